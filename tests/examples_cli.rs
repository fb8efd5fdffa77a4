//! The examples' command lines (`devices`, `vector_add`, `stress`, `graph`, `replay`): `--help` exits 0, an unknown
//! flag is named and exits 2 with the usage, bad numbers exit 2 before anything is allocated
//! (never an abort or a panic), running out of host memory exits 1; and the `devices` report on
//! the emulated driver.
//!
//! The examples are run as programs. `cargo test` builds them (beside the test executables, in
//! `<target>/<profile>/examples/`); `gpu-bundle` stages them in `bin/` beside `tests/`.

use std::path::PathBuf;
use std::process::{Command, Output};

use cudrv_test_support::{
    fake_driver_path, legacy_fake_driver_path, output_retrying_start, start_retrying, testing_oldest_driver, write_temp,
};

/// The path of example `name`, built by `cargo test` (or staged by `gpu-bundle`).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("the test executable is in <dir>/deps/");
    let built = profile_dir.join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if built.is_file() {
        // `cargo test --test examples_cli` alone does not rebuild the examples.
        let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{name}.rs"));
        let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        if let (Some(built_at), Some(edited_at)) = (modified(&built), modified(&source)) {
            assert!(
                built_at >= edited_at,
                "{} is older than {}: run `cargo build --examples`",
                built.display(),
                source.display()
            );
        }
        return built;
    }
    let staged = profile_dir.join("bin").join(name);
    assert!(
        staged.is_file(),
        "the {name} example is not built (looked for {} and {}): run `cargo test`, which builds the examples, \
         or `cargo build --examples` first",
        built.display(),
        staged.display()
    );
    staged
}

/// Runs example `name` with `args`, without a driver.
fn run(name: &str, args: &[&str]) -> Output {
    run_env(name, args, &[])
}

/// Runs example `name` with `args` and `env`.
fn run_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(example(name));
    cmd.args(args).env("CUDRV_DRIVER_PATH", "/no/such/driver/libcuda.so");
    for (k, v) in env {
        cmd.env(k, v);
    }
    output_retrying_start(&mut cmd).unwrap_or_else(|e| panic!("cannot run the {name} example: {e}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Checks the exit status and that stderr contains `needle`; returns stdout and stderr.
#[track_caller]
fn expect(out: &Output, status: i32, needle: &str) -> (String, String) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(status), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in stderr: {stderr}");
    (stdout, stderr)
}

const EXAMPLES: [&str; 4] = ["devices", "vector_add", "stress", "graph"];

#[test]
fn help_prints_the_usage_and_exits_0() {
    for name in EXAMPLES {
        for flag in ["--help", "-h"] {
            let (stdout, stderr) = expect(&run(name, &[flag]), 0, "");
            assert!(stdout.starts_with(&format!("usage: {name}")), "{name} {flag}: {stdout}");
            assert!(stderr.is_empty(), "{name} {flag}: {stderr}");
        }
    }
}

#[test]
fn unknown_flags_are_named_with_the_usage_and_exit_2() {
    for name in EXAMPLES {
        for args in [&["--bogus-flag"][..], &["--bogus-flag", "1"]] {
            let (stdout, stderr) = expect(&run(name, args), 2, "unknown argument --bogus-flag");
            assert!(stderr.contains(&format!("usage: {name}")), "{name}: {stderr}");
            assert!(stdout.is_empty(), "{name}: {stdout}");
        }
    }
    // A flag that takes a value but has none is told apart from an unknown one.
    expect(&run("stress", &["--seconds"]), 2, "--seconds needs a value");
    expect(&run("vector_add", &["1", "2"]), 2, "unexpected argument 2");
}

#[test]
fn bad_numbers_exit_2_before_anything_is_allocated() {
    for (args, needle) in [
        (&["0"][..], "at least 1"),
        (&["many"], "must be a whole number"),
        (&["-5"], "unknown argument -5"),
        (&["18446744073709551615"], "do not fit in memory"),
        (&["99999999999999999999999"], "must be a whole number"),
    ] {
        expect(&run("vector_add", args), 2, needle);
    }
    for (args, needle) in [
        (&["--threads", "0"][..], "--threads 0: must be from 1 to 1024"),
        (&["--threads", "1000000"], "must be from 1 to 1024"),
        (&["--streams", "x"], "--streams x: invalid digit"),
        (&["--max-size", "0"], "--max-size 0: must be from 1"),
        (&["--seconds", "-1"], "0 or more"),
        (&["--seconds", "NaN"], "0 or more"),
        (&["--seconds", "1e300"], "too long"),
        (&["--seed", "-1"], "--seed -1: invalid digit"),
        (&["--resource", "fast"], "expected driver-pool, pool or sync"),
    ] {
        expect(&run("stress", args), 2, needle);
    }
}

#[test]
fn graph_replays_correctly_with_and_without_driver_pools() {
    let fake = fake_driver_path();
    let fake = fake.to_str().expect("a UTF-8 path");
    expect(&run("graph", &["0"]), 2, "REPLAYS must be a whole number of at least 1");
    // CUDA 11.1 predates memory pools: cudrv's pool in every mode.
    let pools = if testing_oldest_driver() { "StreamOrderedPool" } else { "DriverPool" };
    for (mode, resource) in [("linux", pools), ("tcc", "StreamOrderedPool")] {
        let out = run_env("graph", &["40"], &[("CUDRV_DRIVER_PATH", fake), ("CUDRV_FAKE_MODE", mode)]);
        let (stdout, _) = expect(&out, 0, "");
        assert!(stdout.contains(&format!("memory resource {resource}")), "{mode}: {stdout}");
        assert!(stdout.contains("all 65536 elements correct after 40 replays"), "{mode}: {stdout}");
    }
    // Without a driver: an error naming it, status 1.
    expect(&run("graph", &[]), 1, "graph: error:");
}

#[test]
fn vector_add_checks_the_count_against_the_device_and_the_host() {
    let fake = fake_driver_path();
    let fake = fake.to_str().expect("a UTF-8 path");
    // More than the device's memory (16 GiB on the fake): status 2, before any host allocation.
    let out = run_env("vector_add", &["100000000000"], &[("CUDRV_DRIVER_PATH", fake)]);
    expect(&out, 2, "need 1200000000000 bytes of device memory");
    // A device that large, but no host has 2^62 bytes: an error and status 1, not an abort.
    let out = run_env(
        "vector_add",
        &["384307168202282325"],
        &[("CUDRV_DRIVER_PATH", fake), ("CUDRV_FAKE_MEMORY", "4611686018427387904")],
    );
    expect(&out, 1, "out of host memory");
    let out = run_env("vector_add", &["1000"], &[("CUDRV_DRIVER_PATH", fake)]);
    let (stdout, _) = expect(&out, 0, "");
    assert!(stdout.contains("1000 elements") && stdout.contains("all elements correct"), "{stdout}");
    // stress: --max-size larger than the device.
    let out = run_env("stress", &["--max-size", "18446744073709551615"], &[("CUDRV_DRIVER_PATH", fake)]);
    expect(&out, 2, "larger than the memory of device 0");
}

#[test]
fn devices_reports_stream_priorities_the_same_way_in_text_and_json() {
    let fake = fake_driver_path();
    let env = [("CUDRV_DRIVER_PATH", fake.to_str().expect("a UTF-8 path"))];
    let (json, _) = expect(&run_env("devices", &["--json"], &env), 0, "");
    // The fake's range is the H200's: greatest priority -5, least 0.
    assert!(json.contains(r#""stream_priority_range":{"greatest":-5,"least":0}"#), "{json}");
    let (report, _) = expect(&run_env("devices", &[], &env), 0, "");
    assert!(report.contains("-5..=0 (greatest..=least)"), "{report}");
}

#[test]
fn devices_reports_the_launch_memory_and_ipc_capabilities_in_text_and_json() {
    let fake = fake_driver_path();
    let fake = fake.to_str().expect("a UTF-8 path");
    // Windows models (tcc) have no IPC and no concurrent managed access, so no prefetch. Before
    // CUDA 12.0, which has no IPC attribute, the host decides (Linux has IPC) in every mode;
    // CUDA 11.1 has no cuLaunchKernelEx, so no programmatic dependent launch.
    let oldest = testing_oldest_driver();
    let (linux_ipc, tcc_ipc) =
        if oldest { (cfg!(target_os = "linux"), cfg!(target_os = "linux")) } else { (true, false) };
    for (mode, prefetch, ipc) in [("linux", true, linux_ipc), ("tcc", false, tcc_ipc)] {
        let env = [("CUDRV_DRIVER_PATH", fake), ("CUDRV_FAKE_MODE", mode)];
        let (json, _) = expect(&run_env("devices", &["--json"], &env), 0, "");
        for field in [
            format!("\"managed_prefetch\":{prefetch}"),
            format!("\"programmatic_dependent_launch\":{}", !oldest),
            format!("\"cluster_launch\":{}", !oldest),
            format!("\"memory_pools\":{}", mode == "linux" && !oldest),
            "\"mem_sync_domain_count\":4".to_string(),
            format!("\"ipc_events\":{ipc}"),
            format!("\"legacy_ipc\":{ipc}"),
        ] {
            assert!(json.contains(&field), "{mode}: {field} missing in {json}");
        }
        assert!(json.contains("\"max_access_policy_window_size\":"), "{json}");
        let (report, _) = expect(&run_env("devices", &[], &env), 0, "");
        assert!(report.contains("persisting L2 cache"), "{mode}: {report}");
    }
}

/// On the oldest supported driver (CUDA 11.1: no memory pools, no `cuDeviceGetUuid_v2`, none of
/// the newer graph entry points), the examples run through the older entry points and cudrv's pool.
#[test]
fn examples_run_on_a_cuda_11_1_driver() {
    let legacy = legacy_fake_driver_path();
    let env = [("CUDRV_DRIVER_PATH", legacy.to_str().expect("a UTF-8 path"))];
    let (report, _) = expect(&run_env("devices", &[], &env), 0, "");
    assert!(report.contains("11.1"), "{report}");
    assert!(report.contains("StreamOrderedPool"), "{report}");
    let (json, _) = expect(&run_env("devices", &["--json"], &env), 0, "");
    assert!(json.contains("\"memory_pools\":false"), "{json}");
    assert!(json.contains("\"uuid\":\""), "{json}");
    let (stdout, _) = expect(&run_env("vector_add", &["5000"], &env), 0, "");
    assert!(stdout.contains("all elements correct"), "{stdout}");
    let (stdout, _) = expect(&run_env("graph", &["20"], &env), 0, "");
    assert!(stdout.contains("memory resource StreamOrderedPool"), "{stdout}");
    assert!(stdout.contains("all 65536 elements correct after 20 replays"), "{stdout}");
}

#[test]
fn replay_simulates_a_trace_and_reports_memory_and_the_pools_driver_calls() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/resnet50_train.csv");
    let (stdout, _) = expect(&run("replay", &["--simulate", "--memory", "1.10x", trace]), 0, "");
    let summary = stdout.lines().find(|l| l.starts_with("replay: resnet50_train.csv ")).expect("a summary line");
    assert!(summary.contains(" reserved/live=1.") && summary.contains(" peak_live=5518937512 "), "{summary}");
    // Near the budget the pool plans for what the driver keeps back: no driver call fails, so no
    // out-of-memory recovery runs (the simulated device refuses as the driver does; a pool that
    // did not plan for it went through 16 recoveries here).
    let pool = stdout.lines().find(|l| l.trim_start().starts_with("pool ")).expect("the pool's counters");
    assert!(pool.contains(" driver frees, 0 out-of-memory recoveries, "), "{pool}");
}

#[test]
fn replay_in_chunks_gives_the_least_memory_any_placement_in_chunks_needs() {
    // Two live 10.32 MiB tensors need two 12 MiB chunks (2 MiB pages), a 14 KB request a small
    // chunk of 2 MiB: 26 MiB, however they are placed.
    let trace = write_temp("least.csv", b"a,1,10819584,0\na,2,10819584,0\na,3,14088,0\n");
    let (stdout, _) = expect(&run("replay", &["--simulate", "--config", "expandable=false", trace.arg()]), 0, "");
    let line = stdout.lines().find(|l| l.trim_start().starts_with("least in chunks")).expect("the least in chunks");
    assert!(line.contains(" 27262976 bytes (1.2591x the peak live)"), "{line}");
    // Segments are not bound by it: no such line.
    let (stdout, _) = expect(&run("replay", &["--simulate", trace.arg()]), 0, "");
    assert!(!stdout.contains("least in chunks"), "{stdout}");
}

#[test]
fn replay_exits_3_when_a_trace_runs_out_of_memory_and_2_for_bad_input() {
    // 64 MiB live at once on a 48 MiB emulated device: out of memory at the second allocation.
    let big =
        write_temp("big.csv", b"op,id,size,stream\na,1,33554432,0\na,2,33554432,0\nf,1,33554432,0\nf,2,33554432,0\n");
    let (stdout, _) = expect(&run("replay", &["--simulate", "--memory", "48M", big.arg()]), 3, "");
    assert!(stdout.contains("OOM at event 1 "), "{stdout}");
    // A malformed line and a free of an unknown allocation are named by their line.
    let bad = write_temp("bad.csv", b"# recorded by hand\nop,id,size,stream\na,1,512,0\nx,2,512,0\n");
    expect(&run("replay", &["--simulate", bad.arg()]), 2, "line 4");
    let unknown = write_temp("unknown.csv", b"a,1,512,0\nf,7,512,0\n");
    expect(&run("replay", &["--simulate", unknown.arg()]), 2, "line 2");
    expect(&run("replay", &["--simulate", "/no/such/trace.csv"]), 2, "/no/such/trace.csv");
    expect(&run("replay", &["--simulate", "--bogus"]), 2, "unknown flag --bogus");
    expect(&run("replay", &["--simulate", "--memory", "lots", big.arg()]), 2, "--memory");
}

#[test]
fn replay_watch_follows_each_mapping_and_needs_cudrvs_pool() {
    // Two 32 MiB allocations on a 48 MiB emulated device: the first maps, the second cannot.
    let big =
        write_temp("watch.csv", b"op,id,size,stream\na,1,33554432,0\na,2,33554432,0\nf,1,33554432,0\nf,2,33554432,0\n");
    let (stdout, _) = expect(&run("replay", &["--simulate", "--watch", "--memory", "48M", big.arg()]), 3, "");
    let watch: Vec<&str> = stdout.lines().filter(|l| l.starts_with("watch: ")).collect();
    // One line, after event 0: the pool holds the 32 MiB it mapped (the emulated device's
    // granularity is 2 MiB), and the device has the rest of its 48 MiB.
    assert_eq!(watch.len(), 1, "{stdout}");
    let line = watch[0];
    for field in ["event=0 ", " reserved=33554432 ", " in_use=33554432 ", " device_free=16777216 "] {
        assert!(line.contains(field), "{field:?} in {line}");
    }
    // The driver's own pool has no such figures.
    expect(&run("replay", &["--watch", "--resource", "driver-pool", big.arg()]), 2, "--watch follows cudrv's pool");
}

#[test]
fn replay_ends_quietly_when_its_output_is_closed() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    // As `replay ... | head -1`: the reader goes after the first line, and the next write fails
    // with a broken pipe (the Rust runtime ignores SIGPIPE). The replay stops with status 0 and
    // no panic, instead of `println!`'s "failed printing to stdout".
    let traces = concat!(env!("CARGO_MANIFEST_DIR"), "/traces/resnet50_train.csv");
    let mut cmd = Command::new(example("replay"));
    cmd.args(["--simulate", traces, traces, traces])
        .env("CUDRV_DRIVER_PATH", "/no/such/driver/libcuda.so")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = start_retrying(&mut cmd, Command::spawn).expect("the replay example runs");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut first).expect("a first line");
    assert!(first.contains("simulated driver allocs") || first.starts_with("resnet50_train.csv: "), "{first}");
    // The reader is dropped here: stdout is closed.
    let out = child.wait_with_output().expect("the replay ends");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_warning_on_a_closed_stderr_does_not_stop_the_program() {
    use std::io::Read;
    use std::process::Stdio;
    // The driver refuses pool allocations: DriverPool warns once on stderr and switches to
    // StreamOrderedPool. With stderr a pipe whose reader has gone, `eprintln!` panicked there
    // (status 101), as it would in a drop or a driver callback; cudrv's warnings now ignore the
    // broken pipe, and the program goes on.
    let fake = fake_driver_path();
    let mut cmd = Command::new(example("vector_add"));
    cmd.arg("1000")
        .env("CUDRV_DRIVER_PATH", &fake)
        .env("CUDRV_FAKE_FAIL", "cuMemAllocFromPoolAsync:1+:801")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = start_retrying(&mut cmd, Command::spawn).expect("the vector_add example runs");
    drop(child.stderr.take()); // the reader goes before the warning is written
    let mut stdout = String::new();
    child.stdout.take().expect("piped").read_to_string(&mut stdout).expect("stdout");
    let status = child.wait().expect("vector_add ends");
    assert_eq!(status.code(), Some(0), "stdout: {stdout}");
    assert!(stdout.contains("all elements correct"), "{stdout}");
}

//! Test support for cudrv: an emulated CUDA driver, and a runner that executes a test body in a child
//! process loaded with it.
//!
//! # The fake driver
//!
//! `build.rs` compiles `csrc/fake_cuda.c` into `libcuda.so` (`nvcuda.dll` for Windows targets, built
//! with mingw) in this crate's `OUT_DIR`, plus `legacy/libcuda.so` which exports only what CUDA 11.1
//! had (no `cuGetProcAddress`, no memory pools, no `cuLaunchKernelEx`). It exports the driver
//! functions that cudrv uses, under the exact names of the real driver (`cuMemAlloc_v2`, ...), and
//! `cuGetProcAddress`/`cuGetProcAddress_v2` with the real version table. The comment block at the
//! top of `fake_cuda.c` is the full reference; in short:
//!
//! - **Asynchronous streams.** Every stream has a worker thread that runs its operations in order
//!   (`CUDRV_FAKE_DELAY_US` sleeps before each one), so work really runs after the call returns and
//!   ordering bugs show up. The legacy stream synchronises with blocking streams as in the real
//!   driver; events capture stream positions; `cuStreamWaitEvent` orders streams. As in the real
//!   driver, each host thread has its own per-thread default stream (`CU_STREAM_PER_THREAD`) in
//!   each context, with its own worker, released when the thread exits
//!   ([`fake_per_thread_streams`] counts them).
//! - **Driver models.** `CUDRV_FAKE_MODE=linux|wddm|tcc`, or one mode per device with
//!   `CUDRV_FAKE_DEVICES=wddm,tcc`. In `tcc` mode, `MEMORY_POOLS_SUPPORTED` is 0 and every pool entry
//!   point returns `CUDA_ERROR_NOT_SUPPORTED` (801).
//! - **Virtual memory management.** The `cuMemCreate` family (`cuMemAddressReserve`, `cuMemCreate`,
//!   `cuMemMap`, `cuMemSetAccess`, ... at a 2 MiB granularity) works in every mode; the access
//!   checker accepts mapped ranges that the device was given access to. `CUDRV_FAKE_VMM=0` (every
//!   device), or a device entry such as `tcc-novmm` in `CUDRV_FAKE_DEVICES`, takes it away:
//!   `VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` reads 0 and the family returns 801.
//! - **Memory.** Device memory is host memory behind realistic device addresses
//!   (`0x7f0000000000 + device * 2^40`), limited to `CUDRV_FAKE_MEMORY` bytes per device (default
//!   16 GiB). Memory pools cache freed blocks until a sync point finds the reserve above the release
//!   threshold, or until `cuMemPoolTrimTo`.
//! - **Access checking.** Every memset, memcpy and kernel pointer range is checked against the live
//!   allocations when the operation *runs*; a bad range is recorded as a violation and skipped.
//!   `cuMemFree_v2` frees at once, so a still queued operation is caught as a use after free.
//! - **Kernels.** Modules are PTX text; `.entry` names must be built-in kernels: `fill_u32(out,
//!   value: u32, n: u64)`, `add_f32(a, b, out, n: u64)`, `spin_fill_u32(out, value: u32, n: u64,
//!   spin_us: u64)`, `empty()`, `fill_pattern_u8(out, n: u64, seed: u64)` which writes
//!   [`fill_pattern_u8`]`(seed, i)` to `out[i]`.
//! - **Graphs and stream capture** (`csrc/fake_graph.c`). Work queued on a capturing stream becomes
//!   graph nodes (events fork and join streams into the capture, as in the real driver, with its
//!   capture errors); graphs are built node by node, instantiated, launched (nodes run in creation
//!   order on the stream's worker, launches of one executable graph ordered), updated; graph memory
//!   nodes keep one address for the graph's life. [`live_graphs`] and [`live_graph_execs`] count
//!   what is not destroyed.
//! - **Versions.** `CUDRV_FAKE_DRIVER_VERSION` (default 13000) is reported by `cuDriverGetVersion`;
//!   functions introduced later are not served by `cuGetProcAddress`.
//! - **Faults.** `CUDRV_FAKE_FAIL=<function>:<n>[+]:<code>[,...]` makes the n-th call (and with `+`
//!   every later one) of a function return `code`. The function is the exported or the base name.
//! - **Report.** [`fake_report`] gives live allocations, streams, events, modules and the
//!   violations; `CUDRV_FAKE_REPORT_ON_EXIT=1` prints it to stderr when the library unloads.
//! - **Strict configuration.** An invalid value of any of these variables, or an unknown
//!   `CUDRV_FAKE_*` variable, makes `cuInit` return `CUDA_ERROR_INVALID_VALUE` after one line on
//!   stderr that names the variable, its value and what is accepted ([`run_with_fake_output`] shows
//!   a child's stderr). [`CHILD_ENV`] and `CUDRV_FAKE_CFLAGS` (read by the build script) are known.
//!
//! # Tests in a child process
//!
//! A process loads the driver once, and the fake reads its configuration when it is first called, so
//! each configuration needs its own process. [`run_with_fake`] re-runs the current test binary with
//! only the current test selected, with `CUDRV_DRIVER_PATH` pointing at the fake and the given
//! environment, and runs the body there:
//!
//! ```no_run
//! # use cudrv_test_support::*;
//! #[test]
//! fn allocates_in_tcc_mode() {
//!     run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
//!         // runs in the child, with the fake as the driver
//!         assert_no_leaks();
//!     });
//! }
//! ```
//!
//! The test name comes from the name of the test's thread, which libtest sets. Tests must not set
//! environment variables in the parent process; pass them to [`run_with_fake`] instead.
//!
//! # The whole suite on the oldest supported driver
//!
//! `CUDRV_TEST_DRIVER` ([`TEST_DRIVER_ENV`]) chooses the driver that [`fake_driver_path`] names,
//! and so the one every [`run_with_fake`] child loads unless its environment names another:
//! `full` (or unset, or empty) for the fake of CUDA 13.0 ([`full_fake_driver_path`]), `legacy` for
//! the fake of CUDA 11.1 ([`legacy_fake_driver_path`]), the oldest driver cudrv supports. Any other
//! value panics. `CUDRV_TEST_DRIVER=legacy cargo test` runs the whole suite on 11.1:
//!
//! - A test of something that 11.1 lacks (memory pools, `cuGetProcAddress`, `cuLaunchKernelEx` and
//!   so launch attributes and clusters, libraries, ...) asks [`testing_oldest_driver`] in its child
//!   and, when it is true, checks the typed error or the capability that says so, instead of the
//!   feature.
//! - A test of a newer driver (another version emulated with `CUDRV_FAKE_DRIVER_VERSION`, the TCC
//!   interposer over a full driver, the fake's own tests of newer entry points) puts
//!   [`full_fake_driver`] in its environment, so that it tests the same thing whatever the variable
//!   says; tests of the 11.1 build name [`legacy_fake_driver_path`] themselves.
//! - The children inherit the variable; [`fake_driver_version`] is the version the default driver
//!   reports.
//!
//! cudrv's doctests do not read it: with `CUDRV_TEST_LIB_DIR` they run on `<dir>/libcuda.so`.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

use std::cell::RefCell;
use std::ffi::{CStr, c_char, c_int, c_uint};
use std::fmt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Environment variable naming the driver library that cudrv loads.
pub const DRIVER_PATH_ENV: &str = "CUDRV_DRIVER_PATH";
/// Environment variable overriding the directory of the built fake libraries.
pub const LIB_DIR_ENV: &str = "CUDRV_TEST_LIB_DIR";
/// Marker set in the child process: `<test name>#<index of the run_with_fake call>`.
pub const CHILD_ENV: &str = "CUDRV_FAKE_CHILD";
/// Environment variable choosing the fake driver that [`fake_driver_path`] names: `full` (the
/// default, CUDA 13.0) or `legacy` (CUDA 11.1, [`legacy_fake_driver_path`]), to run the whole suite
/// on the oldest supported driver: `CUDRV_TEST_DRIVER=legacy cargo test`.
pub const TEST_DRIVER_ENV: &str = "CUDRV_TEST_DRIVER";

#[cfg(windows)]
const DRIVER_FILE: &str = "nvcuda.dll";
#[cfg(not(windows))]
const DRIVER_FILE: &str = "libcuda.so";
#[cfg(windows)]
const TCC_INTERPOSER_FILE: &str = "cudrv_tcc.dll";
#[cfg(not(windows))]
const TCC_INTERPOSER_FILE: &str = "libcudrv_tcc.so";

/// Whether the fake driver was built (it is not for MSVC targets or without a C compiler).
pub const FAKE_AVAILABLE: bool = !cfg!(fake_unavailable);

/// Directory of the fake libraries: `CUDRV_TEST_LIB_DIR` if set, else this crate's build `OUT_DIR`.
pub fn lib_dir() -> PathBuf {
    match std::env::var_os(LIB_DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(env!("OUT_DIR")),
    }
}

/// Path of the fake driver the tests run on: [`full_fake_driver_path`], or
/// [`legacy_fake_driver_path`] with `CUDRV_TEST_DRIVER=legacy` ([`TEST_DRIVER_ENV`]).
pub fn fake_driver_path() -> PathBuf {
    if testing_oldest_driver() { legacy_fake_driver_path() } else { full_fake_driver_path() }
}

/// Path of the fake driver of CUDA 13.0: `lib_dir()/libcuda.so` (`nvcuda.dll` on Windows), for
/// tests about a newer driver whatever [`TEST_DRIVER_ENV`] says (those that emulate other versions
/// with `CUDRV_FAKE_DRIVER_VERSION`).
pub fn full_fake_driver_path() -> PathBuf {
    lib_dir().join(DRIVER_FILE)
}

/// `(CUDRV_DRIVER_PATH, full_fake_driver_path())`: the entry of a [`run_with_fake`] environment
/// that runs the child on the CUDA 13.0 fake whatever [`TEST_DRIVER_ENV`] says, for tests of a newer
/// driver (versions emulated with `CUDRV_FAKE_DRIVER_VERSION`, the fake's own newer entry points).
pub fn full_fake_driver() -> (&'static str, &'static str) {
    static PATH: OnceLock<String> = OnceLock::new();
    (DRIVER_PATH_ENV, PATH.get_or_init(|| full_fake_driver_path().to_string_lossy().into_owned()))
}

/// Whether the tests run on the CUDA 11.1 fake (`CUDRV_TEST_DRIVER=legacy`): tests of features
/// that 11.1 lacks then check the error that says so. Panics on a value other than `full` or
/// `legacy`. A [`run_with_fake`] child inherits the variable, also one whose environment names
/// another driver: ask this only in children of the default driver.
pub fn testing_oldest_driver() -> bool {
    match std::env::var(TEST_DRIVER_ENV).as_deref() {
        Err(_) | Ok("" | "full") => false,
        Ok("legacy") => true,
        Ok(other) => panic!("{TEST_DRIVER_ENV}={other:?}: expected full or legacy"),
    }
}

/// The driver version that the full fake reports unless `CUDRV_FAKE_DRIVER_VERSION` says
/// otherwise (CUDA 13.0).
pub const FULL_DRIVER_VERSION: i32 = 13000;
/// The driver version that the legacy fake reports (CUDA 11.1), the oldest cudrv supports.
pub const LEGACY_DRIVER_VERSION: i32 = 11010;

/// The version that the driver of [`fake_driver_path`] reports by default:
/// [`LEGACY_DRIVER_VERSION`] when [`testing_oldest_driver`], else [`FULL_DRIVER_VERSION`].
pub fn fake_driver_version() -> i32 {
    if testing_oldest_driver() { LEGACY_DRIVER_VERSION } else { FULL_DRIVER_VERSION }
}

/// Path of the fake driver that exports only the functions of CUDA 11.1 (no `cuGetProcAddress`, no
/// memory pools) and reports driver version 11010: `lib_dir()/legacy/libcuda.so`.
pub fn legacy_fake_driver_path() -> PathBuf {
    lib_dir().join("legacy").join(DRIVER_FILE)
}

/// Path of the TCC interposer (built separately): `lib_dir()/libcudrv_tcc.so`
/// (`cudrv_tcc.dll` on Windows).
pub fn tcc_interposer_path() -> PathBuf {
    lib_dir().join(TCC_INTERPOSER_FILE)
}

/// Whether this process is a child started by [`run_with_fake`].
pub fn in_fake_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// The bytes that the fake kernel `fill_pattern_u8(out, n, seed)` writes: `out[i]` is
/// `fill_pattern_u8(seed, i)`, that is `((seed * 2654435761 + i * 31) >> 3) as u8` in wrapping
/// 64-bit arithmetic.
pub fn fill_pattern_u8(seed: u64, i: u64) -> u8 {
    (seed.wrapping_mul(2_654_435_761).wrapping_add(i.wrapping_mul(31)) >> 3) as u8
}

/// A file in the temporary directory, removed when dropped.
pub struct TempFile(PathBuf);

impl TempFile {
    /// The path, as a string (for a command line).
    pub fn arg(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temporary path")
    }
}

impl AsRef<std::path::Path> for TempFile {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `bytes` to a file named after `name` and this process in the temporary directory (so
/// that test processes running at once do not share it; `name` tells a process's files apart).
pub fn write_temp(name: &str, bytes: &[u8]) -> TempFile {
    let path = std::env::temp_dir().join(format!("cudrv-test-{}-{name}", std::process::id()));
    std::fs::write(&path, bytes).expect("a temporary file");
    TempFile(path)
}

thread_local! {
    /// (test name, number of run_with_fake calls made so far by that test on this thread).
    static CALLS: RefCell<(String, usize)> = const { RefCell::new((String::new(), 0)) };
}

fn current_test_name() -> String {
    let thread = std::thread::current();
    match thread.name() {
        Some(name) if name != "main" => name.to_string(),
        other => panic!(
            "run_with_fake: cannot tell which test is running: the current thread is named {other:?}, \
             not after a test. Call run_with_fake from the test's own thread, and run the tests with \
             libtest's threads (the default; newer toolchains keep a thread per test even with \
             --test-threads=1)."
        ),
    }
}

/// Runs `body` in a child process that uses the fake driver, configured by `env`.
///
/// In the parent, this re-executes the current test binary with
/// `<test name> --exact --nocapture --test-threads=1`, with `CUDRV_DRIVER_PATH` set to
/// [`fake_driver_path`] (unless `env` sets it), the variables of `env`, and `CUDRV_FAKE_CHILD` set
/// to `<test name>#<k>`, `k` being the index of this call within the test. It panics, showing the
/// child's output and the environment, if the child fails or does not run the body; otherwise it
/// prints nothing.
///
/// In the child, only the k-th call runs `body` (the others return at once). After `body` returns,
/// the child panics if the fake recorded access violations. Leaks are checked only where the body
/// calls [`assert_no_leaks`].
pub fn run_with_fake(env: &[(&str, &str)], body: impl FnOnce()) {
    run_with_fake_output(env, body);
}

/// What a child process of [`run_with_fake_output`] printed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChildOutput {
    /// The child's standard output (lossily decoded).
    pub stdout: String,
    /// The child's standard error (lossily decoded): the fake's configuration errors, for example.
    pub stderr: String,
}

/// [`run_with_fake`], returning what the child printed when it succeeded. In a child process it
/// returns `None` (after running `body` if this is the call the child was started for), so that
/// checks of the output run in the parent only:
///
/// ```no_run
/// # use cudrv_test_support::*;
/// if let Some(out) = run_with_fake_output(&[("CUDRV_FAKE_MODE", "bogus")], || {}) {
///     assert!(out.stderr.contains("CUDRV_FAKE_MODE"));
/// }
/// ```
pub fn run_with_fake_output(env: &[(&str, &str)], body: impl FnOnce()) -> Option<ChildOutput> {
    run_in_child(env, true, body)
}

/// Runs `body` in a child process of this test binary (as [`run_with_fake`] does), with the
/// parent's environment and driver, real or emulated: for GPU tests that change what the other
/// threads of their process may do. A stream capture in global mode makes the driver refuse the
/// other threads' allocations and synchronisations, and an invalidated one can leave the process
/// unusable: tests that run beside it in libtest's threads would fail or hang.
pub fn run_in_own_process(body: impl FnOnce()) {
    run_in_child(&[], false, body);
}

/// [`run_with_fake_output`], with the fake driver set (`fake`) or the parent's driver kept.
fn run_in_child(env: &[(&str, &str)], fake: bool, body: impl FnOnce()) -> Option<ChildOutput> {
    let name = current_test_name();
    let k = CALLS.with(|c| {
        let mut c = c.borrow_mut();
        if c.0 != name {
            *c = (name.clone(), 0);
        }
        c.1 += 1;
        c.1 - 1
    });
    let marker = format!("{name}#{k}");

    if let Ok(child_marker) = std::env::var(CHILD_ENV) {
        // In a child: run only the body this child was started for.
        if child_marker == marker {
            body();
            // A body may load something other than the fake (a missing file, a real driver):
            // there is no report to check then.
            let report = if fake_loaded_path().is_some() { fake_report() } else { FakeReport::default() };
            if !report.violations.is_empty() {
                panic!(
                    "the fake driver recorded {} access violation(s):\n  {}",
                    report.violations.len(),
                    report.violations.join("\n  ")
                );
            }
            println!("cudrv-fake-child: body done: {marker}");
        }
        return None;
    }

    if fake && cfg!(fake_unavailable) {
        panic!("the fake CUDA driver was not built for this target (see the build warnings)");
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(&exe);
    // `--include-ignored`: an ignored test run by hand (`-- --ignored`) runs its body there too.
    cmd.args([name.as_str(), "--exact", "--nocapture", "--test-threads=1", "--include-ignored"]);
    let mut shown: Vec<(String, String)> = Vec::new();
    if fake && !env.iter().any(|(k, _)| *k == DRIVER_PATH_ENV) {
        let path = fake_driver_path().to_string_lossy().into_owned();
        shown.push((DRIVER_PATH_ENV.to_string(), path));
    }
    shown.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    shown.push((CHILD_ENV.to_string(), marker.clone()));
    for (k, v) in &shown {
        cmd.env(k, v);
    }
    let out = output_retrying_start(&mut cmd)
        .unwrap_or_else(|e| panic!("run_with_fake: could not start {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let ran = stdout.contains(&format!("cudrv-fake-child: body done: {marker}"));
    if !out.status.success() || !ran {
        let env_text = shown.iter().map(|(k, v)| format!("  {k}={v}")).collect::<Vec<_>>().join("\n");
        panic!(
            "test body {marker} {} in the child process ({})\n\
             environment:\n{env_text}\n\
             ---- child stdout ----\n{stdout}\n---- child stderr ----\n{stderr}",
            if out.status.success() { "did not run" } else { "failed" },
            out.status
        );
    }
    Some(ChildOutput { stdout: stdout.into_owned(), stderr: stderr.into_owned() })
}

/// How many times a process that fails to start is started again (see [`start_retrying`]).
const START_RETRIES: usize = 4;

/// Starts a process with `start` (`Command::output` or `Command::spawn`), again after a pause when
/// it fails to start: Wine has answered `ERROR_INTERNAL_ERROR` (1359) to `CreateProcess` now and
/// then under load. Only the start is retried; what the process does, once it runs, is never
/// retried. Returns the last error when every attempt failed.
pub fn start_retrying<T>(cmd: &mut Command, start: impl Fn(&mut Command) -> std::io::Result<T>) -> std::io::Result<T> {
    let mut started = start(cmd);
    for attempt in 1..=START_RETRIES {
        if started.is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200 * attempt as u64));
        started = start(cmd);
    }
    started
}

/// `cmd.output()`, with a failure to start retried (see [`start_retrying`]).
pub fn output_retrying_start(cmd: &mut Command) -> std::io::Result<std::process::Output> {
    start_retrying(cmd, Command::output)
}

/// Runs `body` once per mode, each in its own child process with `CUDRV_FAKE_MODE=<mode>` and
/// `extra_env` (see [`run_with_fake`]).
pub fn run_with_fake_modes(modes: &[&str], extra_env: &[(&str, &str)], body: impl Fn()) {
    for mode in modes {
        let mut env: Vec<(&str, &str)> = extra_env.to_vec();
        env.push(("CUDRV_FAKE_MODE", mode));
        run_with_fake(&env, &body);
    }
}

/// What the fake driver holds right now (see [`fake_report`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FakeReport {
    /// Live allocations: `cuMemAlloc`, live pool allocations, managed memory and `cuMemHostAlloc`.
    pub live_allocations: u64,
    /// Bytes of those allocations (as requested).
    pub live_bytes: u64,
    /// Streams created and not destroyed.
    pub live_streams: u64,
    /// Events created and not destroyed.
    pub live_events: u64,
    /// Modules loaded and not unloaded.
    pub live_modules: u64,
    /// Access violations recorded since the start (or since [`fake_reset_violations`]).
    pub violations: Vec<String>,
}

impl FakeReport {
    /// Whether nothing is live.
    pub fn is_clean(&self) -> bool {
        self.live_allocations == 0 && self.live_streams == 0 && self.live_events == 0 && self.live_modules == 0
    }
}

impl fmt::Display for FakeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} allocation(s) ({} bytes), {} stream(s), {} event(s), {} module(s) live; {} violation(s)",
            self.live_allocations,
            self.live_bytes,
            self.live_streams,
            self.live_events,
            self.live_modules,
            self.violations.len()
        )?;
        for v in &self.violations {
            write!(f, "\n  {v}")?;
        }
        Ok(())
    }
}

#[repr(C)]
#[derive(Default)]
struct RawReport {
    live_allocations: u64,
    live_bytes: u64,
    live_streams: u64,
    live_events: u64,
    live_modules: u64,
    violation_count: u64,
}

type ReportFn = unsafe extern "C" fn(*mut RawReport) -> c_int;
type ViolationFn = unsafe extern "C" fn(c_uint, *mut c_char, usize) -> c_int;
type VoidFn = unsafe extern "C" fn();

/// The fake driver library of this process, opened once and never unloaded: `CUDRV_DRIVER_PATH`
/// if set (in a [`run_with_fake`] child this is the library that cudrv loaded, so the same instance),
/// else [`fake_driver_path`].
///
/// # Panics
/// If the library cannot be loaded.
pub fn fake_library() -> &'static libloading::Library {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let path = fake_loaded_path().unwrap_or_else(fake_driver_path);
        // SAFETY: loading the fake driver runs no initialisation code with preconditions (its
        // state is initialised statically and on first call). It is kept loaded for the rest of the
        // process, so its worker threads never outlive it.
        unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|e| panic!("cannot load the fake driver {}: {e}", path.display()))
    })
}

/// The fake driver this process uses: `CUDRV_DRIVER_PATH` (or the default fake) when that is the
/// fake, else the driver behind the TCC interposer (`CUDRV_TCC_REAL_DRIVER`) when that is the fake.
/// `None` when neither is (a missing file, a real driver).
pub fn fake_loaded_path() -> Option<PathBuf> {
    let driver = match std::env::var_os(DRIVER_PATH_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => fake_driver_path(),
    };
    let real = std::env::var_os("CUDRV_TCC_REAL_DRIVER").map(PathBuf::from);
    [Some(driver), real].into_iter().flatten().find(|path| {
        // SAFETY: as in `fake_library`; a library that is not the fake is only probed for one
        // symbol and stays loaded (dlopen reference counting), as cudrv loads it anyway.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => {
                // SAFETY: only the symbol's presence is checked.
                let found = unsafe { lib.get::<*const u8>(b"cudrvFakeReport") }.is_ok();
                std::mem::forget(lib);
                found
            }
            Err(_) => false,
        }
    })
}

fn fake_fn<T: Copy>(name: &str) -> T {
    // SAFETY: each caller names a fake-only export and gives its exact C signature as T.
    let sym = unsafe { fake_library().get::<T>(name.as_bytes()) }
        .unwrap_or_else(|e| panic!("the loaded driver has no {name} (is it the fake driver?): {e}"));
    *sym
}

/// Reads the fake driver's report. It first waits until every stream of the fake is idle, so
/// violations of queued work are included.
pub fn fake_report() -> FakeReport {
    let report: ReportFn = fake_fn("cudrvFakeReport");
    let violation: ViolationFn = fake_fn("cudrvFakeViolation");
    let mut raw = RawReport::default();
    // SAFETY: `raw` is a valid, writable CudrvFakeReport (same layout: six uint64_t).
    let rc = unsafe { report(&mut raw) };
    assert_eq!(rc, 0, "cudrvFakeReport failed");
    let mut violations = Vec::new();
    let stored = raw.violation_count.min(4096);
    for i in 0..stored {
        let mut buf = vec![0 as c_char; 1024];
        // SAFETY: `buf` is writable for its whole length, which is passed; the fake writes at most
        // that many bytes, NUL included.
        let rc = unsafe { violation(i as c_uint, buf.as_mut_ptr(), buf.len()) };
        if rc != 0 {
            break;
        }
        // SAFETY: on success the fake wrote a NUL-terminated string into `buf`.
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) };
        violations.push(text.to_string_lossy().into_owned());
    }
    if raw.violation_count > stored {
        violations.push(format!("... and {} more violation(s)", raw.violation_count - stored));
    }
    FakeReport {
        live_allocations: raw.live_allocations,
        live_bytes: raw.live_bytes,
        live_streams: raw.live_streams,
        live_events: raw.live_events,
        live_modules: raw.live_modules,
        violations,
    }
}

/// Panics, listing what leaked, if the fake driver holds any live allocation, stream, event,
/// module, graph or executable graph.
pub fn assert_no_leaks() {
    let report = fake_report();
    if !report.is_clean() {
        panic!("the fake CUDA driver reports leaks: {report}");
    }
    let (graphs, execs) = (live_graphs(), live_graph_execs());
    if graphs != 0 || execs != 0 {
        panic!("the fake CUDA driver reports leaks: {graphs} graph(s), {execs} executable graph(s) live");
    }
}

/// Makes every later driver call return `CUDA_ERROR_DEINITIALIZED` (4), as after process teardown.
pub fn fake_shutdown() {
    let f: VoidFn = fake_fn("cudrvFakeShutdown");
    // SAFETY: cudrvFakeShutdown takes no arguments and only sets a flag under the fake's lock.
    unsafe { f() }
}

/// How many per-thread default streams the fake holds for threads that have not exited yet (one per
/// thread and context that used `CU_STREAM_PER_THREAD`). They are never counted as live streams in
/// [`fake_report`]; a thread's are released when it exits.
pub fn fake_per_thread_streams() -> u64 {
    let f: unsafe extern "C" fn() -> u64 = fake_fn("cudrvFakePerThreadStreams");
    // SAFETY: cudrvFakePerThreadStreams takes no arguments and reads a counter under the fake's lock.
    unsafe { f() }
}

/// How many calls `CUDRV_FAKE_FAIL` has failed so far in this process: whether the faults it names
/// were reached.
pub fn fake_faults_injected() -> u64 {
    let f: unsafe extern "C" fn() -> u64 = fake_fn("cudrvFakeFaultsInjected");
    // SAFETY: cudrvFakeFaultsInjected takes no arguments and reads counters under the fake's lock.
    unsafe { f() }
}

/// How many driver calls were made from inside host functions (`cuLaunchHostFunc` callbacks, run by
/// the fake's stream workers), where the real driver may refuse them or deadlock: 0 unless something
/// called the driver where it must not.
pub fn fake_host_fn_driver_calls() -> u64 {
    let f: unsafe extern "C" fn() -> u64 = fake_fn("cudrvFakeHostFnDriverCalls");
    // SAFETY: cudrvFakeHostFnDriverCalls takes no arguments and reads a counter under the fake's lock.
    unsafe { f() }
}

/// How many CUDA graphs the fake holds: made by `cuGraphCreate`, `cuGraphClone` or a stream capture
/// (ended or not) and not destroyed. [`assert_no_leaks`] checks it is 0.
pub fn live_graphs() -> u64 {
    let f: unsafe extern "C" fn() -> u64 = fake_fn("cudrvFakeLiveGraphs");
    // SAFETY: cudrvFakeLiveGraphs takes no arguments and reads a counter under the fake's lock.
    unsafe { f() }
}

/// How many executable graphs (`cuGraphInstantiate*`) the fake holds, not destroyed.
/// [`assert_no_leaks`] checks it is 0.
pub fn live_graph_execs() -> u64 {
    let f: unsafe extern "C" fn() -> u64 = fake_fn("cudrvFakeLiveGraphExecs");
    // SAFETY: cudrvFakeLiveGraphExecs takes no arguments and reads a counter under the fake's lock.
    unsafe { f() }
}

/// Forgets the violations recorded so far (for tests that provoke them on purpose).
pub fn fake_reset_violations() {
    let f: VoidFn = fake_fn("cudrvFakeResetViolations");
    // SAFETY: cudrvFakeResetViolations takes no arguments and only clears the list under the lock.
    unsafe { f() }
}

/// Whether the TCC interposer ([`tcc_interposer_path`]) was built: Linux (glibc) targets with a C
/// compiler only.
pub const TCC_INTERPOSER_AVAILABLE: bool = !cfg!(tcc_unavailable);

/// Path of the `ProcessPrng` stub that Wine 8 needs to run Rust executables:
/// `lib_dir()/bcryptprimitives.dll`. Built for `windows-gnu` targets only; copy it beside the test
/// executables.
pub fn bcrypt_stub_path() -> PathBuf {
    lib_dir().join("bcryptprimitives.dll")
}

/// `n` pseudo-random words (xorshift64*), for fresh test data without a dependency.
pub fn random_u64s(seed: u64, n: usize) -> Vec<u64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        })
        .collect()
}

/// `n` pseudo-random bytes (the top byte of each [`random_u64s`] word).
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    random_u64s(seed, n).into_iter().map(|w| (w >> 56) as u8).collect()
}

/// A seed that differs from run to run (the clock), so each run checks fresh data.
pub fn time_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::io;
    use std::process::Command;

    use super::{START_RETRIES, start_retrying};

    #[test]
    fn a_start_that_fails_for_a_moment_is_retried_until_it_succeeds() {
        let calls = Cell::new(0);
        let got = start_retrying(&mut Command::new("unused"), |_| {
            calls.set(calls.get() + 1);
            if calls.get() < 3 { Err(io::Error::other("ERROR_INTERNAL_ERROR")) } else { Ok(calls.get()) }
        });
        assert_eq!(got.unwrap(), 3);
        assert_eq!(calls.get(), 3);
    }

    #[test]
    fn a_start_that_keeps_failing_returns_the_last_error_after_the_retries() {
        let calls = Cell::new(0);
        let got: io::Result<()> = start_retrying(&mut Command::new("unused"), |_| {
            calls.set(calls.get() + 1);
            Err(io::Error::other(format!("attempt {}", calls.get())))
        });
        assert_eq!(calls.get(), START_RETRIES + 1);
        assert_eq!(got.unwrap_err().to_string(), format!("attempt {}", START_RETRIES + 1));
    }

    #[test]
    fn a_process_that_ran_and_failed_is_not_started_again() {
        // What the process does is its result: only a failure to start is retried.
        let calls = Cell::new(0);
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.arg("--no-such-flag-for-the-test-harness");
        let out = start_retrying(&mut cmd, |cmd| {
            calls.set(calls.get() + 1);
            cmd.output()
        })
        .unwrap();
        assert!(!out.status.success());
        assert_eq!(calls.get(), 1);
    }
}

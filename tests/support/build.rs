//! Compiles `csrc/fake_cuda.c` into the fake CUDA driver: `$OUT_DIR/libcuda.so` (`nvcuda.dll` for
//! Windows targets) and the CUDA 11.1 variant `$OUT_DIR/legacy/libcuda.so` (`legacy/nvcuda.dll`).
//! Beside them:
//! - on Linux (glibc) targets, `csrc/tcc_interposer.c` into the TCC interposer
//!   `$OUT_DIR/libcudrv_tcc.so` (elsewhere it is skipped and `cfg(tcc_unavailable)` is set);
//! - on `windows-gnu` targets, `csrc/bcryptprimitives.c` into `$OUT_DIR/bcryptprimitives.dll`, the
//!   `ProcessPrng` stub that Rust's std needs under Wine 8.
//!
//! The compiler is the one the `cc` crate picks for the target, invoked directly (a shared library
//! is needed, which `cc::Build::compile` does not make). Where no usable compiler exists (MSVC
//! targets, or no C compiler at all), the build still succeeds: it prints a warning and sets
//! `cfg(fake_unavailable)`.

use std::env;
use std::path::{Path, PathBuf};

const SOURCE: &str = "csrc/fake_cuda.c";
const TCC_SOURCE: &str = "csrc/tcc_interposer.c";
const BCRYPT_SOURCE: &str = "csrc/bcryptprimitives.c";
/// CUDA version whose exports the legacy variant is limited to.
const LEGACY_VERSION: u32 = 11010;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(fake_unavailable)");
    println!("cargo::rustc-check-cfg=cfg(tcc_unavailable)");
    println!("cargo::rerun-if-changed={SOURCE}");
    println!("cargo::rerun-if-changed=csrc/fake_graph.c"); // #included by fake_cuda.c
    println!("cargo::rerun-if-changed={TCC_SOURCE}");
    println!("cargo::rerun-if-changed={BCRYPT_SOURCE}");
    println!("cargo::rerun-if-changed=build.rs");
    let target = env::var("TARGET").unwrap_or_default();
    for var in [
        "CC".to_string(),
        "TARGET_CC".to_string(),
        "CFLAGS".to_string(),
        "TARGET_CFLAGS".to_string(),
        format!("CC_{target}"),
        format!("CC_{}", target.replace('-', "_")),
        format!("CFLAGS_{target}"),
        format!("CFLAGS_{}", target.replace('-', "_")),
        "CUDRV_FAKE_CFLAGS".to_string(),
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }

    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_env = env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let windows = target_os == "windows";
    let file_name = if windows { "nvcuda.dll" } else { "libcuda.so" };

    if !(target_os == "linux" && target_env == "gnu") {
        println!("cargo::rustc-cfg=tcc_unavailable");
    }
    if target_env == "msvc" {
        unavailable(
            "MSVC targets cannot build the fake driver (it needs a GCC-compatible compiler; use x86_64-pc-windows-gnu)",
        );
        return;
    }
    let compiler = match cc::Build::new().cargo_metadata(false).cargo_warnings(false).try_get_compiler() {
        Ok(c) => c,
        Err(e) => {
            unavailable(&format!("no C compiler for {target}: {e}"));
            return;
        }
    };

    let legacy_dir = out_dir.join("legacy");
    std::fs::create_dir_all(&legacy_dir).expect("create OUT_DIR/legacy");
    let variants = [(out_dir.join(file_name), None), (legacy_dir.join(file_name), Some(LEGACY_VERSION))];
    for (output, legacy) in variants {
        let mut cmd = compiler.to_command();
        cmd.args(["-std=c11", "-O2", "-Wall", "-Wextra", "-shared"]);
        if windows {
            cmd.args(["-static-libgcc", "-D__USE_MINGW_ANSI_STDIO=1"]);
        } else {
            cmd.args(["-fPIC", "-pthread", "-fvisibility=hidden"]);
        }
        if let Some(v) = legacy {
            cmd.arg(format!("-DCUDRV_FAKE_LEGACY_EXPORTS={v}"));
        }
        if let Ok(extra) = env::var("CUDRV_FAKE_CFLAGS") {
            cmd.args(extra.split_whitespace());
        }
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(SOURCE));
        cmd.arg("-o").arg(&output);
        if !windows {
            cmd.arg("-pthread");
        }
        match cmd.output() {
            Err(e) => {
                unavailable(&format!("could not run the C compiler {:?}: {e}", compiler.path()));
                return;
            }
            Ok(out) => {
                let stderr = String::from_utf8_lossy(&out.stderr);
                if !out.status.success() {
                    panic!("compiling the fake CUDA driver failed ({cmd:?}):\n{stderr}");
                }
                for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
                    println!("cargo::warning=fake_cuda.c: {line}");
                }
            }
        }
    }

    if target_os == "linux" && target_env == "gnu" {
        build_tcc_interposer(&compiler, &out_dir);
    }
    if windows && target_env == "gnu" {
        build_bcrypt_stub(&compiler, &out_dir);
    }
}

fn unavailable(why: &str) {
    println!("cargo::warning=cudrv-test-support: the fake CUDA driver is not built: {why}");
    println!("cargo::rustc-cfg=fake_unavailable");
    // Nothing else is built without a compiler either.
    println!("cargo::rustc-cfg=tcc_unavailable");
}

/// Runs a compiler command that builds `what`, forwarding its warnings; panics if it fails (the
/// compiler itself was found, so a failure is a bug in the source).
fn compile(mut cmd: std::process::Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("could not run the C compiler for {what} ({cmd:?}): {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        panic!("compiling {what} failed ({cmd:?}):\n{stderr}");
    }
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo::warning={what}: {line}");
    }
}

/// The TCC interposer: `$OUT_DIR/libcudrv_tcc.so`, Linux (glibc) only, as it is made of GNU
/// indirect functions.
fn build_tcc_interposer(compiler: &cc::Tool, out_dir: &Path) {
    let mut cmd = compiler.to_command();
    cmd.args(["-std=c11", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden"]);
    cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(TCC_SOURCE));
    cmd.arg("-o").arg(out_dir.join("libcudrv_tcc.so"));
    cmd.args(["-ldl", "-pthread"]);
    compile(cmd, "tcc_interposer.c");
}

/// The `ProcessPrng` stub for Wine: `$OUT_DIR/bcryptprimitives.dll`, for `windows-gnu` targets.
fn build_bcrypt_stub(compiler: &cc::Tool, out_dir: &Path) {
    let mut cmd = compiler.to_command();
    cmd.args(["-std=c11", "-O2", "-Wall", "-Wextra", "-shared", "-static-libgcc"]);
    cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(BCRYPT_SOURCE));
    cmd.arg("-o").arg(out_dir.join("bcryptprimitives.dll"));
    cmd.arg("-ladvapi32");
    compile(cmd, "bcryptprimitives.c");
}

//! A kernel launch: adds two random `f32` vectors on the GPU and checks every element.
//!
//! ```text
//! cargo run --example vector_add            # on the GPU
//! cargo run --example vector_add -- 1000    # with 1000 elements (default 1 << 20)
//! ```
//!
//! The kernel is `add_f32` in `examples/kernels/vector_add.ptx`, hand-written PTX that the driver
//! JIT-compiles for the device. It also runs on cudrv's emulated driver
//! (`CUDRV_DRIVER_PATH=<.../libcuda.so of cudrv-test-support> cargo run --example vector_add`).
//! Exits with status 1 when an element is wrong, when there is no driver or when memory runs out,
//! and with status 2 for bad arguments (an element count that is not a number, is 0, or needs
//! more memory than the device has), before anything is allocated.

use std::collections::TryReserveError;
use std::process::ExitCode;

use cudrv::memory::DeviceBuffer;
use cudrv::{Device, LaunchConfig, Module, Stream};

const PTX: &str = include_str!("kernels/vector_add.ptx");
const DEFAULT_COUNT: usize = 1 << 20;
const USAGE: &str = "\
usage: vector_add [N]
  N           how many f32 elements to add (default 1048576)
  -h, --help  print this help";

/// Why `run` stops early: a count that does not suit the device (status 2) or a failure
/// (status 1).
enum Stop {
    BadArgument(String),
    Failed(String),
}

impl From<cudrv::Error> for Stop {
    fn from(e: cudrv::Error) -> Stop {
        Stop::Failed(e.to_string())
    }
}

fn main() -> ExitCode {
    let n = match parse_args(std::env::args().skip(1)) {
        Ok(Some(n)) => n,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("vector_add: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(n) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(Stop::BadArgument(message)) => {
            eprintln!("vector_add: {message}");
            ExitCode::from(2)
        }
        Err(Stop::Failed(message)) => {
            eprintln!("vector_add: error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The element count, or `None` for `--help`. Errors are messages for bad arguments.
fn parse_args(args: impl Iterator<Item = String>) -> Result<Option<usize>, String> {
    let mut n = None;
    for arg in args {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            flag if flag.starts_with('-') => return Err(format!("unknown argument {flag}")),
            _ if n.is_some() => return Err(format!("unexpected argument {arg}: give one count")),
            count => {
                let parsed = count
                    .parse::<usize>()
                    .map_err(|e| format!("the element count must be a whole number: {count}: {e}"))?;
                if parsed == 0 {
                    return Err("the element count must be at least 1".into());
                }
                n = Some(parsed);
            }
        }
    }
    let n = n.unwrap_or(DEFAULT_COUNT);
    // Three vectors of n f32 each, on the host and on the device.
    if n.checked_mul(3 * size_of::<f32>()).is_none() {
        return Err(format!("{n} elements do not fit in memory: 3 vectors of them need more than 2^64 bytes"));
    }
    Ok(Some(n))
}

/// An empty vector with room for `n` elements, or the allocator's refusal (never an abort).
fn host_vec(n: usize) -> Result<Vec<f32>, Stop> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e: TryReserveError| {
        Stop::Failed(format!("out of host memory for {n} elements ({} bytes): {e}", n * size_of::<f32>()))
    })?;
    Ok(v)
}

/// Fills `v` (empty, with room for `n`) with random floats in [-1000, 1000), by xorshift64*
/// (no dependency needed).
fn fill_random(v: &mut Vec<f32>, seed: u64, n: usize) {
    let mut x = seed | 1;
    v.extend((0..n).map(|_| {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let bits = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 random bits
        (bits as f32 / (1u64 << 24) as f32) * 2000.0 - 1000.0
    }));
}

fn run(n: usize) -> Result<bool, Stop> {
    let device = Device::get(0)?;
    println!("device 0: {}", device.name()?);
    let (bytes, total) = (3 * n * size_of::<f32>(), device.total_memory()?);
    if bytes > total {
        return Err(Stop::BadArgument(format!(
            "{n} elements need {bytes} bytes of device memory (3 vectors), and device 0 has {total} bytes"
        )));
    }
    // All host memory first, so that running out of it stops the program before any GPU work.
    let (mut a, mut b, mut out) = (host_vec(n)?, host_vec(n)?, host_vec(n)?);
    let module = Module::from_ptx(&device, PTX)?;
    let add = module.function("add_f32")?;
    let stream = Stream::new(&device)?;

    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    fill_random(&mut a, seed, n);
    fill_random(&mut b, seed.wrapping_add(0x9E37_79B9_7F4A_7C15), n);
    let da = DeviceBuffer::from_slice(&a, &stream)?;
    let db = DeviceBuffer::from_slice(&b, &stream)?;
    let mut dout = DeviceBuffer::<f32>::zeroed(n, &stream)?;

    let cfg = LaunchConfig::for_num_elems(n);
    // SAFETY: add_f32 takes (const float *a, const float *b, float *out, size_t n) and touches
    // elements 0..n of each; all three buffers have n elements and are used on `stream` only.
    unsafe { add.launch(cfg, &stream, (&da, &db, &mut dout, n as u64))? };
    out.resize(n, 0.0);
    dout.copy_to_host(&mut out)?;

    let mut wrong = 0usize;
    for (i, ((x, y), z)) in a.iter().zip(&b).zip(&out).enumerate() {
        if (x + y).to_bits() != z.to_bits() {
            if wrong < 5 {
                eprintln!("element {i}: {x} + {y} should be {}, the GPU gave {z}", x + y);
            }
            wrong += 1;
        }
    }
    println!(
        "add_f32: {n} elements, grid {:?} x block {:?}: {}",
        cfg.grid,
        cfg.block,
        if wrong == 0 { "all elements correct".to_string() } else { format!("{wrong} elements WRONG") }
    );
    Ok(wrong == 0)
}

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
//! Exits with status 1 when an element is wrong or when there is no driver.

use std::process::ExitCode;

use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Error, LaunchConfig, Module, Stream};

const PTX: &str = include_str!("kernels/vector_add.ptx");

fn main() -> ExitCode {
    let n = match std::env::args().nth(1).map(|a| a.parse::<usize>()) {
        None => 1 << 20,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("error: the element count must be a number: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(n) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// xorshift64*: random floats in [-1000, 1000) without a dependency.
fn random_f32(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let bits = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 random bits
            (bits as f32 / (1u64 << 24) as f32) * 2000.0 - 1000.0
        })
        .collect()
}

fn run(n: usize) -> Result<bool, Error> {
    let device = Device::get(0)?;
    println!("device 0: {}", device.name()?);
    let module = Module::from_ptx(&device, PTX)?;
    let add = module.function("add_f32")?;
    let stream = Stream::new(&device)?;

    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    let a = random_f32(seed, n);
    let b = random_f32(seed.wrapping_add(0x9E37_79B9_7F4A_7C15), n);
    let da = DeviceBuffer::from_slice(&a, &stream)?;
    let db = DeviceBuffer::from_slice(&b, &stream)?;
    let mut dout = DeviceBuffer::<f32>::zeroed(n, &stream)?;

    let cfg = LaunchConfig::for_num_elems(n);
    // SAFETY: add_f32 takes (const float *a, const float *b, float *out, size_t n) and touches
    // elements 0..n of each; all three buffers have n elements and are used on `stream` only.
    unsafe { add.launch(cfg, &stream, (&da, &db, &mut dout, n as u64))? };
    let out = dout.to_vec()?;

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

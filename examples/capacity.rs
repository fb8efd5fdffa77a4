//! How much of a device's memory a memory resource can hand out: fills the device with buffers
//! until it is out of memory, first with 1 GiB buffers, then (after freeing them) with mixed sizes
//! from 1 MiB to 4 GiB, and prints the bytes reached.
//!
//! ```text
//! cargo run --release --features gpu --example capacity -- [--resource driver-pool|pool|sync] [--device N] [--seed S]
//! ```
//!
//! Run it natively with `--resource driver-pool` and through the TCC interposer with the default
//! (`StreamOrderedPool`) to compare what the fallback pool reaches with the driver's pool. Each
//! phase ends with a line `capacity: <phase> <resource> reached=<bytes> buffers=<n>`.

use std::process::ExitCode;
use std::sync::Arc;

use cudrv::memory::{DeviceBuffer, DriverPool, MemoryResource, StreamOrderedPool, SyncResource};
use cudrv::{Device, Stream};

const USAGE: &str = "usage: capacity [--resource driver-pool|pool|sync] [--device N] [--seed S]";

fn main() -> ExitCode {
    let mut resource = None;
    let mut device = 0usize;
    let mut seed = 1u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let parsed: Result<(), String> = match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "--resource" => value("--resource").and_then(|v| {
                if ["driver-pool", "pool", "sync"].contains(&v.as_str()) {
                    resource = Some(v);
                    Ok(())
                } else {
                    Err(format!("--resource {v:?}: expected driver-pool, pool or sync"))
                }
            }),
            "--device" => value("--device")
                .and_then(|v| v.parse().map(|d| device = d).map_err(|_| format!("--device {v:?}: expected a number"))),
            "--seed" => value("--seed")
                .and_then(|v| v.parse().map(|s| seed = s).map_err(|_| format!("--seed {v:?}: expected a number"))),
            other => Err(format!("unknown argument {other}")),
        };
        if let Err(e) = parsed {
            eprintln!("capacity: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    match run(resource.as_deref(), device, seed) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("capacity: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(which: Option<&str>, device: usize, seed: u64) -> Result<(), cudrv::Error> {
    let dev = Device::get(device)?;
    let r: Arc<dyn MemoryResource> = match which {
        None => dev.memory_resource()?,
        Some("driver-pool") => Arc::new(DriverPool::default_pool(&dev)?),
        Some("pool") => Arc::new(StreamOrderedPool::new(&dev)?),
        Some(_) => Arc::new(SyncResource::new(&dev)?),
    };
    let s = Stream::new(&dev)?;
    println!("device {device}: {} bytes in total, through {}", dev.total_memory()?, r.kind());
    const GIB: usize = 1 << 30;
    // Phase 1: 1 GiB buffers until out of memory.
    let mut held = Vec::new();
    loop {
        match DeviceBuffer::<u8>::zeroed_in(GIB, &s, r.clone()) {
            Ok(b) => held.push(b),
            Err(e) if e.is_out_of_memory() => break,
            Err(e) => return Err(e),
        }
    }
    s.synchronize()?;
    let reached: usize = held.iter().map(|b| b.len()).sum();
    println!("capacity: 1GiB {} reached={reached} buffers={}", r.kind(), held.len());
    drop(held);
    s.synchronize()?;
    r.trim(0)?;
    // Phase 2: mixed sizes, log-uniform in 1 MiB..4 GiB; an out-of-memory request is skipped, and
    // the phase ends after 32 in a row, or when 1 MiB does not fit.
    let mut rng = seed | 1;
    let mut held = Vec::new();
    let mut misses = 0;
    while misses < 32 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let exp = 20.0 + (rng % 10_000) as f64 / 10_000.0 * 12.0; // 2^20 .. 2^32
        let n = (2f64.powf(exp) as usize).clamp(1 << 20, 4 * GIB);
        match DeviceBuffer::<u8>::zeroed_in(n, &s, r.clone()) {
            Ok(b) => {
                held.push(b);
                misses = 0;
            }
            Err(e) if e.is_out_of_memory() => {
                misses += 1;
                if DeviceBuffer::<u8>::zeroed_in(1 << 20, &s, r.clone()).map(|b| held.push(b)).is_err() {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    s.synchronize()?;
    let reached: usize = held.iter().map(|b| b.len()).sum();
    println!("capacity: mixed {} reached={reached} buffers={}", r.kind(), held.len());
    drop(held);
    s.synchronize()?;
    r.trim(0)?;
    Ok(())
}

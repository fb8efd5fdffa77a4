//! Launch benchmark: cudrv's `Function::launch` against the raw `cuLaunchKernel`, in one run.
//!
//! ```text
//! cargo bench --features gpu --bench launch              # needs a GPU
//! cargo bench --features gpu --bench launch -- --quick   # 10x fewer launches
//! ```
//!
//! 1. enqueue cost of the `empty` kernel, through cudrv and through `Driver::cuLaunchKernel` with
//!    the same function handle and stream: launches in bursts of 256, only the launches timed, the
//!    stream drained between bursts (so the launch queue never fills and the figure is the host's
//!    cost), interleaved in rounds (the order alternates);
//! 2. the same with `add_f32` and four arguments (three buffers and a length), which adds cudrv's
//!    argument marshalling and buffer-use recording;
//! 3. a launch and `cuStreamSynchronize` round trip.
//!
//! Figures are medians over rounds, printed as a markdown table with the ratio cudrv / raw (the
//! target for enqueueing is at most 1.05). Without a driver it prints the error and exits 0 (CI
//! builds benches but has no GPU).

use std::ffi::c_void;
use std::time::Instant;

use cudrv::memory::DeviceBuffer;
use cudrv::sys::{CUresult, Driver, MissingSymbol};
use cudrv::{Device, LaunchConfig, Module, Stream};

const PTX: &str = include_str!("../examples/kernels/vector_add.ptx");

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("launch bench: {e}");
    }
}

fn ok(rc: Result<CUresult, MissingSymbol>, what: &str) -> Res<()> {
    match rc? {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(format!("{what} failed with {}", code.0).into()),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// Runs `raw` and `cudrv` (each: `count` operations, returning the elapsed seconds) `rounds` times,
/// alternating which goes first, and returns the medians in nanoseconds per operation.
fn compare(
    rounds: usize,
    count: usize,
    mut raw: impl FnMut(usize) -> Res<f64>,
    mut cudrv: impl FnMut(usize) -> Res<f64>,
) -> Res<(f64, f64)> {
    // Warm up both paths (symbol resolution, driver caches).
    raw(count / 10 + 1)?;
    cudrv(count / 10 + 1)?;
    let (mut r, mut c) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            r.push(raw(count)? * 1e9 / count as f64);
            c.push(cudrv(count)? * 1e9 / count as f64);
        } else {
            c.push(cudrv(count)? * 1e9 / count as f64);
            r.push(raw(count)? * 1e9 / count as f64);
        }
    }
    Ok((median(r), median(c)))
}

/// Launches per timed burst: well below the driver's launch queue depth.
const BURST: usize = 256;

/// Runs `count` launches in bursts of [`BURST`], timing only the launches: the stream is drained
/// between bursts (untimed), so the driver's launch queue never fills and the figure is the host's
/// cost of queueing a launch, not the GPU's rate of running them. Returns the seconds spent
/// launching.
fn bursts(count: usize, stream: &Stream, mut launch: impl FnMut() -> Res<()>) -> Res<f64> {
    let mut spent = 0.0;
    let mut left = count;
    while left > 0 {
        let burst = left.min(BURST);
        let t = Instant::now();
        for _ in 0..burst {
            launch()?;
        }
        spent += t.elapsed().as_secs_f64();
        stream.synchronize()?;
        left -= burst;
    }
    Ok(spent)
}

fn run() -> Res<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (rounds, launches, trips) = if quick { (6, 20_000, 1_000) } else { (10, 20_000 * 10, 10_000) };
    let launches_per_round = launches / rounds;
    let trips_per_round = trips / rounds;

    let dev = Device::get(0)?;
    let d = Driver::global()?;
    let module = Module::from_ptx(&dev, PTX)?;
    let empty = module.function("empty")?;
    let add = module.function("add_f32")?;
    let stream = Stream::new(&dev)?;
    let ctx = dev.primary_context()?;
    let _bound = ctx.bind()?; // the raw calls need the context current; cudrv binds it itself
    let s = stream.as_raw();
    let one = LaunchConfig::linear(1, 1);

    println!(
        "# launch benchmark: {} (driver {}.{}), {rounds} rounds, medians",
        dev.name()?,
        d.version() / 1000,
        d.version() % 1000 / 10
    );
    println!();

    // 1. enqueue `empty`.
    let raw_f = empty.as_raw();
    let (raw_empty, cudrv_empty) = compare(
        rounds,
        launches_per_round,
        |count| {
            bursts(count, &stream, || {
                // SAFETY: `empty` takes no parameters; the stream and function belong to the
                // current context.
                ok(
                    unsafe {
                        d.cuLaunchKernel(raw_f, 1, 1, 1, 1, 1, 1, 0, s, std::ptr::null_mut(), std::ptr::null_mut())
                    },
                    "cuLaunchKernel",
                )
            })
        },
        |count| {
            bursts(count, &stream, || {
                // SAFETY: `empty` takes no parameters.
                unsafe { empty.launch(one, &stream, ()) }.map_err(Into::into)
            })
        },
    )?;

    // 2. enqueue `add_f32` with four arguments.
    let n = 1024usize;
    let a = DeviceBuffer::from_slice(&vec![1.0f32; n], &stream)?;
    let b = DeviceBuffer::from_slice(&vec![2.0f32; n], &stream)?;
    let mut c = DeviceBuffer::<f32>::zeroed(n, &stream)?;
    let cfg = LaunchConfig::for_num_elems(n);
    let raw_add = add.as_raw();
    let (pa, pb, pc) = (a.as_raw(), b.as_raw(), c.as_raw());
    let (raw_add_ns, cudrv_add_ns) = compare(
        rounds,
        launches_per_round / 4,
        |count| {
            bursts(count, &stream, || {
                let len = n as u64;
                let mut params: [*mut c_void; 4] = [
                    (&raw const pa).cast_mut().cast(),
                    (&raw const pb).cast_mut().cast(),
                    (&raw const pc).cast_mut().cast(),
                    (&raw const len).cast_mut().cast(),
                ];
                // SAFETY: add_f32's four parameters, each pointing at a live value; the buffers
                // have n elements and belong to the current context.
                ok(
                    unsafe {
                        d.cuLaunchKernel(raw_add, 4, 1, 1, 256, 1, 1, 0, s, params.as_mut_ptr(), std::ptr::null_mut())
                    },
                    "cuLaunchKernel",
                )
            })
        },
        |count| {
            bursts(count, &stream, || {
                // SAFETY: add_f32(const float*, const float*, float*, size_t) on n elements.
                unsafe { add.launch(cfg, &stream, (&a, &b, &mut c, n as u64)) }.map_err(Into::into)
            })
        },
    )?;

    // 3. launch + synchronise.
    let (raw_trip, cudrv_trip) = compare(
        rounds,
        trips_per_round,
        |count| {
            let t = Instant::now();
            for _ in 0..count {
                // SAFETY: as in 1.
                ok(
                    unsafe {
                        d.cuLaunchKernel(raw_f, 1, 1, 1, 1, 1, 1, 0, s, std::ptr::null_mut(), std::ptr::null_mut())
                    },
                    "cuLaunchKernel",
                )?;
                // SAFETY: a live stream of the current context.
                ok(unsafe { d.cuStreamSynchronize(s) }, "cuStreamSynchronize")?;
            }
            Ok(t.elapsed().as_secs_f64())
        },
        |count| {
            let t = Instant::now();
            for _ in 0..count {
                // SAFETY: `empty` takes no parameters.
                unsafe { empty.launch(one, &stream, ())? };
                stream.synchronize()?;
            }
            Ok(t.elapsed().as_secs_f64())
        },
    )?;

    println!("| measure | raw driver | cudrv | cudrv / raw |");
    println!("|---|---:|---:|---:|");
    println!(
        "| enqueue `empty` ({launches} launches each) | {raw_empty:.0} ns | {cudrv_empty:.0} ns | {:.3} |",
        cudrv_empty / raw_empty
    );
    println!(
        "| enqueue `add_f32`, 3 buffers + length ({} launches each) | {raw_add_ns:.0} ns | {cudrv_add_ns:.0} ns | {:.3} |",
        launches / 4,
        cudrv_add_ns / raw_add_ns
    );
    println!(
        "| launch `empty` + synchronize ({trips} each) | {:.2} µs | {:.2} µs | {:.3} |",
        raw_trip / 1e3,
        cudrv_trip / 1e3,
        cudrv_trip / raw_trip
    );
    let ratio = cudrv_empty / raw_empty;
    println!();
    println!(
        "enqueue target (cudrv <= 1.05x raw): {}",
        if ratio <= 1.05 { format!("met ({ratio:.3}x)") } else { format!("NOT met ({ratio:.3}x)") }
    );
    Ok(())
}

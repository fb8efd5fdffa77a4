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
//! 3. a launch and `cuStreamSynchronize` round trip;
//! 4. graphs: 100 `add_f32` launches captured once, then `GraphExec::launch` against
//!    `cuGraphLaunch` of the same work captured with raw calls (enqueue only, in bursts), and the
//!    round trip (100 launches one by one + synchronize, against one graph launch + synchronize).
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
    // `add_f32(a, b, c, n)` through the raw driver, on the current context's `stream`.
    let raw_add_launch = || {
        let len = n as u64;
        let mut params: [*mut c_void; 4] = [
            (&raw const pa).cast_mut().cast(),
            (&raw const pb).cast_mut().cast(),
            (&raw const pc).cast_mut().cast(),
            (&raw const len).cast_mut().cast(),
        ];
        // SAFETY: add_f32's four parameters, each pointing at a live value; the buffers have n
        // elements and belong to the current context. (Captured, the arguments are copied now.)
        ok(
            unsafe { d.cuLaunchKernel(raw_add, 4, 1, 1, 256, 1, 1, 0, s, params.as_mut_ptr(), std::ptr::null_mut()) },
            "cuLaunchKernel",
        )
    };
    let (raw_add_ns, cudrv_add_ns) = compare(
        rounds,
        launches_per_round / 4,
        |count| bursts(count, &stream, raw_add_launch),
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

    // 4. graphs: 100 `add_f32` launches, one by one or as one captured graph.
    let kernels = 100;
    let graph_rounds = if quick { 200 } else { 2_000 } / rounds;
    let raw_graph = {
        let mut g = std::ptr::null_mut();
        let mut exec = std::ptr::null_mut();
        // SAFETY: a live stream of the current context, not capturing; global mode.
        ok(
            unsafe { d.cuStreamBeginCapture_v2(s, cudrv::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) },
            "cuStreamBeginCapture",
        )?;
        for _ in 0..kernels {
            raw_add_launch()?;
        }
        // SAFETY: the capture begun above; valid out-pointers.
        ok(unsafe { d.cuStreamEndCapture(s, &mut g) }, "cuStreamEndCapture")?;
        // SAFETY: a valid graph; a valid out-pointer.
        ok(unsafe { d.cuGraphInstantiateWithFlags(&mut exec, g, 0) }, "cuGraphInstantiateWithFlags")?;
        (g, exec)
    };
    stream.begin_capture(cudrv::graph::CaptureMode::Global)?;
    for _ in 0..kernels {
        // SAFETY: add_f32(const float*, const float*, float*, size_t) on n elements; the buffers
        // outlive the graph.
        unsafe { add.launch(cfg, &stream, (&a, &b, &mut c, n as u64))? };
    }
    let graph = stream.end_capture()?;
    let exec = graph.instantiate()?;
    let (raw_graph_enqueue, cudrv_graph_enqueue) = compare(
        rounds,
        graph_rounds,
        |count| {
            bursts(count, &stream, || {
                // SAFETY: a valid executable graph and stream of the current context.
                ok(unsafe { d.cuGraphLaunch(raw_graph.1, s) }, "cuGraphLaunch")
            })
        },
        |count| bursts(count, &stream, || exec.launch(&stream).map_err(Into::into)),
    )?;
    let c2 = std::cell::RefCell::new(DeviceBuffer::<f32>::zeroed(n, &stream)?);
    let one_by_one = |count: usize, cudrv_path: bool| -> Res<f64> {
        let t = Instant::now();
        for _ in 0..count {
            for _ in 0..kernels {
                if cudrv_path {
                    // SAFETY: as in 2.
                    unsafe { add.launch(cfg, &stream, (&a, &b, &mut *c2.borrow_mut(), n as u64))? };
                } else {
                    raw_add_launch()?;
                }
            }
            stream.synchronize()?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let as_graph = |count: usize, cudrv_path: bool| -> Res<f64> {
        let t = Instant::now();
        for _ in 0..count {
            if cudrv_path {
                exec.launch(&stream)?;
            } else {
                // SAFETY: as above.
                ok(unsafe { d.cuGraphLaunch(raw_graph.1, s) }, "cuGraphLaunch")?;
            }
            stream.synchronize()?;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let trip_rounds = (graph_rounds / 4).max(1);
    let (raw_single, cudrv_single) = compare(rounds, trip_rounds, |n| one_by_one(n, false), |n| one_by_one(n, true))?;
    let (raw_graph_trip, cudrv_graph_trip) =
        compare(rounds, trip_rounds, |n| as_graph(n, false), |n| as_graph(n, true))?;
    drop((exec, graph));
    // SAFETY: made above, destroyed once; no launch of them is pending (the stream was synchronised).
    unsafe {
        ok(d.cuGraphExecDestroy(raw_graph.1), "cuGraphExecDestroy")?;
        ok(d.cuGraphDestroy(raw_graph.0), "cuGraphDestroy")?;
    }

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
    println!(
        "| enqueue a graph of {kernels} `add_f32` (`cuGraphLaunch`) | {raw_graph_enqueue:.0} ns | {cudrv_graph_enqueue:.0} ns | {:.3} |",
        cudrv_graph_enqueue / raw_graph_enqueue
    );
    println!(
        "| {kernels} `add_f32` one by one + synchronize | {:.2} µs | {:.2} µs | {:.3} |",
        raw_single / 1e3,
        cudrv_single / 1e3,
        cudrv_single / raw_single
    );
    println!(
        "| the same {kernels} as one graph + synchronize | {:.2} µs | {:.2} µs | {:.3} |",
        raw_graph_trip / 1e3,
        cudrv_graph_trip / 1e3,
        cudrv_graph_trip / raw_graph_trip
    );
    println!();
    println!(
        "graph speedup over one-by-one launches: raw {:.2}x, cudrv {:.2}x; graph launch target (cudrv <= 1.05x raw): {}",
        raw_single / raw_graph_trip,
        cudrv_single / cudrv_graph_trip,
        {
            let r = cudrv_graph_enqueue / raw_graph_enqueue;
            if r <= 1.05 { format!("met ({r:.3}x)") } else { format!("NOT met ({r:.3}x)") }
        }
    );
    let ratio = cudrv_empty / raw_empty;
    println!();
    println!(
        "enqueue target (cudrv <= 1.05x raw): {}",
        if ratio <= 1.05 { format!("met ({ratio:.3}x)") } else { format!("NOT met ({ratio:.3}x)") }
    );
    Ok(())
}

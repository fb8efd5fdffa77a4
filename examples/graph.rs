//! CUDA graphs: a step of work captured once and replayed many times with one launch call each.
//!
//! ```text
//! cargo run --example graph                 # on the GPU: 1000 replays
//! cargo run --example graph -- 50           # 50 replays
//! ```
//!
//! The step allocates a temporary inside the capture (`tmp = x`), then runs `x = tmp + y`
//! (`add_f32` of `examples/kernels/vector_add.ptx`) and frees the temporary. Where the driver has
//! memory pools the temporary is a graph memory node; where it has none (Windows TCC, or through
//! cudrv's TCC interposer) it is a block of cudrv's `StreamOrderedPool`, reserved for the graph
//! until it is dropped. The example checks `x = x0 + replays * y` element by element, and prints
//! the time of the replays against the same work launched kernel by kernel. It runs on cudrv's
//! emulated driver too (`CUDRV_DRIVER_PATH=<.../libcuda.so of cudrv-test-support>`, with
//! `CUDRV_FAKE_MODE=tcc` for a TCC device). Exits with 1 on a wrong element or an error, 2 for bad
//! arguments.

use std::process::ExitCode;
use std::time::Instant;

use cudrv::graph::CaptureMode;
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, LaunchConfig, Module, Stream};

const PTX: &str = include_str!("kernels/vector_add.ptx");
const USAGE: &str = "\
usage: graph [REPLAYS]
  REPLAYS     how many times to launch the captured graph (default 1000)
  -h, --help  print this help";

fn main() -> ExitCode {
    let mut replays = 1000usize;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            flag if flag.starts_with('-') => {
                eprintln!("graph: unknown argument {flag}\n{USAGE}");
                return ExitCode::from(2);
            }
            n => match n.parse::<usize>() {
                Ok(v) if v > 0 => replays = v,
                _ => {
                    eprintln!("graph: REPLAYS must be a whole number of at least 1: {n}\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
        }
    }
    match run(replays) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("graph: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(replays: usize) -> cudrv::Result<bool> {
    let n = 1 << 16;
    let device = Device::get(0)?;
    let stream = Stream::new(&device)?;
    let module = Module::from_ptx(&device, PTX)?;
    let add = module.function("add_f32")?;
    let resource = device.memory_resource()?;
    println!(
        "{} ({:?}, memory resource {:?}): {n} elements, {replays} replays",
        device.name()?,
        device.driver_model()?,
        resource.kind()
    );

    let x0: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut x = DeviceBuffer::from_slice(&x0, &stream)?;
    let dy = DeviceBuffer::from_slice(&y, &stream)?;
    let cfg = LaunchConfig::for_num_elems(n);

    // One step, captured: nothing runs now.
    stream.begin_capture(CaptureMode::ThreadLocal)?;
    {
        let mut tmp = DeviceBuffer::<f32>::zeroed(n, &stream)?;
        tmp.copy_from(&x)?;
        // SAFETY: add_f32(const f32*, const f32*, f32*, u64) touches [0..n] of each buffer, and
        // every buffer outlives the graph's launches (cudrv keeps the captured ones alive).
        unsafe { add.launch(cfg, &stream, (&tmp, &dy, &mut x, n as u64))? };
    }
    let graph = stream.end_capture()?;
    let exec = graph.instantiate()?;
    exec.upload(&stream)?;

    let t = Instant::now();
    for _ in 0..replays {
        exec.launch(&stream)?;
    }
    stream.synchronize()?;
    let graph_time = t.elapsed();

    // The same steps launched one by one, on a copy.
    let mut x2 = DeviceBuffer::from_slice(&x0, &stream)?;
    let t = Instant::now();
    for _ in 0..replays {
        let mut tmp = DeviceBuffer::<f32>::zeroed(n, &stream)?;
        tmp.copy_from(&x2)?;
        // SAFETY: as above.
        unsafe { add.launch(cfg, &stream, (&tmp, &dy, &mut x2, n as u64))? };
    }
    stream.synchronize()?;
    let step_time = t.elapsed();

    let (got, got2) = (x.to_vec()?, x2.to_vec()?);
    let mut wrong = 0;
    for i in 0..n {
        let want = x0[i] + replays as f32 * y[i];
        if got[i] != want || got2[i] != want {
            if wrong < 5 {
                eprintln!("element {i}: graph {} step by step {} expected {want}", got[i], got2[i]);
            }
            wrong += 1;
        }
    }
    println!(
        "graph: {:.1} µs per replay; step by step: {:.1} µs per step ({:.2}x)",
        graph_time.as_secs_f64() * 1e6 / replays as f64,
        step_time.as_secs_f64() * 1e6 / replays as f64,
        step_time.as_secs_f64() / graph_time.as_secs_f64()
    );
    if wrong > 0 {
        eprintln!("graph: {wrong} of {n} elements wrong");
        return Ok(false);
    }
    println!("graph: all {n} elements correct after {replays} replays");
    Ok(true)
}

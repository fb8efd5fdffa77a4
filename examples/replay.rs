//! Replays allocation traces (`traces/*.csv`: `op,id,size,stream`) through a memory resource and
//! reports how much memory it reserved against what was live, and how fast it was.
//!
//! ```text
//! cargo run --release --example replay -- [--simulate] [--resource driver-pool|pool|sync]
//!     [--memory BYTES|FACTORx] [--config name=value,...] [--device N] [--watch] TRACE.csv...
//! ```
//!
//! * `--simulate`: no GPU and no driver: the pool's bookkeeping on an emulated device
//!   (`cudrv::memory::SimulatedPool`, the same code as `StreamOrderedPool`).
//! * Without it: on device `--device` (default 0) through the resource `--resource` (default: the
//!   device's own choice), twice: *cold* (trimmed to nothing first) and *warm* (right after),
//!   reporting ns per event of each.
//! * `--memory`: the memory the pool may use: bytes (`3G`, `512M`, `1048576`), or a factor of each
//!   trace's peak of live bytes (`1.10x`). Simulated: the emulated device's size. On the GPU: the
//!   rest of the device's free memory is taken first by one raw `cuMemAlloc`. Simulated without
//!   it, the pool does not know the device's free memory, and some of its decisions (how much
//!   size-class rounding may leave unused, how much a loose reuse may pin) are then unbounded; to
//!   predict a replay on a GPU without a budget, give the GPU's free memory (`--memory 139G` for
//!   an H200; BENCHMARKS.md, runs 43–44, has a rule that the two told apart).
//!
//! * `--config name=value,...`: `PoolConfig` fields for `--simulate` and `--resource pool`: sizes
//!   (`small_limit`, `small_chunk`, `medium_limit`, `medium_chunk`, `large_granule`,
//!   `min_large_split`, `release_threshold`), `classes`, `large_fit`, `headroom` (a percentage or
//!   `none`), `expandable=false` to grow in chunks even where the device (or the emulated one)
//!   has virtual memory management, and `reservoir=false` to grow in chunks near capacity by
//!   exactly each request.
//! * `--watch` (with `--simulate` or `--resource pool`): a line `watch: ...` each time the pool
//!   maps or unmaps memory (allocates or frees a chunk) during the first replay: the event, the
//!   pool's figures and the device's free memory (the emulated device's, simulated), so that a
//!   replay on the GPU can be set beside the simulated one, decision by decision.
//!
//! Where the pool grows in chunks (`--config expandable=false`, or a device without virtual memory
//! management), a line `least in chunks ...` gives the least memory any placement in chunks that
//! keeps small, medium and large requests apart, with a chunk of its own for each large request,
//! needs for the trace (`Trace::least_memory_in_chunks`): below it (plus what the driver keeps
//! back), the pool fits only by placing requests in the tails of large chunks, its last resort,
//! or large requests of a recurring size in shared (packed) chunks.
//!
//! With `--simulate` or `--resource pool`, a line `pool ...` gives the pool's driver frees,
//! out-of-memory recoveries, reservoirs taken near capacity, event synchronisations and queries, and what it leaves of the
//! reported free memory to the driver near capacity (2 MiB, or more where the driver refused).
//! Where the driver made chunk allocations that came soon after a free wait, a line `pacing ...`
//! follows: how many it made wait, and how many the pool then paced, with their pauses summed.
//!
//! Each trace ends with one line:
//! `replay: <file> reserved/live=R.RRR peak_live=N peak_reserved=N driver_allocs=N`, or
//! `replay: <file> OOM at event N ...` when it ran out of memory. Exit status: 0 when every trace
//! completed, 3 when one ran out of memory, 2 for bad arguments or a bad trace (naming the line),
//! 1 for other errors.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use cudrv::memory::{
    DriverPool, MemoryResource, PoolConfig, PoolStats, StreamOrderedPool, SyncResource, Trace, TraceEvent,
};
use cudrv::{Device, Stream};

/// `println!` that ends the program quietly when standard output is closed (`replay ... | head`),
/// as command-line tools do, instead of panicking; any other failure to write exits with 1.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($t)*) {
            std::process::exit(if e.kind() == std::io::ErrorKind::BrokenPipe { 0 } else { 1 });
        }
    }};
}

const USAGE: &str = "usage: replay [--simulate] [--resource driver-pool|pool|sync] [--memory BYTES|FACTORx] \
                     [--config name=value,...] [--device N] [--watch] TRACE.csv...";

#[derive(Clone, Copy, Debug)]
enum Memory {
    Bytes(usize),
    Factor(f64),
}

impl Memory {
    fn for_trace(self, trace: &Trace) -> usize {
        match self {
            Memory::Bytes(b) => b,
            Memory::Factor(f) => (trace.peak_live() as f64 * f) as usize,
        }
    }
}

struct Args {
    config: PoolConfig,
    simulate: bool,
    resource: Option<String>,
    memory: Option<Memory>,
    device: usize,
    watch: bool,
    traces: Vec<String>,
}

fn parse_bytes(v: &str) -> Option<Memory> {
    if let Some(f) = v.strip_suffix(['x', 'X']) {
        return f.parse::<f64>().ok().filter(|f| f.is_finite() && *f > 0.0).map(Memory::Factor);
    }
    let (digits, unit) = match v.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => v.split_at(i),
        None => (v, ""),
    };
    let shift = match unit.to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return None,
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift).map(Memory::Bytes)
}

/// Sets one `PoolConfig` field from `name=value` (sizes as for `--memory`; `headroom=none`).
fn set_config(c: &mut PoolConfig, kv: &str) -> Result<(), String> {
    let (k, v) = kv.split_once('=').ok_or_else(|| format!("--config {kv:?}: expected name=value"))?;
    let bytes = || match parse_bytes(v) {
        Some(Memory::Bytes(b)) => Ok(b),
        _ => Err(format!("--config {k}={v:?}: expected a size")),
    };
    match k {
        "release_threshold" => c.release_threshold = bytes()?,
        "small_limit" => c.small_limit = bytes()?,
        "small_chunk" => c.small_chunk = bytes()?,
        "medium_limit" => c.medium_limit = bytes()?,
        "medium_chunk" => c.medium_chunk = bytes()?,
        "large_granule" => c.large_granule = bytes()?,
        "min_large_split" => c.min_large_split = bytes()?,
        "classes" => {
            c.large_classes_per_octave = v.parse().map_err(|_| format!("--config classes={v:?}: expected a number"))?
        }
        "large_fit" => {
            c.large_fit_percent = v.parse().map_err(|_| format!("--config large_fit={v:?}: expected a percentage"))?
        }
        "headroom" => {
            c.headroom_percent = if v == "none" {
                None
            } else {
                Some(v.parse().map_err(|_| format!("--config headroom={v:?}: expected a percentage or none"))?)
            }
        }
        "reservoir" => {
            c.reservoir = v.parse().map_err(|_| format!("--config reservoir={v:?}: expected true or false"))?
        }
        "expandable" => {
            c.expandable = v.parse().map_err(|_| format!("--config expandable={v:?}: expected true or false"))?
        }
        _ => return Err(format!("--config: unknown field {k:?}")),
    }
    Ok(())
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        config: PoolConfig::default(),
        simulate: false,
        resource: None,
        memory: None,
        device: 0,
        watch: false,
        traces: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "--simulate" => args.simulate = true,
            "--watch" => args.watch = true,
            "--resource" => {
                let v = value("--resource")?;
                if !["driver-pool", "pool", "sync"].contains(&v.as_str()) {
                    return Err(format!("--resource {v:?}: expected driver-pool, pool or sync"));
                }
                args.resource = Some(v);
            }
            "--memory" => {
                let v = value("--memory")?;
                args.memory = Some(parse_bytes(&v).ok_or_else(|| {
                    format!("--memory {v:?}: expected bytes (3G, 512M, 1048576) or a factor (1.10x)")
                })?);
            }
            "--config" => {
                let v = value("--config")?;
                for kv in v.split(',').filter(|kv| !kv.is_empty()) {
                    set_config(&mut args.config, kv)?;
                }
            }
            "--device" => {
                let v = value("--device")?;
                args.device = v.parse().map_err(|_| format!("--device {v:?}: expected a device number"))?;
            }
            flag if flag.starts_with('-') => return Err(format!("unknown flag {flag}")),
            path => args.traces.push(path.to_string()),
        }
    }
    if args.traces.is_empty() {
        return Err("no trace given".into());
    }
    if args.simulate && args.resource.as_deref().is_some_and(|r| r != "pool") {
        return Err("--simulate replays cudrv's pool only (--resource pool)".into());
    }
    if args.watch && !args.simulate && args.resource.as_deref() != Some("pool") {
        return Err("--watch follows cudrv's pool: with --simulate or --resource pool".into());
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            say!("{USAGE}\n\nReplays allocation traces through a memory resource (see the example's docs).");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("replay: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut traces = Vec::new();
    for path in &args.traces {
        let name = std::path::Path::new(path).file_name().map_or(path.clone(), |n| n.to_string_lossy().into_owned());
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("replay: {path}: {e}");
                return ExitCode::from(2);
            }
        };
        match Trace::parse(&text) {
            Ok(t) => traces.push((name, t)),
            Err(e) => {
                eprintln!("replay: {path}: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let mut any_oom = false;
    for (name, trace) in &traces {
        let limit = args.memory.map(|m| m.for_trace(trace));
        let outcome =
            if args.simulate { simulate(&args.config, trace, limit, args.watch) } else { on_gpu(&args, trace, limit) };
        match outcome {
            Ok(r) => {
                any_oom |= r.oom_at.is_some();
                print_report(name, trace, &r);
            }
            Err(e) => {
                eprintln!("replay: {name}: {e}");
                return ExitCode::from(1);
            }
        }
    }
    if any_oom { ExitCode::from(3) } else { ExitCode::SUCCESS }
}

/// What one replay measured.
struct Report {
    events: usize,
    oom_at: Option<usize>,
    peak_reserved: usize,
    driver_allocs: u64,
    /// (cold, warm) ns per event, on a GPU.
    timing: Option<(f64, f64)>,
    resource: String,
    limit: Option<usize>,
    /// cudrv's pool's own counters: with `--simulate` or `--resource pool` (the device's default
    /// resource is shared behind `dyn MemoryResource`, whose statistics do not have them).
    pool: Option<PoolStats>,
    /// Where cudrv's pool grows in chunks: the least memory any placement in chunks keeping the
    /// kinds apart, with a chunk per large request, needs ([`Trace::least_memory_in_chunks`]).
    least_in_chunks: Option<usize>,
}

fn print_report(name: &str, trace: &Trace, r: &Report) {
    say!("{name}: {} events on {} stream(s), through {}", trace.events().len(), trace.streams(), r.resource);
    if let Some(limit) = r.limit {
        say!(
            "  memory limit      {limit} bytes ({:.3}x the peak live)",
            limit as f64 / trace.peak_live().max(1) as f64
        );
    }
    say!("  peak live         {} bytes", trace.peak_live());
    say!("  peak reserved     {} bytes", r.peak_reserved);
    if let Some(least) = r.least_in_chunks {
        say!(
            "  least in chunks   {least} bytes ({:.4}x the peak live): no placement keeping the kinds of request \
             apart, with a chunk per large request, needs less, plus what the driver keeps back",
            least as f64 / trace.peak_live().max(1) as f64
        );
    }
    say!("  driver allocs     {}", r.driver_allocs);
    if let Some((cold, warm)) = r.timing {
        say!("  ns/event          cold {cold:.0}, warm {warm:.0}");
    }
    if let Some(p) = &r.pool {
        say!(
            "  pool              {} driver frees, {} out-of-memory recoveries, {} reservoirs, {} event syncs, \
             {} event queries, {} MiB left to the driver",
            p.driver_frees,
            p.oom_recoveries,
            p.reservoirs,
            p.event_syncs,
            p.event_queries,
            p.driver_spare >> 20
        );
        if p.driver_waits_after_free > 0 || p.paced_allocations > 0 {
            say!(
                "  pacing            {} allocations the driver made wait after frees, {} paced ({:.1} ms)",
                p.driver_waits_after_free,
                p.paced_allocations,
                p.pacing_time.as_secs_f64() * 1e3
            );
        }
    }
    let ratio = r.peak_reserved as f64 / trace.peak_live().max(1) as f64;
    match r.oom_at {
        None => say!(
            "replay: {name} reserved/live={ratio:.3} peak_live={} peak_reserved={} driver_allocs={}",
            trace.peak_live(),
            r.peak_reserved,
            r.driver_allocs
        ),
        Some(i) => say!(
            "replay: {name} OOM at event {i} of {} reserved/live={ratio:.3} peak_live={} peak_reserved={} driver_allocs={}",
            r.events.max(i),
            trace.peak_live(),
            r.peak_reserved,
            r.driver_allocs
        ),
    }
}

/// `--watch`: a line each time the pool's count of driver allocations or frees changed.
#[derive(Default)]
struct Watcher {
    last: (u64, u64),
}

impl Watcher {
    /// After event `event`: the pool's figures `st`, and the device's free memory `free`.
    fn see(&mut self, event: usize, st: &PoolStats, free: impl FnOnce() -> Option<usize>) {
        if (st.driver_allocs, st.driver_frees) == self.last {
            return;
        }
        self.last = (st.driver_allocs, st.driver_frees);
        let free = free().map_or_else(|| "-".to_string(), |f| f.to_string());
        say!(
            "watch: event={event} driver_allocs={} driver_frees={} reserved={} in_use={} device_free={free} \
             queries={} recoveries={} spare={}",
            st.driver_allocs,
            st.driver_frees,
            st.reserved,
            st.in_use,
            st.event_queries,
            st.oom_recoveries,
            st.driver_spare
        );
    }
}

fn simulate(config: &PoolConfig, trace: &Trace, limit: Option<usize>, watch: bool) -> Result<Report, String> {
    let pool = cudrv::memory::SimulatedPool::new(config.clone(), limit);
    let cold = if watch {
        let mut watcher = Watcher::default();
        trace.replay_watched(&pool, |i| {
            let st = pool.stats();
            watcher.see(i, &st, || limit.map(|l| l - st.reserved));
        })
    } else {
        trace.replay_on(&pool)
    };
    let warm = if cold.out_of_memory_at.is_none() { Some(trace.replay_on(&pool)) } else { None };
    let last = warm.unwrap_or(cold);
    say!(
        "  simulated driver allocs: cold {} ({:.1} ms est.), warm {} ({:.1} ms est.)",
        cold.driver_allocs,
        cold.estimated_driver_ns() / 1e6,
        warm.map_or(0, |w| w.driver_allocs),
        warm.map_or(0.0, |w| w.estimated_driver_ns() / 1e6)
    );
    if limit.is_some() && !config.expandable && cold.driver_allocs > 0 {
        say!(
            "  (estimates for a roomy device: in chunks under 1.10x budgets the replays took 1.6-4.1x these on \
             an H100, paced; 21-39x before pacing)"
        );
    }
    Ok(Report {
        events: trace.events().len(),
        oom_at: last.out_of_memory_at,
        peak_reserved: last.peak_reserved,
        driver_allocs: cold.driver_allocs + warm.map_or(0, |w| w.driver_allocs),
        timing: None,
        resource: "StreamOrderedPool (simulated)".into(),
        limit,
        pool: Some(pool.stats()),
        least_in_chunks: (!config.expandable).then(|| trace.least_memory_in_chunks(config)),
    })
}

fn on_gpu(args: &Args, trace: &Trace, limit: Option<usize>) -> Result<Report, String> {
    let e = |e: cudrv::Error| e.to_string();
    let device = Device::get(args.device).map_err(e)?;
    let mut pool = None;
    let resource: Arc<dyn MemoryResource> = match args.resource.as_deref() {
        None => device.memory_resource().map_err(e)?,
        Some("driver-pool") => Arc::new(DriverPool::default_pool(&device).map_err(e)?),
        Some("pool") => {
            let p = Arc::new(StreamOrderedPool::with_config(&device, args.config.clone()).map_err(e)?);
            pool = Some(p.clone());
            p
        }
        Some(_) => Arc::new(SyncResource::new(&device).map_err(e)?),
    };
    let streams: Vec<Stream> =
        (0..trace.streams().max(1)).map(|_| Stream::new(&device)).collect::<Result<_, _>>().map_err(e)?;
    resource.trim(0).map_err(e)?;
    let _hog = match limit {
        Some(bytes) => Some(Hog::leave(&device, bytes)?),
        None => None,
    };
    resource.reset_peaks().map_err(e)?;
    let mut watcher = Watcher::default();
    let mut watch = |i: usize| {
        if let Some(p) = pool.as_ref().filter(|_| args.watch) {
            watcher.see(i, &p.pool_stats(), || device.memory_info().ok().map(|m| m.free));
        }
    };
    let cold = replay_once(&*resource, trace, &streams, &mut watch)?;
    let stats_after_cold = resource.stats().unwrap_or_default();
    let mut report = Report {
        events: cold.1,
        oom_at: cold.0,
        peak_reserved: stats_after_cold.peak_reserved,
        driver_allocs: stats_after_cold.driver_allocations,
        timing: None,
        resource: resource.kind().to_string(),
        limit,
        pool: None,
        least_in_chunks: pool
            .as_ref()
            .filter(|p| !p.grows_in_segments())
            .map(|_| trace.least_memory_in_chunks(&args.config)),
    };
    if cold.0.is_none() {
        let warm = replay_once(&*resource, trace, &streams, &mut |_| {})?;
        let st = resource.stats().unwrap_or_default();
        report.peak_reserved = st.peak_reserved;
        report.driver_allocs = st.driver_allocations;
        report.oom_at = warm.0;
        report.timing = Some((cold.2, warm.2));
    }
    for s in &streams {
        s.synchronize().map_err(e)?;
    }
    report.pool = pool.map(|p| p.pool_stats());
    resource.trim(0).map_err(e)?;
    Ok(report)
}

/// Replays once, calling `watch` with each event's index once served; frees what the trace
/// leaves live. Returns (event that ran out of memory, events done, ns per event).
fn replay_once(
    resource: &dyn MemoryResource,
    trace: &Trace,
    streams: &[Stream],
    watch: &mut dyn FnMut(usize),
) -> Result<(Option<usize>, usize, f64), String> {
    let mut table = trace.replay_table();
    let mut oom = None;
    let start = Instant::now();
    let mut done = 0;
    for (i, ev) in trace.events().iter().enumerate() {
        match *ev {
            TraceEvent::Alloc { size, stream, .. } => match resource.allocate(size, &streams[stream]) {
                Ok(p) => table.allocated(i, p),
                Err(err) if err.is_out_of_memory() => {
                    oom = Some(i);
                    // Where the memory was: the pool's and the device's view, for the report.
                    let live = table.live_bytes();
                    let st = resource.stats().unwrap_or_default();
                    let free = streams[stream].device().memory_info().map_or(0, |m| m.free);
                    eprintln!(
                        "  out of memory: request {size} bytes with {live} live; pool reserved {}, \
                         {} driver allocations; device free {free}",
                        st.reserved, st.driver_allocations
                    );
                    break;
                }
                Err(err) => return Err(format!("event {i}: {err}")),
            },
            TraceEvent::Free { size, stream, .. } => {
                let p = table.freed(i).ok_or_else(|| format!("event {i}: a free of an allocation not live"))?;
                // SAFETY: `p` came from this resource with this size; nothing used it.
                unsafe { resource.deallocate(p, size, &streams[stream]) }.map_err(|e| format!("event {i}: {e}"))?;
            }
        }
        watch(i);
        done = i + 1;
    }
    let elapsed = start.elapsed().as_nanos() as f64 / done.max(1) as f64;
    // In the order of their ids, so that the warm replay starts from the same pool every time.
    for (p, size, stream) in table.into_live() {
        // SAFETY: as above.
        unsafe { resource.deallocate(p, size, &streams[stream]) }.map_err(|e| e.to_string())?;
    }
    Ok((oom, done, elapsed))
}

/// One raw `cuMemAlloc` of all the device's free memory but `leave` bytes (or up to 2 MiB more:
/// whole pages), freed when dropped.
struct Hog {
    ptr: cudrv::sys::CUdeviceptr,
    ctx: Arc<cudrv::Context>,
}

impl Hog {
    fn leave(device: &Device, leave: usize) -> Result<Hog, String> {
        let ctx = device.primary_context().map_err(|e| e.to_string())?;
        let _b = ctx.bind().map_err(|e| e.to_string())?;
        let d = cudrv::sys::Driver::global().map_err(|e| e.to_string())?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is current.
        let rc = unsafe { d.cuMemGetInfo_v2(&mut free, &mut total) }.map_err(|e| e.to_string())?;
        if rc != cudrv::sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemGetInfo: {rc:?}"));
        }
        // The driver maps device memory in 2 MiB pages and rounds an allocation up to whole
        // pages: take whole pages, so that at least `leave` bytes stay free.
        const PAGE: usize = 2 << 20;
        let take = free.saturating_sub(leave) / PAGE * PAGE;
        let mut ptr = 0;
        if take > 0 {
            // SAFETY: valid out-pointer; the context is current.
            let rc = unsafe { d.cuMemAlloc_v2(&mut ptr, take) }.map_err(|e| e.to_string())?;
            if rc != cudrv::sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuMemAlloc of {take} bytes to leave {leave} free: {rc:?}"));
            }
        }
        let left = device.memory_info().map_or(0, |m| m.free);
        drop(_b);
        say!("  (took {take} of {free} free bytes to leave {leave}: {left} left free)");
        Ok(Hog { ptr, ctx })
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let (Ok(_b), Ok(d)) = (self.ctx.bind(), cudrv::sys::Driver::global()) {
            // SAFETY: the pointer came from cuMemAlloc above and is freed once.
            let _ = unsafe { d.cuMemFree_v2(self.ptr) };
        }
    }
}

//! Allocation benchmark: cudrv's memory resources against the raw driver, in one run.
//!
//! ```text
//! cargo bench --features gpu --bench memory            # needs a GPU
//! ```
//!
//! 1. alloc+free pair latency at 256 B, 1 MiB, 64 MiB, 1 GiB: raw `cuMemAllocAsync`+`cuMemFreeAsync`
//!    (default pool, release threshold at its maximum), raw `cuMemAlloc`+`cuMemFree`, and cudrv's
//!    `DriverPool`, `StreamOrderedPool` and `SyncResource`;
//! 2. cross-stream reuse: the pair alternating between two streams;
//! 3. replay of the allocation traces in `traces/`: ns per event, and peak reserved / peak live.
//!
//! Figures are medians of several rounds, printed as markdown tables with ratios against the raw
//! driver. Without a driver it prints the error and exits 0 (CI builds benches but has no GPU).

use std::sync::Arc;
use std::time::Instant;

use cudrv::memory::{DriverPool, MemoryResource, StreamOrderedPool, SyncResource};
use cudrv::sys::{CUresult, Driver};
use cudrv::{Device, Stream};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("memory bench: {e}");
    }
}

/// One way to allocate: a name and an alloc+free pair on given streams.
trait Allocator {
    fn name(&self) -> String;
    fn alloc(&self, bytes: usize, s: &Stream) -> Res<u64>;
    fn free(&self, p: u64, bytes: usize, s: &Stream) -> Res<()>;
    fn peak_reserved(&self) -> Option<usize>;
    fn reset(&self) -> Res<()>;
}

fn ok(rc: Result<CUresult, cudrv::sys::MissingSymbol>, what: &str) -> Res<()> {
    match rc? {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(format!("{what} failed with {}", code.0).into()),
    }
}

/// Raw `cuMemFreeAsync` with `cuMemAllocAsync` on the device's current (default) pool, or, with
/// `from_pool`, `cuMemAllocFromPoolAsync` on that pool by handle: what `DriverPool` calls, without
/// cudrv around it.
struct RawAsync {
    d: &'static Driver,
    pool: Arc<DriverPool>,
    from_pool: bool,
}

impl Allocator for RawAsync {
    fn name(&self) -> String {
        let alloc = if self.from_pool { "cuMemAllocFromPoolAsync" } else { "cuMemAllocAsync" };
        format!("raw {alloc}+cuMemFreeAsync")
    }
    fn alloc(&self, bytes: usize, s: &Stream) -> Res<u64> {
        let mut p = 0;
        // SAFETY: valid out-pointer, pool and stream; the stream's context is current (bound by run).
        let rc = unsafe {
            if self.from_pool {
                self.d.cuMemAllocFromPoolAsync(&mut p, bytes, self.pool.as_raw(), s.as_raw())
            } else {
                self.d.cuMemAllocAsync(&mut p, bytes, s.as_raw())
            }
        };
        ok(rc, "stream-ordered allocation")?;
        Ok(p)
    }
    fn free(&self, p: u64, _bytes: usize, s: &Stream) -> Res<()> {
        // SAFETY: `p` came from the pool and is unused.
        ok(unsafe { self.d.cuMemFreeAsync(p, s.as_raw()) }, "cuMemFreeAsync")
    }
    fn peak_reserved(&self) -> Option<usize> {
        self.pool.pool_stats().ok().map(|s| s.peak_reserved)
    }
    fn reset(&self) -> Res<()> {
        self.pool.trim_to(0)?;
        Ok(self.pool.reset_pool_peaks()?)
    }
}

/// Raw `cuMemAlloc` / `cuMemFree` (no stream order: the free synchronises implicitly).
struct RawSync {
    d: &'static Driver,
    peak: std::sync::atomic::AtomicUsize,
    live: std::sync::atomic::AtomicUsize,
}

impl Allocator for RawSync {
    fn name(&self) -> String {
        "raw cuMemAlloc+cuMemFree".into()
    }
    fn alloc(&self, bytes: usize, _s: &Stream) -> Res<u64> {
        let mut p = 0;
        // SAFETY: valid out-pointer; the context is current.
        ok(unsafe { self.d.cuMemAlloc_v2(&mut p, bytes) }, "cuMemAlloc")?;
        let live = self.live.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed) + bytes;
        self.peak.fetch_max(live, std::sync::atomic::Ordering::Relaxed);
        Ok(p)
    }
    fn free(&self, p: u64, bytes: usize, _s: &Stream) -> Res<()> {
        self.live.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `p` came from cuMemAlloc and is unused.
        ok(unsafe { self.d.cuMemFree_v2(p) }, "cuMemFree")
    }
    fn peak_reserved(&self) -> Option<usize> {
        Some(self.peak.load(std::sync::atomic::Ordering::Relaxed))
    }
    fn reset(&self) -> Res<()> {
        self.peak.store(0, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// A cudrv resource.
struct Cudrv {
    name: &'static str,
    r: Arc<dyn MemoryResource>,
    pool: Option<Arc<StreamOrderedPool>>,
    driver_pool: Option<Arc<DriverPool>>,
}

impl Allocator for Cudrv {
    fn name(&self) -> String {
        format!("cudrv {}", self.name)
    }
    fn alloc(&self, bytes: usize, s: &Stream) -> Res<u64> {
        Ok(self.r.allocate(bytes, s)?)
    }
    fn free(&self, p: u64, bytes: usize, s: &Stream) -> Res<()> {
        // SAFETY: `p` came from this resource with this size and is unused.
        Ok(unsafe { self.r.deallocate(p, bytes, s) }?)
    }
    fn peak_reserved(&self) -> Option<usize> {
        if let Some(p) = &self.pool {
            return Some(p.pool_stats().peak_reserved);
        }
        if let Some(p) = &self.driver_pool {
            return p.pool_stats().ok().map(|s| s.peak_reserved);
        }
        self.r.stats().map(|s| s.peak_reserved)
    }
    fn reset(&self) -> Res<()> {
        self.r.trim(0)?;
        Ok(self.r.reset_peaks()?)
    }
}

/// Pairs per round for the fast allocators; `CUDRV_BENCH_QUICK=1` cuts it (for a check on the
/// emulated driver, whose frees run late on its stream threads).
fn fast_iters() -> usize {
    if std::env::var_os("CUDRV_BENCH_QUICK").is_some() { 20 } else { 20_000 }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// ns per alloc+free pair: rounds of `iters` pairs, median of rounds. `streams` alternate.
fn pair_ns(a: &dyn Allocator, bytes: usize, streams: &[Stream], iters: usize, rounds: usize) -> Res<f64> {
    // Warm up (the pools reserve their memory here).
    for i in 0..4 {
        let s = &streams[i % streams.len()];
        let p = a.alloc(bytes, s)?;
        a.free(p, bytes, s)?;
    }
    let mut per = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        for i in 0..iters {
            let s = &streams[i % streams.len()];
            let p = a.alloc(bytes, s)?;
            a.free(p, bytes, s)?;
        }
        per.push(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    for s in streams {
        s.synchronize()?;
    }
    Ok(median(per))
}

struct Trace {
    name: String,
    events: Vec<(bool, usize, usize)>, // (is_alloc, id, size)
    ids: usize,
    peak_live: usize,
}

fn load_trace(path: &str) -> Res<Trace> {
    let text = std::fs::read_to_string(path)?;
    let mut events = Vec::new();
    let (mut live, mut peak, mut ids) = (0usize, 0usize, 0usize);
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.starts_with("op,")) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 3 {
            continue;
        }
        let (id, size): (usize, usize) = (f[1].parse()?, f[2].parse()?);
        let alloc = f[0] == "a";
        if alloc {
            live += size;
            peak = peak.max(live);
        } else {
            live -= size;
        }
        ids = ids.max(id + 1);
        events.push((alloc, id, size));
    }
    let name = std::path::Path::new(path).file_stem().unwrap_or_default().to_string_lossy().into_owned();
    Ok(Trace { name, events, ids, peak_live: peak })
}

/// Replays a trace twice: cold (after giving every cached byte back) and warm (right after, with
/// what the first pass left cached, as in the next training step). Returns (cold ns per event,
/// warm ns per event, peak reserved / peak live over both passes).
fn replay(a: &dyn Allocator, t: &Trace, s: &Stream) -> Res<(f64, f64, Option<f64>)> {
    a.reset()?;
    let cold = replay_once(a, t, s)?;
    let warm = replay_once(a, t, s)?;
    let ratio = a.peak_reserved().map(|r| r as f64 / t.peak_live as f64);
    a.reset()?;
    Ok((cold, warm, ratio))
}

fn replay_once(a: &dyn Allocator, t: &Trace, s: &Stream) -> Res<f64> {
    let mut ptrs = vec![0u64; t.ids];
    let start = Instant::now();
    for &(alloc, id, size) in &t.events {
        if alloc {
            ptrs[id] = a.alloc(size, s)?;
        } else {
            a.free(ptrs[id], size, s)?;
            ptrs[id] = 0;
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / t.events.len() as f64;
    // Free what the trace leaves live (the model's state).
    for &(alloc, id, size) in &t.events {
        if alloc && ptrs[id] != 0 {
            a.free(ptrs[id], size, s)?;
            ptrs[id] = 0;
        }
    }
    s.synchronize()?;
    Ok(ns)
}

fn run() -> Res<()> {
    let dev = Device::get(0)?;
    let ctx = dev.primary_context()?;
    let _bound = ctx.bind()?;
    let d = Driver::global()?;
    let caps = dev.capabilities()?;
    println!(
        "# memory bench: {} (CC {}.{}), driver {}, driver model {}, cudrv headers {}",
        dev.name()?,
        caps.compute_capability.0,
        caps.compute_capability.1,
        d.version(),
        caps.driver_model,
        cudrv::HEADER_VERSION
    );
    let s = Stream::new(&dev)?;
    let s2 = Stream::new(&dev)?;

    let mut allocs: Vec<Box<dyn Allocator>> = Vec::new();
    if caps.memory_pools {
        let default = Arc::new(DriverPool::default_pool(&dev)?); // raises the default pool's threshold
        allocs.push(Box::new(RawAsync { d, pool: default.clone(), from_pool: false }));
        allocs.push(Box::new(RawAsync { d, pool: default.clone(), from_pool: true }));
    }
    allocs.push(Box::new(RawSync { d, peak: Default::default(), live: Default::default() }));
    if caps.memory_pools {
        let dp = Arc::new(DriverPool::default_pool(&dev)?);
        allocs.push(Box::new(Cudrv { name: "DriverPool", r: dp.clone(), pool: None, driver_pool: Some(dp) }));
    }
    let pool = Arc::new(StreamOrderedPool::new(&dev)?);
    allocs.push(Box::new(Cudrv { name: "StreamOrderedPool", r: pool.clone(), pool: Some(pool), driver_pool: None }));
    allocs.push(Box::new(Cudrv {
        name: "SyncResource",
        r: Arc::new(SyncResource::new(&dev)?),
        pool: None,
        driver_pool: None,
    }));

    let mut sizes = vec![(256, "256 B"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB"), (1 << 30, "1 GiB")];
    if std::env::var_os("CUDRV_BENCH_QUICK").is_some() {
        sizes.truncate(2);
    }
    println!("\n## alloc+free pair, one stream (ns per pair, median of 7 rounds; ratio vs the first row)\n");
    print!("| allocator |");
    for (_, n) in &sizes {
        print!(" {n} | ratio |");
    }
    println!();
    println!("|---|{}", "---|---|".repeat(sizes.len()));
    let mut base = vec![0f64; sizes.len()];
    for (k, a) in allocs.iter().enumerate() {
        print!("| {} |", a.name());
        for (i, (bytes, _)) in sizes.iter().enumerate() {
            let slow = a.name().contains("cuMemAlloc+") || a.name().contains("Sync");
            let iters = if slow { 50 } else { fast_iters() };
            let ns = pair_ns(a.as_ref(), *bytes, std::slice::from_ref(&s), iters, 7)?;
            if k == 0 {
                base[i] = ns;
            }
            print!(" {ns:.0} | {:.3}x |", ns / base[i]);
        }
        println!();
        a.reset()?;
    }

    println!("\n## cross-stream reuse: the pair alternating between two streams (ns per pair)\n");
    println!("| allocator | 1 MiB | ratio |\n|---|---|---|");
    let mut cbase = 0.0;
    for (k, a) in allocs.iter().enumerate() {
        let slow = a.name().contains("cuMemAlloc+") || a.name().contains("Sync");
        let ns = pair_ns(a.as_ref(), 1 << 20, &[s.clone(), s2.clone()], if slow { 50 } else { fast_iters() }, 7)?;
        if k == 0 {
            cbase = ns;
        }
        println!("| {} | {ns:.0} | {:.3}x |", a.name(), ns / cbase);
        a.reset()?;
    }

    println!("\n## trace replay (ns per event; cold: after a full trim; warm: the next replay)\n");
    println!(
        "| allocator | trace | events | cold ns/event | ratio | warm ns/event | ratio | peak reserved / peak live |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");
    let dir = std::env::var("CUDRV_TRACE_DIR").unwrap_or_else(|_| root.to_string());
    for file in ["gpt2_train.csv", "resnet50_train.csv"] {
        let t = load_trace(&format!("{dir}/{file}"))?;
        let (mut first_cold, mut first_warm) = (0.0, 0.0);
        for (k, a) in allocs.iter().enumerate() {
            let (cold, warm, ratio) = replay(a.as_ref(), &t, &s)?;
            if k == 0 {
                (first_cold, first_warm) = (cold, warm);
            }
            let ratio = ratio.map_or("n/a".to_string(), |r| format!("{r:.3}"));
            let (name, trace, n) = (a.name(), &t.name, t.events.len());
            let (rc, rw) = (cold / first_cold, warm / first_warm);
            println!("| {name} | {trace} | {n} | {cold:.0} | {rc:.3}x | {warm:.0} | {rw:.3}x | {ratio} |");
        }
    }
    Ok(())
}

//! Allocation benchmark: cudrv's memory resources against the raw driver, in one run.
//!
//! ```text
//! cargo bench --features gpu --bench memory            # needs a GPU
//! ```
//!
//! 1. alloc+free pair latency at 256 B, 1 MiB, 64 MiB, 1 GiB: raw `cuMemAllocAsync` and
//!    `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` (default pool, release threshold at its
//!    maximum), raw `cuMemAlloc`+`cuMemFree`, and cudrv's `DriverPool`, `StreamOrderedPool` and
//!    `SyncResource`, each through the resource and through `DeviceBuffer` (uninit + drop); then
//!    `DeviceBuffer` against what it wraps (its resource, and for `DriverPool` the raw
//!    `cuMemAllocFromPoolAsync` pair), measured in alternating rounds in a process of its own,
//!    each pair of rounds with the stack at another of 63 places 64 bytes apart (the ratio is the
//!    median, with the 90th percentile), and `DeviceBuffer`'s own cost over a resource that does
//!    nothing;
//! 2. cross-stream reuse: the pair alternating between two streams; and a buffer allocated on one
//!    stream, used on another (`record_use`), then dropped;
//! 3. threads: 1, 2, 4, 8 and 16 threads, each allocating and freeing 1 MiB on its own stream:
//!    pairs per second, all threads together (median of 5 rounds of 100 ms);
//! 4. replay of the allocation traces in `traces/` (with their streams): ns per event, cold (after
//!    a full trim) and warm (the next replay), and peak reserved / peak live.
//!
//! Figures are medians of several rounds, printed as markdown tables with ratios against the raw
//! driver. Without a driver it prints the error and exits 0 (CI builds benches but has no GPU).
//! `CUDRV_BENCH_QUICK=1` cuts every loop (for a check on the emulated driver).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cudrv::memory::{DeviceBuffer, DriverPool, MemoryResource, StreamOrderedPool, SyncResource, Trace, TraceEvent};
use cudrv::sys::{CUresult, Driver};
use cudrv::{Device, Stream};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("memory bench: {e}");
    }
}

fn quick() -> bool {
    std::env::var_os("CUDRV_BENCH_QUICK").is_some()
}

fn ok(rc: Result<CUresult, cudrv::sys::MissingSymbol>, what: &str) -> Res<()> {
    match rc? {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(format!("{what} failed with {}", code.0).into()),
    }
}

/// One way to allocate.
#[derive(Clone)]
enum Alloc {
    /// Raw `cuMemAllocAsync` (device's current pool) or, with `from_pool`,
    /// `cuMemAllocFromPoolAsync` on the default pool by handle, + `cuMemFreeAsync`.
    RawAsync { d: &'static Driver, pool: Arc<DriverPool>, from_pool: bool },
    /// Raw `cuMemAlloc` + `cuMemFree`.
    RawSync { d: &'static Driver },
    /// A cudrv resource, called directly.
    Resource { name: &'static str, r: Arc<dyn MemoryResource> },
    /// `DeviceBuffer::uninit` + drop, with the device's resource set to `r`.
    Buffer { name: &'static str, r: Arc<dyn MemoryResource> },
}

impl Alloc {
    fn name(&self) -> String {
        match self {
            Alloc::RawAsync { from_pool: false, .. } => "raw cuMemAllocAsync+cuMemFreeAsync".into(),
            Alloc::RawAsync { from_pool: true, .. } => "raw cuMemAllocFromPoolAsync+cuMemFreeAsync".into(),
            Alloc::RawSync { .. } => "raw cuMemAlloc+cuMemFree".into(),
            Alloc::Resource { name, .. } => format!("cudrv {name}"),
            Alloc::Buffer { name, .. } => format!("cudrv DeviceBuffer on {name}"),
        }
    }

    fn slow(&self) -> bool {
        matches!(self, Alloc::RawSync { .. }) || self.name().contains("SyncResource")
    }

    /// Makes `r` the device's resource, for `DeviceBuffer::uninit`.
    fn prepare(&self, dev: &Device) -> Res<()> {
        if let Alloc::Buffer { r, name } = self {
            dev.set_memory_resource(r.clone(), *name)?;
        }
        Ok(())
    }

    fn alloc(&self, bytes: usize, s: &Stream) -> Res<u64> {
        let mut p = 0;
        match self {
            // SAFETY (both): valid out-pointer, pool and stream; the context is current.
            Alloc::RawAsync { d, pool, from_pool: true } => ok(
                unsafe { d.cuMemAllocFromPoolAsync(&mut p, bytes, pool.as_raw(), s.as_raw()) },
                "cuMemAllocFromPoolAsync",
            )?,
            Alloc::RawAsync { d, .. } => {
                ok(unsafe { d.cuMemAllocAsync(&mut p, bytes, s.as_raw()) }, "cuMemAllocAsync")?
            }
            // SAFETY: valid out-pointer; the context is current.
            Alloc::RawSync { d } => ok(unsafe { d.cuMemAlloc_v2(&mut p, bytes) }, "cuMemAlloc")?,
            Alloc::Resource { r, .. } => p = r.allocate(bytes, s)?,
            Alloc::Buffer { .. } => unreachable!("buffers go through `pair`"),
        }
        Ok(p)
    }

    fn free(&self, p: u64, bytes: usize, s: &Stream) -> Res<()> {
        match self {
            // SAFETY: `p` came from the pool and is unused.
            Alloc::RawAsync { d, .. } => ok(unsafe { d.cuMemFreeAsync(p, s.as_raw()) }, "cuMemFreeAsync"),
            // SAFETY: `p` came from cuMemAlloc and is unused.
            Alloc::RawSync { d } => ok(unsafe { d.cuMemFree_v2(p) }, "cuMemFree"),
            // SAFETY: `p` came from this resource with this size and is unused.
            Alloc::Resource { r, .. } => Ok(unsafe { r.deallocate(p, bytes, s) }?),
            Alloc::Buffer { .. } => unreachable!("buffers go through `pair`"),
        }
    }

    /// One alloc+free pair.
    #[inline]
    fn pair(&self, bytes: usize, s: &Stream) -> Res<()> {
        if let Alloc::Buffer { .. } = self {
            // SAFETY: the contents are never read.
            let b = unsafe { DeviceBuffer::<u8>::uninit(bytes, s) }?;
            drop(b);
            return Ok(());
        }
        let p = self.alloc(bytes, s)?;
        self.free(p, bytes, s)
    }

    fn resource(&self) -> Option<&Arc<dyn MemoryResource>> {
        match self {
            Alloc::Resource { r, .. } | Alloc::Buffer { r, .. } => Some(r),
            _ => None,
        }
    }

    fn reset(&self) -> Res<()> {
        match self {
            Alloc::RawAsync { pool, .. } => {
                pool.trim(0)?;
                pool.reset_peaks()?;
            }
            Alloc::RawSync { .. } => {}
            Alloc::Resource { r, .. } | Alloc::Buffer { r, .. } => {
                r.trim(0)?;
                r.reset_peaks()?;
            }
        }
        Ok(())
    }

    fn peak_reserved(&self) -> Option<usize> {
        match self {
            Alloc::RawAsync { pool, .. } => pool.stats().map(|s| s.peak_reserved),
            _ => self.resource().and_then(|r| r.stats()).map(|s| s.peak_reserved),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// ns per alloc+free pair: rounds of `iters` pairs, median of rounds. `streams` alternate.
fn pair_ns(dev: &Device, a: &Alloc, bytes: usize, streams: &[Stream], rounds: usize) -> Res<f64> {
    a.prepare(dev)?;
    let iters = if a.slow() {
        50
    } else if quick() {
        20
    } else {
        20_000
    };
    for i in 0..4 {
        a.pair(bytes, &streams[i % streams.len()])?;
    }
    let mut per = Vec::new();
    for _ in 0..rounds {
        per.push(round_ns(a, bytes, streams, iters)?);
    }
    for s in streams {
        s.synchronize()?;
    }
    Ok(median(per))
}

/// ns per pair of one round of `iters` pairs, `streams` alternating.
fn round_ns(a: &Alloc, bytes: usize, streams: &[Stream], iters: usize) -> Res<f64> {
    let t = Instant::now();
    for i in 0..iters {
        a.pair(bytes, &streams[i % streams.len()])?;
    }
    Ok(t.elapsed().as_nanos() as f64 / iters as f64)
}

/// `a` against `b` in adjacent rounds ([`interleaved_ns`]).
struct Paired {
    /// Medians of the rounds' ns per pair.
    a: f64,
    b: f64,
    /// The median of the rounds' `b / a`, and of `b - a` (ns): each from two rounds run one right
    /// after the other, so that a change of the driver's or the clock's state between rounds
    /// (the raw driver pair moves between 600 and 1,300 ns) moves both alike.
    ratio: f64,
    extra: f64,
    /// The 90th percentile of the rounds' `b / a`: what nine in ten stack placements stay within
    /// (the largest is the least favourable placement and the noisiest round at once).
    p90: f64,
}

/// How many stack placements the wraps table measures ([`interleaved_ns`]), [`STACK_STEP`] bytes
/// apart, one per pair of rounds: nearly a page. (Odd, so that the median is one of them.)
const PLACEMENTS: usize = 63;

/// The step between two stack placements, in bytes.
const STACK_STEP: usize = 64;

/// Runs `f` with the stack `k % PLACEMENTS` steps of [`STACK_STEP`] bytes lower. On the H200's
/// host, with the same binary and address-space randomisation off, the stack's place alone moved
/// `DeviceBuffer`'s ratio to its pool's pair between 1.01 and 1.24 (BENCHMARKS.md, run 40), most
/// likely because the CPU compares the low 12 bits of addresses to order a load after earlier
/// stores, and the buffer's fields on the stack then match, or not, the pool's on the heap (that
/// machine has no counters to confirm it). A process measures one placement; each pair of rounds
/// here measures another, so that the table shows the spread rather than the luck of one
/// process.
fn at_stack_placement<R>(k: usize, f: &mut dyn FnMut() -> R) -> R {
    #[inline(never)]
    fn lower<const N: usize, R>(f: &mut dyn FnMut() -> R) -> R {
        let pad = std::hint::black_box([0u8; N]);
        let r = f();
        std::hint::black_box(&pad);
        r
    }
    macro_rules! placements {
        ($($n:literal)*) => {
            match k % PLACEMENTS {
                $($n => lower::<{ $n * STACK_STEP }, R>(f),)*
                _ => unreachable!("fewer than PLACEMENTS"),
            }
        };
    }
    placements!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
        32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62)
}

/// ns per pair of `a` and of `b` on stream `s`, in `rounds` pairs of adjacent rounds of the same
/// number of pairs, which of the two goes first alternating, each pair at its own stack placement
/// ([`at_stack_placement`]).
fn interleaved_ns(dev: &Device, a: &Alloc, b: &Alloc, bytes: usize, s: &Stream, rounds: usize) -> Res<Paired> {
    a.prepare(dev)?;
    b.prepare(dev)?;
    let iters = if quick() { 20 } else { 5_000 };
    for _ in 0..4 {
        a.pair(bytes, s)?;
        b.pair(bytes, s)?;
    }
    let (mut pa, mut pb) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let one = |x: &Alloc| round_ns(x, bytes, std::slice::from_ref(s), iters);
        // Placements in a scrambled order (17 is prime to PLACEMENTS), so that which of the two
        // goes first does not follow the placement.
        let (ta, tb) = at_stack_placement(round * 17, &mut || -> Res<(f64, f64)> {
            Ok(if round % 2 == 0 {
                let ta = one(a)?;
                (ta, one(b)?)
            } else {
                let tb = one(b)?;
                (one(a)?, tb)
            })
        })?;
        pa.push(ta);
        pb.push(tb);
    }
    s.synchronize()?;
    let mut ratios: Vec<f64> = pa.iter().zip(&pb).map(|(a, b)| b / a).collect();
    ratios.sort_by(f64::total_cmp);
    let p90 = ratios[(ratios.len() * 9 / 10).min(ratios.len() - 1)];
    let ratio = median(ratios);
    let extra = median(pa.iter().zip(&pb).map(|(a, b)| b - a).collect());
    Ok(Paired { a: median(pa), b: median(pb), ratio, extra, p90 })
}

/// A buffer allocated on `a`, used on `b` (`record_use`), dropped: ns per round.
fn cross_use_ns(dev: &Device, r: &Arc<dyn MemoryResource>, a: &Stream, b: &Stream) -> Res<f64> {
    dev.set_memory_resource(r.clone(), "bench")?;
    let iters = if quick() { 20 } else { 20_000 };
    let mut per = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..iters {
            // SAFETY: the contents are never read.
            let buf = unsafe { DeviceBuffer::<u8>::uninit(1 << 20, a) }?;
            buf.record_use(b)?;
            drop(buf);
        }
        per.push(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    a.synchronize()?;
    b.synchronize()?;
    Ok(median(per))
}

/// Pairs per second of `threads` threads, each on its own stream: the median of fixed-time
/// rounds.
fn threads_rate(dev: &Device, a: &Alloc, threads: usize) -> Res<f64> {
    a.prepare(dev)?;
    // Fixed-time rounds: a round of a fixed number of pairs lasts a few milliseconds at 60 ns a
    // pair, where one thread started late decides the figure.
    let (rounds, window) = if quick() { (1, Duration::from_millis(5)) } else { (5, Duration::from_millis(100)) };
    let mut rates = Vec::new();
    for _ in 0..rounds {
        rates.push(threads_round(dev, a, threads, window)?);
    }
    Ok(median(rates))
}

/// `threads` threads, each on its own stream, pair for `window`: pairs per second, all threads.
fn threads_round(dev: &Device, a: &Alloc, threads: usize, window: Duration) -> Res<f64> {
    let barrier = Arc::new(Barrier::new(threads + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (a, dev, barrier, stop) = (a.clone(), *dev, barrier.clone(), stop.clone());
            std::thread::spawn(move || -> Res<(u64, Instant)> {
                let ctx = dev.primary_context()?;
                let _bound = ctx.bind()?; // the raw driver needs the context current
                let s = Stream::new(&dev)?;
                for _ in 0..4 {
                    a.pair(1 << 20, &s)?;
                }
                barrier.wait();
                // The stop flag is read once per batch, off the measured pair's path.
                let batch = if a.slow() { 1 } else { 64 };
                let mut pairs = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..batch {
                        a.pair(1 << 20, &s)?;
                    }
                    pairs += batch;
                }
                let end = Instant::now();
                s.synchronize()?;
                Ok((pairs, end))
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    std::thread::sleep(window);
    stop.store(true, Ordering::Relaxed);
    let (mut pairs, mut end) = (0, start);
    for h in handles {
        let (n, t) = h.join().map_err(|_| "a bench thread panicked")??;
        pairs += n;
        end = end.max(t);
    }
    Ok(pairs as f64 / (end - start).as_secs_f64())
}

/// Replays a trace on its streams; returns ns per event (the trace's leftovers freed after).
fn replay_once(a: &Alloc, t: &Trace, streams: &[Stream]) -> Res<f64> {
    let mut table = t.replay_table();
    let start = Instant::now();
    for (i, ev) in t.events().iter().enumerate() {
        match *ev {
            TraceEvent::Alloc { size, stream, .. } => table.allocated(i, a.alloc(size, &streams[stream])?),
            TraceEvent::Free { size, stream, .. } => {
                let p = table.freed(i).ok_or("a free of an unknown id")?;
                a.free(p, size, &streams[stream])?;
            }
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / t.events().len() as f64;
    // In the order of their ids, so that the next replay starts from the same pool every time.
    for (p, size, stream) in table.into_live() {
        a.free(p, size, &streams[stream])?;
    }
    for s in streams {
        s.synchronize()?;
    }
    Ok(ns)
}

/// The argument that runs only [`wraps_table`].
const WRAPS_ARG: &str = "--wraps";

/// `DeviceBuffer` against what it wraps, in adjacent rounds ([`interleaved_ns`]): a row measured minutes after
/// another drifts with the clock speed and the driver's state by as much as the overhead.
fn wraps_table(dev: &Device, allocs: &[Alloc], sizes: &[(usize, &str)], s: &Stream) -> Res<()> {
    println!(
        "\n## DeviceBuffer against what it wraps (ns per pair: medians of {PLACEMENTS} rounds; ratio: the median \
         of the ratios, and differences, of adjacent rounds, each pair at its own stack placement ({PLACEMENTS}, \
         {STACK_STEP} bytes apart); p90: the ratio nine in ten placements stay within)\n"
    );
    print!("| DeviceBuffer on | against |");
    for (_, n) in sizes {
        print!(" {n}: base | buffer | ratio |");
    }
    println!();
    println!("|---|---|{}", "---|---|---|".repeat(sizes.len()));
    for buffer in allocs.iter().filter(|a| matches!(a, Alloc::Buffer { .. }) && !a.slow()) {
        let Alloc::Buffer { name, r } = buffer else { unreachable!() };
        let mut bases = vec![Alloc::Resource { name, r: r.clone() }];
        if *name == "DriverPool" {
            // The raw pair on the same (default) pool, by handle: what DriverPool calls.
            bases.extend(allocs.iter().filter(|a| matches!(a, Alloc::RawAsync { from_pool: true, .. })).cloned());
        }
        for base in &bases {
            print!("| {name} | {} |", base.name());
            for (bytes, _) in sizes {
                let p = interleaved_ns(dev, base, buffer, *bytes, s, PLACEMENTS)?;
                print!(" {:.0} | {:.0} | {:.3}x ({:+.0} ns; p90 {:.3}x) |", p.a, p.b, p.ratio, p.extra, p.p90);
            }
            println!();
            buffer.reset()?;
        }
    }
    own_cost(dev, s)
}

/// A resource that does nothing: hands out one address and takes it back, with no driver call,
/// so that `DeviceBuffer` over it measures cudrv's own cost per pair, apart from any driver's.
#[derive(Debug)]
struct Nothing(Device);

// SAFETY: its one address is never used: the buffers made over it are only allocated and dropped.
unsafe impl MemoryResource for Nothing {
    fn allocate(&self, _bytes: usize, _s: &Stream) -> cudrv::Result<cudrv::memory::DevicePtr> {
        Ok(std::hint::black_box(1 << 40))
    }

    unsafe fn deallocate(&self, ptr: cudrv::memory::DevicePtr, _bytes: usize, _s: &Stream) -> cudrv::Result<()> {
        std::hint::black_box(ptr);
        Ok(())
    }

    fn device(&self) -> Device {
        self.0
    }

    fn kind(&self) -> cudrv::memory::ResourceKind {
        cudrv::memory::ResourceKind::Custom
    }
}

/// `DeviceBuffer`'s own cost: a pair over [`Nothing`] against `Nothing`'s own pair, in
/// alternating rounds (what a buffer adds to any resource's pair that is not a `StreamOrderedPool`,
/// which buffers call directly).
fn own_cost(dev: &Device, s: &Stream) -> Res<()> {
    let r: Arc<dyn MemoryResource> = Arc::new(Nothing(*dev));
    let (base, buffer) = (Alloc::Resource { name: "nothing", r: r.clone() }, Alloc::Buffer { name: "nothing", r });
    let p = interleaved_ns(dev, &base, &buffer, 256, s, PLACEMENTS)?;
    println!(
        "\nDeviceBuffer's own cost, over a resource that does nothing: {:.1} ns per pair against {:.1} ns \
         for the resource's pair ({:+.1} ns, the median of adjacent rounds' differences)",
        p.b, p.a, p.extra
    );
    Ok(())
}

fn run() -> Res<()> {
    let dev = Device::get(0)?;
    let ctx = dev.primary_context()?;
    let _bound = ctx.bind()?;
    let d = Driver::global()?;
    let caps = dev.capabilities()?;
    let wraps_only = std::env::args().any(|a| a == WRAPS_ARG);
    if !wraps_only {
        println!(
            "# memory bench: {} (CC {}.{}), driver {}, driver model {}, cudrv headers {}",
            dev.name()?,
            caps.compute_capability.0,
            caps.compute_capability.1,
            d.version(),
            caps.driver_model,
            cudrv::HEADER_VERSION
        );
    }
    let s = Stream::new(&dev)?;
    let s2 = Stream::new(&dev)?;

    let mut resources: Vec<(&'static str, Arc<dyn MemoryResource>)> = Vec::new();
    let mut allocs: Vec<Alloc> = Vec::new();
    if caps.memory_pools {
        let default = Arc::new(DriverPool::default_pool(&dev)?); // raises the default pool's threshold
        allocs.push(Alloc::RawAsync { d, pool: default.clone(), from_pool: false });
        allocs.push(Alloc::RawAsync { d, pool: default.clone(), from_pool: true });
        resources.push(("DriverPool", Arc::new(DriverPool::default_pool(&dev)?)));
    }
    allocs.push(Alloc::RawSync { d });
    resources.push(("StreamOrderedPool", Arc::new(StreamOrderedPool::new(&dev)?)));
    resources.push(("SyncResource", Arc::new(SyncResource::new(&dev)?)));
    for (name, r) in &resources {
        allocs.push(Alloc::Resource { name, r: r.clone() });
        allocs.push(Alloc::Buffer { name, r: r.clone() });
    }

    let mut sizes = vec![(256, "256 B"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB"), (1 << 30, "1 GiB")];
    if quick() {
        sizes.truncate(2);
    }
    if wraps_only {
        return wraps_table(&dev, &allocs, &sizes, &s);
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
            let ns = pair_ns(&dev, a, *bytes, std::slice::from_ref(&s), 7)?;
            if k == 0 {
                base[i] = ns;
            }
            print!(" {ns:.0} | {:.3}x |", ns / base[i]);
        }
        println!();
        a.reset()?;
    }

    // DeviceBuffer against what it wraps, in a process of its own (the same program, with
    // `--wraps`): ratios of 20 ns differences moved by 0.1-0.2 with the state the rows above
    // leave behind (heap, code paths warmed), while fresh processes agreed within 0.03.
    let child = std::env::current_exe()
        .and_then(|exe| std::process::Command::new(exe).arg(WRAPS_ARG).stderr(std::process::Stdio::inherit()).output());
    match child {
        Ok(out) if out.status.success() => print!("{}", String::from_utf8_lossy(&out.stdout)),
        _ => wraps_table(&dev, &allocs, &sizes, &s)?,
    }

    println!("\n## cross-stream (ns per pair; ratio vs the first row)\n");
    println!("Alternating: each pair on the other stream than the last. Buffer: allocated on one stream, used");
    println!("on a second (`record_use`), dropped.\n");
    println!("| allocator | alternating, 1 MiB | ratio |\n|---|---|---|");
    let mut cbase = 0.0;
    for (k, a) in allocs.iter().enumerate() {
        let ns = pair_ns(&dev, a, 1 << 20, &[s.clone(), s2.clone()], 7)?;
        if k == 0 {
            cbase = ns;
        }
        println!("| {} | {ns:.0} | {:.3}x |", a.name(), ns / cbase);
        a.reset()?;
    }
    println!("\n| resource | buffer used on a second stream, 1 MiB |\n|---|---|");
    for (name, r) in &resources {
        if *name == "SyncResource" {
            continue;
        }
        let ns = cross_use_ns(&dev, r, &s, &s2)?;
        println!("| {name} | {ns:.0} |");
        r.trim(0)?;
    }

    println!("\n## threads: each thread allocates and frees 1 MiB on its own stream (pairs per second, all threads)\n");
    let counts: &[usize] = if quick() { &[1, 2] } else { &[1, 2, 4, 8, 16] };
    print!("| allocator |");
    for n in counts {
        print!(" {n} |");
    }
    println!(" {}/1 |", counts.last().unwrap_or(&1));
    println!("|---|{}---|", "---|".repeat(counts.len()));
    for a in allocs.iter().filter(|a| !a.slow()) {
        print!("| {} |", a.name());
        let mut first = 0.0;
        let mut last = 0.0;
        for (i, &n) in counts.iter().enumerate() {
            let rate = threads_rate(&dev, a, n)?;
            if i == 0 {
                first = rate;
            }
            last = rate;
            print!(" {:.2}M |", rate / 1e6);
        }
        println!(" {:.2}x |", last / first);
        a.reset()?;
    }

    println!("\n## trace replay (ns per event; cold: after a full trim; warm: the next replay)\n");
    println!(
        "| allocator | trace | events | cold ns/event | ratio | warm ns/event | ratio | peak reserved / peak live |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/traces");
    let dir = std::env::var("CUDRV_TRACE_DIR").unwrap_or_else(|_| root.to_string());
    let mut files: Vec<_> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "csv"))
        .collect();
    files.sort();
    for path in files {
        let t = Trace::parse(&std::fs::read_to_string(&path)?)?;
        let name = path.file_stem().unwrap_or_default().to_string_lossy().into_owned();
        let streams: Vec<Stream> = (0..t.streams().max(1)).map(|_| Stream::new(&dev)).collect::<Result<_, _>>()?;
        let (mut first_cold, mut first_warm) = (0.0, 0.0);
        for (k, a) in allocs.iter().filter(|a| !matches!(a, Alloc::Buffer { .. })).enumerate() {
            // cuMemAlloc costs ~60 µs: skip the synchronous allocators on the long traces.
            if a.slow() && (t.events().len() > 20_000 || quick()) {
                continue;
            }
            a.reset()?;
            let cold = replay_once(a, &t, &streams)?;
            let warm = replay_once(a, &t, &streams)?;
            let ratio =
                a.peak_reserved().map_or("n/a".to_string(), |r| format!("{:.3}", r as f64 / t.peak_live() as f64));
            a.reset()?;
            if k == 0 {
                (first_cold, first_warm) = (cold, warm);
            }
            let n = t.events().len();
            println!(
                "| {} | {name} | {n} | {cold:.0} | {:.3}x | {warm:.0} | {:.3}x | {ratio} |",
                a.name(),
                cold / first_cold,
                warm / first_warm
            );
        }
    }
    Ok(())
}

//! A data-integrity stress test of cudrv's memory resources: many threads and streams allocating,
//! filling, copying, sharing across streams and freeing device buffers for a given time, and
//! checking every byte of the buffers it reads back.
//!
//! ```text
//! cargo run --release --example stress -- [--seconds F] [--threads N] [--streams M]
//!     [--max-size BYTES] [--seed S] [--resource driver-pool|pool|sync] [--device D]
//! ```
//!
//! * `--seconds` (default 10): how long to run.
//! * `--threads` (default 4) × `--streams` (default 2): each thread owns `M` streams; the "second
//!   stream" of an operation may be any of the `N × M` streams, so streams are shared across threads.
//! * `--max-size` (default 256 MiB): allocation sizes run from 1 byte to this, log-uniformly (most are
//!   small). Each thread keeps at most 4 × max-size bytes and 64 buffers live.
//! * `--seed` (default: from the clock): the run is random, but reproducible in its choices.
//! * `--resource`: the memory resource, set with `Device::set_memory_resource`. Without it the device's
//!   default is used, which `CUDRV_MEMORY_RESOURCE=driver-pool|pool|sync` overrides.
//!
//! Each thread runs random sequences of:
//! * **allocate** a `DeviceBuffer<u8>` (on one of its streams, or on any stream, so that it is later
//!   freed on a stream of another thread) and fill it with a byte derived from (allocation id,
//!   generation);
//! * **refill** a buffer on its own stream, with the next generation;
//! * **copy** a buffer device to device into a new buffer on another stream (`copy_from`);
//! * **use on a second stream**: `record_use`, then a memset of the buffer's upper half queued there
//!   (a raw driver call), the second stream ordered after the buffer's earlier work by `wait_stream`
//!   or by an `Event` and `wait_event`;
//! * **free** a buffer (drop it, with work possibly still queued on other streams: cudrv must order
//!   the free after it);
//! * **verify** a buffer: copy it back and check every byte.
//!
//! Every operation on a buffer is ordered after the previous one (the stream of the new one waits for
//! the stream of the last), as a correct program must; everything else (frees, reuse of memory,
//! events) is left to cudrv. At the end every live buffer is verified.
//!
//! The last line is the summary, for example
//! `stress: resource=StreamOrderedPool ops=123456 ops_per_s=12345.6 bytes_verified=987654321 mismatches=0 ...`.
//! The exit status is 1 when a byte differed or an operation failed, 2 for bad arguments (checked
//! before anything is allocated: an unknown flag, a flag without its value, a value that is not a
//! number or out of range, a `--max-size` larger than the device's memory), 0 for `--help`.
//!
//! On the fake driver (device memory is host memory there; keep sizes small):
//! `CUDRV_DRIVER_PATH=<fake libcuda.so> CUDRV_FAKE_MODE=tcc cargo run --example stress -- --seconds 2 --max-size 1048576`

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudrv::memory::{DeviceBuffer, DriverPool, MemoryResource, StreamOrderedPool, SyncResource};
use cudrv::sys::{CUresult, Driver};
use cudrv::{Device, Event, Stream};

/// The command line.
#[derive(Debug, Clone)]
struct Options {
    duration: Duration,
    threads: usize,
    streams: usize,
    max_size: usize,
    seed: u64,
    resource: Option<String>,
    device: usize,
}

const USAGE: &str = "\
usage: stress [--seconds F] [--threads N] [--streams M] [--max-size BYTES] [--seed S]
              [--resource driver-pool|pool|sync] [--device D]
  --seconds F        how long to run (default 10)
  --threads N        worker threads, 1 to 1024 (default 4)
  --streams M        streams per thread, 1 to 1024 (default 2)
  --max-size BYTES   the largest allocation (default 268435456)
  --seed S           the seed of the random choices (default: from the clock)
  --resource R       the memory resource: driver-pool, pool or sync (default: the device's)
  --device D         the device (default 0)
  -h, --help         print this help";

/// Most threads, and most streams per thread.
const MAX_THREADS: usize = 1024;
const MAX_STREAMS: usize = 1024;

/// The options, or `None` for `--help`. Errors are messages for bad arguments.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Options>, String> {
    let mut o = Options {
        duration: Duration::from_secs(10),
        threads: 4,
        streams: 2,
        max_size: 256 << 20,
        seed: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64),
        resource: None,
        device: 0,
    };
    fn number<T: std::str::FromStr<Err: std::fmt::Display>>(flag: &str, value: &str) -> Result<T, String> {
        value.parse().map_err(|e| format!("{flag} {value}: {e}"))
    }
    fn in_range(flag: &str, value: &str, max: usize) -> Result<usize, String> {
        match number(flag, value)? {
            n @ 1.. if n <= max => Ok(n),
            _ => Err(format!("{flag} {value}: must be from 1 to {max}")),
        }
    }
    while let Some(flag) = args.next() {
        const TAKES_VALUE: [&str; 7] =
            ["--seconds", "--threads", "--streams", "--max-size", "--seed", "--resource", "--device"];
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        if !TAKES_VALUE.contains(&flag.as_str()) {
            return Err(format!("unknown argument {flag}"));
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--seconds" => {
                let seconds: f64 = number(&flag, &value)?;
                if !(seconds.is_finite() && seconds >= 0.0) {
                    return Err(format!("--seconds {value}: must be a number of seconds, 0 or more"));
                }
                // Refused here, before `Instant + Duration` could panic.
                o.duration = Duration::try_from_secs_f64(seconds)
                    .ok()
                    .filter(|d| Instant::now().checked_add(*d).is_some())
                    .ok_or_else(|| format!("--seconds {value}: too long"))?;
            }
            "--threads" => o.threads = in_range(&flag, &value, MAX_THREADS)?,
            "--streams" => o.streams = in_range(&flag, &value, MAX_STREAMS)?,
            "--max-size" => o.max_size = in_range(&flag, &value, usize::MAX)?,
            "--seed" => o.seed = number(&flag, &value)?,
            "--device" => o.device = number(&flag, &value)?,
            "--resource" if ["driver-pool", "pool", "sync"].contains(&value.as_str()) => o.resource = Some(value),
            "--resource" => return Err(format!("--resource {value}: expected driver-pool, pool or sync")),
            _ => unreachable!("every flag that takes a value is handled"),
        }
    }
    Ok(Some(o))
}

/// SplitMix64: a small, good, seedable generator (no dependency needed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A size from 1 to `max`, log-uniform: as many between 1 and 16 bytes as between 1 and 16 MiB.
    fn size(&mut self, max: usize) -> usize {
        let s = ((max as f64 + 1.0).ln() * self.unit()).exp() as usize;
        s.clamp(1, max)
    }
}

/// The SplitMix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The fill byte of allocation `id` at generation `generation`: never 0 (fresh memory often is),
/// and never `avoid` (so that the two halves of a buffer differ).
fn pattern(id: u64, generation: u64, avoid: u8) -> u8 {
    let mut b = mix(id.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ generation) as u8;
    if b == 0 {
        b = 0xa5;
    }
    if b == avoid {
        b = b.wrapping_add(0x3b) | 1;
    }
    b
}

/// A live buffer and what it must hold: `low` in `[0, split)` and `high` in `[split, len)`.
struct Slot {
    buf: DeviceBuffer<u8>,
    id: u64,
    generation: u64,
    low: u8,
    high: u8,
    split: usize,
    /// The stream of the last operation on the buffer: the next one, on any stream, waits for it.
    last: Stream,
}

/// Totals over all threads.
#[derive(Default)]
struct Totals {
    ops: AtomicU64,
    allocs: AtomicU64,
    frees: AtomicU64,
    copies: AtomicU64,
    second_stream_uses: AtomicU64,
    bytes_allocated: AtomicU64,
    bytes_verified: AtomicU64,
    buffers_verified: AtomicU64,
    mismatches: AtomicU64,
    errors: AtomicU64,
}

fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("stress: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(Stop::BadArgument(e)) => {
            eprintln!("stress: {e}");
            ExitCode::from(2)
        }
        Err(Stop::Failed(e)) => {
            eprintln!("stress: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Why `run` stopped early: an argument that does not suit the device (status 2) or a failure
/// (status 1).
enum Stop {
    BadArgument(String),
    Failed(String),
}

impl From<String> for Stop {
    fn from(e: String) -> Stop {
        Stop::Failed(e)
    }
}

/// Errors met in cudrv's `Drop`s (a free that failed): counted as errors.
static DROP_ERRORS: AtomicU64 = AtomicU64::new(0);

fn run(o: &Options) -> Result<bool, Stop> {
    cudrv::set_drop_error_hook(|e| {
        DROP_ERRORS.fetch_add(1, Ordering::Relaxed);
        eprintln!("stress: error in a drop: {e}");
    });
    let device = Device::get(o.device).map_err(|e| e.to_string())?;
    let memory = device.total_memory().map_err(|e| e.to_string())?;
    if o.max_size > memory {
        return Err(Stop::BadArgument(format!(
            "--max-size {}: larger than the memory of device {} ({memory} bytes)",
            o.max_size, o.device
        )));
    }
    if let Some(name) = &o.resource {
        let resource: Arc<dyn MemoryResource> = match name.as_str() {
            "driver-pool" => Arc::new(DriverPool::default_pool(&device).map_err(|e| e.to_string())?),
            "pool" => Arc::new(StreamOrderedPool::new(&device).map_err(|e| e.to_string())?),
            "sync" => Arc::new(SyncResource::new(&device).map_err(|e| e.to_string())?),
            other => unreachable!("parse_args accepts no --resource {other}"),
        };
        device.set_memory_resource(resource, format!("stress --resource {name}")).map_err(|e| e.to_string())?;
    }
    let (resource, choice) = device.memory_resource_choice().map_err(|e| e.to_string())?;
    eprintln!(
        "stress: device {} ({}), driver {}, {} ({}); {} threads x {} streams, {} s, sizes 1..{} bytes, seed {}",
        o.device,
        device.name().unwrap_or_default(),
        cudrv::driver_version().unwrap_or(0),
        choice.kind,
        choice.reason,
        o.threads,
        o.streams,
        o.duration.as_secs_f64(),
        o.max_size,
        o.seed
    );

    let streams: Vec<Stream> = (0..o.threads * o.streams)
        .map(|_| Stream::new(&device))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let totals = Totals::default();
    let next_id = AtomicU64::new(1);
    let start = Instant::now();
    let deadline = start.checked_add(o.duration).ok_or_else(|| Stop::BadArgument("--seconds: too long".into()))?;
    std::thread::scope(|scope| {
        for t in 0..o.threads {
            let (streams, totals, next_id) = (&streams, &totals, &next_id);
            let spawned = std::thread::Builder::new().spawn_scoped(scope, move || {
                let mut worker = Worker {
                    o,
                    own: &streams[t * o.streams..(t + 1) * o.streams],
                    all: streams,
                    rng: Rng(o.seed ^ mix(t as u64 + 1)),
                    live: Vec::new(),
                    live_bytes: 0,
                    host: Vec::new(),
                    totals,
                    next_id,
                    thread: t,
                };
                if let Err(e) = worker.run(deadline) {
                    totals.errors.fetch_add(1, Ordering::Relaxed);
                    eprintln!("stress: thread {t}: error: {e}");
                }
                // Whatever happened, free what is left (in stream order, no sync).
                worker.live.clear();
            });
            if let Err(e) = spawned {
                totals.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("stress: thread {t}: cannot start it: {e}");
                break;
            }
        }
    });
    for s in &streams {
        if let Err(e) = s.synchronize() {
            totals.errors.fetch_add(1, Ordering::Relaxed);
            eprintln!("stress: synchronize: {e}");
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(stats) = resource.stats() {
        eprintln!(
            "stress: resource stats: reserved {} (peak {}), in use {} (peak {}), {} driver allocations",
            stats.reserved, stats.peak_reserved, stats.in_use, stats.peak_in_use, stats.driver_allocations
        );
    }
    if let Err(e) = resource.trim(0) {
        totals.errors.fetch_add(1, Ordering::Relaxed);
        eprintln!("stress: trim: {e}");
    }
    drop(streams);

    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let errors = get(&totals.errors) + DROP_ERRORS.load(Ordering::Relaxed);
    let mismatches = get(&totals.mismatches);
    eprintln!(
        "stress: {} allocations ({} bytes), {} frees, {} copies, {} second-stream uses, {} buffers verified, {} errors",
        get(&totals.allocs),
        get(&totals.bytes_allocated),
        get(&totals.frees),
        get(&totals.copies),
        get(&totals.second_stream_uses),
        get(&totals.buffers_verified),
        errors
    );
    let ops = get(&totals.ops);
    println!(
        "stress: resource={} ops={} ops_per_s={:.1} bytes_verified={} mismatches={} errors={} threads={} streams={} \
         seconds={:.2} max_size={} seed={}",
        choice.kind,
        ops,
        ops as f64 / elapsed.max(1e-9),
        get(&totals.bytes_verified),
        mismatches,
        errors,
        o.threads,
        o.streams,
        elapsed,
        o.max_size,
        o.seed
    );
    Ok(mismatches == 0 && errors == 0)
}

/// One thread's state.
struct Worker<'a> {
    o: &'a Options,
    /// This thread's streams: where it allocates most buffers.
    own: &'a [Stream],
    /// Every stream: second streams, and some allocations, come from here.
    all: &'a [Stream],
    rng: Rng,
    live: Vec<Slot>,
    live_bytes: usize,
    /// Reused host memory for verification.
    host: Vec<u8>,
    totals: &'a Totals,
    next_id: &'a AtomicU64,
    thread: usize,
}

/// Most buffers a thread keeps live.
const MAX_LIVE: usize = 64;
/// At most this many mismatch reports are printed (per thread).
const MAX_REPORTS: u64 = 10;

type Res<T> = Result<T, String>;

fn err(what: &str) -> impl Fn(cudrv::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

impl Worker<'_> {
    fn run(&mut self, deadline: Instant) -> Res<()> {
        let budget = self.o.max_size.saturating_mul(4);
        while Instant::now() < deadline {
            let roll = self.rng.below(100);
            if self.live.is_empty() || (roll < 30 && self.live.len() < MAX_LIVE) {
                let size = self.rng.size(self.o.max_size);
                while !self.live.is_empty() && (self.live_bytes + size > budget || self.live.len() >= MAX_LIVE) {
                    let i = self.rng.below(self.live.len());
                    self.free(i)?;
                }
                self.allocate(size)?;
            } else {
                let i = self.rng.below(self.live.len());
                match roll {
                    30..=44 => self.refill(i)?,
                    45..=57 => {
                        if self.live_bytes + self.live[i].buf.len() <= budget && self.live.len() < MAX_LIVE {
                            self.copy(i)?;
                        } else {
                            self.free(i)?;
                        }
                    }
                    58..=72 => self.use_on_second_stream(i)?,
                    73..=87 => {
                        if self.rng.below(3) == 0 {
                            self.verify(i)?;
                        }
                        self.free(i)?;
                    }
                    _ => self.verify(i)?,
                }
            }
            self.totals.ops.fetch_add(1, Ordering::Relaxed);
        }
        // The end: every live buffer is checked.
        for i in 0..self.live.len() {
            self.verify(i)?;
        }
        Ok(())
    }

    /// Makes `stream` wait for the last operation on slot `i`, by `wait_stream` or by an event.
    fn order_after_last(&mut self, i: usize, stream: &Stream) -> Res<()> {
        let last = self.live[i].last.clone();
        if last == *stream {
            return Ok(());
        }
        if self.rng.below(2) == 0 {
            stream.wait_stream(&last).map_err(err("wait_stream"))
        } else {
            let event = Event::new(&stream.device()).map_err(err("Event::new"))?;
            event.record(&last).map_err(err("Event::record"))?;
            stream.wait_event(&event).map_err(err("wait_event"))
        }
    }

    fn pick_stream(&mut self) -> Stream {
        if self.rng.below(4) == 0 {
            self.all[self.rng.below(self.all.len())].clone()
        } else {
            self.own[self.rng.below(self.own.len())].clone()
        }
    }

    fn allocate(&mut self, size: usize) -> Res<()> {
        let stream = self.pick_stream();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the contents are overwritten at once by the fill queued below on the same stream,
        // and any byte value is a valid u8.
        let mut buf = unsafe { DeviceBuffer::<u8>::uninit(size, &stream) }.map_err(err("allocate"))?;
        let low = pattern(id, 0, 0);
        if self.rng.below(2) == 0 { buf.fill(low) } else { buf.memset(low) }.map_err(err("fill"))?;
        self.totals.allocs.fetch_add(1, Ordering::Relaxed);
        self.totals.bytes_allocated.fetch_add(size as u64, Ordering::Relaxed);
        self.live_bytes += size;
        self.live.push(Slot { buf, id, generation: 0, low, high: low, split: size, last: stream });
        Ok(())
    }

    /// Refills slot `i` on its own stream with the next generation.
    fn refill(&mut self, i: usize) -> Res<()> {
        let stream = self.live[i].buf.stream().clone();
        self.order_after_last(i, &stream)?;
        let slot = &mut self.live[i];
        slot.generation += 1;
        slot.low = pattern(slot.id, slot.generation, 0);
        slot.high = slot.low;
        slot.split = slot.buf.len();
        slot.buf.memset(slot.low).map_err(err("memset"))?;
        slot.last = stream;
        Ok(())
    }

    /// Copies slot `i` into a new buffer of the same size, allocated on another stream, with
    /// `copy_from` (queued on the new buffer's stream).
    fn copy(&mut self, i: usize) -> Res<()> {
        let stream = self.pick_stream();
        let len = self.live[i].buf.len();
        // SAFETY: overwritten at once by the copy queued below on the same stream.
        let mut dst = unsafe { DeviceBuffer::<u8>::uninit(len, &stream) }.map_err(err("allocate"))?;
        self.order_after_last(i, &stream)?;
        dst.copy_from(&self.live[i].buf).map_err(err("copy_from"))?;
        let src = &mut self.live[i];
        src.last = stream.clone();
        let (low, high, split) = (src.low, src.high, src.split);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.totals.allocs.fetch_add(1, Ordering::Relaxed);
        self.totals.copies.fetch_add(1, Ordering::Relaxed);
        self.totals.bytes_allocated.fetch_add(len as u64, Ordering::Relaxed);
        self.live_bytes += len;
        self.live.push(Slot { buf: dst, id, generation: 0, low, high, split, last: stream });
        Ok(())
    }

    /// Writes the upper half of slot `i` on a stream other than its own, with a raw memset (so the
    /// use is recorded by hand, as for any work cudrv does not queue itself).
    fn use_on_second_stream(&mut self, i: usize) -> Res<()> {
        let own = self.live[i].buf.stream().clone();
        let candidates: Vec<&Stream> = self.all.iter().filter(|s| **s != own).collect();
        if candidates.is_empty() {
            return self.refill(i);
        }
        let second = candidates[self.rng.below(candidates.len())].clone();
        self.order_after_last(i, &second)?;
        let slot = &mut self.live[i];
        slot.buf.record_use(&second).map_err(err("record_use"))?;
        slot.generation += 1;
        let split = slot.buf.len() / 2;
        let high = pattern(slot.id, slot.generation, slot.low);
        let bytes = slot.buf.len() - split;
        let _bound = second.context().bind().map_err(err("bind"))?;
        let driver = Driver::global().map_err(|e| e.to_string())?;
        // SAFETY: `[split, len)` lies inside the live buffer; the use on `second` is recorded, so the
        // buffer's free waits for this memset; the context of `second` is current.
        let rc = unsafe { driver.cuMemsetD8Async(slot.buf.as_raw() + split as u64, high, bytes, second.as_raw()) };
        drop(_bound);
        match rc {
            Ok(CUresult::CUDA_SUCCESS) => {}
            other => return Err(format!("cuMemsetD8Async on the second stream: {other:?}")),
        }
        slot.high = high;
        slot.split = split;
        slot.last = second;
        self.totals.second_stream_uses.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Frees slot `i` (drops it, with no synchronisation).
    fn free(&mut self, i: usize) -> Res<()> {
        let slot = self.live.swap_remove(i);
        self.live_bytes -= slot.buf.len();
        // Work queued on other streams since its last own-stream use was recorded with record_use
        // (or by copy_from): the drop orders the free after it.
        drop(slot);
        self.totals.frees.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Copies slot `i` back (on its own stream, after its last operation) and checks every byte.
    fn verify(&mut self, i: usize) -> Res<()> {
        let own = self.live[i].buf.stream().clone();
        self.order_after_last(i, &own)?;
        let slot = &mut self.live[i];
        slot.last = own;
        let len = slot.buf.len();
        self.host.clear();
        self.host.try_reserve_exact(len).map_err(|e| format!("out of host memory to verify {len} bytes: {e}"))?;
        self.host.resize(len, 0);
        slot.buf.copy_to_host(&mut self.host).map_err(err("copy_to_host"))?;
        let bad_low = self.host[..slot.split].iter().position(|b| *b != slot.low);
        let bad_high = self.host[slot.split..].iter().position(|b| *b != slot.high).map(|p| p + slot.split);
        if let Some(at) = bad_low.or(bad_high) {
            let n = self.totals.mismatches.fetch_add(1, Ordering::Relaxed);
            if n < MAX_REPORTS {
                let wrong = self.host[..slot.split].iter().filter(|b| **b != slot.low).count()
                    + self.host[slot.split..].iter().filter(|b| **b != slot.high).count();
                let expected = if at < slot.split { slot.low } else { slot.high };
                eprintln!(
                    "stress: MISMATCH thread {} buffer {} (generation {}, {} bytes at {:#x}, stream {}): byte {} is \
                     {:#04x}, expected {:#04x}; {} wrong bytes",
                    self.thread,
                    slot.id,
                    slot.generation,
                    len,
                    slot.buf.as_raw(),
                    slot.buf.stream().id(),
                    at,
                    self.host[at],
                    expected,
                    wrong
                );
            }
        }
        self.totals.bytes_verified.fetch_add(len as u64, Ordering::Relaxed);
        self.totals.buffers_verified.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

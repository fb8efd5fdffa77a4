//! Property tests: random workloads on one thread (every operation, fault injection, streams
//! that go away), the same with threads racing, and synthetic traces with heavy-tailed sizes.
//! The mock checks that no block is reused before its free is ordered before the new user.

use std::sync::Arc;

use proptest::prelude::*;

use super::mock::{Call, Mock, MockErr, S};
use super::*;
use crate::memory::pool::trim_to;
use crate::memory::{PoolConfig, SimulatedPool, Trace};

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize, usize),
    /// Free the i-th live allocation on stream slot s.
    Free(usize, usize),
    BadFree(usize, u8),
    Trim(usize),
    /// The stream of slot s goes away; a new one takes its place.
    Retire(usize),
    Threshold(Option<usize>),
    QueryLag(Option<u64>),
    Fail(u8),
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0..=4096usize,
        3 => 4096..=(2 * MIB),
        2 => (2 * MIB)..=(12 * MIB),
        1 => (12 * MIB)..=(40 * MIB),
        // Large sizes that recur (a model's weights), which share packed chunks in chunks.
        2 => proptest::sample::select(vec![12 * MIB + MIB / 2, 9 * MIB + 3 * MIB / 8]),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size(), 0..4usize).prop_map(|(n, s)| Op::Alloc(n, s)),
        8 => (any::<usize>(), 0..4usize).prop_map(|(i, s)| Op::Free(i, s)),
        1 => (any::<usize>(), 0..3u8).prop_map(|(i, k)| Op::BadFree(i, k)),
        1 => (0..(64 * MIB)).prop_map(Op::Trim),
        1 => (0..4usize).prop_map(Op::Retire),
        1 => proptest::option::of(0..(96 * MIB)).prop_map(Op::Threshold),
        1 => proptest::option::of(0..4u64).prop_map(Op::QueryLag),
        1 => (0..8u8).prop_map(Op::Fail),
    ]
}

/// Operations after a settled peak: mostly medium requests (1-8 MiB) and large ones up to the
/// peak's sizes, frees, and the rest as [`op`] draws them.
fn settled_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => ((MIB + 1)..=(8 * MIB), 0..4usize).prop_map(|(n, s)| Op::Alloc(n, s)),
        3 => ((8 * MIB + 1)..=(40 * MIB), 0..4usize).prop_map(|(n, s)| Op::Alloc(n, s)),
        7 => (any::<usize>(), 0..4usize).prop_map(|(i, s)| Op::Free(i, s)),
        1 => (0..(64 * MIB)).prop_map(Op::Trim),
        1 => (0..4usize).prop_map(Op::Retire),
        1 => proptest::option::of(0..4u64).prop_map(Op::QueryLag),
        1 => (0..8u8).prop_map(Op::Fail),
    ]
}

const CALLS: [Call; 8] =
    [Call::Alloc, Call::Free, Call::Create, Call::Record, Call::Wait, Call::Sync, Call::Query, Call::Reserve];

/// A mock device: with virtual memory management (the pool grows in segments) or without (in
/// chunks).
pub(super) fn mock(streams: usize, vmm: bool, capacity: usize) -> Mock {
    if vmm {
        Mock::with_vmm(streams, capacity.saturating_mul(4).min(1 << 40).next_multiple_of(2 << 20))
    } else {
        Mock::new(streams)
    }
}

fn run_ops(nstreams: usize, default_config: bool, capacity: usize, ops: Vec<Op>) {
    run_ops_on(nstreams, default_config, false, capacity, ops);
}

fn run_ops_on(nstreams: usize, default_config: bool, vmm: bool, capacity: usize, ops: Vec<Op>) {
    let config = if default_config { PoolConfig::default() } else { plain() };
    run_ops_with(config, nstreams, vmm, capacity, false, ops);
}

/// Large blocks whose size classes leave tails, live at once (the peak) and freed.
const PEAK_SIZES: [usize; 4] = [30 * MIB + 300 * 1024, 21 * MIB + 5000, 40 * MIB + 1, 13 * MIB];

/// Brings the pool to a settled peak ([`Arena::peak_settled`]): the large blocks of
/// [`PEAK_SIZES`] live at once, then freed, then more than a thousand blocks handed out by the
/// arena without a new peak ([`hand_out_at_the_peak`]).
fn settle_peak(h: &Harness) {
    let peak: Vec<u64> = PEAK_SIZES.iter().map(|&n| h.alloc(n, 0).unwrap()).collect();
    for p in peak {
        h.free(p, 0);
    }
    hand_out_at_the_peak(h, 1100);
    h.check();
}

/// Runs `ops` on a pool with `config` on `nstreams` streams of a mock device (with VMM or not)
/// of `capacity` bytes, after [`settle_peak`] where `settled`, checking the pool's invariants and
/// figures against the mock's after each.
fn run_ops_with(config: PoolConfig, nstreams: usize, vmm: bool, capacity: usize, settled: bool, ops: Vec<Op>) {
    let h = Harness::new(config, mock(nstreams, vmm, capacity));
    h.mock.st().capacity = capacity;
    if settled {
        settle_peak(&h);
    }
    // Stream slot -> current mock stream (a retired stream is replaced by a new one).
    let mut slots: Vec<usize> = (0..nstreams).collect();
    for op in ops {
        h.mock.st().now += 1;
        match op {
            Op::Alloc(n, s) => match h.alloc(n, slots[s % nstreams]) {
                Ok(_) | Err(PoolError::OutOfMemory { .. }) | Err(PoolError::Backend(MockErr::Injected)) => {}
                Err(e) => panic!("unexpected {e:?}"),
            },
            Op::Free(i, s) => {
                let live = h.mock.live();
                if !live.is_empty() {
                    h.free(live[i % live.len()].0, slots[s % nstreams]);
                }
            }
            Op::BadFree(i, k) => {
                let live = h.mock.live();
                let (p, n) = match (live.get(i % live.len().max(1)), k) {
                    (Some(&(p, n, _)), 0) => (p, n + 1),
                    (Some(&(p, n, _)), 1) => (p + 256, n),
                    _ => (i as u64 & !255, 512),
                };
                if !live.iter().any(|&(q, m, _)| q == p && m == n) {
                    let before = h.stats();
                    let r = deallocate(&h, p, n, &S(slots[0]));
                    assert_eq!(r, Err(PoolError::InvalidFree { ptr: p, bytes: n }));
                    let after = h.stats();
                    assert_eq!(
                        (after.in_use, after.live_allocations, after.cached),
                        (before.in_use, before.live_allocations, before.cached)
                    );
                }
            }
            Op::Trim(keep) => {
                let _ = trim_to(&h, keep);
            }
            Op::Retire(s) => {
                let slot = s % nstreams;
                h.retire(slots[slot]);
                slots[slot] = h.mock.new_stream();
            }
            Op::Threshold(t) => h.arena(|a| a.config.release_threshold = t.unwrap_or(usize::MAX)),
            Op::QueryLag(l) => h.mock.st().query_lag = l,
            Op::Fail(k) => h.mock.st().fail = Some(CALLS[k as usize]),
        }
        h.check();
        let st = h.stats();
        let live = h.mock.live();
        assert_eq!(st.in_use, live.iter().map(|&(_, n, _)| n).sum::<usize>());
        assert_eq!(st.live_allocations, live.len());
        let (reserved, chunks, allocs, frees) = h.mock.chunk_figures();
        assert_eq!((st.reserved, st.chunks, st.driver_allocs, st.driver_frees), (reserved, chunks, allocs, frees));
    }
    h.mock.st().fail = None;
    h.teardown();
}

/// Threads, each on its own stream, allocate and free; some allocations are handed to another
/// thread and freed there (on its stream, after ordering it after the allocating stream, as a
/// correct user does); some threads trim meanwhile. The mock checks every reuse.
fn run_threads(threads: usize, rounds: usize, seed: u64, vmm: bool) {
    let h =
        Arc::new(Harness { concurrent: true, ..Harness::new(PoolConfig::default(), mock(threads, vmm, 256 * MIB)) });
    h.mock.st().capacity = 256 * MIB;
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..threads).map(|_| std::sync::mpsc::channel::<u64>()).unzip();
    let handles: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(t, rx)| {
            let h = h.clone();
            let txs = txs.clone();
            std::thread::spawn(move || {
                let mut rng = seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let mut mine: Vec<u64> = Vec::new();
                for _ in 0..rounds {
                    while let Ok(p) = rx.try_recv() {
                        h.free(p, t);
                    }
                    match next() % 10 {
                        0..=4 => {
                            let n = match next() % 4 {
                                0 => (next() % 4096) as usize,
                                1 => (next() % (2 * MIB as u64)) as usize,
                                2 => (next() % (8 * MIB as u64)) as usize,
                                _ => (next() % (24 * MIB as u64)) as usize,
                            };
                            if let Ok(p) = h.alloc(n, t) {
                                mine.push(p);
                            }
                        }
                        5..=7 if !mine.is_empty() => {
                            let i = (next() as usize) % mine.len();
                            h.free(mine.swap_remove(i), t);
                        }
                        8 if !mine.is_empty() => {
                            let i = (next() as usize) % mine.len();
                            let to = (next() as usize) % txs.len();
                            let _ = txs[to].send(mine.swap_remove(i));
                        }
                        9 if next() % 8 == 0 => {
                            let _ = trim_to(&*h, (next() % (64 * MIB as u64)) as usize);
                        }
                        _ => {}
                    }
                }
                for p in mine {
                    h.free(p, t);
                }
                rx
            })
        })
        .collect();
    drop(txs);
    let rxs: Vec<_> = handles.into_iter().map(|j| j.join().expect("a thread panicked")).collect();
    for (t, rx) in rxs.into_iter().enumerate() {
        while let Ok(p) = rx.try_recv() {
            h.free(p, t);
        }
    }
    h.check();
    h.teardown();
}

/// A xorshift generator seeded with `seed` (made odd: never zero).
pub(super) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut rng = seed | 1;
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    }
}

/// Numbers in `[0, 1)` from [`xorshift`] seeded with `seed`.
pub(super) fn uniform(seed: u64) -> impl FnMut() -> f64 {
    let mut next = xorshift(seed);
    move || (next() % 1_000_000) as f64 / 1e6
}

/// A trace being written, in the format of `traces/`: allocations get ids in order.
struct TraceWriter {
    text: String,
    next: u64,
}

impl TraceWriter {
    fn new() -> Self {
        TraceWriter { text: String::from("op,id,size,stream\n"), next: 0 }
    }

    /// Writes an allocation of `bytes` on `stream`; returns its id.
    fn alloc(&mut self, bytes: usize, stream: usize) -> u64 {
        let id = self.next;
        self.next += 1;
        self.text.push_str(&format!("a,{id},{bytes},{stream}\n"));
        id
    }

    /// Writes the free of allocation `id` (of `bytes`) on `stream`.
    fn free(&mut self, id: u64, bytes: usize, stream: usize) {
        self.text.push_str(&format!("f,{id},{bytes},{stream}\n"));
    }

    fn finish(self) -> Trace {
        Trace::parse(&self.text).expect("a valid synthetic trace")
    }
}

/// A synthetic trace: heavy-tailed sizes (most small, a few very large), long-lived allocations
/// interleaved with short-lived ones, on `streams` streams.
fn synthetic_trace(seed: u64, events: usize, streams: usize) -> Trace {
    let mut next = xorshift(seed);
    let mut trace = TraceWriter::new();
    let mut live: Vec<(u64, usize, usize, bool)> = Vec::new();
    for _ in 0..events {
        let free_some = !live.is_empty() && next() % 100 < 48;
        if free_some {
            // Short-lived allocations go first, mostly; long-lived ones rarely.
            let short: Vec<usize> = (0..live.len()).filter(|&i| !live[i].3).collect();
            let pick = if !short.is_empty() && !next().is_multiple_of(10) {
                short[(next() as usize) % short.len()]
            } else {
                (next() as usize) % live.len()
            };
            let (i, n, s, _) = live.swap_remove(pick);
            trace.free(i, n, s);
        } else {
            // Pareto-like: size = 4 KiB / u^1.5, capped at 2 GiB.
            let u = ((next() % 1_000_000) as f64 + 1.0) / 1_000_001.0;
            let n = ((4096.0 / u.powf(1.5)) as usize).min(2 << 30);
            let s = (next() as usize) % streams;
            let long = next().is_multiple_of(5);
            live.push((trace.alloc(n, s), n, s, long));
        }
    }
    trace.finish()
}

/// A synthetic training loop: 10 to 49 layers, each with a long-lived weight (4 to 200 MiB),
/// then `steps` steps that scale every layer's activation (1 to 300 MiB, heavy-tailed) by a
/// factor of 30% to 100% drawn per step (a batch of another shape), allocate them in the forward
/// pass with a short-lived workspace beside every third, and free them in the backward pass,
/// each after its gradient is allocated.
fn training_steps(seed: u64, steps: usize) -> Trace {
    let mut unit = uniform(seed);
    let mut trace = TraceWriter::new();
    let layers = 10 + (unit() * 40.0) as usize;
    let activations: Vec<f64> = (0..layers).map(|_| MIB as f64 * (1.0 + 300.0 * unit().powi(3))).collect();
    for _ in 0..layers {
        trace.alloc((4.0 * MIB as f64 * (1.0 + 50.0 * unit().powi(2))) as usize, 0);
    }
    for _ in 0..steps {
        let factor = 0.3 + 0.7 * unit();
        let mut forward = Vec::with_capacity(layers);
        for &base in &activations {
            let bytes = (base * factor) as usize + 512;
            forward.push((trace.alloc(bytes, 0), bytes));
            if unit() < 1.0 / 3.0 {
                let workspace = bytes / 2 + 1;
                let id = trace.alloc(workspace, 0);
                trace.free(id, workspace, 0);
            }
        }
        while let Some((act, bytes)) = forward.pop() {
            let gradient = trace.alloc(bytes, 0);
            trace.free(act, bytes, 0);
            trace.free(gradient, bytes, 0);
        }
    }
    trace.finish()
}

/// A synthetic continuous-batching server: weights (0.5 to 2 GB in 16 to 40 tensors), then
/// `steps` steps whose batch of tokens drifts by up to 8% either way from the step before (256
/// to 2,048-4,096 tokens), each running every layer with an activation and a workspace four times
/// its size freed within the layer, then a logits buffer (tokens x a vocabulary of 32,000 to
/// 132,000, in `f32`) freed before the next step: large buffers whose size changes a little at
/// every step.
fn serving_steps(seed: u64, steps: usize) -> Trace {
    let mut unit = uniform(seed);
    let mut trace = TraceWriter::new();
    let layers = 16 + (unit() * 24.0) as usize;
    let weights = (0.5 + 1.5 * unit()) * 1e9 / layers as f64;
    for _ in 0..layers {
        trace.alloc((weights * (0.5 + unit())) as usize, 0);
    }
    let hidden = 2048.0 + 4096.0 * unit();
    let vocab = 32000.0 + 100000.0 * unit();
    let (fewest, most) = (256.0, 2048.0 + 2048.0 * unit());
    let mut tokens = fewest + (most - fewest) * unit();
    for _ in 0..steps {
        tokens = (tokens * (0.92 + 0.16 * unit())).clamp(fewest, most);
        for _ in 0..layers {
            let bytes = (tokens * hidden * 2.0) as usize;
            let activation = trace.alloc(bytes, 0);
            let workspace = trace.alloc(bytes * 4, 0);
            trace.free(activation, bytes, 0);
            trace.free(workspace, bytes * 4, 0);
        }
        let bytes = (tokens * vocab * 4.0) as usize;
        let logits = trace.alloc(bytes, 0);
        trace.free(logits, bytes, 0);
    }
    trace.finish()
}

/// A synthetic variable-length inference server: weights (0.3 to 0.8 GB in 20 to 40 tensors) and
/// one long-lived cache of 1.5 to 3 GB, then `requests` requests of 16 to 4,096 tokens, each
/// running every layer with activations linear and quadratic in its length (attention scores),
/// most freed within the layer, a few kept to the request's end.
fn inference_requests(seed: u64, requests: usize) -> Trace {
    let mut unit = uniform(seed);
    let mut trace = TraceWriter::new();
    let layers = 20 + (unit() * 20.0) as usize;
    let weights = (0.3 + 0.5 * unit()) * 1e9 / layers as f64;
    for _ in 0..layers {
        trace.alloc((weights * (0.5 + unit())) as usize, 0);
    }
    trace.alloc(((1.5 + 1.5 * unit()) * 1e9) as usize, 0);
    let hidden = 2048.0 + 2048.0 * unit();
    for _ in 0..requests {
        let tokens = 16.0 + 4080.0 * unit().powi(2);
        let mut kept = Vec::new();
        for _ in 0..layers {
            let linear = (tokens * hidden * 2.0) as usize;
            let scores = (tokens * tokens * 32.0) as usize + 512;
            let sizes = [linear, linear * 3, scores, linear];
            let mut layer: Vec<(u64, usize)> = sizes.into_iter().map(|bytes| (trace.alloc(bytes, 0), bytes)).collect();
            if unit() < 0.1 {
                kept.push(layer.pop().unwrap());
            }
            for (i, bytes) in layer.into_iter().rev() {
                trace.free(i, bytes, 0);
            }
        }
        for (i, bytes) in kept {
            trace.free(i, bytes, 0);
        }
    }
    trace.finish()
}

proptest! {
    #![proptest_config(proptest_config(256))]

    #[test]
    fn random_workloads_are_safe_and_consistent(
        nstreams in 1..=4usize,
        default_config in any::<bool>(),
        vmm in any::<bool>(),
        capacity in prop_oneof![Just(96 * MIB), Just(usize::MAX)],
        ops in proptest::collection::vec(op(), 0..if cfg!(miri) { 40 } else { 300 }),
    ) {
        run_ops_on(nstreams, default_config, vmm, capacity, ops);
    }

    // Past a settled peak's headroom, medium requests take large chunks' free tails
    // (`Arena::tail_past_headroom`) and large ones looser blocks (`Arena::reuse_past_headroom`),
    // across streams too: random traffic of medium and large requests after a settled peak, with
    // a headroom of 5%, so that growth soon passes it. (The settling's 1,100 handouts take
    // minutes under Miri, where the unit tests run those rules.)
    #[test]
    #[cfg_attr(miri, ignore)]
    fn random_workloads_past_a_settled_peaks_headroom_are_safe_and_consistent(
        nstreams in 1..=4usize,
        vmm in any::<bool>(),
        capacity in prop_oneof![Just(160 * MIB), Just(usize::MAX)],
        ops in proptest::collection::vec(settled_op(), 0..200),
    ) {
        let config = PoolConfig { expandable: vmm, headroom_percent: Some(5), ..PoolConfig::default() };
        run_ops_with(config, nstreams, vmm, capacity, true, ops);
    }

    #[test]
    fn synthetic_heavy_tailed_traces_replay_safely(seed in any::<u64>(), streams in 1..=3usize, vmm in any::<bool>()) {
        // The mock checks ordering: replay the synthetic trace on it.
        let trace = synthetic_trace(seed, if cfg!(miri) { 60 } else { 800 }, streams);
        let h = Harness::new(PoolConfig::default(), mock(streams, vmm, usize::MAX));
        let mut table = trace.replay_table();
        for (i, ev) in trace.events().iter().enumerate() {
            match *ev {
                crate::memory::TraceEvent::Alloc { size, stream, .. } => table.allocated(i, h.alloc(size, stream).expect("no limit")),
                crate::memory::TraceEvent::Free { stream, .. } => h.free(table.freed(i).unwrap(), stream),
            }
        }
        h.check();
        h.teardown();
    }
}

#[test]
fn threads_racing_allocations_frees_and_trims_are_safe() {
    let (threads, rounds) = if cfg!(miri) { (3, 40) } else { (4, 3000) };
    // CUDRV_THREAD_SEEDS=N runs N seeds (interleavings differ from run to run anyway).
    let seeds: u64 = std::env::var("CUDRV_THREAD_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    for seed in 0..seeds {
        for vmm in [false, true] {
            run_threads(threads, rounds, seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1, vmm);
        }
    }
}

/// Replays `trace(seed)` for each of `seeds` in segments and in chunks: each fits in 1.10x its
/// peak of live memory, and reserves at most 1.25x without a budget.
fn assert_close_to_live(seeds: std::ops::RangeInclusive<u64>, trace: impl Fn(u64) -> Trace) {
    for expandable in [true, false] {
        let config = PoolConfig { expandable, ..PoolConfig::default() };
        for seed in seeds.clone() {
            let trace = trace(seed);
            let r = trace.replay_simulated(config.clone(), Some(trace.peak_live() / 100 * 110));
            assert_eq!(r.out_of_memory_at, None, "seed {seed}, {config:?}: out of memory within 1.10x its peak");
            let r = trace.replay_simulated(config.clone(), None);
            assert!(r.ratio() <= 1.25, "seed {seed}, {config:?}: reserved/live {:.3}", r.ratio());
        }
    }
}

#[test]
#[cfg_attr(miri, ignore)]
fn synthetic_traces_stay_close_to_live_memory() {
    assert_close_to_live(1..=8, |seed| synthetic_trace(seed * 7919, 20_000, 1 + seed as usize % 3));
}

/// Heavy-tailed traces with requests up to most of their peak fit in 1.10x their peak of live
/// memory in segments: the memory of a large request, freed and cut up by smaller ones, is
/// unmapped between them for the next large one (a growth maps several handles, see
/// `segment::coarse_handle`; with one handle per growth, 7 of these 60 ran out of memory).
#[test]
#[cfg_attr(miri, ignore)]
fn heavy_tailed_traces_fit_in_segments() {
    let config = PoolConfig::default();
    for seed in 1..=60u64 {
        let trace = synthetic_trace(seed * 104_729, 20_000, 1 + seed as usize % 3);
        let budget = trace.peak_live() / 100 * 110;
        let r = trace.replay_simulated(config.clone(), Some(budget));
        assert_eq!(r.out_of_memory_at, None, "seed {seed}: out of memory within 1.10x its peak");
    }
}

/// Replays `trace` on `pool` cold, then (if that fitted) warm on what it left: the driver
/// allocations of both, and the pass that ran out of memory, if one did.
pub(super) fn replay_cold_then_warm(trace: &Trace, pool: &SimulatedPool) -> (u64, Option<&'static str>) {
    let mut allocs = 0;
    for pass in ["cold", "warm"] {
        let r = trace.replay_on(pool);
        allocs += r.driver_allocs;
        if r.out_of_memory_at.is_some() {
            return (allocs, Some(pass));
        }
    }
    (allocs, None)
}

/// A replay is the same every time: what a trace leaves live is freed in the order of its ids,
/// so the warm replay starts from the same pool. (Freed in a hash map's order, which changes from
/// map to map, this trace's warm replay at +16 MiB ran out of memory in some runs of the budget
/// sweep and not in others.)
#[test]
#[cfg_attr(miri, ignore)]
fn replays_are_the_same_every_time() {
    let config = PoolConfig { expandable: false, ..PoolConfig::default() };
    let trace = synthetic_trace(38 * 104_729, 20_000, 1 + 38 % 3);
    let run = || {
        let pool = SimulatedPool::new(config.clone(), Some(trace.peak_live() / 100 * 110 + 16 * MIB));
        let reports = [trace.replay_on(&pool), trace.replay_on(&pool), trace.replay_on(&pool)];
        (reports, pool.stats())
    };
    let first = run();
    assert!(first.0.iter().all(|r| r.events > 0 && r.driver_allocs > 0), "{first:?}");
    for _ in 0..4 {
        assert_eq!(run(), first);
    }
}

/// Heavy-tailed traces replayed twice on the same pool in chunks (as a serving process replays
/// its workload warm, on what the first pass left cached) fit in 1.10x their peak of live memory
/// and a few MiB more (a GPU budget is the factor's plus up to 2 MiB of whole pages, and a pool
/// that fits in one budget may not in a slightly larger one). Before a request could take a free
/// block of another size class as the last resort, seed 15 ran out of memory warm with 2 to 6
/// MiB more, with 18 MiB free in a medium chunk for a request of 8.6 MiB.
#[test]
#[cfg_attr(miri, ignore)]
fn heavy_tailed_traces_replayed_warm_fit_in_chunks() {
    let config = PoolConfig { expandable: false, ..PoolConfig::default() };
    for seed in 13..=17u64 {
        let trace = synthetic_trace(seed * 104_729, 20_000, 1 + seed as usize % 3);
        for extra in [0, 2 * MIB, 4 * MIB] {
            let pool = SimulatedPool::new(config.clone(), Some(trace.peak_live() / 100 * 110 + extra));
            let (_, out) = replay_cold_then_warm(&trace, &pool);
            assert_eq!(out, None, "seed {seed}, {extra} bytes more: the pass that ran out of memory");
        }
    }
}

/// Variable-length inference with a long-lived cache of about half the peak: fits in 1.10x its
/// peak of live memory in segments and in chunks, and reserves at most 1.25x without a budget.
#[test]
#[cfg_attr(miri, ignore)]
fn synthetic_inference_fits_in_segments_and_chunks() {
    assert_close_to_live(1..=8, |seed| inference_requests(seed * 7919, 40));
}

/// Training loops whose activations change size every step fit in 1.10x their peak of live
/// memory in chunks, growing exactly near capacity (the default).
#[test]
#[cfg_attr(miri, ignore)]
fn synthetic_training_steps_fit_in_chunks() {
    let config = PoolConfig { expandable: false, ..PoolConfig::default() };
    for seed in 1..=12u64 {
        let trace = training_steps(seed * 7919, 20);
        let budget = trace.peak_live() / 100 * 110;
        let r = trace.replay_simulated(config.clone(), Some(budget));
        assert_eq!(r.out_of_memory_at, None, "seed {seed}: out of memory within 1.10x its peak");
    }
}

/// What reservoirs ([`PoolConfig::reservoir`]) change in chunks under a budget, on 60 synthetic
/// training loops and 60 heavy-tailed traces: how many run out of memory with and without them,
/// and the driver allocations of those that fit both ways. Figures for the documentation, run by
/// hand: `cargo test --release --lib reservoirs_against_exact_growth -- --ignored --nocapture`.
#[test]
#[ignore]
fn reservoirs_against_exact_growth() {
    for workload in ["training", "heavy-tailed"] {
        for percent in [105usize, 110, 120] {
            let (mut out, mut calls) = ([0; 2], [0u64; 2]);
            for seed in 1..=60u64 {
                let trace = match workload {
                    "training" => training_steps(seed * 7919, 40),
                    _ => synthetic_trace(seed * 104_729, 20_000, 1 + seed as usize % 3),
                };
                let budget = Some(trace.peak_live() / 100 * percent);
                let runs = [false, true].map(|reservoir| {
                    let config = PoolConfig { expandable: false, reservoir, ..PoolConfig::default() };
                    trace.replay_simulated(config, budget)
                });
                for (i, r) in runs.iter().enumerate() {
                    out[i] += usize::from(r.out_of_memory_at.is_some());
                }
                if runs[0].out_of_memory_at.is_some() != runs[1].out_of_memory_at.is_some() {
                    eprintln!(
                        "  {workload} at {percent}%, seed {seed}: out of memory at {:?} exact, {:?} with reservoirs",
                        runs[0].out_of_memory_at, runs[1].out_of_memory_at
                    );
                }
                if runs.iter().all(|r| r.out_of_memory_at.is_none()) {
                    calls[0] += runs[0].driver_allocs;
                    calls[1] += runs[1].driver_allocs;
                }
            }
            eprintln!(
                "{workload} at {percent}%: out of memory {} exact, {} with reservoirs; driver allocations where both fit {} exact, {} with reservoirs",
                out[0], out[1], calls[0], calls[1]
            );
        }
    }
}

#[test]
fn regression_retire_then_fail_create() {
    run_ops(
        1,
        true,
        96 * MIB,
        vec![
            Op::Alloc(0, 0),
            Op::Alloc(0, 0),
            Op::Free(0, 0),
            Op::Alloc(0, 0),
            Op::Alloc(2097152, 0),
            Op::Free(1630649154185941163, 0),
            Op::Free(0, 0),
            Op::BadFree(0, 0),
            Op::Retire(0),
            Op::Fail(2),
            Op::Free(0, 0),
            Op::Alloc(2097153, 0),
        ],
    );
}

/// Found by `random_workloads_are_safe_and_consistent`: a growth in segments whose placement and
/// merge disagreed.
#[test]
fn regression_segment_growth_holds_its_request() {
    run_ops_on(
        2,
        true,
        true,
        96 * MIB,
        vec![
            Op::Alloc(2097153, 1),
            Op::Free(0, 2),
            Op::Alloc(0, 0),
            Op::Threshold(None),
            Op::Free(0, 0),
            Op::Alloc(0, 0),
            Op::Alloc(1048577, 2),
            Op::Alloc(0, 0),
            Op::Alloc(13032961, 0),
            Op::Alloc(0, 0),
            Op::Free(12073827853573357, 0),
            Op::Threshold(Some(50331648)),
            Op::Alloc(26263553, 0),
            Op::Alloc(4326401, 0),
            Op::Alloc(0, 0),
            Op::Free(3560532410284937374, 0),
            Op::Alloc(1048577, 1),
            Op::Free(17931026402304099913, 0),
            Op::Free(14258349967903125156, 0),
            Op::Alloc(2097152, 1),
            Op::Free(9316744725266223543, 0),
            Op::Alloc(1049089, 2),
            Op::Free(38694822814701931, 0),
            Op::Retire(0),
            Op::Alloc(0, 0),
            Op::Alloc(0, 0),
            Op::Free(2054298433685813997, 0),
            Op::Trim(25165824),
            Op::Alloc(1049089, 0),
            Op::Alloc(0, 0),
            Op::Alloc(0, 0),
            Op::Alloc(0, 0),
            Op::Free(0, 0),
            Op::Free(411543927707225203, 0),
            Op::Free(1175101442754, 0),
            Op::Free(2828528784281659481, 3),
            Op::Free(17790546252549459409, 2),
            Op::Trim(43798675),
            Op::Free(961029812583288686, 0),
            Op::Free(4807623340901889156, 3),
            Op::Free(13987007259216354921, 0),
            Op::Alloc(9425345, 3),
            Op::Alloc(3863177, 1),
            Op::QueryLag(None),
            Op::Alloc(33747314, 3),
        ],
    );
}

/// Found by `random_workloads_are_safe_and_consistent`: one stream, growth into a hole.
#[test]
fn regression_segment_growth_into_a_hole() {
    run_ops_on(
        1,
        false,
        true,
        usize::MAX,
        vec![
            Op::Alloc(0, 0),
            Op::Alloc(0, 0),
            Op::Alloc(0, 0),
            Op::Free(0, 0),
            Op::Alloc(0, 0),
            Op::Alloc(1466369, 0),
            Op::Alloc(2727425, 0),
            Op::Free(7434259279283938884, 0),
            Op::BadFree(0, 0),
            Op::Alloc(1048577, 0),
            Op::Alloc(26631169, 0),
            Op::Alloc(14252033, 0),
            Op::Alloc(1982977, 0),
            Op::Alloc(1676801, 0),
            Op::Free(12508414913043834894, 0),
            Op::Free(14556111998126418152, 0),
            Op::Alloc(0, 0),
            Op::Free(5179435361968431496, 0),
            Op::Alloc(1704449, 0),
            Op::Free(3553769423076861595, 0),
            Op::Alloc(0, 0),
            Op::Alloc(19917825, 0),
            Op::Alloc(0, 0),
            Op::Alloc(4955137, 0),
            Op::Alloc(0, 0),
            Op::Free(7365382299550949388, 0),
            Op::Free(8095071474729078394, 0),
            Op::Alloc(0, 0),
            Op::Alloc(1048577, 0),
            Op::Free(13815071287031489388, 0),
            Op::Alloc(0, 0),
            Op::Free(3277165632041499828, 0),
            Op::Free(17503585704537848791, 0),
            Op::Alloc(7797762, 0),
            Op::Free(12139252038291319698, 0),
            Op::Alloc(3135, 2),
            Op::Alloc(374515, 2),
            Op::Free(16100589192978856839, 1),
            Op::Alloc(6856363, 1),
            Op::Alloc(41084281, 2),
            Op::Free(7756061801415864819, 3),
            Op::Alloc(1757901, 0),
            Op::Alloc(3991, 2),
            Op::Free(1391330793423301968, 3),
            Op::Alloc(3314, 0),
            Op::Free(17760769094206825404, 2),
            Op::Alloc(1106, 2),
            Op::Free(6815192232279485770, 0),
            Op::Free(4530037255750604865, 1),
            Op::Trim(66079015),
            Op::Retire(3),
            Op::Alloc(636567, 1),
            Op::Alloc(12030527, 1),
            Op::Threshold(Some(52708970)),
            Op::Free(4932458774081294031, 2),
            Op::Free(16277238331105551957, 1),
            Op::Alloc(629, 1),
            Op::QueryLag(Some(3)),
            Op::Alloc(7991056, 0),
            Op::Free(9515604946704263197, 3),
            Op::Free(14339916693997604109, 3),
            Op::Retire(2),
            Op::Free(13313818361382114926, 1),
            Op::Fail(0),
            Op::Alloc(22233429, 3),
            Op::Alloc(885429, 1),
            Op::Alloc(10279373, 0),
            Op::Alloc(48024, 3),
            Op::Alloc(2663, 2),
            Op::Alloc(397, 3),
            Op::Alloc(791424, 0),
            Op::Alloc(1578355, 1),
            Op::Alloc(188, 3),
            Op::Free(2067114478216503816, 2),
            Op::Free(13825739697501514793, 2),
            Op::Free(8270887160118684187, 0),
            Op::Alloc(6802557, 3),
        ],
    );
}

/// A synthetic autoregressive decoder with a KV cache grown by concatenation: 6 to 47 layers,
/// each with a KV tensor of 1 to 31 MiB and a transient activation and workspace in the prefill,
/// then a logits buffer of 20 to 220 MiB; then `steps` decoding steps in which every layer
/// allocates its tensor grown by one token (a 64th to a 1024th of it), frees the old one, and a
/// small activation lives beside it. Each new tensor is slightly too large for the block that the
/// layer before freed.
fn kv_cache_decoding(seed: u64, steps: usize) -> Trace {
    let mut unit = uniform(seed);
    let mut trace = TraceWriter::new();
    let layers = 6 + (unit() * 42.0) as usize;
    let kv = ((1.0 + 30.0 * unit()) * MIB as f64) as usize / 512 * 512;
    let per_token = kv / (64 + (unit() * 960.0) as usize);
    let act = ((0.5 + 20.0 * unit()) * MIB as f64) as usize;
    let logits = ((20.0 + 200.0 * unit()) * MIB as f64) as usize;
    trace.alloc(14_088, 0);
    let mut caches: Vec<(u64, usize)> = Vec::new();
    for _ in 0..layers {
        let a = trace.alloc(act, 0);
        caches.push((trace.alloc(kv, 0), kv));
        let w = trace.alloc(act * 4, 0);
        trace.free(a, act, 0);
        trace.free(w, act * 4, 0);
    }
    let l = trace.alloc(logits, 0);
    trace.free(l, logits, 0);
    let (small, step_logits) = (act / 8 + 512, logits / 64 + 512);
    for _ in 0..steps {
        for cache in caches.iter_mut() {
            let a = trace.alloc(small, 0);
            let bytes = cache.1 + per_token;
            let grown = trace.alloc(bytes, 0);
            trace.free(cache.0, cache.1, 0);
            *cache = (grown, bytes);
            trace.free(a, small, 0);
        }
        let l = trace.alloc(step_logits, 0);
        trace.free(l, step_logits, 0);
    }
    trace.finish()
}

/// KV caches grown by concatenation stay close to their peak of live memory in segments: 60
/// decoders reserve at most 1.30x (1.27x at worst, 1.08x on average), where they reached 1.53x
/// while the headroom unmapped only the segments' tops (the freed tensors, each too small for
/// the next, stayed mapped between the live ones); and each fits in 1.10x its peak (4 of them
/// ran out of memory while the handles near capacity were 1/64 of the peak, see
/// `segment::tight_handle`). In chunks, without virtual memory management, 11 of the 60 run out
/// of memory under 1.10x (14 before `Arena::packed_medium_chunk`), and the worst reserves 1.40x
/// without a budget: figures from `kv_cache_decoding_figures`.
#[test]
#[cfg_attr(miri, ignore)]
fn kv_caches_grown_by_concatenation_stay_close_to_live_memory_in_segments() {
    let (mut worst, mut sum) = (0.0f64, 0.0);
    for seed in 1..=60u64 {
        let trace = kv_cache_decoding(seed * 7919, 100);
        let r = trace.replay_simulated(PoolConfig::default(), None);
        assert!(r.ratio() <= 1.30, "seed {seed}: reserved/live {:.3}", r.ratio());
        worst = worst.max(r.ratio());
        sum += r.ratio();
        let r = trace.replay_simulated(PoolConfig::default(), Some(trace.peak_live() / 100 * 110));
        assert_eq!(r.out_of_memory_at, None, "seed {seed}: out of memory within 1.10x its peak");
    }
    assert!(sum / 60.0 <= 1.10, "mean reserved/live {:.3} (worst {worst:.3})", sum / 60.0);
}

/// Asserts that `trace` replayed with `config` and no budget reserves at most 1.25x its peak of
/// live memory, and that, replayed cold then warm on one pool, it fits in 1.10x that peak plus
/// each of `extra_mib`.
fn assert_close_and_fits(what: &str, trace: &Trace, config: &PoolConfig, extra_mib: &[usize]) {
    let how = if config.expandable { "segments" } else { "chunks" };
    let r = trace.replay_simulated(config.clone(), None);
    assert!(r.ratio() <= 1.25, "{what}, {how}: reserved/live {:.3}", r.ratio());
    for &extra in extra_mib {
        let pool = SimulatedPool::new(config.clone(), Some(trace.peak_live() / 100 * 110 + extra * MIB));
        let (_, out) = replay_cold_then_warm(trace, &pool);
        assert_eq!(out, None, "{what}, {how}, {extra} MiB more: the pass that ran out of memory");
    }
}

/// Continuous-batching servers (a logits buffer and activations whose sizes drift from step to
/// step) replayed cold and then warm on the same pool fit in 1.10x their peak of live memory and
/// a MiB or two more, in segments and in chunks; without a budget they reserve at most 1.25x it.
#[test]
#[cfg_attr(miri, ignore)]
fn serving_loops_fit_under_budgets_in_segments_and_chunks() {
    for expandable in [true, false] {
        let config = PoolConfig { expandable, ..PoolConfig::default() };
        for seed in 1..=12u64 {
            let trace = serving_steps(seed * 7919, 100);
            assert_close_and_fits(&format!("seed {seed}"), &trace, &config, &[0, 1, 2]);
        }
    }
}

/// KV-cache decoders replayed cold and then warm on the same pool in segments fit in 1.10x their
/// peak of live memory and a few MiB more (a GPU budget is the factor's plus up to 2 MiB of whole
/// pages; on the H200, kv20 of these ran out of memory warm with 1.6 MiB more, as the simulator
/// does with 1 MiB more). These four seeds ran out of memory at some of these budgets while the
/// segments mapped large handles up to half of what they may hold (see `Arena::grow_segment`):
/// the free memory was in pieces that held no whole mapping.
#[test]
#[cfg_attr(miri, ignore)]
fn kv_caches_replayed_warm_fit_in_segments_under_budgets_a_mib_apart() {
    for seed in [20u64, 34, 51, 56] {
        let trace = kv_cache_decoding(seed * 7919, 100);
        for extra in [0, 1, 2, 3, 4, 5, 6, 12, 16] {
            let pool = SimulatedPool::new(PoolConfig::default(), Some(trace.peak_live() / 100 * 110 + extra * MIB));
            let (_, out) = replay_cold_then_warm(&trace, &pool);
            assert_eq!(out, None, "seed {seed}, {extra} MiB more: the pass that ran out of memory");
        }
    }
}

/// The figures behind the test above, in segments and in chunks, without a budget and under
/// 1.10x: `cargo test --release --lib kv_cache_decoding_figures -- --ignored --nocapture`.
#[test]
#[ignore]
fn kv_cache_decoding_figures() {
    for expandable in [true, false] {
        let config = PoolConfig { expandable, ..PoolConfig::default() };
        let (mut out, mut worst, mut sum, mut maps) = (0, 0.0f64, 0.0, 0);
        for seed in 1..=60u64 {
            let trace = kv_cache_decoding(seed * 7919, 100);
            let r = trace.replay_simulated(config.clone(), None);
            (worst, sum, maps) = (worst.max(r.ratio()), sum + r.ratio(), maps + r.driver_allocs);
            let r = trace.replay_simulated(config.clone(), Some(trace.peak_live() / 100 * 110));
            out += usize::from(r.out_of_memory_at.is_some());
        }
        let how = if expandable { "segments" } else { "chunks" };
        eprintln!(
            "{how}: reserved/live {:.3} on average, {worst:.3} at worst, {maps} driver allocations; {out} of 60 out of memory under 1.10x",
            sum / 60.0
        );
    }
}

/// How robust a fit under a budget is: every trace in `traces/` and the synthetic families,
/// each in 1.10x its peak of live memory plus 0 to 16 MiB (a budget on the GPU is the factor's
/// plus up to 2 MiB of whole pages, and the pool's decisions near capacity change with a MiB),
/// replayed cold and then warm on the same pool, in segments and in chunks. Prints the runs that
/// ran out of memory and the driver calls of all: `cargo test --release --lib
/// budget_robustness_figures -- --ignored --nocapture`. `CUDRV_EXTRA_MIB=-6,-4,-2` sets the MiB
/// added instead (the driver keeps 1-5 MiB of what it reports free, so on the GPU a budget of
/// 1.10x is one of up to 3 MiB less in the simulator, which keeps 2 MiB).
#[test]
#[ignore]
fn budget_robustness_figures() {
    let extras: Vec<isize> = match std::env::var("CUDRV_EXTRA_MIB") {
        Ok(v) => v.split(',').map(|x| x.trim().parse().expect("MiB, comma-separated")).collect(),
        Err(_) => vec![0, 1, 2, 3, 4, 5, 6, 8, 12, 16],
    };
    let files = super::traces::traces();
    type Family<'a> = (&'a str, u64, &'a dyn Fn(u64) -> Trace);
    let families: [Family; 9] = [
        ("traces/", files.len() as u64, &|s| files[s as usize - 1].1.clone()),
        ("kv-cache decoding", 60, &|s| kv_cache_decoding(s * 7919, 100)),
        ("heavy-tailed", 40, &|s| synthetic_trace(s * 104_729, 20_000, 1 + s as usize % 3)),
        ("training", 20, &|s| training_steps(s * 7919, 20)),
        ("inference", 20, &|s| inference_requests(s * 7919, 40)),
        ("serving", 20, &|s| serving_steps(s * 7919, 200)),
        ("pipeline", 20, &|s| pipeline_streams(s * 7919, 200)),
        ("accumulating", 20, &|s| accumulating_state(s * 7919, 15)),
        ("diffusion", 20, &|s| diffusion(s * 7919, 20)),
    ];
    // `CUDRV_SWEEP=segments` or `chunks` runs one mode only.
    let only = std::env::var("CUDRV_SWEEP").ok();
    for expandable in [true, false] {
        let how = if expandable { "segments" } else { "chunks" };
        if only.as_deref().is_some_and(|o| o != how) {
            continue;
        }
        let config = PoolConfig { expandable, ..PoolConfig::default() };
        for (name, seeds, make) in &families {
            let (mut runs, mut cold, mut warm, mut maps, mut failed) = (0, 0, 0, 0u64, Vec::new());
            // Runs that no placement in chunks keeping the kinds apart fits
            // (`Trace::least_memory_in_chunks`).
            let mut forced = 0;
            for seed in 1..=*seeds {
                let trace = make(seed);
                let least = trace.least_memory_in_chunks(&config) + super::super::backend::DRIVER_SPARE;
                for &extra_mib in &extras {
                    let budget = (trace.peak_live() / 100 * 110).saturating_add_signed(extra_mib << 20);
                    forced += usize::from(!expandable && least > budget);
                    let pool = SimulatedPool::new(config.clone(), Some(budget));
                    runs += 1;
                    let (allocs, out) = replay_cold_then_warm(&trace, &pool);
                    maps += allocs;
                    if let Some(pass) = out {
                        *if pass == "cold" { &mut cold } else { &mut warm } += 1;
                        failed.push(format!("{seed}+{extra_mib}M {pass}"));
                    }
                }
            }
            failed.truncate(12);
            let forced = if expandable {
                String::new()
            } else {
                format!(" ({forced} that no placement keeping the kinds apart fits)")
            };
            eprintln!(
                "{how}, {name}: {runs} runs, {cold} out of memory cold, {warm} warm{forced}, {maps} driver allocations; {}",
                failed.join(", ")
            );
        }
    }
}

/// A synthetic pipeline on 2 to 4 streams: weights (8 to 24 tensors of 20 to 220 MB), then
/// `steps` inputs of 32 to 96 MB, each produced on one stream and consumed three steps later on
/// the next, whose activations (varying with the batch) are allocated and freed there, and the
/// input with them: every input is freed on another stream than the one it was allocated on.
fn pipeline_streams(seed: u64, steps: usize) -> Trace {
    let mut unit = uniform(seed);
    let mut trace = TraceWriter::new();
    let streams = 2 + (unit() * 3.0) as usize;
    let layers = 8 + (unit() * 16.0) as usize;
    for _ in 0..layers {
        trace.alloc(((20.0 + 200.0 * unit()) * 1e6) as usize, 0);
    }
    let mut inflight: std::collections::VecDeque<(u64, usize, usize)> = Default::default();
    for step in 0..steps {
        let producer = step % streams;
        let batch = 0.5 + unit();
        // Input produced on one stream, consumed (and freed) on another a few steps later.
        let bytes = (batch * 64e6) as usize;
        inflight.push_back((trace.alloc(bytes, producer), bytes, (producer + 1) % streams));
        if inflight.len() > 3 {
            let (id, bytes, consumer) = inflight.pop_front().unwrap();
            let mut acts = Vec::new();
            for _ in 0..layers {
                let b = (batch * (4e6 + 40e6 * unit())) as usize;
                acts.push((trace.alloc(b, consumer), b));
            }
            for (a, b) in acts.into_iter().rev() {
                trace.free(a, b, consumer);
            }
            trace.free(id, bytes, consumer);
        }
    }
    trace.finish()
}

/// A synthetic training loop that accumulates state: `steps` steps of 10 to 30 activations (8 to
/// 128 MB, scaled by the batch), freed in reverse with a gradient allocated beside each; during
/// the first third of the steps every third layer also allocates a long-lived buffer of 1 to 61
/// MB between the activations (optimizer state made lazily, gradient buckets, autotuning caches),
/// never freed, so that long-lived blocks land between short-lived ones.
fn accumulating_state(seed: u64, steps: usize) -> Trace {
    accumulating(seed, steps, &Accumulation::BASE)
}

/// The shape of an [`accumulating`] training loop.
struct Accumulation {
    /// Every `every`-th layer allocates a long-lived buffer ...
    every: usize,
    /// ... of this many MB (uniform) ...
    long_lived_mb: (f64, f64),
    /// ... during the steps before `steps * until.0 / until.1`.
    until: (usize, usize),
    /// The activations' MB before the batch's scale (0.5 to 1.5).
    activation_mb: (f64, f64),
}

impl Accumulation {
    /// [`accumulating_state`]'s.
    const BASE: Accumulation =
        Accumulation { every: 3, long_lived_mb: (1.0, 61.0), until: (1, 3), activation_mb: (8.0, 128.0) };
}

/// A training loop that accumulates state as `shape` says (see [`accumulating_state`]).
fn accumulating(seed: u64, steps: usize, shape: &Accumulation) -> Trace {
    let mut unit = uniform(seed);
    let mut trace = TraceWriter::new();
    let layers = 10 + (unit() * 20.0) as usize;
    let (a0, a1) = shape.activation_mb;
    let (l0, l1) = shape.long_lived_mb;
    for step in 0..steps {
        let scale = 0.5 + unit();
        let mut acts = Vec::new();
        for l in 0..layers {
            let b = (scale * (a0 + (a1 - a0) * unit()) * 1e6) as usize;
            acts.push((trace.alloc(b, 0), b));
            if step < steps * shape.until.0 / shape.until.1 && l % shape.every == 0 {
                // Long-lived state created lazily between activations (optimizer state,
                // gradient buckets, autotuning caches): never freed.
                trace.alloc(((l0 + (l1 - l0) * unit()) * 1e6) as usize, 0);
            }
        }
        for (a, b) in acts.into_iter().rev() {
            let g = trace.alloc(b / 2, 0);
            trace.free(a, b, 0);
            trace.free(g, b / 2, 0);
        }
    }
    trace.finish()
}

/// How the accumulating loops fare under budgets when their shape changes (in segments, or in
/// chunks with `CUDRV_SWEEP=chunks`): eight variants of [`accumulating_state`], 24 seeds of 12
/// steps each, replayed cold then warm in 1.10x their peak of live memory and 4 MiB more. Prints
/// the runs out of memory and the driver allocations: `cargo test --release --lib
/// accumulating_variants_figures -- --ignored --nocapture`.
#[test]
#[ignore]
fn accumulating_variants_figures() {
    let expandable = std::env::var("CUDRV_SWEEP").map_or(true, |m| m != "chunks");
    let base = Accumulation::BASE;
    let variants = [
        ("base", Accumulation { ..base }),
        ("every layer", Accumulation { every: 1, ..base }),
        ("small state", Accumulation { every: 2, long_lived_mb: (0.5, 8.0), until: (1, 2), ..base }),
        ("large state", Accumulation { every: 4, long_lived_mb: (20.0, 200.0), ..base }),
        ("small activations", Accumulation { long_lived_mb: (1.0, 30.0), activation_mb: (2.0, 40.0), ..base }),
        ("large activations", Accumulation { long_lived_mb: (5.0, 100.0), activation_mb: (50.0, 500.0), ..base }),
        ("state made late", Accumulation { until: (4, 5), ..base }),
        ("sparse state", Accumulation { every: 8, long_lived_mb: (5.0, 120.0), until: (1, 2), ..base }),
    ];
    for (name, shape) in &variants {
        let (mut cold, mut warm, mut allocs) = (0, 0, 0);
        for seed in 1..=24u64 {
            let trace = accumulating(seed * 7919, 12, shape);
            for extra_mib in [0, 4] {
                let budget = trace.peak_live() / 100 * 110 + (extra_mib << 20);
                let pool = SimulatedPool::new(PoolConfig { expandable, ..PoolConfig::default() }, Some(budget));
                let (n, out) = replay_cold_then_warm(&trace, &pool);
                allocs += n;
                match out {
                    Some("cold") => cold += 1,
                    Some(_) => warm += 1,
                    None => {}
                }
            }
        }
        eprintln!("{name}: 48 runs, {cold} out of memory cold, {warm} warm, {allocs} driver allocations");
    }
}

/// A synthetic diffusion model serving `requests` requests at one of four resolutions and batches
/// of 1 to 4: 30 weight tensors, then four denoising steps per request through a U of four levels,
/// each level keeping a skip activation until the way up and, below the top, allocating an
/// attention map quadratic in its pixels (up to 3 GB) and freeing it at once.
fn diffusion(seed: u64, requests: usize) -> Trace {
    let mut unit = uniform(seed);
    let mut trace = TraceWriter::new();
    for _ in 0..30 {
        trace.alloc(((10.0 + 100.0 * unit()) * 1e6) as usize, 0);
    }
    for _ in 0..requests {
        let res = [0.5f64, 0.75, 1.0, 1.25][(unit() * 4.0) as usize];
        let batch = 1.0 + (unit() * 4.0).floor();
        for _step in 0..4 {
            let mut skips = Vec::new();
            let mut ch = 1.0;
            for level in 0..4 {
                let px = res * res / 4f64.powi(level);
                let act = (batch * px * ch * 40e6) as usize + 512;
                let tmp = trace.alloc(act * 2, 0);
                if level >= 1 {
                    let tokens = px * 4096.0;
                    let attn = ((batch * tokens * tokens * 2.0) as usize + 512).min(3_000_000_000);
                    let a = trace.alloc(attn, 0);
                    trace.free(a, attn, 0);
                }
                skips.push((trace.alloc(act, 0), act));
                trace.free(tmp, act * 2, 0);
                ch *= 2.0;
            }
            for (s, b) in skips.into_iter().rev() {
                let up = trace.alloc(b * 2, 0);
                trace.free(s, b, 0);
                trace.free(up, b * 2, 0);
            }
        }
    }
    trace.finish()
}

/// Pipelines with inputs freed on another stream, training loops that accumulate long-lived
/// state between their activations, and diffusion models with attention maps that spike,
/// replayed cold and then warm on the same pool, fit in 1.10x their peak of live memory and up
/// to 2 MiB more, in segments and in chunks; without a budget each reserves at most 1.25x it.
///
/// In segments, the accumulating loops' long-lived blocks, placed in the memory that earlier
/// activations freed, strand the free memory around them (a mapping is unmapped only whole):
/// before segments mapped fine handles once that happened (`segment::STRANDED_PART`), 15 of 200
/// such replays ran out of memory (`budget_robustness_figures`), seeds 5 (warm) and 14 (cold)
/// among those below, one with 306 MiB free, 44 MiB of it in whole mappings, for a request of
/// 69 MiB. Placing a request at whichever end of its free block leaves more whole mappings free
/// had fixed them too, but made the traces of `traces/` map 7 times as often and 35 KV-cache
/// decoders fail.
#[test]
#[cfg_attr(miri, ignore)]
fn pipelines_accumulated_state_and_diffusion_fit_under_budgets() {
    type Family<'a> = (&'a str, &'a dyn Fn(u64) -> Trace);
    let families: [Family; 3] = [
        ("pipeline", &|s| pipeline_streams(s * 7919, 100)),
        ("accumulating", &|s| accumulating_state(s * 7919, 15)),
        ("diffusion", &|s| diffusion(s * 7919, 8)),
    ];
    for expandable in [true, false] {
        let config = PoolConfig { expandable, ..PoolConfig::default() };
        for (name, make) in &families {
            let seeds = if *name == "accumulating" { 1..=16u64 } else { 1..=6 };
            for seed in seeds {
                assert_close_and_fits(&format!("{name} {seed}"), &make(seed), &config, &[0, 2]);
            }
        }
    }
}

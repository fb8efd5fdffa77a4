//! Tests of the pool's bookkeeping: a mock device that checks stream ordering in logical time, a
//! harness that runs the pool on it (with threads where a test wants them), unit tests, property
//! tests, and trace replays.

mod graph;
mod mock;
mod props;
mod reservoir;
mod review2;
mod review23c;
mod review4;
mod segments;
mod traces;
mod unit;
mod workloads;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::arena::Arena;
use super::blocks::{Kind, NIL, State};
use super::cache::Cache;
use super::config::PoolConfig;
use super::error::PoolError;
use super::stats::PoolStats;
use super::{Host, allocate, deallocate, retire, stats};
use mock::{Mock, MockErr, S};

const MIB: usize = 1 << 20;

/// The property tests' configuration: `cases` cases (the `PROPTEST_CASES` variable overrides it),
/// 4 under Miri, and no failure files.
fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases: if cfg!(miri) {
            4
        } else {
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases)
        },
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    }
}

thread_local! {
    /// Whether this thread holds the harness's arena lock: the mock's blocking calls assert not.
    static IN_ARENA: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The pool on the mock device, with per-stream caches behind their own locks as in
/// `StreamOrderedPool`.
struct Harness {
    mock: Mock,
    /// Whether threads share the harness (then figures move under a thread's feet).
    concurrent: bool,
    arena: Mutex<Arena<Mock>>,
    caches: Mutex<HashMap<S, Arc<Mutex<Cache>>>>,
}

impl Host for Harness {
    type B = Mock;

    fn backend(&self) -> &Mock {
        &self.mock
    }

    fn arena<R>(&self, f: impl FnOnce(&mut Arena<Mock>) -> R) -> R {
        /// Clears the flag also when `f` panics, so that a failed property test can shrink.
        struct Leave;
        impl Drop for Leave {
            fn drop(&mut self) {
                IN_ARENA.with(|f| f.set(false));
            }
        }
        let mut a = self.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        assert!(!IN_ARENA.with(|f| f.replace(true)), "the arena lock taken twice");
        let _leave = Leave;
        f(&mut a)
    }

    fn cache<R>(&self, stream: &S, f: impl FnOnce(&mut Cache) -> R) -> R {
        assert!(!IN_ARENA.with(|f| f.get()), "a cache taken while holding the arena");
        let cache = {
            let mut map = self.caches.lock().unwrap();
            match map.get(stream) {
                Some(c) => c.clone(),
                None => {
                    let c = Arc::new(Mutex::new(self.arena(|a| a.new_cache(stream))));
                    map.insert(stream.clone(), c.clone());
                    c
                }
            }
        };
        let mut c = cache.lock().unwrap();
        f(&mut c)
    }

    fn existing_cache<R>(&self, stream: &S, f: impl FnOnce(&mut Cache) -> R) -> Option<R> {
        assert!(!IN_ARENA.with(|f| f.get()), "a cache taken while holding the arena");
        let cache = self.caches.lock().unwrap().get(stream).cloned()?;
        let mut c = cache.lock().unwrap();
        Some(f(&mut c))
    }
}

impl Harness {
    fn new(config: PoolConfig, mock: Mock) -> Self {
        let mut arena = Arena::new(config);
        arena.use_segments(super::backend::Backend::segments(&mock));
        Harness { mock, concurrent: false, arena: Mutex::new(arena), caches: Mutex::new(HashMap::new()) }
    }

    /// Allocates on stream `s` and checks the block against every earlier free of its memory.
    fn alloc(&self, bytes: usize, s: usize) -> Result<u64, PoolError<MockErr>> {
        self.alloc_as(bytes, s, false)
    }

    /// [`Harness::alloc`] of a kept allocation (a buffer's, see `Cache::kept`) or not.
    fn alloc_as(&self, bytes: usize, s: usize, kept: bool) -> Result<u64, PoolError<MockErr>> {
        let before = self.stats();
        let r = allocate(self, bytes, &S(s), kept);
        match &r {
            Ok(p) => self.mock.allocated(*p, bytes, s),
            Err(_) if self.concurrent => {}
            Err(_) => {
                let after = self.stats();
                assert_eq!((after.in_use, after.live_allocations), (before.in_use, before.live_allocations));
            }
        }
        r
    }

    /// Frees `p` on stream `s`: the free is issued (in the mock's time) before the pool learns of
    /// it, as a real `cuMemFreeAsync` would be.
    fn free(&self, p: u64, s: usize) {
        let bytes = self.mock.freeing(p, s);
        deallocate(self, p, bytes, &S(s)).expect("a valid free");
    }

    /// The stream's last user lets go of it: its cache goes back to the pool, then the stream is
    /// destroyed (in the mock).
    fn retire(&self, s: usize) {
        if let Some(cache) = self.caches.lock().unwrap().remove(&S(s)) {
            let cache = Arc::try_unwrap(cache).expect("no other user").into_inner().unwrap();
            if retire(self, &S(s), cache).is_err() {
                // The pool could not forget it and still holds it: the stream lives on.
                return;
            }
        }
        self.mock.destroy_stream(s);
    }

    fn stats(&self) -> PoolStats {
        stats(self)
    }

    /// Frees everything left, tears the pool down and checks that nothing leaked.
    fn teardown(&self) {
        let live = self.mock.live_allocations();
        let alive = self.mock.any_live_stream();
        for (p, s) in live {
            let s = if self.mock.is_destroyed(s) { alive } else { s };
            self.free(p, s);
        }
        self.check();
        let leaked = super::teardown(self).expect("teardown");
        assert_eq!(leaked.allocations, 0);
        assert_eq!(leaked.chunks, 0);
        let st = self.stats();
        assert_eq!((st.reserved, st.chunks, st.in_use), (0, 0, 0));
        self.caches.lock().unwrap().clear();
        self.arena(|a| a.forget_idle_streams());
        assert_eq!(self.arena(|a| (a.streams.len(), a.unforgotten)), (0, 0));
        self.mock.assert_clean();
    }

    /// Checks every structural invariant of the arena and the caches.
    fn check(&self) {
        let caches: Vec<(S, Arc<Mutex<Cache>>)> =
            self.caches.lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut cached: BTreeMap<u64, u32> = BTreeMap::new();
        let mut live: BTreeMap<u64, u32> = BTreeMap::new();
        for (_, c) in &caches {
            let c = c.lock().unwrap();
            let (free, l) = c.contents_for_tests();
            for (p, blk) in free {
                assert!(cached.insert(p, blk).is_none(), "a block cached twice");
            }
            for (p, blk) in l {
                assert!(live.insert(p, blk).is_none(), "a block live twice");
            }
        }
        self.arena(|a| {
            let retired = a.streams.iter().filter(|(_, st)| st.retired).count();
            assert_eq!(a.unforgotten, retired, "streams flagged retired");
            // A cache files its frees under its slot: that must be its own stream's state, which
            // counts it (and any cache taken out for a retirement not run yet).
            for (k, c) in &caches {
                let slot = c.lock().unwrap().slot;
                assert_eq!(a.stream_slots.get(k), Some(&slot), "a cache of {k:?} in another stream's slot");
                assert!(a.streams[slot].caches >= 1, "the state of {k:?} does not count its cache");
            }
            for (&p, l) in &a.orphans {
                assert!(live.insert(p, l.blk).is_none(), "an orphan also live in a cache");
            }
            for (p, blk) in a.graph_blocks() {
                assert!(live.insert(p, blk).is_none(), "a graph's block also live elsewhere");
            }
            let (mut reserved, mut out_bytes, mut free_blocks, mut slack, mut free_tails) = (0, 0, 0, 0, 0);
            for (c, chunk) in a.chunks.iter() {
                // A segment's blocks span holes too: what it holds is what is mapped.
                reserved += chunk.segment.as_ref().map_or(chunk.size, |seg| seg.mapped + seg.unmapping);
                if let Some(seg) = &chunk.segment {
                    // The mappings cover exactly the blocks that are not holes, within the range.
                    assert_eq!(seg.maps.values().map(|m| m.0).sum::<usize>(), seg.mapped);
                    assert!(chunk.size <= seg.reserved);
                    assert_eq!(a.segment_of[seg.kind as usize], c, "a segment not its kind's");
                    // Maps are disjoint and inside the span; so they cover exactly the blocks that
                    // are not holes when those add up to the mapped bytes and no map meets a hole.
                    let (mut cur, mut mapped_blocks) = (chunk.first, 0);
                    while cur != NIL {
                        let bl = &a.blocks[cur];
                        assert_eq!(bl.kind, seg.kind, "a block of another kind in a segment");
                        let end = bl.ptr + bl.size as u64;
                        if bl.state == State::Hole {
                            assert_ne!(bl.next, NIL, "a hole at the top of a segment");
                            assert_ne!(a.blocks[bl.next].state, State::Hole, "adjacent holes");
                            let meets =
                                seg.maps.range(..end).next_back().is_some_and(|(&p, &(n, _))| p + n as u64 > bl.ptr);
                            assert!(!meets, "a mapping in a hole");
                        } else {
                            mapped_blocks += bl.size;
                        }
                        cur = bl.next;
                    }
                    assert_eq!(mapped_blocks, seg.mapped, "blocks and mappings differ");
                    let mut at = chunk.ptr;
                    for (&p, &(n, _)) in &seg.maps {
                        assert!(p >= at, "overlapping mappings");
                        at = p + n as u64;
                    }
                    assert!(at <= chunk.ptr + chunk.size as u64, "a mapping beyond the blocks");
                }
                // A packed chunk, and only one, names the size of the requests it was grown for.
                let packed = chunk.segment.is_none() && a.blocks[chunk.first].kind == Kind::Packed;
                assert_eq!(chunk.unit != 0, packed, "a packed chunk without its size, or a size elsewhere");
                if packed {
                    assert!(
                        chunk.unit > a.config.medium_limit && chunk.unit * 2 <= chunk.size,
                        "a packed chunk's size"
                    );
                }
                let (mut cur, mut prev, mut addr, mut out) = (chunk.first, NIL, chunk.ptr, 0);
                while cur != NIL {
                    let bl = &a.blocks[cur];
                    assert_eq!(bl.chunk, c);
                    assert_eq!(bl.prev, prev);
                    assert_eq!(bl.ptr, addr);
                    assert!(bl.size > 0 && bl.size.is_multiple_of(super::GRANULE));
                    // A large block starts its chunk, and the rest of a large chunk is its tail.
                    let first_kind = a.blocks[chunk.first].kind;
                    match bl.kind {
                        _ if chunk.segment.is_some() => {}
                        Kind::Large => assert_eq!(prev, NIL, "a large block inside a chunk"),
                        Kind::Tail => assert_eq!(first_kind, Kind::Large, "a tail outside a large chunk"),
                        k => assert_eq!(k, first_kind, "blocks of two kinds in a chunk"),
                    }
                    match bl.state {
                        State::Free { stream, seq } => {
                            assert_eq!(bl.slack, 0, "a free block with slack");
                            free_blocks += usize::from(!chunk.releasing);
                            if bl.kind == Kind::Tail && !chunk.releasing {
                                free_tails += bl.size;
                            }
                            let st = &a.streams[stream];
                            assert!(seq <= st.seq);
                            let listed = st.free[bl.kind as usize].get(&(bl.size, bl.ptr));
                            assert_eq!(listed, if chunk.releasing { None } else { Some(&cur) });
                            if bl.next != NIL
                                && let State::Free { stream: s2, .. } = a.blocks[bl.next].state
                            {
                                assert_ne!(s2, stream, "adjacent free blocks of one stream");
                            }
                        }
                        State::Hole => assert!(chunk.segment.is_some(), "a hole outside a segment"),
                        State::Out => {
                            out += 1;
                            out_bytes += bl.size;
                            assert!(bl.slack < bl.size, "a block handed out for nothing");
                            slack += bl.slack;
                            let here = cached.get(&bl.ptr).or(live.get(&bl.ptr));
                            assert_eq!(here, Some(&cur), "an out block neither cached nor live");
                        }
                    }
                    addr += bl.size as u64;
                    prev = cur;
                    cur = bl.next;
                }
                assert_eq!(addr, chunk.ptr + chunk.size as u64);
                assert_eq!(out, chunk.out);
            }
            assert_eq!(cached.len() + live.len(), a.chunks.iter().map(|(_, c)| c.out as usize).sum::<usize>());
            let listed: usize = a.streams.iter().map(|(_, st)| st.free.iter().map(BTreeMap::len).sum::<usize>()).sum();
            assert_eq!(listed, free_blocks);
            for (_, st) in a.streams.iter() {
                assert!(st.completed <= st.recorded && st.recorded <= st.seq);
                if st.key.is_none() {
                    assert_eq!(st.recorded, st.seq, "a forgotten stream with uncovered frees");
                }
            }
            for (stream, &s) in &a.stream_slots {
                assert!(a.streams[s].key.as_ref() == Some(stream));
            }
            assert_eq!(a.stats.reserved, reserved);
            assert_eq!(a.stats.out_bytes, out_bytes);
            assert_eq!(a.stats.slack, slack);
            assert_eq!(a.stats.free_tails, free_tails);
            assert_eq!(a.stats.chunks, a.chunks.len());
            assert!(a.stats.peak_reserved >= a.stats.reserved);
        });
        let st = self.stats();
        assert_eq!(st.live_allocations, live.len());
        let graph_blocks = self.arena(|a| a.graph_blocks().len());
        assert_eq!(st.live_allocations, self.mock.live_allocations().len() + graph_blocks);
    }
}

/// Hands out `n` blocks on stream 0 and frees each (20 and 22 MiB in turn, so that each misses the
/// stream's cache and the arena hands a free block out) without a new peak, where the free memory
/// holds them: what settles the peak ([`Arena::peak_settled`](super::arena::Arena)) after 1,000.
/// Returns the addresses handed out.
fn hand_out_at_the_peak(h: &Harness, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let p = h.alloc((20 + 2 * (i % 2)) * MIB, 0).unwrap();
            h.free(p, 0);
            p
        })
        .collect()
}

/// The default configuration without headroom and size classes, so that unit tests can predict
/// chunk sizes.
fn plain() -> PoolConfig {
    PoolConfig { headroom_percent: None, large_classes_per_octave: 0, ..PoolConfig::default() }
}

//! Unit tests of the pool's decisions, on the mock device.

use super::mock::{Call, Mock, MockErr, S};
use super::*;
use crate::memory::pool::{GRANULE, MAX_REQUEST, trim_to};

const KIB: usize = 1 << 10;

fn harness(streams: usize) -> Harness {
    Harness::new(plain(), Mock::new(streams))
}

/// Kept allocations (buffers that refer to their stream through the pool) are counted on their
/// stream's cache from the cache and from the arena, and uncounted by every free, on their own
/// stream or another, and by `unkeep`.
#[test]
fn kept_allocations_are_counted_through_every_path() {
    let h = harness(2);
    let kept = |s: usize| h.existing_cache(&S(s), |c| c.kept).unwrap_or(0);
    let unkeep = |p: u64| h.existing_cache(&S(0), |c| c.unkeep(p)).unwrap();
    let a = h.alloc_as(1000, 0, true).unwrap(); // from the arena
    let b = h.alloc_as(1000, 0, false).unwrap();
    assert_eq!(kept(0), 1);
    h.free(a, 0);
    assert_eq!(kept(0), 0);
    let c = h.alloc_as(1000, 0, true).unwrap(); // from the cache: `a`'s block
    assert_eq!((c, kept(0)), (a, 1));
    assert!(unkeep(c));
    assert!(!unkeep(c), "once");
    assert!(!unkeep(b), "never kept");
    assert_eq!(kept(0), 0);
    let d = h.alloc_as(3000, 0, true).unwrap();
    assert_eq!(kept(0), 1);
    h.free(d, 1); // on another stream
    assert_eq!((kept(0), kept(1)), (0, 0));
    h.free(b, 0);
    h.free(c, 0);
    h.check();
    h.teardown();
}

#[test]
fn same_stream_reuse_makes_no_backend_call() {
    let h = harness(1);
    let p = h.alloc(1000, 0).unwrap();
    h.free(p, 0);
    let calls = h.mock.st().calls;
    for _ in 0..10 {
        let q = h.alloc(1000, 0).unwrap();
        assert_eq!(q, p);
        h.free(q, 0);
    }
    assert_eq!(h.mock.st().calls, calls, "the hot path called the backend");
    let st = h.stats();
    assert_eq!((st.cache_hits, st.allocations, st.driver_allocs, st.event_records), (10, 11, 1, 0));
    h.check();
    h.teardown();
}

#[test]
fn deallocate_makes_no_backend_call() {
    let h = harness(2);
    let ps: Vec<u64> = (0..8).map(|_| h.alloc(5000, 0).unwrap()).collect();
    let calls = h.mock.st().calls;
    for (i, p) in ps.into_iter().enumerate() {
        h.free(p, i % 2);
    }
    assert_eq!(h.mock.st().calls, calls);
    h.check();
    h.teardown();
}

#[test]
fn cross_stream_reuse_records_once_and_waits_on_the_gpu() {
    let h = harness(2);
    // Fill one small chunk exactly, so that stream 1 cannot grow into its tail.
    let ps: Vec<u64> = (0..4).map(|_| h.alloc(512 * KIB, 0).unwrap()).collect();
    for &p in &ps {
        h.free(p, 0);
    }
    let calls = h.mock.st().calls;
    let q = h.alloc(512 * KIB, 1).unwrap();
    assert!(ps.contains(&q));
    {
        let m = h.mock.st();
        assert_eq!((m.records, m.waits, m.syncs), (1, 1, 0));
        assert_eq!(m.calls - calls, 3, "create + record + wait");
    }
    let st = h.stats();
    assert_eq!((st.cross_stream_reuses, st.event_records, st.event_waits, st.driver_allocs), (1, 1, 1, 1));
    // The one wait covered the whole chunk: the rest comes from the arena with no new event.
    for _ in 0..3 {
        h.alloc(512 * KIB, 1).unwrap();
    }
    assert_eq!(h.mock.records_waits(), (1, 1));
    assert_eq!(h.stats().driver_allocs, 1);
    h.check();
    h.teardown();
}

#[test]
fn blocks_freed_after_the_record_need_a_new_record() {
    let h = harness(2);
    let ps: Vec<u64> = (0..4).map(|_| h.alloc(512 * KIB, 0).unwrap()).collect();
    h.free(ps[0], 0);
    h.alloc(512 * KIB, 1).unwrap();
    assert_eq!(h.mock.records_waits(), (1, 1));
    // Freed after that record: not covered.
    h.free(ps[1], 0);
    h.alloc(512 * KIB, 1).unwrap();
    assert_eq!(h.mock.records_waits(), (2, 2));
    assert_eq!(h.stats().events_created, 1, "one reusable event per stream");
    h.check();
    h.teardown();
}

#[test]
fn frees_on_another_stream_are_cached_there() {
    let h = harness(2);
    let p = h.alloc(64 * KIB, 0).unwrap();
    h.free(p, 1); // the user ordered stream 1 after stream 0's uses
    let calls = h.mock.st().calls;
    assert_eq!(h.alloc(64 * KIB, 1).unwrap(), p, "stream 1 reuses it from its own cache");
    assert_eq!(h.mock.st().calls, calls);
    h.check();
    h.teardown();
}

#[test]
fn caches_go_back_to_the_arena_before_it_grows() {
    let h = harness(1);
    // A medium chunk filled with 4 MiB blocks, freed: cached on stream 0 by size.
    let ps: Vec<u64> = (0..8).map(|_| h.alloc(4 * MIB, 0).unwrap()).collect();
    for &p in &ps {
        h.free(p, 0);
    }
    assert_eq!(h.stats().cached, 32 * MIB);
    // 8 MiB is no cached size: the cache goes back, the blocks merge, and the request fits
    // without growing.
    let c = h.alloc(8 * MIB, 0).unwrap();
    let st = h.stats();
    assert_eq!((st.driver_allocs, st.cached, st.cache_flushes), (1, 0, 1));
    assert_eq!(c, ps[0]);
    h.free(c, 0);
    h.check();
    h.teardown();
}

#[test]
fn large_requests_get_chunks_of_their_own() {
    let h = harness(1);
    let a = h.alloc(100 * MIB + 1, 0).unwrap();
    let st = h.stats();
    assert_eq!((st.reserved, st.chunks), (102 * MIB, 1), "rounded to 2 MiB");
    let b = h.alloc(17 * MIB, 0).unwrap();
    assert_eq!(h.stats().reserved, 120 * MIB);
    let small = h.alloc(100, 0).unwrap();
    assert_eq!(h.stats().reserved, 122 * MIB, "small requests use small chunks only");
    for p in [a, b, small] {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

#[test]
fn headroom_releases_completed_chunks_and_grows_exactly() {
    let h = Harness::new(PoolConfig { headroom_percent: Some(10), ..plain() }, Mock::new(1));
    // A growing tensor, as a KV cache that grows by concatenation: 100, 102, 104 ... MiB.
    let mut prev = h.alloc(100 * MIB, 0).unwrap();
    let mut size = 100 * MIB;
    for _ in 0..20 {
        let next = h.alloc(size + 2 * MIB, 0).unwrap();
        h.free(prev, 0);
        size += 2 * MIB;
        prev = next;
        let st = h.stats();
        let limit = (size + (size - 2 * MIB)) * 11 / 10;
        assert!(st.reserved <= limit + 2 * MIB, "reserved {} for live {}", st.reserved, size);
    }
    assert_eq!(h.mock.st().syncs, 0, "the host never waited");
    assert!(h.stats().driver_frees > 0);
    h.free(prev, 0);
    h.check();
    h.teardown();
}

#[test]
fn headroom_never_blocks_when_frees_are_not_complete() {
    let h = Harness::new(PoolConfig { headroom_percent: Some(0), ..plain() }, Mock::new(1));
    let a = h.alloc(30 * MIB, 0).unwrap();
    h.free(a, 0);
    h.mock.st().query_lag = None; // the GPU is busy: nothing completes
    let b = h.alloc(32 * MIB, 0).unwrap();
    assert_eq!(h.stats().reserved, 62 * MIB, "it grew rather than wait");
    assert_eq!(h.mock.st().syncs, 0);
    h.mock.st().query_lag = Some(0);
    h.free(b, 0);
    let c = h.alloc(36 * MIB, 0).unwrap();
    assert_eq!(h.mock.st().syncs, 0);
    assert!(h.stats().driver_frees >= 1);
    assert!(h.stats().reserved <= 36 * MIB + 32 * MIB);
    h.free(c, 0);
    h.check();
    h.teardown();
}

/// A device of 64 MiB, 40 of them in a free chunk cached on stream 1 and not covered by any
/// event; then 50 MiB on stream 0, with the GPU busy (no free polls complete) or not. Returns
/// the harness and the 50 MiB.
fn fifty_of_sixty_four_after_a_free_elsewhere(gpu_busy: bool) -> (Harness, u64) {
    let h = harness(2);
    h.mock.st().capacity = 64 * MIB;
    let a = h.alloc(40 * MIB, 0).unwrap();
    h.free(a, 1);
    if gpu_busy {
        h.mock.st().query_lag = None;
    }
    let b = h.alloc(50 * MIB, 0).unwrap();
    h.mock.st().query_lag = Some(0);
    (h, b)
}

#[test]
fn near_capacity_releases_what_the_request_lacks_without_waiting() {
    // The device has 24 MiB free: the free chunk goes first (its free polled complete), and the
    // driver is never asked for more than it has.
    let (h, b) = fifty_of_sixty_four_after_a_free_elsewhere(false);
    let st = h.stats();
    assert_eq!((st.oom_recoveries, st.driver_frees, st.reserved), (0, 1, 50 * MIB));
    assert_eq!(h.mock.st().syncs, 0, "no host wait");
    h.free(b, 0);
    h.check();
    h.teardown();
}

#[test]
fn near_capacity_keeps_the_free_chunks_the_request_does_not_need() {
    let h = harness(1);
    h.mock.st().capacity = 100 * MIB;
    let a = h.alloc(30 * MIB, 0).unwrap();
    let b = h.alloc(20 * MIB, 0).unwrap();
    h.free(a, 0);
    h.free(b, 0);
    // 60 MiB with 50 MiB free: 10 MiB short, so the smallest chunk that makes up for it goes, and
    // the other stays cached.
    let c = h.alloc(60 * MIB, 0).unwrap();
    let st = h.stats();
    assert_eq!((st.driver_frees, st.reserved, st.oom_recoveries), (1, 90 * MIB, 0));
    let again = h.alloc(30 * MIB, 0).unwrap();
    assert_eq!(again, a, "the chunk kept serves its size again");
    assert_eq!(h.stats().driver_allocs, 3);
    h.free(again, 0);
    h.free(c, 0);
    h.check();
    h.teardown();
}

#[test]
fn oom_waits_for_frees_then_releases_and_retries_exactly() {
    let (h, b) = fifty_of_sixty_four_after_a_free_elsewhere(true);
    let st = h.stats();
    assert_eq!((st.oom_recoveries, st.driver_frees, st.reserved), (1, 1, 50 * MIB));
    assert!(h.mock.st().syncs > 0, "the host waited (with no lock held) before freeing");
    h.free(b, 0);
    h.check();
    h.teardown();
}

/// Out of memory, once every free chunk went back, a large request takes what a live block pins:
/// here the free tail of a chunk whose block fills it to 80%.
#[test]
fn oom_a_large_request_takes_a_free_tail_as_the_last_resort() {
    let h = harness(1);
    h.mock.st().capacity = 256 * MIB;
    let a = h.alloc(100 * MIB, 0).unwrap();
    h.free(a, 0);
    let b = h.alloc(80 * MIB, 0).unwrap();
    assert_eq!(b, a, "the free chunk serves a request of 80% of it, and keeps a 20 MiB tail");
    let c = h.alloc(150 * MIB, 0).unwrap();
    let d = h.alloc(16 * MIB, 0).unwrap();
    assert_eq!(d, a + (80 * MIB) as u64, "the tail holds the request");
    let st = h.stats();
    assert_eq!((st.reserved, st.driver_allocs, st.oom_recoveries), (250 * MIB, 2, 1), "{st:?}");
    // The tail is no larger than it was: a request it cannot hold is out of memory.
    assert!(matches!(h.alloc(16 * MIB, 0), Err(PoolError::OutOfMemory { .. })));
    for p in [b, c, d] {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

#[test]
fn oom_merges_host_safe_blocks_of_different_streams() {
    let h = harness(2);
    // 36 MiB for the pool, and the 2 MiB it leaves to the driver.
    h.mock.st().capacity = 38 * MIB;
    // Two neighbours in a full medium chunk, freed on different streams.
    let a = h.alloc(4 * MIB, 0).unwrap();
    let b = h.alloc(4 * MIB, 0).unwrap();
    let rest: Vec<u64> = (0..3).map(|_| h.alloc(8 * MIB, 0).unwrap()).collect();
    assert_eq!(h.stats().chunks, 1);
    h.free(a, 0);
    h.free(b, 1);
    let c = h.alloc(8 * MIB, 0).unwrap();
    assert_eq!(c, a, "the neighbours merged once the host saw both frees complete");
    for p in rest.into_iter().chain([c]) {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

#[test]
fn oom_error_reports_the_figures() {
    let h = harness(1);
    h.mock.st().capacity = 10 * MIB;
    let _a = h.alloc(3 * MIB, 0).unwrap();
    let reserved = h.stats().reserved;
    assert_eq!(reserved, 6 * MIB, "the 32 MiB medium chunk did not fit: room for two requests of its size");
    let e = h.alloc(100 * MIB, 0).unwrap_err();
    assert_eq!(e, PoolError::OutOfMemory { requested: 100 * MIB, reserved, in_use: 3 * MIB });
    assert!(e.to_string().contains("104857600 bytes requested"));
    h.check();
    h.teardown();
}

#[test]
fn invalid_frees_change_nothing() {
    let h = harness(2);
    let p = h.alloc(1000, 0).unwrap();
    let before = h.stats();
    for (ptr, bytes, s) in [(p + 512, 1000, 0), (p, 999, 0), (p, 1024, 1), (12345, 1, 1)] {
        assert_eq!(deallocate(&h, ptr, bytes, &S(s)), Err(PoolError::InvalidFree { ptr, bytes }));
    }
    assert_eq!(h.stats(), before);
    h.check();
    h.free(p, 0);
    let before = h.stats();
    assert_eq!(deallocate(&h, p, 1000, &S(0)), Err(PoolError::InvalidFree { ptr: p, bytes: 1000 }), "double free");
    assert_eq!(h.stats(), before);
    h.check();
    h.teardown();
}

#[test]
fn zero_sized_allocations_are_distinct_blocks() {
    let h = harness(1);
    let a = h.alloc(0, 0).unwrap();
    let b = h.alloc(0, 0).unwrap();
    assert_ne!(a, b);
    assert_eq!((h.stats().in_use, h.stats().in_use_blocks), (0, 2 * GRANULE));
    assert_eq!(deallocate(&h, a, 1, &S(0)), Err(PoolError::InvalidFree { ptr: a, bytes: 1 }));
    h.free(a, 0);
    h.free(b, 0);
    h.teardown();
}

#[test]
fn too_large_requests_are_refused() {
    let h = harness(1);
    for n in [usize::MAX, usize::MAX - 10, MAX_REQUEST + 1] {
        assert_eq!(h.alloc(n, 0), Err(PoolError::TooLarge { requested: n }));
    }
    assert_eq!(h.mock.st().calls, 0);
    h.mock.st().capacity = 1 << 30;
    assert!(matches!(h.alloc(MAX_REQUEST, 0), Err(PoolError::OutOfMemory { .. })));
    h.check();
    h.teardown();
}

/// A free that unwinds (a backend that panics after the driver gave the memory back) leaves no
/// chunk in flight: that chunk counts as freed, those not reached yet stay cached, and the pool
/// goes on with its accounting matching the driver's.
#[test]
fn a_free_that_unwinds_is_settled_and_the_chunks_it_did_not_reach_stay_cached() {
    let h = harness(1);
    let blocks: Vec<u64> = [30, 20, 10].map(|mib| h.alloc(mib * MIB, 0).unwrap()).to_vec();
    for &p in &blocks[..2] {
        h.free(p, 0);
    }
    h.mock.st().unwind_after = Some(Call::Free);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| trim_to(&h, 10 * MIB)));
    assert!(r.is_err(), "the free unwound");
    assert_eq!(h.arena(|a| a.releasing_bytes()), 0, "a chunk left in flight");
    h.check();
    // The largest went first (30 MiB) and unwound after the driver freed it; the 20 MiB chunk,
    // not reached, is cached still and serves a request.
    let (st, (reserved, _, _, frees)) = (h.stats(), h.mock.chunk_figures());
    assert_eq!((st.reserved, reserved, st.driver_frees, frees), (30 * MIB, 30 * MIB, 1, 1));
    assert_eq!(h.alloc(20 * MIB, 0).unwrap(), blocks[1]);
    h.teardown();
}

#[test]
fn trim_releases_whole_free_chunks_waiting_with_no_lock_held() {
    let h = harness(2);
    let a = h.alloc(30 * MIB, 0).unwrap();
    let b = h.alloc(20 * MIB, 1).unwrap();
    let c = h.alloc(10 * MIB, 0).unwrap();
    h.free(a, 0);
    h.free(b, 1);
    assert_eq!(h.stats().reserved, 60 * MIB, "large requests: chunks of their own");
    trim_to(&h, 40 * MIB).unwrap();
    // The smallest free chunk that is enough alone goes: the 20 MiB one.
    assert_eq!(h.stats().reserved, 40 * MIB);
    trim_to(&h, 0).unwrap();
    assert_eq!(h.stats().reserved, 10 * MIB, "the chunk in use stays");
    assert!(h.mock.st().syncs >= 1);
    h.check();
    h.free(c, 0);
    h.teardown();
}

#[test]
fn retired_streams_blocks_are_reused_after_their_event() {
    let h = harness(3);
    let ps: Vec<u64> = (0..4).map(|_| h.alloc(512 * KIB, 0).unwrap()).collect();
    let orphan = h.alloc(4 * MIB, 0).unwrap(); // in a chunk of its own kind
    for &p in &ps {
        h.free(p, 0);
    }
    h.retire(0);
    assert_eq!(h.mock.st().records, 1, "one last event covers the retired stream's frees");
    let q = h.alloc(512 * KIB, 1).unwrap();
    assert!(ps.contains(&q));
    assert_eq!(h.mock.st().waits, 1);
    // A live allocation of the retired stream can still be freed, on another stream.
    h.free(orphan, 2);
    h.check();
    h.teardown();
}

/// Frees four 512 KiB blocks on stream 0, then retires it with its last record failing: the
/// arena keeps the stream (the harness does not destroy it). Returns the freed blocks.
fn retire_with_a_failed_record(h: &Harness) -> Vec<u64> {
    let ps: Vec<u64> = (0..4).map(|_| h.alloc(512 * KIB, 0).unwrap()).collect();
    for &p in &ps {
        h.free(p, 0);
    }
    h.mock.st().fail = Some(Call::Record);
    h.retire(0);
    assert!(h.mock.st().fail.is_none(), "the last record was tried");
    assert!(!h.mock.is_destroyed(0));
    assert_eq!(h.arena(|a| (a.unforgotten, a.stream_slots.contains_key(&S(0)))), (1, true), "kept");
    ps
}

#[test]
fn a_stream_whose_last_record_failed_is_forgotten_by_the_next_trim() {
    let h = harness(2);
    retire_with_a_failed_record(&h);
    trim_to(&h, 0).unwrap();
    assert_eq!(h.arena(|a| (a.unforgotten, a.stream_slots.contains_key(&S(0)))), (0, false));
    h.mock.destroy_stream(0);
    let st = h.stats();
    assert_eq!((st.reserved, st.streams), (0, 0), "{st:?}");
    h.check();
    h.teardown();
}

#[test]
fn a_stream_whose_last_record_failed_is_forgotten_when_another_retires() {
    let h = harness(3);
    let ps = retire_with_a_failed_record(&h);
    let records = h.mock.st().records;
    let q = h.alloc(512 * KIB, 1).unwrap();
    h.free(q, 1);
    h.retire(1);
    assert_eq!(h.arena(|a| (a.unforgotten, a.stream_slots.len())), (0, 0), "both forgotten");
    assert_eq!(h.mock.st().records, records + 2, "stream 0's record, then stream 1's");
    h.mock.destroy_stream(0);
    // Stream 0's blocks are reused after a wait on the record made for it (the mock checks the
    // order of every reuse against the frees).
    let waits = h.mock.st().waits;
    let r: Vec<u64> = (0..4).map(|_| h.alloc(512 * KIB, 2).unwrap()).collect();
    assert!(r.iter().any(|p| ps.contains(p)), "{r:x?} {ps:x?}");
    assert!(h.mock.st().waits > waits);
    for p in r {
        h.free(p, 2);
    }
    h.check();
    h.teardown();
}

#[test]
fn a_stream_kept_after_a_failed_record_that_gets_a_user_again_is_not_forgotten_under_it() {
    let h = harness(2);
    retire_with_a_failed_record(&h);
    // A new user (a per-thread stream can have one): the stream is the arena's again.
    let p = h.alloc(512 * KIB, 0).unwrap();
    assert_eq!(h.arena(|a| (a.unforgotten, a.stream_slots.contains_key(&S(0)))), (0, true));
    trim_to(&h, 0).unwrap();
    assert!(h.arena(|a| a.stream_slots.contains_key(&S(0))), "a trim forgets no stream in use");
    h.free(p, 0);
    h.retire(0);
    assert!(h.mock.is_destroyed(0));
    h.check();
    h.teardown();
}

#[test]
fn teardown_reports_live_allocations() {
    let h = harness(1);
    let p = h.alloc(3 * MIB, 0).unwrap();
    let leaked = super::super::teardown(&h).unwrap();
    assert_eq!((leaked.allocations, leaked.bytes, leaked.chunks), (1, 3 * MIB, 1));
    h.free(p, 0);
    h.teardown();
}

#[test]
fn backend_errors_leave_the_pool_consistent() {
    for call in [Call::Alloc, Call::Create, Call::Record, Call::Wait, Call::Sync, Call::Free] {
        let h = harness(2);
        h.mock.st().capacity = 8 * MIB;
        let ps: Vec<u64> = (0..4).map(|_| h.alloc(512 * KIB, 0).unwrap()).collect();
        for &p in &ps {
            h.free(p, 0);
        }
        h.mock.st().fail = Some(call);
        // Cross-stream reuse (create, record, wait), growth (alloc), then trim (sync, free).
        let r = h.alloc(512 * KIB, 1);
        let big = h.alloc(6 * MIB, 1);
        let mut failed = r.is_err() || big.is_err();
        h.check();
        for x in [r, big].into_iter().flatten() {
            h.free(x, 1);
        }
        failed |= trim_to(&h, 0).is_err();
        assert!(failed, "{call:?} was injected but nothing failed");
        assert!(h.mock.st().fail.is_none(), "{call:?} was never called");
        h.check();
        // Whatever failed, a second trim gives everything back.
        trim_to(&h, 0).unwrap();
        assert_eq!(h.stats().reserved, 0, "{call:?}");
        h.teardown();
        let _ = MockErr::Injected;
    }
}

#[test]
fn the_pool_learns_what_the_driver_keeps_back() {
    // The emulated driver keeps 6 MiB of what it reports free; the pool starts planning with 2.
    let h = harness(1);
    h.mock.st().capacity = 100 * MIB;
    h.mock.st().spare = 6 * MIB;
    assert_eq!(h.stats().driver_spare, 2 * MIB);
    let a = h.alloc(60 * MIB, 0).unwrap();
    // 38 MiB with 40 reported free: planned to fit, refused, and nothing can make room.
    let refused = h.alloc(38 * MIB, 0).unwrap_err();
    assert!(matches!(refused, PoolError::OutOfMemory { .. }), "{refused:?}");
    // It left 2 MiB, so the driver keeps more than 2: the pool plans with 4 from now on.
    assert_eq!(h.stats().driver_spare, 4 * MIB);
    // 35 MiB (36 with 4 MiB to spare) is refused too: the pool learns 6.
    assert!(h.alloc(35 * MIB, 0).is_err());
    assert_eq!(h.stats().driver_spare, 6 * MIB);
    // A 10 MiB chunk cached free beside the 60 live leaves 30 reported free. 26 MiB then needs
    // it released first: the pool plans for the driver's 6 MiB and releases before asking, so
    // nothing fails and no recovery runs (planning with 2 MiB, it would ask with 30 free, be
    // refused, and recover).
    let d = h.alloc(10 * MIB, 0).unwrap();
    h.free(d, 0);
    let before = h.stats();
    let e = h.alloc(26 * MIB, 0).unwrap();
    let st = h.stats();
    assert_eq!((st.oom_recoveries, st.driver_frees), (before.oom_recoveries, before.driver_frees + 1), "{st:?}");
    assert_eq!(st.driver_spare, 6 * MIB);
    h.free(e, 0);
    h.free(a, 0);
    h.check();
    h.teardown();
}

#[test]
fn tails_of_large_chunks_serve_small_and_medium_requests_before_out_of_memory() {
    // A 12.5 MiB request takes a 14 MiB chunk (whole 2 MiB pages): its 1.5 MiB tail serves a
    // 256 KiB and a 1.25 MiB request when the device has no room left for their own chunks (after
    // the out-of-memory recovery), and stays apart while it has room.
    for (capacity, short) in [(64 * MIB, false), (15 * MIB, true)] {
        let h = harness(1);
        h.mock.st().capacity = capacity;
        let big = h.alloc(12 * MIB + 512 * KIB, 0).unwrap();
        assert_eq!(h.stats().reserved, 14 * MIB);
        let small = h.alloc(256 * KIB, 0).unwrap();
        let medium = h.alloc(MIB + 256 * KIB, 0).unwrap();
        h.check();
        let in_tail = |p: u64| (big + (12 * MIB + 512 * KIB) as u64..big + 14 * MIB as u64).contains(&p);
        let st = h.stats();
        if short {
            assert!(in_tail(small) && in_tail(medium), "{small:#x} {medium:#x} outside {big:#x}'s tail");
            assert_eq!((st.driver_allocs, st.reserved, st.oom_recoveries), (1, 14 * MIB, 2));
        } else {
            assert!(!in_tail(small) && !in_tail(medium));
            assert_eq!((st.driver_allocs, st.oom_recoveries), (3, 0), "a small and a medium chunk of their own");
        }
        // Freed, the tail merges back into the large block: each chunk is one free block again.
        for p in [small, big, medium] {
            h.free(p, 0);
        }
        trim_to(&h, usize::MAX).unwrap();
        let chunks = h.stats().chunks;
        assert_eq!(h.arena(|a| (a.blocks.len(), a.stats.free_tails)), (chunks, 0));
        h.check();
        trim_to(&h, 0).unwrap();
        assert_eq!(h.stats().reserved, 0);
        h.teardown();
    }
}

#[test]
fn a_small_block_does_not_take_a_tail_while_the_device_has_room_for_its_chunk() {
    // Near capacity, a small block in the tail of a 62 MiB chunk would keep the chunk from going
    // back once its large block is freed, and a 64 MiB request would then find no room.
    for config in [plain(), PoolConfig::default()] {
        let h = Harness::new(config, Mock::new(1));
        h.mock.st().capacity = 70 * MIB;
        let big = h.alloc(60 * MIB + 512 * KIB, 0).unwrap();
        let small = h.alloc(256 * KIB, 0).unwrap();
        h.free(big, 0);
        let r = h.alloc(64 * MIB, 0).expect("256 KiB and 64 MiB fit in 70 MiB");
        h.check();
        h.free(r, 0);
        h.free(small, 0);
        h.teardown();
    }
}

#[test]
fn past_the_headroom_a_large_request_takes_a_free_block_then_a_tail_within_the_headrooms_share() {
    // 40 and 60 MiB live (the headroom: 120 MiB), then the 40 MiB freed. A 24 MiB request fills
    // the free block to 60%, below the 75% fit, and growing would pass the headroom: the pool
    // would release the 40 MiB chunk to make a 24 MiB one. Instead it hands out the free block,
    // as long as what blocks leave unused (16 MiB here) stays within the headroom's share of
    // peak live (20 MiB) and within 1% of the device's memory (not on a 1 GiB device: 10.24
    // MiB). With a headroom of 10%, a 16 MiB request passes it too, but would leave 24 MiB, past
    // the share (10 MiB): it is not reused.
    for (headroom, capacity, request, reused) in
        [(20, usize::MAX, 24, true), (20, 1 << 30, 24, false), (10, usize::MAX, 16, false)]
    {
        let config = PoolConfig { headroom_percent: Some(headroom), ..plain() };
        let h = Harness::new(config, Mock::new(1));
        h.mock.st().capacity = capacity;
        let a = h.alloc(40 * MIB, 0).unwrap();
        let b = h.alloc(60 * MIB, 0).unwrap();
        h.free(a, 0);
        let c = h.alloc(request * MIB, 0).unwrap();
        h.check();
        let st = h.stats();
        let mut more = Vec::new();
        if reused {
            assert_eq!(c, a);
            assert_eq!((st.driver_allocs, st.driver_frees, st.reserved), (2, 0, 100 * MIB), "{capacity}");
            assert_eq!(h.arena(|a| (a.stats.loose_fits, a.stats.free_tails)), (1, 16 * MIB));
            // An 18 MiB block grows the pool within the headroom (118 MiB), and is freed. Then a
            // 10 MiB request (56% of that block) would pass the headroom: it takes the 16 MiB
            // tail, which the first block pins anyway, before the free 18 MiB block.
            let d = h.alloc(18 * MIB, 0).unwrap();
            h.free(d, 0);
            let e = h.alloc(10 * MIB, 0).unwrap();
            h.check();
            assert_eq!(e, a + 24 * MIB as u64);
            let st = h.stats();
            assert_eq!((st.driver_allocs, st.driver_frees, st.reserved), (3, 0, 118 * MIB));
            assert_eq!(h.arena(|a| (a.stats.loose_fits, a.stats.free_tails)), (2, 6 * MIB));
            more.push(e);
        } else {
            assert_ne!(c, a);
            assert_eq!((st.driver_allocs, st.driver_frees, st.reserved), (3, 1, (60 + request) * MIB), "{capacity}");
            assert_eq!(h.arena(|a| a.stats.loose_fits), 0);
        }
        // Freed, the blocks merge with the tail: a 32 MiB request (80%) takes the whole chunk.
        h.free(c, 0);
        for p in more {
            h.free(p, 0);
        }
        let d = h.alloc(32 * MIB, 0).unwrap();
        assert_eq!(d == a, reused);
        h.free(d, 0);
        h.free(b, 0);
        h.check();
        h.teardown();
    }
}

// The 1000 handouts that settle the peak take minutes under Miri; the bookkeeping the test reaches
// (a tail handed out past the headroom, split and merged back) runs there in
// `past_the_headroom_a_large_request_takes_a_free_block_then_a_tail_within_the_headrooms_share`.
#[test]
#[cfg_attr(miri, ignore)]
fn past_a_settled_peaks_headroom_a_medium_request_takes_a_free_tail() {
    // 24 and 72 MiB live (peak 96 MiB; a headroom of 5%: 100.8 MiB), then the 24 MiB freed and
    // an 18 MiB request given its block (75%): the block's last 6 MiB become its chunk's free
    // tail. A 6 MiB request (medium) finds no free medium block, and a chunk for it would pass
    // the headroom. While the peak has not settled the tail is the last resort: the pool grows a
    // 6 MiB chunk. Once the arena has handed out 1000 blocks with the peak where it is, the
    // request takes the tail, memory that the 18 MiB block keeps from the driver anyway.
    for settled in [false, true] {
        let config = PoolConfig { headroom_percent: Some(5), ..plain() };
        let h = Harness::new(config, Mock::new(1));
        let a = h.alloc(24 * MIB, 0).unwrap();
        let b = h.alloc(72 * MIB, 0).unwrap();
        h.free(a, 0);
        if settled {
            let handed = hand_out_at_the_peak(&h, 1000);
            assert!(handed.iter().all(|&x| x == a), "the free block that holds them");
        }
        let c = h.alloc(18 * MIB, 0).unwrap();
        assert_eq!(c, a);
        assert_eq!(h.arena(|a| a.stats.free_tails), 6 * MIB);
        let m = h.alloc(6 * MIB, 0).unwrap();
        h.check();
        let st = h.stats();
        if settled {
            assert_eq!(m, a + 18 * MIB as u64, "the tail");
            assert_eq!((st.driver_allocs, st.reserved), (2, 96 * MIB));
            assert_eq!(h.arena(|a| (a.stats.loose_fits, a.stats.free_tails)), (1, 0));
        } else {
            assert_eq!((st.driver_allocs, st.reserved), (3, 102 * MIB));
            assert_eq!(h.arena(|a| (a.stats.loose_fits, a.stats.free_tails)), (0, 6 * MIB));
        }
        for p in [m, c, b] {
            h.free(p, 0);
        }
        h.check();
        h.teardown();
    }
}

#[test]
#[cfg_attr(miri, ignore)] // 1000 handouts to settle the peak: minutes under Miri
fn a_tail_that_merges_into_its_free_large_block_when_borrowed_is_not_taken_past_the_headroom() {
    // As above, with the peak settled, but the 18 MiB block is freed on stream 1 while its 6 MiB
    // tail is free on stream 0 (apart, on two streams). A 6 MiB request on stream 1 borrows the
    // tail: moved to stream 1 it merges with the free 18 MiB block into the whole free 24 MiB
    // chunk. That is a free large block, which a medium request does not take past the headroom
    // (it would keep the whole chunk from the driver for 6 MiB): the request grows its own chunk,
    // and the free large chunk goes back to the driver to make room for it.
    let config = PoolConfig { headroom_percent: Some(5), ..plain() };
    let h = Harness::new(config, Mock::new(2));
    h.mock.st().query_lag = None; // the GPU is busy: a block moves between streams after a wait
    let a = h.alloc(24 * MIB, 0).unwrap();
    let b = h.alloc(72 * MIB, 0).unwrap();
    h.free(a, 0);
    hand_out_at_the_peak(&h, 1000);
    let c = h.alloc(18 * MIB, 0).unwrap();
    assert_eq!(c, a);
    h.free(c, 1); // cached on stream 1
    let small = h.alloc(4096, 1).unwrap(); // a miss gives stream 1's cache back: the 18 MiB block is free there
    let m = h.alloc(6 * MIB, 1).unwrap();
    h.check();
    assert!(!(a..a + 24 * MIB as u64).contains(&m), "a medium block in the free large chunk at {a:#x}: {m:#x}");
    assert_eq!(h.arena(|a| a.stats.loose_fits), 0);
    assert_eq!(h.arena(|a| a.stats.free_tails), 0);
    for p in [m, small, b] {
        h.free(p, 1);
    }
    h.check();
    h.teardown();
}

#[test]
fn a_large_chunk_whose_size_class_passes_the_headroom_takes_what_the_headroom_leaves() {
    // A headroom of 5%. 100 MiB take a chunk of their size class (104 MiB). A 66 MiB request
    // lifts the peak of live memory to 166 MiB (headroom: 174.3 MiB); its class (72 MiB) would
    // pass it, and exactly its pages would fit: the chunk takes what the headroom leaves, 70 MiB,
    // so that after its free a request of 69 MiB (the same buffer a step later, a little larger)
    // reuses it. Growing exactly would have given 66 MiB, and the 69 MiB request would have
    // given it back to grow 70.
    for classes in [8, 0] {
        let config = PoolConfig { headroom_percent: Some(5), large_classes_per_octave: classes, ..plain() };
        let h = Harness::new(config, Mock::new(1));
        let a = h.alloc(100 * MIB, 0).unwrap();
        let r = h.alloc(66 * MIB, 0).unwrap();
        let chunk = h.stats().reserved - if classes > 0 { 104 * MIB } else { 100 * MIB };
        h.free(r, 0);
        let r2 = h.alloc(69 * MIB, 0).unwrap();
        h.check();
        let st = h.stats();
        if classes > 0 {
            assert_eq!(chunk, 70 * MIB);
            assert_eq!((r2, st.driver_allocs, st.driver_frees), (r, 2, 0));
        } else {
            // Without size classes every chunk is exact: 66 MiB, given back for 70.
            assert_eq!(chunk, 66 * MIB);
            assert_eq!((st.driver_allocs, st.driver_frees), (3, 1));
        }
        h.free(r2, 0);
        h.free(a, 0);
        h.check();
        h.teardown();
    }
}

#[test]
fn a_borrowed_large_block_that_merges_with_its_tail_is_handed_out() {
    // A 12.5 MiB block (14 MiB chunk) freed on stream 1 serves a 10 MiB request on stream 0 (80%
    // of it). Moved to stream 0, it merges with its tail, which is stream 0's: the 14 MiB block
    // is past the fit (75%), but it holds the block that was chosen, and serves.
    let h = harness(2);
    let big = h.alloc(12 * MIB + 512 * KIB, 0).unwrap();
    h.free(big, 1);
    let p = h.alloc(10 * MIB, 0).unwrap();
    assert_eq!(p, big, "the freed block serves the request");
    let st = h.stats();
    assert_eq!((st.driver_allocs, st.cross_stream_reuses), (1, 1));
    assert_eq!(h.arena(|a| a.stats.free_tails), 4 * MIB, "the rest is the chunk's tail again");
    h.check();
    h.free(p, 0);
    h.teardown();
}

#[test]
fn the_devices_free_memory_is_asked_again_only_once_stale_or_when_the_driver_refuses() {
    // A report of free memory costs a driver call (`cuMemGetInfo`, 7 µs on the H200): within its
    // freshness the pool counts its own growth instead of asking again.
    let h = Harness::new(PoolConfig { headroom_percent: None, ..plain() }, Mock::new(1));
    h.mock.st().capacity = 200 * MIB;
    h.arena(|a| a.free_fresh = std::time::Duration::from_secs(3600));
    let reports = || h.mock.st().free_memory_reports;
    let a = h.alloc(20 * MIB, 0).unwrap();
    let b = h.alloc(20 * MIB, 0).unwrap();
    let c = h.alloc(20 * MIB, 0).unwrap();
    assert_eq!((h.stats().driver_allocs, reports()), (3, 1));
    // Another allocator takes 100 of the 140 MiB left, unseen: the pool believes 140 MiB free, so
    // a 60 MiB request is no growth near capacity to it. The driver refuses it; the pool asks
    // afresh, releases nothing it could (all is live), and reports out of memory without losing
    // anything.
    h.mock.st().capacity -= 100 * MIB;
    let err = h.alloc(60 * MIB, 0).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err:?}");
    assert!(reports() >= 2, "asked afresh after the refusal");
    // Now it knows: a 30 MiB request near capacity grows exactly, and fits.
    let d = h.alloc(30 * MIB, 0).unwrap();
    assert_eq!(h.stats().reserved, 90 * MIB);
    // With no freshness, every growth asks.
    h.arena(|a| a.free_fresh = std::time::Duration::ZERO);
    let before = reports();
    let e = h.alloc(4 * MIB, 0).unwrap();
    assert_eq!(reports(), before + 1);
    h.check();
    for p in [a, b, c, d, e] {
        h.free(p, 0);
    }
    h.teardown();
}

#[test]
fn a_medium_chunk_cut_down_by_the_headroom_holds_a_few_requests_of_its_size() {
    // 64 MiB live, then 2.4 MiB tensors one after another: a 32 MiB medium chunk would pass the
    // 20% headroom (76.8 MiB), an exact one (4 MiB) would hold one of them and leave 1.6 MiB that
    // the next cannot use. An 8 MiB chunk holds three (1 MiB left).
    let h = Harness::new(PoolConfig { headroom_percent: Some(20), ..plain() }, Mock::new(1));
    let large = h.alloc(64 * MIB, 0).unwrap();
    let tensor = 2 * MIB + 2 * MIB / 5;
    let tensors: Vec<u64> = (0..3).map(|_| h.alloc(tensor, 0).unwrap()).collect();
    let (reserved, chunks, allocs, _) = h.mock.chunk_figures();
    assert_eq!((reserved, chunks, allocs), (72 * MIB, 2, 2), "one 8 MiB chunk for the three");
    assert_eq!(tensors[1] - tensors[0], tensor.next_multiple_of(GRANULE) as u64, "side by side");
    assert_eq!(tensors[2] - tensors[1], tensors[1] - tensors[0]);
    for p in tensors.into_iter().chain([large]) {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

/// Large requests of a size that recurs (a model's 12.5 MiB weights) share packed chunks: after
/// the first, which has a chunk of its own (14 MiB, 1.5 MiB of it unused), each chunk of 38 MiB
/// holds three, side by side, with 0.5 MiB of its last page unused. A request of another size
/// does not take a packed chunk's room: it gets a chunk of its own, and the room waits for the
/// next requests of its size, served with no driver call.
#[test]
fn large_requests_of_a_recurring_size_share_packed_chunks() {
    let h = harness(1);
    let weight = 12 * MIB + MIB / 2;
    let weights: Vec<u64> = (0..8).map(|_| h.alloc(weight, 0).unwrap()).collect();
    let (reserved, chunks, allocs, _) = h.mock.chunk_figures();
    assert_eq!((reserved, chunks, allocs), ((14 + 3 * 38) * MIB, 4, 4), "14 MiB, then 38 MiB for each three");
    // The second to the fourth in one chunk, the fifth to the seventh in the next, side by side.
    for i in [1, 2, 4, 5] {
        assert_eq!(weights[i + 1] - weights[i], weight as u64, "weight {i} and the next");
    }
    // A 9.4 MiB request gets a 10 MiB chunk of its own beside the third chunk's room for two.
    let other = h.alloc(9 * MIB + 3 * MIB / 8, 0).unwrap();
    assert_eq!(h.mock.chunk_figures().2, 5);
    assert!(other < weights[7] || other > weights[7] + 2 * weight as u64, "another size in a packed chunk's room");
    // The next two weights fill that room.
    let more: Vec<u64> = (0..2).map(|_| h.alloc(weight, 0).unwrap()).collect();
    assert_eq!(h.mock.chunk_figures().2, 5, "served with no driver call");
    assert_eq!(more, [weights[7] + weight as u64, weights[7] + 2 * weight as u64]);
    h.check();
    for p in weights.into_iter().chain(more).chain([other]) {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

/// A growth that the driver refused does not count as the size recurring: the out-of-memory
/// recovery's retry of the same request (after a free chunk went back) gets a chunk of its own,
/// not one packed for three.
#[test]
fn a_refused_growth_does_not_make_its_size_recur() {
    let h = harness(1);
    // The driver keeps 30 MiB back (the pool plans with 2): with a free 100 MiB chunk cached,
    // 40 MiB are reported free and a 14 MiB chunk is refused.
    h.mock.st().capacity = 140 * MIB;
    h.mock.st().spare = 30 * MIB;
    let cached = h.alloc(100 * MIB, 0).unwrap();
    h.free(cached, 0);
    let weight = 12 * MIB + MIB / 2;
    let p = h.alloc(weight, 0).unwrap();
    let st = h.stats();
    assert_eq!(st.oom_recoveries, 1, "{st:?}");
    assert_eq!((st.reserved, st.chunks), (14 * MIB, 1), "a chunk of its own after the retry");
    h.free(p, 0);
    h.check();
    h.teardown();
}

/// What a packed chunk keeps beyond its request is at most a quarter of the device's free
/// memory: with 80 MiB free, a second 12.5 MiB weight gets a chunk of its own (a packed one would
/// keep 25.5 MiB for the next two), with 120 MiB free a packed chunk.
#[test]
fn a_packed_chunk_keeps_at_most_a_quarter_of_the_devices_free_memory() {
    for (free_after_first, packed) in [(80 * MIB, false), (120 * MIB, true)] {
        let h = harness(1);
        h.mock.st().capacity = 14 * MIB + free_after_first;
        let weight = 12 * MIB + MIB / 2;
        let first = h.alloc(weight, 0).unwrap();
        let second = h.alloc(weight, 0).unwrap();
        let reserved = h.mock.chunk_figures().0;
        assert_eq!(reserved, if packed { (14 + 38) * MIB } else { 28 * MIB }, "{free_after_first} bytes free");
        for p in [first, second] {
            h.free(p, 0);
        }
        h.check();
        h.teardown();
    }
}

/// Out of memory, a request takes a free block of another size class that holds it: here a
/// large request (above `medium_limit`) the free end of a medium chunk that its live blocks
/// keep. Before, only tails and (for a large request) large blocks were looked at, and the
/// request failed with 14 MiB free in the pool.
#[test]
fn oom_a_request_takes_a_free_block_of_another_kind_as_the_last_resort() {
    let h = harness(1);
    h.mock.st().capacity = 64 * MIB;
    // One 32 MiB medium chunk: three 6 MiB blocks, the middle one freed, 14 MiB free at its end.
    let m: Vec<u64> = (0..3).map(|_| h.alloc(6 * MIB, 0).unwrap()).collect();
    assert_eq!((m[1] - m[0], m[2] - m[1]), ((6 * MIB) as u64, (6 * MIB) as u64), "one chunk");
    h.free(m[1], 0);
    // A large chunk of its own takes the device but for 2 MiB.
    let large = h.alloc(30 * MIB, 0).unwrap();
    assert_eq!(h.mock.chunk_figures().0, 62 * MIB);
    // 9 MiB: no free large block, no room for a chunk, no free chunk to give back.
    let p = h.alloc(9 * MIB, 0).expect("the free end of the medium chunk holds it");
    assert_eq!(p, m[2] + (6 * MIB) as u64, "the best fit: the 14 MiB at the end, not the 6 MiB hole");
    let st = h.stats();
    assert_eq!((st.reserved, st.driver_allocs, st.oom_recoveries), (62 * MIB, 2, 1), "{st:?}");
    // Written where nothing else lives: the mock checks every block against the live ones.
    for q in [p, large, m[0], m[2]] {
        h.free(q, 0);
    }
    h.check();
    h.teardown();
}

/// Near the device's capacity, a large request takes a free chunk larger than its own size
/// class only while what blocks leave unused stays within half the room the device leaves above
/// the most memory live at once: past that it gets an exact chunk, in the room of a free chunk
/// given back. A second round of smaller tensors (27 MiB in the 32 MiB chunks the first round of
/// 31 MiB left) then fits with the request that makes its peak; taking every 32 MiB chunk, it
/// left 40 MiB unused and ran out of memory.
#[test]
fn near_capacity_a_loose_reuse_pins_no_more_than_the_device_leaves_room_for() {
    let h = harness(1);
    // 8 x 31 MiB live at the peak (248 MiB), in 8 exact 32 MiB chunks; the device holds 272.
    h.mock.st().capacity = 272 * MIB;
    let first: Vec<u64> = (0..8).map(|_| h.alloc(31 * MIB, 0).unwrap()).collect();
    for p in first {
        h.free(p, 0);
    }
    assert_eq!(h.mock.chunk_figures().0, 256 * MIB);
    // The second round: 8 x 27 MiB, then 32 MiB, 248 MiB live again.
    let second: Vec<u64> = (0..8).map(|_| h.alloc(27 * MIB, 0).unwrap()).collect();
    let st = h.stats();
    // Room: (256 + 16 - 2 [the driver's spare] - 248) / 2 = 11 MiB: two reuses leave 5 MiB each;
    // six exact 28 MiB chunks, in the room of five 32 MiB chunks given back (and of what the
    // device had left); one 32 MiB chunk stays free.
    assert_eq!((st.reserved, st.driver_allocs, st.driver_frees), (3 * 32 * MIB + 6 * 28 * MIB, 14, 5), "{st:?}");
    let peak = h.alloc(32 * MIB, 0).expect("the peak fits");
    let st = h.stats();
    assert_eq!((st.reserved, st.driver_allocs, st.oom_recoveries), (264 * MIB, 14, 0), "the free chunk serves it");
    for p in second.into_iter().chain([peak]) {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

/// One step of a workload: 100 MiB of weights live, four 40 MiB activations freed, a small request
/// whose miss gives the stream's cache back, optionally `reset_peaks`, then a 42 MiB request and
/// the four 40 MiB ones again. Returns the driver's (allocations, frees) in that second pass and
/// the reported figures just after the reset point.
fn step_after_a_reset(reset: bool) -> ((u64, u64), PoolStats) {
    let config = PoolConfig { expandable: false, headroom_percent: Some(20), large_classes_per_octave: 0, ..plain() };
    let h = Harness::new(config, Mock::new(1));
    let w = h.alloc(100 * MIB, 0).unwrap();
    let acts: Vec<u64> = (0..4).map(|_| h.alloc(40 * MIB, 0).unwrap()).collect();
    for p in acts {
        h.free(p, 0);
    }
    let s = h.alloc(4096, 0).unwrap();
    if reset {
        crate::memory::pool::reset_peaks(&h);
    }
    let before = h.stats();
    let x = h.alloc(42 * MIB, 0).unwrap();
    let acts: Vec<u64> = (0..4).map(|_| h.alloc(40 * MIB, 0).unwrap()).collect();
    let after = h.stats();
    h.check();
    for p in acts.into_iter().chain([x, s, w]) {
        h.free(p, 0);
    }
    h.teardown();
    ((after.driver_allocs - before.driver_allocs, after.driver_frees - before.driver_frees), before)
}

#[test]
fn reset_peaks_resets_the_reported_marks_and_leaves_what_the_pool_keeps() {
    // The reported high-water marks go to the current values; the pool's placement, which follows
    // the most memory live at once, does not change: the second pass reuses the four cached 40 MiB
    // blocks and grows once for the 42 MiB request, as without the reset. (When the reset also
    // reset that peak to what was live, the 42 MiB growth passed the headroom over 100 MiB: the
    // pool gave the four blocks back and allocated them again, 5 allocations and 4 frees.)
    let (without, kept) = step_after_a_reset(false);
    let (with, reset) = step_after_a_reset(true);
    assert_eq!(without, (1, 0));
    assert_eq!(with, without, "a reset of the figures changed the driver calls");
    assert_eq!(kept.peak_in_use, 260 * MIB);
    assert_eq!((reset.peak_in_use, reset.peak_reserved), (reset.in_use, reset.reserved));
    assert_eq!(reset.in_use, 100 * MIB + 4096);
}

#[test]
fn a_request_the_device_refuses_does_not_turn_reservoirs_off() {
    // Reservoirs are not taken once a request has been an eighth of what the pool can reach
    // (such workloads rely on the driver to put memory back together). A request refused for
    // being larger than the device is not one the workload made: after it, the same workload
    // takes its reservoirs as before, with as many driver calls.
    let run = |refused_first: bool| {
        let h = Harness::new(PoolConfig { expandable: false, reservoir: true, ..PoolConfig::default() }, Mock::new(1));
        h.mock.st().capacity = 1 << 30;
        if refused_first {
            assert!(matches!(h.alloc(2 << 30, 0), Err(PoolError::OutOfMemory { .. })));
        }
        let weights: Vec<u64> = (0..28).map(|_| h.alloc(25 * MIB, 0).unwrap()).collect();
        let mut percent = 30;
        for step in 0..60 {
            percent = 30 + (percent * 37 + step * 11) % 71;
            let acts: Vec<u64> = (0..8).map(|i| h.alloc((10 + 5 * i) * MIB / 100 * percent, 0).unwrap()).collect();
            for p in acts.into_iter().rev() {
                h.free(p, 0);
            }
        }
        h.check();
        let st = h.stats();
        for p in weights {
            h.free(p, 0);
        }
        h.teardown();
        (st.reservoirs, st.driver_allocs)
    };
    let plain_run = run(false);
    assert!(plain_run.0 > 0, "the workload takes reservoirs: {plain_run:?}");
    assert_eq!(run(true), plain_run);
}

#[test]
fn a_release_in_the_last_round_of_growth_is_followed_by_growth_not_a_recovery() {
    // The driver refuses to free: the rounds of growth within the headroom give up, and the last
    // round (past the headroom) takes the free 30 MiB chunk out again to stay within the release
    // threshold. Its free now works: the round grows, with no out-of-memory recovery (which waits
    // on the host for every stream) and no error.
    let h = Harness::new(PoolConfig { release_threshold: 40 * MIB, ..plain() }, Mock::new(1));
    let p = h.alloc(30 * MIB, 0).unwrap();
    h.free(p, 0);
    h.mock.st().fail = Some(Call::Free);
    let q = h.alloc(12 * MIB, 0).unwrap();
    let st = h.stats();
    assert_eq!(st.oom_recoveries, 0, "{st:?}");
    assert_eq!((st.reserved, st.driver_frees), (12 * MIB, 1), "{st:?}");
    h.free(q, 0);
    h.check();
    h.teardown();
}

#[test]
fn the_most_in_use_stays_when_the_stream_that_saw_it_retires() {
    let h = Harness::new(plain(), Mock::new(2));
    let p = h.alloc(100 * MIB, 0).unwrap();
    h.free(p, 0);
    assert_eq!(h.stats().peak_in_use, 100 * MIB);
    h.retire(0);
    assert_eq!(h.stats().peak_in_use, 100 * MIB);
    h.check();
    h.teardown();
}

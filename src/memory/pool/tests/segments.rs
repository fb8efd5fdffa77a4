//! Unit tests of growth in segments (virtual memory), on the mock device: where memory is mapped,
//! what is unmapped, and that failures of the backend lose nothing.

use super::mock::{Call, Mock, MockErr, S};
use std::collections::BTreeMap;

use super::*;
use crate::memory::pool::trim_to;

/// The pool in segments on a mock with `capacity` bytes (address ranges of 1 GiB).
fn segments(streams: usize, capacity: usize) -> Harness {
    let mock = Mock::with_vmm(streams, 1 << 30);
    mock.st().capacity = capacity;
    Harness::new(plain(), mock)
}

/// (reserved, mappings made, unmappings made), checked against the mock.
fn figures(h: &Harness) -> (usize, u64, u64) {
    let st = h.stats();
    let (reserved, _, maps, unmaps) = h.mock.chunk_figures();
    assert_eq!((st.reserved, st.driver_allocs, st.driver_frees), (reserved, maps, unmaps));
    (st.reserved, st.driver_allocs, st.driver_frees)
}

#[test]
fn growth_maps_what_a_free_top_block_lacks() {
    let h = segments(1, usize::MAX);
    let a = h.alloc(10 * MIB, 0).unwrap();
    assert_eq!(figures(&h), (10 * MIB, 1, 0));
    h.free(a, 0);
    // The freed block is at the top: 4 MiB more make 14, at the same address.
    let b = h.alloc(14 * MIB, 0).unwrap();
    assert_eq!(b, a);
    assert_eq!(figures(&h), (14 * MIB, 2, 0));
    // Small requests have a segment of their own.
    let c = h.alloc(1000, 0).unwrap();
    assert_eq!(h.stats().chunks, 2);
    assert!(c.abs_diff(a) >= 1 << 30, "a small block inside the large segment's range");
    h.free(b, 0);
    h.free(c, 0);
    h.check();
    h.teardown();
}

/// A miss gives the stream's cached blocks of the large segment back to the arena, where they
/// serve it, but keeps its small blocks cached: the next request of a small block's size takes it
/// on the stream's fast path.
#[test]
fn a_miss_gives_large_cached_blocks_back_and_keeps_small_ones() {
    let h = segments(1, usize::MAX);
    let small = h.alloc(4096, 0).unwrap();
    let large = h.alloc(8 * MIB, 0).unwrap();
    let other = h.alloc(8 * MIB, 0).unwrap();
    h.free(small, 0);
    h.free(large, 0);
    let (before, hits) = (figures(&h), h.stats().cache_hits);
    // A request of another size misses the cache; the freed 8 MiB block, given back, serves it.
    let six = h.alloc(6 * MIB, 0).unwrap();
    assert_eq!((six, figures(&h)), (large, before), "served by the block given back, with no growth");
    // The small block is still cached.
    let again = h.alloc(4096, 0).unwrap();
    assert_eq!((again, h.stats().cache_hits), (small, hits + 1));
    for p in [again, six, other] {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

#[test]
fn freed_neighbours_of_any_mapping_serve_a_larger_request_without_growth() {
    let h = segments(1, usize::MAX);
    let blocks: Vec<u64> = (0..4).map(|_| h.alloc(8 * MIB, 0).unwrap()).collect();
    let (reserved, maps, _) = figures(&h);
    // Two neighbours, from different mappings, merge: 16 MiB with no new mapping.
    h.free(blocks[1], 0);
    h.free(blocks[2], 0);
    let big = h.alloc(16 * MIB, 0).unwrap();
    assert_eq!(big, blocks[1]);
    assert_eq!(figures(&h), (reserved, maps, 0));
    for p in [blocks[0], blocks[3], big] {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

#[test]
fn trim_unmaps_free_memory_between_live_blocks_and_growth_maps_the_hole_again() {
    let h = segments(1, usize::MAX);
    let blocks: Vec<u64> = (0..4).map(|_| h.alloc(8 * MIB, 0).unwrap()).collect();
    assert_eq!(figures(&h).0, 32 * MIB);
    h.free(blocks[1], 0);
    h.free(blocks[2], 0);
    // The middle 16 MiB go back to the driver: a hole between two live blocks.
    trim_to(&h, 16 * MIB).unwrap();
    let (reserved, maps, unmaps) = figures(&h);
    assert_eq!(reserved, 16 * MIB);
    assert!(unmaps >= 1);
    h.check();
    assert!(h.arena(|a| a.describe()).contains('~'), "no hole: {}", h.arena(|a| a.describe()));
    // A request of the hole's size maps it again rather than the top (a tie): same address.
    let again = h.alloc(16 * MIB, 0).unwrap();
    assert_eq!(again, blocks[1]);
    let (reserved, maps_after, _) = figures(&h);
    assert_eq!(reserved, 32 * MIB);
    assert!(maps_after > maps);
    for p in [blocks[0], blocks[3], again] {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

#[test]
fn a_full_device_moves_free_memory_to_where_a_request_fits() {
    // 40 MiB: four blocks of 8, two freed apart, then 16 MiB asked for. Only unmapping the gaps
    // (the host waits for their frees) and mapping at the top can serve it.
    let h = segments(1, 40 * MIB);
    let blocks: Vec<u64> = (0..4).map(|_| h.alloc(8 * MIB, 0).unwrap()).collect();
    h.free(blocks[0], 0);
    h.free(blocks[2], 0);
    h.mock.st().query_lag = None; // the GPU never says it is done: only a host wait tells
    let big = h.alloc(16 * MIB, 0).unwrap();
    let (reserved, _, unmaps) = figures(&h);
    assert!(unmaps >= 1, "nothing unmapped");
    assert!(reserved <= 40 * MIB);
    assert!(big > blocks[3], "not at the top");
    for p in [blocks[1], blocks[3], big] {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

#[test]
fn a_failed_unmap_keeps_the_memory_mapped_free_and_counted() {
    let h = segments(1, usize::MAX);
    let a = h.alloc(8 * MIB, 0).unwrap();
    let b = h.alloc(8 * MIB, 0).unwrap();
    h.free(a, 0);
    let before = figures(&h);
    h.mock.st().fail = Some(Call::Free);
    assert_eq!(trim_to(&h, 8 * MIB), Err(MockErr::Injected));
    h.check();
    assert_eq!(figures(&h), before);
    // It is used again, and a later trim gives it back.
    let c = h.alloc(8 * MIB, 0).unwrap();
    assert_eq!(c, a);
    h.free(c, 0);
    trim_to(&h, 8 * MIB).unwrap();
    assert_eq!(figures(&h).0, 8 * MIB);
    h.free(b, 0);
    h.check();
    h.teardown();
}

/// An unmap that unwinds (a backend that panics after the driver unmapped) leaves nothing in
/// flight: a growth into its range would otherwise wait for it forever (`Grow::Busy`). The
/// mapping that unwound counts as unmapped, the one not reached stays mapped, and a request of
/// the hole's size maps it again.
#[test]
fn an_unmap_that_unwinds_is_settled_and_its_range_is_mapped_again() {
    let h = segments(1, usize::MAX);
    let blocks: Vec<u64> = (0..4).map(|_| h.alloc(8 * MIB, 0).unwrap()).collect();
    h.free(blocks[1], 0);
    h.free(blocks[2], 0);
    h.mock.st().unwind_after = Some(Call::Free);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| trim_to(&h, 16 * MIB)));
    assert!(r.is_err(), "the unmap unwound");
    assert_eq!(h.arena(|a| a.releasing_bytes()), 0, "a mapping left in flight");
    h.check();
    let (reserved, maps, unmaps) = figures(&h);
    assert_eq!((reserved, unmaps), (24 * MIB, 1));
    let again = h.alloc(16 * MIB, 0).unwrap();
    assert_eq!(again, blocks[1]);
    assert_eq!(figures(&h), (32 * MIB, maps + 1, 1));
    h.teardown();
}

#[test]
fn a_refused_address_range_gives_a_smaller_one_then_chunks() {
    // Once refused: a range of the device's memory (a quarter of 1 GiB here) instead.
    let h = segments(1, 64 * MIB);
    h.mock.st().fail = Some(Call::Reserve);
    let a = h.alloc(8 * MIB, 0).unwrap();
    let ranges = h.arena(|a| a.chunks.iter().map(|(_, c)| c.segment.as_ref().unwrap().reserved).sum::<usize>());
    assert_eq!(ranges, 256 * MIB);
    h.free(a, 0);
    h.check();
    h.teardown();
    // Always refused: the pool grows in chunks, for good.
    let h = segments(1, usize::MAX);
    h.mock.st().refuse_reserve = true;
    let a = h.alloc(3 * MIB, 0).unwrap();
    assert!(h.arena(|a| a.segments.is_none()));
    assert_eq!(figures(&h), (32 * MIB, 1, 0), "a medium chunk");
    h.free(a, 0);
    h.check();
    h.teardown();
}

/// A driver that reports virtual memory management but does not offer it for the pool's first
/// mapping leaves the pool growing in chunks, as a refused address range does; a first mapping
/// that merely failed, or one that fails after others mapped (the next test), is an error.
#[test]
fn a_first_mapping_the_driver_does_not_offer_leaves_chunks() {
    let h = segments(1, usize::MAX);
    h.mock.st().fail = Some(Call::Alloc);
    assert_eq!(h.alloc(3 * MIB, 0), Err(PoolError::Backend(MockErr::Injected)));
    assert!(h.arena(|a| a.segments.is_some()), "a failure that may pass left segments");
    h.check();
    h.teardown();
    let h = segments(1, usize::MAX);
    h.mock.st().unsupported = true;
    h.mock.st().fail = Some(Call::Alloc);
    let a = h.alloc(3 * MIB, 0).unwrap();
    assert!(h.arena(|a| a.segments.is_none()), "still in segments");
    let st = h.mock.st();
    assert!(st.reservations.is_empty(), "the address ranges reserved were kept: {:?}", st.reservations);
    drop(st);
    assert_eq!(figures(&h), (32 * MIB, 1, 0), "a medium chunk");
    let b = h.alloc(16 * MIB, 0).unwrap();
    h.free(a, 0);
    h.free(b, 0);
    h.check();
    h.teardown();
}

#[test]
fn a_failed_map_is_an_error_that_loses_nothing() {
    let h = segments(1, usize::MAX);
    let a = h.alloc(8 * MIB, 0).unwrap();
    h.mock.st().fail = Some(Call::Alloc);
    assert_eq!(h.alloc(8 * MIB, 0), Err(PoolError::Backend(MockErr::Injected)));
    h.check();
    assert_eq!(figures(&h).0, 8 * MIB);
    let b = h.alloc(8 * MIB, 0).unwrap();
    h.free(a, 0);
    h.free(b, 0);
    h.check();
    h.teardown();
}

#[test]
fn an_empty_segment_gives_its_range_back_even_after_a_failure() {
    let h = segments(1, usize::MAX);
    let a = h.alloc(8 * MIB, 0).unwrap();
    h.free(a, 0);
    // The unmapping succeeds; giving the range back fails: the empty segment stays, unused.
    h.mock.st().fail = Some(Call::Reserve);
    trim_to(&h, 0).unwrap();
    assert_eq!((h.stats().reserved, h.stats().chunks), (0, 1));
    h.check();
    // The next trim gives it back.
    trim_to(&h, 0).unwrap();
    assert_eq!(h.stats().chunks, 0);
    assert_eq!(h.mock.chunk_figures().1, 0);
    // And growth starts a new one.
    let b = h.alloc(8 * MIB, 0).unwrap();
    h.free(b, 0);
    h.check();
    h.teardown();
}

#[test]
fn memory_freed_on_another_stream_merges_once_its_free_completed() {
    let h = segments(2, usize::MAX);
    let a = h.alloc(8 * MIB, 0).unwrap();
    let b = h.alloc(8 * MIB, 1).unwrap();
    assert_eq!(b, a + 8 * MIB as u64, "stream 1 grew above stream 0's block");
    h.free(a, 0);
    h.free(b, 1);
    // Free on different streams, the two blocks merge only once the GPU has done with both:
    // before growing, the pool asks (the mock's events complete at once), merges, and serves
    // 16 MiB from them after ordering the stream after the other's free.
    let maps = figures(&h).1;
    let c = h.alloc(16 * MIB, 0).unwrap();
    assert_eq!(c, a);
    assert_eq!(figures(&h).1, maps, "grew instead of merging");
    h.free(c, 0);
    h.check();
    h.teardown();
}

/// A graph's block freed outside a capture, after its graph was released, is ordered on the
/// freeing stream (the user may have used it there until the free): near capacity it is unmapped
/// only once the host saw that free complete (the mock checks), and another stream reuses it only
/// after an event.
#[test]
fn a_graph_block_freed_on_a_stream_after_its_release_is_ordered_there() {
    use crate::memory::pool::graph::{allocate_for_graph, release_graph};
    for vmm in [true, false] {
        let h = if vmm { segments(2, 64 * MIB) } else { Harness::new(plain(), Mock::new(2)) };
        let (g, _) = allocate_for_graph(&h, 30 * MIB, 3).unwrap();
        let top = h.alloc(10 * MIB, 0).unwrap();
        release_graph(&h, 3);
        h.mock.allocated(g, 30 * MIB, 0); // the user goes on using the buffer on stream 0
        h.mock.st().query_lag = None; // the GPU is busy: only a host wait tells
        h.free(g, 0);
        // Another stream takes the memory: after an event (segments: or a host wait, near
        // capacity); never unordered.
        let b = h.alloc(30 * MIB, 1).unwrap();
        h.free(b, 1);
        let c = h.alloc(40 * MIB, 0);
        if let Ok(c) = c {
            h.free(c, 0);
        }
        h.free(top, 0);
        h.mock.st().query_lag = Some(0);
        h.check();
        h.teardown();
    }
}

/// The same, freed before the release: the block comes back to the freeing stream at release,
/// at the point of its free, also when that stream was forgotten meanwhile.
#[test]
fn a_graph_block_freed_on_a_stream_before_its_release_is_ordered_there() {
    use crate::memory::pool::graph::{allocate_for_graph, release_graph};
    let h = segments(3, usize::MAX);
    let (g, _) = allocate_for_graph(&h, 30 * MIB, 3).unwrap();
    h.mock.allocated(g, 30 * MIB, 0);
    h.mock.st().query_lag = None;
    h.free(g, 0);
    h.retire(0);
    h.check();
    release_graph(&h, 3);
    h.check();
    let b = h.alloc(30 * MIB, 1).unwrap();
    h.free(b, 1);
    h.mock.st().query_lag = Some(0);
    h.check();
    h.teardown();
}

/// A graph's allocation (possibly during a capture) records, waits, synchronises and queries
/// nothing, and unmaps nothing, also when it finds other streams' free blocks or runs out.
#[test]
fn a_graph_allocation_in_segments_makes_no_event_call_and_unmaps_nothing() {
    use crate::memory::pool::graph::{allocate_for_graph, release_graph};
    let h = segments(1, 64 * MIB);
    let a = h.alloc(8 * MIB, 0).unwrap();
    let keep = h.alloc(8 * MIB, 0).unwrap();
    h.free(a, 0);
    let other = h.alloc(3 * MIB, 0).unwrap(); // gives the cache back: `a` is free in the arena
    let before = h.mock.st().clone_counts();
    let (p, _) = allocate_for_graph(&h, 12 * MIB, 5).unwrap();
    h.mock.check_host_safe(p, 12 * MIB);
    assert!(allocate_for_graph(&h, 60 * MIB, 5).is_err());
    assert_eq!(h.mock.st().clone_counts(), before, "records, waits, syncs, queries, unmaps");
    crate::memory::pool::deallocate(&h, p, 12 * MIB, &S(0)).unwrap();
    release_graph(&h, 5);
    h.free(keep, 0);
    h.free(other, 0);
    h.check();
    h.teardown();
}

/// A growth the driver refuses part-way learns what the driver keeps from what was free at the
/// refusal, not before the growth.
#[test]
fn a_growth_refused_part_way_learns_the_drivers_spare_right() {
    let h = segments(1, 100 * MIB);
    h.mock.st().spare = 6 * MIB;
    let r = h.alloc(96 * MIB, 0);
    assert!(r.is_err());
    let st = h.stats();
    assert!(st.driver_spare <= 8 * MIB, "learned a spare of {} MiB; the driver keeps 6", st.driver_spare / MIB);
    assert_eq!(st.reserved, 0, "the refused request left memory mapped");
    h.teardown();
}

#[test]
fn a_request_larger_than_the_free_memory_maps_nothing() {
    // Mapped handle by handle until the driver refused, then unmapped, such a request took all of
    // the device's memory for a moment: another allocation made meanwhile (a test's 1 GiB
    // `cuMemAlloc`, on the H200) failed.
    let h = segments(1, 256 * MIB);
    let a = h.alloc(100 * MIB, 0).unwrap();
    let before = figures(&h);
    assert!(h.alloc(512 * MIB, 0).is_err());
    assert_eq!(figures(&h), before, "the refused request mapped memory");
    assert_eq!(h.stats().peak_reserved, before.0, "the refused request held memory for a moment");
    h.free(a, 0);
    h.check();
    h.teardown();
}

#[test]
fn the_headroom_unmaps_free_memory_between_live_blocks() {
    // Three blocks of 32 MiB; the middle one is freed, and 48 MiB are asked for, which it cannot
    // hold. Growing at the top would hold 144 MiB for 112 live (1.29x, past the 20% headroom of
    // 134.4 MiB): a mapping of the freed block (16 MiB: growths map handles of at least 16 MiB)
    // is unmapped instead, although live blocks lie on both sides, which is just enough.
    let h = Harness::new(PoolConfig { large_classes_per_octave: 0, ..PoolConfig::default() }, {
        let mock = Mock::with_vmm(1, 1 << 30);
        mock.st().capacity = usize::MAX;
        mock
    });
    let blocks: Vec<u64> = (0..3).map(|_| h.alloc(32 * MIB, 0).unwrap()).collect();
    assert_eq!(figures(&h).0, 96 * MIB);
    h.free(blocks[1], 0);
    let big = h.alloc(48 * MIB, 0).unwrap();
    let (reserved, _, unmaps) = figures(&h);
    assert_eq!((reserved, unmaps), (128 * MIB, 1), "{}", h.arena(|a| a.describe()));
    assert!(big > blocks[2], "not at the top");
    assert!(h.arena(|a| a.describe()).contains('~'), "no hole: {}", h.arena(|a| a.describe()));
    // The hole is mapped again for a request that needs it.
    let again = h.alloc(32 * MIB, 0).unwrap();
    assert_eq!(again, blocks[1]);
    assert_eq!(figures(&h).0, 144 * MIB);
    for p in [blocks[0], blocks[2], big, again] {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

/// The mappings of `h`'s segments: address -> bytes.
fn mappings(h: &Harness) -> BTreeMap<u64, usize> {
    h.arena(|a| {
        a.chunks
            .iter()
            .filter_map(|(_, c)| c.segment.as_ref())
            .flat_map(|s| s.maps.iter().map(|(&at, &(n, _))| (at, n)))
            .collect()
    })
}

#[test]
fn stranded_free_memory_makes_pressed_growth_map_tight_handles() {
    // Ten activations of 60 MiB, each followed by a long-lived block of 2 MiB (optimizer state
    // made lazily between activations), on a device of 2 GiB; the activations are freed, and
    // the free memory between the long-lived blocks is stranded: the mappings under those
    // cannot be unmapped. A growth that is pressed (past an eighth of the device) but not tight
    // then maps handles of 1/256 of the most memory live at once (4 MiB), not 1/32 of it, so
    // that what it maps can be given back between such blocks later. The control keeps the
    // activations live and strands nothing: it maps handles of 1/32 of it (22 MiB).
    for long_lived in [true, false] {
        let h = Harness::new(PoolConfig::default(), {
            let mock = Mock::with_vmm(1, 1 << 34);
            mock.st().capacity = 2 << 30;
            mock
        });
        let (mut acts, mut kept) = (Vec::new(), Vec::new());
        for _ in 0..10 {
            acts.push(h.alloc(60 * MIB, 0).unwrap());
            if long_lived {
                kept.push(h.alloc(2 * MIB, 0).unwrap());
            }
        }
        if long_lived {
            for a in acts.drain(..) {
                h.free(a, 0);
            }
        }
        let before = mappings(&h);
        let big = h.alloc(100 * MIB, 0).unwrap();
        let new: Vec<usize> =
            mappings(&h).into_iter().filter(|(at, _)| !before.contains_key(at)).map(|(_, n)| n).collect();
        let layout = h.arena(|a| a.describe());
        assert!(!new.is_empty(), "the request did not grow the segment: {layout}");
        if long_lived {
            let stranded =
                h.arena(|a| a.segment_of.iter().filter(|&&c| c != NIL).map(|&c| a.stranded(c)).sum::<usize>());
            assert!(stranded > 620 * MIB / super::super::segment::STRANDED_PART, "{layout}");
            assert!(new.iter().all(|&n| n <= 4 * MIB), "handles {new:?} after stranding: {layout}");
        } else {
            // (The last handle of a growth maps what is left of it.)
            assert_eq!(new.iter().max(), Some(&(22 * MIB)), "handles {new:?} with nothing stranded: {layout}");
        }
        for a in acts.into_iter().chain(kept).chain([big]) {
            h.free(a, 0);
        }
        h.check();
        h.teardown();
    }
}

/// A small request that its segment cannot serve, on a device with no room to map a granule for
/// it, takes a free block of the large segment: no memory moves from one segment to the other
/// (unmapped there, mapped again beside the small blocks, then moved back by the next large
/// request), and there is no out-of-memory recovery.
#[test]
fn a_small_request_on_a_full_device_takes_a_free_large_block() {
    let h = segments(1, 24 * MIB);
    // The small segment: one granule, full.
    let small: Vec<u64> = (0..4).map(|_| h.alloc(512 << 10, 0).unwrap()).collect();
    // The large segment takes the rest of the device.
    let mut large = Vec::new();
    while let Ok(p) = h.alloc(2 * MIB, 0) {
        large.push(p);
    }
    let (reserved, maps, unmaps) = figures(&h);
    assert!(reserved > 22 * MIB, "the device is not full: {}", h.arena(|a| a.describe()));
    let freed = large.remove(large.len() / 2);
    h.free(freed, 0);
    let recoveries = h.stats().oom_recoveries;
    let p = h.alloc(512 << 10, 0).unwrap();
    let layout = h.arena(|a| a.describe());
    assert!((freed..freed + 2 * MIB as u64).contains(&p), "not in the large block freed: {layout}");
    assert_eq!(figures(&h), (reserved, maps, unmaps), "memory moved between the segments: {layout}");
    assert_eq!(h.stats().oom_recoveries, recoveries);
    for q in small.into_iter().chain(large).chain([p]) {
        h.free(q, 0);
    }
    h.check();
    h.teardown();
}

/// A large request that its segment can neither serve nor grow for (the device is full, and no
/// free memory lies in whole mappings to unmap) takes a free block of the small segment that holds
/// it without the out-of-memory recovery, which would end there after waiting for every free,
/// giving every cache back and trying to unmap and grow again.
#[test]
fn a_large_request_that_cannot_grow_takes_a_small_free_block_without_recovery() {
    let h = segments(1, 24 * MIB);
    // The small segment: two granules of 256 KiB blocks, then blocks 3-8 freed: 1.5 MiB free
    // across the granules' boundary, which holds no whole mapping.
    let mut small: Vec<u64> = (0..16).map(|_| h.alloc(256 << 10, 0).unwrap()).collect();
    let mut large = Vec::new();
    while let Ok(p) = h.alloc(2 * MIB, 0) {
        large.push(p);
    }
    let freed: Vec<u64> = small.drain(3..9).collect();
    let start = *freed.iter().min().unwrap();
    for &p in &freed {
        h.free(p, 0);
    }
    let (reserved, maps, unmaps) = figures(&h);
    let recoveries = h.stats().oom_recoveries;
    let p = h.alloc(1280 << 10, 0).unwrap();
    let layout = h.arena(|a| a.describe());
    assert!((start..start + (1536 << 10)).contains(&p), "not in the small segment's free block: {layout}");
    assert_eq!(figures(&h), (reserved, maps, unmaps), "{layout}");
    assert_eq!(h.stats().oom_recoveries, recoveries, "an out-of-memory recovery: {layout}");
    for q in small.into_iter().chain(large).chain([p]) {
        h.free(q, 0);
    }
    h.check();
    h.teardown();
}

//! Blocks reserved for graphs (`pool::graph`): taken only from host-safe memory or new chunks,
//! with no event, wait or free (a capture allows none); kept until the graph is released.

use super::mock::Mock;
use super::*;
use crate::memory::pool::graph::{allocate_for_graph, release_graph};
use crate::memory::pool::trim_to;

const KIB: usize = 1 << 10;

fn harness(streams: usize) -> Harness {
    Harness::new(plain(), Mock::new(streams))
}

/// Allocates for graph `g` and checks the block; asserts that no event or free was involved.
fn graph_alloc(h: &Harness, bytes: usize, g: u64) -> (u64, bool) {
    let before = { h.mock.st().clone_counts() };
    let (p, first) = allocate_for_graph(h, bytes, g).expect("graph allocation");
    h.mock.check_host_safe(p, bytes);
    let after = { h.mock.st().clone_counts() };
    assert_eq!(
        (after.0 - before.0, after.1 - before.1, after.2 - before.2, after.3 - before.3),
        (0, 0, 0, 0),
        "a graph allocation recorded, waited on, synchronised or queried an event"
    );
    assert_eq!(after.4, before.4, "a graph allocation freed a chunk");
    (p, first)
}

/// A graph's growths skip the headroom (a capture may not release memory), and so they never
/// pack: six 12.5 MiB blocks for a graph take chunks of their own (14 MiB each), not chunks
/// packed for three whose room the graph's later requests would not look for.
#[test]
fn graph_growths_take_no_packed_chunks() {
    let h = Harness::new(PoolConfig { expandable: false, ..PoolConfig::default() }, Mock::new(1));
    let weight = 12 * MIB + MIB / 2;
    let blocks: Vec<u64> = (0..6).map(|_| graph_alloc(&h, weight, 3).0).collect();
    let st = h.stats();
    assert_eq!((st.reserved, st.chunks), (6 * 14 * MIB, 6), "a chunk of its own for each");
    h.check();
    release_graph(&h, 3);
    for p in blocks {
        deallocate(&h, p, weight, &S(0)).unwrap();
    }
    h.teardown();
}

#[test]
fn graph_blocks_never_come_from_a_streams_unfinished_frees() {
    let h = harness(1);
    let p = h.alloc(64 * KIB, 0).unwrap();
    h.free(p, 0); // cached on stream 0, its free not known complete
    let (q, first) = graph_alloc(&h, 64 * KIB, 7);
    assert!(first);
    assert_ne!(q, p, "a graph took a block whose free the host has not seen complete");
    // Once the host has seen the free complete (trim waits for it), the memory is host-safe.
    trim_to(&h, usize::MAX).unwrap();
    let (r, first) = graph_alloc(&h, 64 * KIB, 7);
    assert!(!first, "the graph's second block");
    assert_eq!(r, p, "host-safe memory is reused for graphs");
    h.check();
    release_graph(&h, 7);
    deallocate(&h, q, 64 * KIB, &S(0)).unwrap();
    deallocate(&h, r, 64 * KIB, &S(0)).unwrap();
    h.teardown();
}

#[test]
fn a_graph_keeps_its_blocks_after_their_free_until_it_is_released() {
    let h = harness(2);
    let (g, _) = graph_alloc(&h, 300 * KIB, 1);
    let st = h.stats();
    assert_eq!((st.live_allocations, st.in_use), (1, 300 * KIB));
    // The free during the capture: the graph still uses the block at every launch.
    deallocate(&h, g, 300 * KIB, &S(0)).unwrap();
    for s in 0..2 {
        let p = h.alloc(300 * KIB, s).unwrap();
        assert_ne!(p, g, "a stream got a block its graph still uses");
        h.free(p, s);
    }
    assert!(deallocate(&h, g, 300 * KIB, &S(0)).is_err(), "a second free is refused");
    release_graph(&h, 1);
    assert_eq!(h.stats().live_allocations, 0);
    // Given back host-safe: any stream takes it with no event.
    let before = h.mock.records_waits();
    let p = h.alloc(300 * KIB, 1).unwrap();
    assert_eq!(h.mock.records_waits(), before, "host-safe memory needs no event");
    h.free(p, 1);
    h.check();
    h.teardown();
}

#[test]
fn a_block_freed_after_its_graph_was_released_goes_back_at_its_free() {
    let h = harness(1);
    let (g, _) = graph_alloc(&h, 5 * (1 << 20), 3);
    release_graph(&h, 3); // a capture that failed while the buffer lived
    assert_eq!(h.stats().live_allocations, 1, "a released graph's block is its user's until freed");
    let p = h.alloc(5 * (1 << 20), 0).unwrap();
    assert_ne!(p, g);
    deallocate(&h, g, 5 * (1 << 20), &S(0)).unwrap();
    assert_eq!(h.stats().live_allocations, 1);
    h.free(p, 0);
    h.check();
    h.teardown();
}

#[test]
fn graph_growth_ignores_the_headroom_and_frees_nothing() {
    let h = harness(1);
    let ps: Vec<u64> = (0..4).map(|_| h.alloc(20 << 20, 0).unwrap()).collect();
    for &p in &ps {
        h.free(p, 0);
    }
    // Far beyond the headroom: a normal allocation would give chunks back first; a graph's grows.
    let (g, _) = graph_alloc(&h, 64 << 20, 9);
    deallocate(&h, g, 64 << 20, &S(0)).unwrap();
    release_graph(&h, 9);
    h.check();
    h.teardown();
}

#[test]
fn graph_blocks_and_streams_share_chunks_soundly() {
    let h = harness(2);
    let mut graph_blocks = Vec::new();
    let mut live = Vec::new();
    for i in 0..64usize {
        let bytes = (i % 7 + 1) * 37 * KIB;
        if i % 3 == 0 {
            graph_blocks.push((graph_alloc(&h, bytes, (i % 2) as u64 + 1).0, bytes));
        } else {
            live.push((h.alloc(bytes, i % 2).unwrap(), i % 2));
        }
        if i % 5 == 0
            && let Some((p, s)) = live.pop()
        {
            h.free(p, s);
        }
        if i % 16 == 15 {
            trim_to(&h, usize::MAX).unwrap();
        }
    }
    h.check();
    for (p, s) in live {
        h.free(p, s);
    }
    release_graph(&h, 1);
    for (p, bytes) in graph_blocks {
        deallocate(&h, p, bytes, &S(0)).unwrap();
    }
    release_graph(&h, 2);
    h.check();
    h.teardown();
}

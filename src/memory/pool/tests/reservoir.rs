//! Reservoirs: near capacity in chunks, the pool takes what the device has left in one chunk and
//! places requests of changing sizes there, instead of trading chunks with the driver at every
//! step ([`PoolConfig::reservoir`]).

use super::*;
use crate::memory::pool::trim_to;

fn config(reservoir: bool) -> PoolConfig {
    PoolConfig { reservoir, ..PoolConfig::default() }
}

/// A device of 1 GiB holding 28 long-lived blocks of 25 MiB (700 MiB), then 60 steps that each
/// allocate eight activations whose sizes change with the step (10 to 45 MiB scaled by 30% to
/// 100%, up to 220 MiB in all), on `streams` streams in turn, and free them at the step's end. Returns the driver calls
/// the last 50 steps made (allocations, frees) and the pool's figures after them.
fn steps_of_changing_sizes(reservoir: bool, streams: usize) -> (u64, u64, PoolStats) {
    let h = Harness::new(config(reservoir), Mock::new(streams));
    h.mock.st().capacity = 1 << 30;
    let weights: Vec<u64> = (0..28).map(|_| h.alloc(25 * MIB, 0).unwrap()).collect();
    let (mut warm, mut next) = (None, super::props::xorshift(0x9E37_79B9_7F4A_7C15));
    for step in 0..60 {
        if step == 10 {
            warm = Some(h.stats());
        }
        let s = step % streams;
        // A factor of 30% to 100% per step, as a batch of another shape would give.
        let percent = 30 + (next() % 71) as usize;
        let acts: Vec<u64> = (0..8)
            .map(|i| {
                let bytes = (10 + 5 * i) * MIB / 100 * percent;
                h.alloc(bytes, s).unwrap_or_else(|e| panic!("step {step}: {e}\n{}", h.arena(|a| a.describe())))
            })
            .collect();
        for p in acts.into_iter().rev() {
            h.free(p, s);
        }
        h.check();
    }
    let (warm, after) = (warm.unwrap(), h.stats());
    for p in weights {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
    (after.driver_allocs - warm.driver_allocs, after.driver_frees - warm.driver_frees, after)
}

#[test]
fn near_capacity_a_reservoir_places_changing_sizes_with_no_driver_call() {
    let (allocs, frees, st) = steps_of_changing_sizes(true, 1);
    assert!(st.reservoirs >= 1, "no reservoir was taken: {st:?}");
    assert_eq!((allocs, frees, st.oom_recoveries), (0, 0, 0), "{st:?}");
    // Growing exactly, steps whose sizes fit no cached chunk trade chunks with the driver.
    let (exact_allocs, exact_frees, exact) = steps_of_changing_sizes(false, 1);
    assert_eq!(exact.reservoirs, 0);
    assert!(exact_allocs >= 20 && exact_frees >= 20, "{exact_allocs} / {exact_frees}: {exact:?}");
}

/// Blocks of a reservoir freed on one stream serve another only once ordered after the free (the
/// mock checks every reuse against every earlier free of its memory).
#[test]
fn a_reservoir_shared_by_streams_orders_every_reuse() {
    let (allocs, _, st) = steps_of_changing_sizes(true, 3);
    assert!(st.reservoirs >= 1, "{st:?}");
    assert!(st.cross_stream_reuses > 0 && st.event_waits > 0, "{st:?}");
    assert_eq!(allocs, 0, "{st:?}");
}

/// What a reservoir costs: 15 live blocks of 50 MiB on a 1 GiB device, each step freeing one and
/// allocating one of another size (41 to 63 MiB). Growing exactly fits every step (each chunk
/// goes back to the driver whole, which puts the memory back together); a reservoir, pinned by
/// the blocks live in it, is soon left in pieces too small for the next request.
#[test]
fn a_reservoir_can_run_out_of_memory_where_exact_growth_fits() {
    let run = |reservoir: bool| {
        let h = Harness::new(config(reservoir), Mock::new(1));
        h.mock.st().capacity = 1 << 30;
        let mut live: Vec<u64> = (0..15).map(|_| h.alloc(50 * MIB, 0).unwrap()).collect();
        let mut failed = None;
        for step in 0..200 {
            h.free(live.remove(step * 7 % live.len()), 0);
            match h.alloc((41 + step * 13 % 23) * MIB, 0) {
                Ok(p) => live.push(p),
                Err(PoolError::OutOfMemory { .. }) => {
                    failed = Some(step);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        let st = h.stats();
        for p in live {
            h.free(p, 0);
        }
        h.check();
        h.teardown();
        (failed, st)
    };
    let (failed, st) = run(false);
    assert_eq!((failed, st.reservoirs), (None, 0), "{st:?}");
    let (failed, st) = run(true);
    assert!(failed.is_some() && st.reservoirs > 0, "{failed:?} {st:?}");
}

/// Requests of every kind take a reservoir's memory: a small and a medium request that find no
/// chunk of their own once the reservoir holds the device's memory are placed in it, and merge
/// back when freed. A reservoir with nothing live goes back on trim.
#[test]
fn a_reservoir_serves_every_kind_and_goes_back_when_free() {
    let h = Harness::new(config(true), Mock::new(1));
    h.mock.st().capacity = 256 * MIB;
    let big: Vec<u64> = (0..8).map(|_| h.alloc(30 * MIB, 0).unwrap()).collect();
    let st = h.stats();
    assert_eq!(st.reservoirs, 1, "the eighth block took what the device had left: {st:?}");
    let reservoir_end = st.reserved;
    let small = h.alloc(4096, 0).unwrap();
    let medium = h.alloc(3 * MIB, 0).unwrap();
    let st = h.stats();
    assert_eq!((st.reservoirs, st.reserved), (1, reservoir_end), "no chunk of their own: {st:?}");
    for p in [small, medium, big[7]] {
        let in_reservoir = h.arena(|a| {
            a.chunks.iter().any(|(_, c)| {
                p >= c.ptr
                    && p < c.ptr + c.size as u64
                    && a.blocks[c.first].kind == super::super::blocks::Kind::Reservoir
            })
        });
        assert!(in_reservoir, "{p:#x} is not in the reservoir:\n{}", h.arena(|a| a.describe()));
    }
    for p in big.into_iter().chain([small, medium]) {
        h.free(p, 0);
    }
    trim_to(&h, 0).unwrap();
    let st = h.stats();
    assert_eq!((st.reserved, st.chunks), (0, 0), "{st:?}");
    h.check();
    h.teardown();
}

/// A workload with a request of an eighth of the memory the pool can reach relies on the driver
/// to put memory back together: no reservoir is taken for it, and growth near capacity stays
/// exact.
#[test]
fn a_request_of_an_eighth_of_the_memory_keeps_growth_exact() {
    let h = Harness::new(config(true), Mock::new(1));
    h.mock.st().capacity = 1 << 30;
    let giant = h.alloc(200 * MIB, 0).unwrap();
    h.free(giant, 0);
    let live: Vec<u64> = (0..18).map(|_| h.alloc(50 * MIB, 0).unwrap()).collect();
    let st = h.stats();
    assert_eq!((st.reservoirs, st.chunks), (0, 18), "a chunk per block: {st:?}");
    for p in live {
        h.free(p, 0);
    }
    h.check();
    h.teardown();
}

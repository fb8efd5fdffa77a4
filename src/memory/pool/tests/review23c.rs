//! Review 23c: errors of the event calls that only make room (a record or a query on a stream
//! whose frees the pool polls or waits for) decide nothing for the other streams or for the
//! request that made room; and behaviour checked and found sound: a host wait's completion never
//! applies to a later stream state in the same slot, and a failed GPU-side wait moves nothing.

use super::mock::{Call, Mock, MockErr, S};
use super::*;
use crate::memory::pool::{flush_caches, trim_to};

const KIB: usize = 1 << 10;

/// The pool without headroom and size classes on a mock with `streams` streams, growing in
/// segments (`vmm`, address ranges of 1 TiB) or in chunks.
fn device(streams: usize, vmm: bool) -> Harness {
    let mock = if vmm { Mock::with_vmm(streams, 1 << 40) } else { Mock::new(streams) };
    let h = Harness::new(plain(), mock);
    assert_eq!(h.arena(|a| a.segments.is_some()), vmm);
    h
}

/// A trim whose record on one stream fails still waits for the other streams' frees and gives
/// their memory back: stream 0's record fails, stream 1's 20 MiB chunk goes back, and the error
/// is returned. Failed before the fix: the first failed record ended the host waits before any
/// was made, so nothing of any stream was released (50 MiB stayed reserved), and the recovery
/// from out of memory, which waits the same way, got no room from any stream either.
#[test]
fn a_failed_record_on_one_stream_does_not_keep_a_trim_from_the_others() {
    let h = device(2, false);
    let a = h.alloc(30 * MIB, 0).unwrap();
    let b = h.alloc(20 * MIB, 1).unwrap();
    h.free(a, 0);
    h.free(b, 1);
    assert_eq!(h.stats().reserved, 50 * MIB);
    h.mock.st().fail = Some(Call::Record);
    assert_eq!(trim_to(&h, 0), Err(MockErr::Injected), "the failed record is returned");
    assert!(h.mock.st().fail.is_none(), "a record was tried");
    // Stream 0's chunk (its free not waited for) stays cached; stream 1's went back after a wait.
    let (st, (reserved, chunks, _, frees)) = (h.stats(), h.mock.chunk_figures());
    assert_eq!((st.reserved, reserved, chunks, frees), (30 * MIB, 30 * MIB, 1, 1), "{st:?}");
    assert_eq!(h.mock.st().syncs, 1, "one host wait, for stream 1");
    h.check();
    // Stream 0's chunk serves its own stream again, with no event.
    let records = h.mock.records_waits();
    assert_eq!(h.alloc(30 * MIB, 0).unwrap(), a);
    assert_eq!(h.mock.records_waits(), records);
    h.free(a, 0);
    trim_to(&h, 0).unwrap();
    assert_eq!(h.stats().reserved, 0);
    h.teardown();
}

/// A 64 MiB device with 40 MiB free on stream 1 (covered by no event yet), and 50 MiB asked on
/// stream 0: room is made by polling stream 1's frees (a record, then a query). That record
/// fails once: the request is still served (the poll's error is reported, and room is made by
/// the out-of-memory recovery's host wait in chunks, or by the release's own poll in segments),
/// in chunks and in segments. Failed before the fix: the record's error failed the allocation
/// (in chunks from the headroom's release, in segments from the merge before growing), though
/// the device had room for it once stream 1's frees were waited for.
#[test]
fn a_failed_poll_of_another_streams_frees_does_not_fail_the_allocation_it_makes_room_for() {
    for vmm in [false, true] {
        let h = device(2, vmm);
        h.mock.st().capacity = 64 * MIB;
        let a = h.alloc(40 * MIB, 0).unwrap();
        h.free(a, 1);
        h.mock.st().fail = Some(Call::Record);
        let b = h.alloc(50 * MIB, 0);
        assert!(b.is_ok(), "vmm {vmm}: {b:?}");
        assert!(h.mock.st().fail.is_none(), "vmm {vmm}: the record was tried");
        assert_eq!(h.mock.st().reports, 1, "vmm {vmm}: the poll's error is reported");
        let st = h.stats();
        assert_eq!((st.reserved, st.in_use), (50 * MIB, 50 * MIB), "vmm {vmm}: stream 1's memory went back");
        h.check();
        h.free(b.unwrap(), 0);
        h.teardown();
    }
}

/// The same past the headroom with the device roomy: the failed poll leaves stream 1's free
/// chunk cached (not known complete), the pool grows past its headroom instead, and the next
/// growth past it polls again and gives the chunk back. Nothing is lost or released unordered.
#[test]
fn a_failed_poll_past_the_headroom_grows_and_the_next_growth_releases() {
    let h = Harness::new(PoolConfig { headroom_percent: Some(0), ..plain() }, Mock::new(2));
    let a = h.alloc(30 * MIB, 0).unwrap();
    h.free(a, 1);
    h.mock.st().fail = Some(Call::Record);
    let b = h.alloc(32 * MIB, 0).unwrap();
    assert_eq!(h.mock.st().reports, 1);
    let st = h.stats();
    assert_eq!((st.reserved, st.driver_frees), (62 * MIB, 0), "grown past the headroom, nothing released");
    h.check();
    h.free(b, 0);
    let c = h.alloc(36 * MIB, 0).unwrap();
    let st = h.stats();
    assert_eq!(h.mock.st().syncs, 0, "no host wait");
    assert!(st.driver_frees >= 1 && st.reserved <= 36 * MIB + 32 * MIB, "{st:?}");
    h.free(c, 0);
    h.check();
    h.teardown();
}

/// Sound: a host wait (a trim's) for a stream's event whose state is reaped meanwhile, and whose
/// slot another stream's state takes, does not mark that stream's frees complete. While the trim
/// waits for stream 0's record (covering its 8th batch of frees), stream 1 borrows stream 0's
/// blocks, stream 0 is retired (its state goes) and a new stream 2 takes its slot and frees a
/// block there (its 2nd batch). Were the wait's completion applied by slot, stream 2's frees up
/// to 8 would count as done: stream 3 would then take its block with no event; it waits on
/// stream 2's event (and the mock checks the order).
#[test]
fn a_host_wait_never_completes_a_later_stream_in_the_same_slot() {
    let h = Arc::new(device(4, false));
    // Eight batches of frees on stream 0, each covered by a record and waited for by a trim.
    let p = h.alloc(512 * KIB, 0).unwrap();
    h.free(p, 0);
    for _ in 0..7 {
        assert_eq!(h.alloc(512 * KIB, 0).unwrap(), p);
        h.free(p, 0);
        trim_to(&*h, usize::MAX).unwrap();
    }
    assert_eq!(h.alloc(512 * KIB, 0).unwrap(), p);
    h.free(p, 0);
    let slot0 = h.arena(|a| a.stream_slots[&S(0)]);
    assert_eq!(h.arena(|a| a.streams[slot0].seq), 7, "the 8th batch is still cached");
    let late = {
        let h2 = h.clone();
        move || {
            // Stream 1 takes stream 0's blocks after a GPU wait; stream 0 goes, and its state
            // with it (it holds no block now).
            let q = h2.alloc(512 * KIB, 1).unwrap();
            assert_eq!(q, p);
            h2.retire(0);
            assert!(h2.arena(|a| a.streams.get(slot0).is_none()), "stream 0's state was reaped");
            // Stream 2 takes the slot, borrows the rest of the chunk from stream 1, and frees
            // a block (flushed into the arena by a growth for a medium request on stream 2).
            let r = h2.alloc(512 * KIB, 2).unwrap();
            assert_eq!(h2.arena(|a| a.stream_slots[&S(2)]), slot0);
            h2.free(r, 2);
            let m = h2.alloc(2 * MIB, 2).unwrap();
            h2.free(m, 2);
            h2.free(q, 1);
            let seq = h2.arena(|a| a.streams[slot0].seq);
            assert!((1..8).contains(&seq), "stream 2's frees are batch {seq}");
        }
    };
    h.mock.st().on_sync = Some(Box::new(late));
    h.mock.st().query_lag = None; // only host waits tell what is complete
    trim_to(&*h, usize::MAX).unwrap();
    assert!(h.mock.st().on_sync.is_none(), "the trim waited for stream 0");
    h.check();
    let slot = h.arena(|a| a.stream_slots[&S(2)]);
    assert!(h.arena(|a| a.streams[slot].completed) < 8, "a completion of stream 0 applied to stream 2");
    // Stream 3 takes what stream 2 freed: only after a GPU wait on stream 2's event.
    let waits = h.mock.st().waits;
    let s = h.alloc(512 * KIB, 3).unwrap();
    assert!(h.mock.st().waits > waits, "reused with no wait");
    h.free(s, 3);
    h.mock.st().query_lag = Some(0);
    h.check();
    h.teardown();
}

/// Sound: a cross-stream reuse whose GPU-side wait fails moves no block and hands none out; the
/// next reuse waits (on the event recorded for the first), and the mock checks its order.
#[test]
fn a_failed_wait_moves_nothing_and_the_next_reuse_waits() {
    let h = device(2, false);
    let p = h.alloc(512 * KIB, 0).unwrap();
    h.free(p, 0);
    flush_caches(&h); // into the arena, covered by no event and not known complete
    h.mock.st().query_lag = None;
    let before = h.arena(|a| a.describe());
    h.mock.st().fail = Some(Call::Wait);
    assert_eq!(h.alloc(512 * KIB, 1), Err(PoolError::Backend(MockErr::Injected)));
    assert_eq!(h.arena(|a| a.describe()), before, "blocks moved");
    let slot0 = h.arena(|a| a.stream_slots[&S(0)]);
    assert!(h.arena(|a| a.streams[slot0].free.iter().any(|l| !l.is_empty())), "stream 0's blocks stay its own");
    h.check();
    let (records, waits) = h.mock.records_waits();
    assert_eq!(h.alloc(512 * KIB, 1).unwrap(), p);
    assert_eq!(h.mock.records_waits(), (records, waits + 1), "the record made stays good: one wait");
    h.free(p, 1);
    h.mock.st().query_lag = Some(0);
    h.check();
    h.teardown();
}

/// The retirement of stream `s` as its last user's drop makes it: its cache is taken off the
/// stream and its live allocations become orphans in one step (`StreamOrderedPool` does both
/// under the stream's attachment lock; here another thread that found the cache a moment before
/// finds it empty, as one blocked on that lock finds none, and looks among the orphans), then
/// the pool forgets the stream. Whether the pool let go of it (a failed last record keeps it,
/// and the stream lives on).
fn retire_racing(h: &Harness, s: usize) -> bool {
    let Some(cache) = h.caches.lock().unwrap().get(&S(s)).cloned() else { return true };
    let taken = {
        let mut c = cache.lock().unwrap();
        crate::memory::pool::orphan_live(h, &mut c);
        let empty = Cache::new(c.slot, h.arena(|a| a.config.small_limit));
        let taken = std::mem::replace(&mut *c, empty);
        h.caches.lock().unwrap().remove(&S(s));
        taken
    };
    retire(h, &S(s), taken).is_ok()
}

/// Threads, each on a stream of its own, allocate and free, hand allocations to each other (freed
/// on the receiver's stream, as a correct user orders it), trim, retire their stream for a new
/// one (its live allocations become orphans that any stream frees), begin and end captures on
/// their stream (a record or a wait there fails, as the CUDA backend's does for a capture begun
/// since the pool asked), and inject a failure of a backend
/// call now and then, all racing. The mock checks every reuse against every free and
/// every release against the host's view; at the end nothing is lost.
fn run_retiring_threads(threads: usize, rounds: usize, seed: u64, vmm: bool) {
    use super::mock::Call;
    const CALLS: [Call; 8] =
        [Call::Alloc, Call::Free, Call::Create, Call::Record, Call::Wait, Call::Sync, Call::Query, Call::Reserve];
    let mock = if vmm { Mock::with_vmm(threads, 1 << 30) } else { Mock::new(threads) };
    let h = Arc::new(Harness { concurrent: true, ..Harness::new(PoolConfig::default(), mock) });
    {
        let mut st = h.mock.st();
        st.capacity = 256 * MIB;
        st.captures_race = true;
    }
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..threads).map(|_| std::sync::mpsc::channel::<u64>()).unzip();
    let handles: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(t, rx)| {
            let (h, txs) = (h.clone(), txs.clone());
            std::thread::spawn(move || {
                let mut next = super::props::xorshift(seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let mut cur = t;
                let mut mine: Vec<u64> = Vec::new();
                for _ in 0..rounds {
                    while let Ok(p) = rx.try_recv() {
                        h.free(p, cur);
                    }
                    match next() % 20 {
                        0..=8 => {
                            let n = match next() % 4 {
                                0 => (next() % 4096) as usize,
                                1 => (next() % (2 * MIB as u64)) as usize,
                                2 => (next() % (8 * MIB as u64)) as usize,
                                _ => (next() % (24 * MIB as u64)) as usize,
                            };
                            if let Ok(p) = h.alloc(n, cur) {
                                mine.push(p);
                            }
                        }
                        9..=14 if !mine.is_empty() => {
                            let i = (next() as usize) % mine.len();
                            h.free(mine.swap_remove(i), cur);
                        }
                        15 if !mine.is_empty() => {
                            let i = (next() as usize) % mine.len();
                            let to = (next() as usize) % txs.len();
                            let _ = txs[to].send(mine.swap_remove(i));
                        }
                        16 if next().is_multiple_of(4) => {
                            let _ = trim_to(&*h, (next() % (64 * MIB as u64)) as usize);
                        }
                        17 if next().is_multiple_of(4) => {
                            // A retirement waits for the end of the stream's capture.
                            h.mock.st().capturing[cur] = false;
                            if retire_racing(&h, cur) {
                                h.mock.destroy_stream(cur);
                            }
                            cur = h.mock.new_stream();
                        }
                        18 if next().is_multiple_of(8) => h.mock.st().fail = Some(CALLS[(next() % 8) as usize]),
                        19 if next().is_multiple_of(2) => {
                            h.mock.st().query_lag = [None, Some(0), Some(2)][(next() % 3) as usize];
                        }
                        // The stream begins or ends a capture (its allocations racing the
                        // begin, which the pool must serve without an event call on it).
                        19 => {
                            let mut st = h.mock.st();
                            st.capturing[cur] = !st.capturing[cur] && next().is_multiple_of(2);
                        }
                        _ => {}
                    }
                    h.mock.st().now += 1;
                }
                h.mock.st().capturing[cur] = false;
                for p in mine {
                    h.free(p, cur);
                }
                (rx, cur)
            })
        })
        .collect();
    drop(txs);
    let ends: Vec<_> = handles.into_iter().map(|j| j.join().expect("a thread panicked")).collect();
    for (rx, cur) in ends {
        while let Ok(p) = rx.try_recv() {
            h.free(p, cur);
        }
    }
    {
        let mut st = h.mock.st();
        st.fail = None;
        st.query_lag = Some(0);
    }
    h.check();
    h.teardown();
}

/// Sound: threads retiring their streams and injected backend failures, racing allocations, frees
/// on other streams and trims (`CUDRV_THREAD_SEEDS` seeds, 3 by default).
#[test]
fn threads_retiring_streams_with_failures_racing_allocations_and_trims_are_safe() {
    let (threads, rounds) = if cfg!(miri) { (3, 40) } else { (4, 2000) };
    let seeds: u64 = std::env::var("CUDRV_THREAD_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    for seed in 0..seeds {
        for vmm in [false, true] {
            run_retiring_threads(threads, rounds, seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1, vmm);
        }
    }
}

/// Sound: while a stream captures a graph, the pool records, waits and polls nothing on it (the
/// mock refuses a record or a wait there), and no other stream takes the blocks it freed before
/// the capture, whose frees the host has not seen complete: another stream's allocation grows
/// instead (in segments, maps beside them), and a trim leaves them. Once the capture has ended,
/// they are reused after a record and a GPU-side wait.
#[test]
fn a_capturing_streams_pending_frees_stay_its_own_until_the_capture_ends() {
    for vmm in [false, true] {
        let h = device(3, vmm);
        let a = h.alloc(30 * MIB, 0).unwrap();
        h.free(a, 0);
        flush_caches(&h);
        h.mock.st().capturing[0] = true;
        let before = h.mock.records_waits();
        let b = h.alloc(30 * MIB, 1).unwrap();
        assert_ne!(b, a, "vmm {vmm}: memory freed before the capture taken unordered");
        trim_to(&h, 0).unwrap();
        assert_eq!(h.mock.records_waits(), before, "vmm {vmm}: an event call during the capture");
        assert_eq!(h.mock.st().syncs, 0);
        assert_eq!(h.stats().reserved, 60 * MIB, "vmm {vmm}: the capturing stream's memory was released");
        h.check();
        h.mock.st().capturing[0] = false;
        let c = h.alloc(30 * MIB, 2).unwrap();
        assert_eq!(c, a, "vmm {vmm}");
        assert_eq!(h.mock.records_waits(), (before.0 + 1, before.1 + 1), "vmm {vmm}: one record, one wait");
        h.free(b, 1);
        h.free(c, 2);
        h.check();
        h.teardown();
    }
}

/// Sound (and the check that found the three defects above): the simulator on configurations at
/// the ends of their ranges (0, `usize::MAX`, powers of two, `MAX_REQUEST`), devices from none
/// to unlimited, and requests up to and past the largest, on three streams with frees on other
/// streams and trims: every call returns (a block or a typed error), every live allocation is
/// freed, and a trim to 0 gives everything back. `SIMROUNDS` and `SIMSEED` change the search.
#[test]
#[cfg_attr(miri, ignore)]
fn the_simulator_survives_extreme_configurations_and_sizes() {
    use crate::memory::SimulatedPool;
    let mut next = super::props::xorshift(std::env::var("SIMSEED").ok().and_then(|v| v.parse().ok()).unwrap_or(12345));
    for round in 0..std::env::var("SIMROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3000u64) {
        let pick = |n: u64, r: u64| -> usize {
            match r % 6 {
                0 => 0,
                1 => usize::MAX,
                2 => 1 << (r % 64),
                3 => (r as usize) % (64 << 20),
                4 => MAX_REQ,
                _ => n as usize,
            }
        };
        const MAX_REQ: usize = (isize::MAX as usize) / 2;
        let config = PoolConfig {
            release_threshold: pick(next(), next()),
            small_limit: pick(next(), next()),
            small_chunk: pick(next(), next()),
            medium_limit: pick(next(), next()),
            medium_chunk: pick(next(), next()),
            large_granule: pick(next(), next()),
            large_classes_per_octave: (next() % 40) as u32 * if next().is_multiple_of(5) { u32::MAX / 40 } else { 1 },
            large_fit_percent: (next() % 300) as u32,
            min_large_split: pick(next(), next()),
            headroom_percent: if next().is_multiple_of(3) { None } else { Some((next() % 400) as u32) },
            expandable: next().is_multiple_of(2),
            reservoir: next().is_multiple_of(2),
        };
        let limit = match next() % 4 {
            0 => None,
            1 => Some(pick(next(), next())),
            _ => Some((next() as usize) % (1 << 34)),
        };
        let pool = SimulatedPool::new(config.clone(), limit);
        let mut live: Vec<(u64, usize, usize)> = Vec::new();
        for _ in 0..60 {
            match next() % 7 {
                0..=3 => {
                    let n = match next() % 5 {
                        0 => (next() % 4096) as usize,
                        1 => (next() % (1 << 24)) as usize,
                        2 => (next() % (1 << 31)) as usize,
                        3 => MAX_REQ - (next() % 2048) as usize,
                        _ => usize::MAX - (next() % 3) as usize,
                    };
                    let s = (next() % 3) as usize;
                    if let Ok(p) = pool.allocate(n, s) {
                        live.push((p, n, s));
                    }
                }
                4 | 5 if !live.is_empty() => {
                    let i = (next() as usize) % live.len();
                    let (p, n, _) = live.swap_remove(i);
                    pool.deallocate(p, n, (next() % 3) as usize)
                        .unwrap_or_else(|e| panic!("round {round}: {e} {config:?}"));
                }
                6 => pool.trim((next() % (1 << 30)) as usize),
                _ => {}
            }
            let _ = pool.stats();
        }
        for (p, n, s) in live {
            pool.deallocate(p, n, s).unwrap();
        }
        pool.trim(0);
        assert_eq!(pool.stats().reserved, 0, "round {round} {config:?} {limit:?}");
    }
}

/// Runs `f` on a thread of its own: whether it returned within `secs` seconds. (One that does not
/// keeps its thread busy until the test binary ends.)
fn returns_within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).ok()
}

/// A medium request of 1 KiB where pages ([`PoolConfig::large_granule`]) are 2^60 bytes: the
/// chunk packed with requests of its size is found at once (one page holds 2^50 of them).
/// Failed before the fix: the search counted requests one at a time, 7·2^47 of them before an
/// eighth of the page was left unused (a hang; in debug builds `unused * 8` overflowed first).
#[test]
#[cfg_attr(miri, ignore)]
fn a_medium_chunk_for_requests_far_smaller_than_a_page_is_found_at_once() {
    let config = PoolConfig {
        small_limit: 0,
        medium_limit: 1 << 61,
        medium_chunk: 1 << 61,
        large_granule: 1 << 60,
        release_threshold: 3 << 59,
        expandable: false,
        ..PoolConfig::default()
    };
    let arena = Arena::<Mock>::new(config.clone());
    let packed = returns_within(20, move || arena.packed_medium_chunk(KIB));
    assert_eq!(packed, Some(1 << 60), "the search did not return");
    let served = returns_within(20, move || {
        let pool = crate::memory::SimulatedPool::new(config, None);
        let p = pool.allocate(KIB, 0).map_err(|e| e.to_string())?;
        let st = pool.stats();
        pool.deallocate(p, KIB, 0).map_err(|e| e.to_string())?;
        Ok::<_, String>((st.reserved, st.in_use))
    });
    assert_eq!(served, Some(Ok((1 << 60, KIB))));
}

/// The packed medium chunk found chunk by chunk is the one found request by request (the search
/// before the fix, kept here as the reference) wherever that one returns in reasonable time.
#[test]
#[cfg_attr(miri, ignore)]
fn the_packed_medium_chunk_is_the_one_counted_request_by_request() {
    fn reference(size: usize, granule: usize, medium_chunk: usize) -> usize {
        let exact = crate::memory::pool::round_up(size, granule).unwrap_or(size);
        let most = medium_chunk.min(exact.saturating_mul(3));
        (1..=most / size.max(1))
            .map_while(|n| {
                crate::memory::pool::round_up(size * n, granule).filter(|&c| c <= most).map(|c| (c, c - size * n))
            })
            .find(|&(chunk, unused)| unused * 8 <= chunk)
            .map_or(exact, |(chunk, _)| chunk)
    }
    let mut next = super::props::xorshift(7);
    for _ in 0..20_000 {
        let granule = 512 * (1 + (next() % 8192) as usize);
        let medium_chunk = 512 * (1 + (next() % 262_144) as usize);
        let size = 512 * (1 + (next() % 32_768) as usize);
        let config = PoolConfig {
            small_limit: 512,
            medium_limit: 1 << 40,
            medium_chunk,
            large_granule: granule,
            ..PoolConfig::default()
        };
        let arena = Arena::<Mock>::new(config);
        let (g, m) = (arena.config.large_granule, arena.config.medium_chunk);
        assert_eq!(
            arena.packed_medium_chunk(size),
            reference(size, g, m),
            "size {size}, granule {g}, medium chunk {m}"
        );
    }
}

/// An unlimited simulated device that gives and takes back chunks of `MAX_REQUEST` bytes keeps
/// handing out ranges inside the address space (it reuses the addresses of the chunks given
/// back). Failed before the fix: the fourth range ran past the end of the address space and
/// wrapped (in debug builds, an overflow panic in the emulated device), and the pool's
/// bookkeeping of such a chunk could find no block at a block's own address (a panic).
#[test]
fn the_simulator_reuses_addresses_instead_of_wrapping_past_the_end() {
    use crate::memory::SimulatedPool;
    use crate::memory::pool::MAX_REQUEST;
    let pool = SimulatedPool::new(PoolConfig { expandable: false, ..PoolConfig::default() }, None);
    let mut seen = Vec::new();
    for i in 0..8 {
        let p = pool.allocate(MAX_REQUEST, 0).unwrap_or_else(|e| panic!("allocation {i}: {e}"));
        assert!(p.checked_add(MAX_REQUEST as u64).is_some(), "allocation {i} at {p:#x} runs past the address space");
        seen.push(p);
        // A smaller block beside it on another stream, then both go back.
        let q = pool.allocate(64 << 20, 1).unwrap();
        assert!(
            q.checked_add(64 << 20).is_some_and(|end| end <= p || q >= p + MAX_REQUEST as u64),
            "{q:#x} overlaps {p:#x}"
        );
        pool.deallocate(q, 64 << 20, 1).unwrap();
        pool.deallocate(p, MAX_REQUEST, 0).unwrap();
        pool.trim(0);
        assert_eq!(pool.stats().reserved, 0);
    }
    assert_eq!(seen[0], 1 << 40);
    assert!(seen[3] < seen[2], "{seen:x?}: the fourth range is not one given back");
}

/// In segments, a first growth for a request larger than the address range it would reserve is
/// refused before anything is mapped (or reserved). Failed before the fix: the range was mapped
/// to its end (where the device's free memory is not known, as here, every byte of it the driver
/// would give), then unmapped, and the request refused.
#[test]
fn a_first_growth_larger_than_its_range_maps_nothing() {
    let h = Harness::new(plain(), Mock::with_vmm(1, 1 << 30));
    let r = h.alloc(2048 * MIB, 0);
    assert!(matches!(r, Err(PoolError::OutOfMemory { .. })), "{r:?}");
    let (reserved, ranges, maps, unmaps) = h.mock.chunk_figures();
    assert_eq!((reserved, ranges, maps, unmaps), (0, 0, 0, 0));
    // A request that fits is served, in segments.
    let p = h.alloc(64 * MIB, 0).unwrap();
    assert!(h.arena(|a| a.segments.is_some()));
    h.free(p, 0);
    h.check();
    h.teardown();
}

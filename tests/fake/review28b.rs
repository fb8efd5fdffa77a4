//! Review 28b: an adversarial review of `StreamOrderedPool`'s concurrency (segments and chunks)
//! for a path where memory is unmapped or freed, or handed to another stream, while queued GPU
//! work may still touch it.
//!
//! Every test runs on the emulated Linux and TCC drivers (`CUDRV_FAKE_MODE`), each with a
//! `StreamOrderedPool` of its own, in segments and in chunks (`PoolConfig::expandable`); the
//! emulated `cuMemUnmap` and `cuMemFree` do not wait for queued work, so a kernel that touches
//! memory the pool gave back is a violation, and every buffer's contents are checked (a block
//! handed out twice while a kernel writes it shows as another tag).
//!
//! Covered:
//! - a per-thread stream made again by its thread (`Stream::per_thread`) while the pool's
//!   retirement of it waits for a capture's end on cudrv's thread:
//!   `a_per_thread_stream_revived_before_its_deferred_retirement_keeps_no_stale_slot`, DEFECT
//!   (segments and chunks): the new cache registers the stream while the arena still knows it and
//!   gets the old state's slot (`Arena::register`); the deferred `pool::retire` then forgot and
//!   reaped that state (`forget_slot`, `maybe_reap`) while the cache kept the slot (`Cache::slot`);
//!   the next stream took the slot, and the per-thread stream's allocation took that stream's
//!   freed block as its own, with no wait, while its kernel still wrote it. Fixed: a stream's
//!   state counts its caches, and `Arena::retire_cache` forgets it only when the last one retires;
//! - the memcheck finding of run 55 (tests/gpu/launch.rs,
//!   `host_functions_drop_buffers_while_another_thread_trims`, a memcheck false positive: run 56),
//!   widened: frees from host functions on several streams against a trimming thread, slow
//!   unmaps, delayed stream work:
//!   `host_function_drops_on_several_streams_race_trims`, found sound;
//! - frees on other streams than the allocation's (buffers used on a second stream, whose free
//!   waits; raw frees elsewhere, `deallocate_elsewhere`), cross-stream reuse through events
//!   (`borrow_from_others`, `move_covered`) and host-safe merges, against trims:
//!   `frees_on_other_streams_race_trims`, found sound;
//! - streams dropped with work in flight (the last record of `retire_cache`, reaped and reused
//!   slots and the epochs of `Wait`, orphans freed elsewhere), against trims:
//!   `streams_dropped_with_work_in_flight_race_trims`, found sound;
//! - per-thread streams retired and made again every round, dropped on their thread or in a host
//!   function (cudrv's thread, where the legacy stream stands in), against trims:
//!   `per_thread_streams_revived_every_round_race_trims`, found sound;
//! - recovery from out of memory on a small device (`settle`, `release_settled`, exact growth,
//!   `take_last_resort`) against frees on every path above:
//!   `out_of_memory_recovery_races_frees_on_every_path`, found sound;
//! - growth past a release threshold and the headroom, which unmaps or frees what polled events
//!   say is done (`Completion::Poll`, `merge_before_growing`, `Grow::Release`, `Grow::Busy`):
//!   `growth_past_the_release_threshold_races_frees`, found sound.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cudrv::graph::CaptureMode;
use cudrv::memory::{DeviceBuffer, MemoryResource, PoolConfig, StreamOrderedPool};
use cudrv::{Device, LaunchConfig, Module, Stream};
use cudrv_test_support::run_with_fake_modes;

use crate::soundness::within;

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");
const LIMIT: Duration = Duration::from_secs(60);

fn pool_of(dev: &Device, expandable: bool) -> Arc<StreamOrderedPool> {
    let p = StreamOrderedPool::with_config(dev, PoolConfig { expandable, ..PoolConfig::default() }).unwrap();
    assert_eq!(p.grows_in_segments(), expandable && dev.capabilities().unwrap().virtual_memory_management);
    Arc::new(p)
}

/// Defect (failed in segments and in chunks; fixed). A per-thread stream whose last user went on another
/// thread while a blocking stream captured:
/// its cache is taken off it at once, but the pool's retirement (`pool::retire`, which forgets
/// the stream's state) waits on cudrv's thread for the end of the capture. Meanwhile the stream's
/// owner thread makes a user of the same stream again (`Stream::per_thread`) and allocates on it:
/// its new cache registers the stream, which the arena still knows, and gets the old state's
/// slot. The deferred retirement then forgets that state (and reaps it, it holds no free block),
/// while the new cache keeps its slot; a stream made next takes the slot. The per-thread stream's
/// next allocation takes, as its own, a block freed on the new stream whose kernel still runs:
/// both write it at once.
#[test]
fn a_per_thread_stream_revived_before_its_deferred_retirement_keeps_no_stale_slot() {
    for expandable in [true, false] {
        run_with_fake_modes(&["linux", "tcc"], &[], move || {
            within(LIMIT, "per-thread revival", || revived_per_thread_stream(expandable));
        });
    }
}

fn revived_per_thread_stream(expandable: bool) {
    const N: usize = 1 << 20; // 4 MiB of u32
    // Exactly one mapping (or chunk): nothing of it stays free in the arena.
    const RAW: usize = 2 << 20;
    let dev = Device::get(0).unwrap();
    let sop = pool_of(&dev, expandable);
    let pool: Arc<dyn MemoryResource> = sop.clone();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let fill = module.function("fill_u32").unwrap();
    let (to_main, from_t1) = mpsc::channel::<Option<Stream>>();
    let (to_t1, from_main) = mpsc::channel::<()>();
    let (x_tx, x_rx) = mpsc::channel::<u64>();
    std::thread::scope(|scope| {
        let pool = &pool;
        let fill = &fill;
        let t1 = scope.spawn(move || {
            let p = Stream::per_thread(&dev).unwrap();
            // A live allocation of the stream's cache (no pin: a raw one), so that its state holds
            // no free block when it is forgotten.
            let raw = pool.allocate(RAW, &p).unwrap();
            to_main.send(Some(p)).unwrap();
            from_main.recv().unwrap();
            // The capture is on: the stream's last user went on the main thread.
            let p = Stream::per_thread(&dev).unwrap();
            // Its new cache (again a whole mapping, live).
            let raw2 = pool.allocate(RAW, &p).unwrap();
            to_main.send(None).unwrap();
            from_main.recv().unwrap();
            // The retirement ran and another stream `r` freed a block whose kernel still runs.
            let x = x_rx.recv().unwrap();
            let mut y = DeviceBuffer::<u32>::zeroed_in(N, &p, pool.clone()).unwrap();
            // SAFETY: fill_u32 writes y[0..N].
            unsafe { fill.launch(LaunchConfig::for_num_elems(N), &p, (&mut y, 0xBBBB_BBBBu32, N as u64)) }.unwrap();
            p.synchronize().unwrap();
            to_main.send(None).unwrap();
            from_main.recv().unwrap();
            let got = y.to_vec().unwrap();
            let bad = got.iter().filter(|&&v| v != 0xBBBB_BBBB).count();
            assert_eq!(
                bad,
                0,
                "{bad} of {N} words of a buffer of the revived per-thread stream changed behind it (at {:#x}; \
                 the other stream's block was at {x:#x}): first {:#x}",
                y.as_raw(),
                got.iter().find(|&&v| v != 0xBBBB_BBBB).copied().unwrap_or(0)
            );
            drop(y);
            // SAFETY: from this pool with this size; nothing used it.
            unsafe { pool.deallocate(raw, RAW, &p) }.unwrap();
            // SAFETY: as above.
            unsafe { pool.deallocate(raw2, RAW, &p) }.unwrap();
        });
        let q = Stream::per_thread(&dev).unwrap();
        q.begin_capture(CaptureMode::Relaxed).unwrap();
        let p = from_t1.recv().unwrap().unwrap();
        // Dropped here, the per-thread stream stands for the legacy stream, which a blocking
        // capture holds: the pool's retirement waits for the capture's end.
        drop(p);
        to_t1.send(()).unwrap();
        assert!(from_t1.recv().unwrap().is_none());
        drop(q.end_capture().unwrap());
        cudrv::flush_deferred_drops().unwrap();
        // A new stream, which may take the slot the retirement freed.
        let r = Stream::new(&dev).unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed_in(N, &r, pool.clone()).unwrap();
        // SAFETY: spin_fill_u32 spins, then writes x[0..N].
        unsafe { spin.launch(LaunchConfig::for_num_elems(N), &r, (&mut x, 0xAAAA_AAAAu32, N as u64, 300_000u64)) }
            .unwrap();
        let x_ptr = x.as_raw();
        drop(x);
        to_t1.send(()).unwrap();
        x_tx.send(x_ptr).unwrap();
        assert!(from_t1.recv().unwrap().is_none());
        r.synchronize().unwrap();
        to_t1.send(()).unwrap();
        t1.join().unwrap();
    });
    cudrv::flush_deferred_drops().unwrap();
    pool.trim(0).unwrap();
    let st = pool.stats().unwrap();
    assert_eq!(st.in_use, 0);
}

/// What [`stress`] does besides allocating, writing and checking buffers on each worker's stream.
#[derive(Clone, Copy, Default)]
struct Stress {
    /// Worker threads, each with its own stream.
    workers: u32,
    rounds: u32,
    /// How long each writing kernel spins before it writes.
    spin_us: u64,
    /// Buffers are dropped in host functions (their frees come from cudrv's deferred-work thread).
    host_fn_drops: bool,
    /// Buffers are written on a second stream of the worker too (tracked uses: the free waits).
    cross_stream: bool,
    /// Raw allocations freed on another stream than their own after a wait
    /// (`deallocate_elsewhere`).
    elsewhere: bool,
    /// Each round also allocates on a stream of its own, writes, frees, and drops the stream
    /// with its work in flight (the pool's retirement of a stream).
    churn: bool,
    /// Another thread trims the pool to nothing this often (0: never).
    trim_every_us: u64,
    /// The streams of `churn` are the worker's per-thread stream, made anew each round (the same
    /// stream, revived), and dropped in a host function half of the time (its retirement then
    /// runs on cudrv's thread, where the legacy stream stands in for it).
    per_thread: bool,
    /// The pool's release threshold (0: none): growth past it first unmaps or frees what the GPU
    /// has completed (asked without waiting, `Completion::Poll`), with no lock held.
    threshold: usize,
    /// The device is small: an allocation may fail with out of memory (after the pool's
    /// recovery), and the round goes on without it.
    oom_ok: bool,
}

/// Element counts (u32) the workers pick from: small (their own segment), medium and large, so
/// that blocks split, merge across streams and grow.
const SIZES: [usize; 6] = [1 << 12, 1 << 16, 3 << 16, 1 << 19, 3 << 18, 5 << 18];

/// A small generator (xorshift), so that each worker's sizes differ.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Workers allocate buffers of changing sizes from one pool, write each with a kernel (that spins
/// first) with a tag of their own, keep a few alive, and check each one's contents before they
/// let it go: a block handed out twice, or unmapped, while a kernel may still write it, shows as
/// a changed tag (or a violation the emulated driver records). Meanwhile, what `s` asks for.
fn stress(expandable: bool, s: Stress) {
    let dev = Device::get(0).unwrap();
    let pool = pool_of(&dev, expandable);
    let dyn_pool: Arc<dyn MemoryResource> = pool.clone();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    if s.threshold > 0 {
        pool.set_release_threshold(s.threshold).unwrap();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (pool, dyn_pool, spin, done, dev) = (&pool, &dyn_pool, &spin, &done, &dev);
        let trimmer = (s.trim_every_us > 0).then(|| {
            scope.spawn(move || {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    pool.trim(0).unwrap();
                    std::thread::sleep(Duration::from_micros(s.trim_every_us));
                }
            })
        });
        let workers: Vec<_> = (0..s.workers)
            .map(|w| {
                scope.spawn(move || {
                    let home = Stream::new(dev).unwrap();
                    let other = Stream::new(dev).unwrap();
                    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (u64::from(w) + 1).wrapping_mul(0x2545_F491_4F6C_DD1D);
                    let mut ring: std::collections::VecDeque<(DeviceBuffer<u32>, u32, bool)> = Default::default();
                    let check = |b: DeviceBuffer<u32>, tag: u32, crossed: bool| {
                        if crossed {
                            other.synchronize().unwrap();
                        }
                        let got = b.to_vec().unwrap();
                        let bad = got.iter().filter(|&&v| v != tag).count();
                        assert_eq!(
                            bad,
                            0,
                            "worker {w}: {bad} of {} words of the buffer at {:#x} changed behind it (tag {tag:#x}, \
                             first other value {:#x})",
                            got.len(),
                            b.as_raw(),
                            got.iter().find(|&&v| v != tag).copied().unwrap_or(0)
                        );
                        b
                    };
                    for round in 0..s.rounds {
                        let n = SIZES[(next(&mut rng) % SIZES.len() as u64) as usize];
                        let tag = (w + 1) << 24 | round;
                        let ok = |e: cudrv::Error| {
                            assert!(s.oom_ok && matches!(e, cudrv::Error::OutOfMemory { .. }), "worker {w}: {e}");
                        };
                        let mut b = match DeviceBuffer::<u32>::zeroed_in(n, &home, dyn_pool.clone()) {
                            Ok(b) => b,
                            Err(e) => {
                                ok(e);
                                continue;
                            }
                        };
                        let crossed = s.cross_stream && next(&mut rng).is_multiple_of(2);
                        let on = if crossed { &other } else { &home };
                        // SAFETY: spin_fill_u32 spins, then writes b[0..n].
                        unsafe { spin.launch(LaunchConfig::for_num_elems(n), on, (&mut b, tag, n as u64, s.spin_us)) }
                            .unwrap();
                        ring.push_back((b, tag, crossed));
                        if s.elsewhere {
                            let bytes = SIZES[(next(&mut rng) % SIZES.len() as u64) as usize] * 4;
                            let raw = match pool.allocate(bytes, &home) {
                                Ok(raw) => raw,
                                Err(e) => {
                                    ok(e);
                                    continue;
                                }
                            };
                            // SAFETY: the raw allocation holds bytes / 4 words.
                            unsafe {
                                spin.launch(
                                    LaunchConfig::for_num_elems(bytes / 4),
                                    &home,
                                    (raw, tag, (bytes / 4) as u64, s.spin_us),
                                )
                            }
                            .unwrap();
                            other.wait_stream(&home).unwrap();
                            // SAFETY: from this pool with this size; its one use is ordered before
                            // the free on `other` (which waited for `home`).
                            unsafe { pool.deallocate(raw, bytes, &other) }.unwrap();
                        }
                        if s.churn {
                            let own = if s.per_thread { Stream::per_thread(dev) } else { Stream::new(dev) }.unwrap();
                            let m = SIZES[(next(&mut rng) % SIZES.len() as u64) as usize];
                            let mut t = match DeviceBuffer::<u32>::zeroed_in(m, &own, dyn_pool.clone()) {
                                Ok(t) => t,
                                Err(e) => {
                                    ok(e);
                                    continue;
                                }
                            };
                            // SAFETY: as above.
                            unsafe {
                                spin.launch(LaunchConfig::for_num_elems(m), &own, (&mut t, tag, m as u64, s.spin_us))
                            }
                            .unwrap();
                            drop(t);
                            // A raw allocation left live on the stream: an orphan once the stream
                            // goes, freed on `home` (which waited for its kernel).
                            let orphan = pool.allocate(m * 4, &own).ok();
                            if let Some(raw) = orphan {
                                // SAFETY: the raw allocation holds m words.
                                unsafe {
                                    spin.launch(LaunchConfig::for_num_elems(m), &own, (raw, tag, m as u64, s.spin_us))
                                }
                                .unwrap();
                                home.wait_stream(&own).unwrap();
                            }
                            if s.per_thread && next(&mut rng).is_multiple_of(2) {
                                home.launch_host_fn(move || drop(own)).unwrap();
                            } else {
                                drop(own);
                            }
                            if let Some(raw) = orphan {
                                // SAFETY: from this pool with this size; its one use is ordered
                                // before the free on `home`.
                                unsafe { pool.deallocate(raw, m * 4, &home) }.unwrap();
                            }
                        }
                        while ring.len() > 3 {
                            let (b, tag, crossed) = ring.pop_front().unwrap();
                            let mut b = check(b, tag, crossed);
                            if s.host_fn_drops {
                                // Written once more, then dropped in a host function behind it.
                                let len = b.len();
                                // SAFETY: as above.
                                unsafe {
                                    spin.launch(
                                        LaunchConfig::for_num_elems(len),
                                        &home,
                                        (&mut b, tag, len as u64, s.spin_us),
                                    )
                                }
                                .unwrap();
                                home.launch_host_fn(move || drop(b)).unwrap();
                            } else {
                                drop(b);
                            }
                        }
                    }
                    for (b, tag, crossed) in ring {
                        drop(check(b, tag, crossed));
                    }
                    home.synchronize().unwrap();
                    other.synchronize().unwrap();
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = trimmer {
            t.join().unwrap();
        }
    });
    cudrv::flush_deferred_drops().unwrap();
    pool.trim(0).unwrap();
    let st = pool.pool_stats();
    assert_eq!((st.in_use, st.live_allocations), (0, 0), "{st:?}");
}

/// Runs [`stress`] in segments, then in chunks, in each mode, with `env`.
fn stress_both(env: &[(&str, &str)], s: Stress) {
    run_with_fake_modes(&["linux", "tcc"], env, move || {
        for expandable in [true, false] {
            within(LIMIT, "stress", || stress(expandable, s));
        }
    });
}

/// The memcheck finding's shape, widened: several threads free buffers from host functions
/// (cudrv's deferred-work thread), right behind a kernel that writes them, while another thread
/// trims the pool every 200 µs, unmaps (segments) or frees (chunks) take 300 µs with no lock
/// held, and every stream operation is delayed.
#[test]
fn host_function_drops_on_several_streams_race_trims() {
    stress_both(
        &[("CUDRV_FAKE_UNMAP_US", "300"), ("CUDRV_FAKE_DELAY_US", "30")],
        Stress { workers: 3, rounds: 120, spin_us: 300, host_fn_drops: true, trim_every_us: 200, ..Stress::default() },
    );
}

/// Buffers written on a second stream (their frees wait for it: `uses`), and raw allocations
/// freed on another stream than their own after a wait (`deallocate_elsewhere`, the block cached
/// on the freeing stream), while another thread trims and each stream operation is delayed:
/// blocks move between streams through events (`borrow_from_others`, `move_covered`) and merge
/// once host-safe.
#[test]
fn frees_on_other_streams_race_trims() {
    stress_both(
        &[("CUDRV_FAKE_UNMAP_US", "200"), ("CUDRV_FAKE_DELAY_US", "30")],
        Stress {
            workers: 3,
            rounds: 100,
            spin_us: 400,
            cross_stream: true,
            elsewhere: true,
            host_fn_drops: true,
            trim_every_us: 300,
            ..Stress::default()
        },
    );
}

/// Each round also makes a stream, writes a buffer there, frees it and drops the stream with the
/// kernel still spinning: the pool forgets the stream with a last event, other workers reuse its
/// blocks after a wait on it (or once host-safe), its state's slot is reaped and reused by the
/// next stream (the epochs of `Wait`), and a trim waits on forgotten streams' events. A raw
/// allocation left live on the stream becomes an orphan, freed on the worker's stream after a wait
/// (`deallocate_elsewhere`).
#[test]
fn streams_dropped_with_work_in_flight_race_trims() {
    stress_both(
        &[("CUDRV_FAKE_UNMAP_US", "200"), ("CUDRV_FAKE_DELAY_US", "20")],
        Stress { workers: 3, rounds: 80, spin_us: 500, churn: true, trim_every_us: 500, ..Stress::default() },
    );
}

/// A device of 40 MiB for workers that together keep up to about 60 MiB live: allocations go
/// through the pool's recovery from out of memory (`settle`, `release_settled`, growth at
/// exactly the request, `take_last_resort`) while other threads free on their streams, from
/// host functions and on other streams, and drop streams with work in flight. An allocation
/// that still fails is skipped.
#[test]
fn out_of_memory_recovery_races_frees_on_every_path() {
    stress_both(
        &[("CUDRV_FAKE_MEMORY", "41943040"), ("CUDRV_FAKE_UNMAP_US", "100"), ("CUDRV_FAKE_DELAY_US", "20")],
        Stress {
            workers: 2,
            rounds: 100,
            spin_us: 400,
            host_fn_drops: true,
            cross_stream: true,
            elsewhere: true,
            churn: true,
            oom_ok: true,
            ..Stress::default()
        },
    );
}

/// No trim: growth past a release threshold of 32 MiB (and past the headroom) unmaps free
/// mappings between live blocks (segments) or frees whole chunks, polling the frees' events
/// without waiting, while other threads free from host functions and on other streams, and
/// growth into a segment waits for another thread's unmapping (`Grow::Busy`).
#[test]
fn growth_past_the_release_threshold_races_frees() {
    stress_both(
        &[("CUDRV_FAKE_UNMAP_US", "300"), ("CUDRV_FAKE_DELAY_US", "20")],
        Stress {
            workers: 3,
            rounds: 100,
            spin_us: 100,
            host_fn_drops: true,
            cross_stream: true,
            elsewhere: true,
            threshold: 32 << 20,
            ..Stress::default()
        },
    );
}

/// `churn` on each worker's per-thread stream: dropped at the end of each round (on the worker,
/// or in a host function, so on cudrv's thread, where the legacy stream stands in for it) and
/// made again by the next round, while frees come from host functions and another thread trims
/// (its records on a per-thread stream go to the legacy stream too).
#[test]
fn per_thread_streams_revived_every_round_race_trims() {
    stress_both(
        &[("CUDRV_FAKE_UNMAP_US", "200"), ("CUDRV_FAKE_DELAY_US", "20")],
        Stress {
            workers: 3,
            rounds: 80,
            spin_us: 400,
            churn: true,
            per_thread: true,
            host_fn_drops: true,
            trim_every_us: 500,
            ..Stress::default()
        },
    );
}

//! Review of the stream-ordered pool and `DeviceBuffer` under driver faults (review 21): non-OOM
//! failures of the pool's driver calls at awkward points, and what the pool's accounting and the
//! driver's objects look like once the fault is spent. Each test reproduced a defect that review
//! found, or pins down behaviour that it checked.

use std::collections::VecDeque;
use std::sync::Arc;

use cudrv::memory::{DeviceBuffer, DevicePtr, MemoryResource, StreamOrderedPool};
use cudrv::{Device, Stream};
use cudrv_test_support::{fake_faults_injected, fake_report, run_with_fake};

/// Chunks (`cuMemAlloc`): no virtual memory management.
const CHUNKS: [(&str, &str); 2] = [("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_VMM", "0")];
/// Segments (`cuMemCreate` / `cuMemMap`).
const SEGMENTS: [(&str, &str); 1] = [("CUDRV_FAKE_MODE", "tcc")];

fn live_streams() -> u64 {
    fake_report().live_streams
}

fn with(base: &[(&str, &str)], extra: &[(&str, &str)]) -> Vec<(String, String)> {
    base.iter().chain(extra).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn run(env: &[(String, String)], body: impl FnOnce()) {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run_with_fake(&env, body);
}

/// A stream whose last user goes while the pool caches blocks freed on it is forgotten by the
/// pool with one last `cuEventRecord` on it (`pool::retire` -> `Arena::forget_stream`). When
/// that record fails, the pool keeps the stream until its next trim (or the next stream to
/// retire), which forgets it. (It kept the stream's `StreamKey`, and the `CUstream` with it, for
/// the pool's life: for the device's pool, the rest of the process.)
#[test]
fn a_failed_record_at_retirement_does_not_keep_the_stream_forever() {
    for mode in [&CHUNKS[..], &SEGMENTS[..]] {
        run(&with(mode, &[("CUDRV_FAKE_FAIL", "cuEventRecord:1:999")]), retire_case);
    }
}

fn retire_case() {
    let dev = Device::get(0).unwrap();
    let pool = StreamOrderedPool::new(&dev).unwrap();
    let base = live_streams();
    let s = Stream::new(&dev).unwrap();
    let p = pool.allocate(1 << 16, &s).unwrap();
    // SAFETY: from this pool, this size, unused.
    unsafe { pool.deallocate(p, 1 << 16, &s) }.unwrap();
    assert_eq!(fake_faults_injected(), 0, "no record before the retirement");
    drop(s); // the pool records one last event on it: that record fails
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(fake_faults_injected(), 1, "the retirement's record failed");
    // The fault is spent: a trim waits for every free and gives everything back.
    pool.trim(0).unwrap();
    cudrv::flush_deferred_drops().unwrap();
    let stats = pool.pool_stats();
    assert_eq!((stats.reserved, stats.chunks), (0, 0), "{stats:?}");
    assert_eq!(stats.streams, 0, "the pool still knows the dropped stream: {stats:?}");
    assert_eq!(live_streams(), base, "the dropped stream was never destroyed");
}

/// Request sizes: small, medium and large, some above the fake's memory share per buffer.
const SIZES: [usize; 7] = [512, 40_000, 300_000, (1 << 20) + 4096, 3 << 20, 9 << 20, 17 << 20];

/// A workload on a pool of its own, over three streams: buffers (memsets keep the streams busy),
/// raw allocations freed on another stream than their own, trims (the last to 0). Driver errors are counted,
/// not fatal. Returns the number of failed operations.
fn pool_workload(pool: &Arc<StreamOrderedPool>, streams: &[Stream]) -> usize {
    let resource: Arc<dyn MemoryResource> = pool.clone();
    let mut failed = 0;
    let mut bufs: VecDeque<DeviceBuffer<u8>> = VecDeque::new();
    let mut raw: VecDeque<(DevicePtr, usize, usize)> = VecDeque::new();
    for i in 0..40usize {
        let bytes = SIZES[i % SIZES.len()] + (i % 5) * 512;
        let s = i % streams.len();
        match DeviceBuffer::<u8>::zeroed_in(bytes, &streams[s], resource.clone()) {
            Ok(mut b) => {
                if b.fill(i as u8).is_err() {
                    failed += 1;
                }
                if i % 4 == 1 && b.record_use(&streams[(s + 1) % streams.len()]).is_err() {
                    failed += 1;
                }
                bufs.push_back(b);
            }
            Err(_) => failed += 1,
        }
        match pool.allocate(SIZES[(i + 3) % SIZES.len()], &streams[(s + 2) % streams.len()]) {
            Ok(p) => raw.push_back((p, SIZES[(i + 3) % SIZES.len()], (s + 2) % streams.len())),
            Err(_) => failed += 1,
        }
        while bufs.len() > 3 {
            drop(bufs.pop_front());
        }
        while raw.len() > 2 {
            let (p, bytes, _) = raw.pop_front().unwrap();
            // Freed on another stream than its own (the block is cached there).
            // SAFETY: from this pool, this size; nothing used it.
            if unsafe { pool.deallocate(p, bytes, &streams[i % streams.len()]) }.is_err() {
                failed += 1;
            }
        }
        if i % 9 == 8 && pool.trim(8 << 20).is_err() {
            failed += 1;
        }
    }
    drop(bufs);
    for (p, bytes, s) in raw {
        // SAFETY: as above.
        if unsafe { pool.deallocate(p, bytes, &streams[s]) }.is_err() {
            failed += 1;
        }
    }
    // Everything back to the driver: segments give their address ranges back.
    if pool.trim(0).is_err() {
        failed += 1;
    }
    failed
}

/// What must hold once the workload's memory is all freed, its streams dropped, the fault spent
/// and the pool trimmed: nothing reserved, live or cached, no stream known, nothing left with the
/// driver (`driver_clean`: also no allocation and no stream of the fake's), and the pool serves.
fn check_after(pool: &Arc<StreamOrderedPool>, base_streams: u64, driver_clean: bool) {
    cudrv::flush_deferred_drops().unwrap();
    // Twice: a segment's range whose give-back failed is given back at the next trim (see
    // `a_failed_address_free_is_not_hidden`).
    pool.trim(0).unwrap();
    pool.trim(0).unwrap();
    cudrv::flush_deferred_drops().unwrap();
    let st = pool.pool_stats();
    assert_eq!(
        (st.reserved, st.chunks, st.live_allocations, st.in_use, st.cached),
        (0, 0, 0, 0, 0),
        "reserved, chunks, live, in use, cached after the trim: {st:?}"
    );
    assert_eq!(st.streams, 0, "streams the pool still knows: {st:?}");
    if driver_clean {
        let r = fake_report();
        assert_eq!(r.live_allocations, 0, "{r}");
        assert_eq!(r.live_streams, base_streams, "{r}");
    }
    let dev = Device::get(0).unwrap();
    let s = Stream::new(&dev).unwrap();
    let resource: Arc<dyn MemoryResource> = pool.clone();
    for bytes in SIZES {
        let mut b = DeviceBuffer::<u8>::zeroed_in(bytes, &s, resource.clone()).unwrap();
        b.fill(9).unwrap();
        assert!(b.to_vec().unwrap().iter().all(|&x| x == 9));
    }
}

/// One run of the workload with `fail` injected; the checks of [`check_after`].
fn accounting_case(fail: &str) {
    let dev = Device::get(0).unwrap();
    let base = live_streams();
    let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    let streams: Vec<Stream> = (0..3).map(|_| Stream::new(&dev).unwrap()).collect();
    pool_workload(&pool, &streams);
    for s in &streams {
        let _ = s.synchronize();
    }
    drop(streams);
    cudrv::flush_deferred_drops().unwrap();
    if fake_faults_injected() == 0 {
        // The workload calls every swept function, so its first call at least is reached: a
        // sweep that injects nothing tests nothing.
        assert!(!fail.contains(":1:"), "{fail} was never reached: the workload does not call it");
        return; // the workload ended before the nth call
    }
    // A failed cuMemRelease leaks the handle's memory with the driver (reported; documented).
    check_after(&pool, base, !fail.starts_with("cuMemRelease"));
}

/// Runs [`accounting_case`] for each of `functions` failing (999) at each of `nths`; returns the
/// faults whose run failed, with the first line of the child's panic.
fn accounting_sweep(mode: &[(&str, &str)], functions: &[&str], nths: &[&str], code: &str, memory: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for f in functions {
        for n in nths {
            let fail = format!("{f}:{n}:{code}");
            let env =
                with(mode, &[("CUDRV_FAKE_FAIL", &fail), ("CUDRV_FAKE_DELAY_US", "50"), ("CUDRV_FAKE_MEMORY", memory)]);
            let fail2 = fail.clone();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&env, || accounting_case(&fail2))));
            if let Err(p) = r {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let why = msg.lines().skip_while(|l| !l.contains("panicked at")).nth(1).unwrap_or("?").to_string();
                bad.push(format!("{fail}: {why}"));
            }
        }
    }
    bad
}

const NTHS: [&str; 6] = ["1", "2", "3", "5", "8", "13"];
// `Stream::synchronize` waits with an event (`cuEventRecord` and `cuEventSynchronize`).
const EVENTS: [&str; 5] =
    ["cuEventCreate", "cuEventQuery", "cuEventSynchronize", "cuStreamWaitEvent", "cuMemGetInfo_v2"];

#[test]
fn sweep_accounting_chunks() {
    let functions: Vec<&str> = ["cuMemAlloc_v2", "cuMemFree_v2", "cuEventRecord"].into_iter().chain(EVENTS).collect();
    let mut bad = accounting_sweep(&CHUNKS, &functions, &NTHS, "999", "100000000");
    // Out of memory injected, and a device small enough for the workload to run out for real.
    bad.extend(accounting_sweep(&CHUNKS, &["cuMemAlloc_v2"], &NTHS, "2", "60000000"));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn sweep_accounting_segments() {
    let functions: Vec<&str> =
        super::faults::VMM.into_iter().chain(["cuMemAddressFree", "cuEventRecord"]).chain(EVENTS).collect();
    let mut bad = accounting_sweep(&SEGMENTS, &functions, &NTHS, "999", "100000000");
    bad.extend(accounting_sweep(&SEGMENTS, &["cuMemCreate", "cuMemMap"], &NTHS, "2", "60000000"));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

const MIB: usize = 1 << 20;

/// In chunks, a large request past the pool's headroom first gives back a whole free chunk whose
/// frees completed (`Arena::grow_chunk` -> `Grow::Release`), then grows. That release is
/// housekeeping: the device has plenty of memory for the growth either way. When its
/// `cuMemFree` fails, the error goes to the drop-error hook and the allocation is served (the
/// chunk went back to the arena, intact). It failed with "cuMemFree failed" before.
#[test]
fn a_failed_headroom_release_does_not_fail_the_allocation_in_chunks() {
    run(&with(&CHUNKS, &[("CUDRV_FAKE_FAIL", "cuMemFree_v2:1:999")]), headroom_chunks_case);
}

fn headroom_chunks_case() {
    let dev = Device::get(0).unwrap();
    let pool = StreamOrderedPool::new(&dev).unwrap();
    let s = Stream::new(&dev).unwrap();
    let a = pool.allocate(64 * MIB, &s).unwrap();
    // SAFETY: from this pool, this size, unused.
    unsafe { pool.deallocate(a, 64 * MIB, &s) }.unwrap();
    // The host sees the free complete (nothing is given back: everything may stay).
    pool.trim(usize::MAX).unwrap();
    // 100 MiB: the free 64 MiB chunk cannot hold it; 64 + 100 MiB passes 1.2 x 100 MiB, so the
    // pool gives the chunk back first (the fake has 16 GiB: nothing else is needed).
    let b = pool.allocate(100 * MIB, &s);
    assert_eq!(fake_faults_injected(), 1, "the release's cuMemFree was reached");
    let b = b.unwrap_or_else(|e| panic!("an allocation the device has room for failed: {e:?}"));
    // SAFETY: as above.
    unsafe { pool.deallocate(b, 100 * MIB, &s) }.unwrap();
    pool.trim(0).unwrap();
    assert_eq!(fake_report().live_allocations, 0);
}

/// The same in segments: past the headroom, free mappings are unmapped before the segment grows
/// (`Arena::grow_segment` -> `Grow::Release`); a failed `cuMemUnmap` there no longer fails the
/// allocation.
#[test]
fn a_failed_headroom_release_does_not_fail_the_allocation_in_segments() {
    run(&with(&SEGMENTS, &[("CUDRV_FAKE_FAIL", "cuMemUnmap:1:999")]), headroom_segments_case);
}

fn headroom_segments_case() {
    let dev = Device::get(0).unwrap();
    let pool = StreamOrderedPool::new(&dev).unwrap();
    assert!(pool.grows_in_segments());
    let s = Stream::new(&dev).unwrap();
    let a = pool.allocate(64 * MIB, &s).unwrap();
    let top = pool.allocate(2 * MIB, &s).unwrap(); // live above `a`: `a` cannot merge with growth
    // SAFETY: from this pool, this size, unused.
    unsafe { pool.deallocate(a, 64 * MIB, &s) }.unwrap();
    // The host sees the free complete (nothing is given back: everything may stay).
    pool.trim(usize::MAX).unwrap();
    // 100 MiB: the free 64 MiB cannot hold it; 74 + 94 MiB mapped passes 1.2 x 102 MiB, so the
    // pool unmaps the free mappings first (the fake has 16 GiB: nothing else is needed).
    let b = pool.allocate(100 * MIB, &s);
    assert_eq!(fake_faults_injected(), 1, "the release's cuMemUnmap was reached");
    let b = b.unwrap_or_else(|e| panic!("an allocation the device has room for failed: {e:?}"));
    // SAFETY: as above.
    unsafe {
        pool.deallocate(b, 100 * MIB, &s).unwrap();
        pool.deallocate(top, 2 * MIB, &s).unwrap();
    }
    pool.trim(0).unwrap();
}

/// `CudaBackend::map`: when `cuMemSetAccess` fails and the `cuMemUnmap` that undoes the mapping
/// fails too, the range stays mapped (its handle released: the memory is freed only once it is
/// unmapped). The backend unmaps it again before it maps over it or gives its address range
/// back, so that once the fault is spent every growth serves. (Every later growth of the segment
/// failed: it mapped at the same place, its top.)
#[test]
fn a_mapping_left_behind_does_not_stop_growth_for_good() {
    run(&with(&SEGMENTS, &[("CUDRV_FAKE_FAIL", "cuMemSetAccess:1:999,cuMemUnmap:1:999")]), stuck_mapping_case);
}

fn stuck_mapping_case() {
    let dev = Device::get(0).unwrap();
    let pool = StreamOrderedPool::new(&dev).unwrap();
    assert!(pool.grows_in_segments());
    let s = Stream::new(&dev).unwrap();
    let first = pool.allocate(4 * MIB, &s);
    assert!(first.is_err(), "the first growth meets both faults");
    assert_eq!(fake_faults_injected(), 2);
    // The faults are spent: the driver would serve every one of these.
    let mut errors = Vec::new();
    for i in 0..5 {
        match pool.allocate(4 * MIB, &s) {
            // SAFETY: from this pool, this size, unused.
            Ok(p) => unsafe { pool.deallocate(p, 4 * MIB, &s) }.unwrap(),
            Err(e) => errors.push(format!("allocation {i}: {e}")),
        }
    }
    assert!(errors.is_empty(), "{errors:#?}");
}

/// A failed `cuMemAddressFree` (a trim giving back a segment's empty range) is reported to the
/// drop-error hook once, however many later trims fail again, and again when the pool is dropped
/// with the range still reserved. (Both were silent: the trim said `Ok` and the range leaked
/// unreported. Then a lasting failure was reported at every trim.)
#[test]
fn a_failed_address_free_is_not_hidden() {
    run(&with(&SEGMENTS, &[("CUDRV_FAKE_FAIL", "cuMemAddressFree:1+:999")]), address_free_case);
}

fn address_free_case() {
    let dev = Device::get(0).unwrap();
    let ctx = dev.primary_context().unwrap();
    let pool = StreamOrderedPool::new(&dev).unwrap();
    let s = Stream::new(&dev).unwrap();
    let p = pool.allocate(4 * MIB, &s).unwrap();
    // SAFETY: from this pool, this size, unused.
    unsafe { pool.deallocate(p, 4 * MIB, &s) }.unwrap();
    // The memory goes back; the empty range stays, and the failure is reported.
    pool.trim(0).unwrap();
    let stats = pool.pool_stats();
    assert_eq!((stats.reserved, stats.chunks), (0, 1), "{stats:?}");
    assert!(fake_faults_injected() >= 1, "the trim gave the range back");
    let reported = ctx.take_deferred();
    assert!(format!("{reported:?}").contains("cuMemAddressFree"), "{reported:?}");
    // Each later trim tries again, and reports nothing more (it reported at every trim before).
    let tried = fake_faults_injected();
    pool.trim(0).unwrap();
    pool.trim(0).unwrap();
    assert_eq!(fake_faults_injected(), tried + 2, "each trim tried to give the range back");
    let again = ctx.take_deferred();
    assert!(!format!("{again:?}").contains("cuMemAddressFree"), "reported again: {again:?}");
    drop(pool);
    cudrv::flush_deferred_drops().unwrap();
    let kept = ctx.take_deferred();
    assert!(format!("{kept:?}").contains("cuMemAddressFree"), "dropped with its range still reserved: {kept:?}");
}

/// The driver shuts down (`CUDA_ERROR_DEINITIALIZED` from every call) while the pool holds
/// cached blocks, raw allocations and buffers (kept by the pool, and used on a second stream),
/// and a stream goes before its buffers: allocations that need the driver fail with an error
/// that says the driver shut down, frees need nothing of it, and every drop (streams, buffers,
/// a pool of its own) returns without a panic or a hang.
#[test]
fn the_pool_and_its_buffers_outlive_a_driver_shutdown() {
    for mode in [&CHUNKS[..], &SEGMENTS[..]] {
        run(&with(mode, &[("CUDRV_MEMORY_RESOURCE", "pool"), ("CUDRV_FAKE_DELAY_US", "200")]), || {
            crate::soundness::within(std::time::Duration::from_secs(60), "drops after shutdown", || {
                let dev = Device::get(0).unwrap();
                let own = StreamOrderedPool::new(&dev).unwrap();
                let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
                let kept = DeviceBuffer::<u32>::zeroed(1 << 18, &a).unwrap();
                let mut used = DeviceBuffer::<u32>::zeroed(3 << 18, &a).unwrap();
                used.fill(5).unwrap();
                used.record_use(&b).unwrap();
                let raw = own.allocate(1 << 16, &a).unwrap();
                let cached = own.allocate(5 * MIB, &b).unwrap();
                // SAFETY: from this pool, this size, unused.
                unsafe { own.deallocate(cached, 5 * MIB, &b) }.unwrap();
                cudrv_test_support::fake_shutdown();
                let e = own.allocate(64 * MIB, &a).unwrap_err();
                assert!(e.is_deinitialized(), "{e:?}");
                let e = DeviceBuffer::<u8>::zeroed(64 * MIB, &b).unwrap_err();
                assert!(e.is_deinitialized(), "{e:?}");
                // A cached block of the size is served without the driver.
                let again = own.allocate(5 * MIB, &b).unwrap();
                drop(a); // before its buffers
                drop(kept);
                drop(used);
                // SAFETY: as above; freed on another stream than its own.
                unsafe {
                    own.deallocate(raw, 1 << 16, &b).unwrap();
                    own.deallocate(again, 5 * MIB, &b).unwrap();
                }
                drop(b);
                drop(own);
                let _ = cudrv::flush_deferred_drops();
                let _ = dev.memory_resource().map(|r| r.trim(0));
            });
        });
    }
}

/// One thread trims while its unmappings are slow and the first fails (the mapping goes back to
/// the arena, free), and three others grow the same segment meanwhile (`Grow::Busy`: they wait
/// for the unmapping with no lock held). Every thread finishes, the failed mapping serves again,
/// and once everything is freed and trimmed nothing is left reserved.
#[test]
fn growth_waits_out_a_slow_failing_unmap_on_another_thread() {
    let env = with(&SEGMENTS, &[("CUDRV_FAKE_UNMAP_US", "20000"), ("CUDRV_FAKE_FAIL", "cuMemUnmap:1:999")]);
    run(&env, || {
        crate::soundness::within(std::time::Duration::from_secs(60), "growth against a failing unmap", || {
            let dev = Device::get(0).unwrap();
            let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
            let s = Stream::new(&dev).unwrap();
            let big: Vec<DevicePtr> = (0..4).map(|_| pool.allocate(32 * MIB, &s).unwrap()).collect();
            for &p in &big {
                // SAFETY: from this pool, this size, unused.
                unsafe { pool.deallocate(p, 32 * MIB, &s) }.unwrap();
            }
            pool.trim(usize::MAX).unwrap(); // the frees are complete: every mapping may go
            let barrier = std::sync::Barrier::new(4);
            std::thread::scope(|scope| {
                let trimmer = scope.spawn(|| {
                    barrier.wait();
                    pool.trim(0)
                });
                let growers: Vec<_> = (0..3)
                    .map(|t| {
                        let (pool, barrier, dev) = (&pool, &barrier, &dev);
                        scope.spawn(move || {
                            let own = Stream::new(dev).unwrap();
                            barrier.wait();
                            // The trim has detached the free mappings by then, and unmaps them
                            // (20 ms each): these growths find the segment busy.
                            std::thread::sleep(std::time::Duration::from_millis(10));
                            for i in 0..6 {
                                let bytes = (3 + t + i) * MIB + 4096;
                                let p = pool.allocate(bytes, &own).unwrap();
                                // SAFETY: as above.
                                unsafe { pool.deallocate(p, bytes, &own) }.unwrap();
                            }
                            own.synchronize().unwrap();
                        })
                    })
                    .collect();
                for g in growers {
                    g.join().unwrap();
                }
                let trimmed = trimmer.join().unwrap();
                assert!(trimmed.is_err() || fake_faults_injected() == 0, "{trimmed:?}");
            });
            drop(s);
            cudrv::flush_deferred_drops().unwrap();
            // (Under load the growers may beat the trim to the free mappings: the fault then
            // comes here.)
            let first = pool.trim(0);
            assert_eq!(fake_faults_injected(), 1, "the first unmap failed: {first:?}");
            pool.trim(0).unwrap();
            pool.trim(0).unwrap();
            let st = pool.pool_stats();
            assert_eq!((st.reserved, st.chunks, st.live_allocations), (0, 0, 0), "{st:?}");
            assert_eq!(fake_report().live_allocations, 0, "{}", fake_report());
        });
    });
}

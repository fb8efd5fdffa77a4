//! Regression tests for the soundness review (issue 12): fault injection, delays that keep copies in
//! flight, threads racing drops, and host functions that drop buffers. Each test reproduces a path
//! by which safe code reached undefined behaviour, a leak or a deadlock, and checks the data.
//!
//! Every test body runs in a child process of this test binary (`run_with_fake`).

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudrv::launch::LaunchConfig;
use cudrv::memory::{
    DeviceBuffer, DeviceRepr, MemoryResource, PinnedBuffer, PoolConfig, StreamOrderedPool, SyncResource, register_host,
};
use cudrv::module::Module;
use cudrv::sys::CUresult;
use cudrv::{Device, Error, Event, Stream};
use cudrv_test_support::{
    assert_no_leaks, fake_report, full_fake_driver, legacy_fake_driver_path, run_with_fake, run_with_fake_modes,
};

use crate::driver_pool_refused;
use crate::graph_cases::release_everything;

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");
const MODES: [&str; 3] = ["linux", "wddm", "tcc"];

/// Ends the child process with a message if `body` has not finished within `limit`: a deadlock
/// must fail the test, not hang it.
pub(crate) fn within<R>(limit: Duration, what: &str, body: impl FnOnce() -> R) -> R {
    let (tx, rx) = mpsc::channel::<()>();
    let what = what.to_string();
    let watchdog = std::thread::spawn(move || {
        if rx.recv_timeout(limit) == Err(mpsc::RecvTimeoutError::Timeout) {
            eprintln!("deadlock: {what} did not finish within {limit:?}");
            std::process::exit(3);
        }
    });
    let r = body();
    let _ = tx.send(());
    let _ = watchdog.join();
    r
}

/// Defect 1: `copy_to_pinned_async` used to queue the copy and only then create the event that
/// tracks it. With event creation failing, it returned `Err` with the copy in flight and
/// untracked: `as_slice` read memory the device was still writing.
#[test]
fn pinned_copy_is_never_left_in_flight_untracked() {
    run_with_fake_modes(
        &MODES,
        &[("CUDRV_FAKE_FAIL", "cuEventCreate:1+:999"), ("CUDRV_FAKE_DELAY_US", "100000")],
        || {
            let dev = Device::get(0).unwrap();
            let stream = Stream::new(&dev).unwrap();
            let data: Vec<u32> = (0..4096).collect();
            let buf = DeviceBuffer::from_slice(&data, &stream).unwrap();
            let mut dst = PinnedBuffer::<u32>::new(&dev, data.len()).unwrap();
            let err = buf.copy_to_pinned_async(&mut dst).unwrap_err();
            assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_UNKNOWN), "{err}");
            let first = dst.as_slice().unwrap().to_vec();
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(dst.as_slice().unwrap(), first, "the memory changed behind a shared borrow");
            assert_eq!(first, vec![0; data.len()], "the failed call must not have queued the copy");

            // The other direction: nothing read from `src` after the call failed.
            let src = PinnedBuffer::from_slice(&dev, &[7u32; 4096]).unwrap();
            let mut target = DeviceBuffer::<u32>::zeroed(4096, &stream).unwrap();
            assert!(target.copy_from_pinned_async(&src).is_err());
            assert_eq!(target.to_vec().unwrap(), vec![0; 4096]);
        },
    );
}

/// Defect 1, second half: when recording the tracking event fails after the copy was queued, the
/// copy is tracked by its stream, the call succeeds, and host access waits for the data.
#[test]
fn pinned_copy_is_tracked_by_its_stream_when_recording_fails() {
    run_with_fake_modes(
        &MODES,
        &[("CUDRV_FAKE_FAIL", "cuEventRecord:1+:999"), ("CUDRV_FAKE_DELAY_US", "50000")],
        || {
            let dev = Device::get(0).unwrap();
            let stream = Stream::new(&dev).unwrap();
            let data: Vec<u32> = (0..4096).map(|i| i * 3).collect();
            let buf = DeviceBuffer::from_slice(&data, &stream).unwrap();
            let mut dst = PinnedBuffer::<u32>::new(&dev, data.len()).unwrap();
            buf.copy_to_pinned_async(&mut dst).unwrap();
            assert_eq!(dst.as_slice().unwrap(), data);
        },
    );
}

/// Defect 2: a synchronous copy used to return at once (with the kept error of another thread's
/// failed drop) while the copy into registered memory was still running.
#[test]
fn host_copies_wait_even_with_a_kept_drop_error() {
    run_with_fake_modes(
        &MODES,
        &[("CUDRV_FAKE_FAIL", "cuEventDestroy:1:999"), ("CUDRV_FAKE_DELAY_US", "100000")],
        || {
            let dev = Device::get(0).unwrap();
            let stream = Stream::new(&dev).unwrap();
            // Another thread's drop fails: the error is kept on the context.
            std::thread::spawn(move || drop(Event::new(&dev).unwrap())).join().unwrap();
            let data: Vec<u64> = (0..2048).map(|i| i * 7 + 1).collect();
            let buf = DeviceBuffer::from_slice(&data, &stream).unwrap();
            let mut host = vec![0u64; data.len()];
            {
                let mut reg = register_host(&dev, &mut host).unwrap();
                buf.copy_to_host(reg.as_mut_slice()).unwrap();
                let first = reg.as_mut_slice().to_vec();
                std::thread::sleep(Duration::from_millis(300));
                assert_eq!(reg.as_mut_slice(), first.as_slice(), "the copy wrote after the call returned");
                assert_eq!(first, data);
            }
            // The kept error is reported by the next synchronisation, after it waited, once, flat.
            let err = stream.synchronize().unwrap_err();
            let Error::Deferred(inner) = &err else { panic!("{err:?}") };
            assert!(matches!(**inner, Error::Driver { call: "cuEventDestroy", .. }), "{err:?}");
            stream.synchronize().unwrap();
        },
    );
}

/// Defect 4: a pinned buffer of a type aligned beyond a page got a misaligned slice.
#[test]
fn buffers_respect_the_alignment_of_their_type() {
    #[derive(Clone, Copy)]
    #[repr(C, align(8192))]
    struct Page([u8; 8192]);
    // SAFETY: one byte array, no padding (its size is its alignment); any bits are valid.
    unsafe impl DeviceRepr for Page {}
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([u32; 16]);
    // SAFETY: as above.
    unsafe impl DeviceRepr for Line {}

    run_with_fake_modes(&MODES, &[], || {
        let dev = Device::get(0).unwrap();
        let stream = Stream::new(&dev).unwrap();
        for len in [1, 3, 17] {
            let mut pinned = PinnedBuffer::<Page>::new(&dev, len).unwrap();
            let slice = pinned.as_mut_slice().unwrap();
            assert_eq!(slice.as_ptr() as usize % 8192, 0);
            slice[len - 1].0[8191] = 9;
            assert_eq!(pinned.as_slice().unwrap()[len - 1].0[8191], 9);
        }
        // Device memory is aligned to 256 bytes: more is refused, with a clear error.
        let err = DeviceBuffer::<Page>::zeroed(2, &stream).unwrap_err();
        assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("align")), "{err}");
        // Up to 256 it works, and views at any offset stay aligned for the type.
        let lines = DeviceBuffer::<Line>::zeroed(9, &stream).unwrap();
        for start in 0..9 {
            assert_eq!(lines.view(start..).unwrap().as_raw() % 64, 0);
        }
        assert_eq!(lines.to_vec().unwrap().len(), 9);
    });
}

/// Defect 5: `copy_to_peer` wrote `dst` on another stream without ordering that stream after
/// `dst`'s own. The pool had given `dst` the block of a buffer whose last copy was still queued on
/// that stream; the peer copy overwrote the data before the old copy read it.
fn copies_on_other_streams_wait_for_the_buffer_stream() {
    let dev = Device::get(0).unwrap();
    let (home, other) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let n = 4096;
    let old_data: Vec<u32> = (0..n as u32).collect();
    let src = DeviceBuffer::from_slice(&vec![0xFFFF_FFFF_u32; n], &other).unwrap();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    let mut saved = PinnedBuffer::<u32>::new(&dev, n).unwrap();

    // A peer copy (same device here) on `other` into a buffer of `home`.
    let old = DeviceBuffer::from_slice(&old_data, &home).unwrap();
    old.copy_to_pinned_async(&mut saved).unwrap(); // still queued (the fake delays every op)
    drop(old); // freed on `home`: the next allocation there may reuse the block at once
    // SAFETY: every element is written by the copy below before anything reads it.
    let mut dst = unsafe { DeviceBuffer::<u32>::uninit(n, &home) }.unwrap();
    src.copy_to_peer(&mut dst, &other).unwrap();
    let wrong = saved.as_slice().unwrap().iter().zip(&old_data).filter(|(a, b)| a != b).count();
    assert_eq!(wrong, 0, "the old buffer's queued copy saw the peer copy's data in {wrong} elements");
    other.synchronize().unwrap();
    home.wait_stream(&other).unwrap();
    assert!(dst.to_vec().unwrap().iter().all(|&v| v == 0xFFFF_FFFF));

    // A kernel on `other` that writes a buffer of `home`.
    let old = DeviceBuffer::from_slice(&old_data, &home).unwrap();
    old.copy_to_pinned_async(&mut saved).unwrap();
    drop(old);
    // SAFETY: every element is written by the kernel below before anything reads it.
    let mut dst = unsafe { DeviceBuffer::<u32>::uninit(n, &home) }.unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes dst[0..n].
    unsafe { fill.launch(LaunchConfig::for_num_elems(n), &other, (&mut dst, 5u32, n as u64)) }.unwrap();
    let wrong = saved.as_slice().unwrap().iter().zip(&old_data).filter(|(a, b)| a != b).count();
    assert_eq!(wrong, 0, "the old buffer's queued copy saw the kernel's data in {wrong} elements");
    other.synchronize().unwrap();
    home.wait_stream(&other).unwrap();
    assert!(dst.to_vec().unwrap().iter().all(|&v| v == 5));

    // A device-to-device copy on `home` reading a buffer of `other`.
    let mut target = DeviceBuffer::<u32>::zeroed(n, &home).unwrap();
    target.copy_from(&src).unwrap();
    assert!(target.to_vec().unwrap().iter().all(|&v| v == 0xFFFF_FFFF));
    assert!(fake_report().violations.is_empty());
}

#[test]
fn copies_on_other_streams_wait_for_the_buffer_stream_in_every_mode() {
    run_with_fake_modes(
        &MODES,
        &[("CUDRV_FAKE_DELAY_US", "20000")],
        copies_on_other_streams_wait_for_the_buffer_stream,
    );
    run_with_fake(
        &[("CUDRV_FAKE_DELAY_US", "20000"), ("CUDRV_MEMORY_RESOURCE", "pool")],
        copies_on_other_streams_wait_for_the_buffer_stream,
    );
}

/// Defect 6: after one failed drop, every later drop took the kept error, failed, leaked its
/// memory and kept a deeper-nested error.
#[test]
fn a_failed_drop_does_not_make_later_drops_leak() {
    for resource in ["driver-pool", "pool", "sync"] {
        let mode = if resource == "driver-pool" { "linux" } else { "tcc" };
        run_with_fake(
            &[
                ("CUDRV_FAKE_FAIL", "cuEventDestroy:1:999"),
                ("CUDRV_MEMORY_RESOURCE", resource),
                ("CUDRV_FAKE_MODE", mode),
            ],
            || {
                if driver_pool_refused(resource) {
                    return; // CUDA 11.1: no driver's pool (checked); the others still run
                }
                let dev = Device::get(0).unwrap();
                let stream = Stream::new(&dev).unwrap();
                drop(Event::new(&dev).unwrap()); // fails: kept on the context
                for i in 0..20u32 {
                    let mut buf = DeviceBuffer::<u32>::zeroed(1000 + i as usize * 512, &stream).unwrap();
                    buf.fill(i).unwrap();
                    drop(buf);
                }
                let err = stream.synchronize().unwrap_err();
                let Error::Deferred(inner) = &err else { panic!("{err:?}") };
                assert!(!matches!(**inner, Error::Deferred(_)), "nested: {err:?}");
                assert_eq!(inner.code(), Some(CUresult::CUDA_ERROR_UNKNOWN));
                stream.synchronize().unwrap();
                release_everything(&dev);
                drop(stream);
                assert_eq!(fake_report().live_allocations, 0, "drops leaked: {}", fake_report());
            },
        );
    }
}

/// Defect 7: a host function that drops a `DeviceBuffer` (the keep-alive pattern) used to block on
/// the pool's lock while `trim` held it through `cuEventSynchronize` of an event queued after the
/// host function: a deadlock. Drops inside host functions now hand their driver work to cudrv's
/// thread, and the pool never holds its lock across a blocking wait.
#[test]
fn host_functions_may_drop_buffers_while_the_pool_trims() {
    run_with_fake_modes(&MODES, &[("CUDRV_MEMORY_RESOURCE", "pool"), ("CUDRV_FAKE_DELAY_US", "2000")], || {
        within(Duration::from_secs(30), "trim against a host function dropping a buffer", || {
            let dev = Device::get(0).unwrap();
            let pool = dev.memory_resource().unwrap();
            let stream = Stream::new(&dev).unwrap();
            for round in 0..5 {
                let kept = DeviceBuffer::<u8>::zeroed(3 << 20, &stream).unwrap();
                let freed = DeviceBuffer::<u8>::zeroed(5 << 20, &stream).unwrap();
                stream.launch_host_fn(move || drop(kept)).unwrap();
                drop(freed); // a free after the host function: trimming waits for it
                pool.trim(0).unwrap();
                let again = DeviceBuffer::<u8>::zeroed(1 << 20, &stream).unwrap();
                assert_eq!(again.to_vec().unwrap(), vec![0; 1 << 20], "round {round}");
            }
            stream.synchronize().unwrap();
            release_everything(&dev);
            assert_eq!(fake_report().live_allocations, 0, "{}", fake_report());
        });
    });
}

/// The keep-alive pattern with every resource, and with pinned memory, streams, events and
/// modules dropped inside host functions: nothing leaks, nothing is used after free, and calls
/// that need the driver are refused inside the host function.
#[test]
fn host_functions_may_drop_every_cudrv_object() {
    for resource in ["driver-pool", "pool", "sync"] {
        run_with_fake(&[("CUDRV_MEMORY_RESOURCE", resource), ("CUDRV_FAKE_DELAY_US", "1000")], || {
            if driver_pool_refused(resource) {
                return; // as above
            }
            let dev = Device::get(0).unwrap();
            let stream = Stream::new(&dev).unwrap();
            let module = Module::from_ptx(&dev, PTX).unwrap();
            let fill = module.function("fill_u32").unwrap();
            let (tx, rx) = mpsc::channel();
            for i in 0..10u32 {
                let mut buf = DeviceBuffer::<u32>::zeroed(4096, &stream).unwrap();
                // SAFETY: fill_u32(u32*, u32, u64) writes buf[0..4096].
                unsafe { fill.launch(LaunchConfig::for_num_elems(4096), &stream, (&mut buf, i, 4096u64)) }.unwrap();
                let pinned = PinnedBuffer::<u32>::new(&dev, 16).unwrap();
                let side = Stream::new(&dev).unwrap();
                let event = Event::new(&dev).unwrap();
                let (module, tx, dev2) = (module.clone(), tx.clone(), dev);
                stream
                    .launch_host_fn(move || {
                        // Needs the driver: refused, nothing done.
                        let refused = Stream::new(&dev2).map(drop);
                        let _ = tx.send(refused);
                        drop((buf, pinned, side, event, module));
                    })
                    .unwrap();
            }
            drop(module);
            drop(fill);
            stream.synchronize().unwrap();
            cudrv::flush_deferred_drops().unwrap();
            for _ in 0..10 {
                let refused = rx.recv().unwrap();
                assert!(matches!(refused, Err(Error::InHostFunction { .. })), "{refused:?}");
            }
            release_everything(&dev);
            drop(stream);
            assert_no_leaks();
        });
    }
}

/// Defect 8: `Event::elapsed` called only `cuEventElapsedTime_v2` (CUDA 12.8), and `Device::uuid`
/// only `cuDeviceGetUuid_v2` (11.4): older drivers got `MissingSymbol`.
#[test]
fn versioned_entry_points_fall_back_on_older_drivers() {
    fn uuid_and_timing() {
        let dev = Device::get(0).unwrap();
        assert!(dev.uuid_string().unwrap().starts_with("GPU-"));
        let stream = Stream::new(&dev).unwrap();
        let timed = || Event::with_flags(&dev, cudrv::EventFlags::timing()).unwrap();
        let (a, b) = (timed(), timed());
        a.record(&stream).unwrap();
        b.record(&stream).unwrap();
        b.synchronize().unwrap();
        Event::elapsed(&a, &b).unwrap();
    }
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_DRIVER_VERSION", "12040")], uuid_and_timing);
    let legacy = legacy_fake_driver_path().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &legacy)], uuid_and_timing);
}

/// Out of memory from `SyncResource` names the resource (it used to say "reserved by the pool").
#[test]
fn out_of_memory_names_the_resource() {
    run_with_fake(&[("CUDRV_FAKE_MEMORY", "67108864")], || {
        let dev = Device::get(0).unwrap();
        let stream = Stream::new(&dev).unwrap();
        let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
        let err = DeviceBuffer::<u8>::zeroed_in(1 << 30, &stream, sync).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { resource: "SyncResource", .. }), "{err:?}");
        assert!(!err.to_string().contains("pool"), "{err}");
        let pool: Arc<dyn MemoryResource> =
            Arc::new(StreamOrderedPool::with_config(&dev, PoolConfig::default()).unwrap());
        let err = DeviceBuffer::<u8>::zeroed_in(1 << 30, &stream, pool).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { resource: "StreamOrderedPool", .. }), "{err:?}");
    });
}

/// An empty or blank `CUDRV_MEMORY_RESOURCE` means no override, as an empty `CUDRV_DRIVER_PATH`.
#[test]
fn empty_environment_variables_mean_unset() {
    for value in ["", "  "] {
        run_with_fake(&[("CUDRV_MEMORY_RESOURCE", value), ("CUDRV_FAKE_MODE", "tcc")], || {
            let (_, choice) = Device::get(0).unwrap().memory_resource_choice().unwrap();
            assert_eq!(choice.kind, cudrv::memory::ResourceKind::StreamOrderedPool, "{}", choice.reason);
        });
    }
}

/// `LaunchConfig`'s products saturate instead of overflowing.
#[test]
fn launch_config_products_saturate() {
    let cfg =
        LaunchConfig { grid: (u32::MAX, u32::MAX, u32::MAX), block: (u32::MAX, 2, u32::MAX), shared_mem_bytes: 0 };
    assert_eq!(cfg.blocks(), u64::MAX);
    assert_eq!(cfg.threads_per_block(), u64::MAX);
    assert_eq!(LaunchConfig::linear(3, 4).blocks(), 3);
}

/// cudrv makes the context it needs current, and then restores the one that was current before
/// (another device's, as the CUDA runtime would have set it).
#[test]
fn binding_restores_the_previous_context() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "2")], || {
        let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
        let (c0, c1) = (d0.primary_context().unwrap(), d1.primary_context().unwrap());
        let driver = cudrv::sys::Driver::global().unwrap();
        let current = || {
            let mut ctx = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { driver.cuCtxGetCurrent(&mut ctx) }.unwrap(), CUresult::CUDA_SUCCESS);
            ctx
        };
        // SAFETY: a retained primary context.
        assert_eq!(unsafe { driver.cuCtxSetCurrent(c1.as_raw()) }.unwrap(), CUresult::CUDA_SUCCESS);
        let stream = Stream::new(&d0).unwrap();
        let buf = DeviceBuffer::from_slice(&[1u8, 2, 3], &stream).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [1, 2, 3]);
        assert_eq!(current(), c1.as_raw(), "device 1's context must be current again");
        {
            let _bound = c0.bind().unwrap();
            assert_eq!(current(), c0.as_raw());
        }
        assert_eq!(current(), c1.as_raw());
        // With no context current, cudrv's stays current (documented: nothing to restore).
        // SAFETY: null makes no context current.
        assert_eq!(unsafe { driver.cuCtxSetCurrent(std::ptr::null_mut()) }.unwrap(), CUresult::CUDA_SUCCESS);
        drop(c0.bind().unwrap());
        assert_eq!(current(), c0.as_raw());
    });
}

/// Waiting for memory never returns early: with the wait failing (for an event recorded on the
/// stream), a synchronous copy still returns only once the copy is done (it asks the event).
#[test]
fn a_failing_synchronize_does_not_cut_a_copy_short() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuEventSynchronize:1+:999"), ("CUDRV_FAKE_DELAY_US", "100000")], || {
        let dev = Device::get(0).unwrap();
        let stream = Stream::new(&dev).unwrap();
        let mut buf = DeviceBuffer::<u16>::zeroed(1024, &stream).unwrap();
        let data: Vec<u16> = (0..1024).collect();
        let mut host = vec![0u16; 1024];
        let mut reg = register_host(&dev, &mut host).unwrap();
        reg.as_mut_slice().copy_from_slice(&data);
        let started = Instant::now();
        let err = buf.copy_from_host(reg.as_mut_slice()).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_UNKNOWN));
        assert!(started.elapsed() >= Duration::from_millis(90), "returned before the copy ran");
        reg.as_mut_slice().fill(0); // the copy is done: changing the source cannot affect it
        drop(reg);
        let mut back = vec![0u16; 1024];
        let _ = buf.copy_to_host(&mut back);
        assert_eq!(back, data);
    });
}

/// Defect 3: `Stream::per_thread` was one value for every thread, but `CU_STREAM_PER_THREAD` is a
/// different stream on each. The pool handed a block freed on thread A's per-thread stream to
/// thread B's with no ordering, and a buffer dropped on another thread was freed on the wrong
/// stream. Now each thread's per-thread stream is its own identity, and work for it from another
/// thread goes through the legacy stream, which is ordered with every per-thread stream.
#[test]
fn per_thread_streams_are_one_identity_per_thread() {
    run_with_fake_modes(&["tcc", "linux"], &[("CUDRV_FAKE_DELAY_US", "1000")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let spin = module.function("spin_fill_u32").unwrap();
        let n = 4096;
        // Thread A: a buffer on its per-thread stream, written by a slow kernel there.
        let (buf, a_id) = std::thread::spawn({
            let spin = spin.clone();
            move || {
                let a = Stream::per_thread(&dev).unwrap();
                assert_eq!(a.id(), Stream::per_thread(&dev).unwrap().id(), "one identity per thread");
                let mut buf = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
                // SAFETY: spin_fill_u32(u32*, u32, u64, u64) spins 100 ms, then writes buf[0..n].
                unsafe {
                    spin.launch(LaunchConfig::for_num_elems(n), &a, (&mut buf, 0xBAD0_BAD0u32, n as u64, 100_000u64))
                }
                .unwrap();
                (buf, a.id())
            }
        })
        .join()
        .unwrap();
        // Thread B: drops A's buffer (freed after A's kernel), then allocates on its own
        // per-thread stream: the block may be A's, but only after the kernel is done.
        std::thread::spawn(move || {
            let b = Stream::per_thread(&dev).unwrap();
            assert_ne!(b.id(), a_id);
            drop(buf);
            let mut mine = DeviceBuffer::<u32>::zeroed(n, &b).unwrap();
            mine.fill(7).unwrap();
            std::thread::sleep(Duration::from_millis(250));
            let wrong = mine.to_vec().unwrap().iter().filter(|&&v| v != 7).count();
            assert_eq!(wrong, 0, "thread A's late kernel wrote into thread B's buffer");
        })
        .join()
        .unwrap();
        assert!(fake_report().violations.is_empty(), "{}", fake_report());
    });
}

//! Loader, errors, devices, capabilities, contexts, streams and events, on the fake driver.
//!
//! Every test body runs in a child process of this test binary (`run_with_fake`), because the
//! driver is loaded once per process and the fake reads its configuration from the environment:
//! tests never set environment variables in this process, so they cannot race.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudrv::memory::{DeviceBuffer, ResourceKind};
use cudrv::sys::{CUresult, Driver};
use cudrv::{Device, DriverModel, Error, Event, EventFlags, Stream};
use cudrv_test_support::{
    assert_no_leaks, fake_driver_path, fake_driver_version, fake_report, fake_shutdown, legacy_fake_driver_path,
    run_with_fake, run_with_fake_modes,
};

use crate::{oldest, pool_kind};

#[test]
fn no_driver_lists_every_path_tried() {
    // An empty CUDRV_DRIVER_PATH means "not set": the usual candidates are tried.
    run_with_fake(&[("CUDRV_DRIVER_PATH", "")], || match Device::count() {
        Ok(_) => eprintln!("a real CUDA driver is installed here; the no-driver case cannot be observed"),
        Err(Error::DriverNotFound { attempts }) => {
            let paths: Vec<&str> = attempts.iter().map(|a| a.path.as_str()).collect();
            let expected: Vec<String> = Driver::candidates().iter().map(|p| p.display().to_string()).collect();
            assert_eq!(paths, expected);
            assert!(attempts.iter().all(|a| !a.reason.is_empty()));
            let text = Error::DriverNotFound { attempts }.to_string();
            assert!(text.contains("CUDRV_DRIVER_PATH"), "{text}");
        }
        Err(e) => panic!("expected DriverNotFound, got {e}"),
    });
}

#[test]
fn driver_path_to_a_missing_file() {
    run_with_fake(&[("CUDRV_DRIVER_PATH", "/nonexistent/dir/libcuda.so.1")], || {
        let Err(Error::DriverNotFound { attempts }) = Device::count() else { panic!("expected DriverNotFound") };
        assert_eq!(attempts.len(), 1);
        assert_eq!(attempts[0].path, "/nonexistent/dir/libcuda.so.1");
        assert!(!attempts[0].reason.is_empty());
        // The failure is kept: a second call says the same, without a panic.
        assert!(matches!(cudrv::driver_version(), Err(Error::DriverNotFound { .. })));
    });
}

#[test]
fn driver_path_to_a_file_that_is_not_a_library() {
    let file = std::env::temp_dir().join(format!("cudrv-not-a-library-{}.so", std::process::id()));
    std::fs::write(&file, b"this is not a shared library").unwrap();
    let path = file.to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &path)], || {
        let err = Device::count().unwrap_err();
        let Error::DriverNotFound { attempts } = &err else { panic!("expected DriverNotFound, got {err}") };
        assert_eq!(attempts.len(), 1);
        assert!(err.to_string().contains("cudrv-not-a-library"), "{err}");
    });
    let _ = std::fs::remove_file(file);
}

#[test]
fn driver_path_to_a_library_that_is_not_a_driver() {
    // A library that is not a CUDA driver: the C library, or kernel32.dll on Windows.
    let candidates: &[&str] = if cfg!(windows) {
        &[r"C:\Windows\System32\kernel32.dll"]
    } else {
        &["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6"]
    };
    let Some(libc) = candidates.iter().copied().find(|p| std::path::Path::new(p).exists()) else { return };
    run_with_fake(&[("CUDRV_DRIVER_PATH", libc)], || {
        let err = Device::count().unwrap_err();
        assert!(err.to_string().contains("not a CUDA driver"), "{err}");
    });
}

#[test]
fn symbols_resolve_lazily_through_get_proc_address() {
    run_with_fake(&[], || {
        let d = Driver::global().unwrap();
        // CUDA 11.1 has no cuGetProcAddress (11.3) and no cuMemAllocAsync (11.2): its functions
        // resolve by their exported names.
        assert_eq!(d.has_get_proc_address(), !oldest());
        assert_eq!(d.version(), fake_driver_version());
        assert!(d.has("cuMemAlloc_v2"));
        assert_eq!(d.has("cuMemAllocAsync"), !oldest());
        // A function the fake does not implement is a typed error, not a panic.
        // SAFETY: never called through: the symbol is missing.
        let missing = unsafe { d.cuGraphDebugDotPrint(std::ptr::null_mut(), std::ptr::null(), 0) };
        let err = missing.unwrap_err();
        assert_eq!(err.name, "cuGraphDebugDotPrint");
        assert_eq!(err.driver_version, fake_driver_version());
        // The second call costs one atomic load and says the same.
        // SAFETY: as above.
        assert_eq!(unsafe { d.cuGraphDebugDotPrint(std::ptr::null_mut(), std::ptr::null(), 0) }.unwrap_err(), err);
    });
}

#[test]
fn old_driver_without_get_proc_address_and_pools() {
    let legacy = legacy_fake_driver_path().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &legacy), ("CUDRV_FAKE_DRIVER_VERSION", "11010")], || {
        let d = Driver::global().unwrap();
        assert!(!d.has_get_proc_address());
        assert_eq!(d.version(), 11010);
        // Exported symbols still resolve by name.
        assert!(d.has("cuMemAlloc_v2"));
        assert!(!d.has("cuMemAllocAsync"));
        // SAFETY: never called through: the symbol is missing.
        let err = unsafe { d.cuMemFreeAsync(0, std::ptr::null_mut()) }.unwrap_err();
        let err: Error = err.into();
        assert_eq!(err.to_string(), "the CUDA driver (version 11.1) does not provide cuMemFreeAsync");

        let dev = Device::get(0).unwrap();
        let caps = dev.capabilities().unwrap();
        assert!(!caps.memory_pools);
        assert!(!caps.cluster_launch);
        let pool = cudrv::memory::DriverPool::default_pool(&dev).unwrap_err();
        assert!(matches!(pool, Error::Unsupported { feature: "memory pools", device: 0, .. }), "{pool}");
        let choice = cudrv::memory::choose(&dev).unwrap();
        assert_eq!(choice.kind, ResourceKind::StreamOrderedPool);
        assert!(choice.reason.contains("predates memory pools"), "{}", choice.reason);
        // Memory still works, through the fallback.
        let stream = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[5u32, 6, 7], &stream).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [5, 6, 7]);
    });
}

#[test]
fn error_messages_read_well() {
    run_with_fake(&[], || {
        // With the driver loaded, names and descriptions come from cuGetErrorName/String.
        Device::count().unwrap();
        let e = Error::driver("cuMemAllocAsync", CUresult::CUDA_ERROR_NOT_SUPPORTED);
        assert_eq!(e.to_string(), "cuMemAllocAsync failed: CUDA_ERROR_NOT_SUPPORTED (801): operation not supported");
        let e = Error::driver("cuMemAlloc_v2", CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(e.to_string(), "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory");
        let bad = Device::get(7).unwrap_err();
        assert_eq!(bad.code(), Some(CUresult::CUDA_ERROR_INVALID_DEVICE));
        assert!(bad.to_string().starts_with("cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE (101)"), "{bad}");
    });
    // Without a driver, cudrv's own table names the code.
    let e = Error::driver("cuInit", CUresult(999_999));
    assert_eq!(
        e.to_string(),
        "cuInit failed: unknown CUresult (999999): no description available (the driver could not be asked)"
    );
    let e = Error::OutOfMemory { requested: 10, device: 1, resource: "SyncResource", reserved: 20, in_use: 5 };
    assert_eq!(
        e.to_string(),
        "out of device memory on device 1: 10 bytes requested from SyncResource, which holds 20 bytes, 5 of them in use"
    );
    let e = Error::Unsupported {
        feature: "memory pools",
        device: 0,
        reason: "TCC".into(),
        alternative: Some("StreamOrderedPool"),
    };
    assert_eq!(e.to_string(), "not supported on device 0: memory pools: TCC; use StreamOrderedPool instead");
}

#[test]
fn driver_models_and_capabilities_per_mode() {
    for (mode, expected) in [
        ("linux", if cfg!(windows) { DriverModel::Wddm } else { DriverModel::Linux }),
        ("wddm", if cfg!(windows) { DriverModel::Wddm } else { DriverModel::Linux }),
        ("tcc", DriverModel::Tcc),
    ] {
        run_with_fake(&[("CUDRV_FAKE_MODE", mode)], || {
            let dev = Device::get(0).unwrap();
            assert_eq!(dev.driver_model().unwrap(), expected);
            let caps = dev.capabilities().unwrap();
            assert_eq!(caps.driver_model, expected);
            // CUDA 11.1 predates memory pools (11.2) and cuLaunchKernelEx, so clusters (11.8).
            let pools = mode != "tcc" && !oldest();
            assert_eq!(caps.memory_pools, pools);
            assert_eq!(caps.concurrent_managed_access, mode == "linux");
            assert_eq!(caps.compute_capability, (9, 0));
            assert_eq!(caps.cluster_launch, !oldest());
            assert!(caps.cooperative_launch && caps.unified_addressing);
            assert_eq!(caps.stream_priority_range, (0, -5));
            assert_eq!(caps.memory_pool_handle_types == 0, mode == "tcc");
            // Cached: the same object every time.
            assert!(std::ptr::eq(caps, dev.capabilities().unwrap()));
            let report = caps.to_string();
            assert!(report.contains(&format!("memory pools                {}", if pools { "yes" } else { "no" })));
            assert!(dev.name().unwrap().contains(mode));
            assert_eq!(dev.compute_capability().unwrap(), (9, 0));
            assert!(dev.total_memory().unwrap() > 0);
            assert!(dev.uuid_string().unwrap().starts_with("GPU-"));
            assert!(!dev.pci_bus_id().unwrap().is_empty());
        });
    }
}

#[test]
fn mixed_devices_are_checked_one_by_one() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "wddm,tcc")], || {
        let devices = Device::all().unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].capabilities().unwrap().memory_pools, !oldest());
        assert!(!devices[1].capabilities().unwrap().memory_pools);
        assert_eq!(devices[1].driver_model().unwrap(), DriverModel::Tcc);
        assert_eq!(cudrv::memory::choose(&devices[0]).unwrap().kind, pool_kind(&devices[0]));
        assert_eq!(cudrv::memory::choose(&devices[1]).unwrap().kind, ResourceKind::StreamOrderedPool);
        assert_ne!(devices[0].uuid().unwrap(), devices[1].uuid().unwrap());
    });
}

#[test]
fn primary_context_is_shared_and_released() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let a = dev.primary_context().unwrap();
        let b = dev.primary_context().unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        a.synchronize().unwrap();
        drop((a, b));
        let c = dev.primary_context().unwrap();
        c.bind().unwrap();
        c.bind().unwrap();
    });
}

#[test]
fn stream_priorities_are_validated() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        Stream::with_priority(&dev, -5).unwrap();
        Stream::with_priority(&dev, 0).unwrap();
        let err = Stream::with_priority(&dev, -6).unwrap_err();
        assert_eq!(err, Error::InvalidPriority { requested: -6, device: 0, least: 0, greatest: -5 });
        assert!(matches!(Stream::with_priority(&dev, 1), Err(Error::InvalidPriority { requested: 1, .. })));
    });
}

#[test]
fn wait_event_orders_streams() {
    run_with_fake_modes(&["linux", "tcc"], &[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let mut src = DeviceBuffer::<u32>::zeroed(1024, &a).unwrap();
        src.fill(0xA5A5_A5A5).unwrap(); // queued behind delays on A
        let done = Event::new(&dev).unwrap();
        done.record(&a).unwrap();
        b.wait_event(&done).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(1024, &b).unwrap();
        dst.copy_from(&src).unwrap(); // on B, after A's fill
        assert!(dst.to_vec().unwrap().iter().all(|&v| v == 0xA5A5_A5A5));
        // wait_stream does the same with an event of its own.
        let mut src2 = DeviceBuffer::<u32>::zeroed(64, &a).unwrap();
        src2.fill(7).unwrap();
        b.wait_stream(&a).unwrap();
        let mut dst2 = DeviceBuffer::<u32>::zeroed(64, &b).unwrap();
        dst2.copy_from(&src2).unwrap();
        assert_eq!(dst2.to_vec().unwrap(), vec![7; 64]);
        assert!(fake_report().violations.is_empty());
    });
}

#[test]
fn queries_see_pending_work() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "50000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut buf = DeviceBuffer::<u8>::zeroed(16, &s).unwrap();
        // The stream's work waits for this host function until the queries are made: pending
        // however long this thread takes.
        let (release, held) = std::sync::mpsc::channel::<()>();
        s.launch_host_fn(move || {
            let _ = held.recv();
        })
        .unwrap();
        buf.memset(1).unwrap();
        let ev = Event::new(&dev).unwrap();
        ev.record(&s).unwrap();
        assert!(!s.query().unwrap());
        assert!(!ev.query().unwrap());
        release.send(()).unwrap();
        ev.synchronize().unwrap();
        assert!(ev.query().unwrap());
        s.synchronize().unwrap();
        assert!(s.query().unwrap());
    });
}

#[test]
fn host_functions_run_in_order_and_are_freed() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "5000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..5 {
            let log = log.clone();
            s.launch_host_fn(move || log.lock().unwrap().push(i)).unwrap();
        }
        s.synchronize().unwrap();
        assert_eq!(*log.lock().unwrap(), [0, 1, 2, 3, 4]);
        // Every boxed closure was run and dropped: only our handle is left.
        assert_eq!(Arc::strong_count(&log), 1);
        // A panicking host function does not unwind into the driver.
        s.launch_host_fn(|| panic!("host function panic (expected in this test)")).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        s.launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        s.synchronize().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn failed_host_function_launch_frees_the_closure() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuLaunchHostFunc:1:1")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let token = Arc::new(());
        let t = token.clone();
        let err = s.launch_host_fn(move || drop(t)).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE));
        assert_eq!(Arc::strong_count(&token), 1);
    });
}

#[test]
fn event_timing() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "30000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let start = Event::with_flags(&dev, EventFlags::timing()).unwrap();
        let end = Event::with_flags(&dev, EventFlags::timing()).unwrap();
        start.record(&s).unwrap();
        let mut buf = DeviceBuffer::<u8>::zeroed(16, &s).unwrap();
        buf.memset(3).unwrap();
        end.record(&s).unwrap();
        end.synchronize().unwrap();
        let t = Event::elapsed(&start, &end).unwrap();
        assert!(t >= Duration::from_millis(25), "{t:?}");
        let plain = Event::new(&dev).unwrap();
        plain.record(&s).unwrap();
        assert_eq!(Event::elapsed(&start, &plain).unwrap_err(), Error::TimingDisabled);
    });
}

#[test]
fn drop_after_driver_shutdown_does_nothing() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ev = Event::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[1u8, 2, 3], &s).unwrap();
        let ctx = dev.primary_context().unwrap();
        fake_shutdown();
        let err = s.synchronize().unwrap_err();
        assert!(err.is_deinitialized(), "{err}");
        drop(buf);
        drop(ev);
        drop(s);
        // Nothing was kept as an error for later: a shut-down driver is not a drop failure.
        assert!(ctx.take_deferred().is_ok());
    });
}

#[test]
fn errors_in_drop_are_kept_for_the_next_call() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuStreamDestroy_v2:1:999")], || {
        let dev = Device::get(0).unwrap();
        let keep = Stream::new(&dev).unwrap();
        drop(Stream::new(&dev).unwrap());
        let err = keep.synchronize().unwrap_err();
        let Error::Deferred(inner) = &err else { panic!("expected a deferred error, got {err}") };
        assert_eq!(inner.code(), Some(CUresult::CUDA_ERROR_UNKNOWN));
        assert!(err.to_string().starts_with("an earlier drop failed: cuStreamDestroy failed"), "{err}");
        // Returned once, then gone.
        keep.synchronize().unwrap();
    });
}

#[test]
fn foreign_streams_are_borrowed_not_owned() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let owner = Stream::new(&dev).unwrap();
        // SAFETY: `owner` outlives the borrowed stream and everything that uses it.
        let borrowed = unsafe { Stream::from_raw(&dev, owner.as_raw()) }.unwrap();
        borrowed.synchronize().unwrap();
        drop(borrowed);
        owner.synchronize().unwrap(); // still valid: the borrow did not destroy it
        let legacy = Stream::legacy(&dev).unwrap();
        legacy.synchronize().unwrap();
        Stream::per_thread(&dev).unwrap().synchronize().unwrap();
    });
}

#[test]
fn no_leaks_after_core_objects_drop() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        {
            let s = Stream::new(&dev).unwrap();
            let e = Event::new(&dev).unwrap();
            e.record(&s).unwrap();
            s.wait_event(&e).unwrap();
            s.synchronize().unwrap();
        }
        let report = fake_report();
        assert_eq!(report.live_streams, 0, "{report}");
        assert_eq!(report.live_events, 0, "{report}");
        assert_no_leaks();
    });
}

#[test]
fn fake_library_is_built() {
    assert!(fake_driver_path().exists(), "{}", fake_driver_path().display());
}

//! Devices, capabilities, contexts, streams and events on a real GPU (`--features gpu`).
//!
//! Run natively, and through the TCC interposer with `CUDRV_DRIVER_PATH=<libcudrv_tcc.so>` and
//! `CUDRV_EXPECT_DRIVER_MODEL=tcc` (see the README, "Testing on a GPU").

use std::sync::{Arc, Mutex};

use cudrv::memory::DeviceBuffer;
use cudrv::{Device, DriverModel, Error, Event, EventFlags, Stream};

fn device() -> Device {
    Device::get(0).expect("a CUDA device (these tests need a GPU)")
}

#[test]
fn devices_and_capabilities() {
    let all = Device::all().unwrap();
    assert!(!all.is_empty());
    for dev in &all {
        let caps = dev.capabilities().unwrap();
        println!("device {}: {}\n{caps}", dev.ordinal(), dev.name().unwrap());
        assert!(!dev.name().unwrap().is_empty());
        assert!(dev.total_memory().unwrap() > 1 << 30);
        assert!(dev.multiprocessor_count().unwrap() > 0);
        assert!(caps.compute_capability.0 >= 5);
        assert!(caps.stream_priority_range.1 <= caps.stream_priority_range.0);
        assert!(dev.uuid_string().unwrap().starts_with("GPU-"));
        assert_eq!(caps.cluster_launch, caps.compute_capability.0 >= 9);
    }
    let dev = device();
    match std::env::var("CUDRV_EXPECT_DRIVER_MODEL").as_deref() {
        Ok("tcc") => {
            assert_eq!(dev.driver_model().unwrap(), DriverModel::Tcc);
            assert!(!dev.capabilities().unwrap().memory_pools);
        }
        Ok("linux") | Err(_) if !cfg!(windows) => assert_eq!(dev.driver_model().unwrap(), DriverModel::Linux),
        _ => {}
    }
    assert!(cudrv::driver_version().unwrap() >= 11000);
}

#[test]
fn priorities_are_validated() {
    let dev = device();
    let (least, greatest) = dev.capabilities().unwrap().stream_priority_range;
    Stream::with_priority(&dev, greatest).unwrap();
    Stream::with_priority(&dev, least).unwrap();
    assert!(matches!(Stream::with_priority(&dev, greatest - 1), Err(Error::InvalidPriority { .. })));
    assert!(matches!(Stream::with_priority(&dev, least + 1), Err(Error::InvalidPriority { .. })));
}

#[test]
fn wait_event_orders_two_streams() {
    let dev = device();
    let a = Stream::new(&dev).unwrap();
    let b = Stream::new(&dev).unwrap();
    let n = 256 << 20; // 1 GiB of u32: long enough that a missing wait would show
    for round in 0..3u32 {
        let mut src = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
        for v in 1..=4 {
            src.fill(v * 0x0101_0101 + round).unwrap();
        }
        let done = Event::new(&dev).unwrap();
        done.record(&a).unwrap();
        b.wait_event(&done).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(n, &b).unwrap();
        dst.copy_from(&src).unwrap();
        let expect = 4 * 0x0101_0101 + round;
        let view = dst.view(n - 1024..).unwrap().to_vec().unwrap();
        assert!(view.iter().all(|&v| v == expect), "round {round}: B did not wait for A");
        assert!(dst.view(..1024).unwrap().to_vec().unwrap().iter().all(|&v| v == expect));
    }
}

#[test]
fn host_functions_run_in_order() {
    let dev = device();
    let s = Stream::new(&dev).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut buf = DeviceBuffer::<u8>::zeroed(64 << 20, &s).unwrap();
    for i in 0..8 {
        buf.memset(i as u8).unwrap();
        let log = log.clone();
        s.launch_host_fn(move || log.lock().unwrap().push(i)).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(*log.lock().unwrap(), (0..8).collect::<Vec<_>>());
    assert_eq!(Arc::strong_count(&log), 1);
}

#[test]
fn event_timing_and_queries() {
    let dev = device();
    let s = Stream::new(&dev).unwrap();
    let start = Event::with_flags(&dev, EventFlags::timing()).unwrap();
    let end = Event::with_flags(&dev, EventFlags::timing()).unwrap();
    let mut buf = DeviceBuffer::<u8>::zeroed(1 << 30, &s).unwrap();
    start.record(&s).unwrap();
    for i in 0..4 {
        buf.memset(i).unwrap();
    }
    end.record(&s).unwrap();
    end.synchronize().unwrap();
    assert!(end.query().unwrap() && s.query().unwrap());
    let t = Event::elapsed(&start, &end).unwrap();
    assert!(t.as_nanos() > 0 && t.as_secs() < 5, "{t:?}");
    println!("4 GiB of memset took {t:?}");
    let plain = Event::new(&dev).unwrap();
    plain.record(&s).unwrap();
    assert_eq!(Event::elapsed(&start, &plain).unwrap_err(), Error::TimingDisabled);
}

#[test]
fn contexts_are_shared_and_streams_borrowed() {
    let dev = device();
    let a = dev.primary_context().unwrap();
    let b = dev.primary_context().unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    a.synchronize().unwrap();
    let owner = Stream::new(&dev).unwrap();
    // SAFETY: `owner` outlives the borrowed stream.
    let borrowed = unsafe { Stream::from_raw(&dev, owner.as_raw()) }.unwrap();
    drop(borrowed);
    owner.synchronize().unwrap();
    Stream::legacy(&dev).unwrap().synchronize().unwrap();
    Stream::per_thread(&dev).unwrap().synchronize().unwrap();
}

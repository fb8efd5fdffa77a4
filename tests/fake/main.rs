//! The tests that run without a GPU, against cudrv's emulated driver (`cudrv-test-support`): one
//! binary, a module per area. Each body runs in a child process of this binary
//! (`run_with_fake`), configured through its environment.

mod api;
mod basics;
mod faults;
mod graph;
#[path = "../graph_cases/mod.rs"]
mod graph_cases;
mod interposer;
mod launch;
mod memory;
mod review2;
mod review_fixes_a;
mod review_graph;
mod slowed;
mod soundness;
mod stream_life;

use std::fmt::Debug;
use std::sync::Arc;

use cudrv::memory::{DeviceBuffer, ResourceKind, SyncResource};
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{LEGACY_DRIVER_VERSION, fake_driver_version, in_fake_child, testing_oldest_driver};

pub use graph_cases::within_10s;

/// Runs `body` while another thread captures, in `mode`, a fill of a buffer of its own on its
/// per-thread stream (a blocking stream: the legacy stream then refuses work) or on a new
/// stream. Then that thread ends the capture, launches the graph and reads the buffer back.
/// Returns `body`'s result, and the other thread's `end_capture` (an error where something
/// invalidated the capture; on success the graph ran and wrote the buffer, checked).
pub fn while_another_thread_captures<R>(
    mode: cudrv::graph::CaptureMode,
    per_thread: bool,
    body: impl FnOnce() -> R,
) -> (R, cudrv::Result<()>) {
    std::thread::scope(|t| {
        let (began_tx, began_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let capturer = t.spawn(move || {
            let dev = Device::get(0).unwrap();
            let s = if per_thread { Stream::per_thread(&dev) } else { Stream::new(&dev) }.unwrap();
            let mut x = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
            s.synchronize().unwrap();
            s.begin_capture(mode).unwrap();
            x.fill(3).unwrap();
            began_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            let graph = s.end_capture()?;
            graph.instantiate().unwrap().launch(&s).unwrap();
            s.synchronize().unwrap();
            assert_eq!(x.to_vec().unwrap(), vec![3; 64], "the other thread's graph");
            Ok(())
        });
        began_rx.recv().unwrap();
        let r = body();
        go_tx.send(()).unwrap();
        (r, capturer.join().unwrap())
    })
}

/// The message of an [`Error::InvalidArgument`]; panics on any other error.
pub fn invalid_argument(e: Error) -> String {
    match e {
        Error::InvalidArgument(msg) => msg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// The kernel and reason of an [`Error::InvalidLaunch`]; panics on any other error.
pub fn invalid_launch(e: Error) -> String {
    match e {
        Error::InvalidLaunch { kernel, reason } => format!("launch of `{kernel}`: {reason}"),
        other => panic!("expected InvalidLaunch, got {other:?}"),
    }
}
mod capture_race;
mod capture_review;

/// No allocation is left (the test's streams, and the events cudrv keeps per context to order
/// streams, may still live).
pub fn assert_no_leaks_but_streams() {
    let r = cudrv_test_support::fake_report();
    assert_eq!(r.live_allocations, 0, "{r}");
}

/// Whether this test runs on the CUDA 11.1 fake (`CUDRV_TEST_DRIVER=legacy`), where a test of a
/// feature that 11.1 lacks checks the error that says so instead. In a child, also checks that the
/// driver cudrv loaded is the one the variable names: ask only in children of the default driver.
pub fn oldest() -> bool {
    let oldest = testing_oldest_driver();
    if in_fake_child() {
        assert_eq!(cudrv::driver_version().unwrap(), fake_driver_version(), "a child of the default driver");
    }
    oldest
}

/// Checks that `r` is cudrv's error for an entry point that the CUDA 11.1 driver lacks:
/// `Error::MissingSymbol { name, driver_version: 11010 }`.
#[track_caller]
pub fn assert_missing_on_oldest<T: Debug>(r: Result<T, Error>, name: &str) {
    match r {
        Err(Error::MissingSymbol { name: missing, driver_version: LEGACY_DRIVER_VERSION }) if missing == name => {}
        other => panic!("expected MissingSymbol {{ name: {name:?}, driver_version: 11010 }}, got {other:?}"),
    }
}

/// Checks that `r` is cudrv's refusal of memory pools on the CUDA 11.1 driver:
/// `Error::Unsupported { feature: "memory pools", .. }`, whose reason says that the driver predates
/// them, and which names an alternative.
#[track_caller]
pub fn assert_no_pools_on_oldest<T: Debug>(r: Result<T, Error>) {
    assert_eq!(cudrv::driver_version().unwrap(), LEGACY_DRIVER_VERSION, "the CUDA 11.1 driver");
    match r {
        Err(Error::Unsupported { feature: "memory pools", reason, alternative: Some(_), .. })
            if reason.contains("the driver (11.1) predates memory pools (CUDA 11.2)") => {}
        other => panic!("expected Unsupported {{ feature: \"memory pools\", .. }} for CUDA 11.1, got {other:?}"),
    }
}

/// The resource that cudrv chooses by default for `dev`, a device whose driver model has memory
/// pools (not TCC): `DriverPool`; on the CUDA 11.1 driver `StreamOrderedPool`, after checking that
/// [`cudrv::memory::choose`] says the driver predates memory pools and that `DriverPool` is refused.
#[track_caller]
pub fn pool_kind(dev: &Device) -> ResourceKind {
    if !oldest() {
        return ResourceKind::DriverPool;
    }
    let choice = cudrv::memory::choose(dev).unwrap();
    assert_eq!(choice.kind, ResourceKind::StreamOrderedPool, "{}", choice.reason);
    assert!(choice.reason.contains("the driver (11.1) predates memory pools (CUDA 11.2)"), "{}", choice.reason);
    assert!(!dev.capabilities().unwrap().memory_pools);
    assert_no_pools_on_oldest(cudrv::memory::DriverPool::default_pool(dev));
    ResourceKind::StreamOrderedPool
}

/// Whether `CUDRV_MEMORY_RESOURCE=resource` cannot be used here: `driver-pool` on the CUDA 11.1
/// driver, after checking that device 0's resource is refused with [`assert_no_pools_on_oldest`].
pub fn driver_pool_refused(resource: &str) -> bool {
    if resource != "driver-pool" || !oldest() {
        return false;
    }
    assert_no_pools_on_oldest(Device::get(0).unwrap().memory_resource());
    true
}

/// Whether IPC is refused here for want of the IPC attribute: on the CUDA 11.1 driver (which
/// predates it) on a host other than Linux (the Windows lane under Wine). Checks that cudrv refuses
/// IPC of memory and of events as `Unsupported`, saying so.
pub fn ipc_refused_on_oldest(dev: &Device, stream: &Stream) -> bool {
    if !oldest() || cfg!(target_os = "linux") {
        return false;
    }
    let sync = Arc::new(SyncResource::new(dev).unwrap());
    let buf = DeviceBuffer::from_slice_in(&[1u8; 8], stream, sync).unwrap();
    for (err, what) in [
        (buf.ipc_handle().unwrap_err(), "legacy IPC of device memory"),
        (cudrv::ipc::IpcEvent::new(dev).unwrap_err(), "interprocess events"),
    ] {
        let Error::Unsupported { feature, reason, .. } = err else { panic!("expected Unsupported, got {err:?}") };
        assert_eq!(feature, what);
        assert!(reason.contains("the driver (11.1) predates CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED"), "{reason}");
    }
    true
}

/// The exporter's half of a two-process legacy IPC test: in a child on the emulated driver, a
/// buffer of 64 `value`s (from `SyncResource`, which legacy IPC exports), whose handle goes to the
/// peer run as `"importer"`; then `check` reads the buffer, after the peer. Nothing where the
/// oldest driver refuses IPC ([`ipc_refused_on_oldest`]).
pub fn export_to_importer(value: u32, check: impl FnOnce(&DeviceBuffer<u32>)) {
    cudrv_test_support::run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &s) {
            return;
        }
        let a = DeviceBuffer::from_slice_in(&[value; 64], &s, Arc::new(SyncResource::new(&dev).unwrap())).unwrap();
        s.synchronize().unwrap();
        api::run_peer("importer", &a.ipc_handle().unwrap().to_string());
        check(&a);
    });
}
mod review22;
mod review22b;
mod review23a;
mod review23b;
mod review24;
mod review24a;
mod review24b;
mod review24c;
mod review25;
mod review25b;
mod review26;
mod review27;
mod review27b;
mod review28b;
mod review28c;
mod review28d;
mod review29a;
mod review30;
mod review_faults21;

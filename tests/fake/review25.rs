//! Review 25: work that waits for the end of a capture, or for a graph's launches, holds the
//! streams it waits on parked (`ParkedStream`), not as users. A capture whose origin's last user
//! goes is then ended (its graph dropped) even where such work waits for it, and the work runs.
//! Each of these tests hung or leaked before: the waiting free held a user of the capturing
//! stream, so the stream's handle never went and the capture was never ended (review 24 found
//! it and kept it as an ignored test).

use std::sync::Arc;

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::ipc::{IpcBuffer, IpcMemHandle};
use cudrv::memory::{
    DeviceBuffer, DeviceBuffer2D, MemoryResource, PinnedBuffer, PinnedHostResource, SyncResource, register_host,
};
use cudrv::{Device, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, live_graphs, run_with_fake_modes};

use crate::api::peer_data;
use crate::{graph_cases, while_another_thread_captures};

const MODES: [&str; 2] = ["linux", "tcc"];
const CAPTURE_MODES: [CaptureMode; 3] = [CaptureMode::Global, CaptureMode::ThreadLocal, CaptureMode::Relaxed];

/// Begins a capture on `origin` and joins `side` to it, so that the capture's state can be read
/// once the origin is gone.
fn capture_joined(origin: &Stream, side: &Stream, mode: CaptureMode) {
    origin.begin_capture(mode).unwrap();
    side.wait_stream(origin).unwrap();
    assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active);
}

/// What every test ends with: the capture is over (its graph gone), the side stream works again,
/// and once cudrv's caches are let go nothing is left: the waiting free ran.
fn check_ended_and_freed(dev: &Device, side: Stream, graphs: u64) {
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(side.capture_status().unwrap(), CaptureStatus::None, "the abandoned capture must end");
    assert_eq!(live_graphs(), graphs, "the abandoned capture's graph is destroyed");
    let mut after = DeviceBuffer::<u32>::zeroed(16, &side).unwrap();
    after.fill(7).unwrap();
    assert_eq!(after.to_vec().unwrap(), vec![7; 16]);
    drop(after);
    drop(side);
    graph_cases::release_everything(dev);
    assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    assert_no_leaks();
}

/// Runs `case` in every capture mode, on the emulated Linux and TCC drivers. `case` begins a
/// capture joined by `side` ([`capture_joined`]) and lets go of everything else; then the
/// capture must have ended and everything been freed ([`check_ended_and_freed`]).
fn each_abandoned_capture(case: impl Fn(&Device, CaptureMode, &Stream)) {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        for mode in CAPTURE_MODES {
            let side = Stream::new(&dev).unwrap();
            let graphs = live_graphs();
            case(&dev, mode, &side);
            check_ended_and_freed(&dev, side, graphs);
        }
    });
}

/// A buffer made before the capture and dropped during it: its free waits for the capture's end.
/// Then the stream's last user goes (a panic between `begin_capture` and `end_capture`).
#[test]
fn a_buffer_dropped_during_the_capture_does_not_keep_an_abandoned_capture() {
    each_abandoned_capture(|dev, mode, side| {
        let origin = Stream::new(dev).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &origin).unwrap();
        capture_joined(&origin, side, mode);
        drop(buf);
        drop(origin);
    });
}

/// As above, with the buffer used by the capture (a fill in the graph): its free waits for the
/// graph, which the abandoned capture never makes.
#[test]
fn a_buffer_used_by_the_capture_does_not_keep_it_once_abandoned() {
    each_abandoned_capture(|dev, mode, side| {
        let origin = Stream::new(dev).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(1 << 12, &origin).unwrap();
        capture_joined(&origin, side, mode);
        buf.fill(5).unwrap();
        drop(buf);
        drop(origin);
    });
}

/// The buffer was used on another stream, whose capture it waits for: that stream's last user is
/// the buffer's record of the use, which goes with the buffer.
#[test]
fn a_buffer_used_on_a_capturing_stream_does_not_keep_that_capture_once_abandoned() {
    each_abandoned_capture(|dev, mode, side| {
        let (own, user) = (Stream::new(dev).unwrap(), Stream::new(dev).unwrap());
        let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &own).unwrap();
        buf.record_use(&user).unwrap();
        capture_joined(&user, side, mode);
        drop(user);
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the buffer still uses the stream");
        drop(buf);
    });
}

/// A pitched buffer (freed synchronously, after waiting for its streams) dropped during its
/// stream's capture waits for the end in the same way.
#[test]
fn a_pitched_buffer_dropped_during_the_capture_does_not_keep_an_abandoned_capture() {
    each_abandoned_capture(|dev, mode, side| {
        let origin = Stream::new(dev).unwrap();
        let buf = DeviceBuffer2D::<u32>::zeroed(64, 8, &origin).unwrap();
        capture_joined(&origin, side, mode);
        drop(buf);
        drop(origin);
    });
}

/// Where the capture is ended by its owner, the waiting free runs then, on the stream the owner
/// still holds (the free makes a user of the live stream again, not a second one): the stream
/// goes on serving its pool's cache, and nothing leaks once it goes.
#[test]
fn a_free_that_waited_for_a_capture_runs_on_the_live_stream_when_it_ends() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let stream = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &stream).unwrap();
        let in_use = || dev.memory_resource().unwrap().stats().unwrap().in_use;
        let before = in_use();
        stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        drop(buf);
        assert_eq!(in_use(), before, "nothing is freed during the capture");
        drop(stream.end_capture().unwrap());
        cudrv::flush_deferred_drops().unwrap();
        stream.synchronize().unwrap();
        assert!(in_use() < before, "the free ran at the capture's end: {before} bytes in use, then {}", in_use());
        let mut again = DeviceBuffer::<u32>::zeroed(1 << 12, &stream).unwrap();
        again.fill(9).unwrap();
        assert_eq!(again.to_vec().unwrap(), vec![9; 1 << 12]);
        drop(again);
        drop(stream);
        graph_cases::release_everything(&dev);
        assert_no_leaks();
    });
}

/// `SyncResource`'s `cuMemAlloc` and `cuMemFree` are "potentially unsafe" calls, which the driver
/// refuses on every thread while a capture in the global mode is active (the default mode),
/// invalidating that capture; the emulated driver now does so too. They run with the thread's
/// capture mode relaxed (never part of a capture, as the pool's own allocations): a buffer made
/// and freed through `SyncResource` on one thread leaves another thread's capture alone. It failed
/// before (the allocation got the driver's 900, and the other thread's `end_capture` 901).
#[test]
fn sync_resource_allocations_leave_another_thread_s_global_capture_alone() {
    run_with_fake_modes(&MODES, &[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
        let (made, ended) = while_another_thread_captures(CaptureMode::Global, false, || {
            let buf = DeviceBuffer::from_slice_in(&[1u32, 2, 3], &s, sync.clone())?;
            let read = buf.to_vec()?;
            drop(buf);
            cudrv::flush_deferred_drops()?;
            Ok::<_, cudrv::Error>(read)
        });
        assert!(ended.is_ok(), "the other thread's capture: {ended:?}");
        assert_eq!(made.unwrap(), vec![1, 2, 3]);
        assert_eq!(sync.stats().unwrap().in_use, 0, "freed");
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// Pinned host memory and host registration are made and given back with "potentially unsafe"
/// calls too (`cuMemHostAlloc`, `cuMemFreeHost`, `cuMemHostRegister`, `cuMemHostUnregister`):
/// PyTorch's data loaders broke global-mode captures on other threads by pinning memory. They now
/// run with the thread's capture mode relaxed. It failed before (900, and the other thread's
/// capture invalidated), once the emulated driver treated these calls as the driver does.
#[test]
fn pinned_memory_and_registration_leave_another_thread_s_global_capture_alone() {
    run_with_fake_modes(&MODES, &[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let pinned_res = PinnedHostResource::new(&dev).unwrap();
        let mut plain = vec![0u32; 1024];
        let (made, ended) = while_another_thread_captures(CaptureMode::Global, false, || {
            let pinned = PinnedBuffer::from_slice(&dev, &[4u32; 256])?;
            let read = pinned.as_slice()?.to_vec();
            drop(pinned);
            let p = pinned_res.allocate(4096, &s)?;
            // SAFETY: from this resource with this size on this stream, unused, freed once.
            unsafe { pinned_res.deallocate(p, 4096, &s) }?;
            let mut registered = register_host(&dev, &mut plain)?;
            registered.as_mut_slice()[0] = 8;
            drop(registered);
            Ok::<_, cudrv::Error>(read)
        });
        assert!(ended.is_ok(), "the other thread's capture: {ended:?}");
        assert_eq!(made.unwrap(), vec![4; 256]);
        assert_eq!(plain[0], 8);
        drop((s, pinned_res));
        graph_cases::release_everything(&dev);
        assert_no_leaks();
    });
}

/// Legacy IPC mappings are opened and closed with "potentially unsafe" calls as well
/// (`cuIpcOpenMemHandle`, `cuIpcCloseMemHandle`): an importer's open, copy and close on one
/// thread now leave another thread's global capture alone. It failed before, as above.
#[test]
fn ipc_mappings_leave_another_thread_s_global_capture_alone() {
    if let Some(data) = peer_data("importer") {
        let h: IpcMemHandle = data.parse().unwrap();
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (read, ended) = while_another_thread_captures(CaptureMode::Global, false, || {
            let b = IpcBuffer::<u32>::open(&h, &s)?;
            let read = b.to_vec()?;
            drop(b);
            Ok::<_, cudrv::Error>(read)
        });
        assert!(ended.is_ok(), "the other thread's capture: {ended:?}");
        assert_eq!(read.unwrap(), vec![6; 64]);
        let report = fake_report();
        assert!(report.violations.is_empty(), "{report}");
        println!("peer done: importer");
        return;
    }
    crate::export_to_importer(6u32, |_| {});
}

/// `cuStreamSynchronize` and `cuStreamQuery` of a stream that takes no part in a capture are
/// "potentially unsafe" calls too: the H200's driver answered 900 to another thread's
/// synchronisation of an unrelated stream during a global capture, and invalidated the capture
/// (`scripts/capture-probe.py`, this session's device batch); the emulated driver now does so.
/// `Stream::synchronize`, `Stream::query` and the waits of frees run relaxed: a thread's own
/// stream work and its waits leave another thread's capture alone. It failed before (900).
#[test]
fn stream_synchronisation_leaves_another_thread_s_global_capture_alone() {
    run_with_fake_modes(&MODES, &[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
        let (done, ended) = while_another_thread_captures(CaptureMode::Global, false, || {
            let mut buf = DeviceBuffer::<u32>::zeroed(256, &s)?;
            buf.fill(5)?;
            let queried = s.query()?;
            s.synchronize()?;
            // A free that waits for its stream (SyncResource's) on the host.
            drop(DeviceBuffer::from_slice_in(&[1u32; 16], &s, sync.clone())?);
            Ok::<_, cudrv::Error>((queried, buf.to_vec()?))
        });
        assert!(ended.is_ok(), "the other thread's capture: {ended:?}");
        let (_, read) = done.unwrap();
        assert_eq!(read, vec![5; 256]);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

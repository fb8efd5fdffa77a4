//! Review 24a: soundness and driver faults in `ipc.rs` (IPC events, memory handles, shared and
//! imported pools, `IpcBuffer`) and `memory/host.rs` (pinned buffers, the pinned resource, host
//! registration). Tests marked DEFECT failed before the fix that came with them: a pinned
//! buffer's host access that deadlocked with a host function touching the buffer, and that
//! invalidated another thread's global-mode capture; a `PinnedHostResource` free on the legacy
//! stream that hung during a blocking capture; `IpcBuffer` host copies through the legacy stream
//! that invalidated a blocking capture; `IpcBuffer`s opened at addresses misaligned for `T`; host
//! registration of zero-sized elements refused by the driver. The others pin down behaviour that
//! the review checked and found sound.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cudrv::graph::CaptureMode;
use cudrv::ipc::{IpcBuffer, IpcMemHandle};
use cudrv::memory::{DeviceBuffer, MemoryResource, PinnedBuffer, PinnedHostResource, register_host};
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{fake_report, run_with_fake};

use crate::api::peer_data;
use crate::{while_another_thread_captures, within_10s};

// ------------------------------------------------------------------------------------------------
// Pinned buffers: host access while copies are pending
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: the main thread's `as_slice` never returned). `PinnedBuffer`'s
/// host access waited for its pending copies (`cuEventSynchronize`) while holding the lock of its
/// pending list. A host function that touches the same buffer (it is `Sync`: an `Arc` of it moved
/// into the closure, as one does to read uploaded data there) locks that list too: when the copy
/// that the main thread waits for is queued after the host function, the host function waited for
/// the lock, the copy for the host function, and the main thread for the copy. The lock is now let
/// go while waiting: the host function gets `Error::InHostFunction` (it may not wait there), and
/// the main thread the data.
#[test]
fn pinned_host_access_does_not_hold_its_lock_while_waiting_for_a_copy() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let src = Arc::new(PinnedBuffer::from_slice(&dev, &[7u32; 64]).unwrap());
        let mut d = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
        d.copy_from_pinned_async(&src).unwrap();
        let (tx, rx) = mpsc::channel();
        let in_fn = src.clone();
        s.launch_host_fn(move || {
            // Time for the main thread to start waiting for the copy queued after this.
            std::thread::sleep(Duration::from_millis(200));
            let _ = tx.send(format!("{:?}", in_fn.as_slice().map(<[u32]>::to_vec)));
        })
        .unwrap();
        d.copy_from_pinned_async(&src).unwrap(); // pending behind the host function
        let waiter = src.clone();
        let read = within_10s(move || waiter.as_slice().map(<[u32]>::to_vec));
        assert!(read.is_some(), "host access to a pinned buffer deadlocked with a host function using it");
        assert_eq!(read.unwrap().unwrap(), vec![7; 64]);
        let in_host_fn = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(in_host_fn.starts_with("Err(InHostFunction"), "{in_host_fn}");
        assert_eq!(d.to_vec().unwrap(), vec![7; 64]);
        drop((d, src));
        s.synchronize().unwrap();
        dev.memory_resource().unwrap().trim(0).unwrap();
        crate::assert_no_leaks_but_streams();
    });
}

// ------------------------------------------------------------------------------------------------
// The pinned resource and the legacy default stream
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `deallocate` did not return, and the capture was
/// invalidated). `PinnedHostResource::deallocate` waits for its stream before `cuMemFreeHost`.
/// On the legacy default stream while a blocking stream of the context captures (here the main
/// thread's per-thread stream), the driver refuses that wait (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`)
/// and invalidates the capture, and cudrv's wait, which must not return while work may still use
/// the memory, polled until the capture ended: here never, as the capturing thread waits for the
/// free. `SyncResource` already waits for such a free on cudrv's thread; the pinned resource now
/// does too: the call returns, the capture ends intact, and the memory goes back after it.
#[test]
fn a_pinned_resource_free_on_the_legacy_stream_waits_for_a_blocking_capture_to_end() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let legacy = Stream::legacy(&dev).unwrap();
        let pinned = Arc::new(PinnedHostResource::new(&dev).unwrap());
        let ptr = pinned.allocate(256, &legacy).unwrap();
        let p = Stream::per_thread(&dev).unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(64, &p).unwrap();
        p.synchronize().unwrap();
        let live = fake_report().live_allocations - 1; // all but the pinned memory
        p.begin_capture(CaptureMode::ThreadLocal).unwrap();
        x.fill(3).unwrap();
        let (r, l) = (pinned.clone(), legacy.clone());
        // SAFETY: `ptr` came from this resource's `allocate`, with this size, and is freed once.
        let freed = within_10s(move || unsafe { r.deallocate(ptr, 256, &l) }.map_err(|e| format!("{e:?}")));
        assert!(freed.is_some(), "a pinned free on the legacy stream hung during a blocking capture");
        freed.unwrap().unwrap();
        let exec = p.end_capture().expect("the free invalidated the capture").instantiate().unwrap();
        exec.launch(&p).unwrap();
        p.synchronize().unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![3; 64]);
        // The free ran once the capture ended.
        let mut waited = 0;
        while fake_report().live_allocations > live && waited < 2000 {
            std::thread::sleep(Duration::from_millis(5));
            cudrv::flush_deferred_drops().unwrap();
            waited += 5;
        }
        assert_eq!(fake_report().live_allocations, live, "the pinned memory was not freed");
        drop((exec, x));
    });
}

// ------------------------------------------------------------------------------------------------
// IPC buffers of the legacy default stream while a blocking stream captures
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: both copies returned the driver's error 906, and the capture
/// was invalidated, so `end_capture` failed). An `IpcBuffer`'s host copies go to its stream and
/// wait for it. For a buffer of the legacy default stream (or of another thread's per-thread
/// stream), while a blocking stream of the context captures (here the main thread's per-thread
/// stream), the driver refuses that work (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`) and invalidates
/// the capture: a copy on one thread broke another's capture. `DeviceBuffer`'s host access refuses
/// this case with `Error::Capturing` (review 23a); `IpcBuffer`'s now does too, before anything
/// is queued, and the same copies work once the capture has ended.
#[test]
fn ipc_host_copies_through_the_legacy_stream_are_refused_during_a_blocking_capture() {
    if let Some(data) = peer_data("importer") {
        let h: IpcMemHandle = data.parse().unwrap();
        let dev = Device::get(0).unwrap();
        let legacy = Stream::legacy(&dev).unwrap();
        let b = IpcBuffer::<u32>::open(&h, &legacy).unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![5; 64]);
        let p = Stream::per_thread(&dev).unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(64, &p).unwrap();
        p.synchronize().unwrap();
        p.begin_capture(CaptureMode::ThreadLocal).unwrap();
        x.fill(3).unwrap();
        let got = within_10s(move || {
            let mut b = b;
            let read = b.to_vec();
            let written = b.copy_from_host(&[9; 64]);
            (b, read, written)
        });
        let Some((mut b, read, written)) = got else { panic!("an IPC host copy through the legacy stream hung") };
        let ended = p.end_capture();
        assert!(matches!(read, Err(Error::Capturing { .. })), "copy_to_host: {read:?}");
        assert!(matches!(written, Err(Error::Capturing { .. })), "copy_from_host: {written:?}");
        let exec = ended.expect("an IPC copy on another thread invalidated the capture").instantiate().unwrap();
        exec.launch(&p).unwrap();
        p.synchronize().unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![3; 64]);
        b.copy_from_host(&[9; 64]).unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![9; 64]);
        drop((b, exec, x));
        let report = fake_report();
        assert!(report.violations.is_empty(), "{report}");
        println!("peer done: importer");
        return;
    }
    crate::export_to_importer(5u32, |a| assert_eq!(a.to_vec().unwrap(), vec![9; 64], "the importer's last copy"));
}

// ------------------------------------------------------------------------------------------------
// Pinned host access while another thread captures in global mode
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `end_capture` failed with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`,
/// 901). `PinnedBuffer`'s host access waits for its pending copies with
/// `cuEventSynchronize`, a "potentially unsafe" call that the driver refuses (and answers by
/// invalidating the capture) on every thread while any capture in `CaptureMode::Global` is active.
/// The wait fell back to the stream's synchronize and succeeded, but another thread's capture was
/// broken by a mere `as_slice`. The events waited for are never part of a capture (pinned copies
/// refuse capturing streams), so the wait now relaxes the calling thread's capture mode, as
/// cudrv's pool does for its own driver calls.
#[test]
fn pinned_host_access_leaves_a_global_capture_of_another_thread_intact() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut dst = PinnedBuffer::<u32>::new(&dev, 64).unwrap();
        let d = DeviceBuffer::from_slice(&[4u32; 64], &s).unwrap();
        d.copy_to_pinned_async(&mut dst).unwrap();
        let (read, captured) =
            while_another_thread_captures(CaptureMode::Global, false, || dst.as_slice().map(<[u32]>::to_vec));
        assert_eq!(read.unwrap(), [4; 64]);
        captured.expect("host access to a pinned buffer invalidated another thread's capture");
    });
}

// ------------------------------------------------------------------------------------------------
// Host registration
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `register_host` returned the driver's
/// `CUDA_ERROR_INVALID_VALUE`). An empty slice registers nothing and succeeds; a non-empty slice
/// of zero-sized elements (`[u32; 0]` is a `DeviceRepr`) is zero bytes as well, but was handed to
/// `cuMemHostRegister` with size 0 (and a dangling pointer), which the driver refuses. It now
/// registers nothing either, and its drop unregisters nothing.
#[test]
fn registering_zero_sized_elements_registers_nothing() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        if !dev.capabilities().unwrap().host_register {
            return;
        }
        let mut none: [[u32; 0]; 8] = [[]; 8];
        let reg = register_host(&dev, &mut none).expect("zero bytes register as nothing");
        assert_eq!((reg.len(), reg.byte_len()), (8, 0));
        drop(reg);
        let s = Stream::new(&dev).unwrap();
        s.synchronize().expect("the drop reported no error");
        // A real slice still registers, and only once at a time.
        let mut host = vec![1u32; 1024];
        let reg = register_host(&dev, &mut host).unwrap();
        assert_eq!(reg.byte_len(), 4096);
        drop(reg);
        let again = register_host(&dev, &mut host).expect("unregistered by the drop");
        drop(again);
        s.synchronize().unwrap();
    });
}

// ------------------------------------------------------------------------------------------------
// IPC handles are untrusted bytes
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: the handle opened, at an address 2 bytes past a `u32`
/// boundary). An `IpcMemHandle`'s offset comes from another process; `IpcBuffer::open` checked the
/// range against the mapped allocation, not that the address suits `T`: an `IpcBuffer<u32>` at an
/// odd address, whose `as_raw` goes to kernels as a `u32*` (a misaligned-address fault on the
/// device), where every `DeviceBuffer<T>` and view is aligned for `T`. A handle whose address is
/// not aligned for `T` is now refused with `Error::InvalidArgument`, and the honest handle opens.
#[test]
fn ipc_open_refuses_an_offset_misaligned_for_the_element_type() {
    if let Some(data) = peer_data("importer") {
        let h: IpcMemHandle = data.parse().unwrap();
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut raw = h.to_bytes();
        raw[80..88].copy_from_slice(&2u64.to_le_bytes());
        raw[88..96].copy_from_slice(&252u64.to_le_bytes());
        let forged = IpcMemHandle::from_bytes(&raw).unwrap();
        match IpcBuffer::<u32>::open(&forged, &s) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("align"), "{msg}"),
            Ok(b) => panic!("opened a u32 buffer at {:#x}", b.as_raw()),
            Err(e) => panic!("{e:?}"),
        }
        // Bytes have no alignment to keep: the same range opens as `u8`.
        let bytes = IpcBuffer::<u8>::open(&forged, &s).unwrap();
        assert_eq!(bytes.to_vec().unwrap()[..4], [0, 0, 0x5A, 0x5A]);
        let honest = IpcBuffer::<u32>::open(&h, &s).unwrap();
        assert_eq!(honest.to_vec().unwrap(), vec![0x5A5A; 64]);
        drop((bytes, honest));
        let report = fake_report();
        assert!(report.violations.is_empty(), "{report}");
        println!("peer done: importer");
        return;
    }
    crate::export_to_importer(0x5A5Au32, |_| {});
}

// ------------------------------------------------------------------------------------------------
// Behaviour checked and found sound
// ------------------------------------------------------------------------------------------------

/// Pins (checked sound): a `PinnedBuffer` dropped inside a host function while a copy into it is
/// still queued on another stream is freed on cudrv's thread after that copy: no access
/// violation, and the memory goes back.
#[test]
fn a_pinned_buffer_dropped_in_a_host_function_is_freed_after_its_pending_copy() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "50000")], || {
        let dev = Device::get(0).unwrap();
        let (s, t) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let d = DeviceBuffer::from_slice(&[8u32; 64], &t).unwrap();
        let mut dst = PinnedBuffer::<u32>::new(&dev, 64).unwrap();
        d.copy_to_pinned_async(&mut dst).unwrap(); // pending on `t`, behind delayed work
        let (tx, rx) = mpsc::channel();
        s.launch_host_fn(move || {
            drop(dst);
            let _ = tx.send(());
        })
        .unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        s.synchronize().unwrap();
        t.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        drop(d);
        t.synchronize().unwrap();
        dev.memory_resource().unwrap().trim(0).unwrap();
        let report = fake_report();
        assert!(report.violations.is_empty(), "{report}");
        crate::assert_no_leaks_but_streams();
    });
}

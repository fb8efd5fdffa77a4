//! Review 24b: soundness and driver faults in pitched memory (`DeviceBuffer2D`, `DeviceBuffer3D`,
//! their views and 2D/3D copies, `src/memory/pitched.rs`) and managed memory (`ManagedBuffer`,
//! `ManagedResource`, `src/memory/managed.rs`).
//!
//! Covered: extents, pitches and offsets from user input (overflowing counts, zero extents, views
//! and boxes out of range, copies between views of different shapes, host slices too short or
//! strided); host access to managed memory while work may still use it; captures (the buffer's
//! own, another thread's in global mode, a blocking one that holds the legacy default stream);
//! frees racing queued work and captures.
//!
//! Tests named `defect_*` reproduced a defect (they failed before the fix that came with them):
//! * `defect_pitched_host_access_through_the_legacy_stream_is_refused_during_a_blocking_capture`
//!   (hung) and `defect_managed_host_access_through_the_legacy_stream_is_refused_during_a_blocking_capture`
//!   (hung): host access through the legacy stream while a blocking stream captures;
//! * `defect_a_managed_resource_free_on_the_legacy_stream_does_not_wait_for_the_thread_s_capture`
//!   (hung): `ManagedResource::deallocate`, as review 23b's `SyncResource`;
//! * `defect_pitched_synchronous_memsets_leave_another_thread_s_blocking_capture_alone`: the
//!   driver's synchronous 2D memsets run on the legacy stream and invalidated that capture;
//! * `defect_pitched_and_managed_allocations_leave_another_thread_s_global_capture_alone`:
//!   `cuMemAllocPitch` / `cuMemAllocManaged` invalidated another thread's global-mode capture.
//!
//! The fake driver gained, for these: call-time capture checks on the 2D/3D copies and memsets
//! (as its 1D ones had), and `cuMemAllocPitch` / `cuMemAllocManaged` as "potentially unsafe"
//! calls. The other tests pin behaviour that the review checked and found sound.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::memory::{DeviceBuffer, DeviceBuffer2D, DeviceBuffer3D, ManagedBuffer, ManagedResource, MemoryResource};
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{fake_report, run_with_fake};

use crate::{while_another_thread_captures, within_10s};

/// Waits (up to 5 s) for every allocation to go back, frees deferred to cudrv's thread and the
/// device resource's cache included, then checks that none is left.
#[track_caller]
fn assert_all_freed(dev: &Device) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while fake_report().live_allocations > 0 && Instant::now() < deadline {
        cudrv::flush_deferred_drops().unwrap();
        dev.memory_resource().unwrap().trim(0).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    crate::assert_no_leaks_but_streams();
}

#[track_caller]
fn assert_capturing<T: std::fmt::Debug>(r: &cudrv::Result<T>, what: &str) {
    assert!(matches!(r, Err(Error::Capturing { .. })), "{what}: {r:?}");
}

// ------------------------------------------------------------------------------------------------
// Host access through the legacy default stream while a blocking stream captures
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `memset_sync` never returned). A pitched buffer of the legacy
/// default stream: its synchronous memsets and host copies wait for that stream, which, while a
/// blocking stream of the context captures (here the main thread's per-thread stream), answers
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` to every synchronize, query and record, and cudrv's wait
/// polled until the capture ended: here never, as the capturing thread waits for the call (and
/// the copy queued there first would join the capture, which the driver refuses by invalidating
/// it). Review 23a fixed this for `DeviceBuffer`; the pitched buffers now refuse such host access
/// with `Error::Capturing` before anything is queued or waited for, and work again after.
#[test]
fn defect_pitched_host_access_through_the_legacy_stream_is_refused_during_a_blocking_capture() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let legacy = Stream::legacy(&dev).unwrap();
        let b2 = DeviceBuffer2D::from_slice(&[1u32; 64], 16, 4, &legacy).unwrap();
        let b3 = DeviceBuffer3D::from_slice(&[2u16; 64], (4, 4, 4), &legacy).unwrap();
        let p = Stream::per_thread(&dev).unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(64, &p).unwrap();
        p.begin_capture(CaptureMode::ThreadLocal).unwrap();
        x.fill(3).unwrap();
        let got = within_10s(move || {
            let (mut b2, mut b3) = (b2, b3);
            let mut out = vec![0u32; 64];
            let results = [
                format!("{:?}", b2.memset_sync(0)),
                format!("{:?}", b2.fill_sync(5)),
                format!("{:?}", b2.to_vec()),
                format!("{:?}", b2.copy_to_host(&mut out)),
                format!("{:?}", b2.copy_from_host(&[7; 64])),
                format!("{:?}", b2.row(1).unwrap().to_vec()),
                format!("{:?}", b3.fill_sync(9)),
                format!("{:?}", b3.to_vec()),
                format!("{:?}", b3.copy_from_host(&[8; 64])),
            ];
            (b2, b3, results)
        });
        let Some((mut b2, mut b3, results)) = got else { panic!("pitched host access through the legacy stream hung") };
        for r in &results {
            assert!(r.starts_with("Err(Capturing"), "{results:?}");
        }
        assert_eq!(p.capture_status().unwrap(), CaptureStatus::Active, "the capture was invalidated");
        let exec = p.end_capture().expect("the capture was invalidated").instantiate().unwrap();
        exec.launch(&p).unwrap();
        p.synchronize().unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![3; 64]);
        // Nothing was written meanwhile; after the capture the same calls work.
        assert_eq!(b2.to_vec().unwrap(), vec![1; 64]);
        assert_eq!(b3.to_vec().unwrap(), vec![2; 64]);
        b2.fill_sync(4).unwrap();
        b3.copy_from_host(&[6; 64]).unwrap();
        assert_eq!(b2.to_vec().unwrap(), vec![4; 64]);
        assert_eq!(b3.to_vec().unwrap(), vec![6; 64]);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// DEFECT (failed before the fix: `as_slice` never returned). The same with a `ManagedBuffer`:
/// one of the legacy stream, and one of an ordinary stream whose use was recorded on the legacy
/// stream. Host access waits for the buffer's stream and every stream it was used on; the host
/// copies order the buffer's stream after those (an event recorded on the legacy stream, which
/// would join the capture). All are refused with `Error::Capturing` now, and work after.
#[test]
fn defect_managed_host_access_through_the_legacy_stream_is_refused_during_a_blocking_capture() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let legacy = Stream::legacy(&dev).unwrap();
        let s = Stream::new(&dev).unwrap();
        let on_legacy = ManagedBuffer::from_slice(&[1u32; 64], &legacy).unwrap();
        let used_there = ManagedBuffer::from_slice(&[2u32; 64], &s).unwrap();
        used_there.record_use(&legacy).unwrap();
        legacy.synchronize().unwrap();
        let p = Stream::per_thread(&dev).unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(64, &p).unwrap();
        p.begin_capture(CaptureMode::ThreadLocal).unwrap();
        x.fill(3).unwrap();
        let got = within_10s(move || {
            let mut results = Vec::new();
            let mut kept = Vec::new();
            for mut m in [on_legacy, used_there] {
                let mut out = vec![0u32; 64];
                results.push(format!("{:?}", m.as_slice().map(|s| s[0])));
                results.push(format!("{:?}", m.as_mut_slice().map(|s| s[0])));
                results.push(format!("{:?}", m.to_vec()));
                results.push(format!("{:?}", m.copy_to_host(&mut out)));
                results.push(format!("{:?}", m.copy_from_host(&[7; 64])));
                kept.push(m);
            }
            (results, kept)
        });
        let Some((results, mut kept)) = got else { panic!("managed host access through the legacy stream hung") };
        for r in &results {
            assert!(r.starts_with("Err(Capturing"), "{results:?}");
        }
        assert_eq!(p.capture_status().unwrap(), CaptureStatus::Active, "the capture was invalidated");
        let exec = p.end_capture().expect("the capture was invalidated").instantiate().unwrap();
        exec.launch(&p).unwrap();
        p.synchronize().unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![3; 64]);
        // Nothing was written meanwhile; after the capture the same calls work.
        assert_eq!(kept[0].as_slice().unwrap(), [1; 64]);
        assert_eq!(kept[1].to_vec().unwrap(), vec![2; 64]);
        kept[1].copy_from_host(&[5; 64]).unwrap();
        assert_eq!(kept[1].as_mut_slice().unwrap(), [5; 64]);
        drop((kept, exec, x));
        p.synchronize().unwrap();
        assert_all_freed(&dev);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// DEFECT (failed before the fix: the free never returned). `ManagedResource::deallocate` waits
/// on the host for the freeing stream before `cuMemFree`; for the legacy stream while a blocking
/// stream of the calling thread captures, that wait lasts until the capture ends, which the
/// thread was to do after the free. Review 23b fixed this in `SyncResource`; the managed resource
/// now hands such a free to cudrv's thread as well, and the memory goes back after the capture.
#[test]
fn defect_a_managed_resource_free_on_the_legacy_stream_does_not_wait_for_the_thread_s_capture() {
    run_with_fake(&[], || {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let dev = Device::get(0).unwrap();
            let legacy = Stream::legacy(&dev).unwrap();
            let managed: Arc<dyn MemoryResource> = Arc::new(ManagedResource::new(&dev).unwrap());
            let raw = managed.allocate(4096, &legacy).unwrap();
            let buf = DeviceBuffer::<u32>::from_slice_in(&[1; 256], &legacy, managed.clone()).unwrap();
            let capturing = Stream::per_thread(&dev).unwrap();
            capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
            drop(buf);
            // SAFETY: from this resource with this size on this stream, unused, freed once.
            let freed = unsafe { managed.deallocate(raw, 4096, &legacy) };
            let ended = capturing.end_capture().map(drop);
            let _ = tx.send((freed, ended));
        });
        let (freed, ended) = rx.recv_timeout(Duration::from_secs(10)).expect("the frees hung");
        assert!(freed.is_ok(), "{freed:?}");
        assert!(ended.is_ok(), "the capture failed: {ended:?}");
        assert_all_freed(&Device::get(0).unwrap());
        let deferred = Device::get(0).unwrap().primary_context().unwrap().take_deferred();
        assert!(deferred.is_ok(), "a free failed: {deferred:?}");
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

// ------------------------------------------------------------------------------------------------
// Copies between pitched buffers and DeviceBuffers
// ------------------------------------------------------------------------------------------------

/// Pins (checked sound): a `DeviceBuffer` allocated during a capture holds memory of the graph,
/// and `end_capture` refuses while it lives, so it is only ever used on its capturing stream:
/// `copy_to_buffer` (which records only the pitched buffer's use, on the destination's stream)
/// and `copy_from_buffer` are refused there, since pitched buffers cannot be captured. Outside
/// captures both directions copy.
#[test]
fn copies_between_pitched_buffers_and_buffers_of_a_capture_are_refused() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let b2 = DeviceBuffer2D::from_slice(&[1u32; 64], 16, 4, &s).unwrap();
        let mut into = DeviceBuffer2D::<u32>::zeroed(16, 4, &s).unwrap();
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
        assert_capturing(&b2.copy_to_buffer(&mut dst), "copy_to_buffer into a buffer of a capture");
        assert_capturing(&into.copy_from_buffer(&dst), "copy_from_buffer from a buffer of a capture");
        assert!(s.end_capture().is_err(), "end_capture while a buffer of the capture lives");
        drop(dst);
        drop(s.end_capture().unwrap());
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
        let mut flat = DeviceBuffer::<u32>::zeroed(64, &Stream::new(&dev).unwrap()).unwrap();
        b2.copy_to_buffer(&mut flat).unwrap();
        into.copy_from_buffer(&flat).unwrap();
        assert_eq!(into.to_vec().unwrap(), vec![1; 64]);
    });
}

// ------------------------------------------------------------------------------------------------
// Synchronous memsets and other threads' captures
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `fill_sync` failed with the driver's 906, and the other thread's
/// capture was invalidated). The driver's synchronous 2D memsets (`cuMemsetD2D8`, ...) run on the
/// legacy default stream, whatever the buffer's stream; while a blocking stream of the context
/// captures (here another thread's per-thread stream), work there is refused and invalidates
/// that capture. A pitched buffer's `memset_sync` / `fill_sync` on an ordinary stream broke a
/// capture it has nothing to do with. They now queue the memset on the buffer's stream and wait
/// for it (same ordering, same result), and leave the legacy stream alone.
#[test]
fn defect_pitched_synchronous_memsets_leave_another_thread_s_blocking_capture_alone() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut b2 = DeviceBuffer2D::<u32>::zeroed(16, 4, &s).unwrap();
        let mut b3 = DeviceBuffer3D::<u16>::zeroed((4, 4, 4), &s).unwrap();
        let (filled, ended) = while_another_thread_captures(CaptureMode::ThreadLocal, true, || {
            (b2.fill_sync(7), b2.memset_sync(1), b3.fill_sync(9))
        });
        assert!(ended.is_ok(), "the other thread's capture: {ended:?}");
        assert!(matches!(filled, (Ok(()), Ok(()), Ok(()))), "{filled:?}");
        assert_eq!(b2.to_vec().unwrap(), vec![0x0101_0101; 64]);
        assert_eq!(b3.to_vec().unwrap(), vec![9; 64]);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

// ------------------------------------------------------------------------------------------------
// Allocations while another thread captures in global mode
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: the allocations failed with the driver's 900 and the other
/// thread's capture was invalidated). `cuMemAllocPitch` and `cuMemAllocManaged` are "potentially
/// unsafe" calls, which the driver refuses on every thread while any capture in global mode is
/// active (the default mode), invalidating that capture. A pitched or managed buffer made on one
/// thread broke an unrelated capture on another, as cudrv's pool avoids for its own `cuMemAlloc`
/// by relaxing the thread's capture mode around it. The allocations (never part of a capture)
/// now do the same, as do their frees.
#[test]
fn defect_pitched_and_managed_allocations_leave_another_thread_s_global_capture_alone() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (made, ended) = while_another_thread_captures(CaptureMode::Global, false, || {
            (
                DeviceBuffer2D::<u32>::zeroed(16, 4, &s).map(drop),
                DeviceBuffer3D::<u16>::zeroed((4, 4, 4), &s).map(drop),
                ManagedBuffer::<u32>::zeroed(64, &s).map(drop),
                ManagedResource::new(&dev).and_then(|r| r.allocate(256, &s).map(|p| (r, p))).and_then(|(r, p)| {
                    // SAFETY: from this resource with this size on this stream, unused, freed once.
                    unsafe { r.deallocate(p, 256, &s) }
                }),
            )
        });
        assert!(ended.is_ok(), "the other thread's capture: {ended:?}");
        assert!(matches!(made, (Ok(()), Ok(()), Ok(()), Ok(()))), "{made:?}");
        s.synchronize().unwrap();
        assert_all_freed(&dev);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

// ------------------------------------------------------------------------------------------------
// Extents, strides and views (checked sound)
// ------------------------------------------------------------------------------------------------

/// Pins (checked sound): host slices of the wrong length are refused before anything is queued
/// and are left as they were; a strided copy writes each row's elements and nothing between the
/// rows; zero extents (no columns, no rows, no slices) make buffers that copy, fill and view as
/// empty; a slice of a 3D buffer copies into a 2D buffer at an offset; extents whose element
/// count overflows are refused.
#[test]
fn host_slices_strides_zero_extents_and_slices_of_volumes() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let v3: Vec<u32> = (0..4 * 3 * 2).collect();
        let mut b3 = DeviceBuffer3D::from_slice(&v3, (4, 3, 2), &s).unwrap();
        let mut short = vec![7u32; 23];
        assert!(matches!(b3.copy_to_host(&mut short), Err(Error::LengthMismatch { expected: 24, found: 23, .. })));
        assert_eq!(short, vec![7; 23], "a refused copy wrote the slice");
        assert!(matches!(b3.copy_from_host(&v3[..23]), Err(Error::LengthMismatch { .. })));
        // A strided copy of slice 1 (rows of 4, 3 rows) into rows 6 apart: the gaps stay.
        let mut strided = vec![u32::MAX; 2 * 6 + 4];
        b3.slice(1).unwrap().copy_to_host_strided(&mut strided, 6).unwrap();
        for (i, v) in strided.iter().enumerate() {
            let (row, col) = (i / 6, i % 6);
            let want = if col < 4 { 12 + (row * 4 + col) as u32 } else { u32::MAX };
            assert_eq!(*v, want, "element {i}");
        }
        assert!(matches!(
            b3.slice(1).unwrap().copy_to_host_strided(&mut strided[..15], 6),
            Err(Error::InvalidArgument(_))
        ));
        // A 3D slice's rectangle into a 2D buffer, at an offset.
        let mut b2 = DeviceBuffer2D::<u32>::zeroed(6, 4, &s).unwrap();
        b2.copy_rect_from((2, 1), &b3.slice(1).unwrap().view(1..4, 0..3).unwrap()).unwrap();
        let got = b2.to_vec().unwrap();
        for (i, v) in got.iter().enumerate() {
            let (x, y) = (i % 6, i / 6);
            let want =
                if (2..5).contains(&x) && (1..4).contains(&y) { 12 + ((y - 1) * 4 + (x - 2 + 1)) as u32 } else { 0 };
            assert_eq!(*v, want, "({x}, {y})");
        }
        // Zero extents.
        for (w, h) in [(0, 5), (5, 0), (0, 0)] {
            let mut e = DeviceBuffer2D::<u32>::zeroed(w, h, &s).unwrap();
            assert!(e.is_empty() && e.to_vec().unwrap().is_empty());
            e.fill_sync(3).unwrap();
            e.memset_sync(1).unwrap();
            e.copy_from_host(&[]).unwrap();
            assert!(e.view(.., ..).unwrap().to_vec().unwrap().is_empty());
        }
        for ext in [(0, 3, 2), (4, 0, 2), (4, 3, 0)] {
            let mut e = DeviceBuffer3D::<u32>::zeroed(ext, &s).unwrap();
            assert!(e.is_empty() && e.to_vec().unwrap().is_empty());
            e.fill_sync(3).unwrap();
            e.copy_from_host(&[]).unwrap();
        }
        // An empty box at the far corner of both volumes is nothing to copy.
        let mut other = DeviceBuffer3D::<u32>::zeroed((4, 3, 2), &s).unwrap();
        other.copy_box_from((4, 3, 2), &b3, (4, 3, 2), (0, 0, 0)).unwrap();
        b3.fill_sync(1).unwrap();
        assert_eq!(b3.to_vec().unwrap(), vec![1; 24]);
        assert_eq!(other.to_vec().unwrap(), vec![0; 24]);
        // Counts that overflow.
        // SAFETY: refused before any allocation.
        let r = unsafe { DeviceBuffer3D::<u8>::uninit((usize::MAX / 2, 2, 2), &s) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // SAFETY: as above.
        let r = unsafe { DeviceBuffer2D::<u8>::uninit(usize::MAX / 2, 3, &s) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

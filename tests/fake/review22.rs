//! Review 22: soundness and driver faults in the API beyond the pool (IPC, pitched, managed and
//! pinned host memory). The first eight tests reproduced a defect each (they failed before the
//! fixes that came with them); the others pin down behaviour that the review checked.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::ipc::{ImportedPool, IpcBuffer, IpcMemHandle, PoolShareableHandle, ShareableHandleType, SharedPool};
use cudrv::memory::{
    DeviceBuffer, DeviceBuffer2D, DeviceBuffer3D, ManagedBuffer, PinnedBuffer, SyncResource, register_host,
};
use cudrv::sys::CUresult;
use cudrv::{Device, Error, Graph, Stream};
use cudrv_test_support::{fake_faults_injected, fake_report, run_with_fake};

use crate::api::{peer_data, run_peer};
use crate::ipc_refused_on_oldest;
use crate::soundness::within;

fn violations() -> Vec<String> {
    fake_report().violations
}

// ------------------------------------------------------------------------------------------------
// Managed memory and captures
// ------------------------------------------------------------------------------------------------

/// `ManagedBuffer::copy_to_host` refuses a capture of the buffer's own stream, but first orders
/// that stream after every stream its use was recorded on (`wait_uses_but_own` ->
/// `wait_stream_in_gate`). When one of those streams is capturing, the buffer's stream joins that
/// capture, and the device-to-host copy into the caller's slice becomes a node of the graph; the
/// call then fails (`wait_for_memory` refuses the now capturing stream) and the borrow ends. Once
/// the capture is joined back and ended, every launch of the graph writes into host memory that
/// nothing borrows any more (freed memory, with `to_vec`).
#[test]
fn managed_host_copy_never_joins_a_capture_of_a_used_stream() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let u = Stream::new(&dev).unwrap();
        let m = ManagedBuffer::<u32>::from_slice(&[0xBEEF; 64], &s).unwrap();
        m.record_use(&u).unwrap(); // as a launch or a prefetch on `u` does
        u.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let mut dst = vec![0u32; 64];
        let r = m.copy_to_host(&mut dst);
        println!("copy_to_host while a used stream captures: {r:?}");
        let joined = s.capture_status().unwrap();
        dst.fill(1); // the call returned: nothing borrows `dst` any more
        // A user that sees `s` in the capture joins it back (as the driver requires to end it).
        if joined != CaptureStatus::None {
            u.wait_stream(&s).unwrap();
        }
        let graph = u.end_capture().unwrap();
        let nodes = graph.nodes().unwrap().len();
        let exec = graph.instantiate().unwrap();
        exec.launch(&u).unwrap();
        u.synchronize().unwrap();
        assert!(matches!(r, Err(Error::Capturing { .. })), "{r:?}");
        assert_eq!(
            dst,
            vec![1; 64],
            "the graph ({nodes} nodes; the buffer's stream was {joined:?}) wrote into host memory no borrow covers"
        );
    });
}

/// What a racing capturer and the operations it races share.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    captures: AtomicUsize,
    ops: AtomicUsize,
}

/// Begins and ends relaxed captures on `s` while `op` runs on this thread (at least 300 ms and
/// 50 captures, at most `limit`); returns the captures made and the graphs that got nodes.
fn race(s: &Stream, limit: Duration, mut op: impl FnMut() -> bool) -> (usize, Vec<Graph>) {
    let shared = Arc::new(Shared::default());
    let t = {
        let (s, shared) = (s.clone(), shared.clone());
        std::thread::spawn(move || {
            let mut graphs = Vec::new();
            while !shared.stop.load(Ordering::Relaxed) {
                if s.begin_capture(CaptureMode::Relaxed).is_ok() {
                    std::thread::yield_now();
                    let g = s.end_capture().unwrap();
                    shared.captures.fetch_add(1, Ordering::Relaxed);
                    if !g.nodes().unwrap().is_empty() {
                        graphs.push(g);
                    }
                }
                std::thread::yield_now();
            }
            graphs
        })
    };
    let start = Instant::now();
    while start.elapsed() < limit
        && (start.elapsed() < Duration::from_millis(300) || shared.captures.load(Ordering::Relaxed) < 50)
    {
        if !op() {
            break;
        }
        shared.ops.fetch_add(1, Ordering::SeqCst);
    }
    shared.stop.store(true, Ordering::Relaxed);
    let graphs = t.join().unwrap();
    (shared.captures.load(Ordering::Relaxed), graphs)
}

/// `ManagedBuffer::memset`/`fill` look at the capture in `record_use`, whose gate is let go on
/// return, and queue the memset after it: a capture begun on the stream in between captures the
/// memset, unseen. The graph keeps nothing of the buffer (pitched, managed and IPC buffers are
/// refused in captures because it cannot), so its launches write freed memory once the buffer is
/// dropped. (`IpcBuffer::memset` and `IpcBuffer::copy_from` have the same window.)
#[test]
fn managed_memset_racing_captures_is_never_captured() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut m = ManagedBuffer::<u32>::zeroed(1 << 10, &s).unwrap();
        let (mut done, mut refused) = (0usize, 0usize);
        let (captures, graphs) = race(&s, Duration::from_secs(20), || {
            match m.fill(7) {
                Ok(()) => done += 1,
                Err(Error::Capturing { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
            true
        });
        println!("{done} memsets, {refused} refused, {captures} captures, {} graphs with nodes", graphs.len());
        assert!(done > 0 && captures > 0, "no race");
        if let Some(g) = graphs.first() {
            // What such a graph does once the buffer is gone.
            let exec = g.instantiate().unwrap();
            drop(m);
            exec.launch(&s).unwrap();
            s.synchronize().unwrap();
            panic!(
                "{} graphs captured a managed memset unseen; a launch after the drop: {:?}",
                graphs.len(),
                violations()
            );
        }
    });
}

// ------------------------------------------------------------------------------------------------
// Host copies that return while the copy may still run
// ------------------------------------------------------------------------------------------------

/// The synchronous host copies of pitched, managed and IPC buffers queue an asynchronous copy and
/// rely on `Stream::wait_for_memory` never to return while it may still run ("`src` stays
/// borrowed until the stream is synchronised below"). When the wait failed, `wait_for_memory`
/// polled the stream, but returned at once on the first *error* of the question, with the copy
/// still queued. The wait is now for an event: it fails here, and so does every question to the
/// event (the stream is asked instead). Into registered (or pinned) host memory the copy is
/// asynchronous: it writes the caller's slice after the borrow ended (with `to_vec`, into a
/// freed `Vec`).
#[test]
fn pitched_copy_to_host_never_returns_while_the_copy_runs() {
    let fail = "cuEventSynchronize:1+:999,cuEventQuery:1+:999";
    run_with_fake(&[("CUDRV_FAKE_FAIL", fail), ("CUDRV_FAKE_DELAY_US", "150000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut b = DeviceBuffer2D::<u32>::zeroed(16, 4, &s).unwrap();
        b.fill(7).unwrap(); // with the memset, 300 ms of queued work
        let mut host = vec![0u32; 64];
        let mut reg = register_host(&dev, &mut host).unwrap();
        let started = Instant::now();
        let r = b.copy_to_host(reg.as_mut_slice());
        let took = started.elapsed();
        assert!(r.is_err(), "{r:?}");
        assert!(fake_faults_injected() >= 2, "both the wait and the question failed");
        // The call returned: the slice is the caller's again.
        reg.as_mut_slice().fill(1);
        std::thread::sleep(Duration::from_millis(600));
        let after = reg.as_mut_slice().to_vec();
        assert_eq!(after, vec![1; 64], "the copy wrote the slice {took:?} after the call returned");
    });
}

// ------------------------------------------------------------------------------------------------
// IPC handles are untrusted bytes
// ------------------------------------------------------------------------------------------------

/// A copy of `h` whose size field says `bytes` and whose offset field says `offset`.
fn forged(h: &IpcMemHandle, offset: u64, bytes: u64) -> IpcMemHandle {
    let mut raw = h.to_bytes();
    raw[80..88].copy_from_slice(&offset.to_le_bytes());
    raw[88..96].copy_from_slice(&bytes.to_le_bytes());
    IpcMemHandle::from_bytes(&raw).unwrap()
}

/// An `IpcMemHandle` comes from another process as bytes (`FromStr`, `from_bytes`), and
/// `IpcBuffer::open` / `ImportedPool::open` take its offset and size as they are: the buffer they
/// return reaches past the mapped allocation, and its safe copies read and write whatever device
/// memory lies there (other allocations of the importing process). Opening must check the range
/// against the mapping (`cuMemGetAddressRange` of the mapped base).
#[test]
fn ipc_open_refuses_a_handle_larger_than_its_allocation() {
    if let Some(data) = peer_data("importer") {
        let mut parts = data.split(',');
        let legacy: IpcMemHandle = parts.next().unwrap().parse().unwrap();
        let pool_raw: Option<u64> = parts.next().map(|p| p.parse().unwrap());
        let pool_h: Option<IpcMemHandle> = parts.next().map(|p| p.parse().unwrap());
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        // The honest handle opens; a handle that claims more, or lies about the offset, must not.
        let honest = IpcBuffer::<u32>::open(&legacy, &s).unwrap();
        assert_eq!(honest.to_vec().unwrap(), vec![0x5A5A; 64]);
        let mut opened = Vec::new();
        for (what, h) in [
            ("a size of 1 MiB", forged(&legacy, 0, 1 << 20)),
            ("an offset of 1 MiB", forged(&legacy, 1 << 20, 256)),
            ("an offset of 192 bytes and 64 KiB", forged(&legacy, 192, 64 << 10)),
        ] {
            if let Ok(b) = IpcBuffer::<u32>::open(&h, &s) {
                let _ = b.to_vec();
                opened.push(format!("legacy with {what}"));
            }
        }
        if let (Some(raw), Some(h)) = (pool_raw, pool_h) {
            let pool =
                ImportedPool::import(&dev, PoolShareableHandle { handle_type: ShareableHandleType::PosixFd, raw })
                    .unwrap();
            let ok = pool.open::<u32>(&h, &s).unwrap();
            assert_eq!(ok.to_vec().unwrap(), vec![0xA5A5; 64]);
            drop(ok);
            if let Ok(b) = pool.open::<u32>(&forged(&h, 0, 1 << 20), &s) {
                let _ = b.to_vec();
                opened.push("pool with a size of 1 MiB".into());
            }
        }
        s.synchronize().unwrap();
        assert!(opened.is_empty(), "opened {opened:?}; the copies did: {:?}", violations());
        println!("peer done: importer");
        return;
    }
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &s) {
            return;
        }
        let sync = Arc::new(SyncResource::new(&dev).unwrap());
        let a = DeviceBuffer::from_slice_in(&[0x5A5Au32; 64], &s, sync).unwrap();
        let mut data = a.ipc_handle().unwrap().to_string();
        let shared = if crate::oldest() {
            None
        } else {
            let pool = Arc::new(SharedPool::with_handle_type(&dev, ShareableHandleType::PosixFd).unwrap());
            let exported = pool.export().unwrap();
            let b = DeviceBuffer::from_slice_in(&[0xA5A5u32; 64], &s, pool.clone()).unwrap();
            data = format!("{data},{},{}", exported.raw, b.ipc_handle().unwrap());
            Some((b, pool))
        };
        s.synchronize().unwrap();
        run_peer("importer", &data);
        drop((a, shared));
    });
}

// ------------------------------------------------------------------------------------------------
// Host registration
// ------------------------------------------------------------------------------------------------

/// `HostRegistration`'s drop says it "never runs inside a host function" because the guard
/// borrows its slice. A `'static` slice (`Box::leak`) lifts that: the guard moves into a host
/// function, its drop fails to bind the context there (`InHostFunction`), and the memory stays
/// page-locked for the rest of the process (the drop is not deferred as other drops are).
#[test]
fn host_registration_dropped_in_a_host_function_is_unregistered() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mem: &'static mut [u32] = Box::leak(vec![3u32; 4096].into_boxed_slice());
        let (ptr, len) = (mem.as_mut_ptr(), mem.len());
        let reg = register_host(&dev, mem).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        s.launch_host_fn(move || {
            drop(reg);
            tx.send(()).unwrap();
        })
        .unwrap();
        rx.recv().unwrap();
        // The drop's error, if any, is kept for the next checked call.
        let synced = s.synchronize();
        let flushed = cudrv::flush_deferred_drops();
        println!("synchronize: {synced:?}; flush: {flushed:?}");
        // SAFETY: the guard that held the only reference is gone; the memory is leaked, so live.
        let again = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        let r = register_host(&dev, again);
        assert!(
            r.is_ok(),
            "registering the memory again: {r:?} (the first registration outlived its guard; its drop: {synced:?})"
        );
    });
}

// ------------------------------------------------------------------------------------------------
// Pitched copies with pinned memory during a capture
// ------------------------------------------------------------------------------------------------

/// `DeviceBuffer::copy_from_pinned_async` refuses a capture of its stream before anything else.
/// `DeviceBuffer2D::copy_from_pinned_async` (and `copy_to_pinned_async`) call
/// `PinnedBuffer::prepare` first, which makes the capturing stream wait on the event of a copy
/// still pending with the pinned buffer on another stream: an event recorded outside the
/// capture, which the driver refuses with `CUDA_ERROR_STREAM_CAPTURE_ISOLATION` and which
/// invalidates the caller's capture. The call should be refused with `Error::Capturing` and leave
/// the capture alone. (The pitched versions also let go of the gate between the copy and
/// `commit`: a capture begun there takes the tracking event's record.)
#[test]
fn pitched_pinned_copy_during_a_capture_is_refused_and_leaves_it_valid() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let u = Stream::new(&dev).unwrap();
        let pinned = PinnedBuffer::from_slice(&dev, &[5u32; 64]).unwrap();
        let mut other = DeviceBuffer::<u32>::zeroed(64, &u).unwrap();
        other.copy_from_pinned_async(&pinned).unwrap(); // pending on `u`
        let mut b = DeviceBuffer2D::<u32>::zeroed(8, 8, &s).unwrap();
        let mut flat = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
        s.synchronize().unwrap();
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // The 1D buffer: refused, nothing touched.
        let r1 = flat.copy_from_pinned_async(&pinned);
        assert!(matches!(r1, Err(Error::Capturing { .. })), "{r1:?}");
        let r2 = b.copy_from_pinned_async(&pinned);
        let ended = s.end_capture();
        assert!(matches!(r2, Err(Error::Capturing { .. })), "DeviceBuffer2D: {r2:?}");
        let g = ended.unwrap_or_else(|e| panic!("the refused call invalidated the capture: {e}"));
        assert!(g.nodes().unwrap().is_empty());
        drop((other, pinned));
    });
}

/// `PinnedBuffer::prepare` orders the new copy's stream after the copies still pending with the
/// buffer. A pending copy whose tracking event could not be recorded is tracked by its stream, and
/// `order_before` then calls `wait_stream_in_gate` on that stream without holding its gate or
/// looking at its capture: when that stream has begun a capture meanwhile, the copy's stream
/// joins it, and the new pinned copy (and its tracking record) become part of the graph; the
/// call returns `Ok`. Once the capture ends, the tracking event is "as before the capture" (never
/// recorded), so `as_slice` returns at once and every launch of the graph writes the pinned
/// memory under the shared borrow (or after its free); the graph does not keep the device
/// buffer alive either.
#[test]
fn pinned_copy_never_joins_a_capture_through_a_pending_copy() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuEventRecord:1:999")], || {
        let dev = Device::get(0).unwrap();
        let s1 = Stream::new(&dev).unwrap();
        let s2 = Stream::new(&dev).unwrap();
        let d1 = DeviceBuffer::from_slice(&[0xD1u32; 64], &s1).unwrap();
        let d2 = DeviceBuffer::from_slice(&[0xD2u32; 64], &s2).unwrap();
        let mut dst = PinnedBuffer::<u32>::new(&dev, 64).unwrap();
        d1.copy_to_pinned_async(&mut dst).unwrap(); // pending on s1, without an event
        assert_eq!(fake_faults_injected(), 1, "the tracking record of the first copy failed");
        s1.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let r = d2.copy_to_pinned_async(&mut dst);
        let joined = s2.capture_status().unwrap();
        println!("a pinned copy on s2 while s1 captures: {r:?}; s2 is {joined:?}");
        if joined != CaptureStatus::None {
            s1.wait_stream(&s2).unwrap(); // joined back, as the driver requires to end the capture
        }
        let graph = s1.end_capture().unwrap();
        let nodes = graph.nodes().unwrap().len();
        let exec = graph.instantiate().unwrap();
        let view = dst.as_slice().unwrap(); // waits for every copy queued with `dst`
        let seen = view.to_vec();
        exec.launch(&s1).unwrap();
        s1.synchronize().unwrap();
        assert_eq!(view, &seen[..], "a graph ({nodes} nodes) wrote the pinned memory under a shared borrow");
        assert!(r.is_err() || seen == [0xD2; 64], "{r:?} but the copy did not run: {:?}", &seen[..4]);
    });
}

// ------------------------------------------------------------------------------------------------
// IPC buffers under driver faults
// ------------------------------------------------------------------------------------------------

/// `free_after_waiting` promises that "a failed wait leaks the memory (its work may still run)":
/// it does not call the free. But the free closure of an `IpcBuffer` owns the mapping
/// (`Arc<LegacyMapping>`), and dropping the uncalled closure drops it: the last buffer of an
/// allocation closes the mapping (`cuIpcCloseMemHandle`) while its queued work still uses it.
#[test]
fn ipc_buffer_keeps_its_mapping_when_the_wait_fails() {
    if let Some(data) = peer_data("importer") {
        let h: IpcMemHandle = data.parse().unwrap();
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut b = IpcBuffer::<u32>::open(&h, &s).unwrap();
        b.memset(0x11).unwrap(); // runs 200 ms from now
        drop(b); // the wait fails: the mapping must stay
        assert!(fake_faults_injected() >= 2, "the drop's wait and question failed");
        let v = violations();
        assert!(v.is_empty(), "the mapping was closed under the queued memset: {v:?}");
        println!("peer done: importer");
        return;
    }
    let fail = "cuEventSynchronize:1+:999,cuEventQuery:1+:999";
    run_with_fake(&[("CUDRV_FAKE_FAIL", fail), ("CUDRV_FAKE_DELAY_US", "200000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if crate::oldest() && !cfg!(target_os = "linux") {
            return; // no IPC there (ipc_refused_on_oldest synchronises, which fails here)
        }
        let sync = Arc::new(SyncResource::new(&dev).unwrap());
        let a = DeviceBuffer::<u32>::zeroed_in(64, &s, sync).unwrap(); // no synchronize
        run_peer("importer", &a.ipc_handle().unwrap().to_string());
        std::mem::forget(a); // its drop would fail to wait too
    });
}

// ------------------------------------------------------------------------------------------------
// Behaviour checked and found sound
// ------------------------------------------------------------------------------------------------

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

/// Pinned copies on two streams: a later copy with the same pinned buffer waits (on the GPU) for
/// the earlier one of another stream, and host access waits for both.
#[test]
fn pinned_copies_on_two_streams_are_ordered_and_waited_for() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "40000")], || {
        let dev = Device::get(0).unwrap();
        let s1 = Stream::new(&dev).unwrap();
        let s2 = Stream::new(&dev).unwrap();
        let mut d = DeviceBuffer::<u32>::zeroed(64, &s1).unwrap();
        d.fill(0xAB).unwrap();
        let mut p = PinnedBuffer::<u32>::new(&dev, 64).unwrap();
        d.copy_to_pinned_async(&mut p).unwrap(); // pending on s1, behind ~120 ms of work
        let mut b = DeviceBuffer2D::<u32>::zeroed(16, 4, &s2).unwrap();
        b.copy_from_pinned_async(&p).unwrap(); // on s2: must read after s1's copy wrote
        assert_eq!(b.to_vec().unwrap(), vec![0xAB; 64], "the 2D copy read the pinned memory too early");
        let mut back = PinnedBuffer::<u32>::new(&dev, 64).unwrap();
        b.fill(0xCD).unwrap();
        b.copy_to_pinned_async(&mut back).unwrap();
        assert_eq!(back.as_slice().unwrap(), [0xCD; 64]);
        drop(p); // waits for both copies, then frees
        assert!(violations().is_empty(), "{:?}", violations());
    });
}

/// A pitched buffer used on another stream (copied into a buffer there, launched there) is freed
/// only after that stream's work: no use after free, whichever stream is slow.
#[test]
fn pitched_and_managed_frees_wait_for_every_stream_they_were_used_on() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "30000")], || {
        let dev = Device::get(0).unwrap();
        let module = cudrv::Module::from_ptx(&dev, PTX).unwrap();
        let spin = module.function("spin_fill_u32").unwrap();
        let s = Stream::new(&dev).unwrap();
        let u = Stream::new(&dev).unwrap();
        let live = fake_report().live_allocations;
        let b2 = DeviceBuffer2D::from_slice(&(0..64u32).collect::<Vec<_>>(), 16, 4, &s).unwrap();
        let b3 = DeviceBuffer3D::<u32>::zeroed((4, 4, 4), &s).unwrap();
        let mut m = ManagedBuffer::<u32>::zeroed(64, &s).unwrap();
        let mut flat = DeviceBuffer::<u32>::zeroed(64, &u).unwrap();
        b2.copy_to_buffer(&mut flat).unwrap(); // on u
        // SAFETY: spin_fill_u32(u32*, u32, u64, u64) spins 50 ms, then writes 64 elements of
        // each buffer's first row (16 of b3's: n is 16 there).
        unsafe {
            spin.launch(cudrv::launch::LaunchConfig::for_num_elems(64), &u, (&mut m, 5u32, 64u64, 50_000u64)).unwrap();
            spin.launch(cudrv::launch::LaunchConfig::for_num_elems(16), &u, (&b3, 6u32, 16u64, 50_000u64)).unwrap();
        }
        drop((b2, b3)); // wait for u, then cuMemFree
        assert_eq!(m.as_slice().unwrap(), [5; 64], "host access waits for the launch on u");
        drop(m);
        assert_eq!(flat.to_vec().unwrap(), (0..64).collect::<Vec<_>>());
        drop(flat);
        u.synchronize().unwrap();
        assert!(violations().is_empty(), "{:?}", violations());
        // The device's resource may cache `flat`'s memory (a StreamOrderedPool, where the driver
        // has no pools): given back first.
        dev.memory_resource().unwrap().trim(0).unwrap();
        assert_eq!(fake_report().live_allocations, live);
    });
}

/// Ranges, rectangles, boxes and strides outside a pitched buffer, or whose arithmetic overflows,
/// are refused before any driver call; sizes that overflow are refused by every constructor.
#[test]
fn out_of_range_rectangles_boxes_and_sizes_are_refused() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let data: Vec<u32> = (0..48).collect();
        let mut a = DeviceBuffer2D::from_slice(&data, 8, 6, &s).unwrap();
        let b = DeviceBuffer2D::<u32>::zeroed(4, 4, &s).unwrap();
        let inv = |r: cudrv::Result<()>| assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        inv(a.view(0..9, ..).map(drop));
        let (hi, lo) = (3, 2);
        inv(a.view(.., hi..lo).map(drop));
        inv(a.view(..=usize::MAX, ..).map(drop));
        inv(a.view((std::ops::Bound::Excluded(usize::MAX), std::ops::Bound::Unbounded), ..).map(drop));
        inv(a.row(6).map(drop));
        let v = a.view(2..6, 1..4).unwrap();
        inv(v.view(0..5, ..).map(drop));
        inv(v.row(3).map(drop));
        let bv = b.as_view();
        inv(a.copy_rect_from((5, 0), &bv));
        inv(a.copy_rect_from((0, 3), &bv));
        inv(a.copy_rect_from((usize::MAX, 0), &bv));
        inv(a.copy_rect_from((0, usize::MAX - 1), &bv));
        a.copy_rect_from((4, 2), &bv).unwrap();
        let got = a.to_vec().unwrap();
        for (i, g) in got.iter().enumerate() {
            let (x, y) = (i % 8, i / 8);
            let want = if (4..8).contains(&x) && (2..6).contains(&y) { 0 } else { i as u32 };
            assert_eq!(*g, want, "({x}, {y})");
        }
        // Host strides: shorter than the width, a slice too short, a stride whose bytes overflow.
        inv(a.copy_from_host_strided(&data, 7));
        inv(a.copy_from_host_strided(&data[..47], 8));
        let mut row = DeviceBuffer2D::<u32>::zeroed(4, 1, &s).unwrap();
        inv(row.copy_from_host_strided(&[1, 2, 3, 4], usize::MAX));
        let mut out = vec![0u32; 40];
        inv(a.copy_to_host_strided(&mut out, 8));
        // Boxes.
        let v3: Vec<u16> = (0..4 * 3 * 2).collect();
        let src = DeviceBuffer3D::from_slice(&v3, (4, 3, 2), &s).unwrap();
        let mut dst = DeviceBuffer3D::<u16>::zeroed((2, 2, 2), &s).unwrap();
        for (at, from, ext) in [
            ((0, 0, 0), (3, 0, 0), (2, 1, 1)),
            ((1, 0, 0), (0, 0, 0), (2, 1, 1)),
            ((0, 0, 0), (0, 0, 1), (1, 1, 2)),
            ((usize::MAX, 0, 0), (0, 0, 0), (1, 1, 1)),
            ((0, 0, 0), (0, usize::MAX, 0), (1, 2, 1)),
        ] {
            inv(dst.copy_box_from(at, &src, from, ext));
        }
        inv(src.slice(2).map(drop));
        dst.copy_box_from((0, 0, 0), &src, (2, 1, 1), (2, 2, 1)).unwrap();
        assert_eq!(dst.slice(0).unwrap().to_vec().unwrap(), [18, 19, 22, 23]);
        // Sizes.
        assert!(matches!(PinnedBuffer::<u64>::new(&dev, usize::MAX / 4), Err(Error::InvalidArgument(_))));
        assert!(matches!(ManagedBuffer::<u64>::zeroed(usize::MAX / 4, &s), Err(Error::InvalidArgument(_))));
        assert!(matches!(DeviceBuffer2D::<u64>::zeroed(usize::MAX / 4, 1, &s), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            DeviceBuffer3D::<u8>::zeroed((1 << 40, 1 << 20, 1 << 10), &s),
            Err(Error::InvalidArgument(_))
        ));
        assert!(violations().is_empty(), "{:?}", violations());
    });
}

/// Driver faults in pitched, managed and pinned operations: the call fails, nothing is queued or
/// tracked, nothing leaks, nothing panics.
#[test]
fn faults_in_pitched_managed_and_pinned_calls_leave_nothing_behind() {
    // A failed 2D copy with pinned memory: its tracking event goes, the pinned buffer is free.
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuMemcpy2DAsync_v2:1+:999"), ("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let events = fake_report().live_events;
        let mut b = DeviceBuffer2D::<u32>::zeroed(8, 8, &s).unwrap();
        let mut p = PinnedBuffer::from_slice(&dev, &[3u32; 64]).unwrap();
        let e = b.copy_from_pinned_async(&p).unwrap_err();
        assert_eq!(e.code(), Some(CUresult::CUDA_ERROR_UNKNOWN));
        let e = b.copy_to_pinned_async(&mut p).unwrap_err();
        assert_eq!(e.code(), Some(CUresult::CUDA_ERROR_UNKNOWN));
        assert_eq!(fake_faults_injected(), 2);
        assert_eq!(p.as_mut_slice().unwrap(), [3; 64]);
        assert_eq!(fake_report().live_events, events, "the tracking events were destroyed");
        drop((b, p));
        s.synchronize().unwrap();
    });
    // A failed event creation: nothing queued.
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuEventCreate:1+:999")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut b = DeviceBuffer2D::<u32>::zeroed(8, 8, &s).unwrap();
        let p = PinnedBuffer::from_slice(&dev, &[3u32; 64]).unwrap();
        assert!(b.copy_from_pinned_async(&p).is_err());
        assert!(fake_faults_injected() >= 1);
        assert_eq!(b.to_vec().unwrap(), vec![0; 64]);
    });
    // Allocation failures: typed errors, no leak.
    let fail = "cuMemAllocPitch_v2:1:2,cuMemHostAlloc:1:2,cuMemAllocManaged:1:2";
    run_with_fake(&[("CUDRV_FAKE_FAIL", fail)], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let live = fake_report().live_allocations;
        match DeviceBuffer2D::<u32>::zeroed(8, 8, &s) {
            Err(Error::OutOfMemory { resource: "cuMemAllocPitch", .. }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(PinnedBuffer::<u32>::new(&dev, 8).unwrap_err().code(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(ManagedBuffer::<u32>::zeroed(8, &s).unwrap_err().code(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(fake_faults_injected(), 3);
        assert_eq!(fake_report().live_allocations, live);
        // The faults are spent: the same calls work.
        drop((DeviceBuffer2D::<u32>::zeroed(8, 8, &s).unwrap(), PinnedBuffer::<u32>::new(&dev, 8).unwrap()));
        drop(ManagedBuffer::<u32>::zeroed(8, &s).unwrap());
        s.synchronize().unwrap();
        assert_eq!(fake_report().live_allocations, live);
    });
    // A failed free: the drop does not panic, the error is kept for the next checked call, and
    // the memory stays the driver's (a leak, the only sound choice).
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuMemFree_v2:1+:999,cuMemFreeHost:1:999")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let live = fake_report().live_allocations;
        drop(DeviceBuffer2D::<u32>::zeroed(8, 8, &s).unwrap());
        drop(ManagedBuffer::<u32>::zeroed(8, &s).unwrap());
        drop(PinnedBuffer::<u32>::new(&dev, 8).unwrap());
        assert_eq!(fake_faults_injected(), 3);
        match s.synchronize() {
            Err(Error::Deferred(e)) => assert_eq!(e.code(), Some(CUresult::CUDA_ERROR_UNKNOWN)),
            other => panic!("{other:?}"),
        }
        assert_eq!(fake_report().live_allocations, live + 3);
    });
}

/// A driver shutdown (process teardown) under live pitched, managed, pinned and IPC objects with
/// work in flight: host access fails with an error, drops neither panic nor hang.
#[test]
fn a_shutdown_under_live_objects_neither_panics_nor_hangs() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let u = Stream::new(&dev).unwrap();
        let mut b2 = DeviceBuffer2D::<u32>::zeroed(16, 4, &s).unwrap();
        let b3 = DeviceBuffer3D::<u32>::zeroed((4, 4, 4), &s).unwrap();
        let m = ManagedBuffer::<u32>::zeroed(64, &s).unwrap();
        m.record_use(&u).unwrap();
        b3.record_use(&u).unwrap();
        let mut p = PinnedBuffer::<u32>::new(&dev, 64).unwrap();
        b2.copy_to_pinned_async(&mut p).unwrap();
        let src = PinnedBuffer::from_slice(&dev, &[1u32; 64]).unwrap();
        b2.copy_from_pinned_async(&src).unwrap();
        let mut host = vec![0u32; 64];
        let reg = register_host(&dev, &mut host).unwrap();
        let ev =
            if dev.capabilities().unwrap().ipc_events { Some(cudrv::ipc::IpcEvent::new(&dev).unwrap()) } else { None };
        if let Some(ev) = &ev {
            ev.record(&s).unwrap();
        }
        cudrv_test_support::fake_shutdown();
        within(Duration::from_secs(20), "host access and drops after a shutdown", || {
            assert!(p.as_slice().is_err());
            assert!(m.as_slice().is_err() || !dev.capabilities().unwrap().concurrent_managed_access);
            assert!(b2.to_vec().is_err());
            drop((reg, ev));
            drop((b2, b3, m, p, src));
            drop((s, u));
            let _ = cudrv::flush_deferred_drops();
        });
    });
}

/// IPC handles: a legacy handle of the buffer's own process is the driver's error, the handle
/// round-trips through bytes and text, and the sizes that do not divide are refused (pinned down
/// beside the forged handles above).
#[test]
fn ipc_handle_sizes_must_be_whole_elements() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &s) {
            return;
        }
        let a = DeviceBuffer::from_slice_in(&[1u8; 10], &s, Arc::new(SyncResource::new(&dev).unwrap())).unwrap();
        let h = a.ipc_handle().unwrap();
        assert_eq!(h.byte_len(), 10);
        assert!(matches!(IpcBuffer::<u32>::open(&h, &s), Err(Error::InvalidArgument(_))));
        assert_eq!(
            IpcBuffer::<u8>::open(&h, &s).unwrap_err().code(),
            Some(CUresult::CUDA_ERROR_INVALID_CONTEXT),
            "a handle of this process"
        );
        let empty = DeviceBuffer::<u8>::zeroed_in(0, &s, Arc::new(SyncResource::new(&dev).unwrap())).unwrap();
        assert!(matches!(empty.ipc_handle(), Err(Error::InvalidArgument(_))));
    });
}

//! Review 23a: soundness and driver faults in streams, host functions, events, devices and
//! `DeviceBuffer`. Tests that reproduced a defect say so (they failed before the fix that came
//! with them); the others pin down behaviour that the review checked.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cudrv::graph::CaptureMode;
use cudrv::launch::LaunchConfig;
use cudrv::memory::{DeviceBuffer, DeviceBuffer2D, DevicePtr, MemoryResource, ResourceKind, SyncResource};
use cudrv::module::Module;
use cudrv::{Device, Error, Event, Stream};
use cudrv_test_support::{fake_report, run_with_fake};

use crate::slowed::{Slowed, slowed, under_way};
use crate::within_10s;

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

// ------------------------------------------------------------------------------------------------
// Waits made by a memory resource, which runs under the stream's gate
// ------------------------------------------------------------------------------------------------

/// A resource that orders each allocation and free after an event (as RMM's pool does with the
/// event of a block freed on another stream): resource.rs says that queueing work on the stream,
/// and waiting for it, are fine in `allocate` and `deallocate`.
#[derive(Debug)]
struct EventOrdered {
    inner: SyncResource,
    event: Event,
}

// SAFETY: forwards to `SyncResource`, after a wait that only orders the stream.
unsafe impl MemoryResource for EventOrdered {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<DevicePtr> {
        stream.wait_event(&self.event)?;
        self.inner.allocate(bytes, stream)
    }
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        stream.wait_event(&self.event)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn kind(&self) -> ResourceKind {
        ResourceKind::Custom
    }
}

/// DEFECT (failed before the fix: the allocation hung for good). While any capture that cudrv
/// tracks is active in the process (here on an unrelated stream), `Stream::wait_event` marks the
/// waiting stream as joining a capture (`StreamKey::joining`), which waits until no gate of the
/// stream is held. A `DeviceBuffer` holds the stream's gate around its resource's `allocate` and
/// `deallocate`, so a resource that waits on an event there (documented as fine) waited for its
/// own thread's gate: `uninit_in`, and a buffer's drop, never returned. The join is now marked
/// only where the calling thread holds no gate (else it is tracked as cudrv's own waits under a
/// gate are), and the allocation, the free and the data go through.
#[test]
fn a_resource_that_waits_on_an_event_does_not_hang_while_a_capture_is_active() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let (s, c) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let event = Event::new(&dev).unwrap();
        event.record(&c).unwrap();
        let resource = Arc::new(EventOrdered { inner: SyncResource::new(&dev).unwrap(), event });
        c.begin_capture(CaptureMode::Relaxed).unwrap();
        let (r, s2) = (resource.clone(), s.clone());
        let got = within_10s(move || {
            let buf = DeviceBuffer::from_slice_in(&[1u32, 2, 3, 4], &s2, r)?;
            let read = buf.to_vec()?;
            drop(buf);
            Ok::<_, Error>(read)
        });
        assert!(got.is_some(), "an allocation whose resource waits on an event hung while a capture was active");
        assert_eq!(got.unwrap().unwrap(), [1, 2, 3, 4]);
        drop(c.end_capture().unwrap());
        s.synchronize().unwrap();
        crate::assert_no_leaks_but_streams();
    });
}

// ------------------------------------------------------------------------------------------------
// Calls the driver refuses during a capture, or inside a host function
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `query` returned the driver's error 900, and the capture was
/// invalidated, so `end_capture` failed with 901). `Stream::synchronize` refuses a capturing
/// stream with `Error::Capturing` because the driver would invalidate the capture; `Stream::query`
/// asked the driver anyway: a thread that polls a stream (which is `Sync`) broke another thread's
/// capture. It now refuses as `synchronize` does, and the capture goes on.
#[test]
fn querying_a_capturing_stream_is_refused_and_leaves_the_capture_intact() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        buf.fill(5).unwrap();
        let s2 = s.clone();
        let queried = std::thread::spawn(move || s2.query()).join().unwrap();
        assert!(matches!(queried, Err(Error::Capturing { .. })), "{queried:?}");
        assert!(matches!(s.synchronize(), Err(Error::Capturing { .. })));
        let graph = s.end_capture().expect("a query from another thread invalidated the capture");
        let exec = graph.instantiate().unwrap();
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert!(s.query().unwrap(), "the stream is idle after synchronize");
        assert_eq!(buf.to_vec().unwrap(), vec![5; 64]);
    });
}

/// DEFECT (failed before the fix: `uuid` and `uuid_string` called `cuDeviceGetUuid` from the
/// driver's host-function thread and returned `Ok`). Review 22b made `Device`'s queries refuse
/// inside a host function (the driver forbids CUDA calls there: they may fail or deadlock); the
/// UUID was left out. It now returns `Error::InHostFunction` there too, and works outside.
#[test]
fn device_uuid_refuses_inside_a_host_function() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (tx, rx) = mpsc::channel();
        s.launch_host_fn(move || {
            let _ = tx.send((format!("{:?}", dev.uuid()), format!("{:?}", dev.uuid_string())));
        })
        .unwrap();
        s.synchronize().unwrap();
        let (uuid, text) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(uuid.starts_with("Err(InHostFunction"), "Device::uuid inside a host function: {uuid}");
        assert!(text.starts_with("Err(InHostFunction"), "Device::uuid_string inside a host function: {text}");
        let outside = dev.uuid_string().unwrap();
        assert!(outside.starts_with("GPU-") && outside.len() == 40, "{outside}");
    });
}

/// Pins (checked sound; it would hang with the join's mark taken before the host-function check):
/// inside a host function, with a capture active, `wait_stream` and `wait_event` return
/// `Error::InHostFunction` before they mark the waiting stream as joining, which waits for that
/// stream's gate: here the main thread holds it, in a `synchronize` that waits for this very
/// host function.
#[test]
fn waits_in_a_host_function_refuse_before_they_wait_for_a_gate() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let (s, t, origin) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        origin.begin_capture(CaptureMode::Relaxed).unwrap();
        let event = Event::new(&dev).unwrap();
        event.record(&origin).unwrap();
        let (tx, rx) = mpsc::channel();
        let (t2, origin2) = (t.clone(), origin.clone());
        s.launch_host_fn(move || {
            // Time for the main thread to enter `t`'s gate and wait for this host function.
            std::thread::sleep(Duration::from_millis(100));
            let _ = tx.send((format!("{:?}", t2.wait_stream(&origin2)), format!("{:?}", t2.wait_event(&event))));
        })
        .unwrap();
        t.wait_stream(&s).unwrap();
        let t3 = t.clone();
        let synced = within_10s(move || t3.synchronize());
        assert!(synced.is_some(), "a host function waited for a gate held by a synchronize that waits for it");
        synced.unwrap().unwrap();
        let (waited_stream, waited_event) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(waited_stream.starts_with("Err(InHostFunction"), "{waited_stream}");
        assert!(waited_event.starts_with("Err(InHostFunction"), "{waited_event}");
        drop(origin.end_capture().unwrap());
    });
}

// ------------------------------------------------------------------------------------------------
// Where a stream stood when it joined a capture
// ------------------------------------------------------------------------------------------------

/// Queues `spin_fill_u32(out, value, n, spin_us)` on `stream`.
fn spin_fill(module: &Module, stream: &Stream, out: &mut DeviceBuffer<u32>, value: u32, spin_us: u64) {
    let f = module.function("spin_fill_u32").unwrap();
    let n = out.len() as u64;
    // SAFETY: spin_fill_u32(u32* out, u32 value, u64 n, u64 spin_us) writes out[0..n].
    unsafe { f.launch(LaunchConfig::for_num_elems(out.len()), stream, (out, value, n, spin_us)).unwrap() };
}

/// A `SyncResource` whose allocations hold the stream's gate for about 300 ms, and what tells
/// when one is under way.
fn slow(dev: &Device) -> (Arc<Slowed>, std::sync::mpsc::Receiver<()>) {
    slowed(SyncResource::new(dev).unwrap(), Duration::from_millis(300))
}

/// DEFECT (failed before the fix: the buffer read 7, the freed buffer's kernel having written
/// it after the graph). `Stream::wait_stream` on a capturing stream records where the waiting
/// stream stands (the event that the graph's first launch waits for), and only then marks the
/// stream as joining, which waits until no other thread is between its look at the stream and
/// its work there. Work queued meanwhile on the stream (here while another thread's allocation
/// holds its gate) is plain work, after that event: a kernel writing `b1`, `b1`'s free, and `b2`
/// allocated from the stream's cache, on the same memory. Used in the capture on its own stream,
/// `b2` counts as allocated before the join (its stream takes part in the capture), so the graph,
/// launched on a third stream, wrote `b2` while the kernel still ran on that memory, which then
/// overwrote it. The event is now recorded under the mark, after every such piece of work: the
/// graph's launch waits for the kernel, and `b2` reads what the graph wrote.
#[test]
fn a_join_notes_where_the_stream_stands_after_work_queued_while_it_waited_to_mark() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || join_after_queued_work(|s, origin| s.wait_stream(origin)));
}

/// DEFECT, as above (failed before the fix in the same way), for a join through
/// `Stream::wait_event` on an event recorded in the capture.
#[test]
fn a_join_through_an_event_notes_where_the_stream_stands_after_work_queued_while_it_waited_to_mark() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        join_after_queued_work(|s, origin| {
            let event = Event::new(&origin.device())?;
            event.record(origin)?;
            s.wait_event(&event)
        })
    });
}

/// The body of the two tests above: `join` makes `s` join `origin`'s capture.
fn join_after_queued_work(join: fn(&Stream, &Stream) -> cudrv::Result<()>) {
    {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let (origin, s, launch) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let n = 1024;
        // An allocation that holds `s`'s gate for about 300 ms.
        let (slow, began) = slow(&dev);
        let s1 = s.clone();
        let allocator = std::thread::spawn(move || DeviceBuffer::<u32>::zeroed_in(n, &s1, slow).unwrap());
        under_way(&began);
        origin.begin_capture(CaptureMode::Relaxed).unwrap();
        let (s2, origin2) = (s.clone(), origin.clone());
        let joiner = std::thread::spawn(move || join(&s2, &origin2));
        std::thread::sleep(Duration::from_millis(50));
        // While the joiner waits for the allocation's gate: a kernel on `b1`, its free, and `b2`
        // from the same memory (the pool's cache of `s`).
        let mut b1 = DeviceBuffer::<u32>::zeroed(n, &s).unwrap();
        spin_fill(&module, &s, &mut b1, 7, 1_000_000);
        let b1_ptr = b1.as_raw();
        drop(b1);
        // SAFETY: written by the graph below before it is read.
        let mut b2 = unsafe { DeviceBuffer::<u32>::uninit(n, &s).unwrap() };
        assert_eq!(b2.as_raw(), b1_ptr, "the pool reuses the block freed on the stream");
        joiner.join().unwrap().unwrap();
        let slow_buffer = allocator.join().unwrap();
        // `s` takes part in the capture now: `b2`'s fill is the graph's.
        assert!(matches!(s.query(), Err(Error::Capturing { .. })), "s joined the capture");
        b2.fill(9).unwrap();
        origin.wait_stream(&s).unwrap();
        let exec = origin.end_capture().unwrap().instantiate().unwrap();
        exec.launch(&launch).unwrap();
        launch.synchronize().unwrap();
        s.synchronize().unwrap();
        let got = b2.to_vec().unwrap();
        let sevens = got.iter().filter(|&&v| v == 7).count();
        assert_eq!(sevens, 0, "the graph wrote b2 before the freed b1's kernel was done with it (then it wrote 7s)");
        assert_eq!(got, vec![9; n]);
        assert_eq!(slow_buffer.to_vec().unwrap(), vec![0; n]);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    }
}

/// DEFECT in `Stream::begin_capture` (graph.rs, not this review's to change; see the report): as
/// above for the stream that begins the capture. `begin_capture` records where the stream
/// stands, then marks it, which waits for the gate that another thread's allocation holds: work
/// queued meanwhile (a kernel on `b1`, its free, `b2` from the same memory) is not covered, and
/// the graph launched on another stream writes `b2` while the kernel still runs there. Fails
/// until `mark_before_join` moves after `mark_capture_starting` in `begin_capture`.
#[test]
fn a_capture_notes_where_its_stream_stands_after_work_queued_while_it_waited_to_mark() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let (s, launch) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let n = 64;
        let (slow, began) = slow(&dev);
        let s1 = s.clone();
        let allocator = std::thread::spawn(move || DeviceBuffer::<u32>::zeroed_in(n, &s1, slow).unwrap());
        under_way(&began);
        let s2 = s.clone();
        let beginner = std::thread::spawn(move || s2.begin_capture(CaptureMode::Relaxed));
        std::thread::sleep(Duration::from_millis(50));
        let mut b1 = DeviceBuffer::<u32>::zeroed(n, &s).unwrap();
        spin_fill(&module, &s, &mut b1, 7, 1_000_000);
        let b1_ptr = b1.as_raw();
        drop(b1);
        // SAFETY: written by the graph below before it is read.
        let mut b2 = unsafe { DeviceBuffer::<u32>::uninit(n, &s).unwrap() };
        assert_eq!(b2.as_raw(), b1_ptr, "the pool reuses the block freed on the stream");
        beginner.join().unwrap().unwrap();
        let slow_buffer = allocator.join().unwrap();
        b2.fill(9).unwrap();
        let exec = s.end_capture().unwrap().instantiate().unwrap();
        exec.launch(&launch).unwrap();
        launch.synchronize().unwrap();
        s.synchronize().unwrap();
        let got = b2.to_vec().unwrap();
        let sevens = got.iter().filter(|&&v| v == 7).count();
        assert_eq!(sevens, 0, "the graph wrote b2 before the freed b1's kernel was done with it (then it wrote 7s)");
        assert_eq!(got, vec![9; n]);
        assert_eq!(slow_buffer.to_vec().unwrap(), vec![0; n]);
    });
}

// ------------------------------------------------------------------------------------------------
// Frees that go to the legacy default stream while a blocking stream captures
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: the drop of the `DeviceBuffer2D` never returned, and the
/// `DeviceBuffer`'s free invalidated the capture and leaked with a drop error 906). A buffer of
/// a per-thread default stream, dropped on another thread than that stream's, is freed on the
/// legacy default stream (cudrv's stand-in for another thread's per-thread stream). While a
/// blocking stream of the context captures (here the main thread's per-thread stream), the
/// driver refuses work on the legacy stream (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`) and
/// invalidates that capture. `DeviceBuffer`'s stream-ordered free (`cuMemFreeAsync` on the legacy
/// stream) broke the capture and leaked the memory; `DeviceBuffer2D`'s synchronous free waited for
/// the legacy stream (`Stream::wait_for_memory`), whose every synchronize, query and record
/// failed with that passing error: the drop polled for as long as the capture lasted, and here,
/// where the capture ends after the drop, for ever. Such frees now wait, on cudrv's thread, until
/// the legacy stream is no longer held by a capture: the drop returns, the capture ends intact,
/// and the memory goes back after it.
#[test]
fn a_free_on_the_legacy_stream_waits_for_a_blocking_capture_to_end() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let (buf, buf2d) = std::thread::spawn(move || {
            let own = Stream::per_thread(&dev).unwrap();
            let buf = DeviceBuffer::<u32>::from_slice(&[1; 64], &own).unwrap();
            let buf2d = DeviceBuffer2D::<u32>::zeroed(16, 4, &own).unwrap();
            own.synchronize().unwrap();
            (buf, buf2d)
        })
        .join()
        .unwrap();
        let p = Stream::per_thread(&dev).unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(64, &p).unwrap();
        p.begin_capture(CaptureMode::ThreadLocal).unwrap();
        x.fill(3).unwrap();
        assert!(within_10s(move || drop((buf, buf2d))).is_some(), "a drop on another thread hung during the capture");
        cudrv::flush_deferred_drops().unwrap();
        let exec = p.end_capture().expect("a drop on another thread invalidated the capture").instantiate().unwrap();
        exec.launch(&p).unwrap();
        p.synchronize().unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![3; 64]);
        drop((exec, x));
        p.synchronize().unwrap();
        // The frees ran once the capture ended.
        std::thread::sleep(Duration::from_millis(20));
        cudrv::flush_deferred_drops().unwrap();
        let deferred = dev.primary_context().unwrap().take_deferred();
        assert!(deferred.is_ok(), "a free failed: {deferred:?}");
        dev.memory_resource().unwrap().trim(0).unwrap();
        crate::assert_no_leaks_but_streams();
    });
}

/// DEFECT (failed before the fix: `memset_sync` did not return, polling a legacy stream that every
/// synchronize, query and record refused, and the capture was invalidated). Host access to a
/// buffer of the legacy default stream (or of another thread's per-thread stream) waits for that
/// stream; while a blocking stream of the context captures, the driver refuses that
/// (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`) and invalidates the capture, and cudrv's wait, which
/// must not return while queued work may still touch the memory, polled until the capture
/// ended: here never, as the capturing thread waits for the call. It is now refused with
/// `Error::Capturing` before anything is queued or waited for; the capture ends intact, and the
/// same call works after it.
#[test]
fn host_access_through_the_legacy_stream_is_refused_during_a_blocking_capture() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let legacy = Stream::legacy(&dev).unwrap();
        let buf = DeviceBuffer::<u32>::from_slice(&[1; 64], &legacy).unwrap();
        let p = Stream::per_thread(&dev).unwrap();
        p.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let got = within_10s(move || {
            let mut buf = buf;
            let refused = buf.memset_sync(0);
            let read = buf.to_vec();
            (buf, refused, read)
        });
        let Some((mut buf, refused, read)) = got else { panic!("host access through the legacy stream hung") };
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
        assert!(matches!(read, Err(Error::Capturing { .. })), "{read:?}");
        drop(p.end_capture().expect("the capture was invalidated"));
        buf.memset_sync(2).unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![0x0202_0202; 64]);
    });
}

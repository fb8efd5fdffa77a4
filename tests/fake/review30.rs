//! Review 30 (the thirty-sixth session's reviews of streams, contexts and memory types): host
//! waits on a per-thread stream that miss work other threads queued in its stead, two captures'
//! streams made to wait on each other, a capture's begin that waited for a synchronize, and peer
//! access undone with its contexts.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudrv::graph::CaptureMode;
use cudrv::memory::{DeviceBuffer2D, ManagedBuffer};
use cudrv::sys::CUresult;
use cudrv::{Device, Event, Stream};
use cudrv_test_support::{fake_report, run_with_fake};

/// Each of the fake driver's operations takes this long: work queued from another thread is
/// still running when the owner thread waits.
const SLOW: &[(&str, &str)] = &[("CUDRV_FAKE_DELAY_US", "200000")];

/// Fills `b` from another thread: there the per-thread stream `b` belongs to is stood in for by
/// the legacy stream.
fn filled_elsewhere<B: Send + 'static>(b: B, fill: impl FnOnce(&mut B) + Send + 'static) -> B {
    std::thread::spawn(move || {
        let mut b = b;
        fill(&mut b);
        b
    })
    .join()
    .unwrap()
}

/// The calling thread's per-thread stream of device 0, and 64 `u32`s of managed memory of it,
/// zeroed (the memset done).
fn zeroed_on_this_threads_stream() -> (Stream, ManagedBuffer<u32>) {
    let p = Stream::per_thread(&Device::get(0).unwrap()).unwrap();
    let m = ManagedBuffer::<u32>::zeroed(64, &p).unwrap();
    p.synchronize().unwrap();
    (p, m)
}

/// A pitched buffer of the owner's per-thread stream, filled from another thread, dropped on the
/// owner thread: its free waits for the fill (it waited for `CU_STREAM_PER_THREAD` only, and
/// `cuMemFree` ran under the fill).
#[test]
fn a_pitched_buffer_freed_on_its_per_thread_streams_owner_waits_for_work_queued_elsewhere() {
    run_with_fake(SLOW, || {
        let dev = Device::get(0).unwrap();
        let p = Stream::per_thread(&dev).unwrap();
        let b = DeviceBuffer2D::<u32>::zeroed(256, 16, &p).unwrap();
        p.synchronize().unwrap();
        let b = filled_elsewhere(b, |b| b.fill(7).unwrap());
        drop(b);
        std::thread::sleep(Duration::from_millis(600));
        let v = fake_report().violations;
        assert!(v.is_empty(), "the free did not wait for the fill: {v:?}");
    });
}

/// `ManagedBuffer::as_slice` on the owner thread sees the fill queued from another thread.
#[test]
fn managed_memory_read_on_its_per_thread_streams_owner_sees_work_queued_elsewhere() {
    run_with_fake(SLOW, || {
        let (_p, m) = zeroed_on_this_threads_stream();
        let m = filled_elsewhere(m, |m| m.fill(7).unwrap());
        assert_eq!(m.as_slice().unwrap(), &[7u32; 64][..], "as_slice returned while the fill was queued");
    });
}

/// `Stream::synchronize` and `Stream::query` of a per-thread stream on its owner thread count the
/// work another thread queued on it.
#[test]
fn a_per_thread_streams_synchronize_and_query_count_work_queued_elsewhere() {
    run_with_fake(SLOW, || {
        let (p, m) = zeroed_on_this_threads_stream();
        let done = Event::new(&p.device()).unwrap();
        let (m, done) = filled_elsewhere((m, done), {
            let p = p.clone();
            move |(m, done)| {
                m.fill(7).unwrap();
                done.record(&p).unwrap(); // after the fill, on the legacy stream
            }
        });
        assert!(!p.query().unwrap(), "the query missed the fill queued from another thread");
        p.synchronize().unwrap();
        assert!(done.query().unwrap(), "synchronize returned before the fill queued from another thread");
        drop(m);
    });
}

/// Two streams, each in a capture of its own, made to wait on each other from two threads at
/// once: each thread holds the other stream's gate and waited for its own stream's gates to
/// empty before seeing that it could not mark it.
#[test]
fn two_captures_streams_made_to_wait_on_each_other_at_once_do_not_deadlock() {
    run_with_fake(&[], || {
        if crate::oldest() {
            return;
        }
        let dev = Device::get(0).unwrap();
        let (s1, s2) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        for round in 0..200 {
            s1.begin_capture(CaptureMode::Relaxed).unwrap();
            s2.begin_capture(CaptureMode::Relaxed).unwrap();
            let go = Arc::new(Barrier::new(2));
            let crossed = |a: &Stream, b: &Stream| {
                let (a, b, go) = (a.clone(), b.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    // The driver refuses a wait across two captures; cudrv must get that far.
                    a.wait_stream(&b)
                })
            };
            let (t1, t2) = (crossed(&s1, &s2), crossed(&s2, &s1));
            let done = crate::within_10s(move || (t1.join().unwrap(), t2.join().unwrap()));
            assert!(done.is_some(), "round {round}: s1.wait_stream(&s2) and s2.wait_stream(&s1) deadlocked");
            let _ = s1.end_capture();
            let _ = s2.end_capture();
        }
    });
}

/// A host function on the stream waits for the thread that begins a capture there (host
/// synchronisation that depends on no CUDA work, which the driver allows), while a third thread
/// synchronizes the stream: the synchronize held the stream's gate for its whole wait, and the
/// capture's begin waited for the gate.
#[test]
fn beginning_a_capture_does_not_wait_for_a_synchronize_of_the_stream() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        s.launch_host_fn(move || {
            // Bounded, so that the process ends either way.
            let _ = rx.recv_timeout(Duration::from_secs(20));
        })
        .unwrap();
        let syncer = std::thread::spawn({
            let s = s.clone();
            move || s.synchronize()
        });
        std::thread::sleep(Duration::from_millis(200));
        let began = crate::within_10s(move || {
            let r = s.begin_capture(CaptureMode::Relaxed);
            let _ = tx.send(());
            (r, s)
        });
        let (r, s) = began.expect("begin_capture waited for the synchronize, which waits for the host function");
        r.unwrap();
        s.end_capture().unwrap();
        syncer.join().unwrap().unwrap();
    });
}

/// Peer access lasts after `enable_peer_access` returns with nothing else holding the two
/// devices' contexts (destroying them undid it).
#[test]
fn peer_access_lasts_when_nothing_else_holds_the_contexts() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux")], || {
        let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
        d0.enable_peer_access(&d1).unwrap();
        let (c0, c1) = (d0.primary_context().unwrap(), d1.primary_context().unwrap());
        let _b = c0.bind().unwrap();
        let d = cudrv::sys::Driver::global().unwrap();
        // SAFETY: c0 is current, c1 a retained primary context, flags 0.
        let rc = unsafe { d.cuCtxEnablePeerAccess(c1.as_raw(), 0) }.unwrap();
        assert_eq!(rc, CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "the peer access went with the contexts");
    });
}

//! Review 24 (the session's own pass over what reviews 23a and 23b left suspected): tests that
//! failed before the fix that came with them, and behaviour pinned down where the suspicion did
//! not hold.

use cudrv::graph::CaptureMode;
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Error, Event, EventFlags, Stream};
use cudrv_test_support::run_with_fake;

use crate::while_another_thread_captures;

/// `GraphExec::upload` on a stream that takes part in a capture cudrv started is refused, as a
/// launch is (an upload is not part of a graph; the driver may invalidate the capture), and the
/// capture goes on. It failed before: the upload was passed to the driver.
#[test]
fn graph_upload_into_a_capture_is_refused_and_the_capture_goes_on() {
    run_with_fake(&[], || {
        let device = Device::get(0).unwrap();
        let stream = Stream::new(&device).unwrap();
        stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let exec = stream.end_capture().unwrap().instantiate().unwrap();

        stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let refused = exec.upload(&stream);
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
        stream.end_capture().unwrap().instantiate().unwrap().launch(&stream).unwrap();
        exec.upload(&stream).unwrap();
        exec.launch(&stream).unwrap();
        stream.synchronize().unwrap();
    });
}

/// An event recorded in a capture marks a point of the graph: the driver refuses to query it or
/// wait for it on the host (`CUDA_ERROR_CAPTURED_EVENT`), and invalidates the capture. cudrv
/// refuses those (and timing with it) while the capture is active, and the capture goes on. It
/// failed before: the query reached the driver, and the capture ended invalidated.
#[test]
fn host_questions_about_an_event_recorded_in_a_capture_are_refused_and_the_capture_goes_on() {
    run_with_fake(&[], || {
        let device = Device::get(0).unwrap();
        let stream = Stream::new(&device).unwrap();
        let timed = || Event::with_flags(&device, EventFlags::timing()).unwrap();
        let (before, event) = (timed(), timed());
        before.record(&stream).unwrap();
        stream.synchronize().unwrap();

        stream.begin_capture(CaptureMode::Relaxed).unwrap();
        event.record(&stream).unwrap();
        let refused = [event.query().map(drop), event.synchronize(), Event::elapsed(&before, &event).map(drop)];
        for r in refused {
            assert!(matches!(r, Err(Error::Capturing { .. })), "{r:?}");
        }
        assert!(before.query().unwrap(), "an event recorded before the capture is asked as before");
        let exec = stream.end_capture().unwrap().instantiate().unwrap();
        exec.launch(&stream).unwrap();

        // Recorded again outside the capture, the event is the stream's again.
        event.record(&stream).unwrap();
        event.synchronize().unwrap();
        assert!(event.query().unwrap());
        Event::elapsed(&before, &event).unwrap();
    });
}

/// An event recorded outside any capture may be waited for and asked about on the host during
/// another thread's global-mode capture: in the global mode (the default) the driver refuses
/// `cuEventSynchronize` and `cuEventQuery` then, and invalidates that capture; cudrv makes them
/// with the thread's mode relaxed, as it does its pool's calls. It failed before (900, and the
/// other thread's capture ended invalidated).
#[test]
fn waiting_for_an_event_leaves_another_threads_global_capture_alone() {
    run_with_fake(&[], || {
        let device = Device::get(0).unwrap();
        let (stream, event) = (Stream::new(&device).unwrap(), Event::new(&device).unwrap());
        let (asked, ended) = while_another_thread_captures(CaptureMode::Global, false, || {
            event.record(&stream)?;
            event.synchronize()?;
            event.query()
        });
        assert!(asked.unwrap(), "the event completed");
        ended.expect("a wait for an event invalidated the other thread's capture");
    });
}

/// `DeviceBuffer::memset_sync` and `fill_sync` on an ordinary stream leave a capture that has
/// nothing to do with them alone. The driver's synchronous memsets (`cuMemsetD8`, ...) run on the
/// legacy default stream, which refuses work while a blocking stream of the context captures
/// (here another thread's per-thread stream) and invalidates that capture; they are now queued on
/// the buffer's stream and waited for. It failed before (906, and the other thread's capture was
/// invalidated); review 24b found it in pitched buffers.
#[test]
fn synchronous_memsets_leave_another_threads_blocking_capture_alone() {
    run_with_fake(&[], || {
        let device = Device::get(0).unwrap();
        let stream = Stream::new(&device).unwrap();
        let (mut bytes, mut words) =
            (DeviceBuffer::<u8>::zeroed(100, &stream).unwrap(), DeviceBuffer::<u32>::zeroed(64, &stream).unwrap());
        let (filled, ended) = while_another_thread_captures(CaptureMode::ThreadLocal, true, || {
            (bytes.memset_sync(0xAB), words.fill_sync(0x0102_0304))
        });
        assert!(ended.is_ok(), "the other thread's capture: {ended:?}");
        assert!(matches!(filled, (Ok(()), Ok(()))), "{filled:?}");
        assert_eq!(bytes.to_vec().unwrap(), vec![0xAB; 100]);
        assert_eq!(words.to_vec().unwrap(), vec![0x0102_0304; 64]);
    });
}

/// Inside a host function during a capture, waits for and queries of an event (and a context
/// synchronisation) are refused before any driver call: the relaxed capture mode they take elsewhere is a driver call
/// of its own (`cuThreadExchangeStreamCaptureMode`), which the emulated driver flags there. It
/// failed before (the mode was relaxed before the refusal).
#[test]
fn host_functions_during_a_capture_make_no_driver_call_to_relax_the_capture_mode() {
    run_with_fake(&[], || {
        let device = Device::get(0).unwrap();
        let (capturing, other) = (Stream::new(&device).unwrap(), Stream::new(&device).unwrap());
        let event = std::sync::Arc::new(Event::new(&device).unwrap());
        event.record(&other).unwrap();
        capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (e, ctx) = (event.clone(), device.primary_context().unwrap());
        other
            .launch_host_fn(move || {
                let _ = tx.send((e.synchronize(), e.query(), ctx.synchronize()));
            })
            .unwrap();
        other.synchronize().unwrap();
        let (waited, asked, synced) = rx.recv().unwrap();
        for r in [waited, asked.map(drop)] {
            assert!(matches!(r, Err(Error::InHostFunction { .. })), "{r:?}");
        }
        // Refused first for the capture on its context, with no driver call either.
        assert!(matches!(synced, Err(Error::Capturing { .. })), "{synced:?}");
        capturing.end_capture().unwrap();
        assert_eq!(cudrv_test_support::fake_host_fn_driver_calls(), 0);
    });
}

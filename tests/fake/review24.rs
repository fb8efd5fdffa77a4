//! Review 24 (the session's own pass over what reviews 23a and 23b left suspected): tests that
//! failed before the fix that came with them, and behaviour pinned down where the suspicion did
//! not hold.

use cudrv::graph::CaptureMode;
use cudrv::{Device, Error, Event, EventFlags, Stream};
use cudrv_test_support::run_with_fake;

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

//! Review 24 (the session's own pass over what reviews 23a and 23b left suspected): tests that
//! failed before the fix that came with them, and behaviour pinned down where the suspicion did
//! not hold.

use cudrv::graph::CaptureMode;
use cudrv::{Device, Error, Stream};
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

//! Review 27: a capture whose origin's last user went while a buffer allocated during it lived.
//!
//! `CaptureSession::abandon` leaves such a capture on (the buffer's memory is the graph's, see
//! `review2::abandon_is_skipped_while_a_capture_buffer_lives`), and nothing tried again when the
//! buffer went: the capture stayed on for good, its joined streams refused host access, what it
//! reserved was never given back, and in the global mode the driver went on refusing other
//! threads' unsafe calls. The last such buffer's drop now abandons the capture, once its free is
//! queued into the capture (`CaptureSession::buffer_gone`, src/session.rs).
//!
//! Reproduced defects (each failed before the fix): every test below but
//! `a_capture_whose_origin_has_a_user_again_is_left_on`, which pins down the other side.

use std::sync::mpsc;

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, live_graphs, run_with_fake_modes};

use crate::graph_cases;
use crate::soundness::within;

const MODES: [&str; 2] = ["linux", "tcc"];
const CAPTURE_MODES: [CaptureMode; 3] = [CaptureMode::Global, CaptureMode::ThreadLocal, CaptureMode::Relaxed];
const LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs `body` with each capture mode in `modes`, on the emulated Linux driver (buffers from the
/// device's driver pool) and TCC driver (from cudrv's pool); then lets go of cudrv's caches and
/// checks that nothing is left and the driver saw no misuse.
pub(crate) fn each_capture_mode(modes: &[CaptureMode], body: impl Fn(Device, CaptureMode)) {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        for &mode in modes {
            body(dev, mode);
        }
        graph_cases::release_everything(&dev);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
        assert_no_leaks();
    });
}

/// A capture in `mode` begun on a new origin, joined by `side`, with `n` buffers allocated on
/// `side` during it (each filled, a captured node); the origin's last user then goes. Returns
/// the graphs that lived before, and the buffers. The capture must go on (the buffers' memory is
/// the graph's).
fn orphaned_capture(dev: Device, side: &Stream, mode: CaptureMode, n: usize) -> (u64, Vec<DeviceBuffer<u32>>) {
    let graphs = live_graphs();
    let origin = Stream::new(&dev).unwrap();
    origin.begin_capture(mode).unwrap();
    side.wait_stream(&origin).unwrap();
    let bufs: Vec<_> = (0..n)
        .map(|i| {
            let mut b = DeviceBuffer::<u32>::zeroed(256 << i, side).unwrap();
            b.fill(9).unwrap();
            b
        })
        .collect();
    drop(origin);
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the capture must go on while its buffers live");
    assert!(matches!(bufs[0].to_vec(), Err(Error::Capturing { .. })), "host access to the graph's memory");
    (graphs, bufs)
}

/// The capture `side` joined is over, its graph destroyed (never made: `graphs` live, as before
/// the capture), and `side` works again: bytes written there read back.
fn check_ended(side: &Stream, graphs: u64) {
    within(LIMIT, "the orphaned capture's end", || {
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::None, "the orphaned capture must end");
    });
    assert_eq!(live_graphs(), graphs, "the abandoned capture's graph is destroyed");
    runs_work(side, 5);
}

/// `stream` runs work again: a buffer filled there with `value` reads it back.
pub(crate) fn runs_work(stream: &Stream, value: u32) {
    let mut after = DeviceBuffer::<u32>::zeroed(64, stream).unwrap();
    after.fill(value).unwrap();
    assert_eq!(after.to_vec().unwrap(), vec![value; 64]);
}

/// DEFECT (failed before the fix). The last buffer of the capture goes, on the thread that began
/// it: the capture ends with it.
#[test]
fn a_capture_orphaned_while_its_buffer_lived_ends_when_the_buffer_goes() {
    each_capture_mode(&CAPTURE_MODES, |dev, mode| {
        let side = Stream::new(&dev).unwrap();
        let (graphs, bufs) = orphaned_capture(dev, &side, mode, 1);
        drop(bufs);
        check_ended(&side, graphs);
    });
}

/// DEFECT (failed before the fix). Of three buffers, the capture ends with the last one only:
/// the first two leave it on.
#[test]
fn an_orphaned_capture_ends_with_its_last_buffer_only() {
    each_capture_mode(&CAPTURE_MODES, |dev, mode| {
        let side = Stream::new(&dev).unwrap();
        let (graphs, mut bufs) = orphaned_capture(dev, &side, mode, 3);
        for _ in 0..2 {
            drop(bufs.remove(0));
            cudrv::flush_deferred_drops().unwrap();
            assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "a buffer of the capture still lives");
            assert!(matches!(bufs[0].to_vec(), Err(Error::Capturing { .. })));
        }
        drop(bufs);
        check_ended(&side, graphs);
    });
}

/// DEFECT (failed before the fix). The last buffer goes inside a host function of another
/// stream: its free and the capture's end run on cudrv's thread, which a relaxed capture lets
/// end it.
#[test]
fn an_orphaned_capture_ends_when_its_last_buffer_goes_in_a_host_function() {
    each_capture_mode(&[CaptureMode::Relaxed], |dev, mode| {
        let (side, other) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let (graphs, bufs) = orphaned_capture(dev, &side, mode, 1);
        let (go, wait) = mpsc::channel::<()>();
        other
            .launch_host_fn(move || {
                wait.recv().unwrap();
                drop(bufs);
            })
            .unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the buffer lives until the host function");
        go.send(()).unwrap();
        other.synchronize().unwrap();
        check_ended(&side, graphs);
    });
}

/// The origin has a user again when the last buffer goes (a clone kept elsewhere): the capture
/// is left on, for that user to end; ended by it, the stream works again.
#[test]
fn a_capture_whose_origin_has_a_user_again_is_left_on() {
    each_capture_mode(&CAPTURE_MODES, |dev, mode| {
        let graphs = live_graphs();
        let (side, origin) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        origin.begin_capture(mode).unwrap();
        side.wait_stream(&origin).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(256, &side).unwrap();
        buf.fill(3).unwrap();
        origin.wait_stream(&side).unwrap();
        drop(buf);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the origin's user may still end it");
        origin.wait_stream(&side).unwrap();
        let graph = origin.end_capture().unwrap();
        drop(graph);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_graphs(), graphs);
        runs_work(&side, 6);
    });
}

/// The origin's last user and the capture's last buffer go at once, on two threads, in either
/// order: whichever comes second ends the capture (`abandon` and `buffer_gone` decide under the
/// session's lock), never neither, and nothing is freed twice or left behind.
#[test]
fn the_origins_user_and_the_last_buffer_racing_still_end_the_capture() {
    each_capture_mode(&[CaptureMode::Relaxed], |dev, mode| {
        let side = Stream::new(&dev).unwrap();
        let graphs = live_graphs();
        for round in 0..100 {
            let origin = Stream::new(&dev).unwrap();
            origin.begin_capture(mode).unwrap();
            side.wait_stream(&origin).unwrap();
            let mut buf = DeviceBuffer::<u32>::zeroed(64 + round, &side).unwrap();
            buf.fill(1).unwrap();
            let start = std::sync::Arc::new(std::sync::Barrier::new(2));
            let s2 = start.clone();
            let other = std::thread::spawn(move || {
                s2.wait();
                drop(buf);
            });
            start.wait();
            drop(origin);
            other.join().unwrap();
            within(LIMIT, "the raced capture's end", || {
                cudrv::flush_deferred_drops().unwrap();
                assert_eq!(side.capture_status().unwrap(), CaptureStatus::None, "round {round}: the capture must end");
            });
        }
        assert_eq!(live_graphs(), graphs, "every abandoned capture's graph is destroyed");
        runs_work(&side, 2);
    });
}

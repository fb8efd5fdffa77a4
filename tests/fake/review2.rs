//! Adversarial review of the changes of 04eff70..HEAD (review2): the hook that ends a capture
//! whose origin stream is dropped (`CaptureSession::abandon`), and the fallbacks to older driver
//! ABIs. The first test showed a defect of the hook (fixed: it now ends the session whenever the
//! driver has ended the capture); the others are regression tests.

use std::sync::mpsc;

use cudrv::graph::{CaptureMode, CaptureStatus, Graph};
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{
    assert_no_leaks, fake_report, full_fake_driver, live_graphs, run_with_fake, run_with_fake_modes,
};

use crate::graph_cases;

const MODES: [&str; 2] = ["linux", "tcc"];

fn driver_code(e: &Error) -> Option<i32> {
    match e {
        Error::Driver { code, .. } => Some(code.0 as i32),
        _ => None,
    }
}

/// The origin stream is dropped while a stream that joined the capture has work that was not
/// joined back. `cuStreamEndCapture` then fails with `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`, but the
/// driver has ended the capture for every stream of it (as it does for an invalidated capture):
/// the session must end too, or cudrv would go on believing the joined stream captures (its
/// buffers' host access refused forever, what the capture kept never released). Review finding,
/// fixed as `Stream::end_capture` does it: ask the driver whether the capture is still on.
#[test]
fn abandon_with_unjoined_work_ends_the_session() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let side = Stream::new(&dev).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(1024, &side).unwrap();
        side.synchronize().unwrap();
        {
            let origin = Stream::new(&dev).unwrap();
            origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
            side.wait_stream(&origin).unwrap(); // joins the capture
            buf.memset(7).unwrap(); // captured on `side`, never joined back
            assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active);
            drop(origin); // its last user: the hook ends the capture (UNJOINED)
        }
        // The driver ended the capture for every stream of it.
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::None);
        // So does cudrv: the buffer's host access is no longer refused "during the capture".
        let got = buf.to_vec();
        assert!(got.is_ok(), "the capture ended, yet cudrv still says the stream captures: {:?}", got.err());
        drop((buf, side));
        graph_cases::release_everything(&dev);
        assert_no_leaks();
    });
}

/// The same capture ended with `Stream::end_capture`: the driver's error is reported, and the
/// session ends with the capture (the contrast to the test above).
#[test]
fn end_capture_with_unjoined_work_ends_the_session() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let side = Stream::new(&dev).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(1024, &side).unwrap();
        side.synchronize().unwrap();
        let origin = Stream::new(&dev).unwrap();
        origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
        side.wait_stream(&origin).unwrap();
        buf.memset(7).unwrap();
        let Err(e) = origin.end_capture() else { panic!("unjoined") };
        assert_eq!(driver_code(&e), Some(904), "{e:?}");
        assert_eq!(buf.to_vec().unwrap(), vec![0; 1024], "nothing of the capture ran");
        drop((buf, origin, side));
        graph_cases::release_everything(&dev);
        assert_no_leaks();
    });
}

/// A stream that joined the capture (not its origin) is dropped: the capture goes on, and the
/// origin ends it as usual.
#[test]
fn dropping_a_joined_stream_does_not_end_the_capture() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let origin = Stream::new(&dev).unwrap();
        origin.begin_capture(CaptureMode::Global).unwrap();
        {
            let side = Stream::new(&dev).unwrap();
            side.wait_stream(&origin).unwrap();
            let mut tmp = DeviceBuffer::<u32>::zeroed(256, &side).unwrap();
            tmp.memset(1).unwrap();
            drop(tmp);
            origin.wait_stream(&side).unwrap();
            drop(side); // joined, not the origin: nothing happens
        }
        assert_eq!(origin.capture_status().unwrap(), CaptureStatus::Active);
        let graph = origin.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        exec.launch(&origin).unwrap();
        origin.synchronize().unwrap();
        drop((exec, graph, origin));
        graph_cases::release_everything(&dev);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
        assert_no_leaks();
    });
}

/// The origin is dropped while a buffer allocated during the capture (on a joined stream) lives:
/// the hook must leave the capture alone (the buffer's memory is the graph's).
#[test]
fn abandon_is_skipped_while_a_capture_buffer_lives() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let (origin, side) = capture_with_a_joined_stream(&dev, CaptureMode::Relaxed);
        let tmp = DeviceBuffer::<u32>::zeroed(256, &side).unwrap();
        let graphs = live_graphs();
        drop(origin);
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the capture must go on");
        assert_eq!(live_graphs(), graphs);
        // Host access to the buffer is still refused (it is the graph's).
        assert!(matches!(tmp.to_vec(), Err(Error::Capturing { .. })));
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// The origin's last user goes inside a host function: the hook runs on cudrv's deferred-work
/// thread. In relaxed mode the driver lets that thread end the capture: the capture ends, its
/// graph is destroyed and what it allocated from the pool goes back.
#[test]
fn abandon_from_a_host_function_ends_a_relaxed_capture() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let other = Stream::new(&dev).unwrap();
        let origin = Stream::new(&dev).unwrap();
        let (go, wait) = mpsc::channel::<()>();
        let last = origin.clone();
        other
            .launch_host_fn(move || {
                wait.recv().unwrap();
                drop(last);
            })
            .unwrap();
        let graphs = live_graphs();
        origin.begin_capture(CaptureMode::Relaxed).unwrap();
        {
            let mut tmp = DeviceBuffer::<u32>::zeroed(1 << 12, &origin).unwrap();
            tmp.memset(3).unwrap();
        }
        drop(origin);
        go.send(()).unwrap();
        other.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_graphs(), graphs, "the abandoned capture's graph is destroyed");
        drop(other);
        graph_cases::release_everything(&dev);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
        assert_no_leaks();
    });
}

/// The origin's last user goes on another thread than the one that began a thread-local capture:
/// the driver refuses to end it there (`WRONG_THREAD`) and the hook leaves the session as it is
/// (no half-finished state: a joined stream still reads as capturing to cudrv and the driver).
#[test]
fn abandon_on_the_wrong_thread_leaves_the_capture_on() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let (origin, side) = capture_with_a_joined_stream(&dev, CaptureMode::ThreadLocal);
        std::thread::spawn(move || drop(origin)).join().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active);
        let buf = DeviceBuffer::<u32>::zeroed(16, &side);
        // Still tracked by cudrv: an allocation there is the capture's (or refused).
        if let Ok(b) = &buf {
            assert!(matches!(b.to_vec(), Err(Error::Capturing { .. })));
        }
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// Threads race the hook: while the origin's last user lets go of it, another thread allocates
/// and frees pool memory on a joined stream (which the capture then owns). Whatever wins, nothing
/// is used after it is freed, and everything is given back.
#[test]
fn abandon_races_allocations_on_a_joined_stream() {
    run_with_fake_modes(&["tcc"], &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        for round in 0..40 {
            let (origin, side) = capture_with_a_joined_stream(&dev, CaptureMode::Relaxed);
            let s2 = side.clone();
            let worker = std::thread::spawn(move || {
                for _ in 0..20 {
                    // No captured node (a memset would be unjoined work, see the first test
                    // above): only the pool's host-side bookkeeping races the hook.
                    // SAFETY: never read.
                    if let Ok(b) = unsafe { DeviceBuffer::<u32>::uninit(64 + round, &s2) } {
                        drop(b);
                    }
                }
            });
            drop(origin);
            worker.join().unwrap();
            // Either the capture ended with the hook or goes on (a buffer lived at the time).
            if side.capture_status().unwrap() == CaptureStatus::None {
                let b = DeviceBuffer::<u32>::from_slice(&[5; 8], &side).unwrap();
                assert_eq!(b.to_vec().unwrap(), vec![5; 8]);
            }
        }
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// A stream capturing in `mode` (the origin), and a second stream that joined its capture.
fn capture_with_a_joined_stream(dev: &Device, mode: CaptureMode) -> (Stream, Stream) {
    let side = Stream::new(dev).unwrap();
    let origin = Stream::new(dev).unwrap();
    origin.begin_capture(mode).unwrap();
    side.wait_stream(&origin).unwrap();
    (origin, side)
}

/// An injected fault, and the body that checks its error.
type Case = (&'static str, fn(&Device));

/// A driver error of a newer entry point is reported, never answered by falling back to the older
/// ABI (only a missing symbol falls back).
#[test]
fn fallbacks_only_on_a_missing_symbol() {
    let cases: [Case; 4] = [
        ("cuStreamGetCaptureInfo_v3:1+:999", |dev| {
            let s = Stream::new(dev).unwrap();
            let Err(e) = s.capture_info() else { panic!("the injected error") };
            assert_eq!(driver_code(&e), Some(999), "{e:?}");
        }),
        ("cuGraphInstantiateWithFlags:1+:2", |dev| {
            let mut g = Graph::new(dev).unwrap();
            g.add_empty_node(&[]).unwrap();
            let Err(e) = g.instantiate() else { panic!("the injected error") };
            assert_eq!(driver_code(&e), Some(2), "{e:?}");
        }),
        ("cuGraphExecUpdate_v2:1+:999", |dev| {
            let mut g = Graph::new(dev).unwrap();
            g.add_empty_node(&[]).unwrap();
            let exec = g.instantiate().unwrap();
            let r = exec.update(&g);
            assert!(matches!(&r, Err(e) if driver_code(e) == Some(999)), "{:?}", r.map(|u| u.is_ok()));
        }),
        ("cuStreamGetCaptureInfo_v3:1+:1", |dev| {
            // begin_capture cannot learn the capture's id: it ends the capture and says why.
            let s = Stream::new(dev).unwrap();
            let Err(e) = s.begin_capture(CaptureMode::Global) else { panic!("the injected error") };
            assert_eq!(driver_code(&e), Some(1), "{e:?}");
            assert_eq!(s.capture_status().unwrap(), CaptureStatus::None);
        }),
    ];
    // The newer entry points exist on the full fake only (CUDRV_TEST_DRIVER=legacy or not).
    for (i, (fail, _)) in cases.iter().enumerate() {
        run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_FAIL", fail)], || {
            let dev = Device::get(0).unwrap();
            (cases[i].1)(&dev);
        });
    }
}

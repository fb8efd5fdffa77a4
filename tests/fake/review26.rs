//! Review 26: work that waits on cudrv's deferred-work thread for a capture to end, and what
//! [`cudrv::flush_deferred_drops`] promises about it: that the work deferred before it was done,
//! or tried once more, when it returns.
//!
//! Two defects broke that promise (CI run of f88bb35: one failure of
//! `review25b::a_pool_graphs_executable_dropped_during_a_capture_does_not_keep_it` in 302, where
//! `Graph::instantiate` refused the next executable graph although the first was gone):
//! - three jobs waited for a capture by sleeping a millisecond and queueing themselves again at
//!   the back of the queue (the release of a dropped executable graph's permission, the release
//!   of a dropped graph's resources after its last launch, the retirement of a stream's cache in
//!   `StreamOrderedPool`). A flush queued while such a job slept ran first. They now wait as
//!   retries (`host_fn::defer_attempts`), which the thread tries again before each later job;
//! - work that deferred work deferred in turn (the graph's release, when the permission's job
//!   dropped the graph's last reference) was queued behind a flush queued meanwhile, and a retry
//!   added by a retry waited for the next pass. Both now come before the next queued job
//!   (src/host_fn.rs, with a unit test of its own).
//!
//! The first two tests failed before; the third passed (that job's retry was queued before its
//! sleep) and pins the behaviour down.

use std::sync::Arc;
use std::time::Duration;

use cudrv::graph::CaptureMode;
use cudrv::memory::{DeviceBuffer, MemoryResource, StreamOrderedPool};
use cudrv::{Device, Graph, GraphExec, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, run_with_fake_modes};

use crate::graph_cases;

const MODES: [&str; 2] = ["linux", "tcc"];
const CAPTURE_MODES: [CaptureMode; 3] = [CaptureMode::Global, CaptureMode::ThreadLocal, CaptureMode::Relaxed];

/// Long enough for cudrv's thread to have tried the waiting job, and to be between two tries.
const WHILE_IT_WAITS: Duration = Duration::from_millis(20);

/// Runs `case` a few times in each capture mode, on the emulated Linux and TCC drivers, then
/// lets go of cudrv's caches and checks that nothing is left and no violation was seen.
fn each_capture_mode(case: impl Fn(&Device, CaptureMode)) {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        for mode in CAPTURE_MODES {
            for _ in 0..4 {
                case(&dev, mode);
            }
        }
        graph_cases::release_everything(&dev);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
        assert_no_leaks();
    });
}

/// Ends `origin`'s capture once cudrv's thread waits for it, and flushes: what waited for the
/// capture must be done when the flush returns.
fn end_capture_and_flush(origin: &Stream) {
    std::thread::sleep(WHILE_IT_WAITS);
    let empty = origin.end_capture().unwrap();
    assert_eq!(empty.nodes().unwrap().len(), 0, "nothing was captured");
    drop(empty);
    cudrv::flush_deferred_drops().unwrap();
}

/// A graph that owns memory of a `StreamOrderedPool` of its own (a buffer allocated during the
/// capture, filled with `value` and copied to `out`), launched once on `origin`.
struct PoolGraph {
    pool: Arc<dyn MemoryResource>,
    origin: Stream,
    cap: Stream,
    out: DeviceBuffer<u32>,
    graph: Graph,
    exec: GraphExec,
}

fn pool_graph_launched(dev: &Device, value: u32) -> PoolGraph {
    let pool: Arc<dyn MemoryResource> = Arc::new(StreamOrderedPool::new(dev).unwrap());
    let (origin, cap) = (Stream::new(dev).unwrap(), Stream::new(dev).unwrap());
    let mut out = DeviceBuffer::<u32>::zeroed(64, &cap).unwrap();
    cap.synchronize().unwrap();
    cap.begin_capture(CaptureMode::Relaxed).unwrap();
    let mut tmp = DeviceBuffer::<u32>::zeroed_in(64, &cap, pool.clone()).unwrap();
    tmp.fill(value).unwrap();
    out.copy_from(&tmp).unwrap();
    drop(tmp);
    let graph = cap.end_capture().unwrap();
    let exec = graph.instantiate().unwrap();
    exec.launch(&origin).unwrap();
    PoolGraph { pool, origin, cap, out, graph, exec }
}

/// DEFECT (failed before the fix). A graph that owns memory of cudrv's pool, whose executable
/// graph is dropped while the stream of its last launch captures: once the capture has ended and
/// deferred work is flushed, the next executable graph may be made.
#[test]
fn a_pool_graphs_next_executable_may_be_made_once_a_flush_follows_the_captures_end() {
    each_capture_mode(|dev, mode| {
        let PoolGraph { pool, origin, cap, mut out, graph, exec } = pool_graph_launched(dev, 9);
        origin.begin_capture(mode).unwrap();
        // Its permission waits for the launch, which cannot be waited for during the capture.
        drop(exec);
        end_capture_and_flush(&origin);
        let again = graph.instantiate().unwrap_or_else(|e| panic!("{mode:?}: the permission is back: {e}"));
        out.fill(0).unwrap();
        cap.synchronize().unwrap();
        again.launch(&origin).unwrap();
        origin.synchronize().unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![9; 64], "{mode:?}");
        drop((again, graph, out));
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(pool.stats().unwrap().in_use, 0, "{mode:?}: the graph's memory is given back");
    });
}

/// DEFECT (failed before the fix). A graph that owns memory of cudrv's pool, dropped (with its
/// executable graph) while the stream of its last launch captures: once the capture has ended
/// and deferred work is flushed, the graph's memory is given back.
#[test]
fn a_graph_dropped_during_a_capture_is_released_once_a_flush_follows_the_captures_end() {
    each_capture_mode(|dev, mode| {
        let PoolGraph { pool, origin, out, graph, exec, .. } = pool_graph_launched(dev, 3);
        origin.begin_capture(mode).unwrap();
        drop((exec, graph));
        assert_ne!(pool.stats().unwrap().in_use, 0, "{mode:?}: the launch may still use the graph's memory");
        end_capture_and_flush(&origin);
        assert_eq!(pool.stats().unwrap().in_use, 0, "{mode:?}: the graph's memory is given back");
        origin.synchronize().unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![3; 64], "{mode:?}");
    });
}

/// Checked (passed before as well: this job queued itself again before it slept, so a flush
/// queued meanwhile came after it). A stream with blocks cached in a `StreamOrderedPool`, whose
/// last handle goes while it takes part in a capture: once the capture has ended and deferred work
/// is flushed, the pool has taken the stream's cache back, and trimming gives everything back.
#[test]
fn a_pools_stream_retired_during_a_capture_is_retired_once_a_flush_follows_the_captures_end() {
    each_capture_mode(|dev, mode| {
        let pool = StreamOrderedPool::new(dev).unwrap();
        let (origin, side) = (Stream::new(dev).unwrap(), Stream::new(dev).unwrap());
        let buf = pool.allocate(1 << 20, &side).unwrap();
        // SAFETY: allocated by this pool on `side`, which nothing else used.
        unsafe { pool.deallocate(buf, 1 << 20, &side) }.unwrap();
        side.synchronize().unwrap();
        origin.begin_capture(mode).unwrap();
        side.wait_stream(&origin).unwrap();
        origin.wait_stream(&side).unwrap();
        drop(side);
        std::thread::sleep(WHILE_IT_WAITS);
        pool.trim(0).unwrap();
        assert_ne!(pool.stats().unwrap().reserved, 0, "{mode:?}: the stream's cache is kept while it captures");
        end_capture_and_flush(&origin);
        pool.trim(0).unwrap();
        assert_eq!(pool.stats().unwrap().reserved, 0, "{mode:?}: the stream's cache was taken back");
    });
}

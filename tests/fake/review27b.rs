//! Review 27b: an adversarial review of cudrv's deferred-work thread after 5cbdeef..fd34233
//! (`NEXT`, jobs that wait for a capture as retries, what `flush_deferred_drops` promises), and of
//! the end of an orphaned capture by its last buffer (`CaptureSession::buffer_gone`, with
//! 03db856, which counts a buffer out only once its free is queued or handed on).
//!
//! Covered:
//! - `flush_deferred_drops` after a capture's end, where the release that waited for the capture
//!   leads to a chain of releases (a graph keeping a child graph keeping a child graph):
//!   `a_flush_after_a_captures_end_waits_for_the_nested_releases_it_leads_to`, DEFECT (fixed in
//!   `host_fn::run`: what a retry defers is run to the end before the queued job);
//! - buffers allocated during a capture on a per-thread stream and dropped on another thread
//!   (`a_capture_buffer_of_a_per_thread_stream_dropped_on_another_thread`, DEFECT) or in a host
//!   function (`a_capture_buffer_of_a_per_thread_stream_dropped_in_a_host_function`, DEFECT):
//!   the free was queued from a thread where the per-thread handle means the legacy stream, which
//!   the capture itself holds (fixed: it waits in the session, `CaptureSession::free_at_end`, and
//!   `Stream::end_capture` queues it on the origin);
//! - an orphaned capture (the origin's last user gone) whose buffers were used on several joined
//!   streams (`copy_from`, `record_use`), in every capture mode, on both emulated drivers:
//!   `an_orphaned_capture_ends_with_a_buffer_used_on_several_streams`, found sound;
//! - an allocation on a joined stream made inside the capture but counted among its live buffers
//!   only after the capture ended (suspected by the review, probed afterwards), found sound; since
//!   the end waits for the gates of every stream of the capture (review_graph), no longer possible:
//!   `an_allocation_on_a_joined_stream_under_way_at_the_captures_end_is_the_captures`.
//!
//! Every test runs on the emulated Linux driver (the device's driver pool) and TCC driver
//! (cudrv's `StreamOrderedPool`), and ends with no leak and no violation the driver saw.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::memory::{DeviceBuffer, DevicePtr, MemoryResource, ResourceKind, SyncResource};
use cudrv::{Device, Error, Graph, Stream};
use cudrv_test_support::{fake_report, live_graphs};

use crate::review27::{each_capture_mode, runs_work};
use crate::soundness::within;

const CAPTURE_MODES: [CaptureMode; 3] = [CaptureMode::Global, CaptureMode::ThreadLocal, CaptureMode::Relaxed];
const LIMIT: Duration = Duration::from_secs(30);

/// A resource whose frees wait, on whatever thread they run, until the test lets them go: a
/// buffer of it dropped in a host function holds cudrv's deferred-work thread in its free.
struct Holding {
    inner: SyncResource,
    started: Mutex<mpsc::Sender<()>>,
    go: Mutex<mpsc::Receiver<()>>,
}

impl std::fmt::Debug for Holding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Holding")
    }
}

// SAFETY: forwards to a resource that keeps the contract (the wait before the free changes
// nothing of it).
unsafe impl MemoryResource for Holding {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<DevicePtr> {
        self.inner.allocate(bytes, stream)
    }
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        let _ = self.started.lock().unwrap().send(());
        let _ = self.go.lock().unwrap().recv_timeout(LIMIT);
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

/// Holds cudrv's deferred-work thread in a free (of a buffer dropped in a host function) until
/// the sender returned is used (or dropped).
fn hold_cudrvs_thread(dev: &Device) -> mpsc::Sender<()> {
    let (started_tx, started_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel();
    let resource = Arc::new(Holding {
        inner: SyncResource::new(dev).unwrap(),
        started: Mutex::new(started_tx),
        go: Mutex::new(go_rx),
    });
    let host = Stream::new(dev).unwrap();
    let buf = DeviceBuffer::from_slice_in(&[1u32; 16], &host, resource).unwrap();
    host.launch_host_fn(move || drop(buf)).unwrap();
    started_rx.recv_timeout(LIMIT).expect("cudrv's thread frees the host function's buffer");
    go_tx
}

/// DEFECT (failed before the fix in `host_fn::run`). `flush_deferred_drops` promises that work deferred before it is done when it returns,
/// "with what it leads to": after `end_capture`, the release of a graph dropped while the stream
/// of its last launch captured is done, and so is what that release lets go of. Here graph `a`
/// keeps child graph `b`, which keeps child graph `c`; each was launched by an executable graph
/// of its own, since dropped, so the release of each waits for its last launch on cudrv's thread
/// (`release_after_launches`, a retry). `a`'s waits for `sa`, which captures. The flush after
/// the capture's end tries `a`'s release once more (`try_retries`, before the flush's job): it
/// is done and drops `b`'s resources, whose release is deferred (into `NEXT`, ahead of the
/// flush's job); that release drops `c`'s, whose release is deferred in turn, but now behind the
/// flush's job (`NEXT` is one queue, and the flush's job was pushed onto it before). The flush
/// returns while `c`'s host node closure (here the `kept` count) is still held.
///
/// cudrv's thread is held (in a custom resource's free) from before the capture's end until the
/// flush's job is queued, so that its timer does not retry `a`'s release first; `c`'s last launch
/// is followed by a host function that holds its stream for a while, so that `c`'s release, once
/// tried, is still waiting when the flush returns. Neither wait can fail a sound build: a flush
/// that keeps its promise returns after `c`'s release, whenever that comes.
#[test]
fn a_flush_after_a_captures_end_waits_for_the_nested_releases_it_leads_to() {
    each_capture_mode(&[CaptureMode::Relaxed, CaptureMode::ThreadLocal], |dev, mode| {
        let kept = Arc::new(());
        let (sa, sb, sc) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let mut c = Graph::new(&dev).unwrap();
        let k = kept.clone();
        c.add_host_node(&[], move || assert!(Arc::strong_count(&k) >= 2)).unwrap();
        let exec_c = c.instantiate().unwrap();
        exec_c.launch(&sc).unwrap();
        // `c`'s last launch completes only once this host function returns.
        let (release_sc, sc_waits) = mpsc::channel::<()>();
        sc.launch_host_fn(move || {
            let _ = sc_waits.recv_timeout(LIMIT);
        })
        .unwrap();
        drop(exec_c);
        let b = launched_parent(&dev, c, &sb);
        let a = launched_parent(&dev, b, &sa);
        sa.begin_capture(mode).unwrap();
        // Its release waits for the capture (a record on `sa` now would be captured).
        drop(a);
        cudrv::flush_deferred_drops().unwrap();
        assert!(Arc::strong_count(&kept) >= 2, "released while the stream of a last launch captured");
        let go = hold_cudrvs_thread(&dev);
        let empty = sa.end_capture().unwrap();
        assert_eq!(empty.nodes().unwrap().len(), 0);
        drop(empty);
        let letting_go = std::thread::spawn(move || {
            // Long after the flush below has queued its job (it cannot fail a sound build).
            std::thread::sleep(Duration::from_millis(300));
            go.send(()).unwrap();
            std::thread::sleep(Duration::from_secs(2));
            release_sc.send(()).unwrap();
        });
        within(LIMIT, "the flush", || cudrv::flush_deferred_drops().unwrap());
        let left = Arc::strong_count(&kept);
        letting_go.join().unwrap();
        assert_eq!(
            left, 1,
            "flush_deferred_drops returned before the release of graph c, which the release of a (tried by the \
             flush, after the capture's end) led to"
        );
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(Arc::strong_count(&kept), 1);
    });
}

/// DEFECT (failed before the fix: `CaptureSession::free_at_end`, src/session.rs). A buffer
/// allocated during a capture on a per-thread stream, dropped on another thread. There the
/// per-thread handle means the legacy stream, which the capture itself holds (a blocking stream
/// captures): `Free::attempt` met `Held::Legacy` (its own capture is skipped by `capture_of`, but
/// not by `legacy_held_by_capture`, src/memory/uses.rs) and handed the free to cudrv's thread,
/// where the handle means the legacy stream too: it was never queued into the capture, where the
/// buffer's memory belongs. Since 03db856 the buffer was never counted out of the capture's live
/// buffers either: `end_capture` refused the capture for good (`Error::Capturing`, "buffers
/// allocated during the capture are alive"), and the free was tried again every millisecond while
/// the capture lived. At 8cb2732 the count fell after the first try, `end_capture` made a graph
/// without the free (3 nodes where the same thread's drop makes 4), and the retried free then ran
/// outside the graph: `cuMemFreeAsync` of the graph's address (the emulated driver refused it,
/// `CUDA_ERROR_INVALID_VALUE`, reported at the next call). Now the free waits in the session and
/// `end_capture` queues it on the origin. `end_capture` must succeed (the buffer is gone), the
/// graph must run, and nothing may be freed outside it or left behind.
#[test]
fn a_capture_buffer_of_a_per_thread_stream_dropped_on_another_thread() {
    each_capture_mode(&CAPTURE_MODES, |dev, mode| {
        per_thread_capture_buffer_dropped(dev, mode, "on another thread", |buf| {
            std::thread::spawn(move || drop(buf)).join().unwrap();
        });
    });
}

/// DEFECT (failed before the same fix). As above, with the buffer dropped in a host function of
/// another stream: its free runs on cudrv's thread, where the per-thread handle means the legacy
/// stream.
#[test]
fn a_capture_buffer_of_a_per_thread_stream_dropped_in_a_host_function() {
    each_capture_mode(&CAPTURE_MODES, |dev, mode| {
        let other = Stream::new(&dev).unwrap();
        per_thread_capture_buffer_dropped(dev, mode, "in a host function", |buf| {
            let (dropped, was_dropped) = mpsc::channel();
            other
                .launch_host_fn(move || {
                    drop(buf);
                    dropped.send(()).unwrap();
                })
                .unwrap();
            was_dropped.recv_timeout(LIMIT).unwrap();
        });
    });
}

/// A capture in `mode` on this thread's per-thread stream, whose only buffer (filled in the
/// capture) goes with `let_go` (`how`, for the messages): the capture must end with its free, and
/// its graph run; the stream then works again.
fn per_thread_capture_buffer_dropped(
    dev: Device,
    mode: CaptureMode,
    how: &str,
    let_go: impl FnOnce(DeviceBuffer<u32>),
) {
    let graphs = live_graphs();
    let ps = Stream::per_thread(&dev).unwrap();
    ps.begin_capture(mode).unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(256, &ps).unwrap();
    buf.fill(7).unwrap();
    let_go(buf);
    cudrv::flush_deferred_drops().unwrap();
    let graph = ps
        .end_capture()
        .unwrap_or_else(|e| panic!("{mode:?}: end_capture after the capture's only buffer was dropped {how}: {e:?}"));
    let exec = graph.instantiate().unwrap();
    exec.launch(&ps).unwrap();
    ps.synchronize().unwrap();
    drop((exec, graph));
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(live_graphs(), graphs);
    assert!(fake_report().violations.is_empty(), "{mode:?}: {:?}", fake_report().violations);
    runs_work(&ps, 4);
}

/// Sound. An orphaned capture (the origin's last user gone) whose only buffer, allocated on a
/// joined stream, was used on two more joined streams: dropped on the capturing thread, its free
/// goes into the capture after the uses, and the capture ends, in every mode.
#[test]
fn an_orphaned_capture_ends_with_a_buffer_used_on_several_streams() {
    each_capture_mode(&CAPTURE_MODES, |dev, mode| {
        let graphs = live_graphs();
        let (side, u1, u2) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let origin = Stream::new(&dev).unwrap();
        origin.begin_capture(mode).unwrap();
        for s in [&side, &u1, &u2] {
            s.wait_stream(&origin).unwrap();
        }
        let mut buf = DeviceBuffer::<u32>::zeroed(512, &side).unwrap();
        buf.fill(3).unwrap();
        let mut copy = DeviceBuffer::<u32>::zeroed(512, &u1).unwrap();
        copy.copy_from(&buf).unwrap();
        buf.record_use(&u2).unwrap();
        drop(origin);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "its buffers live");
        drop(buf);
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "a buffer of the capture lives");
        assert!(matches!(copy.to_vec(), Err(Error::Capturing { .. })));
        drop(copy);
        within(LIMIT, "the orphaned capture's end", || {
            cudrv::flush_deferred_drops().unwrap();
            for s in [&side, &u1, &u2] {
                assert_eq!(s.capture_status().unwrap(), CaptureStatus::None, "{mode:?}: the capture must end");
            }
        });
        assert_eq!(live_graphs(), graphs);
        runs_work(&u2, 8);
    });
}

/// A graph whose one node is `child` (let go of here), instantiated, launched once on `on` (which
/// is then synchronised), and its executable graph dropped: its release waits for that launch.
fn launched_parent(dev: &Device, child: Graph, on: &Stream) -> Graph {
    let mut parent = Graph::new(dev).unwrap();
    parent.add_child_graph_node(&[], &child).unwrap();
    drop(child);
    let exec = parent.instantiate().unwrap();
    exec.launch(on).unwrap();
    drop(exec);
    on.synchronize().unwrap();
    parent
}

/// Sound. An allocation on a joined stream under way (under the stream's gate) while the capture
/// ends on another thread: the end waits for it, as for all work under way on the capture's
/// streams, so the buffer is counted among the capture's live buffers first, and the end is
/// refused until it goes (its free belongs in the graph). (Before the end waited for the origin's
/// gate only, the buffer was counted after the capture ended, with its memory a discarded graph's;
/// the review found that sound: every use of it was refused.)
#[test]
fn an_allocation_on_a_joined_stream_under_way_at_the_captures_end_is_the_captures() {
    each_capture_mode(&[CaptureMode::Relaxed], |dev, mode| {
        let (held, made, go) = crate::slowed::held_after(dev.memory_resource().unwrap());
        let (origin, side) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        origin.begin_capture(mode).unwrap();
        side.wait_stream(&origin).unwrap();
        let s2 = side.clone();
        // SAFETY: never read (only dropped, below).
        let allocating = std::thread::spawn(move || unsafe { DeviceBuffer::<u32>::uninit_in(64, &s2, held) });
        crate::slowed::under_way(&made);
        // The end waits for the allocation: let it finish meanwhile.
        let finish = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            go.send(()).unwrap();
        });
        let ended = origin.end_capture();
        assert!(
            matches!(ended, Err(Error::Capturing { .. })),
            "the end while a buffer of the capture lives: {ended:?}"
        );
        finish.join().unwrap();
        let buf = allocating.join().unwrap().expect("the allocation");
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the capture goes on");
        // Its free goes into the capture, which then ends.
        drop(buf);
        origin.wait_stream(&side).unwrap();
        drop(origin.end_capture().unwrap());
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::None);
        cudrv::flush_deferred_drops().unwrap();
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

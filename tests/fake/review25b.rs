//! Review 25b: the parked streams of frees that wait for a capture or a graph (`ParkedStream`,
//! `FreeStreams`, commit d571d3c), and what else holds a stream while it waits for a capture's
//! end or a graph's launches.
//!
//! Covered: two handles over one stream (a revived one and the one that went, with the pools'
//! caches and pins; per-thread streams, custom resources that keep the stream they free on), the
//! retries when a revival is contended, frees on joined streams, in host functions and after a
//! driver fault, and the other holders (`Kept::fences`, `after_stream_work`,
//! `GraphExec::last_launch`, `GraphUse::after_launches`).
//!
//! Reproduced defects (each test failed before its fix):
//! - `a_per_thread_stream_keeps_its_identity_while_a_free_waits_parked_on_it` and
//!   `a_stream_kept_by_a_resource_from_a_revived_free_is_the_threads_stream`: a parked per-thread
//!   stream was revived as a second stream beside the one `Stream::per_thread` made anew, whose
//!   capture the free then did not see (fixed in `Stream::per_thread`, src/stream.rs);
//! - `a_graph_fence_does_not_keep_an_abandoned_capture_while_the_graph_lives`,
//!   `a_graph_dropped_during_a_capture_of_its_last_launchs_stream_does_not_keep_it`,
//!   `a_free_after_a_graph_released_after_an_abandoned_capture_runs` and
//!   `a_pool_graphs_executable_dropped_during_a_capture_does_not_keep_it`: the graph's fences and
//!   `after_stream_work` held users of the streams they waited for (fixed in src/session.rs);
//! - `an_abandoned_capture_whose_end_fails_once_still_ends` (older than d571d3c): a passing
//!   fault in the end of an abandoned capture left it capturing for good (fixed in
//!   `CaptureSession::abandon`, src/session.rs: cudrv's thread tries again, a while);
//! - `a_live_executable_graph_does_not_keep_an_abandoned_capture_of_its_last_launchs_stream`
//!   (fixed in src/graph.rs from the review's diff: the executable graph keeps its last launch's
//!   stream parked).
//!
//! The others pin down behaviour checked and found sound.

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Graph, GraphExec, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, live_graphs, run_with_fake_modes};

use crate::graph_cases;
use crate::soundness::within;

const MODES: [&str; 2] = ["linux", "tcc"];
const CAPTURE_MODES: [CaptureMode; 3] = [CaptureMode::Global, CaptureMode::ThreadLocal, CaptureMode::Relaxed];
const LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Begins a capture on `origin` and joins `side` to it, so that the capture's state can be read
/// once the origin is gone.
fn capture_joined(origin: &Stream, side: &Stream, mode: CaptureMode) {
    origin.begin_capture(mode).unwrap();
    side.wait_stream(origin).unwrap();
    assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active);
}

/// Lets go of cudrv's caches and checks that nothing is left, and no violation seen.
fn release_and_check(dev: &Device) {
    graph_cases::release_everything(dev);
    assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    assert_no_leaks();
}

/// Runs `body` with each capture mode, on the emulated Linux and TCC drivers; then lets go of
/// cudrv's caches and checks that nothing is left ([`release_and_check`]).
fn each_capture_mode(body: impl Fn(Device, CaptureMode)) {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        for mode in CAPTURE_MODES {
            body(dev, mode);
        }
        release_and_check(&dev);
    });
}

/// The capture that `side` joined is over (the origin's last user went), and `side` works again.
fn check_ended(side: &Stream) {
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(side.capture_status().unwrap(), CaptureStatus::None, "the abandoned capture must end");
    let mut after = DeviceBuffer::<u32>::zeroed(16, side).unwrap();
    after.fill(7).unwrap();
    assert_eq!(after.to_vec().unwrap(), vec![7; 16]);
}

/// The graphs live now, a side stream, an origin, and a graph of [`launched_graph`] on it.
fn graph_launched_on_a_new_origin(dev: Device) -> (u64, Stream, Stream, (Graph, GraphExec, DeviceBuffer<u32>)) {
    let graphs = live_graphs();
    let (side, origin) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let launched = launched_graph(&dev, &origin);
    (graphs, side, origin, launched)
}

/// Drops `origin`, the last user of the capture `side` joined: the capture must end
/// ([`check_ended`]).
fn abandon(origin: Stream, side: &Stream) {
    drop(origin);
    within(LIMIT, "the abandoned capture's end", || check_ended(side));
}

/// Launches `exec` (a graph of [`launched_graph`]) on `side`: it fills `buf` with 4s.
fn replays(exec: &GraphExec, side: &Stream, buf: &DeviceBuffer<u32>) {
    exec.launch(side).unwrap();
    side.synchronize().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![4; 64]);
}

/// A captured graph (a fill of a buffer of its own, returned with it), instantiated and launched
/// once on `on`, which is then synchronised.
fn launched_graph(dev: &Device, on: &Stream) -> (Graph, GraphExec, DeviceBuffer<u32>) {
    let cap = Stream::new(dev).unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(64, &cap).unwrap();
    cap.synchronize().unwrap();
    cap.begin_capture(CaptureMode::Relaxed).unwrap();
    buf.fill(4).unwrap();
    let graph = cap.end_capture().unwrap();
    let exec = graph.instantiate().unwrap();
    exec.launch(on).unwrap();
    on.synchronize().unwrap();
    (graph, exec, buf)
}

/// DEFECT (failed before the fix). An executable graph launched on a stream and dropped leaves
/// the stream to its graph's resources, which wait for that last launch before they are given
/// back (`Kept::fences`). They held a user of the stream: while the graph lived, a capture on
/// that stream whose last (other) user went was never abandoned, and the driver went on
/// refusing other threads' work for it (global mode).
#[test]
fn a_graph_fence_does_not_keep_an_abandoned_capture_while_the_graph_lives() {
    each_capture_mode(|dev, mode| {
        let (graphs, side, origin, (graph, exec, buf)) = graph_launched_on_a_new_origin(dev);
        drop(exec);
        capture_joined(&origin, &side, mode);
        abandon(origin, &side);
        // The graph still replays, and gives everything back once it goes.
        let again = graph.instantiate().unwrap();
        replays(&again, &side, &buf);
        drop((again, graph, buf, side));
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_graphs(), graphs);
    });
}

/// DEFECT (failed before the fix). As above, with the graph dropped during the capture: its
/// resources wait on cudrv's thread for the stream of its last launch, which they cannot while
/// the stream captures; they held a user of the stream meanwhile, so the capture was never
/// abandoned and they waited for ever (nothing was given back).
#[test]
fn a_graph_dropped_during_a_capture_of_its_last_launchs_stream_does_not_keep_it() {
    each_capture_mode(|dev, mode| {
        let (graphs, side, origin, (graph, exec, buf)) = graph_launched_on_a_new_origin(dev);
        capture_joined(&origin, &side, mode);
        drop((exec, graph, buf));
        abandon(origin, &side);
        drop(side);
        within(LIMIT, "the graph's release", cudrv::flush_deferred_drops).unwrap();
        assert_eq!(live_graphs(), graphs, "the graph is given back");
    });
}

/// DEFECT (failed before the fix). A free parked on a per-thread stream whose last user went
/// revived a handle of its own over the old stream, while `Stream::per_thread` on the same
/// thread made a new stream (another id) for the same driver stream: a capture begun on that one
/// went unseen by the free, which ran on this thread when another capture it waited for ended,
/// and went into the capture (the emulated driver invalidated it: `end_capture` failed with
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
#[test]
fn a_per_thread_stream_keeps_its_identity_while_a_free_waits_parked_on_it() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        for mode in [CaptureMode::ThreadLocal, CaptureMode::Relaxed] {
            let other = Stream::new(&dev).unwrap();
            let p = Stream::per_thread(&dev).unwrap();
            let id = p.id();
            let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &p).unwrap();
            buf.record_use(&other).unwrap();
            other.begin_capture(CaptureMode::Relaxed).unwrap();
            // Its free waits for `other`'s capture, with the per-thread stream parked.
            drop(buf);
            drop(p);
            let again = Stream::per_thread(&dev).unwrap();
            let ids = (id, again.id());
            again.begin_capture(mode).unwrap();
            // The waiting free runs now, unless it sees `again` capturing.
            let other_graph = other.end_capture().unwrap();
            let graph = again.end_capture();
            let graph = graph.unwrap_or_else(|e| panic!("the free went into the capture ({mode:?}, ids {ids:?}): {e}"));
            let nodes = graph.nodes().unwrap().len();
            assert_eq!(nodes, 0, "the free was captured ({mode:?}; the per-thread stream's ids {ids:?})");
            assert_eq!(ids.0, ids.1, "one per-thread stream, two identities");
            drop((graph, other_graph, again, other));
            cudrv::flush_deferred_drops().unwrap();
        }
        release_and_check(&dev);
    });
}

/// DEFECT (failed before the fix: the capture stayed active). A live executable graph kept the
/// stream of its last launch (`GraphExec::last_launch`) as a user: a capture on that stream whose
/// last other user went was never abandoned while the executable graph lived. It now keeps the
/// stream parked.
#[test]
fn a_live_executable_graph_does_not_keep_an_abandoned_capture_of_its_last_launchs_stream() {
    each_capture_mode(|dev, mode| {
        let (graphs, side, origin, (graph, exec, buf)) = graph_launched_on_a_new_origin(dev);
        capture_joined(&origin, &side, mode);
        abandon(origin, &side);
        replays(&exec, &side, &buf);
        drop((exec, graph, buf, side));
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_graphs(), graphs);
    });
}

/// Checked and sound: a buffer of a stream joined to the capture (not its origin), dropped during
/// it, as a `DeviceBuffer` (a stream-ordered free) and as a pitched buffer (a synchronous free
/// after waiting): each free waits for the capture's end, which comes when the origin's last user
/// goes, and then runs once, on the joined stream (nothing is left, no freed memory is touched).
#[test]
fn frees_on_a_joined_stream_run_once_when_the_abandoned_capture_ends() {
    each_capture_mode(|dev, mode| {
        let side = Stream::new(&dev).unwrap();
        let origin = Stream::new(&dev).unwrap();
        let mut flat = DeviceBuffer::<u32>::zeroed(1 << 12, &side).unwrap();
        flat.fill(1).unwrap();
        let pitched = cudrv::memory::DeviceBuffer2D::<u32>::zeroed(64, 8, &side).unwrap();
        side.synchronize().unwrap();
        capture_joined(&origin, &side, mode);
        drop((flat, pitched));
        assert!(fake_report().live_allocations >= 2, "freed during the capture");
        abandon(origin, &side);
        drop(side);
    });
}

/// Checked and sound: a buffer dropped inside a host function (of another stream) while its own
/// stream captures: the free goes to cudrv's thread, waits for the capture's end there, and runs
/// once the origin's last user goes (on the dropping thread, which ends the capture).
#[test]
fn a_buffer_dropped_in_a_host_function_during_the_capture_is_freed_when_it_is_abandoned() {
    each_capture_mode(|dev, mode| {
        let side = Stream::new(&dev).unwrap();
        let origin = Stream::new(&dev).unwrap();
        let host = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &origin).unwrap();
        origin.synchronize().unwrap();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (dropped, seen) = std::sync::mpsc::channel::<()>();
        host.launch_host_fn(move || {
            let _ = wait.recv();
            drop(buf);
            let _ = dropped.send(());
        })
        .unwrap();
        capture_joined(&origin, &side, mode);
        go.send(()).unwrap();
        seen.recv().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the origin's user lives");
        abandon(origin, &side);
        host.synchronize().unwrap();
        drop((side, host));
    });
}

/// A buffer used by a graph, dropped (its free waits for the graph's launches), then the graph
/// dropped while the stream of its last launch captures: the graph's release waits for that
/// capture, which ends when the origin's last user goes; then the graph is given back and the
/// buffer freed on a new handle of its stream (its last one went). DEFECT: failed before this
/// review's fix of `Kept::fences` (the capture never ended).
#[test]
fn a_free_after_a_graph_released_after_an_abandoned_capture_runs() {
    each_capture_mode(|dev, mode| {
        let (graphs, side, origin, (graph, exec, buf)) = graph_launched_on_a_new_origin(dev);
        drop(buf);
        capture_joined(&origin, &side, mode);
        drop((exec, graph));
        abandon(origin, &side);
        drop(side);
        within(LIMIT, "the graph's release", cudrv::flush_deferred_drops).unwrap();
        assert_eq!(live_graphs(), graphs, "the graph is given back");
    });
}

/// A resource over a `StreamOrderedPool` whose `deallocate` keeps (a clone of) the stream it is
/// given.
#[derive(Debug)]
struct Keeper {
    pool: std::sync::Arc<cudrv::memory::StreamOrderedPool>,
    kept: std::sync::Mutex<Vec<Stream>>,
}

// SAFETY: the pool's memory, freed in the given stream's order by the pool.
unsafe impl cudrv::memory::MemoryResource for Keeper {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<cudrv::memory::DevicePtr> {
        self.pool.allocate(bytes, stream)
    }

    unsafe fn deallocate(&self, ptr: cudrv::memory::DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        self.kept.lock().unwrap().push(stream.clone());
        // SAFETY: forwarded.
        unsafe { self.pool.deallocate(ptr, bytes, stream) }
    }

    fn device(&self) -> Device {
        self.pool.device()
    }

    fn kind(&self) -> cudrv::memory::ResourceKind {
        cudrv::memory::ResourceKind::Custom
    }
}

/// DEFECT (failed before the fix of `Stream::per_thread`: the thread's stream had another id than
/// the stream the free ran on and the resource kept). A free that waited parked
/// for a capture, on a per-thread stream whose last handle went meanwhile (retiring the pool's
/// cache of it), runs on a new handle of the same stream; the custom resource's `deallocate` keeps
/// that stream and allocates on it later, and `Stream::per_thread` on the same thread gives the
/// same stream (one handle). The pool serves and reads back there, and gives everything back.
#[test]
fn a_stream_kept_by_a_resource_from_a_revived_free_is_the_threads_stream() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let pool = std::sync::Arc::new(cudrv::memory::StreamOrderedPool::new(&dev).unwrap());
        let keeper = std::sync::Arc::new(Keeper { pool: pool.clone(), kept: Default::default() });
        let other = Stream::new(&dev).unwrap();
        let p = Stream::per_thread(&dev).unwrap();
        let id = p.id();
        let mut buf = DeviceBuffer::<u32>::zeroed_in(1 << 12, &p, keeper.clone()).unwrap();
        buf.fill(3).unwrap();
        buf.record_use(&other).unwrap();
        other.begin_capture(CaptureMode::Relaxed).unwrap();
        drop(buf);
        drop(p);
        assert!(keeper.kept.lock().unwrap().is_empty(), "freed during the capture");
        drop(other.end_capture().unwrap());
        cudrv::flush_deferred_drops().unwrap();
        let kept = keeper.kept.lock().unwrap().pop().expect("the free ran at the capture's end");
        assert_eq!(kept.id(), id, "the buffer's stream");
        let again = Stream::per_thread(&dev).unwrap();
        assert_eq!(again.id(), id, "the thread's per-thread stream");
        let data: Vec<u32> = (0..1024).collect();
        let on_kept = DeviceBuffer::from_slice_in(&data, &kept, keeper.clone()).unwrap();
        assert_eq!(on_kept.to_vec().unwrap(), data);
        drop((on_kept, kept, again, other));
        keeper.kept.lock().unwrap().clear();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(cudrv::memory::MemoryResource::stats(&*pool).unwrap().in_use, 0, "everything freed");
        cudrv::memory::MemoryResource::trim(&*pool, 0).unwrap();
        drop((keeper, pool));
        release_and_check(&dev);
    });
}

/// DEFECT (failed before the fix). An executable graph that holds memory of cudrv's pool,
/// dropped while the stream of its last launch captures, leaves the next executable graph's
/// permission to cudrv's thread, which waits for that stream's work once it can
/// (`after_stream_work`); it held a user of the stream meanwhile (as the graph's fences did), so
/// a capture whose origin's last user went was never abandoned (and the wait never ended). The
/// graph itself lives on.
#[test]
fn a_pool_graphs_executable_dropped_during_a_capture_does_not_keep_it() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let pool: std::sync::Arc<dyn cudrv::memory::MemoryResource> =
            std::sync::Arc::new(cudrv::memory::StreamOrderedPool::new(&dev).unwrap());
        for mode in CAPTURE_MODES {
            let side = Stream::new(&dev).unwrap();
            let origin = Stream::new(&dev).unwrap();
            let cap = Stream::new(&dev).unwrap();
            let mut out = DeviceBuffer::<u32>::zeroed(64, &cap).unwrap();
            cap.synchronize().unwrap();
            cap.begin_capture(CaptureMode::Relaxed).unwrap();
            let mut tmp = DeviceBuffer::<u32>::zeroed_in(64, &cap, pool.clone()).unwrap();
            tmp.fill(6).unwrap();
            out.copy_from(&tmp).unwrap();
            drop(tmp);
            let graph = cap.end_capture().unwrap();
            let exec = graph.instantiate().unwrap();
            exec.launch(&origin).unwrap();
            origin.synchronize().unwrap();
            assert_eq!(out.to_vec().unwrap(), vec![6; 64]);
            capture_joined(&origin, &side, mode);
            drop(exec);
            drop(origin);
            within(LIMIT, "the abandoned capture's end", || check_ended(&side));
            // The next executable graph may be made, and runs.
            let again = within(LIMIT, "the next executable graph", || graph.instantiate()).unwrap();
            again.launch(&side).unwrap();
            side.synchronize().unwrap();
            drop((again, graph, out, side, cap));
            cudrv::flush_deferred_drops().unwrap();
        }
        drop(pool);
        release_and_check(&dev);
    });
}

/// Checked and sound: the free that waited for an abandoned capture fails in the driver
/// (`cuMemFreeAsync`, the first free of the process): the capture still ends, the error reaches
/// the drop-error hook once, and the memory is leaked once (never freed twice, nothing touched
/// after a free).
#[test]
fn a_failed_free_after_an_abandoned_capture_leaks_once_and_reports() {
    static SEEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    fn hook(e: &cudrv::Error) {
        assert_eq!(e.code(), Some(cudrv::sys::CUresult::CUDA_ERROR_UNKNOWN), "{e}");
        SEEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    cudrv_test_support::run_with_fake(
        &[("CUDRV_FAKE_DELAY_US", "0"), ("CUDRV_FAKE_FAIL", "cuMemFreeAsync:1:999")],
        || {
            if crate::oldest() {
                return; // no driver pools: the device's pool frees with no cuMemFreeAsync
            }
            assert!(cudrv::set_drop_error_hook(hook));
            let dev = Device::get(0).unwrap();
            let side = Stream::new(&dev).unwrap();
            let origin = Stream::new(&dev).unwrap();
            let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &origin).unwrap();
            origin.synchronize().unwrap();
            capture_joined(&origin, &side, CaptureMode::ThreadLocal);
            drop(buf);
            drop(origin);
            within(LIMIT, "the abandoned capture's end", || check_ended(&side));
            drop(side);
            graph_cases::release_everything(&dev);
            assert_eq!(cudrv_test_support::fake_faults_injected(), 1, "the free met the fault");
            assert_eq!(SEEN.load(std::sync::atomic::Ordering::SeqCst), 1, "reported once");
            let report = fake_report();
            assert!(report.violations.is_empty(), "{report}");
            assert_eq!(report.live_allocations, 1, "the failed free's memory, leaked once: {report}");
        },
    );
}

/// DEFECT (older than d571d3c; failed before the fix in `CaptureSession::abandon`). Where the
/// driver failed the `cuStreamEndCapture` of an abandoned capture once (a passing fault), the
/// capture went on for good: its origin has no user left to end it, so the joined stream stayed
/// capturing (its work refused), and the free that waited for the end never ran (the buffer
/// leaked). Now cudrv's thread tries again, which a relaxed capture allows (in the other modes
/// only the thread that began it may end it).
#[test]

fn an_abandoned_capture_whose_end_fails_once_still_ends() {
    let fail = [("CUDRV_FAKE_DELAY_US", "0"), ("CUDRV_FAKE_FAIL", "cuStreamEndCapture:1:999")];
    cudrv_test_support::run_with_fake(&fail, || {
        let dev = Device::get(0).unwrap();
        let side = Stream::new(&dev).unwrap();
        let origin = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &origin).unwrap();
        origin.synchronize().unwrap();
        capture_joined(&origin, &side, CaptureMode::Relaxed);
        drop(buf);
        drop(origin);
        std::thread::sleep(std::time::Duration::from_millis(50));
        within(LIMIT, "the abandoned capture's end", || check_ended(&side));
        assert_eq!(cudrv_test_support::fake_faults_injected(), 1);
        drop(side);
        release_and_check(&dev);
    });
}

/// Checked and sound: where the driver fails every end of an abandoned capture, cudrv's thread
/// gives up after a while (the capture goes on; what waits for it leaks), and deferred work goes
/// on meanwhile: `flush_deferred_drops` returns.
#[test]
fn an_abandoned_capture_whose_end_always_fails_is_given_up_without_a_hang() {
    let fail = [("CUDRV_FAKE_DELAY_US", "0"), ("CUDRV_FAKE_FAIL", "cuStreamEndCapture:1+:999")];
    cudrv_test_support::run_with_fake(&fail, || {
        let dev = Device::get(0).unwrap();
        let side = Stream::new(&dev).unwrap();
        let origin = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(1 << 12, &origin).unwrap();
        origin.synchronize().unwrap();
        capture_joined(&origin, &side, CaptureMode::Relaxed);
        drop(buf);
        drop(origin);
        within(LIMIT, "deferred work while the end is retried", cudrv::flush_deferred_drops).unwrap();
        // Tries until they stop (a count that stays for 200 ms), within 60 s (1000 tries about
        // a millisecond apart, which a loaded machine stretches).
        let start = std::time::Instant::now();
        let mut tries = cudrv_test_support::fake_faults_injected();
        loop {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let now = cudrv_test_support::fake_faults_injected();
            if now == tries {
                break;
            }
            tries = now;
            assert!(start.elapsed() < std::time::Duration::from_secs(60), "still trying: {tries}");
        }
        assert!(tries > 1, "tried again: {tries}");
        within(LIMIT, "deferred work once given up", cudrv::flush_deferred_drops).unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "the capture goes on");
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

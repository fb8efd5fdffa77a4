//! Captures begun on a stream while another thread queues cudrv work on it: the work is either
//! queued before the capture (and runs), or sees the capture (and is refused, or tracked by the
//! graph), never captured unseen.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudrv::graph::CaptureMode;
use cudrv::memory::{
    DeviceBuffer, DeviceBuffer2D, DriverPool, ManagedBuffer, MemoryResource, PinnedBuffer, SyncResource,
};
use cudrv::{Device, Error, Graph, Stream};
use cudrv_test_support::{fake_report, run_with_fake};

/// What a racing capturer and the operations it races share.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    captures: AtomicUsize,
    ops: AtomicUsize,
}

/// A thread that begins and ends captures on `s` until told to stop, counting them and keeping
/// the graphs that got nodes. Each capture, and each pause between two, lasts until an operation
/// ran (at most 10 ms), so that operations meet both whatever the machine's load.
fn capturer(s: Stream, shared: Arc<Shared>) -> std::thread::JoinHandle<Vec<Graph>> {
    let next_op = |shared: &Shared| {
        let (before, start) = (shared.ops.load(Ordering::SeqCst), Instant::now());
        while shared.ops.load(Ordering::SeqCst) == before && start.elapsed() < Duration::from_millis(10) {
            std::thread::yield_now();
        }
    };
    std::thread::spawn(move || {
        let mut graphs = Vec::new();
        while !shared.stop.load(Ordering::Relaxed) {
            next_op(&shared);
            if s.begin_capture(CaptureMode::Relaxed).is_ok() {
                next_op(&shared);
                // Refused while a buffer allocated in the capture lives: the capture goes on.
                let g = loop {
                    match s.end_capture() {
                        Err(Error::Capturing { .. }) => std::thread::yield_now(),
                        ended => break ended.unwrap(),
                    }
                };
                shared.captures.fetch_add(1, Ordering::Relaxed);
                if !g.nodes().unwrap().is_empty() {
                    graphs.push(g);
                }
            }
        }
        graphs
    })
}

/// Runs `op` while captures come and go on `s` (for at least 100 ms and 20 captures, at most 10
/// s); returns the captures made and the graphs that got nodes.
fn race(s: &Stream, mut op: impl FnMut()) -> (usize, Vec<Graph>) {
    let shared = Arc::new(Shared::default());
    let t = capturer(s.clone(), shared.clone());
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10)
        && (start.elapsed() < Duration::from_millis(100) || shared.captures.load(Ordering::Relaxed) < 20)
    {
        op();
        shared.ops.fetch_add(1, Ordering::SeqCst);
    }
    shared.stop.store(true, Ordering::Relaxed);
    let graphs = t.join().unwrap();
    (shared.captures.load(Ordering::Relaxed), graphs)
}

#[test]
fn host_copies_racing_captures_are_done_or_refused_never_captured() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[7u32; 256], &s).unwrap();
        let (mut done, mut refused) = (0, 0);
        let (captures, graphs) = race(&s, || {
            let mut dst = vec![0u32; 256];
            match buf.copy_to_host(&mut dst) {
                Ok(()) => {
                    assert!(dst.iter().all(|&v| v == 7), "a copy that returned Ok did not run");
                    done += 1;
                }
                Err(Error::Capturing { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
            let mut pinned = PinnedBuffer::<u32>::new(&dev, 256).unwrap();
            match buf.copy_to_pinned_async(&mut pinned) {
                Ok(()) => assert!(pinned.as_slice().unwrap().iter().all(|&v| v == 7), "a pinned copy did not run"),
                Err(Error::Capturing { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        });
        // Host copies are refused in a capture: a graph with a node captured one unseen.
        assert!(graphs.is_empty(), "{} graphs captured a host copy", graphs.len());
        assert!(done > 0 && captures > 0, "no race: {done} copies, {refused} refused, {captures} captures");
    });
}

#[test]
fn device_work_racing_captures_is_kept_alive_by_the_graphs_that_captured_it() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        // Freed synchronously on drop (when no graph keeps it), so that a use after free shows.
        let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
        let mut captured = 0;
        for _ in 0..200 {
            let mut buf = DeviceBuffer::<u32>::zeroed_in(1024, &s, sync.clone()).unwrap();
            s.synchronize().unwrap();
            let (s2, done) = (s.clone(), Arc::new(AtomicUsize::new(0)));
            let done2 = done.clone();
            let capture = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_micros(50));
                s2.begin_capture(CaptureMode::Relaxed).unwrap();
                // Memsets queued meanwhile see the capture: the graph keeps the buffer. (Wait
                // for one, whatever the machine's load.)
                let (before, start) = (done2.load(Ordering::SeqCst), Instant::now());
                while done2.load(Ordering::SeqCst) == before && start.elapsed() < Duration::from_secs(1) {
                    std::thread::yield_now();
                }
                s2.end_capture().unwrap()
            });
            while !capture.is_finished() {
                match buf.memset(1) {
                    Ok(()) | Err(Error::Capturing { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
            let graph = capture.join().unwrap();
            drop(buf); // kept by a graph that captured a memset of it, else freed now
            if !graph.nodes().unwrap().is_empty() {
                captured += 1;
                graph.instantiate().unwrap().launch(&s).unwrap();
                s.synchronize().unwrap();
            }
        }
        let report = fake_report();
        assert!(report.violations.is_empty(), "graphs wrote freed memory: {:?}", report.violations);
        assert!(captured > 0, "no graph captured a memset");
    });
}

#[test]
fn a_capture_waits_for_a_host_copy_under_way_on_its_stream() {
    // Each operation of the emulated GPU takes 100 ms: the copy below is under way when the other
    // thread begins its capture, which must wait for it. A round where this thread came late (the
    // capture came first: the copy is refused, or the capture was over before the copy) proves
    // nothing, and is tried again. The copy's wait (for an event, whose record is one more
    // operation of the emulated GPU) lets the capture begin once the copy is queued: for a copy
    // into pageable memory, once it is done.
    const COPY: Duration = Duration::from_millis(100);
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "100000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[3u32; 64], &s).unwrap();
        s.synchronize().unwrap();
        for round in 0..20 {
            let s2 = s.clone();
            let capture = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                s2.begin_capture(CaptureMode::Relaxed).unwrap();
                let began = Instant::now();
                let graph = s2.end_capture().unwrap();
                (began, graph.nodes().unwrap().len())
            });
            let copy_began = Instant::now();
            let copied = buf.to_vec();
            let (capture_began, nodes) = capture.join().unwrap();
            assert_eq!(nodes, 0);
            match copied {
                // A capture that began after the copy did not come first (the copy would have been
                // refused), so it began once the copy was done.
                Ok(back) if capture_began > copy_began => {
                    assert_eq!(back, vec![3; 64]);
                    assert!(
                        capture_began >= copy_began + COPY,
                        "the capture began while the copy was under way (round {round})"
                    );
                    return;
                }
                Ok(back) => assert_eq!(back, vec![3; 64]),
                Err(Error::Capturing { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        }
        panic!("the capture came before the copy in every round");
    });
}

#[test]
fn driver_pool_buffers_racing_captures_are_the_graphs_or_not_as_they_see() {
    // The driver's pool queues its allocations and frees on the stream: one that another thread's
    // capture took unseen would be a graph's allocation used (and freed) outside the graph, or a
    // free captured for memory of no graph.
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if crate::oldest() {
            // CUDA 11.1 has no driver pools (checked in api.rs).
            return;
        }
        let pool: Arc<dyn MemoryResource> = Arc::new(DriverPool::default_pool(&dev).unwrap());
        let (mut made, mut refused) = (0, 0);
        let (captures, graphs) = race(&s, || match DeviceBuffer::<u32>::zeroed_in(256, &s, pool.clone()) {
            Ok(buf) => {
                made += 1;
                drop(buf);
            }
            Err(Error::Capturing { .. }) => refused += 1,
            Err(e) => panic!("{e}"),
        });
        s.synchronize().unwrap();
        let report = fake_report();
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        // Allocations inside captures are the graphs' (nodes); outside, plain.
        assert!(made > 0 && !graphs.is_empty(), "no race: {made} made, {refused} refused, {captures} captures");
    });
}

#[test]
fn pitched_and_managed_frees_racing_captures_wait_for_them_and_lose_nothing() {
    // Their frees are synchronous (cuMemFree after a wait for the stream): a capture begun between
    // the look at the stream and the wait made the wait fail, and the memory leaked with an error.
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let live_before = fake_report().live_allocations;
        let mut made = 0;
        let (captures, _) = race(&s, || {
            match DeviceBuffer2D::<u32>::zeroed(64, 4, &s) {
                Ok(b) => {
                    made += 1;
                    drop(b);
                }
                Err(Error::Capturing { .. }) => {}
                Err(e) => panic!("{e}"),
            }
            match ManagedBuffer::<u32>::zeroed(256, &s) {
                Ok(b) => {
                    made += 1;
                    drop(b);
                }
                Err(Error::Capturing { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        });
        cudrv::flush_deferred_drops().unwrap();
        s.synchronize().unwrap(); // no drop error kept
        assert_eq!(fake_report().live_allocations, live_before, "memory leaked");
        assert!(made > 0 && captures > 0, "no race: {made} made, {captures} captures");
    });
}

#[test]
fn two_threads_beginning_a_capture_on_one_stream_leave_one_capture_tracked() {
    // Both threads tried to mark the stream; the one that failed to (the other was beginning)
    // asked the driver anyway, and could win there: the marking thread's refusal then cleared
    // the winner's capture id, and its capture went on untracked (a buffer allocated in it did
    // not keep `end_capture` from ending it). Failures are counted, not panicked on, so that the
    // other thread is not left waiting at the barrier.
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let rounds = 300;
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let (s, barrier) = (s.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let (mut won, mut untracked, mut other) = (0, 0, Vec::new());
                    for _ in 0..rounds {
                        barrier.wait();
                        let begun = s.begin_capture(CaptureMode::Relaxed);
                        barrier.wait();
                        match begun {
                            Ok(()) => {
                                won += 1;
                                // The capture is tracked: a buffer allocated in it holds it open.
                                let b = DeviceBuffer::<u32>::zeroed(1024, &s);
                                let held = matches!(s.end_capture(), Err(Error::Capturing { .. }));
                                drop(b);
                                if held {
                                    if let Err(e) = s.end_capture() {
                                        other.push(e.to_string());
                                    }
                                } else {
                                    untracked += 1;
                                }
                            }
                            Err(Error::Driver { code: cudrv_sys::CUresult::CUDA_ERROR_ILLEGAL_STATE, .. }) => {}
                            Err(e) => other.push(e.to_string()),
                        }
                        barrier.wait();
                    }
                    (won, untracked, other)
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let won: usize = results.iter().map(|r| r.0).sum();
        let untracked: usize = results.iter().map(|r| r.1).sum();
        let other: Vec<&String> = results.iter().flat_map(|r| &r.2).collect();
        assert_eq!((won, untracked), (rounds, 0), "one begin wins each round, tracked; errors: {other:?}");
        assert!(other.is_empty(), "{other:?}");
        cudrv::flush_deferred_drops().unwrap();
        s.synchronize().unwrap();
    });
}

/// The device's driver pool, slowed by 50 ms an allocation (so that a capture can try to end
/// while an allocation of the capture is under way), and what tells when one is under way.
fn slow_pool(dev: &Device) -> (Arc<dyn MemoryResource>, std::sync::mpsc::Receiver<()>) {
    let (pool, began) = crate::slowed::slowed(DriverPool::default_pool(dev).unwrap(), Duration::from_millis(50));
    (pool, began)
}

#[test]
fn a_capture_does_not_end_under_an_allocation_of_it_under_way() {
    // `end_capture` looked at the capture's live buffers, then ended it, while another thread's
    // allocation in the capture was under way: the buffer came out of an ended capture (the
    // graph's allocation, used outside it). The stream's capture is now marked as changing from
    // the look to the end, which waits for the allocation: it counts, and the capture goes on.
    run_with_fake(&[], || {
        if crate::oldest() {
            return; // no driver pools on CUDA 11.1
        }
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (pool, began) = slow_pool(&dev);
        s.begin_capture(CaptureMode::Relaxed).unwrap();
        let allocator = {
            let (s, pool) = (s.clone(), pool.clone());
            std::thread::spawn(move || DeviceBuffer::<u32>::zeroed_in(256, &s, pool).unwrap())
        };
        crate::slowed::under_way(&began);
        let ended = s.end_capture();
        assert!(
            matches!(ended, Err(Error::Capturing { .. })),
            "the capture ended under its allocation: {:?}",
            ended.map(|_| ())
        );
        drop(allocator.join().unwrap()); // freed in the capture
        let graph = s.end_capture().unwrap();
        assert!(!graph.nodes().unwrap().is_empty(), "the allocation and its free are the graph's");
        s.synchronize().unwrap();
        let report = fake_report();
        assert!(report.violations.is_empty(), "{:?}", report.violations);
    });
}

/// How a stream joins another stream's capture.
#[derive(Clone, Copy, Debug)]
enum Join {
    /// `Stream::wait_stream` on the capturing stream.
    WaitStream,
    /// `Stream::wait_event` on an event recorded in the capture.
    WaitEvent,
}

/// Makes `s2` join the capture under way on `s1`, the way `how` says.
fn join(how: Join, s1: &Stream, s2: &Stream) {
    match how {
        Join::WaitStream => s2.wait_stream(s1).unwrap(),
        Join::WaitEvent => {
            let ev = cudrv::Event::new(&s1.device()).unwrap();
            ev.record(s1).unwrap();
            s2.wait_event(&ev).unwrap();
        }
    }
}

/// Another thread allocates on `s2` (slowly) while `s2` joins a capture of `s1`: the allocation
/// must come before the join (plain memory) or see it (the graph's), never be captured unseen.
fn a_join_waits_for_an_allocation_under_way(how: Join) {
    run_with_fake(&[], || {
        if crate::oldest() {
            return; // no driver pools on CUDA 11.1
        }
        let dev = Device::get(0).unwrap();
        let (s1, s2) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let (pool, began) = slow_pool(&dev);
        // A capture has begun before (the joins are tracked from the first one on).
        s1.begin_capture(CaptureMode::Relaxed).unwrap();
        drop(s1.end_capture().unwrap());
        s1.begin_capture(CaptureMode::Relaxed).unwrap();
        let allocator = {
            let (s2, pool) = (s2.clone(), pool.clone());
            std::thread::spawn(move || DeviceBuffer::<u32>::zeroed_in(256, &s2, pool).unwrap())
        };
        crate::slowed::under_way(&began);
        join(how, &s1, &s2);
        let buf = allocator.join().unwrap();
        s1.wait_stream(&s2).unwrap(); // joined back
        let graph = s1.end_capture().unwrap();
        // Made before the join, the buffer is plain memory, readable outside the graph. (Captured
        // unseen, it would be the graph's allocation: nothing outside a launch of it.)
        let back = buf.to_vec().unwrap();
        assert_eq!(back.len(), 256);
        drop(buf);
        drop(graph);
        s2.synchronize().unwrap();
        s1.synchronize().unwrap();
        let report = fake_report();
        assert!(report.violations.is_empty(), "{how:?}: {:?}", report.violations);
    });
}

#[test]
fn a_join_by_wait_stream_waits_for_an_allocation_under_way() {
    a_join_waits_for_an_allocation_under_way(Join::WaitStream);
}

#[test]
fn a_join_by_wait_event_waits_for_an_allocation_under_way() {
    a_join_waits_for_an_allocation_under_way(Join::WaitEvent);
}

#[test]
fn a_capture_waits_for_an_allocation_of_the_device_resource_under_way() {
    // `DeviceBuffer::uninit` on the device's own resource (a driver pool, the default where the
    // device has pools) looked at the stream's capture, then allocated, with no gate: a capture
    // begun in between by another thread took the allocation unseen, and the buffer, plain to
    // cudrv, was the graph's memory.
    run_with_fake(&[], || {
        if crate::oldest() {
            return; // no driver pools on CUDA 11.1
        }
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (pool, began) = slow_pool(&dev);
        dev.set_memory_resource(pool, "a slow driver pool, for the test").unwrap();
        let allocator = {
            let s = s.clone();
            std::thread::spawn(move || DeviceBuffer::<u32>::zeroed(256, &s).unwrap())
        };
        crate::slowed::under_way(&began);
        s.begin_capture(CaptureMode::Relaxed).unwrap();
        let buf = allocator.join().unwrap();
        drop(s.end_capture().unwrap());
        // Made before the capture, the buffer is plain memory: zeroed, and freed as such.
        assert_eq!(buf.to_vec().unwrap(), vec![0u32; 256]);
        drop(buf);
        s.synchronize().unwrap();
        let report = fake_report();
        assert!(report.violations.is_empty(), "{:?}", report.violations);
    });
}

#[test]
fn a_capture_begins_and_ends_while_another_thread_queues_work_in_a_loop() {
    // A capture's mark waits for the work under way on the stream; work queued in a loop used to
    // leave the stream's gate empty only for moments between two calls, and a begin or an end
    // waited for hundreds of milliseconds (one in ten), up to seconds. New work now holds back
    // while a thread waits to mark the stream.
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(1024, &s).unwrap();
        let (mut slow, rounds) = (0, 60);
        for _ in 0..rounds {
            let s2 = s.clone();
            let capture = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_micros(50));
                let start = Instant::now();
                s2.begin_capture(CaptureMode::Relaxed).unwrap();
                let begun = start.elapsed();
                let start = Instant::now();
                drop(s2.end_capture().unwrap());
                [begun, start.elapsed()]
            });
            while !capture.is_finished() {
                match buf.memset(1) {
                    Ok(()) | Err(Error::Capturing { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            slow += capture.join().unwrap().iter().filter(|&&t| t > Duration::from_millis(100)).count();
            s.synchronize().unwrap();
        }
        // The defect made one in ten wait; a loaded machine stalls a few threads now and then.
        assert!(slow <= 6, "{slow} of {} begins and ends waited more than 100 ms", 2 * rounds);
    });
}

//! The bodies of the graph tests, shared by `fake_graph.rs` (each in a child process with the fake
//! driver, in several driver models) and `gpu_graph.rs` (on a real GPU, natively and through the
//! TCC interposer). Each checks data read back from the device, and what the pools hold.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use cudrv::graph::{CaptureMode, CaptureStatus, Graph, InstantiateFlags};
use cudrv::launch::LaunchConfig;
use cudrv::memory::{
    DeviceBuffer, DeviceBuffer2D, DeviceBuffer3D, ManagedBuffer, ManagedResource, MemoryResource, PinnedBuffer,
    ResourceKind, StreamOrderedPool, SyncResource,
};
use cudrv::module::{Function, Module};
use cudrv::sys::CUresult;
use cudrv::{Device, Error, Event, Result, Stream};

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

pub fn setup() -> (Device, Module, Stream) {
    let dev = Device::get(0).expect("device 0");
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let stream = Stream::new(&dev).unwrap();
    (dev, module, stream)
}

/// Lets go of everything cached (deferred drops, pools, events), for leak checks.
pub fn release_everything(dev: &Device) {
    cudrv::flush_deferred_drops().unwrap();
    dev.memory_resource().unwrap().trim(0).unwrap();
    dev.primary_context().unwrap().release_cached_events();
}

/// Runs `f` on a thread of its own: its result, or `None` when it has not returned after 10 s (it
/// hangs; the thread is left behind, and the process ends with the test).
pub fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10)).ok()
}

fn refused<T: std::fmt::Debug>(r: Result<T, Error>, what: &str) {
    match r {
        Err(Error::Capturing { .. }) => {}
        other => panic!("{what}: expected Error::Capturing, got {other:?}"),
    }
}

/// One step, captured: allocate a temporary (from `pool`, else the device's resource), fill it
/// with a kernel (`tmp = x + y`), copy it back (`x = tmp`), free it. Each launch adds `y` to `x`.
pub fn capture_accumulate(
    stream: &Stream,
    add: &Function,
    x: &mut DeviceBuffer<f32>,
    y: &DeviceBuffer<f32>,
    pool: Option<&Arc<dyn MemoryResource>>,
) -> Graph {
    let n = x.len();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    {
        let mut tmp = match pool {
            // SAFETY: every element is written by the kernel below before the copy reads it.
            Some(p) => unsafe { DeviceBuffer::<f32>::uninit_in(n, stream, p.clone()).unwrap() },
            // SAFETY: as above.
            None => unsafe { DeviceBuffer::<f32>::uninit(n, stream).unwrap() },
        };
        // SAFETY: add_f32(const f32*, const f32*, f32*, u64) touches [0..n] of each buffer.
        unsafe { add.launch(LaunchConfig::for_num_elems(n), stream, (&*x, y, &mut tmp, n as u64)).unwrap() };
        x.copy_from(&tmp).unwrap();
    }
    stream.end_capture().unwrap()
}

/// The device's resource if it can allocate inside a capture, else cudrv's pool (after checking
/// that the device's resource refuses with `Error::Capturing`).
fn capture_pool(dev: &Device, stream: &Stream) -> Option<Arc<dyn MemoryResource>> {
    let res = dev.memory_resource().unwrap();
    if res.supports_capture() {
        return None;
    }
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    refused(DeviceBuffer::<f32>::zeroed(16, stream), "allocating from a resource without capture support");
    drop(stream.end_capture().unwrap());
    Some(Arc::new(StreamOrderedPool::new(dev).unwrap()))
}

/// Capture, then many launches: each launch runs the whole captured work again.
pub fn a_captured_graph_replays_its_work_at_every_launch(launches: usize) {
    let (dev, module, stream) = setup();
    let add = module.function("add_f32").unwrap();
    let pool = capture_pool(&dev, &stream);
    let n = 3000;
    let y: Vec<f32> = (0..n).map(|i| (i % 17) as f32).collect();
    let x0: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut x = DeviceBuffer::from_slice(&x0, &stream).unwrap();
    let dy = DeviceBuffer::from_slice(&y, &stream).unwrap();
    let graph = capture_accumulate(&stream, &add, &mut x, &dy, pool.as_ref());
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::None);
    assert_eq!(x.to_vec().unwrap(), x0, "nothing runs during a capture");
    assert!(graph.nodes().unwrap().len() >= 2, "a copy and a kernel at least");
    let exec = graph.instantiate().unwrap();
    exec.upload(&stream).unwrap();
    for _ in 0..launches {
        exec.launch(&stream).unwrap();
    }
    let got = x.to_vec().unwrap();
    for i in 0..n {
        assert_eq!(got[i], x0[i] + launches as f32 * y[i], "element {i}");
    }
    drop((exec, graph, x, dy, pool));
    release_everything(&dev);
}

/// A temporary allocated from cudrv's pool during a capture is reserved for the graph's life:
/// nothing else gets it, and it goes back once the graph and its executable graph are gone.
pub fn pool_memory_of_a_graph_is_reserved_until_it_is_gone() {
    let (dev, module, stream) = setup();
    let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    let res: Arc<dyn MemoryResource> = pool.clone();
    let add = module.function("add_f32").unwrap();
    let n = 1 << 16;
    let mut x = DeviceBuffer::from_slice_in(&vec![1.0f32; n], &stream, res.clone()).unwrap();
    let y = DeviceBuffer::from_slice_in(&vec![2.0f32; n], &stream, res.clone()).unwrap();
    let before = pool.pool_stats().in_use;
    let graph = capture_accumulate(&stream, &add, &mut x, &y, Some(&res));
    assert_eq!(pool.pool_stats().in_use - before, n * 4, "the graph holds its temporary");
    let exec = graph.instantiate().unwrap();
    let second = graph.instantiate().unwrap_err();
    assert!(matches!(second, Error::Unsupported { .. }), "one executable graph at a time: {second}");
    for round in 0..50 {
        exec.launch(&stream).unwrap();
        // Other allocations meanwhile never get the graph's block.
        let other = DeviceBuffer::from_slice_in(&vec![round as f32; n], &stream, res.clone()).unwrap();
        assert_eq!(other.to_vec().unwrap()[n - 1], round as f32);
    }
    assert_eq!(x.to_vec().unwrap(), vec![1.0 + 2.0 * 50.0; n]);
    drop(exec);
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(pool.pool_stats().in_use - before, n * 4, "kept while the graph exists");
    let exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    assert_eq!(x.to_vec().unwrap(), vec![1.0 + 2.0 * 51.0; n]);
    drop((exec, graph));
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(pool.pool_stats().in_use, before, "given back after the last launch");
    drop((x, y, res));
    pool.trim(0).unwrap();
    assert_eq!(pool.pool_stats().reserved, 0);
    drop(pool);
    release_everything(&dev);
}

/// Launches of a captured graph (with an allocation inside) while other threads allocate, check
/// and free on their own streams.
pub fn graphs_replay_while_other_threads_allocate(launches: usize, threads: usize) {
    let (dev, module, stream) = setup();
    let add = module.function("add_f32").unwrap();
    let pool = capture_pool(&dev, &stream);
    let n = 4096;
    let mut x = DeviceBuffer::from_slice(&vec![0.0f32; n], &stream).unwrap();
    let y = DeviceBuffer::from_slice(&vec![1.0f32; n], &stream).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let s = Stream::new(&dev).unwrap();
                let mut rounds = 0u32;
                while !stop.load(Ordering::Relaxed) || rounds < 20 {
                    let len = 1000 + (rounds as usize * 37 + t * 101) % 50_000;
                    let data: Vec<u32> = (0..len as u32).map(|i| i ^ rounds).collect();
                    let b = DeviceBuffer::from_slice(&data, &s).unwrap();
                    assert_eq!(b.to_vec().unwrap(), data);
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    let graph = capture_accumulate(&stream, &add, &mut x, &y, pool.as_ref());
    let exec = graph.instantiate().unwrap();
    for _ in 0..launches {
        exec.launch(&stream).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        assert!(w.join().unwrap() >= 20);
    }
    assert_eq!(x.to_vec().unwrap(), vec![launches as f32; n]);
    drop((exec, graph, x, y, pool));
    release_everything(&dev);
}

/// A buffer allocated before the capture and used by it, dropped while the graph may still
/// launch: its memory stays the graph's until the graph is gone.
pub fn a_buffer_used_by_a_graph_outlives_its_drop() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    let res: Arc<dyn MemoryResource> = pool.clone();
    let n = 1 << 15;
    let mut target = DeviceBuffer::<u32>::zeroed_in(n, &stream, res.clone()).unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(n, &stream).unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes target[0..n].
    unsafe { fill.launch(LaunchConfig::for_num_elems(n), &stream, (&mut target, 9u32, n as u64)).unwrap() };
    out.copy_from(&target).unwrap();
    let graph = stream.end_capture().unwrap();
    let exec = graph.instantiate().unwrap();
    let in_use = pool.pool_stats().in_use;
    drop(target);
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(pool.pool_stats().in_use, in_use, "freed while a graph still uses it");
    let other = DeviceBuffer::<u32>::zeroed_in(n, &stream, res.clone()).unwrap();
    for _ in 0..3 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(out.to_vec().unwrap(), vec![9; n]);
    assert_eq!(other.to_vec().unwrap(), vec![0; n], "another buffer got the graph's memory");
    drop((exec, graph));
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(pool.pool_stats().in_use, in_use, "freed once the graph is gone (`other` took as much)");
    drop((out, other, res));
    pool.trim(0).unwrap();
    assert_eq!(pool.pool_stats().reserved, 0);
    drop(pool);
    release_everything(&dev);
}

/// What a capture refuses, and that the capture stays usable.
pub fn a_capture_refuses_what_a_graph_cannot_keep_sound() {
    let (dev, _module, stream) = setup();
    let mut buf = DeviceBuffer::from_slice(&[1u32, 2, 3, 4], &stream).unwrap();
    let mut pinned = PinnedBuffer::<u32>::new(&dev, 4).unwrap();
    let pool: Arc<dyn MemoryResource> = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    // Allocated before the capture: in a thread-local or global capture the driver refuses the
    // capturing thread's pool allocations even on other streams.
    let other = Stream::new(&dev).unwrap();
    let mut copy = DeviceBuffer::<u32>::zeroed(16, &other).unwrap();
    let mut pitched = DeviceBuffer2D::<u32>::zeroed(8, 8, &stream).unwrap();
    let managed = ManagedBuffer::<u32>::zeroed(8, &Stream::new(&dev).unwrap()).unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    refused(buf.to_vec(), "to_vec");
    refused(buf.copy_from_host(&[0; 4]), "copy_from_host");
    refused(buf.copy_to_pinned_async(&mut pinned), "copy_to_pinned_async");
    refused(buf.memset_sync(0), "memset_sync");
    refused(stream.synchronize(), "synchronize");
    refused(stream.launch_host_fn(|| {}), "launch_host_fn");
    let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
    refused(DeviceBuffer::<u32>::zeroed_in(4, &stream, sync), "SyncResource allocation");
    // Pitched and managed buffers: their free does not wait for graphs, so they stay out.
    refused(pitched.record_use(&stream), "DeviceBuffer2D::record_use");
    refused(pitched.fill(1), "DeviceBuffer2D::fill on a capturing stream");
    refused(managed.record_use(&stream), "ManagedBuffer::record_use");
    // A buffer allocated in the capture belongs to it: not usable outside it, and the capture
    // cannot end while the buffer lives (its free belongs in the graph).
    let kept = DeviceBuffer::<u32>::zeroed_in(16, &stream, pool.clone()).unwrap();
    refused(copy.copy_from_view(0, &kept.as_view(), &other), "using a capture's buffer outside it");
    refused(stream.end_capture(), "end_capture with a live buffer of the capture");
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::Active, "the capture goes on");
    drop(kept);
    let graph = stream.end_capture().unwrap();
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::None);
    assert_eq!(graph.nodes().unwrap().len(), 1, "only the kept buffer's memset was captured");
    drop(graph);
    buf.memset(0).unwrap();
    assert_eq!(buf.to_vec().unwrap(), [0; 4]);
    other.wait_stream(&stream).unwrap();
    copy.copy_from_view(12, &buf.as_view(), &other).unwrap();
    assert_eq!(copy.to_vec().unwrap()[12..], [0; 4]);
    let err = stream.end_capture().unwrap_err();
    assert!(err.code().is_some(), "ending a capture never begun is the driver's error: {err}");
    drop((buf, copy, pinned, pool, pitched, managed));
    release_everything(&dev);
}

/// A prohibited call made through the driver invalidates the capture: `end_capture` says so, and
/// the stream is usable again.
pub fn an_invalidated_capture_reports_it_and_the_stream_stays_usable() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(256, &stream).unwrap();
    let event = Event::new(&dev).unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes out[0..256].
    unsafe { fill.launch(LaunchConfig::for_num_elems(256), &stream, (&mut out, 1u32, 256u64)).unwrap() };
    // cudrv refuses to synchronise a capturing stream; the raw driver call is prohibited and
    // invalidates the capture.
    refused(stream.synchronize(), "synchronize");
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::Active, "a refusal changes nothing");
    {
        let _bound = stream.context().bind().unwrap();
        let d = cudrv::sys::Driver::global().unwrap();
        // SAFETY: a valid stream of the current context.
        let rc = unsafe { d.cuStreamSynchronize(stream.as_raw()) }.unwrap();
        assert_eq!(rc, CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::Invalidated);
    // Work queued on an invalidated capture is refused by the driver, with its error.
    let err = event.record(&stream).unwrap_err();
    assert!(err.code().is_some(), "{err}");
    let err = stream.end_capture().unwrap_err();
    assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), "{err}");
    assert_eq!(stream.capture_status().unwrap(), CaptureStatus::None);
    // SAFETY: as above.
    unsafe { fill.launch(LaunchConfig::for_num_elems(256), &stream, (&mut out, 2u32, 256u64)).unwrap() };
    assert_eq!(out.to_vec().unwrap(), vec![2; 256], "the stream works again; the captured fill never ran");
    drop(out);
    release_everything(&dev);
}

/// A buffer dropped during a capture that does not use it, while its stream captures, is freed
/// when the capture ends (a free queued in the capture would belong to the graph).
pub fn a_buffer_dropped_during_a_capture_that_does_not_use_it_is_freed_at_its_end() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    let res: Arc<dyn MemoryResource> = pool.clone();
    let unrelated = DeviceBuffer::<u32>::zeroed_in(1 << 12, &stream, res.clone()).unwrap();
    let mut used = DeviceBuffer::<u32>::zeroed(64, &stream).unwrap();
    let before = pool.pool_stats().in_use;
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes used[0..64].
    unsafe { fill.launch(LaunchConfig::for_num_elems(64), &stream, (&mut used, 5u32, 64u64)).unwrap() };
    drop(unrelated);
    assert_eq!(pool.pool_stats().in_use, before, "not freed inside the capture");
    let graph = stream.end_capture().unwrap();
    assert_eq!(pool.pool_stats().in_use, before - 4 * (1 << 12), "freed when the capture ended");
    let exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    assert_eq!(used.to_vec().unwrap(), vec![5; 64]);
    drop((exec, graph, used, res));
    pool.trim(0).unwrap();
    drop(pool);
    release_everything(&dev);
}

/// A second stream joins the capture (waits on the capturing one) and must be joined back.
pub fn streams_join_a_capture_and_the_graph_keeps_their_order() {
    let (dev, module, s1) = setup();
    let s2 = Stream::new(&dev).unwrap();
    let fill = module.function("fill_u32").unwrap();
    let n = 1 << 14;
    let mut a = DeviceBuffer::<u32>::zeroed(n, &s1).unwrap();
    let mut b = DeviceBuffer::<u32>::zeroed(n, &s1).unwrap();
    s1.begin_capture(CaptureMode::Global).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes a[0..n].
    unsafe { fill.launch(LaunchConfig::for_num_elems(n), &s1, (&mut a, 3u32, n as u64)).unwrap() };
    s2.wait_stream(&s1).unwrap();
    assert_eq!(s2.capture_status().unwrap(), CaptureStatus::Active, "s2 joined");
    assert_eq!(s2.capture_info().unwrap().id, s1.capture_info().unwrap().id);
    b.copy_from_view(0, &a.as_view(), &s2).unwrap();
    let err = s1.end_capture().unwrap_err();
    assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED), "{err}");
    assert_eq!(s1.capture_status().unwrap(), CaptureStatus::None, "the driver ended the capture");
    assert_eq!(s2.capture_status().unwrap(), CaptureStatus::None);
    s1.begin_capture(CaptureMode::Global).unwrap();
    // SAFETY: as above.
    unsafe { fill.launch(LaunchConfig::for_num_elems(n), &s1, (&mut a, 3u32, n as u64)).unwrap() };
    s2.wait_stream(&s1).unwrap();
    b.copy_from_view(0, &a.as_view(), &s2).unwrap();
    s1.wait_stream(&s2).unwrap();
    let graph = s1.end_capture().unwrap();
    assert_eq!(s2.capture_status().unwrap(), CaptureStatus::None);
    let exec = graph.instantiate().unwrap();
    exec.launch(&s1).unwrap();
    s1.synchronize().unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![3; n], "the copy ran after the fill");
    drop((exec, graph, a, b));
    release_everything(&dev);
}

/// A graph built node by node: kernel, copy, host, memset, event and empty nodes, in order.
pub fn graphs_built_node_by_node_run_in_dependency_order() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let n = 1000usize;
    let a = DeviceBuffer::<u32>::zeroed(n, &stream).unwrap();
    let b = DeviceBuffer::<u32>::zeroed(n, &stream).unwrap();
    stream.synchronize().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Event::new(&dev).unwrap());
    let mut graph = Graph::new(&dev).unwrap();
    let mut a_ptr = a.as_raw();
    let mut value = 11u32;
    let mut count = n as u64;
    let mut params: [*mut std::ffi::c_void; 3] =
        [(&raw mut a_ptr).cast(), (&raw mut value).cast(), (&raw mut count).cast()];
    let start = graph.add_event_record_node(&[], &started).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes a[0..n]; `a` outlives every launch below.
    let k = unsafe { graph.add_kernel_node(&[start], &fill, LaunchConfig::for_num_elems(n), &mut params).unwrap() };
    // SAFETY: both ranges are live buffers of n u32 that outlive every launch.
    let copy = unsafe { graph.add_memcpy_node(&[k], b.as_raw(), a.as_raw(), n * 4).unwrap() };
    let c = calls.clone();
    let host = graph
        .add_host_node(&[copy], move || {
            c.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    // SAFETY: a[0..n/2] is a live buffer that outlives every launch.
    let half = unsafe { graph.add_memset_node(&[host], a.as_raw(), 0, 4, n / 2).unwrap() };
    graph.add_empty_node(&[half]).unwrap();
    assert_eq!(graph.nodes().unwrap().len(), 6);
    let exec = graph.instantiate().unwrap();
    drop(graph); // the executable graph keeps what the host node needs
    for _ in 0..4 {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 4, "the host node ran once per launch");
    assert_eq!(b.to_vec().unwrap(), vec![11; n], "the copy ran after the kernel");
    let got = a.to_vec().unwrap();
    assert_eq!(&got[..n / 2], &vec![0; n / 2][..]);
    assert_eq!(&got[n / 2..], &vec![11; n - n / 2][..]);
    let mut g = Graph::new(&dev).unwrap();
    // SAFETY: refused before anything is added.
    let err = unsafe { g.add_memset_node(&[], a.as_raw(), 0, 3, 1) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    drop((exec, g, a, b));
    release_everything(&dev);
}

/// `GraphExec::update` with a graph of the same shape, and its refusal of another shape;
/// `set_kernel_node_params`.
pub fn executable_graphs_update_in_place_or_say_why_not() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let n = 512;
    let mut out = DeviceBuffer::<u32>::zeroed(n, &stream).unwrap();
    let capture = |value: u32, out: &mut DeviceBuffer<u32>, times: usize| {
        stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        for _ in 0..times {
            // SAFETY: fill_u32(u32*, u32, u64) writes out[0..n].
            unsafe { fill.launch(LaunchConfig::for_num_elems(n), &stream, (&mut *out, value, n as u64)).unwrap() };
        }
        stream.end_capture().unwrap()
    };
    let g1 = capture(1, &mut out, 1);
    let exec = g1.instantiate_with(InstantiateFlags::default()).unwrap();
    exec.launch(&stream).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![1; n]);
    let g2 = capture(2, &mut out, 1);
    exec.update(&g2).unwrap().expect("same shape, new argument");
    exec.launch(&stream).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![2; n]);
    let g3 = capture(3, &mut out, 2);
    let why = exec.update(&g3).unwrap().unwrap_err();
    assert!(why.reason.contains("topology"), "{why}");
    exec.launch(&stream).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![2; n], "a refused update changes nothing");
    // A node of the graph the executable graph was instantiated from (the driver's rule).
    let node = g1.nodes().unwrap()[0];
    let mut ptr = out.as_raw();
    let mut value = 7u32;
    let mut count = n as u64;
    let mut params: [*mut std::ffi::c_void; 3] =
        [(&raw mut ptr).cast(), (&raw mut value).cast(), (&raw mut count).cast()];
    // SAFETY: the same kernel on the same live buffer, which outlives the executable graph.
    unsafe { exec.set_kernel_node_params(node, &fill, LaunchConfig::for_num_elems(n), &mut params).unwrap() };
    exec.launch(&stream).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![7; n]);
    drop((exec, g1, g2, g3, out));
    release_everything(&dev);
}

/// A pool dropped while a graph holds memory of it: the memory goes back after the graph.
pub fn a_pool_dropped_before_its_graph_gives_its_memory_back_after_it() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let pool: Arc<dyn MemoryResource> = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    let mut out = DeviceBuffer::<u32>::zeroed(256, &stream).unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    {
        let mut tmp = DeviceBuffer::<u32>::zeroed_in(256, &stream, pool.clone()).unwrap();
        // SAFETY: fill_u32(u32*, u32, u64) writes tmp[0..256].
        unsafe { fill.launch(LaunchConfig::for_num_elems(256), &stream, (&mut tmp, 4u32, 256u64)).unwrap() };
        out.copy_from(&tmp).unwrap();
    }
    let graph = stream.end_capture().unwrap();
    drop(pool);
    let exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![4; 256]);
    drop((exec, graph, out));
    release_everything(&dev);
}

/// cudrv's pool keeps working on other threads while one thread captures in global mode (where
/// the driver refuses "potentially unsafe" calls, such as `cuMemAlloc` and
/// `cuEventSynchronize`, on every thread in global mode): its calls are never part of a capture,
/// and run with the thread's capture mode relaxed. The capture stays valid.
pub fn pool_work_on_other_threads_leaves_a_global_capture_valid() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    let mut out = DeviceBuffer::<u32>::zeroed(4096, &stream).unwrap();
    stream.begin_capture(CaptureMode::Global).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes out[0..4096].
    unsafe { fill.launch(LaunchConfig::for_num_elems(4096), &stream, (&mut out, 8u32, 4096u64)).unwrap() };
    let worker = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let s = Stream::new(&dev).unwrap();
            let res: Arc<dyn MemoryResource> = pool.clone();
            for round in 0..20usize {
                // Growth (cuMemAlloc), frees, then a trim that waits for them (cuEventSynchronize)
                // and gives chunks back (cuMemFree).
                let bufs: Vec<_> = (0..8)
                    .map(|i| DeviceBuffer::<u8>::zeroed_in((i + 1) * (3 << 20), &s, res.clone()).unwrap())
                    .collect();
                drop(bufs);
                pool.trim(round % 2 * (8 << 20)).unwrap();
            }
        })
    };
    worker.join().expect("the pool's work on another thread failed during a global capture");
    let graph = stream.end_capture().expect("the capture was invalidated");
    let exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![8; 4096]);
    drop((exec, graph, out));
    pool.trim(0).unwrap();
    drop(pool);
    release_everything(&dev);
}

/// With the driver's pool, an allocation inside a capture is a memory node: the driver accounts
/// it as graph memory while the executable graph lives. Where pools are missing (TCC), graph
/// memory is too, and says so.
pub fn graph_memory_nodes_where_the_driver_has_pools() {
    let (dev, module, stream) = setup();
    let res = dev.memory_resource().unwrap();
    if !dev.capabilities().unwrap().memory_pools {
        for err in [dev.graph_memory().unwrap_err(), dev.trim_graph_memory().unwrap_err()] {
            assert!(matches!(err, Error::Unsupported { feature: "graph memory", .. }), "{err}");
            assert!(err.to_string().contains("memory pools"), "{err}");
        }
        let err = dev.graph_memory().unwrap_err();
        println!("graph memory: {err} (resource {:?})", res.kind());
        return;
    }
    if res.kind() != ResourceKind::DriverPool {
        // Pools exist, but allocations come from elsewhere: no memory nodes to look at.
        assert!(dev.graph_memory().is_ok());
        return;
    }
    let fill = module.function("fill_u32").unwrap();
    let n = 1 << 20;
    let mut out = DeviceBuffer::<u32>::zeroed(n, &stream).unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    {
        // SAFETY: written by the kernel before the copy reads it.
        let mut tmp = unsafe { DeviceBuffer::<u32>::uninit(n, &stream).unwrap() };
        // SAFETY: fill_u32(u32*, u32, u64) writes tmp[0..n].
        unsafe { fill.launch(LaunchConfig::for_num_elems(n), &stream, (&mut tmp, 6u32, n as u64)).unwrap() };
        out.copy_from(&tmp).unwrap();
    }
    let graph = stream.end_capture().unwrap();
    let exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![6; n]);
    let mem = dev.graph_memory().unwrap();
    println!("graph memory after a launch: {mem:?}");
    assert!(mem.reserved_high >= (n * 4) as u64, "{mem:?}");
    drop((exec, graph));
    stream.synchronize().unwrap();
    dev.trim_graph_memory().unwrap();
    let after = dev.graph_memory().unwrap();
    assert_eq!(after.used, 0, "{after:?}");
    drop(out);
    release_everything(&dev);
}

/// The last user of a global capture's origin goes while a buffer allocated during the capture
/// (on a stream that joined it, filled by a kernel) lives: a panic between `begin_capture` and
/// `end_capture`, say. The capture goes on while the buffer lives (its memory is the graph's),
/// and ends when the buffer is dropped, on the thread that began it: the driver then no longer
/// refuses another thread's `cuMemAlloc`, and the joined stream runs work again.
pub fn an_orphaned_capture_ends_when_its_last_buffer_goes() {
    let (dev, module, side) = setup();
    let fill = module.function("fill_u32").unwrap();
    let pool = capture_pool(&dev, &side);
    let origin = Stream::new(&dev).unwrap();
    origin.begin_capture(CaptureMode::Global).unwrap();
    side.wait_stream(&origin).unwrap();
    // SAFETY: every element is written by the fill below, which is never run (the capture is
    // abandoned), and nothing reads the buffer.
    let mut tmp = unsafe {
        match &pool {
            Some(p) => DeviceBuffer::<u32>::uninit_in(4096, &side, p.clone()),
            None => DeviceBuffer::<u32>::uninit(4096, &side),
        }
    }
    .unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes tmp[0..4096].
    unsafe { fill.launch(LaunchConfig::for_num_elems(4096), &side, (&mut tmp, 3u32, 4096u64)).unwrap() };
    drop(origin);
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active, "a buffer of the capture lives");
    refused(tmp.to_vec(), "host access to the graph's memory");
    drop(tmp);
    cudrv::flush_deferred_drops().unwrap();
    assert_eq!(side.capture_status().unwrap(), CaptureStatus::None, "the orphaned capture must end");
    std::thread::spawn(move || {
        // `cuMemAlloc`, which a global capture on any thread would refuse.
        let s = Stream::new(&dev).unwrap();
        let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
        let b = DeviceBuffer::<u32>::from_slice_in(&[4; 64], &s, sync).unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![4; 64]);
    })
    .join()
    .expect("another thread's work after the orphaned capture's end");
    let mut out = DeviceBuffer::<u32>::zeroed(256, &side).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes out[0..256].
    unsafe { fill.launch(LaunchConfig::for_num_elems(256), &side, (&mut out, 5u32, 256u64)).unwrap() };
    assert_eq!(out.to_vec().unwrap(), vec![5; 256], "the joined stream runs work again");
    drop((out, side, pool));
    release_everything(&dev);
}

// ------------------------------------------------------------------------------------------------
// Host copies and memsets while a capture begins (review 31)
// ------------------------------------------------------------------------------------------------

/// What a host operation's destination holds, read once the capture has ended (the buffer is
/// dropped there).
type Check = Box<dyn FnOnce() -> Vec<u32> + Send>;

/// A synchronous host operation on a buffer of the stream (made before anything is queued behind
/// it): its result and the check of its destination.
type Run = Box<dyn FnOnce() -> (Result<()>, Check) + Send>;

/// A host operation, whether it is a copy, and what its destination must hold after it ran.
struct HostOp {
    name: &'static str,
    run: Run,
    /// A copy between the device and (pageable) host memory, which the driver may run
    /// synchronously: cudrv waits for the stream's earlier work before it queues the copy, and
    /// refuses the copy where a capture began on the stream meanwhile. A memset is queued at
    /// once.
    copy: bool,
    /// What the destination holds after a memset or a copy that ran.
    written: Vec<u32>,
}

const HOST_OP_LEN: usize = 64;

/// Every synchronous host copy and memset of the buffer types with a stream, on buffers of `s`.
/// The destinations start zeroed.
fn host_ops(s: &Stream) -> Vec<HostOp> {
    let data: Vec<u32> = (1..=HOST_OP_LEN as u32).collect();
    // A copy to the host, into a zeroed `Vec`.
    fn to_host(
        name: &'static str,
        data: &[u32],
        copy: impl FnOnce(&mut [u32]) -> Result<()> + Send + 'static,
    ) -> HostOp {
        let run: Run = Box::new(move || {
            let mut v = vec![0; HOST_OP_LEN];
            (copy(&mut v), Box::new(move || v))
        });
        HostOp { name, run, copy: true, written: data.to_vec() }
    }
    // A copy of `data` from the host into `b`, read back after.
    fn from_host<B: Send + 'static>(
        name: &'static str,
        data: &[u32],
        b: B,
        copy: fn(&mut B, &[u32]) -> Result<()>,
        read: fn(&B) -> Result<Vec<u32>>,
    ) -> HostOp {
        let d = data.to_vec();
        HostOp { name, run: on_device(b, move |b| copy(b, &d), read), copy: true, written: data.to_vec() }
    }
    // An operation on a device buffer, read back after.
    fn on_device<B: Send + 'static>(
        mut b: B,
        op: impl FnOnce(&mut B) -> Result<()> + Send + 'static,
        read: impl FnOnce(&B) -> Result<Vec<u32>> + Send + 'static,
    ) -> Run {
        Box::new(move || (op(&mut b), Box::new(move || read(&b).unwrap())))
    }
    // A memset that leaves every element `value`.
    let memset = |name, value: u32, run: Run| HostOp { name, run, copy: false, written: vec![value; HOST_OP_LEN] };
    let (b1, b2, b3, b4) = (
        DeviceBuffer::from_slice(&data, s).unwrap(),
        DeviceBuffer::<u32>::zeroed(HOST_OP_LEN, s).unwrap(),
        DeviceBuffer::<u32>::zeroed(HOST_OP_LEN, s).unwrap(),
        DeviceBuffer::<u32>::zeroed(HOST_OP_LEN, s).unwrap(),
    );
    let p1 = DeviceBuffer2D::from_slice(&data, 16, 4, s).unwrap();
    let (p2, p3) = (DeviceBuffer2D::<u32>::zeroed(16, 4, s).unwrap(), DeviceBuffer2D::<u32>::zeroed(16, 4, s).unwrap());
    let v1 = DeviceBuffer3D::from_slice(&data, (4, 4, 4), s).unwrap();
    let v2 = DeviceBuffer3D::<u32>::zeroed((4, 4, 4), s).unwrap();
    let mut m1 = ManagedBuffer::<u32>::zeroed(HOST_OP_LEN, s).unwrap();
    let m2 = ManagedBuffer::<u32>::zeroed(HOST_OP_LEN, s).unwrap();
    m1.copy_from_host(&data).unwrap();
    vec![
        to_host("DeviceBuffer::copy_to_host", &data, move |v| b1.copy_to_host(v)),
        from_host("DeviceBuffer::copy_from_host", &data, b2, DeviceBuffer::copy_from_host, DeviceBuffer::to_vec),
        memset("DeviceBuffer::memset_sync", 0xABAB_ABAB, on_device(b3, |b| b.memset_sync(0xAB), DeviceBuffer::to_vec)),
        memset("DeviceBuffer::fill_sync", 7, on_device(b4, |b| b.fill_sync(7), DeviceBuffer::to_vec)),
        to_host("DeviceBuffer2D::copy_to_host", &data, move |v| p1.copy_to_host(v)),
        from_host("DeviceBuffer2D::copy_from_host", &data, p2, DeviceBuffer2D::copy_from_host, DeviceBuffer2D::to_vec),
        memset("DeviceBuffer2D::fill_sync", 9, on_device(p3, |b| b.fill_sync(9), DeviceBuffer2D::to_vec)),
        to_host("DeviceBuffer3D::copy_to_host", &data, move |v| v1.copy_to_host(v)),
        from_host("DeviceBuffer3D::copy_from_host", &data, v2, DeviceBuffer3D::copy_from_host, DeviceBuffer3D::to_vec),
        to_host("ManagedBuffer::copy_to_host", &data, move |v| m1.copy_to_host(v)),
        from_host("ManagedBuffer::copy_from_host", &data, m2, ManagedBuffer::copy_from_host, ManagedBuffer::to_vec),
    ]
}

/// A host function on the stream waits for the thread that begins a capture there (host
/// synchronisation that depends on no CUDA work, which the driver allows), while a third thread
/// runs a synchronous host copy or memset on the stream, queued behind the host function. The
/// gate was held through the wait (and, for a copy with pageable memory, through the driver's
/// call, which waits for the host function), and `begin_capture` waited for it: all three hung.
/// Now the capture begins; the host function returns; a memset, queued before the capture,
/// completes, and a copy, which waited for the stream's earlier work before it was queued, is
/// refused as the capture is under way, its destination untouched.
pub fn a_capture_begins_while_host_copies_wait_behind_a_host_function() {
    {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ops = host_ops(&s);
        s.synchronize().unwrap();
        for HostOp { name, run, copy, written } in ops {
            let (result, check) = capture_begins_behind_a_waiting_host_fn(&s, &s, name, run);
            if copy {
                assert!(matches!(result, Err(Error::Capturing { .. })), "{name}: {result:?}");
                assert_eq!(check(), vec![0; HOST_OP_LEN], "{name} was refused, but wrote its destination");
            } else {
                result.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(check(), written, "{name}");
            }
        }
        drop(s);
        release_everything(&dev);
    }
}

/// Runs `op` (named `name`) on a thread of its own, queued behind a host function on `waiting`
/// that waits for the thread that begins a capture on `s` (`waiting` may be `s`); checks that the
/// capture begins while `op` waits, and that `op` returns once the host function has; ends the
/// capture. What `op` returned.
pub fn capture_begins_behind_a_waiting_host_fn<T: Send + 'static>(
    s: &Stream,
    waiting: &Stream,
    name: &str,
    op: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel::<()>();
    waiting
        .launch_host_fn(move || {
            // Bounded, so that the process ends either way.
            let _ = rx.recv_timeout(Duration::from_secs(20));
        })
        .unwrap();
    let op = std::thread::spawn(op);
    // The operation is under way behind the host function, and waits for it.
    std::thread::sleep(Duration::from_millis(200));
    assert!(!op.is_finished(), "{name} returned before the host function ran");
    let began = within_10s({
        let s = s.clone();
        move || {
            let r = s.begin_capture(CaptureMode::Relaxed);
            let _ = tx.send(());
            r
        }
    });
    let began = began.unwrap_or_else(|| panic!("begin_capture waited for {name}, which waits for the host function"));
    began.unwrap();
    // The capture lasts until the operation has returned.
    let result = within_10s(move || op.join().unwrap())
        .unwrap_or_else(|| panic!("{name} did not return once the host function had"));
    s.end_capture().unwrap();
    result
}

/// A buffer whose free waits for its stream on the host (a `DeviceBuffer` in a `SyncResource` or
/// a `ManagedResource`, alone or used on a second stream too; a `ManagedBuffer`, a
/// `DeviceBuffer2D`), dropped behind a host function that waits for the thread that begins a
/// capture on the stream. The drop held the stream's gate through its wait, and `begin_capture`
/// waited for it: all three hung. Now the gates go while the drop waits: the capture begins, the
/// host function returns, and the drop frees the memory (the `SyncResource` counts none in use;
/// the fake driver's leak check sees the rest).
pub fn a_capture_begins_while_a_dropped_buffer_waits_for_its_stream() {
    let dev = Device::get(0).unwrap();
    let s = Stream::new(&dev).unwrap();
    let other = Stream::new(&dev).unwrap();
    let data: Vec<u32> = (1..=HOST_OP_LEN as u32).collect();
    let sync = Arc::new(SyncResource::new(&dev).unwrap());
    let resources: [(&str, Arc<dyn MemoryResource>); 2] =
        [("SyncResource", sync.clone()), ("ManagedResource", Arc::new(ManagedResource::new(&dev).unwrap()))];
    type Drop = Box<dyn FnOnce() + Send>;
    let mut drops: Vec<(String, Drop)> = Vec::new();
    for (name, resource) in resources {
        let alone = DeviceBuffer::from_slice_in(&data, &s, resource.clone()).unwrap();
        let shared = DeviceBuffer::from_slice_in(&data, &s, resource).unwrap();
        shared.record_use(&other).unwrap();
        drops.push((format!("a DeviceBuffer in a {name}"), Box::new(move || drop(alone))));
        drops.push((format!("a DeviceBuffer in a {name} used on another stream"), Box::new(move || drop(shared))));
    }
    let managed = ManagedBuffer::from_slice(&data, &s).unwrap();
    managed.record_use(&other).unwrap();
    let pitched = DeviceBuffer2D::from_slice(&data, 16, 4, &s).unwrap();
    drops.push(("a ManagedBuffer used on another stream".into(), Box::new(move || drop(managed))));
    drops.push(("a DeviceBuffer2D".into(), Box::new(move || drop(pitched))));
    assert_eq!(sync.stats().unwrap().in_use, 2 * size_of_val(&data[..]));
    s.synchronize().unwrap();
    other.synchronize().unwrap();
    for (name, drop_it) in drops {
        capture_begins_behind_a_waiting_host_fn(&s, &s, &name, drop_it);
    }
    assert_eq!(sync.stats().unwrap().in_use, 0, "a SyncResource buffer's drop returned without its free");
    drop((s, other));
    release_everything(&dev);
}

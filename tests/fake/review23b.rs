//! Review 23b: soundness and faults in graphs, stream captures and the memory resources
//! (`graph.rs`, `session.rs`, `capture.rs`, `memory/{driver_pool,choice,stream_ordered,resource,
//! sync}.rs`). The tests named `defect_*` reproduced a defect each (they failed before the fix
//! that came with them); the others pin down behaviour that the review checked and found sound.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudrv::graph::{CaptureMode, CaptureStatus, Graph};
use cudrv::launch::LaunchConfig;
use cudrv::memory::{
    DeviceBuffer, DevicePtr, DriverPool, DriverPoolConfig, MemoryResource, ResourceKind, SyncResource,
};
use cudrv::module::Module;
use cudrv::{Device, Stream};
use cudrv_test_support::{fake_report, run_with_fake, run_with_fake_modes};

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

/// Queues `spin_fill_u32(out, 7, n, spin_us)` on `stream`: it sleeps `spin_us`, then writes 7.
fn spin_fill(module: &Module, stream: &Stream, out: &mut DeviceBuffer<u32>, spin_us: u64) {
    let f = module.function("spin_fill_u32").unwrap();
    let n = out.len() as u64;
    // SAFETY: spin_fill_u32(u32* out, u32 value, u64 n, u64 spin_us) writes out[0..n].
    unsafe { f.launch(LaunchConfig::for_num_elems(out.len()), stream, (out, 7u32, n, spin_us)).unwrap() };
}

/// Queues `fill_u32(out, value, n)` on `stream` (captured when it captures).
fn fill(module: &Module, stream: &Stream, out: &mut DeviceBuffer<u32>, value: u32) {
    let f = module.function("fill_u32").unwrap();
    let n = out.len() as u64;
    // SAFETY: fill_u32(u32* out, u32 value, u64 n) writes out[0..n].
    unsafe { f.launch(LaunchConfig::for_num_elems(out.len()), stream, (out, value, n)).unwrap() };
}

/// A block freed on `a` while a 300 ms kernel there still writes it, taken again at once on `a`
/// by `y` (the same address: the allocation is ordered after the kernel on `a`); a capture on `b`
/// then fills `y` with 5. Returns (a, c, y, the graph), `c` being an idle third stream.
fn reused_block_captured(dev: &Device, module: &Module) -> (Stream, Stream, DeviceBuffer<u32>, Graph) {
    let (a, b, c) = (Stream::new(dev).unwrap(), Stream::new(dev).unwrap(), Stream::new(dev).unwrap());
    let n = 256;
    let mut x = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
    spin_fill(module, &a, &mut x, 300_000);
    let at = x.as_raw();
    drop(x);
    let mut y = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
    assert_eq!(y.as_raw(), at, "the block freed on `a` is taken again on `a`");
    b.begin_capture(CaptureMode::ThreadLocal).unwrap();
    fill(module, &b, &mut y, 5);
    let graph = b.end_capture().unwrap();
    (a, c, y, graph)
}

/// Pins the sound case: the executable graph of a capture that used a buffer allocated before it,
/// launched on a third stream, waits (on the GPU) for the buffer's allocation, which is ordered
/// after a kernel that still wrote the same block: the graph's 5 lands after the kernel's 7.
#[test]
fn a_captured_graph_waits_for_the_allocation_of_a_reused_block() {
    run_with_fake_modes(&["linux", "tcc"], &[("CUDRV_MEMORY_RESOURCE", "pool")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let (a, c, y, graph) = reused_block_captured(&dev, &module);
        let exec = graph.instantiate().unwrap();
        exec.launch(&c).unwrap();
        c.synchronize().unwrap();
        a.synchronize().unwrap();
        let got = y.to_vec().unwrap();
        assert!(got == vec![5; 256], "the graph ran before the block's allocation: y[0] = {}", got[0]);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// Defect (failed before the fix): `Graph::add_child_graph_node` kept the child's resources but not
/// the events its first launch must wait for (the child's prelude: where the capture's streams,
/// and the buffers the capture used, stood before it). An executable graph of the parent ran the
/// child's work at once: here the child's fill of `y` ran while the kernel that last used `y`'s
/// block (before it was freed and taken again, in stream order, by `y`) still ran, and that
/// kernel's 7 overwrote the graph's 5. Safe code, a write into memory that another kernel still
/// owns. The parent now takes over the child's prelude.
#[test]
fn defect_a_parent_graph_waits_for_its_child_graph_s_prelude() {
    run_with_fake_modes(&["linux", "tcc"], &[("CUDRV_MEMORY_RESOURCE", "pool")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let (a, c, y, child) = reused_block_captured(&dev, &module);
        let mut parent = Graph::new(&dev).unwrap();
        parent.add_child_graph_node(&[], &child).unwrap();
        drop(child);
        let exec = parent.instantiate().unwrap();
        exec.launch(&c).unwrap();
        c.synchronize().unwrap();
        a.synchronize().unwrap();
        let got = y.to_vec().unwrap();
        assert!(
            got == vec![5; 256],
            "the parent graph ran its child's fill before the allocation it was captured after: y[0] = {}",
            got[0]
        );
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// Defect (failed before the fix): an executable graph launched on the legacy stream keeps what
/// its graph uses until an event recorded on that stream after its last launch completes, and
/// cudrv's deferred-work thread records that event once the graph is gone. The look for a capture
/// before the record (`session::fence_unless_capturing`) read `cuStreamIsCapturing` of the legacy
/// stream, which answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` (906) while a blocking stream of the
/// context captures, as an answer of "not capturing": the record was queued on the legacy stream,
/// which invalidated the user's capture on another thread's per-thread stream (its end failed with
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`), and the graph's host closure leaked with a drop
/// error. The record now waits until no capture makes the legacy stream depend on it.
#[test]
fn defect_a_graph_released_after_a_legacy_launch_does_not_invalidate_a_blocking_capture() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let legacy = Stream::legacy(&dev).unwrap();
        let kept = Arc::new(());
        let mut graph = Graph::new(&dev).unwrap();
        let k = kept.clone();
        graph.add_host_node(&[], move || drop(k.clone())).unwrap();
        let exec = graph.instantiate().unwrap();
        exec.launch(&legacy).unwrap();
        legacy.synchronize().unwrap();
        // A blocking stream captures: work on the legacy stream of its context would join it.
        let capturing = Stream::per_thread(&dev).unwrap();
        capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
        drop(exec);
        drop(graph);
        // (Not `flush_deferred_drops`: before the fix the deferred thread then hung in
        // `wait_for_memory` of the legacy stream, which answers 906 until the capture ends, and
        // the flush with it.)
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            capturing.capture_status().unwrap(),
            CaptureStatus::Active,
            "cudrv's release invalidated the capture"
        );
        let ended = capturing.end_capture();
        assert!(ended.is_ok(), "the user's capture: {ended:?}");
        drop(ended);
        // Once the capture is over, the graph's closure is released.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Arc::strong_count(&kept) > 1 && Instant::now() < deadline {
            cudrv::flush_deferred_drops().unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(Arc::strong_count(&kept), 1, "the graph's host closure was never released");
    });
}

/// Defect (failed before the fix): `StreamOrderedPool` records, waits on and queries events of
/// no stream that captures, but asked only cudrv's own record of captures. The legacy stream takes
/// part in no capture, yet while a blocking stream of its context captures, work queued there
/// would join it (the driver answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` and invalidates the
/// capture). A legacy stream with a free in the pool, dropped during such a capture (on another
/// thread's per-thread stream), had its last event recorded at once: the user's capture was
/// invalidated. The pool now treats such a stream as capturing.
#[test]
fn defect_the_pool_does_not_record_on_the_legacy_stream_during_a_blocking_capture() {
    run_with_fake(&[("CUDRV_MEMORY_RESOURCE", "pool")], || {
        let dev = Device::get(0).unwrap();
        let legacy = Stream::legacy(&dev).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(256, &legacy).unwrap();
        drop(buf);
        let capturing = Stream::per_thread(&dev).unwrap();
        capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
        drop(legacy);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            capturing.capture_status().unwrap(),
            CaptureStatus::Active,
            "the pool's record invalidated the capture"
        );
        let ended = capturing.end_capture();
        assert!(ended.is_ok(), "the user's capture: {ended:?}");
        drop(ended);
        // The legacy stream's block is reusable once the capture is over.
        let again = DeviceBuffer::<u32>::from_slice(&[3; 256], &Stream::new(&dev).unwrap()).unwrap();
        assert_eq!(again.to_vec().unwrap(), vec![3; 256]);
        let pool = dev.memory_resource().unwrap();
        pool.trim(0).unwrap();
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// A resource over device 0's `SyncResource` whose `trim` trims every device's resource, as a
/// wrapper that stands for "the program's memory" might.
#[derive(Debug)]
struct TrimsEveryDevice(SyncResource);

// SAFETY: every pointer is the inner resource's, handed out and taken back as it came.
unsafe impl MemoryResource for TrimsEveryDevice {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<DevicePtr> {
        self.0.allocate(bytes, stream)
    }
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.deallocate(ptr, bytes, stream) }
    }
    fn device(&self) -> Device {
        self.0.device()
    }
    fn kind(&self) -> ResourceKind {
        ResourceKind::Custom
    }
    fn trim(&self, keep_bytes: usize) -> cudrv::Result<()> {
        for dev in Device::all()? {
            if dev != self.device() {
                dev.memory_resource()?.trim(keep_bytes)?;
            }
        }
        Ok(())
    }
}

/// Defect (failed before the fix: the call never returned): `Device::set_memory_resource` trims
/// the resource it replaces (user code, for a custom resource) while it holds the registry's lock,
/// which the first use of any device's resource takes too. A custom resource whose `trim` asked
/// for another device's resource, not used yet, waited for that lock for ever. The trim now runs
/// once the lock is let go.
#[test]
fn defect_replacing_a_resource_does_not_trim_it_under_the_registry_lock() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux")], || {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dev = Device::get(0).unwrap();
            let wrapper = Arc::new(TrimsEveryDevice(SyncResource::new(&dev).unwrap()));
            dev.set_memory_resource(wrapper, "a wrapper").unwrap();
            // Replaced: the wrapper is trimmed, and asks for device 1's resource (made now).
            dev.set_memory_resource(Arc::new(SyncResource::new(&dev).unwrap()), "plain").unwrap();
            let _ = tx.send(dev.memory_resource_choice().unwrap().1.reason);
        });
        let reason = rx.recv_timeout(Duration::from_secs(10));
        assert_eq!(reason.as_deref(), Ok("plain"), "set_memory_resource hung in the old resource's trim");
        let (_, choice) = Device::get(1).unwrap().memory_resource_choice().unwrap();
        assert_eq!(choice.kind, crate::pool_kind(&Device::get(1).unwrap()));
    });
}

/// Defect (failed before the fix: the drop never returned). `SyncResource::deallocate` waits on
/// the host for the freeing stream before `cuMemFree`. For the legacy stream, while a blocking
/// stream of its context captures, that wait cannot succeed until the capture ends (every call on
/// the legacy stream answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and `wait_for_memory` keeps
/// asking): a `SyncResource` buffer of the legacy stream dropped by the thread that captures on its
/// per-thread stream waited for ever for its own capture. Both ways to free return at once now,
/// and the memory goes back once the capture is over: a `DeviceBuffer`'s drop (its free waits on
/// cudrv's thread, review 23a) and a direct `deallocate` (the resource's `cuMemFree` waits there).
#[test]
fn defect_a_sync_resource_free_on_the_legacy_stream_does_not_wait_for_the_dropping_thread_s_capture() {
    run_with_fake(&[], || {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dev = Device::get(0).unwrap();
            let legacy = Stream::legacy(&dev).unwrap();
            let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
            let buf = DeviceBuffer::<u32>::from_slice_in(&[1; 256], &legacy, sync.clone()).unwrap();
            let raw = sync.allocate(4096, &legacy).unwrap();
            let capturing = Stream::per_thread(&dev).unwrap();
            capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
            drop(buf);
            // SAFETY: from this resource with this size on this stream, unused, freed once.
            let freed = unsafe { sync.deallocate(raw, 4096, &legacy) };
            let ended = capturing.end_capture().map(drop);
            let _ = tx.send((freed, ended, sync));
        });
        let (freed, ended, sync) = rx.recv_timeout(Duration::from_secs(10)).expect("the frees hung");
        assert!(freed.is_ok(), "{freed:?}");
        assert!(ended.is_ok(), "the capture failed: {ended:?}");
        // The memory goes back once the capture is over.
        let deadline = Instant::now() + Duration::from_secs(30);
        while fake_report().live_allocations > 0 && Instant::now() < deadline {
            cudrv::flush_deferred_drops().unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        // The free's last step (the resource's count) follows the driver's free.
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(sync.stats().unwrap().in_use, 0);
        drop(sync);
        crate::assert_no_leaks_but_streams();
        let deferred = Device::get(0).unwrap().primary_context().unwrap().take_deferred();
        assert!(deferred.is_ok(), "a free failed: {deferred:?}");
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// Pins: `GraphExec::update` from a graph whose capture used another buffer keeps that buffer for
/// the executable graph's launches. The buffer (and the graph it came with) dropped after the
/// update, its block is not handed to a new buffer while the executable graph can still write it.
#[test]
fn an_updated_executable_graph_keeps_the_buffers_of_the_graph_it_was_updated_from() {
    run_with_fake_modes(&["linux", "tcc"], &[("CUDRV_MEMORY_RESOURCE", "pool")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let s = Stream::new(&dev).unwrap();
        let capture_fill = |out: &mut DeviceBuffer<u32>, value| {
            s.begin_capture(CaptureMode::ThreadLocal).unwrap();
            fill(&module, &s, out, value);
            s.end_capture().unwrap()
        };
        let mut a = DeviceBuffer::<u32>::zeroed(256, &s).unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed(256, &s).unwrap();
        let exec = capture_fill(&mut a, 1).instantiate().unwrap();
        let g2 = capture_fill(&mut b, 2);
        assert_eq!(exec.update(&g2).unwrap(), Ok(()));
        let b_at = b.as_raw();
        drop((g2, b));
        // The block of `b` stays the graph's: a new buffer of its size on its stream gets another.
        let c = DeviceBuffer::<u32>::zeroed(256, &s).unwrap();
        assert_ne!(c.as_raw(), b_at, "b's block was handed out while the updated graph still writes it");
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(c.to_vec().unwrap(), vec![0; 256]);
        assert_eq!(a.to_vec().unwrap(), vec![0; 256], "the update pointed the node at b");
        drop(exec);
        cudrv::flush_deferred_drops().unwrap();
        s.synchronize().unwrap();
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// Pins: a failed instantiation of a graph that owns pool memory (one executable graph at a
/// time) leaves it instantiable: the driver's error comes back, and the next try makes the one
/// executable graph, whose launch writes the graph's block.
#[test]
fn a_failed_instantiation_of_a_pool_memory_graph_does_not_block_the_next() {
    let fail = ("CUDRV_FAKE_FAIL", "cuGraphInstantiateWithFlags:1:2,cuGraphInstantiate:1:2");
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), fail], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut out = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let mut tmp = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
        fill(&module, &s, &mut tmp, 4);
        out.copy_from(&tmp).unwrap();
        drop(tmp);
        let graph = s.end_capture().unwrap();
        let err = graph.instantiate().unwrap_err();
        assert_eq!(err.code(), Some(cudrv::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY), "{err:?}");
        assert_eq!(cudrv_test_support::fake_faults_injected(), 1);
        let exec = graph.instantiate().unwrap();
        let second = graph.instantiate();
        assert!(matches!(second, Err(cudrv::Error::Unsupported { .. })), "{second:?}");
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![4; 64]);
        assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    });
}

/// Pins: `DriverPool` refuses a stream of another device (`DeviceMismatch`) before asking the
/// driver, and serves its own device's streams.
#[test]
fn a_driver_pool_refuses_another_device_s_stream() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux")], || {
        if crate::oldest() {
            return; // no driver pools on CUDA 11.1
        }
        let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
        let pool = DriverPool::with_config(&d0, DriverPoolConfig::default()).unwrap();
        let other = Stream::new(&d1).unwrap();
        let err = pool.allocate(1024, &other).unwrap_err();
        assert!(matches!(err, cudrv::Error::DeviceMismatch { expected: 0, found: 1, .. }), "{err:?}");
        let own = Stream::new(&d0).unwrap();
        let p = pool.allocate(0, &own).unwrap();
        assert_ne!(p, 0, "a zero-byte request takes one byte");
        // SAFETY: `p` came from this pool with this size, and nothing uses it.
        unsafe { pool.deallocate(p, 0, &own).unwrap() };
        own.synchronize().unwrap();
    });
}

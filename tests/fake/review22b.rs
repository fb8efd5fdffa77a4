//! Review 22b: soundness and driver faults in modules, launches, events, contexts, devices and
//! host functions. Five tests reproduced a defect each (they failed before the fixes that came
//! with them); the others pin down behaviour that the review checked.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudrv::launch::LaunchConfig;
use cudrv::memory::DeviceBuffer;
use cudrv::module::Module;
use cudrv::sys::CUdevice_attribute as DA;
use cudrv::{Device, Error, Event, Stream};
use cudrv_test_support::{fake_faults_injected, fake_report, fake_shutdown, run_with_fake};

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");
const TWO_DEVICES: (&str, &str) = ("CUDRV_FAKE_DEVICES", "linux,linux");

/// Queues `spin_fill_u32(out, 7, n, spin_us)` on `stream` (whose device `module` is loaded on).
fn spin_fill(module: &Module, stream: &Stream, out: &mut DeviceBuffer<u32>, spin_us: u64) {
    let f = module.function("spin_fill_u32").unwrap();
    let n = out.len() as u64;
    // SAFETY: spin_fill_u32(u32* out, u32 value, u64 n, u64 spin_us) writes out[0..n].
    unsafe { f.launch(LaunchConfig::for_num_elems(out.len()), stream, (out, 7u32, n, spin_us)).unwrap() };
}

// ------------------------------------------------------------------------------------------------
// Stream::wait_stream across devices
// ------------------------------------------------------------------------------------------------

/// Makes `waiter` (a stream of device 0) wait for a 400 ms kernel on a stream of device 1, then
/// records an event on `waiter` and waits for it: the event must not complete before the kernel.
fn cross_device_wait(waiter: impl Fn(&Device) -> Stream) {
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    let s1 = Stream::new(&d1).unwrap();
    let m1 = Module::from_ptx(&d1, PTX).unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(256, &s1).unwrap();
    let w = waiter(&d0);
    spin_fill(&m1, &s1, &mut out, 400_000);
    let start = Instant::now();
    w.wait_stream(&s1).unwrap();
    let e0 = Event::new(&d0).unwrap();
    e0.record(&w).unwrap();
    e0.synchronize().unwrap();
    let (waited, s1_done) = (start.elapsed(), s1.query().unwrap());
    assert!(
        s1_done,
        "the event recorded on device 0's stream after wait_stream(device 1's stream) completed after {waited:?}, \
         while the kernel it was ordered after still ran"
    );
    assert_eq!(out.to_vec().unwrap(), vec![7; 256]);
}

/// Pins the case that works: a stream of its own (which carries its context) waits for a stream of
/// another device.
#[test]
fn wait_stream_across_devices_orders_an_own_stream() {
    run_with_fake(&[TWO_DEVICES], || cross_device_wait(|d| Stream::new(d).unwrap()));
}

/// `Stream::wait_stream` binds `other`'s context (`Context::order_after`, context.rs:287, called
/// from stream.rs:1175) and queues `cuStreamWaitEvent(self.as_raw(), ..)` there. For the legacy
/// stream (`CU_STREAM_LEGACY`, a handle that means "the current context's"), that is the legacy
/// stream of `other`'s device, not of `self`'s: device 0's legacy stream is not ordered at all, and
/// work queued there after the wait runs concurrently with what it was meant to follow.
#[test]
fn wait_stream_across_devices_orders_the_legacy_stream() {
    run_with_fake(&[TWO_DEVICES], || cross_device_wait(|d| Stream::legacy(d).unwrap()));
}

/// As above for the per-thread default stream (`CU_STREAM_PER_THREAD`, also "the current
/// context's"): device 1's per-thread stream of this thread waits instead.
#[test]
fn wait_stream_across_devices_orders_the_per_thread_stream() {
    run_with_fake(&[TWO_DEVICES], || cross_device_wait(|d| Stream::per_thread(d).unwrap()));
}

// ------------------------------------------------------------------------------------------------
// Host functions
// ------------------------------------------------------------------------------------------------

/// host_fn.rs says that inside a host function "every other cudrv call that would reach the driver
/// returns `Error::InHostFunction` before doing anything" (the driver forbids CUDA calls there: they
/// may fail or deadlock). `Device`'s methods never look (device.rs: `count`, `get`, `attribute`,
/// `name`, `total_memory`, `primary_context`, `capabilities`): they call the driver from the
/// driver's callback thread. (`Module::from_ptx`, `Kernel::function` and `Event::new` refuse in
/// the end, at `Context::bind`, but only after `cuDevicePrimaryCtxRetain` and a dozen
/// `cuDeviceGetAttribute`s made through these.)
#[test]
fn device_queries_refuse_inside_a_host_function() {
    run_with_fake(&[TWO_DEVICES], || {
        let d0 = Device::get(0).unwrap();
        let s = Stream::new(&d0).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        s.launch_host_fn(move || {
            let d1 = d0;
            let results: Vec<(&str, Result<String, Error>)> = vec![
                ("Device::count", Device::count().map(|n| n.to_string())),
                ("Device::get", Device::get(1).map(|d| format!("{d:?}"))),
                (
                    "Device::attribute",
                    d1.attribute(DA::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map(|v| v.to_string()),
                ),
                ("Device::name", d1.name()),
                ("Device::total_memory", d1.total_memory().map(|v| v.to_string())),
                (
                    "Device::primary_context (device 1)",
                    Device::get(1).and_then(|d| d.primary_context()).map(|c| format!("{:?}", c.as_raw())),
                ),
            ];
            tx.send(
                results
                    .into_iter()
                    .map(|(w, r)| (w, format!("{r:?}"), matches!(r, Err(Error::InHostFunction { .. }))))
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        })
        .unwrap();
        s.synchronize().unwrap();
        let results = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let reached: Vec<String> =
            results.iter().filter(|(_, _, refused)| !refused).map(|(w, r, _)| format!("{w}: {r}")).collect();
        assert!(reached.is_empty(), "reached the driver inside a host function: {reached:#?}");
    });
}

/// A host function that drops the last handles of a module, an event, a stream and the context:
/// every driver call is deferred to cudrv's thread, which carries them out, and nothing leaks.
#[test]
fn a_host_function_drops_the_last_module_event_and_stream() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let f = module.function("fill_u32").unwrap();
        let ev = Event::new(&dev).unwrap();
        let other = Stream::new(&dev).unwrap();
        let ctx = dev.primary_context().unwrap();
        assert_eq!(fake_report().live_modules, 1);
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        s.launch_host_fn(move || {
            drop((module, f, ev, other, ctx));
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        s.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        // The event that `synchronize` waited for is the context's to keep; not the host function's.
        dev.primary_context().unwrap().release_cached_events();
        let rep = fake_report();
        assert_eq!((rep.live_modules, rep.live_events, rep.live_streams), (0, 0, 1), "{rep}");
        drop(s);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_streams, 0);
    });
}

/// A host function whose `cuLaunchHostFunc` failed is dropped, never run; one queued before the
/// driver shuts down never runs either, and nothing panics or hangs (its closure leaks, soundly).
#[test]
fn host_functions_under_a_failed_launch_and_a_shutdown() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuLaunchHostFunc:1:999"), ("CUDRV_FAKE_DELAY_US", "200000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(AtomicUsize::new(0));
        struct Count(Arc<AtomicUsize>);
        impl Drop for Count {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (r, d) = (ran.clone(), Count(dropped.clone()));
        let e = s.launch_host_fn(move || {
            let _d = d;
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert!(matches!(&e, Err(Error::Driver { .. })), "{e:?}");
        assert_eq!(fake_faults_injected(), 1);
        assert_eq!((ran.load(Ordering::SeqCst), dropped.load(Ordering::SeqCst)), (0, 1));
        // Queued behind a 200 ms delay, then the driver goes away.
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let (r, d) = (ran.clone(), Count(dropped.clone()));
        s.launch_host_fn(move || {
            let _d = d;
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        fake_shutdown();
        let start = Instant::now();
        drop((module, s));
        cudrv::flush_deferred_drops().unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(Event::new(&dev).is_err());
    });
}

// ------------------------------------------------------------------------------------------------
// Driver faults in drops
// ------------------------------------------------------------------------------------------------

/// `ModuleInner::drop` (module.rs, `impl Drop for ModuleInner`) runs `cuModuleUnload` only if
/// `ctx.bind()` succeeds: one failed `cuCtxSetCurrent` (or `cuCtxGetCurrent`) on the dropping
/// thread leaks the module for good (nothing tries again), though the unload itself would have
/// worked (`cuModuleUnload` names its module; `Event` and `Stream` drops bind nothing). The same
/// held for `Linker`'s `cuLinkDestroy`. Such drops now try once more on cudrv's deferred-work
/// thread (`context::drop_call`).
#[test]
fn a_failed_bind_in_a_module_drop_does_not_leak_it() {
    // The first cuCtxSetCurrent makes the context current on the main thread; the second is the
    // drop's, on a thread where nothing is current.
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuCtxSetCurrent:2:999")], || {
        let dev = Device::get(0).unwrap();
        let ctx = dev.primary_context().unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        module.function("fill_u32").unwrap();
        assert_eq!(fake_report().live_modules, 1);
        std::thread::spawn(move || drop(module)).join().unwrap();
        assert_eq!(fake_faults_injected(), 1, "the drop's bind was not the one that failed");
        // The unload is tried again on cudrv's deferred-work thread, where it succeeds: nothing
        // to report.
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_modules, 0, "the module is never unloaded");
        assert!(ctx.take_deferred().is_ok());
    });
}

// ------------------------------------------------------------------------------------------------
// Launches and captures
// ------------------------------------------------------------------------------------------------

/// A plain `u32` argument whose `kernel_value` runs `hook` first: it widens the window between
/// the buffer arguments' `kernel_value` and the launch, which preemption opens as well.
struct Hooked<F: Fn()>(u32, F);

// SAFETY: the value is a plain u32 and refers to no memory.
unsafe impl<F: Fn()> cudrv::launch::KernelArg for Hooked<F> {
    type Value = u32;
    fn kernel_value(&self, _stream: &Stream) -> cudrv::Result<u32> {
        (self.1)();
        Ok(self.0)
    }
}

/// `&mut DeviceBuffer`'s `KernelArg::kernel_value` (launch.rs, `by_address!`) calls `record_use`,
/// which takes the streams' gates in `use_on` and lets them go on return (`use_on(..).map(drop)`,
/// buffer.rs:453); the launch takes the stream's gate again only in `enqueue`, after every
/// argument. A capture begun on the stream in between (here from another thread, while a later
/// argument is computed) captures the launch, but the buffer saw no capture and the graph does
/// not keep it (`keep_for_capture` keeps the module only): once the buffer is dropped, each launch
/// of the graph writes freed memory. The launch now holds the stream's gate from its arguments to
/// its queueing: the capture waits for it.
#[test]
fn a_launch_captured_after_its_buffer_args_were_recorded_keeps_them() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let sync = Arc::new(cudrv::memory::SyncResource::new(&dev).unwrap());
        let mut b = DeviceBuffer::<u32>::zeroed_in(1024, &s, sync).unwrap();
        let (begun_tx, begun_rx) = std::sync::mpsc::channel::<()>();
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        let (begin_tx, begin_rx) = std::sync::mpsc::channel::<()>();
        let capturer = {
            let s = s.clone();
            std::thread::spawn(move || {
                begin_rx.recv().unwrap();
                s.begin_capture(cudrv::graph::CaptureMode::Relaxed).unwrap();
                begun_tx.send(()).unwrap();
                end_rx.recv().unwrap();
                s.end_capture().unwrap()
            })
        };
        let hook = Hooked(7, move || {
            // The buffer's use is recorded (no capture then); another thread begins a capture
            // while the next argument is computed, and has time to.
            begin_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        // SAFETY: fill_u32(u32* out, u32 value, u64 n) writes out[0..1024].
        unsafe { fill.launch(LaunchConfig::for_num_elems(1024), &s, (&mut b, hook, 1024u64)).unwrap() };
        begun_rx.recv_timeout(Duration::from_secs(10)).expect("the capture began after the launch");
        end_tx.send(()).unwrap();
        let graph = capturer.join().unwrap();
        let nodes = graph.nodes().unwrap().len();
        // The launch held the stream's gate from its arguments to its queueing: the capture began
        // after it, and took nothing. (Had it taken the launch, the graph would have to keep `b`.)
        assert_eq!(nodes, 0, "the launch was captured though its arguments saw no capture");
        drop(b);
        s.synchronize().unwrap();
        let exec = graph.instantiate().unwrap();
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        let v = fake_report().violations;
        assert!(v.is_empty(), "the graph's kernel wrote the dropped buffer's memory: {v:?}");
    });
}

// ------------------------------------------------------------------------------------------------
// Concurrency
// ------------------------------------------------------------------------------------------------

/// Eight threads ask one `Kernel` for its function on the same device at once, launch it, and drop
/// their handles while the others still launch: one function is made (the library's code is
/// loaded once), every launch writes its buffer, and the library is unloaded with the last handle.
#[test]
fn kernels_are_loaded_once_and_launch_from_many_threads() {
    run_with_fake(&[], || {
        if crate::oldest() {
            return;
        }
        let dev = Device::get(0).unwrap();
        let library = cudrv::module::Library::from_ptx(PTX).unwrap();
        let kernel = library.kernel("fill_u32").unwrap();
        drop(library);
        let threads: Vec<_> = (0..8u32)
            .map(|i| {
                let kernel = kernel.clone();
                std::thread::spawn(move || {
                    let s = Stream::new(&dev).unwrap();
                    let f = kernel.function(&dev).unwrap();
                    drop(kernel);
                    let mut out = DeviceBuffer::<u32>::zeroed(512, &s).unwrap();
                    for _ in 0..20 {
                        // SAFETY: fill_u32(u32* out, u32 value, u64 n) writes out[0..512].
                        unsafe { f.launch(LaunchConfig::for_num_elems(512), &s, (&mut out, i, 512u64)).unwrap() };
                    }
                    (f.as_raw() as usize, out.to_vec().unwrap() == vec![i; 512])
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(results.iter().all(|&(_, ok)| ok), "{results:?}");
        assert!(results.windows(2).all(|w| w[0].0 == w[1].0), "one function per device: {results:?}");
        assert_eq!(fake_report().live_modules, 1);
        drop(kernel);
        assert_eq!(fake_report().live_modules, 0, "the library outlived its last handle");
        assert!(fake_report().violations.is_empty());
    });
}

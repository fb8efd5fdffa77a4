//! Graph soundness review: what an executable graph's changed kernel node runs, and launches on
//! streams that joined a capture while it ends.
//!
//! Found, with the tests that reproduce each (they failed before the fix that came with them):
//! - `GraphExec::set_kernel_node_params` may change the node's function (the driver allows any
//!   function of the context), but kept nothing of it: with the `Function` and its `Module`
//!   dropped, a safe `GraphExec::launch` ran unloaded code. The executable graph now keeps the
//!   function's module until its last launch has completed, and refuses a function of another
//!   context: `set_kernel_node_params_keeps_the_new_functions_module` and
//!   `set_kernel_node_params_refuses_a_function_of_another_context`.
//! - Ending a capture waited for the work under way on its origin only. A launch on a stream that
//!   joined the capture holds that stream's gate alone, from its arguments' looks at the stream's
//!   capture to the queueing of the kernel and the keep of its module; a capture ended (or
//!   abandoned) in between left the kernel in the graph with its module unloaded once the
//!   `Function` went, or noted a buffer's use as the graph's while the kernel ran outside it, on
//!   memory freed meanwhile. The end now waits for every stream of the capture:
//!   `a_launch_on_a_joined_stream_racing_the_captures_end_keeps_its_module`,
//!   `a_launch_on_a_joined_stream_that_saw_the_capture_is_captured_or_orders_the_free`,
//!   `a_launch_on_a_joined_stream_racing_an_abandoned_capture_orders_the_free`; and it does not
//!   wait for ever for a gate that the ending thread holds itself:
//!   `end_capture_under_a_gate_of_a_joined_stream_is_refused_not_a_deadlock`.

use std::ffi::c_void;
use std::sync::mpsc::{Sender, channel};
use std::time::Duration;

use cudrv::graph::CaptureMode;
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Error, KernelArg, LaunchConfig, Module, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, run_with_fake, run_with_fake_modes};

use crate::within_10s;

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

/// A graph of one captured `fill_u32` of `out` with 1, on `s`, instantiated.
fn one_fill(s: &Stream, out: &mut DeviceBuffer<u32>) -> (cudrv::Graph, cudrv::graph::GraphExec) {
    let module = Module::from_ptx(&s.device(), PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: fill_u32(u32*, u32, u64) writes out[0..256]; the graph keeps `out` (used in it).
    unsafe { fill.launch(LaunchConfig::for_num_elems(256), s, (&mut *out, 1u32, 256u64)).unwrap() };
    let graph = s.end_capture().unwrap();
    let exec = graph.instantiate().unwrap();
    (graph, exec)
}

/// The node of a changed function runs it at every later launch: its module must stay loaded
/// while the executable graph may launch it, whatever became of the `Function` and `Module`. Set
/// twice with the same function, it is kept once, and let go after the executable graph's last
/// launch. It failed before (the module was unloaded at the drop: 1 live module, not 2).
#[test]
fn set_kernel_node_params_keeps_the_new_functions_module() {
    run_with_fake_modes(&["linux"], &[("CUDRV_FAKE_DELAY_US", "200")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut out = DeviceBuffer::<u32>::zeroed(256, &s).unwrap();
        let (graph, exec) = one_fill(&s, &mut out);
        let node = graph.nodes().unwrap()[0];
        assert_eq!(fake_report().live_modules, 1, "the graph keeps its kernel's module");
        let other = Module::from_ptx(&dev, PTX).unwrap();
        let fill = other.function("fill_u32").unwrap();
        assert_eq!(fake_report().live_modules, 2);
        for value in [2u32, 3] {
            let (mut p, mut v, mut n) = (out.as_raw(), value, 256u64);
            let mut params: [*mut c_void; 3] = [(&raw mut p).cast(), (&raw mut v).cast(), (&raw mut n).cast()];
            // SAFETY: the arguments match fill_u32(u32*, u32, u64) and write out[0..256]; `out`
            // lives until after the executable graph's last launch has completed (synchronized
            // below before it goes).
            unsafe { exec.set_kernel_node_params(node, &fill, LaunchConfig::for_num_elems(256), &mut params).unwrap() };
        }
        drop((fill, other));
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_modules, 2, "the module of a kernel that `exec` launches was unloaded");
        // Queued behind the stream's delay: the module must stay until it has run.
        exec.launch(&s).unwrap();
        drop(exec);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![3; 256]);
        drop(graph);
        s.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_modules, 0, "kept past the executable graph's last launch");
        drop((out, s));
        no_leaks();
    });
}

/// The driver lets a node change its function only within the executable graph's context: a
/// function of another device's is refused before the driver is called, and kept by nothing.
#[test]
fn set_kernel_node_params_refuses_a_function_of_another_context() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "2")], || {
        let s = Stream::new(&Device::get(0).unwrap()).unwrap();
        let mut out = DeviceBuffer::<u32>::zeroed(256, &s).unwrap();
        let (graph, exec) = one_fill(&s, &mut out);
        let node = graph.nodes().unwrap()[0];
        let other = Module::from_ptx(&Device::get(1).unwrap(), PTX).unwrap();
        let fill = other.function("fill_u32").unwrap();
        let (mut p, mut v, mut n) = (out.as_raw(), 2u32, 256u64);
        let mut params: [*mut c_void; 3] = [(&raw mut p).cast(), (&raw mut v).cast(), (&raw mut n).cast()];
        // SAFETY: refused before the driver is called; the arguments would match fill_u32.
        let refused =
            unsafe { exec.set_kernel_node_params(node, &fill, LaunchConfig::for_num_elems(256), &mut params) };
        assert!(matches!(refused, Err(Error::DeviceMismatch { expected: 0, found: 1, .. })), "{refused:?}");
        drop((fill, other));
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_modules, 1, "the refused function's module was kept");
        exec.launch(&s).unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![1; 256]);
        drop((exec, graph));
        s.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        drop((out, s));
        no_leaks();
    });
}

/// Nothing of the test is left with the driver once device 0's resource and context let go of
/// what they keep for reuse: the resource's free memory (a `StreamOrderedPool` where the driver
/// has no pools, as CUDA 11.1's) and the events of waits (`Stream::synchronize`, `wait_stream`).
fn no_leaks() {
    cudrv::flush_deferred_drops().unwrap();
    let dev = Device::get(0).unwrap();
    dev.memory_resource().unwrap().trim(0).unwrap();
    dev.primary_context().unwrap().release_cached_events();
    assert_no_leaks();
}

/// A capture begun on `s1` (returned first), which `s2` joined; a zeroed buffer of 256 `u32`s of
/// `s1`'s; and `fill_u32`, whose `Function` alone keeps its module.
fn capture_with_a_joined_stream() -> (Stream, Stream, DeviceBuffer<u32>, cudrv::Function) {
    let dev = Device::get(0).unwrap();
    let (s1, s2) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let out = DeviceBuffer::<u32>::zeroed(256, &s1).unwrap();
    s1.synchronize().unwrap();
    let fill = Module::from_ptx(&dev, PTX).unwrap().function("fill_u32").unwrap();
    s1.begin_capture(CaptureMode::Relaxed).unwrap();
    s2.wait_stream(&s1).unwrap();
    (s1, s2, out, fill)
}

/// A `u32` kernel argument whose `kernel_value` (run under the launch's stream's gate, after the
/// arguments before it recorded their uses) says so on `started`, then sleeps `pause`: work under
/// way on the stream, between its looks at the stream's capture and the launch.
struct Slow {
    value: u32,
    started: Sender<()>,
    pause: Duration,
}

// SAFETY: the value is a `u32`, plain data without padding; it hands the kernel no memory.
unsafe impl KernelArg for Slow {
    type Value = u32;
    fn kernel_value(&self, _stream: &Stream) -> cudrv::Result<u32> {
        let _ = self.started.send(());
        std::thread::sleep(self.pause);
        Ok(self.value)
    }
}

/// A launch on a stream that joined the capture, queued (captured) before the capture's end on
/// another thread, but whose keep of the module comes after it: the graph must keep the module.
/// `CUDRV_FAKE_LAUNCH_US` widens the window between the launch and the keep. It failed before
/// (the graph's kernel's module was unloaded once the `Function` went: 0 live modules).
#[test]
fn a_launch_on_a_joined_stream_racing_the_captures_end_keeps_its_module() {
    run_with_fake_modes(&["linux"], &[("CUDRV_FAKE_LAUNCH_US", "300000")], || {
        // The launch's `Function` alone keeps the module.
        let (s1, s2, out, fill) = capture_with_a_joined_stream();
        let (started, launching) = channel();
        let graph = std::thread::scope(|t| {
            t.spawn(|| {
                started.send(()).unwrap();
                // SAFETY: fill_u32(u32*, u32, u64) writes out[0..256]; the graph keeps `out` (used
                // in it), which outlives every launch below anyway.
                unsafe { fill.launch(LaunchConfig::for_num_elems(256), &s2, (&out, 5u32, 256u64)).unwrap() };
                // The last `Function`: the module goes unless the graph keeps it.
                drop(fill);
            });
            launching.recv().unwrap();
            // The launch is captured (the fake sleeps after it); its keep is not done yet.
            std::thread::sleep(Duration::from_millis(100));
            s1.wait_stream(&s2).unwrap();
            s1.end_capture().unwrap()
        });
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(graph.nodes().unwrap().len(), 1, "the kernel is in the graph");
        assert_eq!(fake_report().live_modules, 1, "the graph's kernel's module was unloaded");
        let exec = graph.instantiate().unwrap();
        exec.launch(&s1).unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![5; 256]);
        drop((exec, graph));
        s1.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_modules, 0);
        drop((out, s1, s2));
        no_leaks();
    });
}

/// A launch on `s2` of `fill` into `buf`, with a `Slow` argument: started once its uses are
/// recorded (as the capture's, where `s2` takes part in one), then slow to launch.
fn slow_fill(fill: &cudrv::Function, s2: &Stream, buf: &DeviceBuffer<u32>, started: Sender<()>) {
    let slow = Slow { value: 7, started, pause: Duration::from_millis(300) };
    // SAFETY: fill_u32(u32*, u32, u64) writes buf[0..256]; `buf`'s free waits for the launch (its
    // use is recorded), which is what the callers check.
    unsafe { fill.launch(LaunchConfig::for_num_elems(256), s2, (buf, slow, 256u64)).unwrap() };
}

/// The race of the two tests below. `s2` is kept busy for a second, so that a kernel queued there
/// for real runs after the buffer's drop; it joins a capture begun on `s1`; another thread
/// launches `fill` into `buf` on `s2`, slowly once its uses are recorded; then `during` runs (on
/// this thread, with `s1` and `s2`), and `after` once the launch has returned. Then `buf` is dropped, and
/// the fake driver must report no access of freed memory.
fn race_a_launch_on_a_joined_stream<R>(during: impl Fn(Stream, &Stream) -> R, after: impl Fn(R, &Stream)) {
    run_with_fake_modes(&["linux"], &[], || {
        let dev = Device::get(0).unwrap();
        let (s0, s1, s2) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let (fill, spin) = (module.function("fill_u32").unwrap(), module.function("spin_fill_u32").unwrap());
        let mut busy = DeviceBuffer::<u32>::zeroed(16, &s2).unwrap();
        // SAFETY: spin_fill_u32(u32*, u32, u64, u64) writes busy[0..16] after a second.
        unsafe { spin.launch(LaunchConfig::linear(1, 1), &s2, (&mut busy, 1u32, 16u64, 1_000_000u64)).unwrap() };
        let buf = DeviceBuffer::<u32>::zeroed(256, &s0).unwrap();
        s0.synchronize().unwrap();
        s1.begin_capture(CaptureMode::Relaxed).unwrap();
        s2.wait_stream(&s1).unwrap();
        let (started, launching) = channel();
        let r = std::thread::scope(|t| {
            t.spawn(|| slow_fill(&fill, &s2, &buf, started));
            launching.recv().unwrap();
            during(s1, &s2)
        });
        after(r, &s2);
        drop(buf);
        s2.synchronize().unwrap();
        s0.synchronize().unwrap();
        assert_eq!(fake_report().violations, Vec::<String>::new());
        drop((busy, fill, spin, module));
    });
}

/// A launch on a stream that joined the capture, its buffer's use recorded as the capture's (the
/// graph's), racing the capture's end on another thread before it is queued: it must be captured
/// (the end waits for it; here, queued after the join back, it leaves the capture unjoined), or
/// else its use must order the buffer's free after it. It failed before (the capture ended, the
/// kernel ran outside it, and the buffer was freed under it: an access violation).
#[test]
fn a_launch_on_a_joined_stream_that_saw_the_capture_is_captured_or_orders_the_free() {
    race_a_launch_on_a_joined_stream(
        |s1, s2| {
            s1.wait_stream(s2).unwrap();
            s1.end_capture()
        },
        |ended, _| match ended {
            // Captured after the join back: the capture was left unjoined (its graph discarded).
            Err(e) => assert_eq!(e.code(), Some(cudrv::sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED), "{e}"),
            Ok(graph) => drop(graph),
        },
    );
}

/// As `a_launch_on_a_joined_stream_that_saw_the_capture_is_captured_or_orders_the_free`, with the
/// capture abandoned (its origin's last user dropped) instead of ended. It failed before.
#[test]
fn a_launch_on_a_joined_stream_racing_an_abandoned_capture_orders_the_free() {
    race_a_launch_on_a_joined_stream(
        // Its last user: the capture is abandoned (ended, its graph discarded).
        |s1, _| drop(s1),
        |(), s2| assert_eq!(s2.capture_status().unwrap(), cudrv::graph::CaptureStatus::None),
    );
}

/// Ending a capture from code that cudrv runs under the gate of a stream that joined it (a kernel
/// argument's `kernel_value`, for a launch on that stream) cannot wait for that gate, its own: it
/// is refused, and the capture goes on, instead of waiting for ever.
#[test]
fn end_capture_under_a_gate_of_a_joined_stream_is_refused_not_a_deadlock() {
    run_with_fake_modes(&["linux"], &[], || {
        /// Ends the capture of `origin` from its `kernel_value`.
        struct EndsCapture {
            origin: Stream,
            ended: Sender<cudrv::Result<cudrv::Graph>>,
        }
        // SAFETY: the value is a `u32`, plain data without padding; it hands the kernel no memory.
        unsafe impl KernelArg for EndsCapture {
            type Value = u32;
            fn kernel_value(&self, _stream: &Stream) -> cudrv::Result<u32> {
                let _ = self.ended.send(self.origin.end_capture());
                Ok(4)
            }
        }
        // The refusal, or what came instead; `None` if it hangs.
        let refused = within_10s(|| {
            let (s1, s2, out, fill) = capture_with_a_joined_stream();
            let (ended, refused) = channel();
            let arg = EndsCapture { origin: s1.clone(), ended };
            // SAFETY: fill_u32(u32*, u32, u64) writes out[0..256]; the graph keeps `out`.
            unsafe { fill.launch(LaunchConfig::for_num_elems(256), &s2, (&out, arg, 256u64)).unwrap() };
            let refused = refused.recv().unwrap();
            if refused.is_ok() {
                return refused.map(drop);
            }
            // The capture went on, and ends once the launch is queued.
            s1.wait_stream(&s2).unwrap();
            let exec = s1.end_capture().unwrap().instantiate().unwrap();
            exec.launch(&s1).unwrap();
            assert_eq!(out.to_vec().unwrap(), vec![4; 256]);
            refused.map(drop)
        });
        let refused = refused.expect("end_capture under a gate of a stream of the capture hangs");
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
    });
}

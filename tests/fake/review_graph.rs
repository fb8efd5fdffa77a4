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

use std::ffi::c_void;

use cudrv::graph::CaptureMode;
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Error, LaunchConfig, Module, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, run_with_fake, run_with_fake_modes};

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
        assert_no_leaks();
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
        assert_no_leaks();
    });
}

//! CUDA graphs on the fake driver (`cudrv::graph`), in every driver model: capture and replay,
//! memory allocated inside a capture (the driver's memory nodes where pools exist, cudrv's pool on
//! TCC), buffers that a graph keeps alive, what a capture refuses, graphs built node by node,
//! updates. The bodies are shared with `gpu_graph.rs` (`graph_cases`); here each runs in a child
//! process with the fake driver, and ends with a leak check.

use crate::graph_cases;

use std::sync::Arc;

use cudrv::memory::{DeviceBuffer, MemoryResource, PoolConfig, StreamOrderedPool};
use cudrv::{Device, Stream};
use cudrv_test_support::{assert_no_leaks, legacy_fake_driver_path, run_with_fake_modes};

const MODES: [&str; 3] = ["linux", "wddm", "tcc"];

fn each_mode(delay_us: &str, body: fn()) {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", delay_us)], || {
        body();
        assert_no_leaks();
    });
}

#[test]
fn a_captured_graph_replays_its_work_at_every_launch() {
    each_mode("50", || graph_cases::a_captured_graph_replays_its_work_at_every_launch(25));
}

#[test]
fn pool_memory_of_a_graph_is_reserved_until_it_is_gone() {
    each_mode("0", graph_cases::pool_memory_of_a_graph_is_reserved_until_it_is_gone);
}

#[test]
fn graphs_replay_while_other_threads_allocate() {
    each_mode("20", || graph_cases::graphs_replay_while_other_threads_allocate(200, 4));
}

#[test]
fn a_buffer_used_by_a_graph_outlives_its_drop() {
    each_mode("200", graph_cases::a_buffer_used_by_a_graph_outlives_its_drop);
}

#[test]
fn a_capture_refuses_what_a_graph_cannot_keep_sound() {
    each_mode("0", graph_cases::a_capture_refuses_what_a_graph_cannot_keep_sound);
}

#[test]
fn a_buffer_dropped_during_a_capture_that_does_not_use_it_is_freed_at_its_end() {
    each_mode("0", graph_cases::a_buffer_dropped_during_a_capture_that_does_not_use_it_is_freed_at_its_end);
}

#[test]
fn streams_join_a_capture_and_the_graph_keeps_their_order() {
    each_mode("100", graph_cases::streams_join_a_capture_and_the_graph_keeps_their_order);
}

#[test]
fn graphs_built_node_by_node_run_in_dependency_order() {
    each_mode("50", graph_cases::graphs_built_node_by_node_run_in_dependency_order);
}

#[test]
fn executable_graphs_update_in_place_or_say_why_not() {
    each_mode("0", graph_cases::executable_graphs_update_in_place_or_say_why_not);
}

#[test]
fn a_pool_dropped_before_its_graph_gives_its_memory_back_after_it() {
    each_mode("0", graph_cases::a_pool_dropped_before_its_graph_gives_its_memory_back_after_it);
}

#[test]
fn pool_work_on_other_threads_leaves_a_global_capture_valid() {
    each_mode("0", graph_cases::pool_work_on_other_threads_leaves_a_global_capture_valid);
}

#[test]
fn graph_memory_nodes_where_the_driver_has_pools() {
    each_mode("0", graph_cases::graph_memory_nodes_where_the_driver_has_pools);
}

#[test]
fn an_invalidated_capture_reports_it_and_the_stream_stays_usable() {
    each_mode("0", graph_cases::an_invalidated_capture_reports_it_and_the_stream_stays_usable);
}

#[test]
fn an_orphaned_capture_ends_when_its_last_buffer_goes() {
    each_mode("0", graph_cases::an_orphaned_capture_ends_when_its_last_buffer_goes);
}

/// On a CUDA 11.1 driver, which has neither memory pools nor the newer graph entry points
/// (`cuStreamGetCaptureInfo_v2`/`_v3`, `cuGraphInstantiateWithFlags`, `cuGraphAddKernelNode_v2`,
/// `cuGraphExecUpdate_v2`, `cuGraphExecKernelNodeSetParams_v2`), graphs work through the older
/// ones, and allocation in a capture through cudrv's pool.
#[test]
fn graphs_work_on_a_cuda_11_1_driver() {
    let legacy = legacy_fake_driver_path().to_string_lossy().into_owned();
    let env = [("CUDRV_DRIVER_PATH", legacy.as_str()), ("CUDRV_FAKE_DELAY_US", "20")];
    run_with_fake_modes(&MODES, &env, || {
        let driver = cudrv::sys::Driver::global().unwrap();
        assert_eq!(driver.version(), 11010);
        for newer in ["cuStreamGetCaptureInfo_v2", "cuGraphInstantiateWithFlags", "cuGraphExecUpdate_v2"] {
            assert!(!driver.has(newer), "{newer}");
        }
        graph_cases::a_captured_graph_replays_its_work_at_every_launch(10);
        graph_cases::pool_memory_of_a_graph_is_reserved_until_it_is_gone();
        graph_cases::a_capture_refuses_what_a_graph_cannot_keep_sound();
        graph_cases::an_invalidated_capture_reports_it_and_the_stream_stays_usable();
        graph_cases::streams_join_a_capture_and_the_graph_keeps_their_order();
        graph_cases::graphs_built_node_by_node_run_in_dependency_order();
        graph_cases::executable_graphs_update_in_place_or_say_why_not();
        graph_cases::graph_memory_nodes_where_the_driver_has_pools();
        graph_cases::an_orphaned_capture_ends_when_its_last_buffer_goes();
        // Flags need cuGraphInstantiateWithFlags (11.4): refused, with what to do instead.
        let dev = cudrv::Device::get(0).unwrap();
        let mut graph = cudrv::graph::Graph::new(&dev).unwrap();
        graph.add_empty_node(&[]).unwrap();
        let flags = cudrv::graph::InstantiateFlags { auto_free_on_launch: true, ..Default::default() };
        match graph.instantiate_with(flags) {
            Err(cudrv::Error::Unsupported { feature: "instantiation flags", reason, .. }) => {
                assert!(reason.contains("cuGraphInstantiateWithFlags"), "{reason}")
            }
            other => panic!("expected Unsupported, got {:?}", other.map(|_| ())),
        }
        drop(graph);
        graph_cases::release_everything(&dev);
        assert_no_leaks();
    });
}

/// A test that panics between `begin_capture` and `end_capture` drops its stream while it captures:
/// the capture ends with it, so that the driver stops refusing what other threads do (in global
/// mode, their event synchronisations), and what the capture allocated goes back.
#[test]
fn a_stream_dropped_during_its_capture_ends_it() {
    each_mode("0", || {
        let dev = cudrv::Device::get(0).unwrap();
        let caught = std::panic::catch_unwind(|| {
            let stream = cudrv::Stream::new(&dev).unwrap();
            stream.begin_capture(cudrv::graph::CaptureMode::Global).unwrap();
            let _tmp = cudrv::memory::DeviceBuffer::<u32>::zeroed(1 << 10, &stream).unwrap();
            panic!("a test fails during its capture");
        });
        assert!(caught.is_err());
        std::thread::spawn(move || {
            let other = cudrv::Stream::new(&dev).unwrap();
            let event = cudrv::Event::new(&dev).unwrap();
            event.record(&other).unwrap();
            event.synchronize().unwrap();
        })
        .join()
        .unwrap();
        graph_cases::release_everything(&dev);
    });
}

#[test]
fn a_node_of_another_graph_is_refused_as_a_dependency() {
    run_with_fake_modes(&["linux"], &[], || {
        let dev = cudrv::Device::get(0).unwrap();
        let mut a = cudrv::Graph::new(&dev).unwrap();
        let a1 = a.add_empty_node(&[]).unwrap();
        let a2 = a.add_empty_node(&[a1]).unwrap();
        let mut b = cudrv::Graph::new(&dev).unwrap();
        let err = b.add_empty_node(&[a2]).unwrap_err();
        assert!(matches!(&err, cudrv::Error::InvalidArgument(m) if m.contains("another graph")), "{err}");
        // A node of a graph that is gone: its handle would dangle.
        drop(a);
        let err = b.add_empty_node(&[a1]).unwrap_err();
        assert!(matches!(err, cudrv::Error::InvalidArgument(_)), "{err}");
        let b1 = b.add_empty_node(&[]).unwrap();
        b.add_empty_node(&[b1]).unwrap();
        assert_eq!(b.nodes().unwrap().len(), 2);
        assert!(b.nodes().unwrap().contains(&b1));
    });
}

#[test]
fn a_graph_keeps_the_modules_of_its_kernels_loaded() {
    use cudrv::memory::DeviceBuffer;
    use cudrv::{LaunchConfig, Module, Stream};
    run_with_fake_modes(&["linux"], &[], || {
        let dev = cudrv::Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut out = DeviceBuffer::<u32>::zeroed(256, &s).unwrap();
        let module = Module::from_ptx(&dev, include_str!("../../examples/kernels/vector_add.ptx")).unwrap();
        let fill = module.function("fill_u32").unwrap();
        s.begin_capture(cudrv::graph::CaptureMode::ThreadLocal).unwrap();
        // SAFETY: fill_u32(u32*, u32, u64) writes out[0..256]; the graph keeps `out` (used in it).
        unsafe { fill.launch(LaunchConfig::for_num_elems(256), &s, (&mut out, 9u32, 256u64)).unwrap() };
        let graph = s.end_capture().unwrap();
        drop((fill, module));
        // The captured launch runs the kernel at each of the graph's launches: still loaded.
        assert_eq!(cudrv_test_support::fake_report().live_modules, 1);
        let exec = graph.instantiate().unwrap();
        exec.launch(&s).unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![9; 256]);
        drop((exec, graph));
        s.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(cudrv_test_support::fake_report().live_modules, 0);
    });
}

/// A host function on a stream waits for the thread that begins a capture there, while a third
/// thread runs a synchronous host copy or memset on the stream behind it: the capture begins (it
/// waited for the copy's gate, and all three hung), the memset completes, the copy is refused.
#[test]
fn a_capture_begins_while_host_copies_wait_behind_a_host_function() {
    each_mode("0", graph_cases::a_capture_begins_while_host_copies_wait_behind_a_host_function);
}

#[test]
fn a_capture_begins_while_a_dropped_buffer_waits_for_its_stream() {
    each_mode("0", graph_cases::a_capture_begins_while_a_dropped_buffer_waits_for_its_stream);
}

/// A buffer from a `StreamOrderedPool` given explicitly (`uninit_in`), whose allocation finds the
/// device full and, to make room, waits on the host for the frees of another stream, queued behind
/// a host function that waits for the thread that begins a capture on the buffer's stream. The
/// allocation held the stream's gate through that wait (only the device's own pool took none),
/// and `begin_capture` waited for it: all three hung. Now the capture begins, the host function
/// returns, the frees complete, and the pool gives their chunks back to the driver and grows:
/// the buffer gets its memory, outside the graph (the capture began after the allocation's look).
#[test]
fn a_capture_begins_while_a_given_pool_waits_for_frees_to_make_room() {
    const MIB: usize = 1 << 20;
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_MEMORY", "67108864")], || {
        let dev = Device::get(0).unwrap();
        let (s, other) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        // Chunks: a chunk of its own for each large request.
        let pool = Arc::new(
            StreamOrderedPool::with_config(&dev, PoolConfig { expandable: false, ..PoolConfig::default() }).unwrap(),
        );
        let r: Arc<dyn MemoryResource> = pool.clone();
        // 60 of the device's 64 MiB: two chunks of 20 MiB on `other`, freed behind the host
        // function, and one kept on `s`.
        // SAFETY (all three): the contents are never read.
        let (a, b) = unsafe {
            (
                DeviceBuffer::<u8>::uninit_in(20 * MIB, &other, r.clone()).unwrap(),
                DeviceBuffer::<u8>::uninit_in(20 * MIB, &other, r.clone()).unwrap(),
            )
        };
        let kept = unsafe { DeviceBuffer::<u8>::uninit_in(20 * MIB, &s, r.clone()) }.unwrap();
        other.synchronize().unwrap();
        let (s2, r2) = (s.clone(), r.clone());
        let allocate = move || {
            drop((a, b));
            // SAFETY: as above.
            unsafe { DeviceBuffer::<u8>::uninit_in(40 * MIB, &s2, r2) }
        };
        let buf = graph_cases::capture_begins_behind_a_waiting_host_fn(
            &s,
            &other,
            "an allocation that waits for other streams' frees",
            allocate,
        )
        .unwrap();
        assert_eq!(buf.len(), 40 * MIB);
        let stats = pool.pool_stats();
        assert_eq!((stats.in_use, stats.reserved), (60 * MIB, 60 * MIB), "{stats:?}");
        assert!(stats.oom_recoveries >= 1, "{stats:?}");
        drop((buf, kept));
        drop((s, other));
        r.trim(0).unwrap();
        drop((r, pool));
        assert_no_leaks();
    });
}

//! CUDA graphs on a real GPU (`--features gpu`): the bodies of `fake_graph.rs` (`graph_cases`),
//! plus the driver's graph memory nodes. Natively, allocation inside a capture goes to the
//! driver's pool (memory nodes); through the TCC interposer, and with `CUDRV_MEMORY_RESOURCE=pool`,
//! to cudrv's `StreamOrderedPool`; with `=sync` the device's resource refuses and the cases use a
//! `StreamOrderedPool` of their own.
//!
//! Each runs in a process of its own (`run_in_own_process`): a capture in global mode makes the
//! driver refuse what the tests running beside it in other threads do, as CUDA specifies.

use crate::graph_cases;

use cudrv_test_support::run_in_own_process;

#[test]
fn a_captured_graph_replays_its_work_at_every_launch() {
    run_in_own_process(|| graph_cases::a_captured_graph_replays_its_work_at_every_launch(1000));
}

#[test]
fn pool_memory_of_a_graph_is_reserved_until_it_is_gone() {
    run_in_own_process(graph_cases::pool_memory_of_a_graph_is_reserved_until_it_is_gone);
}

#[test]
fn a_graph_with_an_allocation_replays_1000_times_while_other_threads_allocate() {
    run_in_own_process(|| graph_cases::graphs_replay_while_other_threads_allocate(1000, 8));
}

#[test]
fn a_buffer_used_by_a_graph_outlives_its_drop() {
    run_in_own_process(graph_cases::a_buffer_used_by_a_graph_outlives_its_drop);
}

#[test]
fn a_capture_refuses_what_a_graph_cannot_keep_sound() {
    run_in_own_process(graph_cases::a_capture_refuses_what_a_graph_cannot_keep_sound);
}

#[test]
fn a_buffer_dropped_during_a_capture_that_does_not_use_it_is_freed_at_its_end() {
    run_in_own_process(graph_cases::a_buffer_dropped_during_a_capture_that_does_not_use_it_is_freed_at_its_end);
}

#[test]
fn streams_join_a_capture_and_the_graph_keeps_their_order() {
    run_in_own_process(graph_cases::streams_join_a_capture_and_the_graph_keeps_their_order);
}

#[test]
fn graphs_built_node_by_node_run_in_dependency_order() {
    run_in_own_process(graph_cases::graphs_built_node_by_node_run_in_dependency_order);
}

#[test]
fn executable_graphs_update_in_place_or_say_why_not() {
    run_in_own_process(graph_cases::executable_graphs_update_in_place_or_say_why_not);
}

#[test]
fn a_pool_dropped_before_its_graph_gives_its_memory_back_after_it() {
    run_in_own_process(graph_cases::a_pool_dropped_before_its_graph_gives_its_memory_back_after_it);
}

#[test]
fn pool_work_on_other_threads_leaves_a_global_capture_valid() {
    run_in_own_process(graph_cases::pool_work_on_other_threads_leaves_a_global_capture_valid);
}

#[test]
fn graph_memory_nodes_where_the_driver_has_pools() {
    run_in_own_process(graph_cases::graph_memory_nodes_where_the_driver_has_pools);
}

#[test]
fn an_invalidated_capture_reports_it_and_the_stream_stays_usable() {
    run_in_own_process(graph_cases::an_invalidated_capture_reports_it_and_the_stream_stays_usable);
}

#[test]
fn an_orphaned_capture_ends_when_its_last_buffer_goes() {
    run_in_own_process(graph_cases::an_orphaned_capture_ends_when_its_last_buffer_goes);
}

/// A host function on a stream waits for the thread that begins a capture there, while a third
/// thread runs a synchronous host copy or memset on the stream behind it: the capture begins (it
/// waited for the copy's gate, and all three hung), the memset completes, the copy is refused.
#[test]
fn a_capture_begins_while_host_copies_wait_behind_a_host_function() {
    run_in_own_process(graph_cases::a_capture_begins_while_host_copies_wait_behind_a_host_function);
}

/// The same, with a buffer whose drop waits for the stream before its free (`SyncResource`,
/// `ManagedResource`, `ManagedBuffer`, `DeviceBuffer2D`): the capture begins, the memory is freed.
#[test]
fn a_capture_begins_while_a_dropped_buffer_waits_for_its_stream() {
    run_in_own_process(graph_cases::a_capture_begins_while_a_dropped_buffer_waits_for_its_stream);
}

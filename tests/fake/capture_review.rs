//! Regression tests from the adversarial review of graphs, captures and the newer buffer types:
//! each reproduced a use-after-free, a stack overflow, a leak or a wrong error on the code before
//! its fix. Where the fix refuses an operation instead (a use that would make a stream join a
//! capture unseen, a pitched or managed buffer in a graph), the test checks the refusal and that
//! nothing was captured. Each body runs in a child process with the fake driver.

use std::sync::Arc;

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::launch::LaunchConfig;
use cudrv::memory::{DeviceBuffer, DeviceBuffer2D, ManagedBuffer, MemoryResource, StreamOrderedPool};
use cudrv::module::Module;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{fake_report, output_retrying_start, run_with_fake, run_with_fake_modes};

use crate::ipc_refused_on_oldest;

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

fn violations() -> Vec<String> {
    fake_report().violations
}

/// R1: a DeviceBuffer whose own stream captures, used on a stream that does not: the use's
/// `wait_stream` makes that stream join the capture, but the use goes through `order_use`, not
/// `use_in_capture`, so the graph does not keep the buffer. Dropped after the capture, it is freed
/// while the executable graph still writes it.
#[test]
fn r1_buffer_used_on_a_stream_that_joins_through_the_use_is_not_kept_by_the_graph() {
    run_with_fake_modes(&["linux", "tcc"], &[("CUDRV_FAKE_DELAY_US", "0")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let n = 1 << 12;
        let mut target = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        assert_eq!(b.capture_status().unwrap(), CaptureStatus::None);
        // SAFETY: fill_u32(u32*, u32, u64) writes target[0..n].
        let refused = unsafe { fill.launch(LaunchConfig::for_num_elems(n), &b, (&mut target, 9u32, n as u64)) };
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
        assert_eq!(b.capture_status().unwrap(), CaptureStatus::None, "b must not join a's capture unseen");
        // Joined explicitly, the use is the capture's, and the graph keeps the buffer.
        b.wait_stream(&a).unwrap();
        // SAFETY: as above.
        unsafe { fill.launch(LaunchConfig::for_num_elems(n), &b, (&mut target, 9u32, n as u64)).unwrap() };
        a.wait_stream(&b).unwrap();
        let graph = a.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        drop(target); // the graph should keep it until its last launch
        a.synchronize().unwrap();
        b.synchronize().unwrap();
        // In tcc mode (StreamOrderedPool) the block goes to the next allocation: the graph
        // overwrites it.
        let other = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
        exec.launch(&a).unwrap();
        a.synchronize().unwrap();
        let got = other.to_vec().unwrap();
        let v = violations();
        assert!(
            v.is_empty() && got == vec![0; n],
            "the graph wrote memory freed to the pool: violations {v:?}, other[0] = {}",
            got[0]
        );
    });
}

/// R2: the same with a pitched buffer as a kernel argument: `Pitched::record_use` checks the
/// launch stream for a capture *before* `note_use` makes it join; the kernel is captured, the
/// graph keeps nothing, and the drop's `cuMemFree` leaves the graph writing freed memory.
#[test]
fn r2_pitched_buffer_joins_a_capture_and_is_freed_under_the_graph() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let p = DeviceBuffer2D::<u32>::zeroed(64, 1, &a).unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // SAFETY: fill_u32 writes p's first row (64 elements).
        let refused = unsafe { fill.launch(LaunchConfig::for_num_elems(64), &b, (&p, 3u32, 64u64)) };
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
        assert_eq!(b.capture_status().unwrap(), CaptureStatus::None, "nothing joined, nothing captured");
        b.wait_stream(&a).unwrap();
        // Joined, the pitched buffer is refused still: a graph could not keep it alive.
        // SAFETY: as above.
        let refused = unsafe { fill.launch(LaunchConfig::for_num_elems(64), &b, (&p, 3u32, 64u64)) };
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
        a.wait_stream(&b).unwrap();
        let graph = a.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        drop(p); // cuMemFree after waiting for a and b: the graph is not waited for
        exec.launch(&a).unwrap();
        a.synchronize().unwrap();
        let v = violations();
        assert!(v.is_empty(), "use after free by a graph launch: {v:?}");
    });
}

/// R2b: the same with a managed buffer.
#[test]
fn r2b_managed_buffer_joins_a_capture_and_is_freed_under_the_graph() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let m = ManagedBuffer::<u32>::zeroed(64, &a).unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // SAFETY: fill_u32 writes m[0..64].
        let refused = unsafe { fill.launch(LaunchConfig::for_num_elems(64), &b, (&m, 3u32, 64u64)) };
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
        assert_eq!(b.capture_status().unwrap(), CaptureStatus::None);
        b.wait_stream(&a).unwrap();
        a.wait_stream(&b).unwrap();
        let graph = a.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        drop(m);
        exec.launch(&a).unwrap();
        a.synchronize().unwrap();
        let v = violations();
        assert!(v.is_empty(), "use after free by a graph launch: {v:?}");
    });
}

/// R3: `ManagedBuffer::copy_to_host` does not refuse a capture of its stream: the device-to-host
/// copy is captured into the graph (with the caller's slice as destination), then
/// `wait_for_memory` returns `Err(Capturing)`. Every launch of the graph then writes into host
/// memory that is no longer borrowed (or freed, with `to_vec`).
#[test]
fn r3_managed_copy_to_host_is_captured_and_the_graph_writes_unborrowed_host_memory() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let a = Stream::new(&dev).unwrap();
        let m = ManagedBuffer::<u32>::from_slice(&[0xDEAD; 64], &a).unwrap();
        let mut dst = vec![0u32; 64];
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let r = m.copy_to_host(&mut dst);
        println!("copy_to_host during the capture: {r:?}");
        assert!(r.is_err());
        let graph = a.end_capture().expect("the capture stayed valid");
        println!("nodes: {}", graph.nodes().unwrap().len());
        let exec = graph.instantiate().unwrap();
        let dst_ro: &Vec<u32> = &dst; // nothing borrows dst mutably any more
        exec.launch(&a).unwrap();
        a.synchronize().unwrap();
        assert_eq!(dst_ro[0], 0, "the graph wrote into host memory that no borrow covers");
    });
}

/// R4: cudrv's pool records its per-stream event on a stream that is capturing (here from
/// `trim`): the record lands in the capture; the pool notes it as covering the stream's frees.
/// After the capture the event is as before it (never recorded), and the next cross-stream reuse
/// waits on nothing: a block still written by the old stream is handed to another stream.
#[test]
fn r4_pool_event_recorded_during_a_capture_orders_nothing_afterwards() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_DELAY_US", "30000")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        let res: Arc<dyn MemoryResource> = pool.clone();
        let s = Stream::new(&dev).unwrap();
        let u = Stream::new(&dev).unwrap();
        let n = 1 << 12;
        // SAFETY: written below before anything reads it.
        let mut old = unsafe { DeviceBuffer::<u32>::uninit_in(n, &s, res.clone()).unwrap() };
        for _ in 0..6 {
            // SAFETY: fill_u32 writes old[0..n]; ~180 ms of queued work on s.
            unsafe { fill.launch(LaunchConfig::for_num_elems(n), &s, (&mut old, 9u32, n as u64)).unwrap() };
        }
        let addr = old.as_raw();
        drop(old); // freed in s's order, behind the fills
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let t = pool.trim(0);
        println!("trim during the capture: {t:?}");
        let e = s.end_capture();
        println!("end_capture: {:?}", e.as_ref().map(|_| ()));
        drop(e);
        // u borrows s's block: it should wait for s's fills first.
        let fresh = DeviceBuffer::from_slice_in(&vec![7u32; n], &u, res.clone()).unwrap();
        println!("same block: {}", fresh.as_raw() == addr);
        s.synchronize().unwrap();
        let got = fresh.to_vec().unwrap();
        let bad = got.iter().filter(|&&x| x != 7).count();
        assert_eq!(bad, 0, "s's old fills overwrote {bad} elements of the block u was given (got[0] = {})", got[0]);
        drop(fresh);
    });
}

/// R4b: the same stale record without any error: a stream that joined a capture loses its last
/// handle during the capture. The pool retires it and records its last event (in the capture);
/// the capture ends cleanly; afterwards the event orders nothing, and another stream gets the
/// stream's block while its earlier work still writes it.
#[test]
fn r4b_pool_retires_a_capturing_stream_with_a_record_that_orders_nothing() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_DELAY_US", "30000")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        let res: Arc<dyn MemoryResource> = pool.clone();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let u = Stream::new(&dev).unwrap();
        let n = 1 << 12;
        // SAFETY: written below before anything reads it.
        let mut old = unsafe { DeviceBuffer::<u32>::uninit_in(n, &b, res.clone()).unwrap() };
        for _ in 0..6 {
            // SAFETY: fill_u32 writes old[0..n]; ~180 ms of queued work on b.
            unsafe { fill.launch(LaunchConfig::for_num_elems(n), &b, (&mut old, 9u32, n as u64)).unwrap() };
        }
        drop(old); // cached on b, behind the fills
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        b.wait_stream(&a).unwrap(); // b joins
        a.wait_stream(&b).unwrap(); // and is joined back
        drop(b); // last handle: the pool records b's last event, inside the capture
        let graph = a.end_capture().expect("a valid capture");
        drop(graph);
        let fresh = DeviceBuffer::from_slice_in(&vec![7u32; n], &u, res.clone()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(400));
        let got = fresh.to_vec().unwrap();
        let bad = got.iter().filter(|&&x| x != 7).count();
        assert_eq!(bad, 0, "b's old fills overwrote {bad} elements of the block u was given");
    });
}

/// R5: cudrv's pool borrows a block of a capturing stream for another stream: it records its
/// event on the capturing stream and makes the other stream wait on it, which makes that stream
/// join the capture, silently and untracked: the allocating stream's work is captured instead of
/// run, and the capture cannot end.
#[test]
fn r5_pool_cross_stream_reuse_makes_the_allocating_stream_join_a_capture() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        let res: Arc<dyn MemoryResource> = pool.clone();
        let s = Stream::new(&dev).unwrap();
        let t = Stream::new(&dev).unwrap();
        let n = 3 << 20; // 12 MiB: a large chunk of its own, with no free remainder
        let old = DeviceBuffer::<u32>::zeroed_in(n, &s, res.clone()).unwrap();
        drop(old); // cached on s; its free not complete yet (delay)
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let other = DeviceBuffer::<u32>::zeroed_in(n, &t, res.clone());
        println!("allocation on t: {:?}", other.as_ref().map(|b| b.as_raw()));
        let st = t.capture_status().unwrap();
        let end = s.end_capture();
        println!("t: {st:?}; end_capture: {:?}", end.as_ref().map(|_| ()));
        assert_eq!(st, CaptureStatus::None, "t joined s's capture through the pool's wait");
    });
}

/// R6: an `IpcEvent` recorded on a capturing stream and waited in another stream makes that
/// stream join the capture without cudrv knowing (`IpcEvent::wait_in` has no join hooks). A
/// buffer of that stream used there is then captured with nothing keeping it: its drop frees it
/// under the graph.
#[test]
fn r6_ipc_event_join_is_untracked_and_the_graph_uses_freed_memory() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &a) {
            return;
        }
        let mut buf = DeviceBuffer::<u32>::zeroed(64, &b).unwrap();
        let e = cudrv::ipc::IpcEvent::new(&dev).unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        e.record(&a).unwrap();
        e.wait_in(&b).unwrap();
        assert_eq!(b.capture_status().unwrap(), CaptureStatus::Active);
        // SAFETY: fill_u32 writes buf[0..64].
        unsafe { fill.launch(LaunchConfig::for_num_elems(64), &b, (&mut buf, 5u32, 64u64)).unwrap() };
        a.wait_stream(&b).unwrap();
        let graph = a.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        drop(buf);
        b.synchronize().unwrap();
        exec.launch(&a).unwrap();
        a.synchronize().unwrap();
        let v = violations();
        assert!(v.is_empty(), "use after free by a graph launch: {v:?}");
    });
}

/// R7: a graph holding StreamOrderedPool memory admits a second executable graph as soon as the
/// first is dropped, although the first one's launches may still run: the second one's first
/// launch waits only for the capture's prelude. Both then run on the same reserved temporaries
/// at once, and each computes a result neither could compute alone.
#[test]
fn r7_a_second_exec_of_a_pool_graph_runs_on_the_temporaries_of_the_first_ones_launch() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_DELAY_US", "40000")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let add = module.function("add_f32").unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        let res: Arc<dyn MemoryResource> = pool.clone();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let n = 1024;
        let y = DeviceBuffer::from_slice(&vec![1.0f32; n], &a).unwrap();
        let mut out = DeviceBuffer::<f32>::zeroed(n, &a).unwrap();
        a.synchronize().unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        {
            let mut t1 = DeviceBuffer::<f32>::zeroed_in(n, &a, res.clone()).unwrap();
            // SAFETY: written by the kernel below before it is read.
            let mut t2 = unsafe { DeviceBuffer::<f32>::uninit_in(n, &a, res.clone()).unwrap() };
            let cfg = LaunchConfig::for_num_elems(n);
            for _ in 0..3 {
                // SAFETY: add_f32(a, b, out, n) touches [0..n] of each.
                unsafe { add.launch(cfg, &a, (&t1, &y, &mut t2, n as u64)).unwrap() }; // t2 = t1 + 1
                // SAFETY: as above.
                unsafe { add.launch(cfg, &a, (&t2, &y, &mut t1, n as u64)).unwrap() }; // t1 = t2 + 1
            }
            out.copy_from(&t1).unwrap();
        }
        let graph = a.end_capture().unwrap();
        let exec1 = graph.instantiate().unwrap();
        println!("nodes: {}", graph.nodes().unwrap().len());
        exec1.launch(&a).unwrap(); // 8 nodes, 40 ms each
        drop(exec1); // its launch is still running
        let exec2 = graph.instantiate().expect("a second executable graph once the first is dropped");
        std::thread::sleep(std::time::Duration::from_millis(100));
        let t0 = std::time::Instant::now();
        exec2.launch(&b).unwrap(); // not ordered after exec1's launch
        a.synchronize().unwrap();
        println!("a done after {:?}", t0.elapsed());
        b.synchronize().unwrap();
        println!("b done after {:?}", t0.elapsed());
        let got = out.to_vec().unwrap();
        println!("out[0] = {}, out[n-1] = {}", got[0], got[n - 1]);
        assert_eq!(got[0], 6.0, "each launch computes 6; two launches sharing the temporaries gave {}", got[0]);
        drop((exec2, graph));
    });
}

/// R3b: `IpcBuffer::copy_to_host` does not refuse a capture of its stream either: the copy into
/// the caller's slice is captured, the call returns `Err`, and every launch writes the slice.
#[test]
fn r3b_ipc_copy_to_host_is_captured_and_the_graph_writes_unborrowed_host_memory() {
    const ROLE: &str = "CUDRV_TEST_PEER";
    if std::env::var(ROLE).ok().as_deref() == Some("importer") {
        let h: cudrv::ipc::IpcMemHandle = std::env::var("CUDRV_TEST_PEER_DATA").unwrap().parse().unwrap();
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ib = cudrv::ipc::IpcBuffer::<u32>::open(&h, &s).unwrap();
        let mut dst = vec![0u32; 64];
        s.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let r = ib.copy_to_host(&mut dst);
        println!("IpcBuffer::copy_to_host during the capture: {r:?}");
        let graph = s.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        let dst_ro: &Vec<u32> = &dst;
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(dst_ro[0], 0, "the graph wrote into host memory that no borrow covers");
        println!("peer done: importer");
        return;
    }
    run_with_fake(&[("CUDRV_MEMORY_RESOURCE", "sync")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &s) {
            return;
        }
        let buf = DeviceBuffer::from_slice(&[0xBEEFu32; 64], &s).unwrap();
        let h = buf.ipc_handle().unwrap();
        let name = std::thread::current().name().unwrap().to_string();
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, "importer")
            .env("CUDRV_TEST_PEER_DATA", h.to_string())
            .env_remove("CUDRV_FAKE_CHILD");
        let out = output_retrying_start(&mut cmd).unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line = stderr.lines().find(|l| l.contains("assertion") || l.contains("panicked")).unwrap_or("");
        assert!(
            stdout.contains("peer done: importer"),
            "importer failed: {line}\n{}",
            stderr.lines().take(4).collect::<Vec<_>>().join("\n")
        );
        drop(buf);
    });
}

/// R8: `GraphExec::launch` notes the launch stream *before* launching and replaces the previous
/// one. A launch that then fails leaves `last_launch` naming a stream the graph never ran on, and
/// the stream of the real last launch is forgotten: the drop releases what the graph keeps after
/// waiting for the wrong stream, while the earlier launch still runs.
#[test]
fn r8_a_failed_launch_makes_the_release_forget_the_real_last_launch() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "50000"), ("CUDRV_FAKE_FAIL", "cuGraphLaunch:2:999")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let a = Stream::new(&dev).unwrap();
        let s1 = Stream::new(&dev).unwrap();
        let s2 = Stream::new(&dev).unwrap();
        let n = 1024;
        let mut target = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
        a.synchronize().unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        for _ in 0..4 {
            // SAFETY: fill_u32 writes target[0..n].
            unsafe { fill.launch(LaunchConfig::for_num_elems(n), &a, (&mut target, 1u32, n as u64)).unwrap() };
        }
        let graph = a.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        exec.launch(&s1).unwrap(); // 4 kernels, 50 ms each
        assert!(exec.launch(&s2).is_err(), "the injected failure");
        drop(target); // the graph keeps it
        drop((exec, graph)); // released after the last launch... on s2
        cudrv::flush_deferred_drops().unwrap();
        s1.synchronize().unwrap();
        let v = violations();
        assert!(v.is_empty(), "the graph's launch on s1 used memory released under it: {v:?}");
    });
}

/// R8b: the same without fault injection: a launch on the legacy stream fails with
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` while a blocking stream (here a per-thread stream)
/// captures; `last_launch` then names the legacy stream, which does not wait for the
/// non-blocking stream the graph really runs on.
#[test]
fn r8b_a_launch_refused_by_the_driver_makes_the_release_forget_the_real_last_launch() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "50000")], || {
        let dev = Device::get(0).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let a = Stream::new(&dev).unwrap();
        let s1 = Stream::new(&dev).unwrap();
        let n = 1024;
        let mut target = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
        a.synchronize().unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        for _ in 0..4 {
            // SAFETY: fill_u32 writes target[0..n].
            unsafe { fill.launch(LaunchConfig::for_num_elems(n), &a, (&mut target, 1u32, n as u64)).unwrap() };
        }
        let graph = a.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        exec.launch(&s1).unwrap();
        let pts = Stream::per_thread(&dev).unwrap();
        pts.begin_capture(CaptureMode::Relaxed).unwrap();
        let err = exec.launch(&Stream::legacy(&dev).unwrap()).unwrap_err();
        println!("launch on the legacy stream: {err}");
        drop(pts.end_capture());
        drop(target);
        drop((exec, graph));
        cudrv::flush_deferred_drops().unwrap();
        s1.synchronize().unwrap();
        let v = violations();
        assert!(v.is_empty(), "the graph's launch on s1 used memory released under it: {v:?}");
    });
}

/// R9: every capture that uses a long-lived buffer appends a `GraphUse` to it, never removed
/// while the buffer lives (unbounded growth: each keeps its graph's `GraphResources` allocation
/// and `Completion`). At the drop, `Free::run` walks them by recursion (`run` -> `after_launches`
/// -> `Completion::after` -> `release` -> `run`), one level per graph: a buffer used by enough
/// captures overflows the stack in its `Drop`.
#[test]
fn r9_a_buffer_used_by_many_captures_overflows_the_stack_when_dropped() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let a = Stream::new(&dev).unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(16, &a).unwrap();
        for _ in 0..20_000 {
            a.begin_capture(CaptureMode::ThreadLocal).unwrap();
            x.memset(1).unwrap();
            drop(a.end_capture().unwrap());
        }
        println!("dropping the buffer");
        drop(x);
        println!("dropped");
    });
}

/// R10: a pitched (or managed, or IPC) buffer dropped while its stream captures is leaked for
/// good: `free_after_waiting` -> `wait_for_memory` refuses the capturing stream, and the free is
/// dropped with a "drop error" instead of being deferred to the end of the capture as
/// `DeviceBuffer` does.
#[test]
fn r10_a_pitched_buffer_dropped_during_a_capture_leaks() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let a = Stream::new(&dev).unwrap();
        let p = DeviceBuffer2D::<u32>::zeroed(64, 4, &a).unwrap();
        let m = ManagedBuffer::<u32>::zeroed(64, &a).unwrap();
        a.synchronize().unwrap();
        let before = fake_report().live_allocations;
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        drop((p, m));
        drop(a.end_capture().unwrap());
        let sync = a.synchronize();
        println!("synchronize after the capture: {sync:?}");
        cudrv::flush_deferred_drops().unwrap();
        let after = fake_report().live_allocations;
        println!("deferred error: {:?}", dev.primary_context().unwrap().take_deferred());
        assert_eq!(after, before - 2, "both buffers should be freed once the capture ended");
    });
}

/// R8c: R8b's consequence on host memory, in safe code only: a graph built node by node whose
/// host nodes' closures the graph keeps "while any launch may run". After a refused launch, the
/// release waits for the wrong stream and frees the closures while the real last launch still
/// has to call them.
#[test]
fn r8c_host_node_closures_are_freed_while_a_launch_still_calls_them() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "50000")], || {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dev = Device::get(0).unwrap();
        let s1 = Stream::new(&dev).unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let mut graph = cudrv::graph::Graph::new(&dev).unwrap();
        let mut prev = Vec::new();
        for i in 0..4u64 {
            let data: Vec<u64> = vec![i; 1 << 16];
            let c = calls.clone();
            let n = graph
                .add_host_node(&prev, move || {
                    let sum: u64 = data.iter().sum();
                    assert_eq!(sum, i << 16, "host node {i} reads freed memory");
                    c.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            prev = vec![n];
        }
        let exec = graph.instantiate().unwrap();
        exec.launch(&s1).unwrap(); // 4 host nodes, 50 ms each
        let pts = Stream::per_thread(&dev).unwrap();
        pts.begin_capture(CaptureMode::Relaxed).unwrap();
        assert!(exec.launch(&Stream::legacy(&dev).unwrap()).is_err());
        drop(pts.end_capture());
        drop((exec, graph));
        cudrv::flush_deferred_drops().unwrap(); // the closures are dropped here
        // Reuse the freed heap memory.
        let junk: Vec<Vec<u64>> = (0..64).map(|_| vec![0xDEAD_BEEF; 1 << 16]).collect();
        s1.synchronize().unwrap();
        drop(junk);
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    });
}

/// R1b: R1 in safe code only: `copy_from_view` on a stream that does not capture, of buffers
/// whose stream does. The destination's `record_use` makes the copy stream join (untracked as a
/// use); the source's, coming second, sees the capture and is kept.
#[test]
fn r1b_safe_copy_on_a_joining_stream_leaves_the_destination_unkept() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let src = DeviceBuffer::from_slice(&[5u32; 256], &a).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(256, &a).unwrap();
        a.begin_capture(CaptureMode::ThreadLocal).unwrap();
        let refused = dst.copy_from_view(0, &src.as_view(), &b);
        assert!(matches!(refused, Err(Error::Capturing { .. })), "{refused:?}");
        assert_eq!(b.capture_status().unwrap(), CaptureStatus::None);
        b.wait_stream(&a).unwrap(); // joined explicitly
        dst.copy_from_view(0, &src.as_view(), &b).unwrap(); // captured on b, both buffers kept
        a.wait_stream(&b).unwrap();
        let graph = a.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        drop(dst); // freed now (cuMemFreeAsync on a): the graph does not keep it
        a.synchronize().unwrap();
        exec.launch(&a).unwrap();
        a.synchronize().unwrap();
        let v = violations();
        assert!(v.is_empty(), "use after free by a graph launch: {v:?}");
        drop(src);
    });
}

#[test]
fn a_stream_retired_after_its_pool_gives_the_blocks_it_cached_back_to_the_driver() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        let origin = Stream::new(&dev).unwrap();
        let joined = Stream::new(&dev).unwrap();
        // A block freed on `joined` stays in its cache.
        let buf = DeviceBuffer::<u8>::zeroed_in(3 << 20, &joined, pool.clone()).unwrap();
        drop(buf);
        joined.synchronize().unwrap();
        assert!(fake_report().live_allocations > 0);
        origin.begin_capture(CaptureMode::Relaxed).unwrap();
        joined.wait_stream(&origin).unwrap();
        origin.wait_stream(&joined).unwrap();
        // Its last user goes while it captures: its retirement waits for the capture's end.
        drop(joined);
        drop(pool);
        let graph = origin.end_capture().unwrap();
        drop(graph);
        // The retirement runs on cudrv's thread once the capture has ended.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while fake_report().live_allocations > 0 && std::time::Instant::now() < deadline {
            cudrv::flush_deferred_drops().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(fake_report().live_allocations, 0, "the cached block's memory was not given back");
    });
}

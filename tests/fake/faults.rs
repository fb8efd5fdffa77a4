//! Driver faults, swept: a workload of buffers on two streams, with cross-stream uses, copies,
//! reads back and trims, runs once for each injected failure of each driver function it calls
//! (its n-th call, then every call from the n-th on). Whatever fails, cudrv must not panic, the
//! fake driver must record no access to freed memory, every read that succeeds must return
//! what the operations that succeeded wrote, and the memory must still serve afterwards.
//!
//! A second workload does the same for a captured graph that allocates inside the capture, and
//! the first runs again on four threads sharing one pool.
//!
//! The sweeps were checked against faults planted by hand: in the pool, a failed
//! `cuStreamWaitEvent`, `cuEventRecord` or `cuEventQuery` taken for a success, and no wait at all
//! before another stream reuses a block (a buffer read back another's data); in graphs, a failed
//! wait before the first launch taken for a success (the launch read its input before it was
//! written). Each made a sweep fail.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::Arc;

use cudrv::graph::CaptureMode;
use cudrv::launch::LaunchConfig;
use cudrv::memory::{DeviceBuffer, MemoryResource, StreamOrderedPool, SyncResource};
use cudrv::module::Module;
use cudrv::{Device, Stream};
use cudrv_test_support::{fake_faults_injected, fake_report, run_with_fake};

use super::oldest;

/// Element counts of the workload's buffers (of `u32`): small, medium and large requests, so
/// that the pool's small blocks, shared chunks and chunks of their own all take part.
const LENS: [usize; 6] = [64, 16 << 10, (1 << 18) + 128, 3 << 18, (2 << 20) + 64, (3 << 20) + 4096];

/// A buffer the workload keeps, and the value every element holds if everything that wrote it
/// succeeded (`None`: some write failed, and its contents are not checked).
struct Kept {
    buf: DeviceBuffer<u32>,
    value: Option<u32>,
}

/// The workload: returns how many buffers it read back and checked, and how many operations
/// failed. Never panics on a driver error: it notes it and goes on, as an application that
/// handles errors would. It panics on a wrong value read back by a read that succeeded.
fn workload(rounds: u32) -> (usize, usize) {
    let mut checked = 0;
    let failed = Cell::new(0);
    let fail = || failed.set(failed.get() + 1);
    let note = |r: &cudrv::Result<()>| {
        if r.is_err() {
            fail();
        }
        r.is_ok()
    };
    let Ok(dev) = Device::get(0) else { return (0, 1) };
    let (Ok(s1), Ok(s2)) = (Stream::new(&dev), Stream::new(&dev)) else { return (0, 1) };
    let mut kept: VecDeque<Kept> = VecDeque::new();
    for i in 0..rounds {
        let len = LENS[i as usize % LENS.len()];
        let value = 0x1000_0000 | i;
        // Written on one stream, copied on the other after a wait, used there, read back later.
        let Ok(mut a) = DeviceBuffer::<u32>::zeroed(len, &s1) else {
            fail();
            continue;
        };
        let mut ok = note(&a.fill(value));
        match DeviceBuffer::<u32>::zeroed(len, &s2) {
            Ok(mut b) => {
                ok &= note(&s2.wait_stream(&s1));
                ok &= note(&b.copy_from(&a));
                kept.push_back(Kept { buf: b, value: ok.then_some(value) });
            }
            Err(_) => fail(),
        }
        // `a` is freed while its copy may still run on s2: the pool must not hand its block out
        // before that copy is done.
        if i % 3 == 0 {
            kept.push_back(Kept { buf: a, value: ok.then_some(value) });
        } else {
            drop(a);
        }
        // A new buffer on s1 likely reuses `a`'s block at once: written with another value.
        if let Ok(mut c) = DeviceBuffer::<u32>::zeroed(len, &s1) {
            note(&c.fill(!value));
            drop(c);
        } else {
            fail();
        }
        // A buffer freed on s1 behind writes still queued there, and one of its size made on s2
        // at once, which may get its block: the pool must order s2's writes after s1's.
        if let Ok(mut x) = DeviceBuffer::<u32>::zeroed(len, &s1) {
            for k in 0..4 {
                note(&x.fill(k));
            }
        } else {
            fail();
        }
        match DeviceBuffer::<u32>::zeroed(len, &s2) {
            Ok(mut y) => {
                if note(&y.fill(value)) {
                    kept.push_back(Kept { buf: y, value: Some(value) });
                }
            }
            Err(_) => fail(),
        }
        // Read back the oldest buffers, out of the order they were made in.
        while kept.len() > 4 {
            let k = kept.swap_remove_front(i as usize % kept.len()).expect("a kept buffer");
            if let Some(value) = k.value {
                match k.buf.to_vec() {
                    Ok(v) => {
                        let wrong = v.iter().position(|&x| x != value);
                        assert_eq!(
                            wrong,
                            None,
                            "round {i}: a buffer of {len} u32 reads {:#x}, not {value:#x}",
                            v[wrong.unwrap_or(0)]
                        );
                        checked += 1;
                    }
                    Err(_) => fail(),
                }
            }
        }
        if i % 7 == 6 {
            note(&dev.memory_resource().and_then(|r| r.trim(0)));
        }
    }
    drop(kept);
    note(&s1.synchronize());
    note(&s2.synchronize());
    // Everything back to the driver once more (threads that share the pool each give back what
    // the others left cached, so the number of releases depends less on their timing).
    note(&dev.memory_resource().and_then(|r| r.trim(0)));
    (checked, failed.get())
}

/// After the workload: the device's memory still serves, and reads back what was written.
fn still_serves() {
    let dev = Device::get(0).unwrap();
    let s = Stream::new(&dev).unwrap();
    for len in LENS {
        let mut b = DeviceBuffer::<u32>::zeroed(len, &s).unwrap();
        b.fill(7).unwrap();
        assert!(b.to_vec().unwrap().iter().all(|&x| x == 7));
    }
}

/// What every mode's workload calls besides its memory resource's own functions: the streams'
/// ordering (events, waits), the buffers' memsets and copies, and the reads back.
/// The host's waits are for events recorded on the stream (a copy to the host first asks the
/// stream whether it is idle); the last, `cuEventQuery`, is reached where the pool asks its events.
const COMMON: [&str; 9] = [
    "cuEventCreate",
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuStreamQuery",
    "cuMemsetD32Async",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuEventSynchronize",
    "cuEventQuery",
];

/// Which calls fail: the n-th only, or the n-th and every one after (a sticky error, or a driver
/// that stops answering). Under Wine (CI's Windows lane), where a child process takes about a
/// second to start, the first only and every one from the third: the pool's logic is the same
/// there, and the other lanes sweep the rest.
fn nth() -> &'static [&'static str] {
    if cfg!(windows) { &["1", "3+"] } else { &["1", "2", "3", "8", "1+", "3+"] }
}

/// Runs `body` in a child process on the fake driver in `mode`, with the fault `fail`
/// (`CUDRV_FAKE_FAIL`) injected and each operation on the device delayed a little, so that a
/// free not ordered after the work on its memory would be seen. After `body`, no freed memory may
/// have been accessed.
fn with_fault(mode: &[(&str, &str)], fail: &str, body: impl FnOnce()) {
    let mut env = mode.to_vec();
    env.extend([("CUDRV_FAKE_FAIL", fail), ("CUDRV_FAKE_DELAY_US", "200")]);
    run_with_fake(&env, || {
        if oldest() {
            return;
        }
        body();
        let report = fake_report();
        assert!(report.violations.is_empty(), "{fail}: {report}");
    });
}

/// Runs the workload once per fault: each of `functions` failing with CUDA_ERROR_UNKNOWN (999) at
/// each of [`nth`], and each of `allocations` with CUDA_ERROR_OUT_OF_MEMORY (2) too. Checks that
/// every fault was reached at its first call (so that the sweep tests what it names), that no
/// freed memory was accessed, that a single fault leaves reads to check and the memory serving.
fn sweep(mode: &[(&str, &str)], functions: &[&str], allocations: &[&str]) {
    let faults = functions
        .iter()
        .flat_map(|f| nth().iter().map(move |n| (*f, *n, "999")))
        .chain(allocations.iter().flat_map(|f| nth().iter().map(move |n| (*f, *n, "2"))));
    for (f, n, code) in faults {
        let fail = format!("{f}:{n}:{code}");
        with_fault(mode, &fail, || {
            let (checked, failed) = workload(24);
            let injected = fake_faults_injected();
            if n == "1" {
                assert!(injected >= 1, "{fail}: the workload never called {f}");
            }
            if !n.ends_with('+') {
                // One failed call leaves the rest of the workload to run and check.
                assert!(checked >= 20, "{fail}: only {checked} buffers read back ({failed} errors)");
                // Once the fault is spent (a fault not reached would still be armed).
                if injected >= 1 {
                    still_serves();
                }
            }
        });
    }
}

/// The driver calls of a pool that grows in segments.
pub(super) const VMM: [&str; 6] =
    ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease", "cuMemAddressReserve"];

#[test]
fn pool_in_segments_survives_every_driver_fault() {
    let functions: Vec<&str> = VMM.into_iter().chain(["cuMemGetInfo_v2"]).chain(COMMON).collect();
    sweep(&[("CUDRV_FAKE_MODE", "tcc")], &functions, &["cuMemCreate"]);
}

/// A driver that reports virtual memory management but refuses every `cuMemCreate` with
/// `CUDA_ERROR_NOT_SUPPORTED` (as an interposer or a driver model that keeps the virtual memory
/// calls from the process would) leaves the device's pool growing in chunks: every size is
/// served and reads back what was written.
#[test]
fn pool_grows_in_chunks_where_the_driver_refuses_every_mapping() {
    with_fault(&[("CUDRV_FAKE_MODE", "tcc")], "cuMemCreate:1+:801", || {
        let dev = Device::get(0).unwrap();
        let stream = Stream::new(&dev).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        assert!(pool.grows_in_segments(), "the fake's device reports virtual memory management");
        for (i, len) in LENS.into_iter().enumerate() {
            let data: Vec<u32> = (0..len as u32).map(|x| x ^ (i as u32) << 24).collect();
            let buf = DeviceBuffer::from_slice_in(&data, &stream, pool.clone()).unwrap();
            assert_eq!(buf.to_vec().unwrap(), data, "{len} elements");
        }
        assert!(fake_faults_injected() >= 1, "cuMemCreate was never called");
        assert!(!pool.grows_in_segments());
        assert!(pool.pool_stats().driver_allocs >= 3, "{:?}", pool.pool_stats());
    });
}

#[test]
fn pool_in_chunks_survives_every_driver_fault() {
    let functions: Vec<&str> = ["cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2"].into_iter().chain(COMMON).collect();
    sweep(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_VMM", "0")], &functions, &["cuMemAlloc_v2"]);
}

#[test]
fn driver_pool_survives_every_driver_fault() {
    // The driver's pool orders its frees itself: no event is queried on the host.
    let functions: Vec<&str> =
        ["cuMemAllocFromPoolAsync", "cuMemFreeAsync"].into_iter().chain(COMMON.into_iter().take(8)).collect();
    sweep(&[("CUDRV_FAKE_MODE", "linux")], &functions, &["cuMemAllocFromPoolAsync"]);
}

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

/// The graph workload: captures a step that allocates a temporary from the device's resource,
/// fills it with a kernel (`tmp = x + y`) and copies it back (`x = tmp`); launches the graph
/// `launches` times, with buffers of the temporary's size made, written and read back between
/// launches (they must never get the graph's block); then checks that `x` holds `x0 + k * y` for
/// one `k` that counts every launch that succeeded. Returns how many reads it checked and how many
/// operations failed; never panics on a driver error.
fn graph_workload(launches: usize) -> (usize, usize) {
    let n = 4096;
    let (mut checked, mut failed) = (0, 0);
    let Ok(dev) = Device::get(0) else { return (0, 1) };
    let Ok(module) = Module::from_ptx(&dev, PTX) else { return (0, 1) };
    let (Ok(add), Ok(s)) = (module.function("add_f32"), Stream::new(&dev)) else { return (0, 1) };
    // `x` is written on another stream, still queued there when the graph is captured: its first
    // launch must wait for it.
    let Ok(s0) = Stream::new(&dev) else { return (0, 1) };
    let x0 = 5.0;
    let y: Vec<f32> = (0..n).map(|i| (i % 17 + 1) as f32).collect();
    // Made with `cuMemAlloc` directly, so that the device's resource meets its first driver call
    // (and its faults) at the allocation inside the capture.
    let Ok(sync) = SyncResource::new(&dev) else { return (0, 1) };
    let sync: Arc<dyn MemoryResource> = Arc::new(sync);
    let (Ok(dy), Ok(mut x)) =
        (DeviceBuffer::from_slice_in(&y, &s, sync.clone()), DeviceBuffer::<f32>::zeroed_in(n, &s0, sync))
    else {
        return (0, 1);
    };
    if (0..8).any(|k| x.fill(x0 - 7.0 + k as f32).is_err()) {
        return (0, 1);
    }
    let (mut launched, mut tried) = (0, 0);
    if s.begin_capture(CaptureMode::ThreadLocal).is_ok() {
        let step = (|| -> cudrv::Result<()> {
            // SAFETY: the kernel writes every element before the copy reads it.
            let mut tmp = unsafe { DeviceBuffer::<f32>::uninit(n, &s) }?;
            // SAFETY: add_f32(const f32*, const f32*, f32*, u64) touches [0..n] of each buffer.
            unsafe { add.launch(LaunchConfig::for_num_elems(n), &s, (&x, &dy, &mut tmp, n as u64)) }?;
            x.copy_from_view(0, &tmp.as_view(), &s)
        })();
        // The capture ends whatever happened in it; a graph of a step that failed is dropped.
        let graph = s.end_capture();
        failed += usize::from(step.is_err()) + usize::from(graph.is_err());
        if let (Ok(()), Ok(graph)) = (step, graph) {
            match graph.instantiate() {
                Ok(exec) => {
                    for round in 0..launches {
                        tried += 1;
                        match exec.launch(&s) {
                            Ok(()) => launched += 1,
                            Err(_) => failed += 1,
                        }
                        let Ok(mut other) = DeviceBuffer::<f32>::zeroed(n, &s) else {
                            failed += 1;
                            continue;
                        };
                        let value = -(round as f32) - 1.0;
                        if other.fill(value).is_err() {
                            failed += 1;
                            continue;
                        }
                        match other.to_vec() {
                            Ok(v) => {
                                assert!(
                                    v.iter().all(|&e| e == value),
                                    "round {round}: a buffer made between launches changed"
                                );
                                checked += 1;
                            }
                            Err(_) => failed += 1,
                        }
                    }
                }
                Err(_) => failed += 1,
            }
        }
    } else {
        failed += 1;
    }
    // The launches ran on `s`, `x`'s reads are ordered on its own stream: order them after.
    if s0.wait_stream(&s).is_err() {
        return (checked, failed + 1);
    }
    match x.to_vec() {
        Ok(got) => {
            // Every launch that succeeded ran; one that failed may have run before its error.
            let k = (got[1] - x0) / y[1];
            assert!(k >= launched as f32 && k <= tried as f32, "x shows {k} launches: {launched} succeeded of {tried}");
            for i in 0..n {
                assert_eq!(got[i], x0 + k * y[i], "element {i} after {k} launches");
            }
            checked += 1;
        }
        Err(_) => failed += 1,
    }
    (checked, failed)
}

/// Runs the graph workload once per fault, as [`sweep`] does the buffer workload; after a single
/// fault, a second run must succeed in full.
fn graph_sweep(mode: &[(&str, &str)], functions: &[&str]) {
    for f in functions {
        let nth: &[&str] = if cfg!(windows) { &["1", "1+"] } else { &["1", "2", "3", "1+"] };
        for &n in nth {
            let fail = format!("{f}:{n}:999");
            with_fault(mode, &fail, || {
                graph_workload(6);
                let injected = fake_faults_injected();
                if n == "1" {
                    assert!(injected >= 1, "{fail}: the workload never called {f}");
                }
                if !n.ends_with('+') && injected == 1 {
                    let (checked, failed) = graph_workload(6);
                    assert_eq!((checked, failed), (7, 0), "{fail}: the run after the fault");
                    still_serves();
                }
            });
        }
    }
}

/// What capturing, instantiating and launching a graph calls, in every mode.
const GRAPH: [&str; 9] = [
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuStreamGetCaptureInfo_v3",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuLaunchKernel",
    "cuMemcpyDtoDAsync_v2",
    "cuEventRecord",
    "cuStreamWaitEvent",
];

#[test]
fn graphs_on_the_pool_in_segments_survive_every_driver_fault() {
    let functions: Vec<&str> = GRAPH.into_iter().chain(["cuMemCreate", "cuMemMap"]).collect();
    graph_sweep(&[("CUDRV_FAKE_MODE", "tcc")], &functions);
}

#[test]
fn graphs_on_the_pool_in_chunks_survive_every_driver_fault() {
    let functions: Vec<&str> = GRAPH.into_iter().chain(["cuMemAlloc_v2"]).collect();
    graph_sweep(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_VMM", "0")], &functions);
}

#[test]
fn graphs_on_the_driver_pool_survive_every_driver_fault() {
    let functions: Vec<&str> = GRAPH.into_iter().chain(["cuMemAllocFromPoolAsync", "cuMemFreeAsync"]).collect();
    graph_sweep(&[("CUDRV_FAKE_MODE", "linux")], &functions);
}

/// Four threads run the buffer workload at once, each on its own streams and all on the device's
/// one pool, while a fault hits one call, or every call from some point on (a sticky error):
/// the threads must all finish (no lock is left held, no thread waits forever on another's
/// failed work), with the same checks as [`sweep`].
fn threaded_sweep(mode: &[(&str, &str)], functions: &[&str]) {
    for f in functions {
        for n in ["7", "7+"] {
            let fail = format!("{f}:{n}:999");
            with_fault(mode, &fail, || {
                let results: Vec<(usize, usize)> = std::thread::scope(|scope| {
                    let threads: Vec<_> = (0..4).map(|_| scope.spawn(|| workload(12))).collect();
                    threads.into_iter().map(|t| t.join().expect("a workload thread panicked")).collect()
                });
                assert!(fake_faults_injected() >= 1, "{fail}: the workload never called {f} 7 times");
                if n == "7" {
                    let checked: usize = results.iter().map(|r| r.0).sum();
                    assert!(checked >= 4 * 8, "{fail}: only {checked} buffers read back: {results:?}");
                    still_serves();
                }
            });
        }
    }
}

#[test]
fn threads_on_the_pool_in_segments_survive_driver_faults() {
    let functions = ["cuMemCreate", "cuMemMap", "cuMemUnmap", "cuEventRecord", "cuEventQuery", "cuStreamWaitEvent"];
    threaded_sweep(&[("CUDRV_FAKE_MODE", "tcc")], &functions);
}

#[test]
fn threads_on_the_pool_in_chunks_survive_driver_faults() {
    let functions = ["cuMemAlloc_v2", "cuMemFree_v2", "cuEventRecord", "cuEventQuery", "cuStreamWaitEvent"];
    threaded_sweep(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_VMM", "0")], &functions);
}

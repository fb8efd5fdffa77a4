//! Review 29a: a panic audit of the library code that safe public API reaches (`src/**/*.rs` and
//! `sys/src/**/*.rs`, tests and docs aside): every `unwrap`, `expect`, `unreachable!`, `panic!`
//! and non-debug `assert!`; indexing on data from the user or the driver; arithmetic on user sizes,
//! lengths, offsets and counts that could overflow (and, wrapping in release, hand the driver a
//! wrong value); `as` casts that truncate user values; divisions; `RefCell` borrows; thread-local
//! access during thread exit; every `impl Drop` (poisoned mutexes, unwinding); the callbacks the
//! driver runs on its own threads (host functions and graph host nodes, where a panic that
//! escapes unwinds into C and aborts); cudrv's deferred-work thread; and `Error`'s `Display`
//! and `From` impls.
//!
//! Found, with the tests that reproduce each (they failed before the fix that came with them):
//! - `Stream::per_thread` read its thread-local cache with `LocalKey::with`, which panics once the
//!   thread's thread-locals are being destroyed: called from a thread-local destructor (a value
//!   that gives its thread's per-thread stream a last piece of work), it panicked, and a panic in
//!   a thread-local destructor aborts the process. It now returns `Error::Unsupported`:
//!   `per_thread_in_a_thread_local_destructor_is_an_error_not_an_abort`.
//! - The trampolines of `Stream::launch_host_fn` and `Graph::add_host_node` caught a panic of the
//!   user's closure, but dropped its payload in the `extern "C"` function itself: a payload whose
//!   own `Drop` panics (`std::panic::panic_any`) unwound into the driver, which aborts the process.
//!   The payload is now dropped under `catch_unwind` too (and forgotten if that panics again):
//!   `a_host_function_whose_panic_payload_panics_as_it_is_dropped_does_not_abort` and
//!   `a_graph_host_node_whose_panic_payload_panics_as_it_is_dropped_does_not_abort`.
//! - cudrv's deferred-work thread did the same with the payload of a deferred drop that panicked
//!   (a custom `MemoryResource::deallocate`, run there for a buffer dropped in a host function):
//!   the thread died, every later deferred drop leaked, and `flush_deferred_drops` waited for ever:
//!   `a_deferred_free_whose_panic_payload_panics_as_it_is_dropped_leaves_the_thread_serving`.
//! - `JitTarget::compute` and `JitTarget::arch_specific` computed `major * 10 + minor`, which
//!   overflows for a large major (a panic in a debug build, a wrapped value in release) and is
//!   ambiguous for a minor above 9: `compute(429_496_737, 6)` wrapped to 80 and `compute(8, 10)`
//!   was 90, so a module was compiled for compute_80 or compute_90 where the caller asked for an
//!   impossible target, and `compute(6556, 6)` became the architecture-specific `compute_30a`. The
//!   target now keeps the major and minor it was given, and is refused unless it is a compute
//!   capability (`InvalidArgument`, before the driver is called):
//!   `jit_targets_beyond_a_compute_capability_are_refused_not_wrapped`.
//!
//! Found by reading, fixed, with no test (the emulated driver cannot answer so): `Event::elapsed`
//! and a module's `compile_time` turned the driver's milliseconds into a `Duration` with
//! `Duration::from_secs_f64`, which panics for an infinite or huge value (more than about 584
//! billion years): the elapsed time saturates now, and such a compile time is `None`. The cluster
//! size checked by `launch_cluster`, `launch_with` and `max_active_clusters` was the product of
//! three dimensions, each at most the device's grid limit: a driver reporting limits beyond any
//! real device's let it wrap to a small size (a panic in a debug build); it saturates now.
//! `cuMemHostAlloc` and `cuMemAllocManaged` answering success with a null pointer would have made
//! `PinnedBuffer` write through it (and `ManagedBuffer` make a slice of it): refused now as a
//! driver error (`CUDA_ERROR_UNKNOWN`). The spin counter of a stream's gate waits
//! (`stream::pause`) overflowed (a panic in a debug build) after about four billion looks at a gate
//! held for long (a capture begun on a stream whose gate another thread holds during a wait of an
//! hour): it wraps now, as it did in release.
//!
//! In `src/memory/pool/trace.rs`: `Trace::replay_watched` `expect`ed each free of the replay to
//! succeed, but its `watch` closure may use the `SimulatedPool` it is given (it is shared): a
//! closure that freed one of the replay's allocations made the replay panic; it skips that free
//! now: `replaying_a_trace_whose_watcher_frees_an_allocation_reports_no_panic`.
//!
//! Checked and sound: the other `unwrap`/`expect`/`unreachable!` sites (each guarded by a check
//! just before, or an invariant of cudrv's own bookkeeping); every `Drop` takes its locks with
//! `unwrap_or_else(PoisonError::into_inner)` and reaches the driver only through `Result`s; the
//! thread-locals other than `Stream::per_thread`'s are `const` cells without destructors (always
//! accessible), read with `try_with` (the drop-error hook's), or those of cudrv's deferred-work
//! thread, which never exits (their `RefCell`s are borrowed around no call out); launch dimensions,
//! shared memory, cluster sizes and JIT options are checked before any cast or product; copies,
//! views and ranges use checked arithmetic; IPC handles are checked against the allocation they
//! open; driver attributes are converted with `try_from` (a negative value reads 0); the pool's
//! `SimulatedPool` and `Trace` took extreme `PoolConfig` values, memory limits, sizes and bad
//! frees without a panic (a fuzz run outside the suite, with overflow checks on). Pinned down here:
//! buffers of a per-thread stream dropped in a thread-local destructor after that thread's
//! thread-locals began to go (in the first test), and zero-sized elements, whose buffers,
//! copies, views, fills and IPC handles answer with typed errors or do nothing:
//! `buffers_of_zero_sized_elements_answer_without_panicking`.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use cudrv::graph::Graph;
use cudrv::memory::{
    DeviceBuffer, DevicePtr, MemoryResource, PoolConfig, ResourceKind, SimulatedPool, SyncResource, Trace,
};
use cudrv::module::JitTarget;
use cudrv::{Device, Error, JitConfig, Module, Stream};
use cudrv_test_support::run_with_fake;

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");
const WAIT: Duration = Duration::from_secs(10);

// ------------------------------------------------------------------------------------------------
// Thread exit
// ------------------------------------------------------------------------------------------------

/// What a thread-local destructor saw: the contents of a buffer of its thread's per-thread stream
/// (read, then dropped there with its stream), and what `Stream::per_thread` answered.
type AtExitSaw = (cudrv::Result<Vec<u32>>, cudrv::Result<u64>);

/// A value whose destructor runs at its thread's exit, after the thread's other thread-locals
/// (it is registered before them: they go first).
struct AtThreadExit {
    dev: Device,
    kept: Option<(Stream, DeviceBuffer<u32>)>,
    tx: mpsc::Sender<AtExitSaw>,
}

impl Drop for AtThreadExit {
    fn drop(&mut self) {
        let read = match self.kept.take() {
            Some((stream, buf)) => {
                let read = buf.to_vec();
                drop(buf);
                drop(stream);
                read
            }
            None => Ok(Vec::new()),
        };
        let again = Stream::per_thread(&self.dev).map(|s| s.id());
        let _ = self.tx.send((read, again));
    }
}

thread_local! {
    static AT_THREAD_EXIT: RefCell<Option<AtThreadExit>> = const { RefCell::new(None) };
}

/// DEFECT (failed before the fix: the child aborted, "thread local panicked on drop": the
/// destructor's `Stream::per_thread` panicked in `LocalKey::with`). A thread-local destructor that
/// runs after cudrv's own thread-locals went asks for its thread's per-thread stream: cudrv can no
/// longer find the stream it gave that thread, and handing out another would give the thread two
/// streams of one handle, unaware of each other's captures. It gets `Error::Unsupported`, and the
/// buffer and stream it kept still read and drop there.
///
/// Linux only: the test needs its thread-local's destructor to run after cudrv's, in the reverse
/// order of registration, as glibc runs them. Rust promises neither the order nor that
/// destructors run on Windows; under Wine the destructor did not run at all (the CI replica's
/// Windows lane waited for it in vain). The fix (`try_with`) is the same code there.
#[test]
#[cfg_attr(not(target_os = "linux"), ignore = "thread-local destructor order is glibc's")]
fn per_thread_in_a_thread_local_destructor_is_an_error_not_an_abort() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            // First: registered before cudrv's thread-locals, destroyed after them.
            AT_THREAD_EXIT.with(|slot| *slot.borrow_mut() = Some(AtThreadExit { dev, kept: None, tx }));
            let s = Stream::per_thread(&dev).unwrap();
            let mut buf = DeviceBuffer::<u32>::zeroed(256, &s).unwrap();
            buf.fill(7).unwrap();
            AT_THREAD_EXIT.with(|slot| slot.borrow_mut().as_mut().unwrap().kept = Some((s, buf)));
        });
        assert!(thread.join().is_ok(), "the thread exited normally");
        let (read, again) = rx.recv_timeout(WAIT).expect("the thread-local destructor ran");
        assert_eq!(read.unwrap(), vec![7; 256], "the buffer kept until thread exit");
        match again {
            Err(Error::Unsupported { feature, reason, alternative: Some(_), .. }) => {
                assert!(feature.contains("per-thread"), "{feature}");
                assert!(reason.contains("thread-local"), "{reason}");
            }
            other => panic!("expected Unsupported from Stream::per_thread at thread exit, got {other:?}"),
        }
        // The thread's other streams and this thread's per-thread stream are unaffected.
        let s = Stream::per_thread(&dev).unwrap();
        let b = DeviceBuffer::from_slice(&[1u32, 2, 3], &s).unwrap();
        assert_eq!(b.to_vec().unwrap(), [1, 2, 3]);
        drop(b);
        cudrv::flush_deferred_drops().unwrap();
        dev.memory_resource().unwrap().trim(0).unwrap();
        crate::assert_no_leaks_but_streams();
    });
}

// ------------------------------------------------------------------------------------------------
// Panics on the driver's threads and on cudrv's
// ------------------------------------------------------------------------------------------------

/// A panic payload whose `Drop` panics.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("a panic payload that panics as it is dropped (expected by the test)");
    }
}

/// DEFECT (failed before the fix: the child aborted, "panic in a function that cannot unwind":
/// the trampoline dropped the caught payload itself). `launch_host_fn` promises that a panic in
/// the host function is caught and does not cross into the driver: so is a payload that panics as
/// it is dropped, and the stream goes on running later host functions.
#[test]
fn a_host_function_whose_panic_payload_panics_as_it_is_dropped_does_not_abort() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        s.launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
            std::panic::panic_any(Bomb);
        })
        .unwrap();
        let (tx, rx) = mpsc::channel();
        s.launch_host_fn(move || {
            let _ = tx.send(());
        })
        .unwrap();
        s.synchronize().unwrap();
        rx.recv_timeout(WAIT).expect("the next host function ran");
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        let b = DeviceBuffer::from_slice(&[5u32; 16], &s).unwrap();
        assert_eq!(b.to_vec().unwrap(), [5; 16], "the stream works on");
    });
}

/// DEFECT (failed before the fix, as the test above: the child aborted). The same for a graph's
/// host node, which runs at every launch of the executable graph.
#[test]
fn a_graph_host_node_whose_panic_payload_panics_as_it_is_dropped_does_not_abort() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        let mut graph = Graph::new(&dev).unwrap();
        graph
            .add_host_node(&[], move || {
                r.fetch_add(1, Ordering::SeqCst);
                std::panic::panic_any(Bomb);
            })
            .unwrap();
        let exec = graph.instantiate().unwrap();
        exec.launch(&s).unwrap();
        exec.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 2, "the host node ran at each launch");
        drop((exec, graph));
        cudrv::flush_deferred_drops().unwrap();
    });
}

/// A `SyncResource` whose `deallocate`, once armed, frees the memory and then panics with a
/// [`Bomb`].
#[derive(Debug)]
struct PanicsAfterFree {
    inner: SyncResource,
    armed: AtomicBool,
}

// SAFETY: every pointer is the inner resource's and goes back to it as it came.
unsafe impl MemoryResource for PanicsAfterFree {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<DevicePtr> {
        self.inner.allocate(bytes, stream)
    }
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }?;
        if self.armed.swap(false, Ordering::SeqCst) {
            std::panic::panic_any(Bomb);
        }
        Ok(())
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn kind(&self) -> ResourceKind {
        ResourceKind::Custom
    }
}

/// DEFECT (failed before the fix: the flush did not return within 10 s; cudrv's deferred-work
/// thread had died dropping the payload of the free that panicked on it, so nothing deferred ran
/// any more). A buffer of a custom resource dropped in a host function is freed on cudrv's
/// deferred-work thread, which runs the resource's `deallocate`: a panic there, payload and all,
/// must not end the thread that serves every later deferred drop.
#[test]
fn a_deferred_free_whose_panic_payload_panics_as_it_is_dropped_leaves_the_thread_serving() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let r = Arc::new(PanicsAfterFree { inner: SyncResource::new(&dev).unwrap(), armed: AtomicBool::new(true) });
        let first = DeviceBuffer::<u32>::zeroed_in(64, &s, r.clone()).unwrap();
        let second = DeviceBuffer::<u32>::zeroed_in(64, &s, r.clone()).unwrap();
        s.launch_host_fn(move || drop(first)).unwrap();
        s.synchronize().unwrap();
        let flushed = crate::within_10s(cudrv::flush_deferred_drops);
        assert!(matches!(flushed, Some(Ok(()))), "the flush after the panic: {flushed:?}");
        assert!(!r.armed.load(Ordering::SeqCst), "the free that panics ran");
        // The thread serves on: the next buffer dropped in a host function is freed too.
        s.launch_host_fn(move || drop(second)).unwrap();
        s.synchronize().unwrap();
        let flushed = crate::within_10s(cudrv::flush_deferred_drops);
        assert!(matches!(flushed, Some(Ok(()))), "the next flush: {flushed:?}");
        assert_eq!(r.inner.stats().unwrap().in_use, 0, "both buffers were freed");
        crate::assert_no_leaks_but_streams();
    });
}

// ------------------------------------------------------------------------------------------------
// Arithmetic on the user's values
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `JitTarget::compute(429_496_737, 6)` reported compute
/// capability 8.0, and the module loaded for compute_80). A target beyond a compute capability,
/// by a major that overflows `major * 10 + minor` or a minor above 9, keeps what the caller asked
/// for and is refused before the driver is called; it never becomes another, valid target.
#[test]
fn jit_targets_beyond_a_compute_capability_are_refused_not_wrapped() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        for (target, asked, arch) in [
            (JitTarget::compute(429_496_737, 6), (429_496_737, 6), false),
            (JitTarget::compute(u32::MAX, u32::MAX), (u32::MAX, u32::MAX), false),
            (JitTarget::compute(8, 10), (8, 10), false),
            (JitTarget::compute(6556, 6), (6556, 6), false),
            (JitTarget::arch_specific(9, 10), (9, 10), true),
            (JitTarget::arch_specific(u32::MAX, 0), (u32::MAX, 0), true),
        ] {
            assert_eq!(target.compute_capability(), asked, "{target}");
            let shown = target.to_string();
            assert_eq!(shown.ends_with('a'), arch, "{shown}");
            let err = Module::from_ptx_with(&dev, PTX, &JitConfig::new().target(target)).unwrap_err();
            let msg = crate::invalid_argument(err);
            assert!(msg.contains("is not a compute capability"), "{msg}");
        }
        assert_eq!(cudrv_test_support::fake_report().live_modules, 0);
        // Compute capabilities keep their values and load.
        assert_eq!(JitTarget::compute(8, 6).as_raw(), 86);
        assert_eq!(JitTarget::compute(9, 0).to_string(), "compute_90");
        assert_eq!(JitTarget::arch_specific(9, 0).as_raw(), (1 << 16) + 90);
        assert_eq!(JitTarget::arch_specific(9, 0).compute_capability(), (9, 0));
        assert_eq!(JitTarget::compute(9, 0), JitTarget::compute(9, 0));
        assert_ne!(JitTarget::compute(9, 0), JitTarget::arch_specific(9, 0));
        Module::from_ptx_with(&dev, PTX, &JitConfig::new().target(JitTarget::compute(9, 0))).unwrap();
    });
}

/// Checked and sound: buffers of zero-sized elements (`[u32; 0]` is a `DeviceRepr`) hold no
/// bytes whatever their length; allocating, copying, viewing, filling and sharing them either does
/// nothing or answers with a typed error, and they are freed.
#[test]
fn buffers_of_zero_sized_elements_answer_without_panicking() {
    run_with_fake(&[], || {
        type Z = [u32; 0];
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut a = DeviceBuffer::<Z>::zeroed(1000, &s).unwrap();
        let b = DeviceBuffer::<Z>::from_slice(&[[]; 1000], &s).unwrap();
        assert_eq!((a.len(), a.byte_len()), (1000, 0));
        assert_eq!(a.to_vec().unwrap().len(), 1000);
        a.copy_from(&b).unwrap();
        a.copy_within(0..10, 500).unwrap();
        a.copy_from_host(&[[]; 1000]).unwrap();
        let v = b.view(10..20).unwrap();
        assert_eq!((v.len(), v.as_raw()), (10, b.as_raw()));
        a.copy_from_view(990, &v, &s).unwrap();
        a.memset(1).unwrap();
        assert!(matches!(a.fill([]), Err(Error::InvalidArgument(_))));
        assert!(matches!(a.ipc_handle(), Err(Error::InvalidArgument(_))));
        s.synchronize().unwrap();
        drop((a, b));
        cudrv::flush_deferred_drops().unwrap();
        dev.memory_resource().unwrap().trim(0).unwrap();
        crate::assert_no_leaks_but_streams();
    });
}

// ------------------------------------------------------------------------------------------------
// The pool's trace replay (src/memory/pool/trace.rs)
// ------------------------------------------------------------------------------------------------

/// DEFECT (fixed): `Trace::replay_watched` calls `watch` after each event with the replay's pool
/// shared, and `expect`ed that each free of the replay succeeds. A watcher that frees one of the
/// replay's allocations itself (the simulated addresses are deterministic: a pool made alike hands
/// out the same one) made the replay panic ("a live allocation of the pool"); the replay now
/// skips a free the pool refuses, and checks its figures as before.
#[test]
fn replaying_a_trace_whose_watcher_frees_an_allocation_reports_no_panic() {
    let trace = Trace::parse("a,1,4096,0\nf,1,4096,0").unwrap();
    // The address the replay's first allocation gets.
    let ptr = SimulatedPool::new(PoolConfig::default(), None).allocate(4096, 0).unwrap();
    let pool = SimulatedPool::new(PoolConfig::default(), None);
    let freed = std::cell::Cell::new(false);
    let replayed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        trace.replay_watched(&pool, |i| {
            if i == 0 {
                freed.set(pool.deallocate(ptr, 4096, 0).is_ok());
            }
        })
    }));
    assert!(freed.get(), "the watcher freed the replay's allocation");
    let report = replayed.expect("the replay panicked");
    assert_eq!((report.events, report.out_of_memory_at), (2, None));
    assert_eq!(pool.stats().in_use, 0);
}

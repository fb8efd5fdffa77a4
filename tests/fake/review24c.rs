//! Review 24c: the loader (`sys/src/loader.rs`, `sys/src/lib.rs`), primary contexts and binding
//! (`src/context.rs`) and the initialised driver (`src/result.rs`), for soundness and driver
//! faults: concurrent first use of many symbols, a driver whose `cuGetProcAddress` fails, a bad
//! `CUDRV_DRIVER_PATH`, `cuInit` failing, the driver shutting down under live objects, binding on
//! threads that have a context of their own, primary-context retain/release counts, and what
//! stays mapped for the driver's threads. Three tests reproduced a defect (they failed before the
//! fix that came with them, and say so in their docs):
//! `releasing_cached_events_inside_a_host_function_does_not_call_the_driver`,
//! `dropping_a_loaded_driver_leaves_its_library_mapped_for_the_drivers_threads` and
//! `synchronizing_a_context_during_a_capture_is_refused_and_leaves_the_capture_intact`; the others
//! pin down behaviour that the review checked and found sound.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use cudrv::memory::DeviceBuffer;
use cudrv::sys::{CUresult, Driver};
use cudrv::{Device, Error, Event, Stream};
use cudrv_test_support::{fake_faults_injected, fake_host_fn_driver_calls, fake_report, fake_shutdown, run_with_fake};

use crate::soundness::within;

const OK: Result<CUresult, cudrv::sys::MissingSymbol> = Ok(CUresult::CUDA_SUCCESS);

// ------------------------------------------------------------------------------------------------
// Contexts inside host functions
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: the fake counted one driver call made inside the host
/// function). `Context::release_cached_events` is safe and may be called anywhere, a host
/// function included (a `Context` is `Send + Sync`, and host functions capture `Arc<Context>`s),
/// but it destroyed the context's spare events with `cuEventDestroy` right there, where the driver
/// may not be called (it may refuse, or deadlock). Inside a host function the events are now
/// destroyed on cudrv's deferred-work thread, as a `Context`'s own drop does.
#[test]
fn releasing_cached_events_inside_a_host_function_does_not_call_the_driver() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        a.wait_stream(&b).unwrap(); // leaves a spare event on the context
        a.synchronize().unwrap();
        let with_spare = fake_report().live_events;
        let ctx = dev.primary_context().unwrap();
        let (c, (tx, rx)) = (ctx.clone(), mpsc::channel());
        a.launch_host_fn(move || {
            c.release_cached_events();
            let _ = tx.send(());
        })
        .unwrap();
        // Counted before a synchronize, which would make a spare event again for its own wait.
        rx.recv_timeout(Duration::from_secs(10)).expect("the host function ran");
        assert_eq!(fake_host_fn_driver_calls(), 0, "the driver was called inside a host function");
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_events, with_spare - 1, "the spare event is destroyed, once");
        a.synchronize().unwrap();
        // The context makes a new one when it needs one again.
        a.wait_stream(&b).unwrap();
        a.synchronize().unwrap();
        assert_eq!(fake_report().live_events, with_spare);
    });
}

/// The emulated driver flags every driver call made inside a host function as a violation (which
/// fails any test in the fake suite that makes one, through cudrv or not), and counts it.
#[test]
fn the_fake_flags_driver_calls_made_inside_host_functions() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        // Resolved here first: a first call resolves the function with `cuGetProcAddress`, a
        // driver call of its own.
        let mut version = 0;
        // SAFETY: a valid out-pointer.
        let _ = unsafe { Driver::global().unwrap().cuDriverGetVersion(&mut version) };
        s.launch_host_fn(|| {
            let mut version = 0;
            // SAFETY: a valid out-pointer; the call is the violation this test makes on purpose.
            let _ = unsafe { Driver::global().unwrap().cuDriverGetVersion(&mut version) };
        })
        .unwrap();
        s.synchronize().unwrap();
        assert_eq!(fake_host_fn_driver_calls(), 1);
        let violations = fake_report().violations;
        assert!(
            violations.len() == 1 && violations[0].contains("cuDriverGetVersion called inside a host function"),
            "{violations:?}"
        );
        cudrv_test_support::fake_reset_violations();
    });
}

/// Checked and sound: a `Context` whose last holder is a host function is released on cudrv's
/// deferred-work thread, not in the host function; the primary context ends inactive.
#[test]
fn the_last_context_dropped_in_a_host_function_is_released_outside_it() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ctx = dev.primary_context().unwrap();
        let other = Stream::new(&dev).unwrap();
        other.wait_stream(&s).unwrap(); // a spare event, destroyed with the context
        drop(other);
        let (tx, rx) = mpsc::channel();
        let raw_dev = dev.as_raw();
        // The stream's own context reference goes with the stream, on this thread, after the
        // host function has run: the host function holds the last other one.
        s.launch_host_fn(move || {
            drop(ctx);
            let _ = tx.send(());
        })
        .unwrap();
        s.synchronize().unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        drop(s);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_host_fn_driver_calls(), 0);
        assert!(!primary_active(raw_dev), "every retain of the primary context was released");
        let r = fake_report();
        assert_eq!((r.live_events, r.live_streams), (0, 0), "{r}");
    });
}

// ------------------------------------------------------------------------------------------------
// Unloading the driver
// ------------------------------------------------------------------------------------------------

static HOST_FN_RAN: AtomicBool = AtomicBool::new(false);

extern "C" fn note_host_fn(_: *mut c_void) {
    HOST_FN_RAN.store(true, Ordering::SeqCst);
}

/// DEFECT (failed before the fix: the child died of a segmentation fault). `Driver::load` is safe
/// and returns an owned `Driver`, whose drop closed the library (`dlclose`). A CUDA driver starts
/// threads of its own (a stream's worker, the driver's service threads) that run its code after
/// the call that started them returned: with the library unmapped under them, the next thing they
/// ran was unmapped memory. Every call made through the `Driver` met its documented contract, and
/// the drop is safe code. A `Driver` now never unloads its library (the driver cannot be unloaded
/// while its threads live, and cudrv cannot know when they are done).
#[test]
fn dropping_a_loaded_driver_leaves_its_library_mapped_for_the_drivers_threads() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "300000")], || {
        let d = Driver::load().unwrap();
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointers and handles, each made by the call before; the host function
        // is a plain `extern "C"` function of this binary that ignores its argument.
        unsafe {
            assert_eq!(d.cuInit(0), OK);
            let mut dev = 0;
            assert_eq!(d.cuDeviceGet(&mut dev, 0), OK);
            let mut ctx = std::ptr::null_mut();
            assert_eq!(d.cuDevicePrimaryCtxRetain(&mut ctx, dev), OK);
            assert_eq!(d.cuCtxSetCurrent(ctx), OK);
            assert_eq!(d.cuStreamCreate(&mut stream, 0), OK);
            assert_eq!(d.cuLaunchHostFunc(stream, Some(note_host_fn), std::ptr::null_mut()), OK);
        }
        // The stream's worker sleeps 300 ms inside the driver before it runs the host function.
        drop(d);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !HOST_FN_RAN.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(HOST_FN_RAN.load(Ordering::SeqCst), "the driver's thread ran the host function");
        // The library, and the driver's state, are the same ones.
        let d = Driver::global().unwrap();
        // SAFETY: the stream made above, synchronised and destroyed once, its context current.
        unsafe {
            assert_eq!(d.cuStreamSynchronize(stream), OK);
            assert_eq!(d.cuStreamDestroy_v2(stream), OK);
        }
    });
}

// ------------------------------------------------------------------------------------------------
// Lazy resolution
// ------------------------------------------------------------------------------------------------

/// Checked and sound: many threads loading the driver and resolving every function for the first
/// time at once (in different orders) all see the same table, which is the one a single thread
/// sees afterwards; with `cuGetProcAddress` failing for some of them (the first call only, so that
/// the threads race a failed and a successful lookup) the exported symbols stand in. A failed
/// `cuGetProcAddress` is never taken for a missing function.
#[test]
fn concurrent_first_resolution_gives_every_thread_the_same_table() {
    for env in [&[][..], &[("CUDRV_FAKE_FAIL", "cuGetProcAddress:1:999")][..]] {
        run_with_fake(env, || {
            const THREADS: usize = 12;
            let names: Vec<&'static str> = Driver::functions().iter().map(|f| f.name).collect();
            let barrier = Arc::new(Barrier::new(THREADS));
            let seen: Vec<Vec<bool>> = (0..THREADS)
                .map(|t| {
                    let (barrier, names) = (barrier.clone(), names.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        let d = Driver::global().unwrap();
                        let n = names.len();
                        let mut has = vec![false; n];
                        for k in 0..n {
                            let i = (k * (t + 1) + t * 37) % n; // a different order per thread
                            has[i] = d.has(names[i]);
                        }
                        // (k * (t + 1)) mod n is a permutation only where t + 1 and n are coprime:
                        // ask for the rest too.
                        for i in 0..n {
                            has[i] = d.has(names[i]);
                        }
                        has
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect();
            let d = Driver::global().unwrap();
            let again: Vec<bool> = names.iter().map(|n| d.has(n)).collect();
            for (t, s) in seen.iter().enumerate() {
                assert_eq!(s, &again, "thread {t} saw another table");
            }
            assert!(again.iter().filter(|&&h| h).count() > 100, "the fake's functions resolve");
            if !crate::oldest() {
                // In every set of bindings cudrv builds with (CUDA 12.9 and 13.0 headers).
                assert!(d.has("cuMemAllocAsync") && d.has("cuGetProcAddress_v2"));
                // A CUDA 13.0 function, where the bindings have it (those of 12.9's headers do not).
                if names.contains(&"cuCtxSynchronize_v2") {
                    assert!(d.has("cuCtxSynchronize_v2"));
                }
            }
            // And the functions work.
            let dev = Device::get(0).unwrap();
            let s = Stream::new(&dev).unwrap();
            let buf = DeviceBuffer::from_slice(&[7u32, 8, 9], &s).unwrap();
            assert_eq!(buf.to_vec().unwrap(), [7, 8, 9]);
        });
    }
}

/// Checked and sound: with `cuGetProcAddress` failing at every call, every function resolves by
/// its exported name (the ABI the bindings declare), and cudrv works as usual.
#[test]
fn a_driver_whose_get_proc_address_always_fails_still_works() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuGetProcAddress:1+:999"), ("CUDRV_MEMORY_RESOURCE", "sync")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
        buf.fill(11).unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![11; 64]);
        let d = Driver::global().unwrap();
        assert!(d.has("cuMemAlloc_v2") && d.has("cuStreamDestroy_v2"));
        if !crate::oldest() {
            assert!(fake_faults_injected() > 0, "cuGetProcAddress was asked, and failed");
        }
        drop((buf, s));
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(fake_report().live_allocations, 0);
    });
}

// ------------------------------------------------------------------------------------------------
// Loading and initialising
// ------------------------------------------------------------------------------------------------

/// Checked and sound: a library whose `cuDriverGetVersion` fails is no driver: the attempt says
/// why, with the library's own name of the code; the failure is kept.
#[test]
fn a_library_whose_version_query_fails_is_refused_with_its_reason() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuDriverGetVersion:1+:999")], || {
        let err = Device::count().unwrap_err();
        let Error::DriverNotFound { attempts } = &err else { panic!("expected DriverNotFound, got {err:?}") };
        assert_eq!(attempts.len(), 1);
        assert!(
            attempts[0].reason.contains("cuDriverGetVersion failed: CUDA_ERROR_UNKNOWN (999)"),
            "{}",
            attempts[0].reason
        );
        assert_eq!(cudrv::driver_version().unwrap_err(), err, "kept");
        assert!(Driver::loaded().is_none());
    });
}

/// Checked and sound: a failed `cuInit` is a typed error, kept for every later call; nothing
/// panics, and the loaded library still describes codes.
#[test]
fn a_failed_cu_init_is_kept_and_typed() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuInit:1:100")], || {
        let err = Device::count().unwrap_err();
        match &err {
            Error::Driver { call: "cuInit", code: CUresult::CUDA_ERROR_NO_DEVICE, name, .. } => {
                assert_eq!(name, "CUDA_ERROR_NO_DEVICE")
            }
            other => panic!("expected cuInit's NO_DEVICE, got {other:?}"),
        }
        // Kept, though the fault was injected once: the driver is not asked again.
        assert_eq!(Device::get(0).unwrap_err(), err);
        assert_eq!(fake_faults_injected(), 1);
        // The library itself loaded.
        assert_eq!(cudrv::driver_version().unwrap(), cudrv_test_support::fake_driver_version());
    });
}

/// Checked and sound: a `CUDRV_DRIVER_PATH` naming a directory, or a path with a NUL-free but odd
/// name, is one failed attempt with the OS's reason, not a panic.
#[test]
fn driver_path_to_a_directory_is_a_typed_error() {
    let dir = std::env::temp_dir().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &dir)], || {
        let err = Device::count().unwrap_err();
        let Error::DriverNotFound { attempts } = &err else { panic!("expected DriverNotFound, got {err:?}") };
        assert_eq!(attempts.len(), 1);
        assert!(!attempts[0].reason.is_empty());
    });
}

// ------------------------------------------------------------------------------------------------
// Driver shutdown
// ------------------------------------------------------------------------------------------------

static HOOK_CALLS: AtomicUsize = AtomicUsize::new(0);

fn count_hook(e: &Error) {
    eprintln!("drop error: {e}");
    HOOK_CALLS.fetch_add(1, Ordering::SeqCst);
}

/// Checked and sound: after the driver shut down (`CUDA_ERROR_DEINITIALIZED`), the drops of
/// contexts (the primary context's release), streams, events and buffers, on this thread, on
/// another thread and in a host function queued before the shutdown, report nothing to the hook,
/// keep nothing, and do not hang.
#[test]
fn drops_after_a_shutdown_report_nothing_anywhere() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "100000")], || {
        assert!(cudrv::set_drop_error_hook(count_hook));
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let t = Stream::new(&dev).unwrap();
        t.wait_stream(&s).unwrap(); // a spare event on the context
        let ev = Event::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[1u8, 2, 3], &s).unwrap();
        let other = DeviceBuffer::from_slice(&[4u8; 64], &t).unwrap();
        let ctx = dev.primary_context().unwrap();
        let in_host_fn = DeviceBuffer::from_slice(&[5u8; 16], &s).unwrap();
        // Queued behind the delay: runs after the shutdown.
        s.launch_host_fn(move || drop(in_host_fn)).unwrap();
        fake_shutdown();
        within(Duration::from_secs(20), "drops after a shutdown", move || {
            assert!(s.synchronize().unwrap_err().is_deinitialized());
            assert!(ctx.synchronize().unwrap_err().is_deinitialized());
            std::thread::spawn(move || drop((other, t))).join().unwrap();
            drop((buf, ev, s));
            let _ = cudrv::flush_deferred_drops();
            assert!(ctx.take_deferred().is_ok());
            drop(ctx);
            let _ = cudrv::flush_deferred_drops();
        });
        assert_eq!(HOOK_CALLS.load(Ordering::SeqCst), 0, "a shut-down driver is not a drop failure");
    });
}

// ------------------------------------------------------------------------------------------------
// Primary contexts and binding
// ------------------------------------------------------------------------------------------------

/// Whether `dev`'s primary context is active (retained by someone).
fn primary_active(dev: cudrv::sys::CUdevice) -> bool {
    let d = Driver::global().unwrap();
    let (mut flags, mut active) = (0, 0);
    // SAFETY: valid out-pointers; a device handle from cuDeviceGet.
    assert_eq!(unsafe { d.cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) }, OK);
    active != 0
}

/// Checked and sound: a failed `cuDevicePrimaryCtxRetain` retains nothing and caches nothing (the
/// next call retains); every retain is released once, whatever failed in between, so that the
/// primary context ends inactive; a failed bind in between leaves the counts alone.
#[test]
fn primary_context_retains_and_releases_balance_on_error_paths() {
    let env = [("CUDRV_FAKE_FAIL", "cuDevicePrimaryCtxRetain:1:2,cuCtxSetCurrent:2:999")];
    run_with_fake(&env, || {
        let dev = Device::get(0).unwrap();
        let raw = dev.as_raw();
        let err = dev.primary_context().unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY), "{err:?}");
        assert!(!primary_active(raw), "a failed retain retained nothing");
        let ctx = dev.primary_context().unwrap();
        assert!(Arc::ptr_eq(&ctx, &dev.primary_context().unwrap()), "one Context per device");
        // The first cuCtxSetCurrent binds this thread; the second, on a new thread, fails.
        ctx.synchronize().unwrap();
        let c = ctx.clone();
        let failed = std::thread::spawn(move || c.synchronize()).join().unwrap();
        assert_eq!(failed.unwrap_err().code(), Some(CUresult::CUDA_ERROR_UNKNOWN));
        assert_eq!(fake_faults_injected(), 2);
        let s = Stream::new(&dev).unwrap();
        drop(ctx);
        assert!(primary_active(raw), "the stream holds the context");
        drop(s);
        cudrv::flush_deferred_drops().unwrap();
        assert!(!primary_active(raw), "every retain was released");
        // And a new Context retains it again.
        let ctx = dev.primary_context().unwrap();
        assert!(primary_active(raw));
        drop(ctx);
        assert!(!primary_active(raw));
    });
}

/// Checked and sound: on a thread whose current context is another device's (made current by
/// other code), cudrv's work on a device binds that device's context for the call and makes the
/// other one current again afterwards; a drop does the same.
#[test]
fn binding_restores_the_context_the_thread_had() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "2")], || {
        let d = Driver::global().unwrap();
        let (dev0, dev1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
        let ctx1 = dev1.primary_context().unwrap();
        // SAFETY: a retained primary context, alive while `ctx1` is.
        assert_eq!(unsafe { d.cuCtxSetCurrent(ctx1.as_raw()) }, OK);
        let current = || {
            let mut c = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { d.cuCtxGetCurrent(&mut c) }, OK);
            c
        };
        let s = Stream::new(&dev0).unwrap();
        let buf = DeviceBuffer::from_slice(&[1u32, 2], &s).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [1, 2]);
        assert_eq!(current(), ctx1.as_raw(), "the thread's own context is current again");
        drop((buf, s));
        assert_eq!(current(), ctx1.as_raw(), "after the drops too");
        let ctx0 = dev0.primary_context().unwrap();
        {
            let _b = ctx0.bind().unwrap();
            assert_eq!(current(), ctx0.as_raw());
            {
                let _again = ctx0.bind().unwrap();
                assert_eq!(current(), ctx0.as_raw());
            }
            assert_eq!(current(), ctx0.as_raw(), "a nested bind of the same context restores nothing");
        }
        assert_eq!(current(), ctx1.as_raw());
    });
}

// ------------------------------------------------------------------------------------------------
// Context::synchronize during a capture
// ------------------------------------------------------------------------------------------------

/// DEFECT (failed before the fix: `Context::synchronize` returned the driver's 900, and the
/// capture was invalidated, so that `end_capture` failed with 901). `cuCtxSynchronize` while a
/// stream of the context captures (in any mode) is refused by the driver, which invalidates the
/// capture: a thread that synchronised the device's context (a `Context` is `Sync`, and every
/// stream hands its own out) broke another thread's capture, as `Stream::query` did before review
/// 23a. `Context::synchronize` now refuses with `Error::Capturing` while a stream of the context
/// takes part in a capture that cudrv tracks, and the capture goes on.
#[test]
fn synchronizing_a_context_during_a_capture_is_refused_and_leaves_the_capture_intact() {
    use cudrv::graph::CaptureMode;
    for mode in [CaptureMode::Relaxed, CaptureMode::ThreadLocal, CaptureMode::Global] {
        run_with_fake(&[], || {
            let dev = Device::get(0).unwrap();
            let s = Stream::new(&dev).unwrap();
            let mut buf = DeviceBuffer::<u32>::zeroed(64, &s).unwrap();
            s.synchronize().unwrap();
            s.begin_capture(mode).unwrap();
            buf.fill(9).unwrap();
            let ctx = s.context().clone();
            let synced = std::thread::spawn(move || ctx.synchronize()).join().unwrap();
            assert!(matches!(synced, Err(Error::Capturing { .. })), "{mode:?}: {synced:?}");
            let graph = s.end_capture().expect("a context synchronisation invalidated the capture");
            let exec = graph.instantiate().unwrap();
            exec.launch(&s).unwrap();
            s.context().synchronize().unwrap();
            assert_eq!(buf.to_vec().unwrap(), vec![9; 64]);
        });
    }
}

/// Captures on another device's context leave `Context::synchronize` alone, and it leaves them
/// alone: it is not refused, and from a thread in the global capture mode (the default) it does
/// not invalidate another thread's global-mode capture, which the driver would do to a plain
/// `cuCtxSynchronize`. (Review 24c's first fix refused it during any capture; the driver's
/// refusal of the synchronisation itself invalidated the capture before either fix.)
#[test]
fn synchronizing_a_context_leaves_a_capture_on_another_device_alone() {
    use cudrv::graph::CaptureMode;
    for mode in [CaptureMode::Relaxed, CaptureMode::ThreadLocal, CaptureMode::Global] {
        run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux")], || {
            let (dev0, dev1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
            let (s0, s1) = (Stream::new(&dev0).unwrap(), Stream::new(&dev1).unwrap());
            let mut buf = DeviceBuffer::<u32>::zeroed(64, &s1).unwrap();
            let mut other = DeviceBuffer::<u32>::zeroed(64, &s0).unwrap();
            s1.synchronize().unwrap();
            s1.begin_capture(mode).unwrap();
            buf.fill(9).unwrap();
            other.fill(5).unwrap();
            let ctx = s0.context().clone();
            let synced = std::thread::spawn(move || ctx.synchronize()).join().unwrap();
            assert!(synced.is_ok(), "{mode:?}: {synced:?}");
            assert_eq!(other.to_vec().unwrap(), vec![5; 64]);
            let graph = s1.end_capture().expect("a context synchronisation invalidated the capture");
            graph.instantiate().unwrap().launch(&s1).unwrap();
            assert_eq!(buf.to_vec().unwrap(), vec![9; 64]);
        });
    }
}

// ------------------------------------------------------------------------------------------------
// Process exit
// ------------------------------------------------------------------------------------------------

thread_local! {
    /// Objects that live until the test's thread exits, after the driver has shut down.
    static AT_THREAD_EXIT: std::cell::RefCell<Option<(Stream, DeviceBuffer<u32>, Event)>> =
        const { std::cell::RefCell::new(None) };
}

/// A stream and a buffer with work queued on it.
type Busy = (Stream, DeviceBuffer<u8>);

/// Objects that are never dropped (the process exits under them).
static FOREVER: std::sync::OnceLock<std::sync::Mutex<Vec<Busy>>> = std::sync::OnceLock::new();

/// Checked and sound: objects kept in a static (never dropped) with work still queued, and objects
/// in a thread-local dropped when the test's thread exits after the driver shut down, let the
/// process exit normally, and print no drop error.
#[test]
fn the_process_exits_cleanly_with_live_objects_and_late_drops() {
    let out = cudrv_test_support::run_with_fake_output(&[("CUDRV_FAKE_DELAY_US", "50000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut kept = DeviceBuffer::<u8>::zeroed(1 << 12, &s).unwrap();
        kept.fill(3).unwrap(); // still queued at exit
        FOREVER.get_or_init(Default::default).lock().unwrap().push((s.clone(), kept));
        let t = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[1u32, 2, 3], &t).unwrap();
        let ev = Event::new(&dev).unwrap();
        ev.record(&t).unwrap();
        AT_THREAD_EXIT.with(|slot| *slot.borrow_mut() = Some((t, buf, ev)));
        fake_shutdown();
    });
    if let Some(out) = out {
        assert!(!out.stderr.contains("error in drop"), "{}", out.stderr);
    }
}

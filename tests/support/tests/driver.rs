//! Tests of the fake CUDA driver itself, through hand-declared function types (not through cudrv).
//! Every test body runs in a child process (`run_with_fake`) that loads the fake: the default one
//! (`CUDRV_TEST_DRIVER` chooses), or the full one (`full_fake_driver`) for tests of entry points
//! newer than CUDA 11.1.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::ptr::null_mut;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudrv_test_support::*;

type R = c_int;
type Ptr = u64;
type H = *mut c_void;

const NOT_READY: R = 600;
const NOT_SUPPORTED: R = 801;

/// `CUhostFn` (`CUDA_CB` is `__stdcall`, as `"system"` is on 32-bit Windows).
type HostFn = unsafe extern "system" fn(*mut c_void);

/// Looks a function up in the fake loaded in this process.
macro_rules! f {
    ($name:literal : $t:ty) => {{
        // SAFETY: the type is the exact C signature of the named export (from cuda.h).
        let s =
            unsafe { fake_library().get::<$t>($name.as_bytes()) }.unwrap_or_else(|e| panic!("missing {}: {e}", $name));
        *s
    }};
}

/// The driver functions these tests use.
struct Cu {
    init: unsafe extern "system" fn(c_uint) -> R,
    driver_version: unsafe extern "system" fn(*mut c_int) -> R,
    device_get: unsafe extern "system" fn(*mut c_int, c_int) -> R,
    device_count: unsafe extern "system" fn(*mut c_int) -> R,
    device_name: unsafe extern "system" fn(*mut c_char, c_int, c_int) -> R,
    pci_bus_id: unsafe extern "system" fn(*mut c_char, c_int, c_int) -> R,
    attr: unsafe extern "system" fn(*mut c_int, c_int, c_int) -> R,
    retain: unsafe extern "system" fn(*mut H, c_int) -> R,
    release: unsafe extern "system" fn(c_int) -> R,
    set_current: unsafe extern "system" fn(H) -> R,
    get_current: unsafe extern "system" fn(*mut H) -> R,
    ctx_sync: unsafe extern "system" fn() -> R,
    stream_create: unsafe extern "system" fn(*mut H, c_uint) -> R,
    stream_destroy: unsafe extern "system" fn(H) -> R,
    stream_sync: unsafe extern "system" fn(H) -> R,
    stream_query: unsafe extern "system" fn(H) -> R,
    stream_wait_event: unsafe extern "system" fn(H, H, c_uint) -> R,
    event_create: unsafe extern "system" fn(*mut H, c_uint) -> R,
    event_destroy: unsafe extern "system" fn(H) -> R,
    event_record: unsafe extern "system" fn(H, H) -> R,
    event_query: unsafe extern "system" fn(H) -> R,
    event_elapsed: unsafe extern "system" fn(*mut f32, H, H) -> R,
    mem_alloc: unsafe extern "system" fn(*mut Ptr, usize) -> R,
    mem_free: unsafe extern "system" fn(Ptr) -> R,
    memset_d32_async: unsafe extern "system" fn(Ptr, c_uint, usize, H) -> R,
    htod: unsafe extern "system" fn(Ptr, *const c_void, usize) -> R,
    dtoh: unsafe extern "system" fn(*mut c_void, Ptr, usize) -> R,
    dtoh_async: unsafe extern "system" fn(*mut c_void, Ptr, usize, H) -> R,
    htod_async: unsafe extern "system" fn(Ptr, *const c_void, usize, H) -> R,
    dtod_async: unsafe extern "system" fn(Ptr, Ptr, usize, H) -> R,
    launch_host_func: unsafe extern "system" fn(H, HostFn, *mut c_void) -> R,
}

impl Cu {
    fn load() -> Cu {
        Cu {
            init: f!("cuInit": unsafe extern "system" fn(c_uint) -> R),
            driver_version: f!("cuDriverGetVersion": unsafe extern "system" fn(*mut c_int) -> R),
            device_get: f!("cuDeviceGet": unsafe extern "system" fn(*mut c_int, c_int) -> R),
            device_count: f!("cuDeviceGetCount": unsafe extern "system" fn(*mut c_int) -> R),
            device_name: f!("cuDeviceGetName": unsafe extern "system" fn(*mut c_char, c_int, c_int) -> R),
            pci_bus_id: f!("cuDeviceGetPCIBusId": unsafe extern "system" fn(*mut c_char, c_int, c_int) -> R),
            attr: f!("cuDeviceGetAttribute": unsafe extern "system" fn(*mut c_int, c_int, c_int) -> R),
            retain: f!("cuDevicePrimaryCtxRetain": unsafe extern "system" fn(*mut H, c_int) -> R),
            release: f!("cuDevicePrimaryCtxRelease_v2": unsafe extern "system" fn(c_int) -> R),
            set_current: f!("cuCtxSetCurrent": unsafe extern "system" fn(H) -> R),
            get_current: f!("cuCtxGetCurrent": unsafe extern "system" fn(*mut H) -> R),
            ctx_sync: f!("cuCtxSynchronize": unsafe extern "system" fn() -> R),
            stream_create: f!("cuStreamCreate": unsafe extern "system" fn(*mut H, c_uint) -> R),
            stream_destroy: f!("cuStreamDestroy_v2": unsafe extern "system" fn(H) -> R),
            stream_sync: f!("cuStreamSynchronize": unsafe extern "system" fn(H) -> R),
            stream_query: f!("cuStreamQuery": unsafe extern "system" fn(H) -> R),
            stream_wait_event: f!("cuStreamWaitEvent": unsafe extern "system" fn(H, H, c_uint) -> R),
            event_create: f!("cuEventCreate": unsafe extern "system" fn(*mut H, c_uint) -> R),
            event_destroy: f!("cuEventDestroy_v2": unsafe extern "system" fn(H) -> R),
            event_record: f!("cuEventRecord": unsafe extern "system" fn(H, H) -> R),
            event_query: f!("cuEventQuery": unsafe extern "system" fn(H) -> R),
            event_elapsed: f!("cuEventElapsedTime": unsafe extern "system" fn(*mut f32, H, H) -> R),
            mem_alloc: f!("cuMemAlloc_v2": unsafe extern "system" fn(*mut Ptr, usize) -> R),
            mem_free: f!("cuMemFree_v2": unsafe extern "system" fn(Ptr) -> R),
            memset_d32_async: f!("cuMemsetD32Async": unsafe extern "system" fn(Ptr, c_uint, usize, H) -> R),
            htod: f!("cuMemcpyHtoD_v2": unsafe extern "system" fn(Ptr, *const c_void, usize) -> R),
            dtoh: f!("cuMemcpyDtoH_v2": unsafe extern "system" fn(*mut c_void, Ptr, usize) -> R),
            dtoh_async: f!("cuMemcpyDtoHAsync_v2": unsafe extern "system" fn(*mut c_void, Ptr, usize, H) -> R),
            htod_async: f!("cuMemcpyHtoDAsync_v2": unsafe extern "system" fn(Ptr, *const c_void, usize, H) -> R),
            dtod_async: f!("cuMemcpyDtoDAsync_v2": unsafe extern "system" fn(Ptr, Ptr, usize, H) -> R),
            launch_host_func: f!("cuLaunchHostFunc": unsafe extern "system" fn(H, HostFn, *mut c_void) -> R),
        }
    }

    /// cuInit + retain device `dev`'s primary context and make it current.
    fn setup(dev: c_int) -> Cu {
        let cu = Cu::load();
        let mut ctx = null_mut();
        // SAFETY (here and in the rest of this file): the arguments follow the documented driver
        // API contracts; out-pointers point at live locals.
        unsafe {
            ok((cu.init)(0));
            ok((cu.retain)(&mut ctx, dev));
            ok((cu.set_current)(ctx));
        }
        cu
    }

    fn alloc(&self, n: usize) -> Ptr {
        let mut p = 0;
        // SAFETY: see `setup`.
        unsafe { ok((self.mem_alloc)(&mut p, n)) };
        p
    }

    fn read_u32(&self, p: Ptr, n: usize) -> Vec<u32> {
        let mut v = vec![0u32; n];
        // SAFETY: see `setup`; `v` holds n * 4 bytes.
        unsafe { ok((self.dtoh)(v.as_mut_ptr().cast(), p, n * 4)) };
        v
    }

    /// [`Cu::read_u32`] through `stream`, not through the legacy stream (which `cuMemcpyDtoH` uses,
    /// and which waits for every blocking stream): to pageable memory, the copy is synchronous.
    fn read_u32_on(&self, p: Ptr, n: usize, stream: H) -> Vec<u32> {
        let mut v = vec![0u32; n];
        // SAFETY: see `setup`; `v` holds n * 4 bytes.
        unsafe { ok((self.dtoh_async)(v.as_mut_ptr().cast(), p, n * 4, stream)) };
        v
    }

    fn stream(&self) -> H {
        let mut s = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.stream_create)(&mut s, 0)) };
        s
    }
}

// ---- holding a stream ---------------------------------------------------------------------------

/// How long a held host function waits for [`Gate::open`] before it lets its stream go by itself.
/// A safety net only, never part of a passing run: a call that waits for a held stream (made by
/// the test before it opens the gate: a bug of the fake, or of the test) would otherwise hang the
/// test instead of failing it. [`Gate::open`] fails when it fired, and [`Gate::is_open`] tells.
const GATE_SAFETY_NET: Duration = Duration::from_secs(60);

/// A [`Gate`]'s state: whether it is open, and whether the safety net opened it.
#[derive(Default)]
struct GateFlags {
    open: bool,
    timed_out: bool,
}

/// What a [`Gate`]'s host functions wait on.
type GateState = (Mutex<GateFlags>, Condvar);

/// A host function (`cuLaunchHostFunc`) that holds the stream it is queued on until the test opens
/// the gate. Work queued behind it has certainly not run while the gate is closed, however the
/// threads are scheduled: the tests assert "not ready" there instead of betting that a delay
/// (CUDRV_FAKE_DELAY_US, a spinning kernel) outlasts the test thread's next few calls.
///
/// Dropping the gate opens it, so a failed assertion (a panic) cannot leave a stream held, and the
/// test hung on it.
struct Gate(Arc<GateState>);

impl Gate {
    fn new() -> Gate {
        Gate(Arc::default())
    }

    /// Queues a host function on `stream` that waits until the gate is open.
    fn hold(&self, cu: &Cu, stream: H) {
        let data = Arc::into_raw(Arc::clone(&self.0)).cast_mut().cast::<c_void>();
        // SAFETY: see `Cu::setup`; `gate_host_fn` has the `CUhostFn` signature, and `data` is one
        // reference to the gate's state, which the host function takes back when it runs.
        let r = unsafe { (cu.launch_host_func)(stream, gate_host_fn, data) };
        if r != 0 {
            // SAFETY: not queued, so the host function will not run: the reference is still ours
            // (from `Arc::into_raw` above), taken back once.
            drop(unsafe { Arc::from_raw(data.cast_const().cast::<GateState>()) });
        }
        ok(r);
    }

    /// Lets every host function of this gate return (and any queued later return at once). Fails
    /// if the [`GATE_SAFETY_NET`] had to open it: something waited for the held stream.
    #[track_caller]
    fn open(&self) {
        let timed_out = self.release();
        assert!(
            !timed_out,
            "a held stream was let go by the safety net after {GATE_SAFETY_NET:?}: a call waited for it"
        );
    }

    /// Opens the gate; returns whether the safety net had opened it already.
    fn release(&self) -> bool {
        let (flags, cv) = &*self.0;
        let mut flags = flags.lock().unwrap_or_else(PoisonError::into_inner);
        flags.open = true;
        cv.notify_all();
        flags.timed_out
    }

    /// Whether the gate is open: by [`Gate::open`], or by the [`GATE_SAFETY_NET`].
    fn is_open(&self) -> bool {
        self.0.0.lock().unwrap_or_else(PoisonError::into_inner).open
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.release();
    }
}

/// The host function of [`Gate::hold`]: waits until the gate is open (or the safety net fires,
/// which opens it for good). It calls no driver function (the driver forbids that) and cannot
/// panic (a poisoned lock is still used).
unsafe extern "system" fn gate_host_fn(data: *mut c_void) {
    // SAFETY: `data` is the reference to the gate's state that `Gate::hold` made with
    // `Arc::into_raw` for this one call; it is taken back here once, and dropped on return.
    let state = unsafe { Arc::from_raw(data.cast_const().cast::<GateState>()) };
    let (flags, cv) = &*state;
    let flags = flags.lock().unwrap_or_else(PoisonError::into_inner);
    let (mut flags, wait) =
        cv.wait_timeout_while(flags, GATE_SAFETY_NET, |f| !f.open).unwrap_or_else(PoisonError::into_inner);
    if wait.timed_out() {
        flags.open = true;
        flags.timed_out = true;
        cv.notify_all();
    }
}

#[track_caller]
fn ok(r: R) {
    assert_eq!(r, 0, "driver call failed with {r}");
}

fn attr(cu: &Cu, a: c_int, dev: c_int) -> c_int {
    let mut v = -7;
    // SAFETY: see `Cu::setup`.
    unsafe { ok((cu.attr)(&mut v, a, dev)) };
    v
}

#[test]
fn not_initialized_then_deinitialized() {
    run_with_fake(&[], || {
        let cu = Cu::load();
        let mut n = 0;
        // SAFETY: see `Cu::setup`.
        unsafe {
            assert_eq!((cu.device_count)(&mut n), 3);
            ok((cu.driver_version)(&mut n));
            assert_eq!(n, fake_driver_version());
            ok((cu.init)(0));
            ok((cu.device_count)(&mut n));
            assert_eq!(n, 1);
            fake_shutdown();
            assert_eq!((cu.device_count)(&mut n), 4);
        }
    });
}

/// (1) Work on a delayed stream really runs after the call returned: queued behind a held host
/// function, it has not run (the stream is not ready, the memory is untouched) until the stream goes
/// on, and then it waits CUDRV_FAKE_DELAY_US.
#[test]
fn stream_runs_asynchronously() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "200000")], || {
        let cu = Cu::setup(0);
        let p = cu.alloc(4096);
        let (s, other) = (cu.stream(), cu.stream());
        let zeros = vec![0u32; 1024];
        // SAFETY: see `Cu::setup`; `zeros` holds 4096 bytes.
        unsafe { ok((cu.htod)(p, zeros.as_ptr().cast(), 4096)) };
        let gate = Gate::new();
        gate.hold(&cu, s);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.memset_d32_async)(p, 0xdead_beef, 1024, s));
            assert_eq!((cu.stream_query)(s), NOT_READY);
        }
        // Read on another stream: the legacy stream would wait for `s`.
        assert_eq!(cu.read_u32_on(p, 1024, other), zeros, "the memset ran before its stream went on");
        let opened = Instant::now();
        gate.open();
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_sync)(s));
            ok((cu.stream_query)(s));
        }
        // The delay itself: the memset slept CUDRV_FAKE_DELAY_US (200 ms) after the gate opened. A
        // lower bound, which load only lengthens, so it cannot fail spuriously; half the delay
        // leaves room for coarse sleep timers (Windows' Sleep counts in ticks).
        let waited = opened.elapsed();
        assert!(waited >= Duration::from_millis(100), "the memset ran {waited:?} after its stream went on");
        assert!(cu.read_u32(p, 1024).iter().all(|&x| x == 0xdead_beef));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_destroy)(s));
            ok((cu.stream_destroy)(other));
            ok((cu.mem_free)(p));
        }
        assert_no_leaks();
    });
}

/// (2) An injected fault appears exactly at the n-th call (base name matches the _v2 export), and
/// `n+` fails every call from the n-th on.
#[test]
fn fault_injection_hits_exactly_the_nth_call() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuMemAlloc:3:2")], || {
        let cu = Cu::setup(0);
        let mut results = Vec::new();
        let mut ptrs = Vec::new();
        for _ in 0..5 {
            let mut p = 0;
            // SAFETY: see `Cu::setup`.
            results.push(unsafe { (cu.mem_alloc)(&mut p, 256) });
            if p != 0 {
                ptrs.push(p);
            }
        }
        assert_eq!(results, [0, 0, 2, 0, 0]);
        for p in ptrs {
            // SAFETY: see `Cu::setup`.
            unsafe { ok((cu.mem_free)(p)) };
        }
        assert_no_leaks();
    });
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuStreamCreate:2+:801,cuInit:1:999")], || {
        let cu = Cu::load();
        // SAFETY: see `Cu::setup`.
        unsafe {
            assert_eq!((cu.init)(0), 999);
        }
        let cu = Cu::setup(0);
        let mut s = null_mut();
        // SAFETY: see `Cu::setup`.
        let r: Vec<R> = (0..4).map(|_| unsafe { (cu.stream_create)(&mut s, 0) }).collect();
        assert_eq!(r, [0, 801, 801, 801]);
    });
}

/// (3) A queued copy into memory freed before it ran is reported as a violation and skipped.
#[test]
fn use_after_free_through_queued_copy_is_reported() {
    run_with_fake(&[], || {
        let cu = Cu::setup(0);
        let p = cu.alloc(1 << 16);
        let s = cu.stream();
        let host = vec![7u8; 1 << 16];
        // The copy stays queued (behind the held host function) until the memory is freed.
        let gate = Gate::new();
        gate.hold(&cu, s);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.htod_async)(p, host.as_ptr().cast(), host.len(), s));
            ok((cu.mem_free)(p)); // frees at once: the copy is still queued
            assert_eq!((cu.stream_query)(s), NOT_READY);
        }
        gate.open();
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_sync)(s));
            ok((cu.stream_destroy)(s));
        }
        let report = fake_report();
        assert_eq!(report.violations.len(), 1, "{report}");
        let v = &report.violations[0];
        assert!(v.contains("cuMemcpyHtoDAsync_v2"), "{v}");
        assert!(v.contains(&format!("{p:#x}")), "{v}");
        assert!(v.contains("not inside a live allocation"), "{v}");
        fake_reset_violations();

        // Out of bounds is caught too.
        let q = cu.alloc(64);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.htod)(q + 32, host.as_ptr().cast(), 64)) };
        let report = fake_report();
        assert_eq!(report.violations.len(), 1, "{report}");
        assert!(report.violations[0].contains("overruns"), "{report}");
        fake_reset_violations();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.mem_free)(q)) };
        assert_no_leaks();
    });
}

type GetDefaultPool = unsafe extern "system" fn(*mut H, c_int) -> R;
type AllocAsync = unsafe extern "system" fn(*mut Ptr, usize, H) -> R;
type FreeAsync = unsafe extern "system" fn(Ptr, H) -> R;
type PoolAttr = unsafe extern "system" fn(H, c_int, *mut c_void) -> R;
type PoolTrim = unsafe extern "system" fn(H, usize) -> R;

const ATTR_TCC_DRIVER: c_int = 35;
const ATTR_CONCURRENT_MANAGED_ACCESS: c_int = 89;
const ATTR_MEMORY_POOLS_SUPPORTED: c_int = 115;
const ATTR_MEMPOOL_HANDLE_TYPES: c_int = 119;

/// (4) Per-mode attributes; tcc refuses every pool entry point with 801. (The pools are CUDA 11.2's:
/// on the full fake.)
#[test]
fn driver_modes() {
    run_with_fake_modes(&["linux", "wddm", "tcc"], &[full_fake_driver()], || {
        let mode = std::env::var("CUDRV_FAKE_MODE").unwrap();
        let cu = Cu::setup(0);
        let expect = match mode.as_str() {
            "linux" => [0, 1, 1, 1],
            "wddm" => [0, 0, 1, 6],
            _ => [1, 0, 0, 0],
        };
        let got = [
            attr(&cu, ATTR_TCC_DRIVER, 0),
            attr(&cu, ATTR_CONCURRENT_MANAGED_ACCESS, 0),
            attr(&cu, ATTR_MEMORY_POOLS_SUPPORTED, 0),
            attr(&cu, ATTR_MEMPOOL_HANDLE_TYPES, 0),
        ];
        assert_eq!(got, expect, "mode {mode}");
        assert_eq!(attr(&cu, 75, 0) * 10 + attr(&cu, 76, 0), 90);
        assert_eq!(attr(&cu, 16, 0), 132);
        assert_eq!(attr(&cu, 97, 0), 232448);

        let get_default: GetDefaultPool = f!("cuDeviceGetDefaultMemPool": GetDefaultPool);
        let get_pool: GetDefaultPool = f!("cuDeviceGetMemPool": GetDefaultPool);
        let alloc_async: AllocAsync = f!("cuMemAllocAsync": AllocAsync);
        let free_async: FreeAsync = f!("cuMemFreeAsync": FreeAsync);
        let set_attr: PoolAttr = f!("cuMemPoolSetAttribute": PoolAttr);
        let get_attr: PoolAttr = f!("cuMemPoolGetAttribute": PoolAttr);
        let trim: PoolTrim = f!("cuMemPoolTrimTo": PoolTrim);
        let create: unsafe extern "system" fn(*mut H, *const u8) -> R =
            f!("cuMemPoolCreate": unsafe extern "system" fn(*mut H, *const u8) -> R);
        let destroy: unsafe extern "system" fn(H) -> R = f!("cuMemPoolDestroy": unsafe extern "system" fn(H) -> R);
        let mut pool = null_mut();
        let mut p = 0;
        // CUmemPoolProps: allocType=PINNED, handleTypes=0, location={DEVICE, 0}; 88 bytes.
        let mut props = [0u8; 88];
        props[0] = 1;
        props[8] = 1;
        if mode == "tcc" {
            // SAFETY: see `Cu::setup`.
            unsafe {
                assert_eq!(get_default(&mut pool, 0), NOT_SUPPORTED);
                assert_eq!(get_pool(&mut pool, 0), NOT_SUPPORTED);
                assert_eq!(alloc_async(&mut p, 256, null_mut()), NOT_SUPPORTED);
                assert_eq!(free_async(0x7f00_0000_0000, null_mut()), NOT_SUPPORTED);
                assert_eq!(create(&mut pool, props.as_ptr()), NOT_SUPPORTED);
                assert_eq!(trim(null_mut(), 0), NOT_SUPPORTED);
                let mut v = 0u64;
                assert_eq!(get_attr(null_mut(), 4, (&mut v as *mut u64).cast()), NOT_SUPPORTED);
                assert_eq!(destroy(null_mut()), NOT_SUPPORTED);
            }
            return;
        }
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok(get_default(&mut pool, 0));
            let mut cur = null_mut();
            ok(get_pool(&mut cur, 0));
            assert_eq!(pool, cur);
            let s = cu.stream();
            ok(alloc_async(&mut p, 1000, s));
            ok((cu.memset_d32_async)(p, 5, 250, s));
            let (mut reserved, mut used) = (0u64, 0u64);
            ok(get_attr(pool, 5, (&mut reserved as *mut u64).cast()));
            ok(get_attr(pool, 7, (&mut used as *mut u64).cast()));
            assert_eq!((reserved, used), (1024, 1000));
            ok(free_async(p, s));
            assert_eq!(free_async(p, s), 1, "double free");
            ok((cu.stream_sync)(s)); // sync point: reserved > threshold 0 => released
            ok(get_attr(pool, 5, (&mut reserved as *mut u64).cast()));
            assert_eq!(reserved, 0);
            // A high threshold keeps the memory cached until trimmed.
            let mut threshold = u64::MAX;
            ok(set_attr(pool, 4, (&mut threshold as *mut u64).cast()));
            ok(alloc_async(&mut p, 4096, s));
            ok(free_async(p, s));
            ok((cu.stream_sync)(s));
            ok(get_attr(pool, 5, (&mut reserved as *mut u64).cast()));
            assert_eq!(reserved, 4096);
            let mut q = 0;
            ok(alloc_async(&mut q, 4000, s));
            assert_eq!(q, p, "cached block reused");
            ok(free_async(q, s));
            ok((cu.stream_sync)(s));
            ok(trim(pool, 0));
            ok(get_attr(pool, 5, (&mut reserved as *mut u64).cast()));
            assert_eq!(reserved, 0);
            let mut own = null_mut();
            ok(create(&mut own, props.as_ptr()));
            ok(destroy(own));
            assert_eq!(destroy(pool), 1, "the default pool cannot be destroyed");
            ok((cu.stream_destroy)(s));
        }
        assert_no_leaks();
    });
}

/// (4) Mixed devices: each device has its own mode (with pools: on the full fake).
#[test]
fn mixed_devices() {
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_DEVICES", "wddm,tcc")], || {
        let cu = Cu::setup(1);
        let mut n = 0;
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.device_count)(&mut n)) };
        assert_eq!(n, 2);
        assert_eq!(attr(&cu, ATTR_MEMORY_POOLS_SUPPORTED, 0), 1);
        assert_eq!(attr(&cu, ATTR_MEMORY_POOLS_SUPPORTED, 1), 0);
        assert_eq!(attr(&cu, ATTR_TCC_DRIVER, 0), 0);
        assert_eq!(attr(&cu, ATTR_TCC_DRIVER, 1), 1);
        assert_ne!(attr(&cu, 33, 0), attr(&cu, 33, 1), "PCI bus ids differ");
        let name = |d| {
            let mut buf = [0 as c_char; 64];
            // SAFETY: see `Cu::setup`.
            unsafe {
                ok((cu.device_name)(buf.as_mut_ptr(), 64, d));
                CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
            }
        };
        assert_eq!(name(0), "Fake NVIDIA H200 (wddm)");
        assert_eq!(name(1), "Fake NVIDIA H200 (tcc)");
        let mut bus = [0 as c_char; 32];
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.pci_bus_id)(bus.as_mut_ptr(), 32, 1));
            assert_eq!(CStr::from_ptr(bus.as_ptr()).to_str().unwrap(), "0000:29:00.0");
            let mut d = 0;
            assert_eq!((cu.device_get)(&mut d, 2), 101);
        }
        let get_default: GetDefaultPool = f!("cuDeviceGetDefaultMemPool": GetDefaultPool);
        let alloc_async: AllocAsync = f!("cuMemAllocAsync": AllocAsync);
        let mut pool = null_mut();
        let mut p = 0;
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok(get_default(&mut pool, 0));
            assert_eq!(get_default(&mut pool, 1), NOT_SUPPORTED);
            // current context is device 1 (tcc)
            assert_eq!(alloc_async(&mut p, 64, null_mut()), NOT_SUPPORTED);
        }
    });
}

type GetProc = unsafe extern "system" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> R;

fn proc_address(name: &str, version: c_int) -> (R, *mut c_void, c_int) {
    let get: GetProc = f!("cuGetProcAddress_v2": GetProc);
    let name = CString::new(name).unwrap();
    let mut pfn = null_mut();
    let mut status = -1;
    // SAFETY: see `Cu::setup`.
    let r = unsafe { get(name.as_ptr(), &mut pfn, version, 0, &mut status) };
    (r, pfn, status)
}

fn export(name: &str) -> *mut c_void {
    // SAFETY: only the address of the symbol is read.
    *unsafe { fake_library().get::<*mut c_void>(name.as_bytes()) }.unwrap()
}

/// (5) cuGetProcAddress picks the variant by version (on the full fake); the legacy build lacks
/// newer exports.
#[test]
fn get_proc_address_versions() {
    run_with_fake(&[full_fake_driver()], || {
        // works before cuInit
        assert_eq!(proc_address("cuMemAlloc", 13000), (0, export("cuMemAlloc_v2"), 0));
        assert_eq!(proc_address("cuEventElapsedTime", 12000), (0, export("cuEventElapsedTime"), 0));
        assert_eq!(proc_address("cuEventElapsedTime", 13000), (0, export("cuEventElapsedTime_v2"), 0));
        assert_eq!(proc_address("cuGetProcAddress", 13000), (0, export("cuGetProcAddress_v2"), 0));
        assert_eq!(proc_address("cuGetProcAddress", 11080), (0, export("cuGetProcAddress"), 0));
        // As in cudaTypedefs.h: these base names get a new ABI at 13000 / 12050.
        assert_eq!(proc_address("cuCtxSynchronize", 13000).1, export("cuCtxSynchronize_v2"));
        assert_eq!(proc_address("cuCtxSynchronize", 12090).1, export("cuCtxSynchronize"));
        assert_eq!(proc_address("cuStreamGetCtx", 12050).1, export("cuStreamGetCtx_v2"));
        assert_eq!(proc_address("cuNoSuchFunction", 13000), (500, null_mut(), 1));
        assert_eq!(proc_address("cuMemAlloc_v2", 13000).0, 500, "base names only");
        assert_eq!(proc_address("cuMemAllocAsync", 11000), (500, null_mut(), 2));
        // The v1 entry point (no status argument) works too.
        let get1: unsafe extern "system" fn(*const c_char, *mut *mut c_void, c_int, u64) -> R =
            f!("cuGetProcAddress": unsafe extern "system" fn(*const c_char, *mut *mut c_void, c_int, u64) -> R);
        let mut pfn = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { ok(get1(c"cuStreamDestroy".as_ptr(), &mut pfn, 12000, 0)) };
        assert_eq!(pfn, export("cuStreamDestroy_v2"));
    });
    // An older driver does not serve newer variants.
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_DRIVER_VERSION", "12000")], || {
        let cu = Cu::load();
        let mut v = 0;
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.driver_version)(&mut v)) };
        assert_eq!(v, 12000);
        assert_eq!(proc_address("cuEventElapsedTime", 13000), (0, export("cuEventElapsedTime"), 0));
        assert_eq!(proc_address("cuCtxSynchronize", 13000), (0, export("cuCtxSynchronize"), 0));
        assert_eq!(proc_address("cuStreamGetCtx", 13000).1, export("cuStreamGetCtx"));
    });
    // The legacy (CUDA 11.1) build.
    let legacy = legacy_fake_driver_path();
    run_with_fake(&[("CUDRV_DRIVER_PATH", legacy.to_str().unwrap())], || {
        let lib = fake_library();
        for missing in [
            "cuGetProcAddress",
            "cuGetProcAddress_v2",
            "cuMemAllocAsync",
            "cuMemPoolCreate",
            "cuLaunchKernelEx",
            "cuEventElapsedTime_v2",
        ] {
            // SAFETY: only the presence of the symbol is checked.
            assert!(unsafe { lib.get::<*mut c_void>(missing.as_bytes()) }.is_err(), "{missing}");
        }
        let cu = Cu::setup(0); // fails if any of the older exports is missing
        let mut v = 0;
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.driver_version)(&mut v)) };
        assert_eq!(v, 11010);
        let p = cu.alloc(16);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.mem_free)(p)) };
    });
}

type LoadEx = unsafe extern "system" fn(*mut H, *const c_void, c_uint, *mut c_int, *mut *mut c_void) -> R;
type GetFunction = unsafe extern "system" fn(*mut H, H, *const c_char) -> R;
type Launch = unsafe extern "system" fn(
    H,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    H,
    *mut *mut c_void,
    *mut *mut c_void,
) -> R;

const PTX: &str = "//\n.version 8.4\n.target sm_90\n.address_size 64\n\n\
.visible .entry fill_u32(\n  .param .u64 out, .param .u32 v, .param .u64 n)\n{ ret; }\n\
.visible .entry add_f32(.param .u64 a, .param .u64 b, .param .u64 o, .param .u64 n)\n{ ret; }\n\
.entry fill_pattern_u8(.param .u64 o, .param .u64 n, .param .u64 s) { ret; }\n";

fn load_module(src: &[u8]) -> (R, H, String) {
    let load: LoadEx = f!("cuModuleLoadDataEx": LoadEx);
    let mut log = vec![0u8; 256];
    let mut opts = [5 as c_int, 6];
    let mut vals = [log.as_mut_ptr().cast::<c_void>(), std::ptr::without_provenance_mut::<c_void>(256)];
    let mut m = null_mut();
    // SAFETY: see `Cu::setup`; the log buffer is 256 bytes as declared.
    let r = unsafe { load(&mut m, src.as_ptr().cast(), 2, opts.as_mut_ptr(), vals.as_mut_ptr()) };
    let used = vals[1] as usize;
    let text = if used > 0 {
        assert_eq!(log[used - 1], 0, "written-back size includes the NUL");
        String::from_utf8_lossy(&log[..used - 1]).into_owned()
    } else {
        String::new()
    };
    (r, m, text)
}

/// (6) Built-in kernels compute the right data; bad modules fail with a log.
#[test]
fn kernels_and_modules() {
    run_with_fake(&[], || {
        let cu = Cu::setup(0);
        let get_function: GetFunction = f!("cuModuleGetFunction": GetFunction);
        let launch: Launch = f!("cuLaunchKernel": Launch);
        let unload: unsafe extern "system" fn(H) -> R = f!("cuModuleUnload": unsafe extern "system" fn(H) -> R);
        let mut src = PTX.as_bytes().to_vec();
        src.push(0);
        let (r, m, log) = load_module(&src);
        assert_eq!(r, 0, "{log}");
        let func = |name: &CStr| {
            let mut f = null_mut();
            // SAFETY: see `Cu::setup`.
            unsafe { ok(get_function(&mut f, m, name.as_ptr())) };
            f
        };
        let (fill, add, pattern) = (func(c"fill_u32"), func(c"add_f32"), func(c"fill_pattern_u8"));
        let mut f = null_mut();
        // SAFETY: see `Cu::setup`.
        assert_eq!(unsafe { get_function(&mut f, m, c"empty".as_ptr()) }, 500);

        let n: u64 = 1000;
        let (a, b, out) = (cu.alloc(4000), cu.alloc(4000), cu.alloc(4000));
        let s = cu.stream();
        let run_fill = |ptr: Ptr, value: f32| {
            let (mut ptr, mut value, mut n) = (ptr, value.to_bits(), n);
            let mut params =
                [(&mut ptr as *mut Ptr).cast::<c_void>(), (&mut value as *mut u32).cast(), (&mut n as *mut u64).cast()];
            // SAFETY: see `Cu::setup`; params point at values of the kernel's parameter types.
            unsafe { ok(launch(fill, 4, 1, 1, 256, 1, 1, 0, s, params.as_mut_ptr(), null_mut())) };
        };
        run_fill(a, 1.5);
        run_fill(b, 2.25);
        // add_f32 through the `extra` buffer.
        #[repr(C)]
        struct AddArgs {
            a: Ptr,
            b: Ptr,
            out: Ptr,
            n: u64,
        }
        let mut args = AddArgs { a, b, out, n };
        let mut size = std::mem::size_of::<AddArgs>();
        let mut extra = [
            std::ptr::without_provenance_mut::<c_void>(1),
            (&mut args as *mut AddArgs).cast(),
            std::ptr::without_provenance_mut::<c_void>(2),
            (&mut size as *mut usize).cast(),
            null_mut(),
        ];
        // SAFETY: see `Cu::setup`; `extra` follows the CU_LAUNCH_PARAM_* protocol.
        unsafe {
            ok(launch(add, 4, 1, 1, 256, 1, 1, 0, s, null_mut(), extra.as_mut_ptr()));
            ok((cu.stream_sync)(s));
        }
        assert!(cu.read_u32(out, 1000).iter().all(|&x| f32::from_bits(x) == 3.75));

        let (mut o, mut len, mut seed) = (out, 4000u64, 42u64);
        let mut params =
            [(&mut o as *mut Ptr).cast::<c_void>(), (&mut len as *mut u64).cast(), (&mut seed as *mut u64).cast()];
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok(launch(pattern, 1, 1, 1, 32, 1, 1, 0, s, params.as_mut_ptr(), null_mut()));
            // block too large
            assert_eq!(launch(pattern, 1, 1, 1, 2048, 1, 1, 0, s, params.as_mut_ptr(), null_mut()), 1);
            ok((cu.stream_sync)(s));
        }
        let mut bytes = vec![0u8; 4000];
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.dtoh)(bytes.as_mut_ptr().cast(), out, 4000)) };
        assert!(bytes.iter().enumerate().all(|(i, &x)| x == fill_pattern_u8(42, i as u64)));

        // Bad modules.
        let (r, _, log) = load_module(b"//\n.version 8.4\n.visible .entry foo(\n)\n{ ret; }\n\0");
        assert_eq!(r, 218);
        assert!(log.contains("line 3") && log.contains("unknown entry 'foo'"), "{log}");
        let (r, _, log) = load_module(b".version 8.4\n.fake_syntax_error\n.entry empty()\0");
        assert_eq!(r, 218);
        assert!(log.contains("line 2"), "{log}");
        let (r, _, log) = load_module(b"no entries here\0");
        assert_eq!(r, 218, "{log}");
        let (r, _, _) = load_module(b"\x7fELF\x02\x01\x01\0\0\0");
        assert_eq!(r, 209);

        // SAFETY: see `Cu::setup`.
        unsafe {
            ok(unload(m));
            ok((cu.stream_destroy)(s));
            for p in [a, b, out] {
                ok((cu.mem_free)(p));
            }
        }
        assert_no_leaks();
    });
}

/// (7) cuStreamWaitEvent orders a second stream after work on a first, delayed stream.
#[test]
fn event_wait_orders_streams() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "50000")], || {
        let cu = Cu::setup(0);
        let (src, dst) = (cu.alloc(4096), cu.alloc(4096));
        let (s1, s2) = (cu.stream(), cu.stream());
        let (mut start, mut done) = (null_mut(), null_mut());
        // s1 is held (before `start`, so that the held time is not in the elapsed time) until s2 has
        // queued its wait: `done` is certainly pending then, and the wait a real one.
        let gate = Gate::new();
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_create)(&mut start, 0));
            ok((cu.event_create)(&mut done, 0));
        }
        gate.hold(&cu, s1);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_record)(start, s1));
            ok((cu.memset_d32_async)(src, 1, 1024, s1));
            ok((cu.memset_d32_async)(src, 2, 1024, s1));
            ok((cu.memset_d32_async)(src, 3, 1024, s1));
            ok((cu.event_record)(done, s1));
            assert_eq!((cu.event_query)(done), NOT_READY);
            let mut ms = 0.0f32;
            assert_eq!((cu.event_elapsed)(&mut ms, start, done), NOT_READY);
            ok((cu.stream_wait_event)(s2, done, 0));
            ok((cu.dtod_async)(dst, src, 4096, s2));
            assert_eq!((cu.stream_query)(s2), NOT_READY, "s2 does not wait for `done`");
            gate.open();
            ok((cu.stream_sync)(s2));
            ok((cu.event_query)(done));
            ok((cu.event_elapsed)(&mut ms, start, done));
            // The delay itself: a lower bound, which load only lengthens (it cannot fail
            // spuriously); it leaves room for coarse sleep timers (Windows' Sleep counts in ticks).
            assert!(ms >= 100.0, "three delayed ops take at least 150 ms, got {ms}");
        }
        assert!(cu.read_u32(dst, 1024).iter().all(|&x| x == 3));
        // Without timing: INVALID_HANDLE.
        let mut nt = null_mut();
        let mut ms = 0.0f32;
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_create)(&mut nt, 2));
            ok((cu.event_record)(nt, s1));
            ok((cu.ctx_sync)());
            assert_eq!((cu.event_elapsed)(&mut ms, start, nt), 400);
            for e in [start, done, nt] {
                ok((cu.event_destroy)(e));
            }
            for s in [s1, s2] {
                ok((cu.stream_destroy)(s));
            }
            ok((cu.mem_free)(src));
            ok((cu.mem_free)(dst));
        }
        assert_no_leaks();
    });
}

/// (8) The report counts a leaked allocation, and assert_no_leaks names it.
#[test]
fn leak_report_counts_leaks() {
    run_with_fake(&[], || {
        let cu = Cu::setup(0);
        let p = cu.alloc(1000);
        let s = cu.stream();
        let report = fake_report();
        assert_eq!((report.live_allocations, report.live_bytes, report.live_streams), (1, 1000, 1));
        let err = std::panic::catch_unwind(assert_no_leaks).unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.contains("1 allocation(s) (1000 bytes), 1 stream(s)"), "{msg}");
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.mem_free)(p));
            ok((cu.stream_destroy)(s));
            ok((cu.release)(0));
        }
        assert_no_leaks();
    });
}

/// The runner reports a failing child with its output, and a second call in one test is its own child.
#[test]
fn runner_reports_child_failures() {
    run_with_fake(&[], || {});
    if in_fake_child() {
        run_with_fake(&[], || panic!("expected failure in child"));
        return;
    }
    let err = std::panic::catch_unwind(|| run_with_fake(&[], || panic!("expected failure in child"))).unwrap_err();
    let msg = err.downcast_ref::<String>().unwrap();
    assert!(msg.contains("expected failure in child"), "{msg}");
    assert!(msg.contains("CUDRV_FAKE_CHILD=runner_reports_child_failures#1"), "{msg}");
}

// ---- per-thread default streams ---------------------------------------------------------------

/// `CU_STREAM_LEGACY`.
fn legacy() -> H {
    std::ptr::without_provenance_mut(1)
}

/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
fn per_thread() -> H {
    std::ptr::without_provenance_mut(2)
}

const PTX_SPIN: &[u8] = b".version 8.4\n.target sm_90\n\
.visible .entry spin_fill_u32(.param .u64 o, .param .u32 v, .param .u64 n, .param .u64 us) { ret; }\n\0";

/// How long the tests' `spin_fill_u32` kernels spin: briefly. No check depends on it: what must
/// still be running when a test looks is held back by a [`Gate`] instead.
const SPIN_US: u64 = 1_000;

/// The built-in kernel `spin_fill_u32`, as addresses (to cross threads).
struct Kernels {
    launch: Launch,
    module: usize,
    spin_fill: usize,
}

impl Kernels {
    fn load() -> Kernels {
        let get_function: GetFunction = f!("cuModuleGetFunction": GetFunction);
        let (r, m, log) = load_module(PTX_SPIN);
        assert_eq!(r, 0, "{log}");
        let func = |name: &CStr| {
            let mut f = null_mut();
            // SAFETY: see `Cu::setup`.
            unsafe { ok(get_function(&mut f, m, name.as_ptr())) };
            f.expose_provenance()
        };
        Kernels {
            launch: f!("cuLaunchKernel": Launch),
            module: m.expose_provenance(),
            spin_fill: func(c"spin_fill_u32"),
        }
    }

    fn unload(self) {
        let unload: unsafe extern "system" fn(H) -> R = f!("cuModuleUnload": unsafe extern "system" fn(H) -> R);
        // SAFETY: see `Cu::setup`; the module is loaded.
        unsafe { ok(unload(std::ptr::with_exposed_provenance_mut(self.module))) };
    }

    /// `spin_fill_u32(out, value, n, spin_us)` on `stream`: sleeps `spin_us`, then fills.
    fn spin_fill(&self, out: Ptr, value: u32, n: u64, spin_us: u64, stream: H) {
        let (mut out, mut value, mut n, mut spin_us) = (out, value, n, spin_us);
        let mut params = [
            (&mut out as *mut Ptr).cast::<c_void>(),
            (&mut value as *mut u32).cast(),
            (&mut n as *mut u64).cast(),
            (&mut spin_us as *mut u64).cast(),
        ];
        let f = std::ptr::with_exposed_provenance_mut(self.spin_fill);
        // SAFETY: see `Cu::setup`; params point at values of the kernel's parameter types.
        unsafe { ok((self.launch)(f, 1, 1, 1, 32, 1, 1, 0, stream, params.as_mut_ptr(), null_mut())) };
    }
}

impl Cu {
    /// The current context, as an address (to cross threads).
    fn current(&self) -> usize {
        let mut ctx = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((self.get_current)(&mut ctx)) };
        ctx.expose_provenance()
    }

    /// Makes `ctx` (from [`Cu::current`]) current on the calling thread.
    fn enter(&self, ctx: usize) {
        // SAFETY: see `Cu::setup`; `ctx` is a live context handle.
        unsafe { ok((self.set_current)(std::ptr::with_exposed_provenance_mut(ctx))) };
    }
}

/// Every host thread has its own per-thread stream, with its own worker: a kernel held on thread
/// A's does not hold up thread B's, and synchronising B's waits for B's only. They never count as
/// live streams, and are released when their thread exits.
#[test]
fn per_thread_streams_of_two_threads_run_concurrently() {
    run_with_fake(&[], || {
        let cu = Cu::setup(0);
        let k = Kernels::load();
        let ctx = cu.current();
        let n = 1024u64;
        let (a, b) = (cu.alloc(4096), cu.alloc(4096));
        // Holds thread A's per-thread stream until thread B is done.
        let gate = Gate::new();
        // Channels, not barriers: a thread that fails drops its sender, and the other one's `recv`
        // fails instead of waiting for ever.
        let (queued_tx, queued_rx) = mpsc::channel::<()>();
        let (b_done_tx, b_done_rx) = mpsc::channel::<()>();
        // Joined explicitly: a scope's end does not wait for the threads' TLS destructors, which
        // release their per-thread streams, but a join does.
        std::thread::scope(|scope| {
            let thread_a = scope.spawn(|| {
                let (queued_tx, b_done_rx) = (queued_tx, b_done_rx); // moved in: dropped if A fails
                cu.enter(ctx);
                gate.hold(&cu, per_thread());
                k.spin_fill(a, 1, n, SPIN_US, per_thread());
                queued_tx.send(()).unwrap();
                b_done_rx.recv().expect("thread B failed");
                // B is done; A's kernel is still held.
                // SAFETY: see `Cu::setup`.
                unsafe { assert_eq!((cu.stream_query)(per_thread()), NOT_READY) };
                gate.open();
                // SAFETY: see `Cu::setup`.
                unsafe {
                    ok((cu.stream_sync)(per_thread()));
                    ok((cu.stream_query)(per_thread()));
                }
            });
            let thread_b = scope.spawn(|| {
                let (queued_rx, b_done_tx) = (queued_rx, b_done_tx); // moved in: dropped if B fails
                cu.enter(ctx);
                queued_rx.recv().expect("thread A failed");
                // SAFETY: see `Cu::setup`.
                unsafe {
                    ok((cu.memset_d32_async)(b, 7, n as usize, per_thread()));
                    ok((cu.stream_sync)(per_thread()));
                }
                // Certain, not timed: had B's stream waited for A's, its synchronisation would have
                // returned only when the gate opened (by the safety net: A opens it after B).
                assert!(!gate.is_open(), "thread B's per-thread stream waited for thread A's");
                // Not through the legacy stream (cuMemcpyDtoH), which would wait for thread A's
                // stream: a copy to pageable memory on B's per-thread stream is synchronous there.
                let got = cu.read_u32_on(b, n as usize, per_thread());
                assert!(got.iter().all(|&x| x == 7));
                assert_eq!(fake_per_thread_streams(), 2);
                b_done_tx.send(()).unwrap();
            });
            thread_a.join().unwrap();
            thread_b.join().unwrap();
        });
        assert!(cu.read_u32(a, n as usize).iter().all(|&x| x == 1));
        assert_eq!(fake_per_thread_streams(), 0, "both threads exited");
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.mem_free)(a));
            ok((cu.mem_free)(b));
        }
        k.unload();
        assert_no_leaks();
    });
}

/// Events recorded on `CU_STREAM_PER_THREAD` are recorded on the calling thread's stream, and
/// `cuStreamWaitEvent(CU_STREAM_PER_THREAD, ..)` makes the calling thread's stream wait.
#[test]
fn events_on_per_thread_streams_order_other_streams() {
    run_with_fake(&[], || {
        let cu = Cu::setup(0);
        let k = Kernels::load();
        let ctx = cu.current();
        let n = 1024u64;
        let (p, q) = (cu.alloc(4096), cu.alloc(4096));
        let (mut ev, mut ev2) = (null_mut(), null_mut());
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_create)(&mut ev, 0));
            ok((cu.event_create)(&mut ev2, 0));
        }
        let (ev_addr, ev2_addr) = (ev.expose_provenance(), ev2.expose_provenance());
        // Thread A: a held fill on its per-thread stream, and an event after it. It exits at once:
        // its stream is released, but the work and the event still complete.
        let gate_a = Gate::new();
        std::thread::scope(|scope| {
            let thread_a = scope.spawn(|| {
                cu.enter(ctx);
                gate_a.hold(&cu, per_thread());
                k.spin_fill(p, 5, n, SPIN_US, per_thread());
                let ev: H = std::ptr::with_exposed_provenance_mut(ev_addr);
                // SAFETY: see `Cu::setup`.
                unsafe {
                    ok((cu.event_record)(ev, per_thread()));
                    assert_eq!((cu.event_query)(ev), NOT_READY);
                }
            });
            thread_a.join().unwrap();
        });
        assert_eq!(fake_per_thread_streams(), 0, "thread A exited");
        let s = cu.stream();
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_wait_event)(s, ev, 0));
            ok((cu.dtod_async)(q, p, 4096, s));
            assert_eq!((cu.stream_query)(s), NOT_READY, "the stream does not wait for thread A's event");
        }
        gate_a.open();
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_sync)(s));
            ok((cu.event_query)(ev));
        }
        assert!(cu.read_u32(q, n as usize).iter().all(|&x| x == 5), "the copy ran before thread A's kernel");

        // The other way: an event on a user stream (held until thread C has queued its copy),
        // waited for by thread C's per-thread stream.
        let gate_s = Gate::new();
        gate_s.hold(&cu, s);
        k.spin_fill(p, 9, n, SPIN_US, s);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.event_record)(ev2, s)) };
        std::thread::scope(|scope| {
            let thread_c = scope.spawn(|| {
                cu.enter(ctx);
                let ev2: H = std::ptr::with_exposed_provenance_mut(ev2_addr);
                // SAFETY: see `Cu::setup`.
                unsafe {
                    ok((cu.stream_wait_event)(per_thread(), ev2, 0));
                    ok((cu.dtod_async)(q, p, 4096, per_thread()));
                    assert_eq!((cu.stream_query)(per_thread()), NOT_READY, "C's stream does not wait for the event");
                }
                gate_s.open();
                // SAFETY: see `Cu::setup`.
                unsafe { ok((cu.stream_sync)(per_thread())) };
                assert!(cu.read_u32(q, n as usize).iter().all(|&x| x == 9), "the copy did not wait for the event");
            });
            thread_c.join().unwrap();
        });
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.ctx_sync)());
            ok((cu.event_destroy)(ev));
            ok((cu.event_destroy)(ev2));
            ok((cu.stream_destroy)(s));
            ok((cu.mem_free)(p));
            ok((cu.mem_free)(q));
        }
        assert_eq!(fake_per_thread_streams(), 0);
        k.unload();
        assert_no_leaks();
    });
}

/// Queues a memset of `value` over the `n` words at `p` on `stream`, which must wait for work of
/// another stream that `held` holds: it is not ready while held, and once `held` opens and
/// `stream` is synchronised every word reads `value`. `what` says the ordering that failed.
fn memset_waits_for(cu: &Cu, (p, n, value): (Ptr, usize, c_uint), stream: H, held: &Gate, what: &str) {
    // SAFETY: see `Cu::setup`; `p` holds `n` words.
    unsafe {
        ok((cu.memset_d32_async)(p, value, n, stream));
        assert_eq!((cu.stream_query)(stream), NOT_READY, "{what}");
    }
    held.open();
    // SAFETY: see `Cu::setup`.
    unsafe { ok((cu.stream_sync)(stream)) };
    assert!(cu.read_u32(p, n).iter().all(|&x| x == value), "{what}");
}

/// The legacy stream, used on thread B, waits for work queued earlier on thread A's per-thread
/// stream; and later work on thread A's per-thread stream waits for that legacy-stream work.
#[test]
fn legacy_stream_orders_with_every_threads_per_thread_stream() {
    run_with_fake(&[], || {
        let cu = Cu::setup(0);
        let k = Kernels::load();
        let ctx = cu.current();
        let n = 1024u64;
        let p = cu.alloc(4096);
        // Each kernel is held until the work that must wait for it is queued (and seen waiting).
        let (gate_a, gate_b) = (Gate::new(), Gate::new());
        // Channels, not barriers: a thread that fails drops its sender, and the other one's `recv`
        // fails instead of waiting for ever.
        let (step1_tx, step1_rx) = mpsc::channel::<()>();
        let (step2_tx, step2_rx) = mpsc::channel::<()>();
        std::thread::scope(|scope| {
            // Thread A
            scope.spawn(|| {
                let (step1_tx, step2_rx) = (step1_tx, step2_rx); // moved in: dropped if A fails
                cu.enter(ctx);
                gate_a.hold(&cu, per_thread());
                k.spin_fill(p, 1, n, SPIN_US, per_thread());
                step1_tx.send(()).unwrap(); // (1) queued on A's per-thread stream
                step2_rx.recv().expect("thread B failed"); // (2) B queued its legacy-stream kernel
                memset_waits_for(
                    &cu,
                    (p, n as usize, 4),
                    per_thread(),
                    &gate_b,
                    "A's per-thread stream did not wait for the earlier legacy-stream kernel",
                );
            });
            // Thread B
            scope.spawn(|| {
                let (step1_rx, step2_tx) = (step1_rx, step2_tx); // moved in: dropped if B fails
                cu.enter(ctx);
                step1_rx.recv().expect("thread A failed"); // (1)
                memset_waits_for(
                    &cu,
                    (p, n as usize, 2),
                    legacy(),
                    &gate_a,
                    "the legacy stream did not wait for thread A's per-thread stream",
                );
                gate_b.hold(&cu, legacy());
                k.spin_fill(p, 3, n, SPIN_US, legacy());
                step2_tx.send(()).unwrap(); // (2)
            });
        });
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.ctx_sync)());
            ok((cu.mem_free)(p));
        }
        k.unload();
        assert_no_leaks();
    });
}

/// A thread's per-thread stream is released when the thread exits, after its queued work ran.
#[test]
fn per_thread_streams_are_reclaimed_at_thread_exit() {
    run_with_fake(&[], || {
        let cu = Cu::setup(0);
        let ctx = cu.current();
        let p = cu.alloc(4096);
        let mut ev = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.event_create)(&mut ev, 0)) };
        for value in 1..=3u32 {
            // Holds the thread's per-thread stream until after the thread exited.
            let gate = Gate::new();
            std::thread::scope(|scope| {
                let thread = scope.spawn(|| {
                    cu.enter(ctx);
                    // The first use makes the thread's per-thread stream. The report comes before the
                    // stream is held: it first waits until every stream is idle.
                    // SAFETY: see `Cu::setup`.
                    unsafe { ok((cu.stream_query)(per_thread())) };
                    assert_eq!(fake_report().live_streams, 0, "per-thread streams are not live streams");
                    gate.hold(&cu, per_thread());
                    // SAFETY: see `Cu::setup`.
                    unsafe {
                        ok((cu.memset_d32_async)(p, value, 1024, per_thread()));
                        assert_eq!((cu.stream_query)(per_thread()), NOT_READY);
                    }
                    assert_eq!(fake_per_thread_streams(), 1);
                });
                thread.join().unwrap();
            });
            assert_eq!(fake_per_thread_streams(), 0);
            // The legacy stream still waits for the released stream's queued work.
            // SAFETY: see `Cu::setup`.
            unsafe {
                ok((cu.event_record)(ev, legacy()));
                assert_eq!(
                    (cu.event_query)(ev),
                    NOT_READY,
                    "the legacy stream does not wait for the released stream's queued work"
                );
            }
            gate.open();
            assert!(cu.read_u32(p, 1024).iter().all(|&x| x == value));
        }
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_destroy)(ev));
            ok((cu.mem_free)(p));
        }
        assert_no_leaks();
    });
}

// ---- virtual memory management ----------------------------------------------------------------

/// `CUmemAllocationProp` (cuda.h, 32 bytes on 64-bit targets).
#[repr(C)]
#[derive(Default)]
struct AllocProp {
    type_: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_metadata: usize,
    compression: u8,
    rdma: u8,
    usage: u16,
    reserved: [u8; 4],
}

impl AllocProp {
    /// Pinned device memory on `dev`, exportable as `handle_types`.
    fn device(dev: c_int, handle_types: c_int) -> AllocProp {
        AllocProp { type_: 1, handle_types, location_type: 1, location_id: dev, ..Default::default() }
    }
}

/// `CUmemAccessDesc`: a device location and its access flags.
#[repr(C)]
struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

fn access(dev: c_int, flags: c_int) -> AccessDesc {
    AccessDesc { location_type: 1, location_id: dev, flags }
}

const PROT_READ: c_int = 1;
const PROT_READWRITE: c_int = 3;
const MIB: usize = 1 << 20;
const ATTR_VMM_SUPPORTED: c_int = 102;

/// The cuMemCreate family, from `lib` (the fake, or the TCC interposer).
struct Vmm {
    reserve: unsafe extern "system" fn(*mut Ptr, usize, usize, Ptr, u64) -> R,
    address_free: unsafe extern "system" fn(Ptr, usize) -> R,
    create: unsafe extern "system" fn(*mut u64, usize, *const AllocProp, u64) -> R,
    release: unsafe extern "system" fn(u64) -> R,
    map: unsafe extern "system" fn(Ptr, usize, usize, u64, u64) -> R,
    unmap: unsafe extern "system" fn(Ptr, usize) -> R,
    set_access: unsafe extern "system" fn(Ptr, usize, *const AccessDesc, usize) -> R,
    get_access: unsafe extern "system" fn(*mut u64, *const [c_int; 2], Ptr) -> R,
    granularity: unsafe extern "system" fn(*mut usize, *const AllocProp, c_int) -> R,
    props: unsafe extern "system" fn(*mut AllocProp, u64) -> R,
    export: unsafe extern "system" fn(*mut c_void, u64, c_int, u64) -> R,
    import: unsafe extern "system" fn(*mut u64, *mut c_void, c_int) -> R,
    retain: unsafe extern "system" fn(*mut u64, *mut c_void) -> R,
}

fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> T {
    // SAFETY: each caller gives the exact C signature of the named export (from cuda.h) as T.
    *unsafe { lib.get::<T>(name.as_bytes()) }.unwrap_or_else(|e| panic!("missing {name}: {e}"))
}

impl Vmm {
    fn load(lib: &libloading::Library) -> Vmm {
        Vmm {
            reserve: sym(lib, "cuMemAddressReserve"),
            address_free: sym(lib, "cuMemAddressFree"),
            create: sym(lib, "cuMemCreate"),
            release: sym(lib, "cuMemRelease"),
            map: sym(lib, "cuMemMap"),
            unmap: sym(lib, "cuMemUnmap"),
            set_access: sym(lib, "cuMemSetAccess"),
            get_access: sym(lib, "cuMemGetAccess"),
            granularity: sym(lib, "cuMemGetAllocationGranularity"),
            props: sym(lib, "cuMemGetAllocationPropertiesFromHandle"),
            export: sym(lib, "cuMemExportToShareableHandle"),
            import: sym(lib, "cuMemImportFromShareableHandle"),
            retain: sym(lib, "cuMemRetainAllocationHandle"),
        }
    }

    /// What every function of the family answers to (mostly null) arguments.
    fn all_results(&self) -> Vec<R> {
        let prop = AllocProp::device(0, 0);
        let (mut p, mut h, mut g, mut f) = (0, 0u64, 0usize, 0u64);
        let desc = access(0, PROT_READWRITE);
        let mut out = AllocProp::default();
        // SAFETY: every pointer is valid for what the call writes.
        unsafe {
            vec![
                (self.reserve)(&mut p, 2 * MIB, 0, 0, 0),
                (self.address_free)(0x6000_0000_0000, 2 * MIB),
                (self.create)(&mut h, 2 * MIB, &prop, 0),
                (self.release)(1),
                (self.map)(0x6000_0000_0000, 2 * MIB, 0, 1, 0),
                (self.unmap)(0x6000_0000_0000, 2 * MIB),
                (self.set_access)(0x6000_0000_0000, 2 * MIB, &desc, 1),
                (self.get_access)(&mut f, &[1, 0], 0x6000_0000_0000),
                (self.granularity)(&mut g, &prop, 0),
                (self.props)(&mut out, 1),
                (self.export)((&mut f as *mut u64).cast(), 1, 1, 0),
                (self.import)(&mut h, std::ptr::without_provenance_mut(3), 1),
                (self.retain)(&mut h, std::ptr::without_provenance_mut(0x6000_0000_0000)),
            ]
        }
    }
}

/// Reserve, create, map, set access, use (across two mappings), release, unmap, free: memory counts
/// against CUDRV_FAKE_MEMORY, and the access checker follows the mappings and their access. (It
/// also looks the family up through cuGetProcAddress: on the full fake.)
#[test]
fn vmm_maps_physical_memory_into_reserved_ranges() {
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_MEMORY", "33554432")], || {
        let cu = Cu::setup(0);
        let v = Vmm::load(fake_library());
        let mem_info: unsafe extern "system" fn(*mut usize, *mut usize) -> R =
            f!("cuMemGetInfo_v2": unsafe extern "system" fn(*mut usize, *mut usize) -> R);
        let free_mib = || {
            let (mut free, mut total) = (0, 0);
            // SAFETY: see `Cu::setup`.
            unsafe { ok(mem_info(&mut free, &mut total)) };
            assert_eq!(total, 32 * MIB);
            free / MIB
        };
        assert_eq!(attr(&cu, ATTR_VMM_SUPPORTED, 0), 1);
        let prop = AllocProp::device(0, 0);
        let s = cu.stream();
        let (mut va, mut h1, mut h2, mut g) = (0, 0, 0, 0);
        // SAFETY: see `Cu::setup`; every pointer is valid for what the call writes.
        unsafe {
            ok((v.granularity)(&mut g, &prop, 0));
            assert_eq!(g, 2 * MIB);
            ok((v.granularity)(&mut g, &prop, 1));
            assert_eq!(g, 2 * MIB);
            assert_eq!((v.granularity)(&mut g, &prop, 2), 1);
            assert_eq!((v.granularity)(&mut g, &AllocProp::device(1, 0), 0), 101);

            assert_eq!((v.reserve)(&mut va, 3 * MIB, 0, 0, 0), 1, "not a multiple of the granularity");
            ok((v.reserve)(&mut va, 8 * MIB, 0, 0, 0));
            assert!((0x6000_0000_0000..0x7000_0000_0000).contains(&va) && va % (2 * MIB as u64) == 0, "{va:#x}");
            let mut hinted = 0;
            ok((v.reserve)(&mut hinted, 2 * MIB, 0, 0x6800_0000_0000, 0));
            assert_eq!(hinted, 0x6800_0000_0000, "a free, aligned hint is honoured");
            ok((v.address_free)(hinted, 2 * MIB));

            ok((v.create)(&mut h1, 4 * MIB, &prop, 0));
            ok((v.create)(&mut h2, 4 * MIB, &prop, 0));
            assert_ne!(h1, h2);
            assert_eq!((v.create)(&mut g as *mut usize as *mut u64, MIB, &prop, 0), 1);
            assert_eq!(free_mib(), 24, "physical memory counts against CUDRV_FAKE_MEMORY");
            let report = fake_report();
            assert_eq!((report.live_allocations, report.live_bytes), (3, 8 * MIB as u64), "{report}");

            ok((v.map)(va, 4 * MIB, 0, h1, 0));
            ok((v.map)(va + 4 * MIB as u64, 4 * MIB, 0, h2, 0));
            assert_eq!((v.map)(va, 4 * MIB, 0, h2, 0), 1, "already mapped");
            assert_eq!((v.map)(va + 8 * MIB as u64, 2 * MIB, 0, h2, 0), 1, "outside the reservation");
            assert_eq!((v.map)(0x6f00_0000_0000, 2 * MIB, 0, h2, 0), 1, "not reserved");

            // Mapped, but no access yet: a write is a violation.
            ok((cu.memset_d32_async)(va, 1, 16, s));
            ok((cu.stream_sync)(s));
            let report = fake_report();
            assert_eq!(report.violations.len(), 1, "{report}");
            assert!(report.violations[0].contains("no read-write access"), "{report}");
            fake_reset_violations();

            let rw = access(0, PROT_READWRITE);
            assert_eq!((v.set_access)(va, 2 * MIB, &rw, 1), 1, "only whole mappings");
            assert_eq!((v.set_access)(va, 10 * MIB, &rw, 1), 1, "only mapped ranges");
            ok((v.set_access)(va, 8 * MIB, &rw, 1));
            let mut flags = 0;
            ok((v.get_access)(&mut flags, &[1, 0], va + 5 * MIB as u64));
            assert_eq!(flags, 3);
            ok((v.get_access)(&mut flags, &[1, 0], va));
            assert_eq!(flags, 3);

            // A range across both mappings (whose backings are separate) works as one.
            let words = 2 * MIB; // 8 MiB of u32
            ok((cu.memset_d32_async)(va, 0xabcd, words, s));
            ok((cu.stream_sync)(s));
        }
        let edge = va + 4 * MIB as u64 - 8;
        assert_eq!(cu.read_u32(edge, 4), [0xabcd; 4]);
        let data: Vec<u8> = (0..64u8).collect();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.htod)(edge - 24, data.as_ptr().cast(), data.len())) };
        let mut back = vec![0u8; 64];
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.dtoh)(back.as_mut_ptr().cast(), edge - 24, 64)) };
        assert_eq!(back, data);
        // A kernel across the boundary, through the PTX of `kernels_and_modules`.
        let launch: Launch = f!("cuLaunchKernel": Launch);
        let get_function: GetFunction = f!("cuModuleGetFunction": GetFunction);
        let unload: unsafe extern "system" fn(H) -> R = f!("cuModuleUnload": unsafe extern "system" fn(H) -> R);
        let mut src = PTX.as_bytes().to_vec();
        src.push(0);
        let (r, m, log) = load_module(&src);
        assert_eq!(r, 0, "{log}");
        let mut pattern = null_mut();
        let (mut o, mut len, mut seed) = (edge - 1000, 3000u64, 7u64);
        let mut params =
            [(&mut o as *mut Ptr).cast::<c_void>(), (&mut len as *mut u64).cast(), (&mut seed as *mut u64).cast()];
        // SAFETY: see `Cu::setup`; params point at values of the kernel's parameter types.
        unsafe {
            ok(get_function(&mut pattern, m, c"fill_pattern_u8".as_ptr()));
            ok(launch(pattern, 1, 1, 1, 32, 1, 1, 0, s, params.as_mut_ptr(), null_mut()));
            ok((cu.stream_sync)(s));
            ok(unload(m));
        }
        let mut bytes = vec![0u8; 3000];
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.dtoh)(bytes.as_mut_ptr().cast(), edge - 1000, 3000)) };
        assert!(bytes.iter().enumerate().all(|(i, &x)| x == fill_pattern_u8(7, i as u64)));

        let upper = va + 4 * MIB as u64;
        let (mut h, mut h3, mut h4) = (0, 0, 0);
        // SAFETY: see `Cu::setup`; every pointer is valid for what the call writes.
        unsafe {
            // Read-only access: reading works, writing is a violation.
            ok((v.set_access)(upper, 4 * MIB, &access(0, PROT_READ), 1));
            ok((cu.dtod_async)(va, upper, 4096, s));
            ok((cu.stream_sync)(s));
            assert!(fake_report().violations.is_empty());
            ok((cu.memset_d32_async)(upper, 0, 16, s));
            ok((cu.stream_sync)(s));
            let report = fake_report();
            assert_eq!(report.violations.len(), 1, "{report}");
            assert!(report.violations[0].contains("no read-write access"), "{report}");
            fake_reset_violations();

            // A released handle keeps its memory while it is mapped.
            ok((v.release)(h1));
            assert_eq!((v.release)(h1), 1, "released twice");
            ok((cu.memset_d32_async)(va, 5, 1024, s));
            ok((cu.stream_sync)(s));
            assert_eq!(free_mib(), 24);
            // The handle of a mapped address.
            ok((v.retain)(&mut h, std::ptr::without_provenance_mut(upper as usize + 100)));
            assert_eq!(h, h2);
            ok((v.release)(h));
            let mut props = AllocProp::default();
            ok((v.props)(&mut props, h2));
            assert_eq!((props.type_, props.location_type, props.location_id), (1, 1, 0));

            // Export and import (in this process), for a handle type the device has.
            ok((v.create)(&mut h3, 2 * MIB, &AllocProp::device(0, 1), 0));
            let mut fd: c_int = -1;
            ok((v.export)((&mut fd as *mut c_int).cast(), h3, 1, 0));
            assert_eq!((v.export)((&mut fd as *mut c_int).cast(), h2, 1, 0), 1, "h2 is not exportable");
            ok((v.import)(&mut h4, std::ptr::without_provenance_mut(fd as usize), 1));
            assert_eq!(h4, h3);
            ok((v.release)(h4));
            ok((v.release)(h3));
            assert_eq!((v.create)(&mut h3, 2 * MIB, &AllocProp::device(0, 2), 0), NOT_SUPPORTED, "WIN32 on linux");

            // The memory limit.
            let mut big = 0;
            ok((v.create)(&mut big, 24 * MIB, &prop, 0));
            assert_eq!((v.create)(&mut h3, 2 * MIB, &prop, 0), 2, "out of memory");
            ok((v.release)(big));

            // Unmapping: only whole mappings; the reservation cannot be freed while mapped.
            assert_eq!((v.unmap)(upper, 2 * MIB), 1);
            assert_eq!((v.address_free)(va, 8 * MIB), 1);
            ok((v.unmap)(va, 4 * MIB)); // h1: released and unmapped, so freed
            assert_eq!(free_mib(), 28);
            // Queued work on unmapped memory is a violation.
            ok((cu.memset_d32_async)(va, 5, 16, s));
            ok((cu.stream_sync)(s));
            let report = fake_report();
            assert_eq!(report.violations.len(), 1, "{report}");
            assert!(report.violations[0].contains("unmapped"), "{report}");
            fake_reset_violations();
            ok((v.unmap)(upper, 4 * MIB));
            assert_eq!(free_mib(), 28, "h2 is still held by its handle");
            ok((v.release)(h2));
            assert_eq!(free_mib(), 32);
            ok((v.address_free)(va, 8 * MIB));
            assert_eq!((v.address_free)(va, 8 * MIB), 1);
            ok((cu.stream_destroy)(s));
        }
        // cuGetProcAddress serves the family with cudaTypedefs.h's versions.
        assert_eq!(proc_address("cuMemCreate", 13000), (0, export("cuMemCreate"), 0));
        assert_eq!(proc_address("cuMemRetainAllocationHandle", 11000).1, export("cuMemRetainAllocationHandle"));
        assert_eq!(proc_address("cuMemRetainAllocationHandle", 10020), (500, null_mut(), 2));
        assert_no_leaks();
    });
}

/// CUDRV_FAKE_VMM=0 (in any mode) and `-novmm` devices: attribute 102 reads 0 and the family
/// answers 801.
#[test]
fn vmm_can_be_turned_off() {
    run_with_fake_modes(&["linux", "wddm", "tcc"], &[("CUDRV_FAKE_VMM", "0")], || {
        let cu = Cu::setup(0);
        assert_eq!(attr(&cu, ATTR_VMM_SUPPORTED, 0), 0);
        assert_eq!(attr(&cu, 110, 0), 0, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED");
        let results = Vmm::load(fake_library()).all_results();
        assert!(results.iter().all(|&r| r == NOT_SUPPORTED), "{results:?}");
    });
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux, tcc-novmm")], || {
        let cu = Cu::setup(1);
        let v = Vmm::load(fake_library());
        assert_eq!([attr(&cu, ATTR_VMM_SUPPORTED, 0), attr(&cu, ATTR_VMM_SUPPORTED, 1)], [1, 0]);
        let (mut g, mut h, mut va) = (0, 0, 0);
        // SAFETY: see `Cu::setup`; every pointer is valid for what the call writes.
        unsafe {
            assert_eq!((v.granularity)(&mut g, &AllocProp::device(1, 0), 0), NOT_SUPPORTED);
            assert_eq!((v.create)(&mut h, 2 * MIB, &AllocProp::device(1, 0), 0), NOT_SUPPORTED);
            // Virtual addresses belong to no device: device 0 can still use them.
            ok((v.reserve)(&mut va, 2 * MIB, 0, 0, 0));
            ok((v.create)(&mut h, 2 * MIB, &AllocProp::device(0, 0), 0));
            ok((v.map)(va, 2 * MIB, 0, h, 0));
            assert_eq!((v.set_access)(va, 2 * MIB, &access(1, PROT_READWRITE), 1), NOT_SUPPORTED);
            ok((v.set_access)(va, 2 * MIB, &access(0, PROT_READWRITE), 1));
            ok((v.unmap)(va, 2 * MIB));
            ok((v.release)(h));
            ok((v.address_free)(va, 2 * MIB));
        }
        assert_no_leaks();
    });
    // A `-vmm` entry overrides CUDRV_FAKE_VMM=0.
    run_with_fake(&[("CUDRV_FAKE_VMM", "0"), ("CUDRV_FAKE_DEVICES", "tcc-vmm,wddm")], || {
        let cu = Cu::setup(0);
        assert_eq!([attr(&cu, ATTR_VMM_SUPPORTED, 0), attr(&cu, ATTR_VMM_SUPPORTED, 1)], [1, 0]);
        let mut g = 0;
        // SAFETY: see `Cu::setup`.
        unsafe { ok((Vmm::load(fake_library()).granularity)(&mut g, &AllocProp::device(0, 0), 0)) };
    });
}

// ---- the TCC interposer -----------------------------------------------------------------------

/// The TCC interposer, loaded in this (child) process.
fn interposer() -> libloading::Library {
    // SAFETY: the interposer's initialiser only loads the driver named by CUDRV_TCC_REAL_DRIVER.
    unsafe { libloading::Library::new(tcc_interposer_path()) }.expect("load the TCC interposer")
}

/// `CUDRV_TCC_NO_VMM=1`: the interposer reports no VMM and answers 801 from the family (by name
/// and through cuGetProcAddress); without it, the family is forwarded.
#[test]
fn tcc_interposer_can_hide_vmm() {
    if !TCC_INTERPOSER_AVAILABLE {
        eprintln!("skipped: the TCC interposer is built for Linux (glibc) targets only");
        return;
    }
    let path = tcc_interposer_path().to_string_lossy().into_owned();
    let real = full_fake_driver_path().to_string_lossy().into_owned();
    let base = [("CUDRV_DRIVER_PATH", path.as_str()), ("CUDRV_TCC_REAL_DRIVER", real.as_str())];
    let with = |extra: (&'static str, &'static str)| {
        let mut env = base.to_vec();
        env.push(extra);
        env
    };
    run_with_fake(&with(("CUDRV_TCC_NO_VMM", "1")), || {
        let lib = interposer();
        let init: unsafe extern "system" fn(c_uint) -> R = sym(&lib, "cuInit");
        let attribute: unsafe extern "system" fn(*mut c_int, c_int, c_int) -> R = sym(&lib, "cuDeviceGetAttribute");
        let get = |a| {
            let mut v = -1;
            // SAFETY: see `Cu::setup`.
            unsafe { ok(attribute(&mut v, a, 0)) };
            v
        };
        // SAFETY: see `Cu::setup`.
        unsafe { ok(init(0)) };
        assert_eq!([get(ATTR_VMM_SUPPORTED), get(ATTR_MEMORY_POOLS_SUPPORTED), get(ATTR_TCC_DRIVER)], [0, 0, 1]);
        let results = Vmm::load(&lib).all_results();
        assert!(results.iter().all(|&r| r == NOT_SUPPORTED), "{results:?}");
        // Through cuGetProcAddress too.
        let get_proc: GetProc = sym(&lib, "cuGetProcAddress_v2");
        let mut pfn = null_mut();
        let mut status = -1;
        // SAFETY: see `Cu::setup`.
        unsafe { ok(get_proc(c"cuMemCreate".as_ptr(), &mut pfn, 13000, 0, &mut status)) };
        assert!(!pfn.is_null() && pfn != export("cuMemCreate"), "the interposer's own cuMemCreate");
        // SAFETY: pfn is the interposer's cuMemCreate, which has cuda.h's signature.
        let create: unsafe extern "system" fn(*mut u64, usize, *const AllocProp, u64) -> R =
            unsafe { std::mem::transmute::<*mut c_void, _>(pfn) };
        let mut h = 0;
        // SAFETY: see `Cu::setup`.
        assert_eq!(unsafe { create(&mut h, 2 * MIB, &AllocProp::device(0, 0), 0) }, NOT_SUPPORTED);
        assert_eq!(h, 0);
    });
    run_with_fake(&with(("CUDRV_TCC_NO_VMM", "0")), || {
        let lib = interposer();
        let init: unsafe extern "system" fn(c_uint) -> R = sym(&lib, "cuInit");
        let attribute: unsafe extern "system" fn(*mut c_int, c_int, c_int) -> R = sym(&lib, "cuDeviceGetAttribute");
        let mut v = -1;
        let mut g = 0;
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok(init(0));
            ok(attribute(&mut v, ATTR_VMM_SUPPORTED, 0));
            ok((Vmm::load(&lib).granularity)(&mut g, &AllocProp::device(0, 0), 0));
        }
        assert_eq!((v, g), (1, 2 * MIB), "forwarded to the fake");
    });
    let out = run_with_fake_output(&with(("CUDRV_TCC_NO_VMM", "yes")), || {
        let lib = interposer();
        let init: unsafe extern "system" fn(c_uint) -> R = sym(&lib, "cuInit");
        // SAFETY: see `Cu::setup`.
        assert_eq!(unsafe { init(0) }, 1);
    });
    if let Some(out) = out {
        assert!(out.stderr.contains("CUDRV_TCC_NO_VMM=\"yes\"") && out.stderr.contains("expected 0"), "{}", out.stderr);
    }
}

/// Without a real driver, the interposer says which library it tried, why it failed (dlerror), and
/// that it is the cudrv TCC interposer: on stderr, and as the text of error 303.
#[test]
fn tcc_interposer_explains_a_missing_real_driver() {
    if !TCC_INTERPOSER_AVAILABLE {
        eprintln!("skipped: the TCC interposer is built for Linux (glibc) targets only");
        return;
    }
    let path = tcc_interposer_path().to_string_lossy().into_owned();
    let env = [("CUDRV_DRIVER_PATH", path.as_str()), ("CUDRV_TCC_REAL_DRIVER", "/nonexistent/libcuda.so.1")];
    let out = run_with_fake_output(&env, || {
        let lib = interposer();
        let version: unsafe extern "system" fn(*mut c_int) -> R = sym(&lib, "cuDriverGetVersion");
        let init: unsafe extern "system" fn(c_uint) -> R = sym(&lib, "cuInit");
        let error_name: unsafe extern "system" fn(R, *mut *const c_char) -> R = sym(&lib, "cuGetErrorName");
        let error_string: unsafe extern "system" fn(R, *mut *const c_char) -> R = sym(&lib, "cuGetErrorString");
        let mut v = 0;
        let (mut name, mut text) = (std::ptr::null(), std::ptr::null());
        // SAFETY: see `Cu::setup`; the strings returned are static.
        let (name, text) = unsafe {
            assert_eq!(version(&mut v), 303);
            assert_eq!(init(0), 303);
            ok(error_name(303, &mut name));
            ok(error_string(303, &mut text));
            (CStr::from_ptr(name).to_string_lossy(), CStr::from_ptr(text).to_string_lossy())
        };
        assert_eq!(name, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED");
        for part in ["cudrv TCC interposer", "libcudrv_tcc", "/nonexistent/libcuda.so.1", "No such file or directory"] {
            assert!(text.contains(part), "{part:?} missing from {text:?}");
        }
    });
    if let Some(out) = out {
        assert!(
            out.stderr.contains("cudrv TCC interposer") && out.stderr.contains("/nonexistent/libcuda.so.1"),
            "{}",
            out.stderr
        );
    }
}

// ---- strict configuration ---------------------------------------------------------------------

/// Every invalid value, and every unknown CUDRV_FAKE_* name, makes cuInit fail with
/// CUDA_ERROR_INVALID_VALUE and says why on stderr.
#[test]
fn invalid_configuration_fails_cu_init() {
    let cases: &[(&str, &str, &str)] = &[
        ("CUDRV_FAKE_MODE", "bogus", "linux, wddm or tcc"),
        ("CUDRV_FAKE_MODE", "TCC", "linux, wddm or tcc"),
        ("CUDRV_FAKE_DEVICES", "linux,bogus", "<mode>[-novmm|-vmm]"),
        ("CUDRV_FAKE_DEVICES", "linux,,tcc", "<mode>[-novmm|-vmm]"),
        ("CUDRV_FAKE_DEVICES", "tcc-novm", "<mode>[-novmm|-vmm]"),
        ("CUDRV_FAKE_DEVICES", "17", "from 0 to 16"),
        ("CUDRV_FAKE_DEVICES", "2x", "from 0 to 16"),
        ("CUDRV_FAKE_MEMORY", "16G", "a number of bytes"),
        ("CUDRV_FAKE_MEMORY", "-1", "a number of bytes"),
        ("CUDRV_FAKE_MEMORY", "99999999999999999999999", "a number of bytes"),
        ("CUDRV_FAKE_DELAY_US", "1ms", "a number of microseconds"),
        ("CUDRV_FAKE_DRIVER_VERSION", "12.8", "1000 * major + 10 * minor"),
        ("CUDRV_FAKE_DRIVER_VERSION", "12", "1000 * major + 10 * minor"),
        ("CUDRV_FAKE_FAIL", "cuNoSuchFunction:1:2", "<function>:<n>[+]:<code>"),
        ("CUDRV_FAKE_FAIL", "cuMemAlloc:0:2", "<function>:<n>[+]:<code>"),
        ("CUDRV_FAKE_FAIL", "cuMemAlloc:1", "<function>:<n>[+]:<code>"),
        ("CUDRV_FAKE_FAIL", "cuMemAlloc:1:0", "<function>:<n>[+]:<code>"),
        ("CUDRV_FAKE_FAIL", "cuMemAlloc:1:2,", "<function>:<n>[+]:<code>"),
        ("CUDRV_FAKE_VMM", "no", "0 (no virtual memory management) or 1"),
        ("CUDRV_FAKE_REPORT_ON_EXIT", "yes", "0 or 1"),
        ("CUDRV_FAKE_MOED", "tcc", "the fake driver reads CUDRV_FAKE_MODE"),
    ];
    for &(var, value, expected) in cases {
        let out = run_with_fake_output(&[(var, value)], || {
            let cu = Cu::load();
            let mut n = 0;
            // SAFETY: see `Cu::setup`.
            unsafe {
                assert_eq!((cu.init)(0), 1);
                assert_eq!((cu.device_count)(&mut n), 3, "not initialised");
            }
        });
        let Some(out) = out else { continue };
        let line = out.stderr.lines().find(|l| l.starts_with("cudrv fake driver:")).unwrap_or_default();
        assert!(
            line.contains(&format!("{var}=\"{value}\"")) && line.contains(expected) && line.contains("cuInit"),
            "{var}={value}: {}",
            out.stderr
        );
    }
}

/// Every valid spelling still works, with nothing on stderr.
#[test]
fn valid_configuration_is_accepted() {
    let env = [
        ("CUDRV_FAKE_MODE", "tcc"),
        ("CUDRV_FAKE_DEVICES", " linux , tcc-novmm,wddm-vmm"),
        ("CUDRV_FAKE_VMM", "1"),
        ("CUDRV_FAKE_MEMORY", "0x100000000"),
        ("CUDRV_FAKE_DELAY_US", "0"),
        ("CUDRV_FAKE_DRIVER_VERSION", "12080"),
        ("CUDRV_FAKE_FAIL", "cuMemAlloc:5+:2,cuStreamDestroy_v2:1:0x3e7"),
        ("CUDRV_FAKE_REPORT_ON_EXIT", "0"),
        ("CUDRV_FAKE_CFLAGS", "-O0"),
    ];
    let out = run_with_fake_output(&env, || {
        let cu = Cu::setup(2);
        let mut n = 0;
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.device_count)(&mut n)) };
        assert_eq!(n, 3);
        assert_eq!(attr(&cu, ATTR_VMM_SUPPORTED, 1), 0);
        assert_eq!(attr(&cu, ATTR_VMM_SUPPORTED, 2), 1);
        assert_eq!(attr(&cu, ATTR_TCC_DRIVER, 1), 1);
        let s = cu.stream();
        // SAFETY: see `Cu::setup`.
        unsafe { assert_eq!((cu.stream_destroy)(s), 999) };
    });
    if let Some(out) = out {
        assert!(!out.stderr.contains("cudrv fake driver"), "{}", out.stderr);
    }
    // Empty values are unset ones.
    let out = run_with_fake_output(&[("CUDRV_FAKE_MODE", ""), ("CUDRV_FAKE_FAIL", "")], || {
        let _ = Cu::setup(0);
    });
    if let Some(out) = out {
        assert!(!out.stderr.contains("cudrv fake driver"), "{}", out.stderr);
    }
}

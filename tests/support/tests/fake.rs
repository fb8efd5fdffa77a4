//! Tests of the fake CUDA driver itself, through hand-declared function types (not through cudrv).
//! Every test body runs in a child process (`run_with_fake`) that loads the fake.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::ptr::null_mut;

use cudrv_test_support::*;

type R = c_int;
type Ptr = u64;
type H = *mut c_void;

const NOT_READY: R = 600;
const NOT_SUPPORTED: R = 801;

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
    htod_async: unsafe extern "system" fn(Ptr, *const c_void, usize, H) -> R,
    dtod_async: unsafe extern "system" fn(Ptr, Ptr, usize, H) -> R,
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
            htod_async: f!("cuMemcpyHtoDAsync_v2": unsafe extern "system" fn(Ptr, *const c_void, usize, H) -> R),
            dtod_async: f!("cuMemcpyDtoDAsync_v2": unsafe extern "system" fn(Ptr, Ptr, usize, H) -> R),
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

    fn stream(&self) -> H {
        let mut s = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.stream_create)(&mut s, 0)) };
        s
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
            assert_eq!(n, 13000);
            ok((cu.init)(0));
            ok((cu.device_count)(&mut n));
            assert_eq!(n, 1);
            fake_shutdown();
            assert_eq!((cu.device_count)(&mut n), 4);
        }
    });
}

/// (1) Work on a delayed stream really runs after the call returned.
#[test]
fn stream_runs_asynchronously() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "200000")], || {
        let cu = Cu::setup(0);
        let p = cu.alloc(4096);
        let s = cu.stream();
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.memset_d32_async)(p, 0xdead_beef, 1024, s));
            assert_eq!((cu.stream_query)(s), NOT_READY);
            ok((cu.stream_sync)(s));
            ok((cu.stream_query)(s));
        }
        assert!(cu.read_u32(p, 1024).iter().all(|&x| x == 0xdead_beef));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_destroy)(s));
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
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "100000")], || {
        let cu = Cu::setup(0);
        let p = cu.alloc(1 << 16);
        let s = cu.stream();
        let host = vec![7u8; 1 << 16];
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.htod_async)(p, host.as_ptr().cast(), host.len(), s));
            ok((cu.mem_free)(p)); // frees at once: the copy is still queued
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

/// (4) Per-mode attributes; tcc refuses every pool entry point with 801.
#[test]
fn driver_modes() {
    run_with_fake_modes(&["linux", "wddm", "tcc"], &[], || {
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

/// (4) Mixed devices: each device has its own mode.
#[test]
fn mixed_devices() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "wddm,tcc")], || {
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

/// (5) cuGetProcAddress picks the variant by version; the legacy build lacks newer exports.
#[test]
fn get_proc_address_versions() {
    run_with_fake(&[], || {
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
    run_with_fake(&[("CUDRV_FAKE_DRIVER_VERSION", "12000")], || {
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
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_create)(&mut start, 0));
            ok((cu.event_create)(&mut done, 0));
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
            ok((cu.stream_sync)(s2));
            ok((cu.event_query)(done));
            ok((cu.event_elapsed)(&mut ms, start, done));
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

//! Tests of the fake driver's emulation of the API extensions (pitched memory and 2D/3D copies,
//! pointer attributes, managed-memory advice, the linker and JIT options, launch attributes, IPC),
//! through hand-declared function types (not through cudrv). Every test body runs in a child
//! process (`run_with_fake`) that loads the fake: the default one (`CUDRV_TEST_DRIVER` chooses), or
//! the full one (`full_fake_driver`) for tests of entry points newer than CUDA 11.1.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::ptr::null_mut;

use cudrv_test_support::*;

type R = c_int;
type Ptr = u64;
type H = *mut c_void;

const INVALID_VALUE: R = 1;
const INVALID_CONTEXT: R = 201;
const INVALID_DEVICE: R = 101;
const INVALID_PTX: R = 218;
const NOT_FOUND: R = 500;
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

/// The NUL-terminated UTF-8 text at the start of `bytes` (a log or a name the fake wrote).
fn c_text(bytes: &[u8]) -> String {
    CStr::from_bytes_until_nul(bytes).unwrap().to_str().unwrap().to_string()
}

#[track_caller]
fn ok(r: R) {
    assert_eq!(r, 0, "driver call failed with {r}");
}

/// cuInit, and device 0's primary context current.
fn setup() {
    let init = f!("cuInit": unsafe extern "system" fn(c_uint) -> R);
    let retain = f!("cuDevicePrimaryCtxRetain": unsafe extern "system" fn(*mut H, c_int) -> R);
    let set_current = f!("cuCtxSetCurrent": unsafe extern "system" fn(H) -> R);
    let mut ctx = null_mut();
    // SAFETY (here and in the rest of this file): the arguments follow the documented driver API
    // contracts; out-pointers point at live locals.
    unsafe {
        ok(init(0));
        ok(retain(&mut ctx, 0));
        ok(set_current(ctx));
    }
}

fn alloc(n: usize) -> Ptr {
    let mem_alloc = f!("cuMemAlloc_v2": unsafe extern "system" fn(*mut Ptr, usize) -> R);
    let mut p = 0;
    // SAFETY: see `setup`.
    unsafe { ok(mem_alloc(&mut p, n)) };
    p
}

fn read(p: Ptr, n: usize) -> Vec<u8> {
    let dtoh = f!("cuMemcpyDtoH_v2": unsafe extern "system" fn(*mut c_void, Ptr, usize) -> R);
    let mut v = vec![0u8; n];
    // SAFETY: see `setup`; `v` holds n bytes.
    unsafe { ok(dtoh(v.as_mut_ptr().cast(), p, n)) };
    v
}

fn write(p: Ptr, data: &[u8]) {
    let htod = f!("cuMemcpyHtoD_v2": unsafe extern "system" fn(Ptr, *const c_void, usize) -> R);
    // SAFETY: see `setup`.
    unsafe { ok(htod(p, data.as_ptr().cast(), data.len())) };
}

/// `CUDA_MEMCPY2D`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Copy2D {
    src_x: usize,
    src_y: usize,
    src_type: c_int,
    src_host: usize,
    src_device: Ptr,
    src_array: usize,
    src_pitch: usize,
    dst_x: usize,
    dst_y: usize,
    dst_type: c_int,
    dst_host: usize,
    dst_device: Ptr,
    dst_array: usize,
    dst_pitch: usize,
    width: usize,
    height: usize,
}

const HOST: c_int = 1;
const DEVICE: c_int = 2;
const ARRAY: c_int = 3;

#[test]
fn pitched_allocations_region_copies_and_2d_memsets() {
    run_with_fake(&[], || {
        setup();
        let alloc_pitch =
            f!("cuMemAllocPitch_v2": unsafe extern "system" fn(*mut Ptr, *mut usize, usize, usize, c_uint) -> R);
        let copy2d = f!("cuMemcpy2DAsync_v2": unsafe extern "system" fn(*const Copy2D, H) -> R);
        let memset2d = f!("cuMemsetD2D16_v2": unsafe extern "system" fn(Ptr, usize, u16, usize, usize) -> R);
        let memset2d_async =
            f!("cuMemsetD2D32Async": unsafe extern "system" fn(Ptr, usize, c_uint, usize, usize, H) -> R);
        let sync = f!("cuCtxSynchronize": unsafe extern "system" fn() -> R);
        let (mut p, mut pitch) = (0, 0);
        // SAFETY: see `setup`.
        unsafe {
            assert_eq!(alloc_pitch(&mut p, &mut pitch, 100, 4, 3), INVALID_VALUE, "element size 3");
            assert_eq!(alloc_pitch(&mut p, &mut pitch, 0, 4, 4), INVALID_VALUE);
            ok(alloc_pitch(&mut p, &mut pitch, 100, 4, 4));
        }
        assert_eq!(pitch, 512);
        // Fill the whole allocation with 0xEE, then a 2D memset of 10 u16 per row leaves the padding.
        write(p, &[0xEE; 2048]);
        // SAFETY: see `setup`.
        unsafe {
            assert_eq!(memset2d(p + 1, pitch, 7, 10, 4), INVALID_VALUE, "misaligned for 16 bits");
            assert_eq!(memset2d(p, 10, 7, 10, 4), INVALID_VALUE, "pitch below the width");
            ok(memset2d(p, pitch, 0x0102, 10, 4));
        }
        let back = read(p, 2048);
        for row in 0..4 {
            assert!(back[row * 512..row * 512 + 20].chunks(2).all(|c| c == [0x02, 0x01]), "row {row}");
            assert!(back[row * 512 + 20..(row + 1) * 512].iter().all(|&b| b == 0xEE), "row {row} padding");
        }
        // A 2D copy from pageable host memory (staged at the call), rows 64 bytes apart.
        let host: Vec<u8> = (0..=255).collect();
        let c = Copy2D {
            src_type: HOST,
            src_host: host.as_ptr() as usize,
            src_pitch: 64,
            dst_type: DEVICE,
            dst_device: p,
            dst_pitch: pitch,
            dst_x: 8,
            dst_y: 1,
            width: 16,
            height: 3,
            ..Copy2D::default()
        };
        // SAFETY: see `setup`.
        unsafe {
            ok(copy2d(&c, null_mut()));
            ok(sync());
        }
        let back = read(p, 2048);
        for row in 0..3 {
            let at = (row + 1) * 512 + 8;
            assert_eq!(&back[at..at + 16], &host[row * 64..row * 64 + 16], "row {row}");
        }
        // Bad descriptors are refused at the call; a region beyond the allocation is a violation.
        for bad in [Copy2D { dst_pitch: 8, ..c }, Copy2D { src_type: ARRAY, ..c }, Copy2D { dst_device: 0, ..c }] {
            // SAFETY: see `setup`.
            assert_eq!(unsafe { copy2d(&bad, null_mut()) }, INVALID_VALUE);
        }
        // SAFETY: see `setup`.
        unsafe {
            ok(copy2d(&Copy2D { dst_y: 3, ..c }, null_mut())); // rows 3..6 of 4
            ok(memset2d_async(p, pitch, 1, 10, 4, null_mut()));
            ok(sync());
        }
        let report = fake_report();
        assert_eq!(report.violations.len(), 1, "{report}");
        assert!(report.violations[0].contains("cuMemcpy2DAsync_v2") && report.violations[0].contains("overruns"));
        fake_reset_violations();
    });
}

#[test]
fn pointer_attributes_and_address_ranges() {
    run_with_fake(&[full_fake_driver()], || {
        setup();
        let attr = f!("cuPointerGetAttribute": unsafe extern "system" fn(*mut c_void, c_int, Ptr) -> R);
        let range = f!("cuMemGetAddressRange_v2": unsafe extern "system" fn(*mut Ptr, *mut usize, Ptr) -> R);
        let pool_get = f!("cuDeviceGetDefaultMemPool": unsafe extern "system" fn(*mut H, c_int) -> R);
        let alloc_async = f!("cuMemAllocAsync": unsafe extern "system" fn(*mut Ptr, usize, H) -> R);
        let managed = f!("cuMemAllocManaged": unsafe extern "system" fn(*mut Ptr, usize, c_uint) -> R);
        let p = alloc(4096);
        let int_attr = |a: c_int, ptr: Ptr| {
            let mut v: c_int = -1;
            // SAFETY: see `setup`; the attribute is an int.
            let r = unsafe { attr((&raw mut v).cast(), a, ptr) };
            (r, v)
        };
        assert_eq!(int_attr(10, p + 100), (0, 1), "cuMemAlloc memory is legacy-IPC capable");
        assert_eq!(int_attr(9, p), (0, 0));
        assert_eq!(int_attr(8, p), (0, 0));
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: see `setup`.
        unsafe {
            attr((&raw mut base).cast(), 11, p + 100);
            attr((&raw mut size).cast(), 12, p + 100);
        }
        assert_eq!((base, size), (p, 4096));
        (base, size) = (0, 0);
        // SAFETY: see `setup`.
        unsafe { ok(range(&mut base, &mut size, p + 4095)) };
        assert_eq!((base, size), (p, 4096));
        // SAFETY: see `setup`.
        assert_eq!(unsafe { range(&mut base, &mut size, p + 4096) }, NOT_FOUND);
        assert_eq!(int_attr(10, 0x1234).0, INVALID_VALUE, "not memory of the driver");
        assert_eq!(int_attr(99, p).0, INVALID_VALUE);
        // Pool memory: not legacy capable; its pool, without handle types.
        let (mut pool, mut q) = (null_mut(), 0);
        // SAFETY: see `setup`.
        unsafe {
            ok(pool_get(&mut pool, 0));
            ok(alloc_async(&mut q, 1000, null_mut()));
        }
        assert_eq!(int_attr(10, q), (0, 0));
        let mut got: H = null_mut();
        let mut types: u64 = 7;
        // SAFETY: see `setup`.
        unsafe {
            ok(attr((&raw mut got).cast(), 17, q));
            ok(attr((&raw mut types).cast(), 14, q));
        }
        assert_eq!((got, types), (pool, 0));
        // SAFETY: see `setup`.
        unsafe { ok(attr((&raw mut got).cast(), 17, p)) };
        assert!(got.is_null());
        // Managed memory.
        let mut m = 0;
        // SAFETY: see `setup`.
        unsafe { ok(managed(&mut m, 64, 1)) };
        assert_eq!(int_attr(8, m), (0, 1));
        assert_eq!(int_attr(10, m), (0, 0));
    });
}

#[test]
fn managed_advice_prefetch_and_range_attributes() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,wddm")], || {
        setup();
        let managed = f!("cuMemAllocManaged": unsafe extern "system" fn(*mut Ptr, usize, c_uint) -> R);
        let advise = f!("cuMemAdvise": unsafe extern "system" fn(Ptr, usize, c_int, c_int) -> R);
        let prefetch = f!("cuMemPrefetchAsync": unsafe extern "system" fn(Ptr, usize, c_int, H) -> R);
        let range_attr =
            f!("cuMemRangeGetAttribute": unsafe extern "system" fn(*mut c_void, usize, c_int, Ptr, usize) -> R);
        let sync = f!("cuCtxSynchronize": unsafe extern "system" fn() -> R);
        let mut m = 0;
        // SAFETY: see `setup`.
        unsafe { ok(managed(&mut m, 4096, 1)) };
        let get = |a: c_int| {
            let mut v: c_int = 99;
            // SAFETY: see `setup`; 4 bytes for an int.
            ok(unsafe { range_attr((&raw mut v).cast(), 4, a, m, 4096) });
            v
        };
        assert_eq!((get(1), get(2), get(4)), (0, -2, -2));
        // SAFETY: see `setup`.
        unsafe {
            ok(advise(m, 4096, 1, 0));
            ok(advise(m, 100, 3, 1)); // preferred: device 1, on part of the range
            assert_eq!(advise(m, 4096, 3, 7), INVALID_DEVICE);
            assert_eq!(advise(m, 8192, 1, 0), INVALID_VALUE, "beyond the allocation");
            ok(advise(m, 4096, 5, -1)); // accessed by the host (CU_DEVICE_CPU)
            ok(advise(m, 4096, 5, 0));
        }
        assert_eq!((get(1), get(2)), (1, 1));
        let mut by = [7 as c_int; 4];
        // SAFETY: see `setup`; 16 bytes for 4 ints.
        unsafe { ok(range_attr(by.as_mut_ptr().cast(), 16, 3, m, 4096)) };
        assert_eq!(by, [0, -1, -2, -2]);
        let mut v: c_int = 0;
        // SAFETY: see `setup`.
        unsafe {
            assert_eq!(range_attr((&raw mut v).cast(), 8, 1, m, 4096), INVALID_VALUE, "size of an int only");
            ok(prefetch(m, 4096, -1, null_mut()));
            ok(sync());
        }
        assert_eq!(get(4), -1, "last prefetched to the host");
        // SAFETY: see `setup`.
        unsafe {
            // Device 1 (wddm) has no concurrent managed access: no prefetch there.
            assert_eq!(prefetch(m, 4096, 1, null_mut()), INVALID_DEVICE);
            assert_eq!(prefetch(m, 4096, 5, null_mut()), INVALID_DEVICE);
            assert_eq!(prefetch(alloc(64), 64, 0, null_mut()), INVALID_VALUE, "not managed memory");
        }
    });
}

#[test]
fn proc_address_serves_the_variant_of_the_driver_version() {
    for (version, expect_v2) in [("12010", false), ("12020", true)] {
        run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_DRIVER_VERSION", version)], || {
            let get = f!("cuGetProcAddress": unsafe extern "system" fn(*const c_char, *mut H, c_int, u64) -> R);
            let v1 = f!("cuMemPrefetchAsync": unsafe extern "system" fn()) as H;
            let v2 = f!("cuMemPrefetchAsync_v2": unsafe extern "system" fn()) as H;
            let mut p = null_mut();
            let cname = CString::new("cuMemPrefetchAsync").unwrap();
            // SAFETY: see `setup`.
            ok(unsafe { get(cname.as_ptr(), &mut p, 13000, 0) });
            assert_eq!(p, if expect_v2 { v2 } else { v1 }, "at {version}");
            // Libraries appeared in 12.0, the kernel count in 12.4.
            let mut p = null_mut();
            let name = CString::new("cuLibraryGetKernelCount").unwrap();
            // SAFETY: see `setup`.
            let r = unsafe { get(name.as_ptr(), &mut p, 13000, 0) };
            assert_eq!(r, NOT_FOUND);
        });
    }
}

#[test]
fn the_linker_keeps_its_logs_and_makes_loadable_images() {
    run_with_fake(&[], || {
        setup();
        let create = f!("cuLinkCreate_v2": unsafe extern "system" fn(c_uint, *mut c_int, *mut H, *mut H) -> R);
        let add = f!("cuLinkAddData_v2": unsafe extern "system" fn(H, c_int, *mut c_void, usize, *const c_char, c_uint, *mut c_int, *mut H) -> R);
        let complete = f!("cuLinkComplete": unsafe extern "system" fn(H, *mut *mut c_void, *mut usize) -> R);
        let destroy = f!("cuLinkDestroy": unsafe extern "system" fn(H) -> R);
        let load = f!("cuModuleLoadData": unsafe extern "system" fn(*mut H, *const c_void) -> R);
        let get_fn = f!("cuModuleGetFunction": unsafe extern "system" fn(*mut H, H, *const c_char) -> R);
        let unload = f!("cuModuleUnload": unsafe extern "system" fn(H) -> R);
        let mut err = vec![0u8; 256];
        let mut info = vec![0u8; 256];
        // error log, its size, info log, its size, wall time, optimisation level
        let mut opts: [c_int; 6] = [5, 6, 3, 4, 2, 7];
        let mut vals: [H; 6] =
            [err.as_mut_ptr().cast(), 256 as H, info.as_mut_ptr().cast(), 256 as H, null_mut(), 3 as H];
        let mut state = null_mut();
        // SAFETY: see `setup`; the arrays outlive the link state.
        unsafe {
            let mut bad_opts: [c_int; 1] = [7];
            let mut bad_vals: [H; 1] = [5 as H];
            assert_eq!(create(1, bad_opts.as_mut_ptr(), bad_vals.as_mut_ptr(), &mut state), INVALID_VALUE);
            ok(create(6, opts.as_mut_ptr(), vals.as_mut_ptr(), &mut state));
            let name = CString::new("a.ptx").unwrap();
            let mut ptx = b".entry fill_u32\n\0".to_vec();
            ok(add(state, 1, ptx.as_mut_ptr().cast(), ptx.len(), name.as_ptr(), 0, null_mut(), null_mut()));
            assert_eq!(c_text(&info), "fake nvlink: added a.ptx (1 entry)");
            assert_eq!(vals[3] as usize, 35, "the used size of the info log");
            // No terminating NUL within the size: refused.
            let mut unterminated = b".entry empty\n".to_vec();
            let n = unterminated.len();
            assert_eq!(
                add(state, 1, unterminated.as_mut_ptr().cast(), n, name.as_ptr(), 0, null_mut(), null_mut()),
                INVALID_VALUE
            );
            let mut broken = b".entry nope\n\0".to_vec();
            let name2 = CString::new("b.ptx").unwrap();
            assert_eq!(
                add(state, 1, broken.as_mut_ptr().cast(), broken.len(), name2.as_ptr(), 0, null_mut(), null_mut()),
                INVALID_PTX
            );
            assert!(c_text(&err).starts_with("b.ptx: fake ptxas: line 1: unknown entry 'nope'"), "{}", c_text(&err));
            // The log sizes were cut to the used sizes; the next log is whole anyway.
            let mut more = b".entry empty\n.entry add_f32\n\0".to_vec();
            let name3 = CString::new("c.ptx with a long name").unwrap();
            ok(add(state, 1, more.as_mut_ptr().cast(), more.len(), name3.as_ptr(), 0, null_mut(), null_mut()));
            assert_eq!(c_text(&info), "fake nvlink: added c.ptx with a long name (2 entries)");
            let (mut image, mut size) = (null_mut(), 0);
            ok(complete(state, &mut image, &mut size));
            assert_eq!(c_text(&info), "fake nvlink: linked 2 inputs into 3 entries");
            assert_eq!(f32::from_ne_bytes((vals[4] as usize as u32).to_ne_bytes()), 0.25, "the wall time");
            let bytes = std::slice::from_raw_parts(image.cast::<u8>(), size);
            assert_eq!(&bytes[..4], b"\x7fELF");
            assert_eq!(&bytes[64..size - 1], b".entry fill_u32\n.entry empty\n.entry add_f32\n");
            let mut module = null_mut();
            ok(load(&mut module, image));
            let mut f = null_mut();
            let kname = CString::new("add_f32").unwrap();
            ok(get_fn(&mut f, module, kname.as_ptr()));
            ok(unload(module));
            ok(destroy(state));
            assert_eq!(destroy(state), 400, "destroyed already");
        }
    });
}

/// `CUlaunchAttribute`: an id, padding, and a 64-byte value.
#[repr(C)]
#[derive(Clone, Copy)]
struct Attr {
    id: c_int,
    pad: c_int,
    value: [u64; 8],
}

/// `CUlaunchConfig`.
#[repr(C)]
struct Config {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: H,
    attrs: *mut Attr,
    num_attrs: c_uint,
}

fn attr(id: c_int, words: &[u64]) -> Attr {
    let mut a = Attr { id, pad: 0, value: [0; 8] };
    a.value[..words.len()].copy_from_slice(words);
    a
}

#[test]
fn launch_attributes_are_validated_and_recorded() {
    run_with_fake(&[full_fake_driver()], || {
        setup();
        let load = f!("cuModuleLoadData": unsafe extern "system" fn(*mut H, *const c_void) -> R);
        let get_fn = f!("cuModuleGetFunction": unsafe extern "system" fn(*mut H, H, *const c_char) -> R);
        let launch_ex = f!("cuLaunchKernelEx": unsafe extern "system" fn(*const Config, H, *mut *mut c_void, *mut *mut c_void) -> R);
        let last = f!("cudrvFakeLastLaunch": unsafe extern "C" fn(*mut [u8; 144]) -> c_int);
        let ptx = CString::new(".entry empty\n").unwrap();
        let name = CString::new("empty").unwrap();
        let (mut module, mut f) = (null_mut(), null_mut());
        // SAFETY: see `setup`.
        unsafe {
            ok(load(&mut module, ptx.as_ptr().cast()));
            ok(get_fn(&mut f, module, name.as_ptr()));
        }
        let run = |attrs: &mut [Attr], grid: [c_uint; 3]| {
            let cfg = Config {
                grid,
                block: [32, 1, 1],
                shared: 0,
                stream: null_mut(),
                attrs: attrs.as_mut_ptr(),
                num_attrs: attrs.len() as c_uint,
            };
            // SAFETY: see `setup`; `empty` takes no parameters.
            unsafe { launch_ex(&cfg, f, null_mut(), null_mut()) }
        };
        let both = |a: u32, b: u32| u64::from(a) | u64::from(b) << 32;
        // Values out of range.
        assert_eq!(run(&mut [attr(6, &[2])], [1, 1, 1]), INVALID_VALUE, "PSS is 0 or 1");
        assert_eq!(run(&mut [attr(10, &[2])], [1, 1, 1]), INVALID_VALUE, "two domains");
        let nan = u64::from(f32::NAN.to_bits());
        assert_eq!(run(&mut [attr(1, &[0x1000, 64, nan])], [1, 1, 1]), INVALID_VALUE, "hit ratio");
        assert_eq!(run(&mut [attr(1, &[0x1000, 1 << 30, u64::from(0.5f32.to_bits())])], [1, 1, 1]), INVALID_VALUE);
        assert_eq!(run(&mut [attr(11, &[both(2, 1), 1])], [4, 1, 1]), INVALID_VALUE, "no cluster");
        assert_eq!(run(&mut [attr(4, &[both(2, 1), 1]), attr(11, &[both(3, 1), 1])], [6, 1, 1]), INVALID_VALUE);
        assert_eq!(run(&mut [attr(99, &[])], [1, 1, 1]), INVALID_VALUE, "unknown attribute");
        // Everything at once.
        let window = [0xABC000, 4096, u64::from(0.75f32.to_bits()) | 2 << 32, 1];
        ok(run(
            &mut [
                attr(6, &[1]),
                attr(8, &[(-3i32) as u32 as u64]),
                attr(10, &[1]),
                attr(1, &window),
                attr(4, &[both(2, 1), 1]),
                attr(11, &[both(4, 1), 1]),
            ],
            [8, 1, 1],
        ));
        let mut rec = [0u8; 144];
        // SAFETY: the fake writes its 144-byte record.
        unsafe { assert_eq!(last(&mut rec), 0) };
        let word = |at: usize| i32::from_ne_bytes(rec[at..at + 4].try_into().unwrap());
        assert_eq!(u64::from_ne_bytes(rec[..8].try_into().unwrap()), 1, "one launch so far");
        assert_eq!((word(40), word(52)), (2, 4), "cluster and preferred cluster x");
        assert_eq!((word(64), word(68), word(72), word(76)), (1, 1, -3, 1), "PSS, priority, domain");
        assert_eq!((word(80), word(84), word(88)), (1, 2, 1), "window: set, persisting, streaming");
        assert_eq!(f32::from_ne_bytes(rec[92..96].try_into().unwrap()), 0.75);
        assert_eq!(u64::from_ne_bytes(rec[96..104].try_into().unwrap()), 0xABC000);
        assert!(rec[112..].starts_with(b"cuLaunchKernelEx\0"));
    });
}

#[test]
fn ipc_calls_check_what_they_are_given() {
    run_with_fake(&[full_fake_driver()], || {
        setup();
        let get_mem = f!("cuIpcGetMemHandle": unsafe extern "system" fn(*mut [u8; 64], Ptr) -> R);
        let open_mem = f!("cuIpcOpenMemHandle_v2": unsafe extern "system" fn(*mut Ptr, [u8; 64], c_uint) -> R);
        let close_mem = f!("cuIpcCloseMemHandle": unsafe extern "system" fn(Ptr) -> R);
        let get_event = f!("cuIpcGetEventHandle": unsafe extern "system" fn(*mut [u8; 64], H) -> R);
        let event_create = f!("cuEventCreate": unsafe extern "system" fn(*mut H, c_uint) -> R);
        let alloc_async = f!("cuMemAllocAsync": unsafe extern "system" fn(*mut Ptr, usize, H) -> R);
        let export_ptr = f!("cuMemPoolExportPointer": unsafe extern "system" fn(*mut [u8; 64], Ptr) -> R);
        let p = alloc(1 << 20);
        write(p, &[9; 64]);
        let mut h = [0u8; 64];
        let mut q = 0;
        // SAFETY: see `setup`.
        unsafe {
            assert_eq!(get_mem(&mut h, p + 512), INVALID_VALUE, "the allocation's base only");
            ok(get_mem(&mut h, p));
            assert_eq!(&h[..8], b"FKIPCMEM");
            assert_eq!(open_mem(&mut q, h, 0), INVALID_CONTEXT, "a handle of this very process");
            assert_eq!(open_mem(&mut q, h, 2), INVALID_VALUE, "unknown flag");
            assert_eq!(open_mem(&mut q, [0; 64], 1), INVALID_VALUE, "not a handle");
            assert_eq!(close_mem(p), INVALID_VALUE, "not an opened mapping");
        }
        // The export kept the contents (the backing moved to shared memory).
        assert_eq!(read(p, 64), [9; 64]);
        // Pool memory is not legacy-IPC memory, and the default pool has no handle types.
        // SAFETY: see `setup`.
        unsafe {
            ok(alloc_async(&mut q, 4096, null_mut()));
            assert_eq!(get_mem(&mut h, q), INVALID_VALUE);
            assert_eq!(export_ptr(&mut h, q), INVALID_VALUE);
        }
        // Events must be interprocess to be exported.
        let (mut e, mut ipc) = (null_mut(), null_mut());
        // SAFETY: see `setup`.
        unsafe {
            ok(event_create(&mut e, 2));
            ok(event_create(&mut ipc, 6));
            assert_eq!(get_event(&mut h, e), INVALID_VALUE);
            ok(get_event(&mut h, ipc));
            assert_eq!(&h[..8], b"FKIPCEVT");
            let mut none = null_mut();
            assert_eq!(event_create(&mut none, 4), INVALID_VALUE, "interprocess needs disable-timing");
        }
        // Freeing removes the shared memory the exports made.
        let mem_free = f!("cuMemFree_v2": unsafe extern "system" fn(Ptr) -> R);
        let event_destroy = f!("cuEventDestroy_v2": unsafe extern "system" fn(H) -> R);
        // SAFETY: see `setup`; each is freed once.
        unsafe {
            ok(mem_free(p));
            ok(event_destroy(e));
            ok(event_destroy(ipc));
        }
    });
    run_with_fake(&[("CUDRV_FAKE_MODE", "wddm")], || {
        setup();
        let get_mem = f!("cuIpcGetMemHandle": unsafe extern "system" fn(*mut [u8; 64], Ptr) -> R);
        let p = alloc(4096);
        let mut h = [0u8; 64];
        // SAFETY: see `setup`.
        assert_eq!(unsafe { get_mem(&mut h, p) }, NOT_SUPPORTED);
    });
}

/// The name of the shared memory that an IPC memory handle names (the fake's wire format: magic,
/// pid, device, size, then the name). Only the Unix test reads it.
#[cfg(unix)]
fn shared_memory_name(handle: &[u8; 64]) -> String {
    c_text(&handle[24..])
}

/// A process that dies with exports alive leaves its shared-memory files behind, and a later
/// process may get its pid: an export must not fail on a name that such a file takes (CI once
/// failed `pool_ipc_between_two_processes` so), nor touch the file.
#[cfg(unix)]
#[test]
fn exports_skip_shared_memory_names_left_behind() {
    run_with_fake(&[], || {
        setup();
        let get_mem = f!("cuIpcGetMemHandle": unsafe extern "system" fn(*mut [u8; 64], Ptr) -> R);
        let mem_free = f!("cuMemFree_v2": unsafe extern "system" fn(Ptr) -> R);
        let (first, second) = (alloc(4096), alloc(4096));
        let (mut h1, mut h2) = ([0u8; 64], [0u8; 64]);
        // SAFETY: see `setup`.
        unsafe { ok(get_mem(&mut h1, first)) };
        let name = shared_memory_name(&h1);
        let dir = std::env::temp_dir();
        assert!(dir.join(&name).exists(), "{name} is a file of the temporary directory");
        assert!(name.contains(&format!("-m{}-", std::process::id())), "{name} names this process");
        // The name the next export would take, taken by a file that no live process owns.
        let (stem, serial) = name.rsplit_once('-').unwrap();
        let stale = dir.join(format!("{stem}-{}", serial.parse::<u64>().unwrap() + 1));
        std::fs::write(&stale, b"left by a dead process").unwrap();
        write(second, &[7; 64]);
        // SAFETY: see `setup`; each allocation is freed once.
        unsafe {
            ok(get_mem(&mut h2, second));
            let taken = shared_memory_name(&h2);
            assert_ne!(dir.join(&taken), stale, "the export moved on to a free name");
            assert!(dir.join(&taken).exists());
            assert_eq!(read(second, 64), [7; 64], "the export kept the contents");
            ok(mem_free(first));
            ok(mem_free(second));
            assert!(!dir.join(&taken).exists() && !dir.join(&name).exists(), "freeing removes the files");
        }
        assert_eq!(std::fs::read(&stale).unwrap(), b"left by a dead process", "the stale file is not touched");
        std::fs::remove_file(&stale).unwrap();
    });
}

//! Tests of the fake driver's CUDA graphs and stream capture (`csrc/fake_graph.c`), through
//! hand-declared function types (not through cudrv). Every test body runs in a child process
//! (`run_with_fake`) that loads the fake: the full one (`full_fake_driver`), whose newer entry points
//! (`cuMemAllocAsync`, `cuStreamGetCaptureInfo_v3`, ...) these declare, whatever
//! `CUDRV_TEST_DRIVER` says; the last test checks what the CUDA 11.1 build exports.

use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudrv_test_support::*;

type R = c_int;
type Ptr = u64;
type H = *mut c_void;
type HostFn = unsafe extern "system" fn(*mut c_void);

const INVALID_VALUE: R = 1;
const INVALID_HANDLE: R = 400;
const NOT_FOUND: R = 500;
const NOT_SUPPORTED: R = 801;
const ILLEGAL_STATE: R = 401;
const CAPTURE_UNSUPPORTED: R = 900;
const CAPTURE_INVALIDATED: R = 901;
const CAPTURE_MERGE: R = 902;
const CAPTURE_UNMATCHED: R = 903;
const CAPTURE_UNJOINED: R = 904;
const CAPTURE_ISOLATION: R = 905;
const CAPTURE_IMPLICIT: R = 906;
const CAPTURED_EVENT: R = 907;
const CAPTURE_WRONG_THREAD: R = 908;
const EXEC_UPDATE_FAILURE: R = 910;

const GLOBAL: c_int = 0;
const THREAD_LOCAL: c_int = 1;
const RELAXED: c_int = 2;

const STATUS_NONE: c_int = 0;
const STATUS_ACTIVE: c_int = 1;
const STATUS_INVALIDATED: c_int = 2;

const NODE_KERNEL: c_int = 0;
const NODE_MEMCPY: c_int = 1;
const NODE_MEMSET: c_int = 2;
const NODE_HOST: c_int = 3;
const NODE_GRAPH: c_int = 4;
const NODE_EMPTY: c_int = 5;
const NODE_WAIT_EVENT: c_int = 6;
const NODE_EVENT_RECORD: c_int = 7;
const NODE_MEM_ALLOC: c_int = 10;
const NODE_MEM_FREE: c_int = 11;

const UPDATE_TOPOLOGY_CHANGED: c_int = 2;
const UPDATE_NODE_TYPE_CHANGED: c_int = 3;
const UPDATE_PARAMETERS_CHANGED: c_int = 5;

const MEM_USED_CURRENT: c_int = 0;
const MEM_USED_HIGH: c_int = 1;
const MEM_RESERVED_CURRENT: c_int = 2;
const MEM_RESERVED_HIGH: c_int = 3;

const NON_BLOCKING: c_uint = 1;

/// `CU_STREAM_LEGACY`.
fn legacy() -> H {
    std::ptr::without_provenance_mut(1)
}

/// Looks a function up in the fake loaded in this process.
macro_rules! f {
    ($name:literal) => {{
        // SAFETY: the field's type is the exact C signature of the named export (from cuda.h).
        let s = unsafe { fake_library().get($name.as_bytes()) }.unwrap_or_else(|e| panic!("missing {}: {e}", $name));
        *s
    }};
}

/// `CUDA_KERNEL_NODE_PARAMS` (`_v2`).
#[repr(C)]
struct KernelParams {
    func: H,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem: c_uint,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
    kern: H,
    ctx: H,
}

/// `CUDA_MEMCPY3D`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Memcpy3D {
    src_x: usize,
    src_y: usize,
    src_z: usize,
    src_lod: usize,
    src_type: c_int,
    src_host: *const c_void,
    src_device: Ptr,
    src_array: H,
    reserved0: H,
    src_pitch: usize,
    src_height: usize,
    dst_x: usize,
    dst_y: usize,
    dst_z: usize,
    dst_lod: usize,
    dst_type: c_int,
    dst_host: H,
    dst_device: Ptr,
    dst_array: H,
    reserved1: H,
    dst_pitch: usize,
    dst_height: usize,
    width: usize,
    height: usize,
    depth: usize,
}

const MEMORYTYPE_HOST: c_int = 1;
const MEMORYTYPE_DEVICE: c_int = 2;
const MEMORYTYPE_ARRAY: c_int = 3;

impl Memcpy3D {
    fn zeroed() -> Memcpy3D {
        Memcpy3D {
            src_x: 0,
            src_y: 0,
            src_z: 0,
            src_lod: 0,
            src_type: 0,
            src_host: null(),
            src_device: 0,
            src_array: null_mut(),
            reserved0: null_mut(),
            src_pitch: 0,
            src_height: 0,
            dst_x: 0,
            dst_y: 0,
            dst_z: 0,
            dst_lod: 0,
            dst_type: 0,
            dst_host: null_mut(),
            dst_device: 0,
            dst_array: null_mut(),
            reserved1: null_mut(),
            dst_pitch: 0,
            dst_height: 0,
            width: 0,
            height: 1,
            depth: 1,
        }
    }

    fn dtod(dst: Ptr, src: Ptr, bytes: usize) -> Memcpy3D {
        Memcpy3D {
            src_type: MEMORYTYPE_DEVICE,
            src_device: src,
            dst_type: MEMORYTYPE_DEVICE,
            dst_device: dst,
            width: bytes,
            ..Memcpy3D::zeroed()
        }
    }

    fn dtoh(dst: H, src: Ptr, bytes: usize) -> Memcpy3D {
        Memcpy3D {
            src_type: MEMORYTYPE_DEVICE,
            src_device: src,
            dst_type: MEMORYTYPE_HOST,
            dst_host: dst,
            width: bytes,
            ..Memcpy3D::zeroed()
        }
    }

    fn htod(dst: Ptr, src: *const c_void, bytes: usize) -> Memcpy3D {
        Memcpy3D {
            src_type: MEMORYTYPE_HOST,
            src_host: src,
            dst_type: MEMORYTYPE_DEVICE,
            dst_device: dst,
            width: bytes,
            ..Memcpy3D::zeroed()
        }
    }
}

/// `CUDA_MEMSET_NODE_PARAMS`.
#[repr(C)]
struct MemsetParams {
    dst: Ptr,
    pitch: usize,
    value: c_uint,
    element_size: c_uint,
    width: usize,
    height: usize,
}

/// `CUDA_HOST_NODE_PARAMS`.
#[repr(C)]
struct HostParams {
    func: HostFn,
    user_data: H,
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (with its `CUmemPoolProps` spelled out).
#[repr(C)]
struct MemAllocParams {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_security_attributes: H,
    max_size: usize,
    usage: u16,
    reserved: [u8; 54],
    access_descs: *const c_void,
    access_desc_count: usize,
    bytesize: usize,
    dptr: Ptr,
}

impl MemAllocParams {
    /// `bytes` of device memory on `dev`.
    fn device(dev: c_int, bytes: usize) -> MemAllocParams {
        MemAllocParams {
            alloc_type: 1,
            handle_types: 0,
            location_type: 1,
            location_id: dev,
            win32_security_attributes: null_mut(),
            max_size: 0,
            usage: 0,
            reserved: [0; 54],
            access_descs: null(),
            access_desc_count: 0,
            bytesize: bytes,
            dptr: 0,
        }
    }
}

/// `CUgraphExecUpdateResultInfo`.
#[repr(C)]
struct UpdateInfo {
    result: c_int,
    error_node: H,
    error_from_node: H,
}

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

/// The driver functions these tests use.
struct Cu {
    init: unsafe extern "system" fn(c_uint) -> R,
    retain: unsafe extern "system" fn(*mut H, c_int) -> R,
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
    event_sync: unsafe extern "system" fn(H) -> R,
    mem_alloc: unsafe extern "system" fn(*mut Ptr, usize) -> R,
    mem_free: unsafe extern "system" fn(Ptr) -> R,
    host_alloc: unsafe extern "system" fn(*mut *mut c_void, usize, c_uint) -> R,
    free_host: unsafe extern "system" fn(*mut c_void) -> R,
    memset_d32: unsafe extern "system" fn(Ptr, c_uint, usize) -> R,
    memset_d32_async: unsafe extern "system" fn(Ptr, c_uint, usize, H) -> R,
    htod: unsafe extern "system" fn(Ptr, *const c_void, usize) -> R,
    dtoh: unsafe extern "system" fn(*mut c_void, Ptr, usize) -> R,
    htod_async: unsafe extern "system" fn(Ptr, *const c_void, usize, H) -> R,
    dtod_async: unsafe extern "system" fn(Ptr, Ptr, usize, H) -> R,
    alloc_async: unsafe extern "system" fn(*mut Ptr, usize, H) -> R,
    free_async: unsafe extern "system" fn(Ptr, H) -> R,
    launch_host_func: unsafe extern "system" fn(H, HostFn, H) -> R,
    module_load: unsafe extern "system" fn(*mut H, *const c_void) -> R,
    module_unload: unsafe extern "system" fn(H) -> R,
    get_function: unsafe extern "system" fn(*mut H, H, *const c_char) -> R,
    launch: Launch,
    begin_capture: unsafe extern "system" fn(H, c_int) -> R,
    end_capture: unsafe extern "system" fn(H, *mut H) -> R,
    is_capturing: unsafe extern "system" fn(H, *mut c_int) -> R,
    capture_info:
        unsafe extern "system" fn(H, *mut c_int, *mut u64, *mut H, *mut *const H, *mut *const u64, *mut usize) -> R,
    exchange_mode: unsafe extern "system" fn(*mut c_int) -> R,
    graph_create: unsafe extern "system" fn(*mut H, c_uint) -> R,
    graph_destroy: unsafe extern "system" fn(H) -> R,
    graph_clone: unsafe extern "system" fn(*mut H, H) -> R,
    get_nodes: unsafe extern "system" fn(H, *mut H, *mut usize) -> R,
    root_nodes: unsafe extern "system" fn(H, *mut H, *mut usize) -> R,
    node_type: unsafe extern "system" fn(H, *mut c_int) -> R,
    add_empty: unsafe extern "system" fn(*mut H, H, *const H, usize) -> R,
    add_kernel: unsafe extern "system" fn(*mut H, H, *const H, usize, *const KernelParams) -> R,
    kernel_set_params: unsafe extern "system" fn(H, *const KernelParams) -> R,
    add_memcpy: unsafe extern "system" fn(*mut H, H, *const H, usize, *const Memcpy3D, H) -> R,
    add_memset: unsafe extern "system" fn(*mut H, H, *const H, usize, *const MemsetParams, H) -> R,
    add_host: unsafe extern "system" fn(*mut H, H, *const H, usize, *const HostParams) -> R,
    add_event_record: unsafe extern "system" fn(*mut H, H, *const H, usize, H) -> R,
    add_event_wait: unsafe extern "system" fn(*mut H, H, *const H, usize, H) -> R,
    add_child: unsafe extern "system" fn(*mut H, H, *const H, usize, H) -> R,
    add_mem_alloc: unsafe extern "system" fn(*mut H, H, *const H, usize, *mut MemAllocParams) -> R,
    add_mem_free: unsafe extern "system" fn(*mut H, H, *const H, usize, Ptr) -> R,
    instantiate: unsafe extern "system" fn(*mut H, H, u64) -> R,
    exec_destroy: unsafe extern "system" fn(H) -> R,
    graph_launch: unsafe extern "system" fn(H, H) -> R,
    upload: unsafe extern "system" fn(H, H) -> R,
    exec_update: unsafe extern "system" fn(H, H, *mut UpdateInfo) -> R,
    exec_kernel_set_params: unsafe extern "system" fn(H, H, *const KernelParams) -> R,
    get_mem_attr: unsafe extern "system" fn(c_int, c_int, *mut c_void) -> R,
    set_mem_attr: unsafe extern "system" fn(c_int, c_int, *mut c_void) -> R,
    mem_trim: unsafe extern "system" fn(c_int) -> R,
}

const PTX: &[u8] = b".version 8.4\n.target sm_90\n.address_size 64\n\
.visible .entry fill_u32(.param .u64 o, .param .u32 v, .param .u64 n) { ret; }\n\
.visible .entry spin_fill_u32(.param .u64 o, .param .u32 v, .param .u64 n, .param .u64 us) { ret; }\n\0";

/// The values of a fill_u32 / spin_fill_u32 launch, whose addresses make its `kernelParams`.
struct Args {
    out: Ptr,
    value: u32,
    n: u64,
    spin_us: u64,
}

impl Args {
    fn new(out: Ptr, value: u32, n: u64) -> Args {
        Args { out, value, n, spin_us: 0 }
    }

    fn ptrs(&mut self) -> [*mut c_void; 4] {
        [
            (&raw mut self.out).cast(),
            (&raw mut self.value).cast(),
            (&raw mut self.n).cast(),
            (&raw mut self.spin_us).cast(),
        ]
    }
}

#[track_caller]
fn ok(r: R) {
    assert_eq!(r, 0, "driver call failed with {r}");
}

impl Cu {
    fn load() -> Cu {
        Cu {
            init: f!("cuInit"),
            retain: f!("cuDevicePrimaryCtxRetain"),
            set_current: f!("cuCtxSetCurrent"),
            ctx_sync: f!("cuCtxSynchronize"),
            stream_create: f!("cuStreamCreate"),
            stream_destroy: f!("cuStreamDestroy_v2"),
            stream_sync: f!("cuStreamSynchronize"),
            stream_query: f!("cuStreamQuery"),
            stream_wait_event: f!("cuStreamWaitEvent"),
            event_create: f!("cuEventCreate"),
            event_destroy: f!("cuEventDestroy_v2"),
            event_record: f!("cuEventRecord"),
            event_query: f!("cuEventQuery"),
            event_sync: f!("cuEventSynchronize"),
            mem_alloc: f!("cuMemAlloc_v2"),
            mem_free: f!("cuMemFree_v2"),
            host_alloc: f!("cuMemHostAlloc"),
            free_host: f!("cuMemFreeHost"),
            memset_d32: f!("cuMemsetD32_v2"),
            memset_d32_async: f!("cuMemsetD32Async"),
            htod: f!("cuMemcpyHtoD_v2"),
            dtoh: f!("cuMemcpyDtoH_v2"),
            htod_async: f!("cuMemcpyHtoDAsync_v2"),
            dtod_async: f!("cuMemcpyDtoDAsync_v2"),
            alloc_async: f!("cuMemAllocAsync"),
            free_async: f!("cuMemFreeAsync"),
            launch_host_func: f!("cuLaunchHostFunc"),
            module_load: f!("cuModuleLoadData"),
            module_unload: f!("cuModuleUnload"),
            get_function: f!("cuModuleGetFunction"),
            launch: f!("cuLaunchKernel"),
            begin_capture: f!("cuStreamBeginCapture_v2"),
            end_capture: f!("cuStreamEndCapture"),
            is_capturing: f!("cuStreamIsCapturing"),
            capture_info: f!("cuStreamGetCaptureInfo_v3"),
            exchange_mode: f!("cuThreadExchangeStreamCaptureMode"),
            graph_create: f!("cuGraphCreate"),
            graph_destroy: f!("cuGraphDestroy"),
            graph_clone: f!("cuGraphClone"),
            get_nodes: f!("cuGraphGetNodes"),
            root_nodes: f!("cuGraphGetRootNodes"),
            node_type: f!("cuGraphNodeGetType"),
            add_empty: f!("cuGraphAddEmptyNode"),
            add_kernel: f!("cuGraphAddKernelNode_v2"),
            kernel_set_params: f!("cuGraphKernelNodeSetParams_v2"),
            add_memcpy: f!("cuGraphAddMemcpyNode"),
            add_memset: f!("cuGraphAddMemsetNode"),
            add_host: f!("cuGraphAddHostNode"),
            add_event_record: f!("cuGraphAddEventRecordNode"),
            add_event_wait: f!("cuGraphAddEventWaitNode"),
            add_child: f!("cuGraphAddChildGraphNode"),
            add_mem_alloc: f!("cuGraphAddMemAllocNode"),
            add_mem_free: f!("cuGraphAddMemFreeNode"),
            instantiate: f!("cuGraphInstantiateWithFlags"),
            exec_destroy: f!("cuGraphExecDestroy"),
            graph_launch: f!("cuGraphLaunch"),
            upload: f!("cuGraphUpload"),
            exec_update: f!("cuGraphExecUpdate_v2"),
            exec_kernel_set_params: f!("cuGraphExecKernelNodeSetParams_v2"),
            get_mem_attr: f!("cuDeviceGetGraphMemAttribute"),
            set_mem_attr: f!("cuDeviceSetGraphMemAttribute"),
            mem_trim: f!("cuDeviceGraphMemTrim"),
        }
    }

    /// cuInit + retain device 0's primary context and make it current; returns the context too.
    fn setup() -> (Cu, H) {
        let cu = Cu::load();
        let mut ctx = null_mut();
        // SAFETY (here and in the rest of this file): the arguments follow the documented driver
        // API contracts; out-pointers point at live locals; what graphs refer to outlives their
        // launches.
        unsafe {
            ok((cu.init)(0));
            ok((cu.retain)(&mut ctx, 0));
            ok((cu.set_current)(ctx));
        }
        (cu, ctx)
    }

    fn alloc(&self, n: usize) -> Ptr {
        let mut p = 0;
        // SAFETY: see `setup`.
        unsafe { ok((self.mem_alloc)(&mut p, n)) };
        p
    }

    fn free(&self, p: Ptr) {
        // SAFETY: see `setup`.
        unsafe { ok((self.mem_free)(p)) };
    }

    fn fill(&self, p: Ptr, value: u32, n: usize) {
        // SAFETY: see `setup`.
        unsafe { ok((self.memset_d32)(p, value, n)) };
    }

    fn read_u32(&self, p: Ptr, n: usize) -> Vec<u32> {
        let mut v = vec![0u32; n];
        // SAFETY: see `setup`; `v` holds n * 4 bytes.
        unsafe { ok((self.dtoh)(v.as_mut_ptr().cast(), p, n * 4)) };
        v
    }

    fn stream(&self, flags: c_uint) -> H {
        let mut s = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.stream_create)(&mut s, flags)) };
        s
    }

    fn event(&self) -> H {
        let mut e = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.event_create)(&mut e, 2)) };
        e
    }

    fn sync(&self, s: H) {
        // SAFETY: see `setup`.
        unsafe { ok((self.stream_sync)(s)) };
    }

    fn begin(&self, s: H, mode: c_int) -> R {
        // SAFETY: see `setup`.
        unsafe { (self.begin_capture)(s, mode) }
    }

    fn end(&self, s: H) -> (R, H) {
        let mut g = std::ptr::without_provenance_mut(7);
        // SAFETY: see `setup`.
        let r = unsafe { (self.end_capture)(s, &mut g) };
        (r, g)
    }

    fn status(&self, s: H) -> c_int {
        let mut st = -1;
        // SAFETY: see `setup`.
        unsafe { ok((self.is_capturing)(s, &mut st)) };
        st
    }

    /// (status, id, graph, dependencies) of `cuStreamGetCaptureInfo_v3`.
    fn info(&self, s: H) -> (c_int, u64, H, Vec<H>) {
        let (mut st, mut id, mut g, mut deps, mut edges, mut n) = (-1, 0, null_mut(), null(), null(), 0usize);
        // SAFETY: see `setup`; the arrays belong to the driver and are read at once.
        unsafe {
            ok((self.capture_info)(s, &mut st, &mut id, &mut g, &mut deps, &mut edges, &mut n));
            let deps = if n == 0 { Vec::new() } else { std::slice::from_raw_parts(deps, n).to_vec() };
            if n > 0 {
                assert!(std::slice::from_raw_parts(edges, n).iter().all(|&e| e == 0), "edge data is all zero");
            }
            (st, id, g, deps)
        }
    }

    fn graph(&self) -> H {
        let mut g = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.graph_create)(&mut g, 0)) };
        g
    }

    fn nodes(&self, g: H) -> Vec<H> {
        let mut n = 0usize;
        // SAFETY: see `setup`; the array has room for `n` nodes.
        unsafe {
            ok((self.get_nodes)(g, null_mut(), &mut n));
            let mut v = vec![null_mut(); n];
            ok((self.get_nodes)(g, v.as_mut_ptr(), &mut n));
            assert_eq!(n, v.len());
            v
        }
    }

    fn roots(&self, g: H) -> Vec<H> {
        let mut v = vec![null_mut(); 16];
        let mut n = v.len();
        // SAFETY: see `setup`; the array has room for `n` nodes.
        unsafe { ok((self.root_nodes)(g, v.as_mut_ptr(), &mut n)) };
        assert!(v[n..].iter().all(|p| p.is_null()), "the rest is NULL");
        v.truncate(n);
        v
    }

    fn types(&self, g: H) -> Vec<c_int> {
        self.nodes(g)
            .into_iter()
            .map(|n| {
                let mut t = -1;
                // SAFETY: see `setup`.
                unsafe { ok((self.node_type)(n, &mut t)) };
                t
            })
            .collect()
    }

    fn instantiate(&self, g: H) -> H {
        let mut x = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.instantiate)(&mut x, g, 0)) };
        x
    }

    fn launch_graph(&self, x: H, s: H) {
        // SAFETY: see `setup`.
        unsafe { ok((self.graph_launch)(x, s)) };
    }

    fn destroy_graph(&self, g: H) {
        // SAFETY: see `setup`.
        unsafe { ok((self.graph_destroy)(g)) };
    }

    fn destroy_exec(&self, x: H) {
        // SAFETY: see `setup`.
        unsafe { ok((self.exec_destroy)(x)) };
    }

    fn mem_attr(&self, attr: c_int) -> u64 {
        let mut v = u64::MAX;
        // SAFETY: see `setup`; the attribute is a cuuint64_t.
        unsafe { ok((self.get_mem_attr)(0, attr, (&raw mut v).cast())) };
        v
    }

    /// Loads the kernels: (module, fill_u32, spin_fill_u32).
    fn kernels(&self) -> (H, H, H) {
        let mut m = null_mut();
        let (mut fill, mut spin) = (null_mut(), null_mut());
        // SAFETY: see `setup`; the PTX is NUL-terminated.
        unsafe {
            ok((self.module_load)(&mut m, PTX.as_ptr().cast()));
            ok((self.get_function)(&mut fill, m, c"fill_u32".as_ptr()));
            ok((self.get_function)(&mut spin, m, c"spin_fill_u32".as_ptr()));
        }
        (m, fill, spin)
    }

    /// Launches fill_u32 (or spin_fill_u32 when `args.spin_us` > 0) on `s`.
    fn launch_fill(&self, func: H, args: &mut Args, s: H) -> R {
        let mut p = args.ptrs();
        // SAFETY: see `setup`; `p` points at values of the kernel's parameter types.
        unsafe { (self.launch)(func, 4, 1, 1, 128, 1, 1, 0, s, p.as_mut_ptr(), null_mut()) }
    }

    /// Adds a fill_u32 / spin_fill_u32 node.
    fn add_fill(&self, g: H, deps: &[H], func: H, args: &mut Args) -> (R, H) {
        let mut p = args.ptrs();
        let params = kparams(func, &mut p);
        let mut node = null_mut();
        // SAFETY: see `setup`; the driver copies the arguments now.
        let r = unsafe { (self.add_kernel)(&mut node, g, deps.as_ptr(), deps.len(), &params) };
        (r, node)
    }

    fn add_memset_u32(&self, g: H, deps: &[H], dst: Ptr, value: u32, n: usize, ctx: H) -> H {
        let p = MemsetParams { dst, pitch: 0, value, element_size: 4, width: n, height: 1 };
        let mut node = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.add_memset)(&mut node, g, deps.as_ptr(), deps.len(), &p, ctx)) };
        node
    }

    fn add_copy(&self, g: H, deps: &[H], p: &Memcpy3D, ctx: H) -> (R, H) {
        let mut node = null_mut();
        // SAFETY: see `setup`.
        let r = unsafe { (self.add_memcpy)(&mut node, g, deps.as_ptr(), deps.len(), p, ctx) };
        (r, node)
    }

    fn add_host_fn(&self, g: H, deps: &[H], func: HostFn, user_data: H) -> H {
        let p = HostParams { func, user_data };
        let mut node = null_mut();
        // SAFETY: see `setup`.
        unsafe { ok((self.add_host)(&mut node, g, deps.as_ptr(), deps.len(), &p)) };
        node
    }
}

fn kparams(func: H, args: &mut [*mut c_void; 4]) -> KernelParams {
    KernelParams {
        func,
        grid: [4, 1, 1],
        block: [128, 1, 1],
        shared_mem: 0,
        kernel_params: args.as_mut_ptr(),
        extra: null_mut(),
        kern: null_mut(),
        ctx: null_mut(),
    }
}

/// A host function that adds one to the `AtomicU64` its data points at.
unsafe extern "system" fn count_up(data: *mut c_void) {
    // SAFETY: the tests pass a pointer to an AtomicU64 that outlives every launch.
    unsafe { &*data.cast::<AtomicU64>() }.fetch_add(1, Ordering::SeqCst);
}

fn as_data(counter: &AtomicU64) -> H {
    std::ptr::from_ref(counter).cast_mut().cast()
}

/// A capture of a kernel, a memset, a copy and a host function becomes a graph of four nodes, in
/// order; nothing runs until it is launched; 100 launches compute the data and call the host
/// function 100 times.
#[test]
fn captured_graph_runs_at_each_launch() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, _ctx) = Cu::setup();
        let (m, fill, _) = cu.kernels();
        const N: usize = 4096;
        let (a, b, c) = (cu.alloc(N * 4), cu.alloc(N * 4), cu.alloc(N * 4));
        let s = cu.stream(NON_BLOCKING);
        let calls = AtomicU64::new(0);
        ok(cu.begin(s, THREAD_LOCAL));
        assert_eq!(cu.status(s), STATUS_ACTIVE);
        let (st, id, g_during, deps) = cu.info(s);
        assert_eq!((st, deps.len()), (STATUS_ACTIVE, 0));
        assert!(id > 0);
        ok(cu.launch_fill(fill, &mut Args::new(a, 7, N as u64), s));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.memset_d32_async)(b, 0xabcd_0123, N, s));
            ok((cu.dtod_async)(c, a, N * 4, s));
            ok((cu.launch_host_func)(s, count_up, as_data(&calls)));
        }
        let (_, id2, _, deps) = cu.info(s);
        assert_eq!(id2, id);
        assert_eq!(deps.len(), 1);
        assert_eq!(cu.nodes(g_during).last().copied(), Some(deps[0]), "depends on the last node");
        let (r, g) = cu.end(s);
        ok(r);
        assert_eq!(g, g_during);
        assert_eq!(cu.status(s), STATUS_NONE);
        assert_eq!(cu.info(s).1, 0);
        assert_eq!(cu.types(g), [NODE_KERNEL, NODE_MEMSET, NODE_MEMCPY, NODE_HOST]);
        assert_eq!(cu.roots(g).len(), 1);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert!(cu.read_u32(a, N).iter().all(|&x| x == 0), "the capture ran nothing");
        assert!(cu.read_u32(c, N).iter().all(|&x| x == 0), "the capture ran nothing");

        let x = cu.instantiate(g);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.upload)(x, s)) };
        for _ in 0..100 {
            cu.launch_graph(x, s);
        }
        cu.sync(s);
        assert_eq!(calls.load(Ordering::SeqCst), 100);
        assert!(cu.read_u32(a, N).iter().all(|&x| x == 7));
        assert!(cu.read_u32(b, N).iter().all(|&x| x == 0xabcd_0123));
        assert!(cu.read_u32(c, N).iter().all(|&x| x == 7));

        // A launch that reruns the copy after the data changed.
        cu.fill(c, 0, N);
        cu.launch_graph(x, s);
        cu.sync(s);
        assert!(cu.read_u32(c, N).iter().all(|&x| x == 7));
        assert_eq!(calls.load(Ordering::SeqCst), 101);

        // A graph launch inside a capture becomes a child graph node.
        let s2 = cu.stream(NON_BLOCKING);
        ok(cu.begin(s2, GLOBAL));
        cu.launch_graph(x, s2);
        let (r, outer) = cu.end(s2);
        ok(r);
        assert_eq!(cu.types(outer), [NODE_GRAPH]);
        cu.fill(c, 0, N);
        let y = cu.instantiate(outer);
        cu.launch_graph(y, s2);
        cu.sync(s2);
        assert!(cu.read_u32(c, N).iter().all(|&x| x == 7));
        assert_eq!(calls.load(Ordering::SeqCst), 102);

        // A captured copy from pageable host memory reads it when the node runs.
        let mut src = vec![1u32; 64];
        let dst = cu.alloc(256);
        ok(cu.begin(s, GLOBAL));
        // SAFETY: see `Cu::setup`; `src` outlives the launch below.
        unsafe { ok((cu.htod_async)(dst, src.as_ptr().cast(), 256, s)) };
        let (r, gh) = cu.end(s);
        ok(r);
        src.fill(2);
        let xh = cu.instantiate(gh);
        cu.launch_graph(xh, s);
        cu.sync(s);
        assert_eq!(cu.read_u32(dst, 64), vec![2; 64]);
        cu.destroy_exec(xh);
        cu.destroy_graph(gh);
        cu.free(dst);

        assert_eq!((live_graphs(), live_graph_execs()), (2, 2));
        cu.destroy_exec(x);
        cu.destroy_exec(y);
        cu.destroy_graph(g);
        cu.destroy_graph(outer);
        // SAFETY: see `Cu::setup`.
        unsafe {
            assert_eq!((cu.graph_destroy)(g), INVALID_HANDLE);
            assert_eq!((cu.exec_destroy)(x), INVALID_HANDLE);
            ok((cu.stream_destroy)(s));
            ok((cu.stream_destroy)(s2));
            ok((cu.module_unload)(m));
        }
        for p in [a, b, c] {
            cu.free(p);
        }
        assert_no_leaks();
    });
}

/// Fork and join through events: the second stream joins the capture (same id), its slow kernel
/// becomes a dependency of the copy that the origin stream queues after joining it back.
#[test]
fn capture_forks_and_joins_streams_through_events() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, _ctx) = Cu::setup();
        let (m, _, spin) = cu.kernels();
        const N: usize = 1024;
        let (a, b) = (cu.alloc(N * 4), cu.alloc(N * 4));
        let (s1, s2, s3) = (cu.stream(NON_BLOCKING), cu.stream(NON_BLOCKING), cu.stream(NON_BLOCKING));
        let (fork, join) = (cu.event(), cu.event());
        ok(cu.begin(s1, GLOBAL));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.memset_d32_async)(a, 1, N, s1));
            ok((cu.event_record)(fork, s1));
            assert_eq!(cu.status(s2), STATUS_NONE);
            ok((cu.stream_wait_event)(s2, fork, 0));
        }
        let (st1, id1, g1, deps1) = cu.info(s1);
        let (st2, id2, g2, deps2) = cu.info(s2);
        assert_eq!((st1, st2), (STATUS_ACTIVE, STATUS_ACTIVE));
        assert_eq!((id1, g1), (id2, g2), "s2 joined s1's capture");
        assert_eq!(deps1, deps2, "s2 starts from the event's dependencies");
        let mut args = Args { out: a, value: 5, n: N as u64, spin_us: 30_000 };
        ok(cu.launch_fill(spin, &mut args, s2));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_record)(join, s2));
            ok((cu.stream_wait_event)(s1, join, 0));
            ok((cu.dtod_async)(b, a, N * 4, s1));
        }
        let (r, g) = cu.end(s1);
        ok(r);
        assert_eq!(cu.status(s2), STATUS_NONE, "ending the capture ends it for every stream");
        assert_eq!(cu.types(g), [NODE_MEMSET, NODE_KERNEL, NODE_MEMCPY], "events make no nodes");
        assert_eq!(cu.roots(g).len(), 1, "the copy depends on the kernel, the kernel on the memset");
        // The events are as before the capture (never recorded).
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_query)(fork));
            ok((cu.event_query)(join));
        }
        let x = cu.instantiate(g);
        cu.launch_graph(x, s3);
        cu.sync(s3);
        assert!(cu.read_u32(b, N).iter().all(|&v| v == 5), "the joined stream's kernel ran before the copy");
        cu.destroy_exec(x);
        cu.destroy_graph(g);
        // SAFETY: see `Cu::setup`.
        unsafe {
            for s in [s1, s2, s3] {
                ok((cu.stream_destroy)(s));
            }
            ok((cu.event_destroy)(fork));
            ok((cu.event_destroy)(join));
            ok((cu.module_unload)(m));
        }
        cu.free(a);
        cu.free(b);
        assert_no_leaks();
    });
}

/// Work of a joined stream that is not joined back: UNJOINED, no graph, every stream released.
/// Ending on the joined stream: UNMATCHED, which invalidates the capture.
#[test]
fn unjoined_and_unmatched_captures_fail() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, _ctx) = Cu::setup();
        let p = cu.alloc(4096);
        let (s1, s2) = (cu.stream(NON_BLOCKING), cu.stream(NON_BLOCKING));
        let e = cu.event();
        for _ in 0..2 {
            ok(cu.begin(s1, GLOBAL));
            // SAFETY: see `Cu::setup`.
            unsafe {
                ok((cu.memset_d32_async)(p, 1, 1024, s1));
                ok((cu.event_record)(e, s1));
                ok((cu.stream_wait_event)(s2, e, 0));
                ok((cu.memset_d32_async)(p, 2, 1024, s2));
            }
            let (r, g) = cu.end(s1);
            assert_eq!(r, CAPTURE_UNJOINED);
            assert!(g.is_null());
            assert_eq!((cu.status(s1), cu.status(s2)), (STATUS_NONE, STATUS_NONE));
            assert_eq!(live_graphs(), 0);
        }
        // A joined stream with no work of its own needs no join.
        ok(cu.begin(s1, GLOBAL));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_record)(e, s1));
            ok((cu.stream_wait_event)(s2, e, 0));
        }
        let (r, g) = cu.end(s1);
        ok(r);
        assert_eq!(cu.nodes(g).len(), 0);
        cu.destroy_graph(g);

        ok(cu.begin(s1, GLOBAL));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.event_record)(e, s1));
            ok((cu.stream_wait_event)(s2, e, 0));
        }
        assert_eq!(cu.end(s2), (CAPTURE_UNMATCHED, null_mut()));
        assert_eq!(cu.status(s1), STATUS_INVALIDATED);
        assert_eq!(cu.end(s1), (CAPTURE_INVALIDATED, null_mut()));
        assert_eq!(cu.end(s1).0, ILLEGAL_STATE, "not capturing any more");
        // The streams work again.
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.memset_d32_async)(p, 3, 1024, s2));
            ok((cu.stream_sync)(s2));
        }
        assert!(cu.read_u32(p, 1024).iter().all(|&v| v == 3));
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_destroy)(s1));
            ok((cu.stream_destroy)(s2));
            ok((cu.event_destroy)(e));
        }
        cu.free(p);
        assert_no_leaks();
    });
}

/// A GLOBAL or THREAD_LOCAL capture ends on the thread that began it (WRONG_THREAD elsewhere, and
/// the capture goes on); a RELAXED one on any thread.
#[test]
fn capture_ends_on_its_thread_unless_relaxed() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, ctx) = Cu::setup();
        let s = cu.stream(NON_BLOCKING);
        let (ctx_addr, s_addr) = (ctx as usize, s as usize);
        let end_elsewhere = || {
            std::thread::spawn(move || {
                let cu = Cu::load();
                let mut g = null_mut();
                // SAFETY: see `Cu::setup`; the context and stream are alive.
                unsafe {
                    ok((cu.set_current)(ctx_addr as H));
                    let r = (cu.end_capture)(s_addr as H, &mut g);
                    (r, g as usize)
                }
            })
            .join()
            .unwrap()
        };
        for mode in [GLOBAL, THREAD_LOCAL] {
            ok(cu.begin(s, mode));
            assert_eq!(end_elsewhere(), (CAPTURE_WRONG_THREAD, 0));
            assert_eq!(cu.status(s), STATUS_ACTIVE, "the capture goes on");
            let (r, g) = cu.end(s);
            ok(r);
            cu.destroy_graph(g);
        }
        ok(cu.begin(s, RELAXED));
        let (r, g) = end_elsewhere();
        ok(r);
        assert_eq!(cu.status(s), STATUS_NONE);
        cu.destroy_graph(g as H);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.stream_destroy)(s)) };
        assert_no_leaks();
    });
}

/// Synchronising or querying a capturing stream fails with 900 and invalidates the capture: later
/// work on it fails with 901, and so does ending it; the stream is usable afterwards.
#[test]
fn sync_of_a_capturing_stream_invalidates_the_capture() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, _ctx) = Cu::setup();
        let p = cu.alloc(4096);
        let s = cu.stream(NON_BLOCKING);
        for query in [false, true] {
            ok(cu.begin(s, GLOBAL));
            // SAFETY: see `Cu::setup`.
            unsafe {
                ok((cu.memset_d32_async)(p, 9, 1024, s));
                let r = if query { (cu.stream_query)(s) } else { (cu.stream_sync)(s) };
                assert_eq!(r, CAPTURE_UNSUPPORTED);
            }
            assert_eq!(cu.status(s), STATUS_INVALIDATED);
            let (st, id, g, _) = cu.info(s);
            assert_eq!(st, STATUS_INVALIDATED);
            assert!(id > 0 && g.is_null());
            // SAFETY: see `Cu::setup`.
            unsafe { assert_eq!((cu.memset_d32_async)(p, 9, 1024, s), CAPTURE_INVALIDATED) };
            assert_eq!(cu.end(s), (CAPTURE_INVALIDATED, null_mut()));
            assert_eq!(cu.status(s), STATUS_NONE);
            assert_eq!(live_graphs(), 0);
        }
        assert!(cu.read_u32(p, 1024).iter().all(|&v| v == 0), "nothing captured ran");
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.memset_d32_async)(p, 4, 1024, s));
            ok((cu.stream_sync)(s));
        }
        assert!(cu.read_u32(p, 1024).iter().all(|&v| v == 4));
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.stream_destroy)(s)) };
        cu.free(p);
        assert_no_leaks();
    });
}

/// What else a capture refuses: the legacy stream, a second begin, ending without capturing,
/// unsafe calls the capture mode prohibits, the legacy stream's implicit dependency on a blocking
/// capturing stream, captured events, waits across the capture boundary. cuMemAlloc stays allowed.
#[test]
fn prohibited_operations_during_capture() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, _ctx) = Cu::setup();
        let p = cu.alloc(4096);
        let host = [0u8; 64];
        let s = cu.stream(NON_BLOCKING);
        let e = cu.event();
        // SAFETY (whole block): see `Cu::setup`.
        unsafe {
            assert_eq!(cu.begin(legacy(), GLOBAL), CAPTURE_UNSUPPORTED);
            assert_eq!(cu.begin(s, 3), INVALID_VALUE);
            assert_eq!(cu.end(s).0, ILLEGAL_STATE);

            // Synchronous copies on the capturing thread: prohibited in GLOBAL mode.
            ok(cu.begin(s, GLOBAL));
            assert_eq!(cu.begin(s, GLOBAL), ILLEGAL_STATE);
            // cuMemAlloc is a potentially unsafe call too (the H200's driver answers so:
            // scripts/capture-probe.py).
            let mut q = 0;
            assert_eq!((cu.mem_alloc)(&mut q, 64), CAPTURE_UNSUPPORTED);
            assert_eq!((cu.htod)(p, host.as_ptr().cast(), 64), CAPTURE_UNSUPPORTED);
            assert_eq!(cu.end(s), (CAPTURE_INVALIDATED, null_mut()));

            // ... not once the thread is RELAXED.
            ok(cu.begin(s, THREAD_LOCAL));
            let mut mode = RELAXED;
            ok((cu.exchange_mode)(&mut mode));
            assert_eq!(mode, GLOBAL, "the default mode");
            ok((cu.htod)(p, host.as_ptr().cast(), 64));
            ok((cu.exchange_mode)(&mut mode));
            assert_eq!(mode, RELAXED);
            let mut bad = 7;
            assert_eq!((cu.exchange_mode)(&mut bad), INVALID_VALUE);
            assert_eq!((cu.event_query)(e), CAPTURE_UNSUPPORTED, "an unsafe call in THREAD_LOCAL mode");
            assert_eq!(cu.end(s).0, CAPTURE_INVALIDATED);

            // A RELAXED capture allows unsafe calls, but not a context synchronisation.
            ok(cu.begin(s, RELAXED));
            ok((cu.htod)(p, host.as_ptr().cast(), 64));
            ok((cu.event_query)(e));
            let q = cu.alloc(64);
            cu.free(q);
            assert_eq!((cu.ctx_sync)(), CAPTURE_UNSUPPORTED);
            assert_eq!(cu.end(s).0, CAPTURE_INVALIDATED);

            // An event recorded in the capture cannot be queried or waited for on the host.
            ok(cu.begin(s, RELAXED));
            ok((cu.event_record)(e, s));
            assert_eq!((cu.event_query)(e), CAPTURED_EVENT);
            assert_eq!((cu.event_sync)(e), CAPTURED_EVENT);
            assert_eq!(cu.end(s).0, CAPTURE_INVALIDATED);

            // Waiting on work recorded outside the capture.
            ok((cu.event_record)(e, legacy()));
            ok(cu.begin(s, GLOBAL));
            assert_eq!((cu.stream_wait_event)(s, e, 0), CAPTURE_ISOLATION);
            assert_eq!(cu.end(s).0, CAPTURE_INVALIDATED);
            // ... unless as an external wait: an event wait node.
            ok(cu.begin(s, GLOBAL));
            ok((cu.stream_wait_event)(s, e, 1));
            let (r, g) = cu.end(s);
            ok(r);
            assert_eq!(cu.types(g), [NODE_WAIT_EVENT]);
            cu.destroy_graph(g);

            // Two captures cannot merge.
            let s2 = cu.stream(NON_BLOCKING);
            let e2 = cu.event();
            ok(cu.begin(s, GLOBAL));
            ok(cu.begin(s2, GLOBAL));
            ok((cu.event_record)(e2, s2));
            assert_eq!((cu.stream_wait_event)(s, e2, 0), CAPTURE_MERGE);
            assert_eq!(cu.end(s).0, CAPTURE_INVALIDATED);
            assert_eq!(cu.end(s2).0, CAPTURE_INVALIDATED);

            // Work on the legacy stream while a blocking stream captures.
            let blocking = cu.stream(0);
            ok(cu.begin(blocking, RELAXED));
            let mut st = -1;
            assert_eq!((cu.is_capturing)(legacy(), &mut st), CAPTURE_IMPLICIT);
            assert_eq!(cu.status(blocking), STATUS_ACTIVE, "a status query does not invalidate");
            assert_eq!((cu.memset_d32_async)(p, 1, 16, legacy()), CAPTURE_IMPLICIT);
            assert_eq!(cu.status(blocking), STATUS_INVALIDATED);
            assert_eq!(cu.end(blocking).0, CAPTURE_INVALIDATED);
            // ... but not while a non-blocking stream captures.
            ok(cu.begin(s, RELAXED));
            ok((cu.memset_d32_async)(p, 1, 16, legacy()));
            ok((cu.stream_sync)(legacy()));
            let (r, g) = cu.end(s);
            ok(r);
            cu.destroy_graph(g);

            for h in [s, s2, blocking] {
                ok((cu.stream_destroy)(h));
            }
            ok((cu.event_destroy)(e));
            ok((cu.event_destroy)(e2));
        }
        cu.free(p);
        assert_no_leaks();
    });
}

/// Capture modes across threads: another thread's unsafe call invalidates a GLOBAL capture (the
/// other thread is in GLOBAL mode), not a THREAD_LOCAL one.
#[test]
fn capture_modes_across_threads() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, ctx) = Cu::setup();
        let p = cu.alloc(4096);
        let s = cu.stream(NON_BLOCKING);
        let (ctx_addr, p_addr) = (ctx as usize, p);
        let sync_memset_elsewhere = || {
            std::thread::spawn(move || {
                let cu = Cu::load();
                // SAFETY: see `Cu::setup`; the context and memory are alive.
                unsafe {
                    ok((cu.set_current)(ctx_addr as H));
                    (cu.memset_d32)(p_addr, 5, 1024)
                }
            })
            .join()
            .unwrap()
        };
        ok(cu.begin(s, GLOBAL));
        assert_eq!(sync_memset_elsewhere(), CAPTURE_UNSUPPORTED);
        assert_eq!(cu.end(s).0, CAPTURE_INVALIDATED);
        ok(cu.begin(s, THREAD_LOCAL));
        ok(sync_memset_elsewhere());
        let (r, g) = cu.end(s);
        ok(r);
        cu.destroy_graph(g);
        assert!(cu.read_u32(p, 1024).iter().all(|&v| v == 5));
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.stream_destroy)(s)) };
        cu.free(p);
        assert_no_leaks();
    });
}

static HOST_NODE_CALLS: AtomicU64 = AtomicU64::new(0);

/// A graph built node by node: memset, kernel, copies (device to device, device to host, host to
/// device), a 2D memset, a host node, event record and wait nodes, a child graph and an empty node,
/// with dependencies; five launches give the right data and five host calls.
#[test]
fn graph_built_node_by_node() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, ctx) = Cu::setup();
        let (m, fill, spin) = cu.kernels();
        const N: usize = 2048;
        let (a, b, c, d, w) = (cu.alloc(N * 4), cu.alloc(N * 4), cu.alloc(N * 4), cu.alloc(N * 4), cu.alloc(N * 4));
        let e2d = cu.alloc(4096);
        let mut pinned = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.host_alloc)(&mut pinned, N * 4, 0)) };
        let source: Vec<u32> = (0..N as u32).collect();
        let (s, s2) = (cu.stream(NON_BLOCKING), cu.stream(NON_BLOCKING));
        let (recorded, waited) = (cu.event(), cu.event());

        let g = cu.graph();
        let set = cu.add_memset_u32(g, &[], a, 0xffff_ffff, N, ctx);
        let (r, kernel) = cu.add_fill(g, &[set], fill, &mut Args::new(a, 9, N as u64));
        ok(r);
        let (r, copy) = cu.add_copy(g, &[kernel], &Memcpy3D::dtod(b, a, N * 4), ctx);
        ok(r);
        let (r, to_host) = cu.add_copy(g, &[copy], &Memcpy3D::dtoh(pinned, b, N * 4), ctx);
        ok(r);
        let host = cu.add_host_fn(g, &[to_host], count_up, as_data(&HOST_NODE_CALLS));
        let mut record = null_mut();
        let mut wait = null_mut();
        let (r, upload) = cu.add_copy(g, &[], &Memcpy3D::htod(c, source.as_ptr().cast(), N * 4), ctx);
        ok(r);
        // 2D memset: 4 rows of 16 bytes, pitch 1024.
        let rows = MemsetParams { dst: e2d, pitch: 1024, value: 0x5a, element_size: 1, width: 16, height: 4 };
        let mut set2d = null_mut();
        // A child graph that copies w to d, after a wait for `waited`.
        let child = cu.graph();
        let (r, _) = cu.add_copy(child, &[], &Memcpy3D::dtod(d, w, N * 4), ctx);
        ok(r);
        let mut child_node = null_mut();
        let mut empty = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.add_event_record)(&mut record, g, [host].as_ptr(), 1, recorded));
            ok((cu.add_event_wait)(&mut wait, g, [upload].as_ptr(), 1, waited));
            ok((cu.add_memset)(&mut set2d, g, null(), 0, &rows, ctx));
            ok((cu.add_child)(&mut child_node, g, [wait].as_ptr(), 1, child));
            ok((cu.add_empty)(&mut empty, g, [record, child_node, set2d].as_ptr(), 3));
        }
        cu.destroy_graph(child); // the node has its own copy
        assert_eq!(
            cu.types(g),
            [
                NODE_MEMSET,
                NODE_KERNEL,
                NODE_MEMCPY,
                NODE_MEMCPY,
                NODE_HOST,
                NODE_MEMCPY,
                NODE_EVENT_RECORD,
                NODE_WAIT_EVENT,
                NODE_MEMSET,
                NODE_GRAPH,
                NODE_EMPTY
            ]
        );
        assert_eq!(cu.roots(g), [set, upload, set2d]);

        // Refusals.
        let mut node = null_mut();
        let other = cu.graph();
        let mut bad = Memcpy3D::dtod(b, a, 64);
        // SAFETY: see `Cu::setup`.
        unsafe {
            assert_eq!((cu.add_empty)(&mut node, g, [set, set].as_ptr(), 2), INVALID_VALUE, "duplicate");
            assert_eq!((cu.add_empty)(&mut node, other, [set].as_ptr(), 1), INVALID_VALUE, "another graph's node");
            assert_eq!((cu.add_empty)(&mut node, g, null(), 1), INVALID_VALUE);
            assert_eq!((cu.add_empty)(&mut node, null_mut(), null(), 0), INVALID_HANDLE);
            bad.height = 2;
            assert_eq!((cu.add_memcpy)(&mut node, g, null(), 0, &bad, ctx), NOT_SUPPORTED, "2D copies");
            bad.height = 1;
            bad.src_type = MEMORYTYPE_ARRAY;
            assert_eq!((cu.add_memcpy)(&mut node, g, null(), 0, &bad, ctx), NOT_SUPPORTED, "arrays");
            let p = MemsetParams { dst: a, pitch: 0, value: 0, element_size: 3, width: 4, height: 1 };
            assert_eq!((cu.add_memset)(&mut node, g, null(), 0, &p, ctx), INVALID_VALUE);
            assert_eq!((cu.add_child)(&mut node, g, null(), 0, g), INVALID_VALUE, "itself");
            let mut x = null_mut();
            assert_eq!((cu.instantiate)(&mut x, g, 4), NOT_SUPPORTED, "device launch");
            assert_eq!((cu.instantiate)(&mut x, g, 16), INVALID_VALUE);
        }
        cu.destroy_graph(other);
        assert_eq!(cu.nodes(g).len(), 11);

        let x = cu.instantiate(g);
        // The graph can change without changing the executable graph.
        let (r, _) = cu.add_fill(g, &[empty], fill, &mut Args::new(a, 1, N as u64));
        ok(r);
        for round in 1..=5u64 {
            // `waited` is recorded after a slow kernel that fills w on another stream: the child's
            // copy of w waits for it.
            cu.fill(w, 0, N);
            cu.fill(c, 0, N);
            let mut args = Args { out: w, value: 0xdead_0000 + round as u32, n: N as u64, spin_us: 20_000 };
            ok(cu.launch_fill(spin, &mut args, s2));
            // SAFETY: see `Cu::setup`.
            unsafe { ok((cu.event_record)(waited, s2)) };
            cu.fill(d, 0, N);
            cu.launch_graph(x, s);
            // SAFETY: see `Cu::setup`; `recorded` is recorded by the launch.
            unsafe { ok((cu.event_sync)(recorded)) };
            assert_eq!(HOST_NODE_CALLS.load(Ordering::SeqCst), round);
            cu.sync(s);
            assert!(cu.read_u32(b, N).iter().all(|&v| v == 9));
            // SAFETY: `pinned` holds N u32, written by the graph.
            let host_copy = unsafe { std::slice::from_raw_parts(pinned.cast::<u32>(), N) };
            assert!(host_copy.iter().all(|&v| v == 9));
            assert_eq!(cu.read_u32(c, N), source, "the upload from pageable host memory");
            assert!(
                cu.read_u32(d, N).iter().all(|&v| v == 0xdead_0000 + round as u32),
                "the child's copy ran after the wait"
            );
            let mut bytes = vec![0u8; 4096];
            // SAFETY: see `Cu::setup`.
            unsafe { ok((cu.dtoh)(bytes.as_mut_ptr().cast(), e2d, 4096)) };
            for (i, &v) in bytes.iter().enumerate() {
                assert_eq!(v, if i % 1024 < 16 && i < 4 * 1024 { 0x5a } else { 0 }, "byte {i}");
            }
        }
        cu.destroy_exec(x);
        cu.destroy_graph(g);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.free_host)(pinned));
            ok((cu.stream_destroy)(s));
            ok((cu.stream_destroy)(s2));
            ok((cu.event_destroy)(recorded));
            ok((cu.event_destroy)(waited));
            ok((cu.module_unload)(m));
        }
        for p in [a, b, c, d, w, e2d] {
            cu.free(p);
        }
        assert_no_leaks();
    });
}

/// cuGraphExecUpdate: a graph of the same shape with another kernel argument updates the
/// executable graph; another topology or node type is refused (910) and changes nothing.
#[test]
fn exec_update_succeeds_or_refuses() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, ctx) = Cu::setup();
        let (m, fill, _) = cu.kernels();
        const N: usize = 512;
        let (a, b) = (cu.alloc(N * 4), cu.alloc(N * 4));
        let s = cu.stream(NON_BLOCKING);
        let build = |value: u32| {
            let g = cu.graph();
            let (r, k) = cu.add_fill(g, &[], fill, &mut Args::new(a, value, N as u64));
            ok(r);
            let (r, _) = cu.add_copy(g, &[k], &Memcpy3D::dtod(b, a, N * 4), ctx);
            ok(r);
            g
        };
        let g1 = build(1);
        let x = cu.instantiate(g1);
        cu.launch_graph(x, s);
        cu.sync(s);
        assert!(cu.read_u32(b, N).iter().all(|&v| v == 1));

        let update = |g: H| {
            let mut info =
                UpdateInfo { result: -1, error_node: std::ptr::without_provenance_mut(9), error_from_node: null_mut() };
            // SAFETY: see `Cu::setup`.
            let r = unsafe { (cu.exec_update)(x, g, &mut info) };
            (r, info)
        };
        let g2 = build(2);
        let (r, info) = update(g2);
        ok(r);
        assert_eq!((info.result, info.error_node), (0, null_mut()));
        cu.launch_graph(x, s);
        cu.sync(s);
        assert!(cu.read_u32(b, N).iter().all(|&v| v == 2), "the updated argument");

        // One more node: the topology changed.
        let g3 = build(3);
        let mut extra = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.add_empty)(&mut extra, g3, null(), 0)) };
        let (r, info) = update(g3);
        assert_eq!((r, info.result), (EXEC_UPDATE_FAILURE, UPDATE_TOPOLOGY_CHANGED));
        // The same nodes, without the edge.
        let g4 = cu.graph();
        let (r, _) = cu.add_fill(g4, &[], fill, &mut Args::new(a, 4, N as u64));
        ok(r);
        let (r, copy4) = cu.add_copy(g4, &[], &Memcpy3D::dtod(b, a, N * 4), ctx);
        ok(r);
        let (r, info) = update(g4);
        assert_eq!((r, info.result, info.error_node), (EXEC_UPDATE_FAILURE, UPDATE_TOPOLOGY_CHANGED, copy4));
        // A memset where the kernel was.
        let g5 = cu.graph();
        let set5 = cu.add_memset_u32(g5, &[], a, 5, N, ctx);
        let (r, _) = cu.add_copy(g5, &[set5], &Memcpy3D::dtod(b, a, N * 4), ctx);
        ok(r);
        let (r, info) = update(g5);
        assert_eq!((r, info.result, info.error_node), (EXEC_UPDATE_FAILURE, UPDATE_NODE_TYPE_CHANGED, set5));
        // A memset of another size cannot update one.
        let g6 = cu.graph();
        let set6 = cu.add_memset_u32(g6, &[], a, 6, N / 2, ctx);
        let (r, _) = cu.add_copy(g6, &[set6], &Memcpy3D::dtod(b, a, N * 4), ctx);
        ok(r);
        let x5 = cu.instantiate(g5);
        let mut info = UpdateInfo { result: -1, error_node: null_mut(), error_from_node: null_mut() };
        // SAFETY: see `Cu::setup`.
        let r = unsafe { (cu.exec_update)(x5, g6, &mut info) };
        assert_eq!((r, info.result, info.error_node), (EXEC_UPDATE_FAILURE, UPDATE_PARAMETERS_CHANGED, set6));

        // Refused updates changed nothing.
        cu.fill(b, 0, N);
        cu.launch_graph(x, s);
        cu.sync(s);
        assert!(cu.read_u32(b, N).iter().all(|&v| v == 2));

        for h in [x, x5] {
            cu.destroy_exec(h);
        }
        for g in [g1, g2, g3, g4, g5, g6] {
            cu.destroy_graph(g);
        }
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_destroy)(s));
            ok((cu.module_unload)(m));
        }
        cu.free(a);
        cu.free(b);
        assert_no_leaks();
    });
}

/// cuGraphExecKernelNodeSetParams changes one executable graph's kernel arguments (named by the
/// graph's node), not the graph's nor another executable graph's; cuGraphKernelNodeSetParams
/// changes the graph's.
#[test]
fn exec_kernel_node_set_params() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, ctx) = Cu::setup();
        let (m, fill, _) = cu.kernels();
        const N: usize = 256;
        let a = cu.alloc(N * 4);
        let s = cu.stream(NON_BLOCKING);
        let g = cu.graph();
        let (r, k) = cu.add_fill(g, &[], fill, &mut Args::new(a, 1, N as u64));
        ok(r);
        let set = cu.add_memset_u32(g, &[], a + N as u64 * 2, 0, 1, ctx);
        let (x1, x2) = (cu.instantiate(g), cu.instantiate(g));
        let run = |x: H| {
            cu.launch_graph(x, s);
            cu.sync(s);
            cu.read_u32(a, N / 2)
        };
        let mut args = Args::new(a, 7, N as u64 / 2);
        let mut p = args.ptrs();
        let params = kparams(fill, &mut p);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.exec_kernel_set_params)(x1, k, &params));
            assert_eq!((cu.exec_kernel_set_params)(x1, set, &params), INVALID_VALUE, "not a kernel node");
            assert_eq!((cu.exec_kernel_set_params)(x1, null_mut(), &params), INVALID_VALUE);
        }
        assert!(run(x1).iter().all(|&v| v == 7));
        assert!(run(x2).iter().all(|&v| v == 1));
        assert!(run(x1).iter().all(|&v| v == 7), "the change stays");
        let x3 = cu.instantiate(g);
        assert!(run(x3).iter().all(|&v| v == 1), "the graph did not change");
        let mut args = Args::new(a, 3, N as u64);
        let mut p = args.ptrs();
        let params = kparams(fill, &mut p);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.kernel_set_params)(k, &params)) };
        let x4 = cu.instantiate(g);
        assert!(run(x4).iter().all(|&v| v == 3));
        assert!(run(x3).iter().all(|&v| v == 1), "instantiated before the change");
        for x in [x1, x2, x3, x4] {
            cu.destroy_exec(x);
        }
        cu.destroy_graph(g);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_destroy)(s));
            ok((cu.module_unload)(m));
        }
        cu.free(a);
        assert_no_leaks();
    });
}

/// cuMemAllocAsync and cuMemFreeAsync in a capture make memory nodes; the allocation keeps its
/// address for every launch and counts in the graph memory attributes until the graph and its
/// executable graph are gone. In tcc mode the memory-node paths are CUDA_ERROR_NOT_SUPPORTED.
#[test]
fn graph_memory_nodes() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, ctx) = Cu::setup();
        const N: usize = 1024;
        let out = cu.alloc(N * 4);
        let s = cu.stream(NON_BLOCKING);
        assert_eq!(cu.mem_attr(MEM_USED_CURRENT), 0);
        ok(cu.begin(s, GLOBAL));
        let mut p = 0;
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.alloc_async)(&mut p, N * 4, s));
            assert_ne!(p, 0);
            ok((cu.memset_d32_async)(p, 0x1234_5678, N, s));
            ok((cu.dtod_async)(out, p, N * 4, s));
            ok((cu.free_async)(p, s));
        }
        let (r, g) = cu.end(s);
        ok(r);
        assert_eq!(cu.types(g), [NODE_MEM_ALLOC, NODE_MEMSET, NODE_MEMCPY, NODE_MEM_FREE]);
        assert!(cu.mem_attr(MEM_USED_CURRENT) >= (N * 4) as u64);
        assert!(cu.mem_attr(MEM_RESERVED_CURRENT) >= (N * 4) as u64);
        assert!(fake_report().live_allocations >= 2, "the graph's allocation is live");
        // SAFETY: see `Cu::setup`.
        unsafe {
            assert_eq!((cu.mem_free)(p), INVALID_VALUE, "freed by its own graph");
            let mut clone = null_mut();
            assert_eq!((cu.graph_clone)(&mut clone, g), INVALID_VALUE);
        }
        let x = cu.instantiate(g);
        let mut second = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { assert_eq!((cu.instantiate)(&mut second, g, 1), INVALID_VALUE, "one executable graph at a time") };
        for _ in 0..3 {
            cu.fill(out, 0, N);
            cu.launch_graph(x, s);
            cu.sync(s);
            assert!(cu.read_u32(out, N).iter().all(|&v| v == 0x1234_5678));
        }
        // A launch still queued keeps the memory.
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.launch_host_func)(s, sleep_a_bit, null_mut()));
        }
        cu.fill(out, 0, N);
        cu.launch_graph(x, s);
        cu.destroy_exec(x);
        cu.destroy_graph(g);
        cu.sync(s);
        assert!(cu.read_u32(out, N).iter().all(|&v| v == 0x1234_5678));
        assert_eq!(cu.mem_attr(MEM_USED_CURRENT), 0);
        assert!(cu.mem_attr(MEM_RESERVED_CURRENT) > 0, "cached until trimmed");
        assert!(cu.mem_attr(MEM_USED_HIGH) >= (N * 4) as u64);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.mem_trim)(0));
            let mut zero = 0u64;
            ok((cu.set_mem_attr)(0, MEM_USED_HIGH, (&raw mut zero).cast()));
            ok((cu.set_mem_attr)(0, MEM_RESERVED_HIGH, (&raw mut zero).cast()));
            let mut one = 1u64;
            assert_eq!((cu.set_mem_attr)(0, MEM_USED_HIGH, (&raw mut one).cast()), INVALID_VALUE);
            assert_eq!((cu.set_mem_attr)(0, MEM_USED_CURRENT, (&raw mut zero).cast()), INVALID_VALUE);
        }
        assert_eq!(cu.mem_attr(MEM_RESERVED_CURRENT), 0);
        assert_eq!(cu.mem_attr(MEM_USED_HIGH), 0);
        assert_eq!(cu.mem_attr(MEM_RESERVED_HIGH), 0);

        // Memory nodes added by hand; an allocation not freed by its graph may be freed outside.
        let g = cu.graph();
        let parent = cu.graph();
        let mut params = MemAllocParams::device(0, 4096);
        let mut alloc = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.add_mem_alloc)(&mut alloc, g, null(), 0, &mut params)) };
        assert_ne!(params.dptr, 0);
        let set = cu.add_memset_u32(g, &[alloc], params.dptr, 0x77, 1024, ctx);
        let (r, _) = cu.add_copy(g, &[set], &Memcpy3D::dtod(out, params.dptr, 4096), ctx);
        ok(r);
        let mut node = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe {
            assert_eq!((cu.add_child)(&mut node, parent, null(), 0, g), INVALID_VALUE, "graph memory in a child");
            assert_eq!((cu.add_mem_free)(&mut node, g, null(), 0, out), INVALID_VALUE, "not graph memory");
            let mut bad = MemAllocParams::device(0, 0);
            assert_eq!((cu.add_mem_alloc)(&mut node, g, null(), 0, &mut bad), INVALID_VALUE);
        }
        cu.destroy_graph(parent);
        let x = cu.instantiate(g);
        cu.launch_graph(x, s);
        cu.sync(s);
        assert_eq!(cu.read_u32(out, 1024), vec![0x77; 1024]);
        // SAFETY: see `Cu::setup`; not freed by its graph: the free outside is accepted.
        unsafe { ok((cu.free_async)(params.dptr, s)) };
        cu.destroy_exec(x);
        cu.destroy_graph(g);
        cu.sync(s);
        assert_eq!(cu.mem_attr(MEM_USED_CURRENT), 0);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.stream_destroy)(s)) };
        cu.free(out);
        assert_no_leaks();
    });
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_MODE", "tcc")], || {
        let (cu, _ctx) = Cu::setup();
        let out = cu.alloc(4096);
        let s = cu.stream(NON_BLOCKING);
        let mut v = 0u64;
        let mut p = 0;
        // SAFETY: see `Cu::setup`.
        unsafe {
            assert_eq!((cu.get_mem_attr)(0, MEM_USED_CURRENT, (&raw mut v).cast()), NOT_SUPPORTED);
            assert_eq!((cu.mem_trim)(0), NOT_SUPPORTED);
            ok(cu.begin(s, GLOBAL));
            assert_eq!((cu.alloc_async)(&mut p, 4096, s), NOT_SUPPORTED);
            ok((cu.memset_d32_async)(out, 3, 1024, s));
        }
        let (r, g) = cu.end(s);
        ok(r); // the refused allocation did not invalidate the capture
        let mut params = MemAllocParams::device(0, 4096);
        let mut node = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { assert_eq!((cu.add_mem_alloc)(&mut node, g, null(), 0, &mut params), NOT_SUPPORTED) };
        let x = cu.instantiate(g);
        cu.launch_graph(x, s);
        cu.sync(s);
        assert_eq!(cu.read_u32(out, 1024), vec![3; 1024]);
        cu.destroy_exec(x);
        cu.destroy_graph(g);
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.stream_destroy)(s)) };
        cu.free(out);
        assert_no_leaks();
    });
}

/// A host function that sleeps 50 ms, so that work queued after it is still queued for a while.
unsafe extern "system" fn sleep_a_bit(_: *mut c_void) {
    std::thread::sleep(std::time::Duration::from_millis(50));
}

static BUSY: AtomicBool = AtomicBool::new(false);
static OVERLAPS: AtomicU64 = AtomicU64::new(0);
static DONE: AtomicU64 = AtomicU64::new(0);

unsafe extern "system" fn launch_starts(_: *mut c_void) {
    if BUSY.swap(true, Ordering::SeqCst) {
        OVERLAPS.fetch_add(1, Ordering::SeqCst);
    }
}

unsafe extern "system" fn launch_ends(_: *mut c_void) {
    BUSY.store(false, Ordering::SeqCst);
    DONE.fetch_add(1, Ordering::SeqCst);
}

/// Launches of one executable graph alternating between two streams never overlap: each waits for
/// the previous one, as in the real driver.
#[test]
fn launches_of_one_exec_are_ordered_across_streams() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, _ctx) = Cu::setup();
        let (m, _, spin) = cu.kernels();
        let a = cu.alloc(4096);
        let g = cu.graph();
        let start = cu.add_host_fn(g, &[], launch_starts, null_mut());
        let mut args = Args { out: a, value: 1, n: 1024, spin_us: 2_000 };
        let (r, k) = cu.add_fill(g, &[start], spin, &mut args);
        ok(r);
        cu.add_host_fn(g, &[k], launch_ends, null_mut());
        let x = cu.instantiate(g);
        let (s1, s2) = (cu.stream(NON_BLOCKING), cu.stream(NON_BLOCKING));
        for i in 0..40 {
            cu.launch_graph(x, if i % 2 == 0 { s1 } else { s2 });
        }
        cu.sync(s1);
        cu.sync(s2);
        assert_eq!(DONE.load(Ordering::SeqCst), 40);
        assert_eq!(OVERLAPS.load(Ordering::SeqCst), 0, "launches of one executable graph overlapped");
        // Two executable graphs of one graph are not ordered with each other: they may overlap,
        // which the test does not depend on.
        cu.destroy_exec(x);
        cu.destroy_graph(g);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.stream_destroy)(s1));
            ok((cu.stream_destroy)(s2));
            ok((cu.module_unload)(m));
        }
        cu.free(a);
        assert_no_leaks();
    });
}

/// Graphs and executable graphs count as live until destroyed, and `assert_no_leaks` says so.
#[test]
fn leak_counts_return_to_zero() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, _ctx) = Cu::setup();
        let s = cu.stream(NON_BLOCKING);
        assert_eq!((live_graphs(), live_graph_execs()), (0, 0));
        let g = cu.graph();
        let mut clone = null_mut();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.graph_clone)(&mut clone, g)) };
        ok(cu.begin(s, GLOBAL));
        assert_eq!(live_graphs(), 3, "the capture's graph counts too");
        let (r, captured) = cu.end(s);
        ok(r);
        let x = cu.instantiate(captured);
        assert_eq!((live_graphs(), live_graph_execs()), (3, 1));
        let err = std::panic::catch_unwind(assert_no_leaks).unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.contains("1 stream(s)"), "{msg}");
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.stream_destroy)(s)) };
        let err = std::panic::catch_unwind(assert_no_leaks).unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.contains("3 graph(s), 1 executable graph(s) live"), "{msg}");
        for h in [g, clone, captured] {
            cu.destroy_graph(h);
        }
        assert_eq!((live_graphs(), live_graph_execs()), (0, 1));
        cu.destroy_exec(x);
        assert_eq!((live_graphs(), live_graph_execs()), (0, 0));
        assert_no_leaks();
    });
    // The report at unload counts them too.
    if let Some(out) = run_with_fake_output(&[full_fake_driver(), ("CUDRV_FAKE_REPORT_ON_EXIT", "1")], || {
        let (cu, _ctx) = Cu::setup();
        let g = cu.graph();
        cu.instantiate(g);
    }) {
        assert!(out.stderr.contains("live_graphs=1 live_graph_execs=1"), "{}", out.stderr);
    }
}

/// Several threads capture, instantiate and launch their own graphs while another allocates and
/// frees: every result is right.
#[test]
fn concurrent_captures_launches_and_allocations() {
    run_with_fake(&[full_fake_driver()], || {
        let (cu, ctx) = Cu::setup();
        let (m, fill, _) = cu.kernels();
        let (ctx_addr, fill_addr) = (ctx as usize, fill as usize);
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let allocator = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let cu = Cu::load();
                // SAFETY: see `Cu::setup`; the context is alive.
                unsafe { ok((cu.set_current)(ctx_addr as H)) };
                let s = cu.stream(NON_BLOCKING);
                let mut rounds = 0;
                while !stop.load(Ordering::SeqCst) || rounds < 50 {
                    let p = cu.alloc(64 << 10);
                    let mut q = 0;
                    // SAFETY: see `Cu::setup`.
                    unsafe {
                        ok((cu.alloc_async)(&mut q, 4096, s));
                        ok((cu.memset_d32_async)(q, 1, 1024, s));
                        ok((cu.free_async)(q, s));
                    }
                    cu.free(p);
                    rounds += 1;
                }
                cu.sync(s);
                // SAFETY: see `Cu::setup`.
                unsafe { ok((cu.stream_destroy)(s)) };
            })
        };
        let workers: Vec<_> = (0..4u32)
            .map(|t| {
                std::thread::spawn(move || {
                    let cu = Cu::load();
                    // SAFETY: see `Cu::setup`; the context is alive.
                    unsafe { ok((cu.set_current)(ctx_addr as H)) };
                    const N: usize = 2048;
                    let (a, b) = (cu.alloc(N * 4), cu.alloc(N * 4));
                    let s = cu.stream(NON_BLOCKING);
                    ok(cu.begin(s, THREAD_LOCAL));
                    ok(cu.launch_fill(fill_addr as H, &mut Args::new(a, 100 + t, N as u64), s));
                    // SAFETY: see `Cu::setup`.
                    unsafe { ok((cu.dtod_async)(b, a, N * 4, s)) };
                    let (r, g) = cu.end(s);
                    ok(r);
                    let x = cu.instantiate(g);
                    for _ in 0..50 {
                        cu.launch_graph(x, s);
                    }
                    cu.sync(s);
                    assert!(cu.read_u32(b, N).iter().all(|&v| v == 100 + t));
                    cu.destroy_exec(x);
                    cu.destroy_graph(g);
                    // SAFETY: see `Cu::setup`.
                    unsafe { ok((cu.stream_destroy)(s)) };
                    cu.free(a);
                    cu.free(b);
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        allocator.join().unwrap();
        // SAFETY: see `Cu::setup`.
        unsafe { ok((cu.module_unload)(m)) };
        assert_no_leaks();
    });
}

type GetProc = unsafe extern "system" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> R;
type GetErrorName = unsafe extern "system" fn(R, *mut *const c_char) -> R;

fn proc_address(name: &str, version: c_int) -> (R, *mut c_void) {
    let get: GetProc = f!("cuGetProcAddress_v2");
    let name = CString::new(name).unwrap();
    let mut pfn = null_mut();
    let mut status = -1;
    // SAFETY: see `Cu::setup`.
    let r = unsafe { get(name.as_ptr(), &mut pfn, version, 0, &mut status) };
    (r, pfn)
}

fn export(name: &str) -> *mut c_void {
    // SAFETY: only the address of the symbol is read.
    *unsafe { fake_library().get::<*mut c_void>(name.as_bytes()) }.unwrap()
}

/// cuGetProcAddress serves the graph functions by version (cudaTypedefs.h); the legacy (CUDA 11.1)
/// build lacks the newer ones; the new error codes have names; faults can be injected.
#[test]
fn graph_functions_by_version_names_and_faults() {
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_FAIL", "cuGraphLaunch:2:999")], || {
        for (name, version, exported) in [
            ("cuStreamBeginCapture", 13000, "cuStreamBeginCapture_v2"),
            ("cuStreamBeginCapture", 10000, "cuStreamBeginCapture"),
            ("cuStreamGetCaptureInfo", 13000, "cuStreamGetCaptureInfo_v3"),
            ("cuStreamGetCaptureInfo", 12000, "cuStreamGetCaptureInfo_v2"),
            ("cuStreamGetCaptureInfo", 11000, "cuStreamGetCaptureInfo"),
            ("cuGraphAddKernelNode", 12000, "cuGraphAddKernelNode_v2"),
            ("cuGraphAddKernelNode", 11080, "cuGraphAddKernelNode"),
            ("cuGraphExecUpdate", 13000, "cuGraphExecUpdate_v2"),
            ("cuGraphExecUpdate", 11080, "cuGraphExecUpdate"),
            ("cuGraphExecKernelNodeSetParams", 13000, "cuGraphExecKernelNodeSetParams_v2"),
            ("cuGraphInstantiate", 13000, "cuGraphInstantiate_v2"),
            ("cuGraphInstantiateWithFlags", 13000, "cuGraphInstantiateWithFlags"),
            ("cuGraphLaunch", 13000, "cuGraphLaunch"),
            ("cuDeviceGetGraphMemAttribute", 13000, "cuDeviceGetGraphMemAttribute"),
        ] {
            assert_eq!(proc_address(name, version), (0, export(exported)), "{name}@{version}");
        }
        assert_eq!(proc_address("cuGraphInstantiateWithFlags", 11020), (NOT_FOUND, null_mut()));
        assert_eq!(proc_address("cuGraphAddNode", 13000), (NOT_FOUND, null_mut()), "not emulated");
        let name_of: GetErrorName = f!("cuGetErrorName");
        for (code, expected) in [
            (CAPTURE_UNJOINED, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"),
            (EXEC_UPDATE_FAILURE, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"),
            (ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE"),
            (CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT"),
        ] {
            let mut s = null();
            // SAFETY: see `Cu::setup`; the name is a static NUL-terminated string.
            let got = unsafe {
                ok(name_of(code, &mut s));
                std::ffi::CStr::from_ptr(s).to_str().unwrap()
            };
            assert_eq!(got, expected);
        }
        let (cu, _ctx) = Cu::setup();
        let g = cu.graph();
        let x = cu.instantiate(g);
        let s = cu.stream(NON_BLOCKING);
        // SAFETY: see `Cu::setup`.
        unsafe {
            ok((cu.graph_launch)(x, s));
            assert_eq!((cu.graph_launch)(x, s), 999);
            ok((cu.graph_launch)(x, s));
            ok((cu.stream_destroy)(s));
        }
        cu.destroy_exec(x);
        cu.destroy_graph(g);
        assert_no_leaks();
    });
    let legacy = legacy_fake_driver_path();
    run_with_fake(&[("CUDRV_DRIVER_PATH", legacy.to_str().unwrap())], || {
        let lib = fake_library();
        // SAFETY: only the presence of the symbols is checked.
        unsafe {
            for missing in ["cuGraphInstantiateWithFlags", "cuStreamGetCaptureInfo_v2", "cuGraphAddKernelNode_v2"] {
                assert!(lib.get::<*mut c_void>(missing.as_bytes()).is_err(), "{missing}");
            }
            for present in ["cuGraphCreate", "cuStreamBeginCapture_v2", "cuGraphInstantiate_v2", "cuGraphUpload"] {
                assert!(lib.get::<*mut c_void>(present.as_bytes()).is_ok(), "{present}");
            }
        }
    });
}

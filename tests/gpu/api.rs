//! The driver API beyond allocation and plain launches, on a real GPU (`--features gpu`): JIT
//! options, the linker resolving an external function, context-independent libraries, launch
//! attributes (programmatic dependent launch with a measured overlap, priority, access-policy
//! window, memory synchronisation domain, clusters and preferred clusters), cluster occupancy,
//! pitched 2D/3D memory, copies between views, synchronous memsets, memory info, managed memory
//! with prefetches and advice, and IPC between two processes (legacy memory handles, events, and a
//! pool exported with a file descriptor).
//!
//! Written for an H200 (compute capability 9.0, Linux); each test says what it skips elsewhere.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use cudrv::ipc::{
    ImportedPool, IpcBuffer, IpcEvent, IpcMemHandle, IpcMemKind, PoolShareableHandle, ShareableHandleType, SharedPool,
};
use cudrv::launch::{AccessPolicyWindow, LaunchAttributes, LaunchConfig, MemSyncDomain};
use cudrv::memory::{
    Advice, DeviceBuffer, DeviceBuffer2D, DeviceBuffer3D, DriverPool, Location, ManagedBuffer, PoolConfig,
    StreamOrderedPool, SyncResource,
};
use cudrv::module::{JitCacheMode, JitConfig, JitTarget, Linker, Module};
use cudrv::{Device, Error, Function, Stream};
use cudrv_test_support::{random_u64s, time_seed};

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

/// A kernel that calls a function it does not define: `out[0] = add_seven(x)`.
const USES_HELPER: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.extern .func (.param .b32 func_retval0) add_seven(.param .b32 x);

.visible .entry use_helper(.param .u64 out, .param .u32 x)
{
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<2>;
	ld.param.u64 	%rd1, [out];
	cvta.to.global.u64 	%rd1, %rd1;
	ld.param.u32 	%r1, [x];
	{
	.param .b32 param0;
	st.param.b32 	[param0+0], %r1;
	.param .b32 retval0;
	call.uni (retval0), add_seven, (param0);
	ld.param.b32 	%r2, [retval0+0];
	}
	st.global.u32 	[%rd1], %r2;
	ret;
}
"#;

/// The function `USES_HELPER` calls.
const HELPER: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .func (.param .b32 func_retval0) add_seven(.param .b32 x)
{
	.reg .b32 	%r<3>;
	ld.param.u32 	%r1, [x];
	add.u32 	%r2, %r1, 7;
	st.param.b32 	[func_retval0+0], %r2;
	ret;
}
"#;

/// Programmatic dependent launch: the primary lets its dependents start at once, spins `spin_ns`
/// on the global timer, and writes when it ended to `out[0]`; the secondary writes when it started
/// to `out[1]`, waits for the primary (`griddepcontrol.wait`), and writes when that returned to
/// `out[2]`.
const PDL: &str = r#"
.version 7.8
.target sm_90
.address_size 64

.visible .entry pdl_primary(.param .u64 out, .param .u64 spin_ns)
{
	.reg .pred 	%p<2>;
	.reg .b64 	%rd<6>;
	ld.param.u64 	%rd1, [out];
	ld.param.u64 	%rd2, [spin_ns];
	cvta.to.global.u64 	%rd1, %rd1;
	griddepcontrol.launch_dependents;
	mov.u64 	%rd3, %globaltimer;
	add.u64 	%rd4, %rd3, %rd2;
$SPIN:
	mov.u64 	%rd5, %globaltimer;
	setp.lt.u64 	%p1, %rd5, %rd4;
	@%p1 bra 	$SPIN;
	st.global.u64 	[%rd1], %rd5;
	ret;
}

.visible .entry pdl_secondary(.param .u64 out)
{
	.reg .b64 	%rd<4>;
	ld.param.u64 	%rd1, [out];
	cvta.to.global.u64 	%rd1, %rd1;
	mov.u64 	%rd2, %globaltimer;
	st.global.u64 	[%rd1+8], %rd2;
	griddepcontrol.wait;
	mov.u64 	%rd3, %globaltimer;
	st.global.u64 	[%rd1+16], %rd3;
	ret;
}
"#;

fn device() -> Device {
    Device::get(0).expect("a CUDA device (these tests need a GPU)")
}

fn setup() -> (Device, Module, Stream) {
    let dev = device();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let stream = Stream::new(&dev).unwrap();
    (dev, module, stream)
}

fn check_filled(out: &DeviceBuffer<u32>, value: u32, what: &str) {
    let got = out.to_vec().unwrap();
    if let Some(i) = got.iter().position(|&v| v != value) {
        panic!("{what}: element {i} is {:#x}, expected {value:#x}", got[i]);
    }
}

/// Launches `fill_u32` over all of `out` with `attrs`.
fn fill_with(
    fill: &Function,
    attrs: &LaunchAttributes,
    cfg: LaunchConfig,
    stream: &Stream,
    out: &mut DeviceBuffer<u32>,
    value: u32,
) -> cudrv::Result<()> {
    let n = out.len() as u64;
    // SAFETY: fill_u32(u32*, u32, u64) writes out[0..n] (grid-stride: any configuration covers it).
    unsafe { fill.launch_with(cfg, attrs, stream, (out, value, n)) }
}

#[test]
fn capabilities_and_memory_info() {
    let dev = device();
    let caps = dev.capabilities().unwrap();
    println!("{caps}");
    let info = dev.memory_info().unwrap();
    println!("device 0: {info}");
    assert!(info.free <= info.total && info.total <= dev.total_memory().unwrap());
    let s = Stream::new(&dev).unwrap();
    let sync: Arc<dyn cudrv::memory::MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
    // Free memory is the device's: tests running beside this one allocate and free too. A round
    // in which nothing else moved shows the 1 GiB taken, then given back.
    let mut seen = Vec::new();
    let moved = (0..50).any(|_| {
        let before = dev.memory_info().unwrap().free;
        let big = DeviceBuffer::<u8>::zeroed_in(1 << 30, &s, sync.clone()).unwrap();
        let during = dev.memory_info().unwrap().free;
        drop(big);
        let after = dev.memory_info().unwrap().free;
        seen.push((before, during, after));
        before.checked_sub(during).is_some_and(|d| d >= 1 << 30)
            && after.checked_sub(during).is_some_and(|d| d >= 1 << 30)
    });
    assert!(moved, "1 GiB allocated and freed: free memory (before, during, after) in each round: {seen:?}");
    if caps.compute_capability.0 >= 9 {
        assert!(caps.programmatic_dependent_launch && caps.mem_sync_domain_count >= 2);
        assert!(caps.max_access_policy_window_size > 0);
    }
}

#[test]
fn jit_options_change_the_code() {
    let dev = device();
    let limited = Module::from_ptx_with(&dev, PTX, &JitConfig::new().max_registers(16).optimization_level(3)).unwrap();
    let attrs = limited.function("add_f32").unwrap().attributes().unwrap();
    println!(
        "max registers 16: {attrs:?}\ninfo log: {}\ncompile time: {:?}",
        limited.info_log(),
        limited.compile_time()
    );
    // The limit is a request: the driver keeps a few registers of its own above it (18 for
    // add_f32 at a limit of 16 on an H200 with driver 580): at most 8 more, or what it uses
    // without a limit.
    let unlimited = Module::from_ptx(&dev, PTX).unwrap().function("add_f32").unwrap().attributes().unwrap();
    println!("unlimited: {unlimited:?}");
    assert!(attrs.num_registers <= unlimited.num_registers.max(16 + 8), "{attrs:?} against {unlimited:?}");
    let target = JitTarget::of_device(&dev).unwrap();
    for options in [
        JitConfig::new().optimization_level(0),
        JitConfig::new().line_info(true),
        JitConfig::new().debug_info(true),
        JitConfig::new().cache_mode(JitCacheMode::L2Only),
        JitConfig::new().target(target),
        JitConfig::new().log_verbose(false).log_size(64),
    ] {
        let m = Module::from_ptx_with(&dev, PTX, &options).unwrap_or_else(|e| panic!("{options:?}: {e}"));
        let (_, _, stream) = setup();
        let mut out = DeviceBuffer::<u32>::zeroed(1000, &stream).unwrap();
        // SAFETY: fill_u32(u32*, u32, u64) writes out[0..1000].
        unsafe {
            m.function("fill_u32")
                .unwrap()
                .launch(LaunchConfig::for_num_elems(1000), &stream, (&mut out, 3u32, 1000u64))
                .unwrap()
        };
        check_filled(&out, 3, &format!("{options:?}"));
    }
    // Code for a newer architecture does not run here.
    let (major, _) = dev.compute_capability().unwrap();
    let newer = JitTarget::compute(major as u32 + 1, 0);
    let err = Module::from_ptx_with(&dev, PTX, &JitConfig::new().target(newer)).unwrap_err();
    println!("{newer}: {err}");
}

#[test]
fn the_linker_resolves_an_external_function() {
    let dev = device();
    let stream = Stream::new(&dev).unwrap();
    // Alone, the kernel's call is unresolved.
    let err = Module::from_ptx(&dev, USES_HELPER).unwrap_err();
    println!("unlinked: {err}");
    let mut linker = Linker::new(&dev, &JitConfig::new().optimization_level(3)).unwrap();
    linker.add_ptx("uses_helper.ptx", USES_HELPER).unwrap().add_ptx("helper.ptx", HELPER).unwrap();
    println!("linker log: {}", linker.info_log());
    let module = linker.complete().unwrap();
    let f = module.function("use_helper").unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(1, &stream).unwrap();
    // SAFETY: use_helper(u32* out, u32 x) writes out[0].
    unsafe { f.launch(LaunchConfig::linear(1, 1), &stream, (&mut out, 35u32)).unwrap() };
    assert_eq!(out.to_vec().unwrap(), [42]);
    // The linked cubin loads again, as a module and as a library.
    let mut linker = Linker::new(&dev, &JitConfig::new()).unwrap();
    linker.add_ptx("a.ptx", USES_HELPER).unwrap().add_ptx("b.ptx", HELPER).unwrap();
    let cubin = linker.complete_cubin().unwrap();
    let again = Module::from_cubin(&dev, &cubin).unwrap().function("use_helper").unwrap();
    // SAFETY: as above.
    unsafe { again.launch(LaunchConfig::linear(1, 1), &stream, (&mut out, 1u32)).unwrap() };
    assert_eq!(out.to_vec().unwrap(), [8]);
    #[cfg(cuda_12000)]
    {
        let library = cudrv::module::Library::from_cubin(&cubin).unwrap();
        // SAFETY: as above.
        unsafe {
            library.kernel("use_helper").unwrap().launch(LaunchConfig::linear(1, 1), &stream, (&mut out, 2u32)).unwrap()
        };
        assert_eq!(out.to_vec().unwrap(), [9]);
    }
    // Undefined at link time: an error with the linker's log.
    let mut linker = Linker::new(&dev, &JitConfig::new()).unwrap();
    linker.add_ptx("uses_helper.ptx", USES_HELPER).unwrap();
    let err = linker.complete().unwrap_err();
    println!("undefined: {err}");
    assert!(matches!(err, Error::Jit { .. } | Error::Driver { .. }), "{err:?}");
}

#[cfg(cuda_12000)]
#[test]
fn library_kernels_launch_on_every_device() {
    let library = cudrv::module::Library::from_ptx(PTX).unwrap();
    #[cfg(cuda_12050)]
    match library.kernel_names() {
        Ok(mut names) => {
            names.sort();
            assert_eq!(names, ["add_f32", "empty", "fill_pattern_u8", "fill_u32", "spin_fill_u32"]);
        }
        Err(e) => println!("kernel names (CUDA 12.4): {e}"),
    }
    let fill = library.kernel("fill_u32").unwrap();
    for dev in Device::all().unwrap() {
        let stream = Stream::new(&dev).unwrap();
        let mut out = DeviceBuffer::<u32>::zeroed(1 << 20, &stream).unwrap();
        let value = 0x1000 + dev.ordinal() as u32;
        // SAFETY: fill_u32(u32*, u32, u64) writes out[0..n].
        unsafe { fill.launch(LaunchConfig::for_num_elems(1 << 20), &stream, (&mut out, value, 1u64 << 20)).unwrap() };
        check_filled(&out, value, "library kernel");
        println!("device {}: {:?}", dev.ordinal(), fill.function(&dev).unwrap().attributes().unwrap());
    }
}

#[test]
fn launch_attributes_launch() {
    let (dev, module, stream) = setup();
    let caps = dev.capabilities().unwrap();
    let fill = module.function("fill_u32").unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(1 << 22, &stream).unwrap();
    let cfg = LaunchConfig::linear(264, 256);
    let (_, highest) = caps.stream_priority_range;
    fill_with(&fill, &LaunchAttributes::new().priority(highest), cfg, &stream, &mut out, 1).unwrap();
    check_filled(&out, 1, "priority");
    if caps.max_access_policy_window_size > 0 {
        let bytes = out.byte_len().min(caps.max_access_policy_window_size);
        let window = AccessPolicyWindow { num_bytes: bytes, ..AccessPolicyWindow::persisting(&out, 0.6) };
        fill_with(&fill, &LaunchAttributes::new().access_policy_window(window), cfg, &stream, &mut out, 2).unwrap();
        check_filled(&out, 2, "access-policy window");
    }
    if caps.mem_sync_domain_count >= 2 {
        fill_with(&fill, &LaunchAttributes::new().mem_sync_domain(MemSyncDomain::Remote), cfg, &stream, &mut out, 3)
            .unwrap();
        check_filled(&out, 3, "remote domain");
    }
    if caps.cluster_launch {
        fill_with(&fill, &LaunchAttributes::new().cluster_dim((2, 1, 1)), cfg, &stream, &mut out, 4).unwrap();
        check_filled(&out, 4, "cluster");
        let attrs = LaunchAttributes::new().cluster_dim((2, 1, 1)).preferred_cluster_dim((4, 1, 1));
        match fill_with(&fill, &attrs, cfg, &stream, &mut out, 5) {
            Ok(()) => check_filled(&out, 5, "preferred cluster"),
            Err(e) => println!("preferred cluster dimension: {e}"),
        }
        println!(
            "cluster occupancy: potential size {}, active clusters of 2: {}",
            fill.max_potential_cluster_size(cfg).unwrap(),
            fill.max_active_clusters(cfg, (2, 1, 1)).unwrap()
        );
        assert!(fill.max_potential_cluster_size(cfg).unwrap() >= 8);
        assert!(fill.max_active_clusters(cfg, (2, 1, 1)).unwrap() > 0);
    }
    if caps.cooperative_launch {
        fill_with(
            &fill,
            &LaunchAttributes::new().cooperative(true),
            LaunchConfig::linear(caps_sms(&dev), 256),
            &stream,
            &mut out,
            6,
        )
        .unwrap();
        check_filled(&out, 6, "cooperative");
    }
    if caps.programmatic_dependent_launch {
        fill_with(&fill, &LaunchAttributes::new().programmatic_stream_serialization(true), cfg, &stream, &mut out, 7)
            .unwrap();
        check_filled(&out, 7, "programmatic stream serialization");
    }
}

fn caps_sms(dev: &Device) -> u32 {
    dev.multiprocessor_count().unwrap() as u32
}

#[test]
fn programmatic_dependent_launch_overlaps_the_kernels() {
    let dev = device();
    if !dev.capabilities().unwrap().programmatic_dependent_launch {
        println!("note: no programmatic dependent launch on device 0; skipped");
        return;
    }
    let module = Module::from_ptx(&dev, PDL).unwrap();
    let (primary, secondary) = (module.function("pdl_primary").unwrap(), module.function("pdl_secondary").unwrap());
    let stream = Stream::new(&dev).unwrap();
    let spin_ns = 2_000_000u64; // 2 ms
    let run = |pdl: bool| -> [u64; 3] {
        let mut out = DeviceBuffer::<u64>::zeroed(3, &stream).unwrap();
        let one = LaunchConfig::linear(1, 32);
        // SAFETY: pdl_primary(u64* out, u64 spin_ns) writes out[0]; pdl_secondary(u64* out) writes
        // out[1] and out[2], and waits for the primary (griddepcontrol.wait) before its last write;
        // the primary touches no memory the secondary uses before that.
        unsafe {
            primary.launch(one, &stream, (&mut out, spin_ns)).unwrap();
            let attrs = LaunchAttributes::new().programmatic_stream_serialization(pdl);
            secondary.launch_with(one, &attrs, &stream, (&mut out,)).unwrap();
        }
        out.to_vec().unwrap().try_into().unwrap()
    };
    // The secondary may start early only where the GPU has room for it: kernels of the tests
    // running beside this one can take it, so the overlap is looked for in up to 10 runs. Every
    // run must keep the wait's order.
    let mut overlapped = false;
    for _ in 0..10 {
        let [end, start, after] = run(true);
        println!(
            "PDL: primary ended at {end}, secondary started at {start} ({} ns before), its wait returned at {after}",
            end as i64 - start as i64
        );
        assert!(after >= end, "griddepcontrol.wait returns after the primary");
        if start < end {
            overlapped = true;
            break;
        }
    }
    // compute-sanitizer runs kernels one at a time (it injects itself through the driver's
    // injection variables): no overlap is possible there, and the order is all that is checked.
    let sanitized = std::env::vars().any(|(k, v)| k.contains("INJECTION") && v.contains("sanitizer"));
    if sanitized && !overlapped {
        println!("note: under compute-sanitizer kernels do not overlap; only the order was checked");
    } else {
        assert!(overlapped, "with programmatic stream serialization the secondary starts before the primary ends");
    }
    let [end, start, _] = run(false);
    println!("plain: primary ended at {end}, secondary started at {start}");
    assert!(start >= end, "without it, stream order holds");
}

#[test]
fn pitched_memory_in_2d_and_3d() {
    let (_dev, module, s) = setup();
    let (w, h) = (1000usize, 37usize);
    let data: Vec<f32> = random_u64s(time_seed(), w * h).into_iter().map(|x| (x >> 40) as f32).collect();
    let mut a = DeviceBuffer2D::from_slice(&data, w, h, &s).unwrap();
    println!("{w}x{h} f32: pitch {}", a.pitch());
    assert!(a.pitch() >= w * 4);
    assert_eq!(a.to_vec().unwrap(), data);
    let rect = a.view(100..300, 10..20).unwrap();
    let expect: Vec<f32> = (10..20).flat_map(|y| data[y * w + 100..y * w + 300].to_vec()).collect();
    assert_eq!(rect.to_vec().unwrap(), expect);
    let mut b = DeviceBuffer2D::<f32>::zeroed(200, 10, &s).unwrap();
    b.copy_rect_from((0, 0), &rect).unwrap();
    assert_eq!(b.to_vec().unwrap(), expect);
    let mut tight = DeviceBuffer::<f32>::zeroed(w * h, &s).unwrap();
    a.copy_to_buffer(&mut tight).unwrap();
    assert_eq!(tight.to_vec().unwrap(), data);
    let fill = module.function("fill_u32").unwrap();
    let mut ints = DeviceBuffer2D::<u32>::zeroed(w, h, &s).unwrap();
    ints.fill(5).unwrap();
    // SAFETY: fill_u32 writes w elements from the start of row 3: that row only.
    unsafe { fill.launch(LaunchConfig::for_num_elems(w), &s, (ints.row(3).unwrap(), 9u32, w as u64)).unwrap() };
    let got = ints.to_vec().unwrap();
    assert!(got[3 * w..4 * w].iter().all(|&v| v == 9) && got[..3 * w].iter().chain(&got[4 * w..]).all(|&v| v == 5));
    ints.memset_sync(0).unwrap();
    assert!(ints.to_vec().unwrap().iter().all(|&v| v == 0));
    a.fill_sync(1.5).unwrap();
    assert!(a.to_vec().unwrap().iter().all(|&v| v == 1.5));
    // 3D.
    let (x, y, z) = (70usize, 20usize, 9usize);
    let vol: Vec<u16> = (0..x * y * z).map(|i| (i * 7) as u16).collect();
    let v = DeviceBuffer3D::from_slice(&vol, (x, y, z), &s).unwrap();
    assert_eq!(v.to_vec().unwrap(), vol);
    let mut part = DeviceBuffer3D::<u16>::zeroed((10, 5, 3), &s).unwrap();
    part.copy_box_from((0, 0, 0), &v, (30, 10, 4), (10, 5, 3)).unwrap();
    let got = part.to_vec().unwrap();
    for k in 0..3 {
        for j in 0..5 {
            for i in 0..10 {
                assert_eq!(got[(k * 5 + j) * 10 + i], vol[((4 + k) * y + 10 + j) * x + 30 + i]);
            }
        }
    }
}

#[test]
fn view_copies_and_synchronous_memsets() {
    let (dev, module, _) = setup();
    let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let spin = module.function("spin_fill_u32").unwrap();
    let n = 1 << 20;
    let mut src = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
    // SAFETY: spin_fill_u32(u32*, u32, u64, u64) spins 20 ms, then writes src[0..n].
    unsafe { spin.launch(LaunchConfig::for_num_elems(n), &a, (&mut src, 0xABu32, n as u64, 20_000u64)).unwrap() };
    let mut dst = DeviceBuffer::<u32>::zeroed(n, &b).unwrap();
    b.wait_stream(&a).unwrap();
    dst.copy_from_view(1000, &src.view(0..n - 1000).unwrap(), &b).unwrap();
    drop(src); // freed after the copy on `b`
    let got = dst.to_vec().unwrap();
    assert!(got[..1000].iter().all(|&v| v == 0) && got[1000..].iter().all(|&v| v == 0xAB));
    dst.copy_within(1000..2000, 0).unwrap();
    assert!(dst.view(0..1000).unwrap().to_vec().unwrap().iter().all(|&v| v == 0xAB));
    // A synchronous memset comes after the work queued on the buffer's stream.
    // SAFETY: as above, on dst.
    unsafe { spin.launch(LaunchConfig::for_num_elems(n), &b, (&mut dst, 1u32, n as u64, 20_000u64)).unwrap() };
    dst.fill_sync(0x5A5A).unwrap();
    check_filled(&dst, 0x5A5A, "fill_sync after a slow kernel");
    dst.memset_sync(0).unwrap();
    check_filled(&dst, 0, "memset_sync");
}

#[test]
fn managed_memory_prefetch_and_advice() {
    let (dev, module, s) = setup();
    let caps = dev.capabilities().unwrap();
    if !caps.managed_memory {
        println!("note: no managed memory; skipped");
        return;
    }
    let n = 1 << 22;
    let mut m = ManagedBuffer::<u32>::zeroed(n, &s).unwrap();
    if !caps.managed_prefetch {
        assert!(m.prefetch_to(Location::Device(dev), &s).is_err());
        println!("note: no concurrent managed access; prefetch refused as expected");
        return;
    }
    m.advise(Advice::SetPreferredLocation(Location::Device(dev))).unwrap();
    assert_eq!(m.preferred_location().unwrap(), Some(Location::Device(dev)));
    m.advise(Advice::SetAccessedBy(Location::Device(dev))).unwrap();
    assert!(m.accessed_by().unwrap().contains(&Location::Device(dev)));
    m.prefetch_to(Location::Device(dev), &s).unwrap();
    let fill = module.function("fill_u32").unwrap();
    // SAFETY: fill_u32 writes m[0..n].
    unsafe { fill.launch(LaunchConfig::for_num_elems(n), &s, (&mut m, 17u32, n as u64)).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(m.last_prefetch_location().unwrap(), Some(Location::Device(dev)));
    m.prefetch_to(Location::Host, &s).unwrap();
    assert!(m.as_slice().unwrap().iter().all(|&v| v == 17));
    assert_eq!(m.last_prefetch_location().unwrap(), Some(Location::Host));
    m.advise(Advice::SetReadMostly).unwrap();
    assert!(m.is_read_mostly().unwrap());
    m.as_mut_slice().unwrap()[5] = 3;
    assert_eq!(m.to_vec().unwrap()[5], 3);
}

// ------------------------------------------------------------------------------------------------
// IPC between two processes
// ------------------------------------------------------------------------------------------------

const PEER_ROLE: &str = "CUDRV_TEST_PEER";
const PEER_DATA: &str = "CUDRV_TEST_PEER_DATA";

fn peer_data(role: &str) -> Option<String> {
    (std::env::var(PEER_ROLE).ok()? == role).then(|| std::env::var(PEER_DATA).unwrap_or_default())
}

fn peer_command(role: &str, data: &str) -> Command {
    let name = std::thread::current().name().expect("a test thread").to_string();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"]).env(PEER_ROLE, role).env(PEER_DATA, data);
    cmd
}

/// Runs the current test again in another process as `role`, and checks it finished.
fn run_peer(role: &str, data: &str) {
    let out = peer_command(role, data).stdin(Stdio::null()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(&format!("peer done: {role}")),
        "peer {role} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn legacy_ipc_and_events_between_two_processes() {
    if let Some(data) = peer_data("importer") {
        let parts: Vec<&str> = data.split(',').collect();
        let dev = device();
        let s = Stream::new(&dev).unwrap();
        let ready = IpcEvent::open(&dev, &parts[2].parse().unwrap()).unwrap();
        ready.wait_in(&s).unwrap(); // after the exporter's slow kernel
        let mut a = IpcBuffer::<u32>::open(&parts[0].parse().unwrap(), &s).unwrap();
        let b = IpcBuffer::<u32>::open(&parts[1].parse().unwrap(), &s).unwrap();
        assert_eq!(a.to_vec().unwrap(), vec![0xA11CE; a.len()]);
        assert_eq!(b.to_vec().unwrap(), (0..b.len() as u32).collect::<Vec<_>>());
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let n = b.len() as u64;
        // SAFETY: fill_u32 writes b[0..n].
        unsafe { fill.launch(LaunchConfig::for_num_elems(b.len()), &s, (&b, 0xB0Bu32, n)).unwrap() };
        a.memset(0).unwrap();
        s.synchronize().unwrap();
        drop((a, b));
        println!("peer done: importer");
        return;
    }
    let dev = device();
    if !dev.capabilities().unwrap().legacy_ipc {
        println!("note: no legacy IPC on device 0; skipped");
        return;
    }
    let (_, module, s) = setup();
    let spin = module.function("spin_fill_u32").unwrap();
    let mut a = DeviceBuffer::<u32>::zeroed_in(1 << 20, &s, Arc::new(SyncResource::new(&dev).unwrap())).unwrap();
    // Legacy IPC shares cuMemAlloc memory: a pool in chunks, not in segments of virtual memory.
    let chunked = PoolConfig { expandable: false, ..PoolConfig::default() };
    let pool = Arc::new(StreamOrderedPool::with_config(&dev, chunked).unwrap());
    assert!(!pool.grows_in_segments());
    if dev.capabilities().unwrap().virtual_memory_management {
        let segments = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        assert!(segments.grows_in_segments());
        let v = DeviceBuffer::<u32>::zeroed_in(100, &s, segments).unwrap();
        match v.ipc_handle() {
            Err(cudrv::Error::Unsupported { reason, .. }) => {
                assert!(reason.contains("PoolConfig::expandable"), "{reason}")
            }
            other => panic!("legacy IPC of a segment pool's buffer: {other:?}"),
        }
    }
    let _filler = DeviceBuffer::<u8>::zeroed_in(10_000, &s, pool.clone()).unwrap();
    let b = DeviceBuffer::from_slice_in(&(0..50_000).collect::<Vec<u32>>(), &s, pool.clone()).unwrap();
    let hb = b.ipc_handle().unwrap();
    assert!(hb.offset() > 0, "inside the pool's chunk");
    let n = a.len();
    // SAFETY: spin_fill_u32 spins 300 ms, then writes a[0..n].
    unsafe { spin.launch(LaunchConfig::for_num_elems(n), &s, (&mut a, 0xA11CEu32, n as u64, 300_000u64)).unwrap() };
    let ready = IpcEvent::new(&dev).unwrap();
    ready.record(&s).unwrap();
    run_peer("importer", &format!("{},{hb},{}", a.ipc_handle().unwrap(), ready.handle().unwrap()));
    assert_eq!(a.to_vec().unwrap(), vec![0; a.len()]);
    assert_eq!(b.to_vec().unwrap(), vec![0xB0B; b.len()]);
    // Memory of the driver's pool is refused (cudarc #521).
    if dev.capabilities().unwrap().memory_pools {
        let pooled = DeviceBuffer::<u32>::zeroed_in(64, &s, Arc::new(DriverPool::default_pool(&dev).unwrap())).unwrap();
        let err = pooled.ipc_handle().unwrap_err();
        println!("driver pool: {err}");
        assert!(err.is_unsupported());
    }
}

/// Takes a file descriptor of another process (`pidfd_open`, `pidfd_getfd`; Linux 5.6): allowed
/// for a descendant process under the default ptrace policy.
#[cfg(target_os = "linux")]
fn take_fd(pid: u32, fd: i32) -> std::io::Result<i32> {
    use std::ffi::c_long;
    unsafe extern "C" {
        fn syscall(num: c_long, ...) -> c_long;
    }
    const SYS_PIDFD_OPEN: c_long = 434;
    const SYS_PIDFD_GETFD: c_long = 438;
    // SAFETY: pidfd_open takes a pid and flags (0).
    let pidfd = unsafe { syscall(SYS_PIDFD_OPEN, pid as c_long, 0 as c_long) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number of that process and flags (0).
    let local = unsafe { syscall(SYS_PIDFD_GETFD, pidfd, fd as c_long, 0 as c_long) };
    let err = std::io::Error::last_os_error();
    // SAFETY: `pidfd` is a descriptor of ours, closed once.
    drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(pidfd as i32) });
    if local < 0 { Err(err) } else { Ok(local as i32) }
}

#[cfg(target_os = "linux")]
#[test]
fn pool_ipc_between_two_processes() {
    if peer_data("exporter").is_some() {
        // The child exports a pool and a buffer of it, and waits until the parent is done.
        let dev = device();
        let s = Stream::new(&dev).unwrap();
        let pool = Arc::new(SharedPool::new(&dev).unwrap());
        let exported = pool.export().unwrap();
        let buf = DeviceBuffer::from_slice_in(&vec![2.5f32; 1 << 18], &s, pool.clone()).unwrap();
        let h = buf.ipc_handle().unwrap();
        assert_eq!(h.kind(), IpcMemKind::Pool);
        s.synchronize().unwrap();
        println!("exported {} {} {h}", std::process::id(), exported.raw);
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        match line.trim() {
            "done" => assert!(buf.to_vec().unwrap().iter().all(|&v| v == 7.0), "the parent's writes are visible"),
            other => assert_eq!(other, "skipped"),
        }
        println!("peer done: exporter");
        return;
    }
    let dev = device();
    let caps = dev.capabilities().unwrap();
    if !caps.memory_pools || caps.memory_pool_handle_types & 1 == 0 {
        println!("note: device 0's pools export no file descriptors; skipped");
        return;
    }
    let mut child = peer_command("exporter", "").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    // A hang (in the driver or the child) must fail the test, saying where, not stall the suite.
    let stage = Arc::new(std::sync::Mutex::new("waiting for the child's handles"));
    let (_finished, watch) = std::sync::mpsc::channel::<()>();
    {
        let (stage, child_pid) = (stage.clone(), child.id());
        std::thread::spawn(move || {
            // Ends when the test does (the sender is dropped), else after 45 s.
            if watch.recv_timeout(std::time::Duration::from_secs(45)) != Err(std::sync::mpsc::RecvTimeoutError::Timeout)
            {
                return;
            }
            eprintln!("pool_ipc_between_two_processes: stuck for 45 s at: {}", stage.lock().unwrap());
            let _ = Command::new("kill").args(["-9", &child_pid.to_string()]).status();
            std::process::exit(3);
        });
    }
    let note = |what: &'static str| {
        eprintln!("pool ipc: {what}");
        *stage.lock().unwrap() = what;
    };
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The child's test harness may print "test <name> ... " first, on the same line.
    let line = lines
        .find_map(|l| l.ok().and_then(|l| l.find("exported ").map(|at| l[at..].to_string())))
        .expect("the child's handles");
    let parts: Vec<&str> = line.split_whitespace().collect();
    let (pid, fd, handle): (u32, i32, IpcMemHandle) =
        (parts[1].parse().unwrap(), parts[2].parse().unwrap(), parts[3].parse().unwrap());
    note("taking the child's pool descriptor");
    let reply = match take_fd(pid, fd) {
        Err(e) => {
            println!("note: cannot take the child's descriptor ({e}); pool import skipped");
            "skipped\n"
        }
        Ok(local) => {
            let s = Stream::new(&dev).unwrap();
            note("importing the pool");
            let pool = ImportedPool::import(
                &dev,
                PoolShareableHandle { handle_type: ShareableHandleType::PosixFd, raw: local as u64 },
            )
            .unwrap();
            // SAFETY: the descriptor is ours; the driver holds its own reference to the pool.
            drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(local) });
            note("opening the buffer");
            let mut b = pool.open::<f32>(&handle, &s).unwrap();
            note("reading and writing the buffer");
            assert!(b.to_vec().unwrap().iter().all(|&v| v == 2.5));
            b.copy_from_host(&vec![7.0; b.len()]).unwrap();
            note("freeing the imported buffer and pool");
            drop(b); // freed here before the exporter frees it
            drop(pool);
            // The free (`cuMemFree` of the imported pointer) succeeded: a failed one would be kept
            // for the stream's next synchronize.
            s.synchronize().expect("the imported buffer was freed");
            "done\n"
        }
    };
    note("waiting for the child to finish");
    child.stdin.take().unwrap().write_all(reply.as_bytes()).unwrap();
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let status = child.wait().unwrap();
    assert!(status.success(), "the exporter failed: {rest:?}");
    if rest.iter().any(|l| l.contains("peer done: exporter")) {
        return;
    }
    panic!("the exporter did not finish: {rest:?}");
}

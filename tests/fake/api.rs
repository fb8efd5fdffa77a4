//! The driver API beyond allocation and plain launches, on the fake driver: JIT options, the
//! linker, context-independent libraries, launch attributes and cluster occupancy, pitched 2D/3D
//! memory, copies between views, synchronous memsets, memory info, managed memory with prefetches
//! and advice, and IPC (events, legacy memory handles, pool export and import) between two
//! processes.
//!
//! Every test body runs in a child process of this test binary (`run_with_fake`); the IPC tests
//! start one more process of it (`run_peer`), which opens what the first exported.

use std::process::{Command, Stdio};
use std::sync::Arc;

use crate::{
    assert_missing_on_oldest, assert_no_leaks_but_streams, assert_no_pools_on_oldest, invalid_argument, invalid_launch,
    ipc_refused_on_oldest, oldest, pool_kind,
};
use cudrv::ipc::{
    ImportedPool, IpcBuffer, IpcEvent, IpcEventHandle, IpcMemHandle, IpcMemKind, PoolShareableHandle,
    ShareableHandleType, SharedPool,
};
use cudrv::launch::{AccessPolicyWindow, AccessProperty, LaunchAttributes, LaunchConfig, MemSyncDomain};
use cudrv::memory::{
    Advice, DeviceBuffer, DeviceBuffer2D, DeviceBuffer3D, DriverPool, Location, ManagedBuffer, ManagedResource,
    MemoryResource, PinnedBuffer, PoolConfig, StreamOrderedPool, SyncResource,
};
use cudrv::module::{JitCacheMode, JitConfig, JitFallback, JitTarget, LinkInput, Linker, Module};
use cudrv::sys::CUresult;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{
    fake_library, fake_report, full_fake_driver, legacy_fake_driver_path, output_retrying_start, random_u64s,
    run_with_fake, run_with_fake_modes, time_seed, write_temp,
};

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

/// PTX text whose only entry is `name` (the fake compiles `.entry` lines; a GPU would need bodies).
fn entries(names: &[&str]) -> String {
    let mut s = String::from(".version 7.0\n.target sm_52\n.address_size 64\n");
    for n in names {
        s.push_str(&format!(".visible .entry {n}()\n{{\n\tret;\n}}\n"));
    }
    s
}

fn unsupported(e: Error) -> (&'static str, String) {
    match e {
        Error::Unsupported { feature, reason, .. } => (feature, reason),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// What the fake recorded of the last launch (`cudrvFakeLastLaunch`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct LastLaunch {
    launches: u64,
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    cooperative: i32,
    cluster: [u32; 3],
    preferred_cluster: [u32; 3],
    programmatic_stream_serialization: i32,
    has_priority: i32,
    priority: i32,
    mem_sync_domain: i32,
    has_access_policy_window: i32,
    apw_hit: i32,
    apw_miss: i32,
    apw_hit_ratio: f32,
    apw_base: u64,
    apw_bytes: u64,
    api: [u8; 32],
}

impl LastLaunch {
    fn api(&self) -> &str {
        let end = self.api.iter().position(|&b| b == 0).unwrap_or(32);
        std::str::from_utf8(&self.api[..end]).unwrap()
    }
}

fn last_launch() -> LastLaunch {
    // SAFETY: cudrvFakeLastLaunch takes a pointer to this exact layout (struct CudrvFakeLaunch).
    let f = unsafe { fake_library().get::<unsafe extern "C" fn(*mut LastLaunch) -> i32>(b"cudrvFakeLastLaunch") }
        .expect("the fake exports cudrvFakeLastLaunch");
    let mut out = LastLaunch::default();
    // SAFETY: `out` is writable and has the layout the fake writes.
    assert_eq!(unsafe { f(&mut out) }, 0);
    out
}

// ------------------------------------------------------------------------------------------------
// Capabilities and memory information
// ------------------------------------------------------------------------------------------------

#[test]
fn capabilities_report_the_new_device_properties() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,wddm,tcc")], || {
        let caps: Vec<_> = Device::all().unwrap().iter().map(|d| d.capabilities().unwrap().clone()).collect();
        // CUDA 11.1 has no cuLaunchKernelEx: no programmatic dependent launch, no clusters.
        let launch_ex = !oldest();
        let linux = &caps[0];
        assert!(linux.managed_prefetch);
        assert_eq!((linux.programmatic_dependent_launch, linux.cluster_launch), (launch_ex, launch_ex));
        assert_eq!(linux.mem_sync_domain_count, 4);
        assert_eq!(linux.max_access_policy_window_size, 134_213_632);
        assert_eq!(linux.max_persisting_l2_cache_size, 82_837_504);
        assert_eq!(linux.preferred_cluster_dimension, cfg!(cuda_12080) && launch_ex);
        // Before CUDA 12.0 no attribute says whether IPC works: the host's system decides, in
        // every mode of the fake.
        let (linux_ipc, windows_ipc) =
            if oldest() { (cfg!(target_os = "linux"), cfg!(target_os = "linux")) } else { (true, false) };
        assert_eq!((linux.ipc_events, linux.legacy_ipc), (linux_ipc, linux_ipc));
        for windows in &caps[1..] {
            assert!(!windows.managed_prefetch, "{windows}");
            assert_eq!((windows.ipc_events, windows.legacy_ipc), (windows_ipc, windows_ipc), "{windows}");
            assert_eq!(windows.programmatic_dependent_launch, launch_ex, "{windows}");
        }
        let report = linux.to_string();
        let yes = |b: bool| if b { "yes" } else { "no" };
        let pdl = format!("dependent launch (PDL)      {}", yes(launch_ex));
        let (ipc_events, legacy_ipc) = (
            format!("IPC events                  {}", yes(linux_ipc)),
            format!("legacy IPC memory           {}", yes(linux_ipc)),
        );
        for line in [
            "managed prefetch            yes",
            &pdl,
            "memory sync domains         4",
            "access-policy window        128.0 MiB",
            "persisting L2 cache         79.0 MiB",
            &ipc_events,
            &legacy_ipc,
        ] {
            assert!(report.contains(line), "{line:?} missing from\n{report}");
        }
        let windows_legacy_ipc = format!("legacy IPC memory           {}", yes(windows_ipc));
        assert!(caps[2].to_string().contains(&windows_legacy_ipc));
    });
    // An older driver: no preferred cluster dimension (12.8), no IPC attribute (12.0: Linux decides).
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_DRIVER_VERSION", "11080")], || {
        let caps = Device::get(0).unwrap().capabilities().unwrap();
        assert!(!caps.preferred_cluster_dimension);
        assert_eq!(caps.ipc_events, cfg!(target_os = "linux"));
    });
}

#[test]
fn memory_info_sees_allocations_come_and_go() {
    run_with_fake(&[("CUDRV_FAKE_MEMORY", "1073741824"), ("CUDRV_MEMORY_RESOURCE", "sync")], || {
        let dev = Device::get(0).unwrap();
        let before = dev.memory_info().unwrap();
        assert_eq!(before.total, 1 << 30);
        assert_eq!(before.free, 1 << 30);
        assert_eq!(before.used(), 0);
        let s = Stream::new(&dev).unwrap();
        let b = DeviceBuffer::<u8>::zeroed(100 << 20, &s).unwrap();
        let during = dev.memory_info().unwrap();
        assert_eq!(during.used(), 100 << 20);
        assert_eq!(during.to_string(), "0.9 GiB free of 1.0 GiB");
        drop(b);
        assert_eq!(dev.memory_info().unwrap(), before);
    });
}

// ------------------------------------------------------------------------------------------------
// JIT options, the linker, libraries
// ------------------------------------------------------------------------------------------------

#[test]
fn jit_options_reach_the_compiler() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let options = JitConfig::new()
            .max_registers(8)
            .optimization_level(3)
            .target(JitTarget::of_device(&dev).unwrap())
            .fallback(JitFallback::PreferBinary)
            .line_info(true)
            .debug_info(true)
            .cache_mode(JitCacheMode::L2Only);
        let module = Module::from_ptx_with(&dev, PTX, &options).unwrap();
        let log = module.info_log();
        assert!(log.contains("5 entries compiled"), "{log}");
        assert!(
            log.contains(
                "max registers 8, optimisation level 3, target compute_90, prefer binary, line info, debug info, cache mode cg"
            ),
            "{log}"
        );
        let took = module.compile_time().unwrap().as_secs_f64();
        assert!((took - 0.000_25).abs() < 1e-9, "{took}");
        assert_eq!(module.function("add_f32").unwrap().attributes().unwrap().num_registers, 8);
        // Without options nothing is described, and the default register count applies.
        let plain = Module::from_ptx(&dev, PTX).unwrap();
        assert!(!plain.info_log().contains('('), "{}", plain.info_log());
        assert_eq!(plain.function("add_f32").unwrap().attributes().unwrap().num_registers, 16);
        // A log of 8 bytes holds 7 characters.
        let short = Module::from_ptx_with(&dev, PTX, &JitConfig::new().log_size(8)).unwrap();
        assert_eq!(short.info_log(), "fake pt");
        // The other constructors take options too.
        Module::from_file_with(&dev, write_temp("jit.ptx", PTX.as_bytes()), &JitConfig::new().optimization_level(0))
            .unwrap();
    });
}

#[test]
fn jit_options_out_of_range_are_refused_first() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        for (options, what) in [
            (JitConfig::new().optimization_level(5), "optimization_level is 5"),
            (JitConfig::new().max_registers(0), "max_registers is 0"),
            (JitConfig::new().max_registers(256), "max_registers is 256"),
            (JitConfig::new().target(JitTarget::compute(2, 0)), "compute_20"),
            (JitConfig::new().log_size(0), "log_size is 0"),
        ] {
            let msg = invalid_argument(Module::from_ptx_with(&dev, PTX, &options).unwrap_err());
            assert!(msg.contains(what), "{msg}");
        }
        assert_eq!(fake_report().live_modules, 0);
        // A target the device cannot run: the driver's error, with its log.
        let err =
            Module::from_ptx_with(&dev, PTX, &JitConfig::new().target(JitTarget::arch_specific(10, 0))).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU));
        let Error::Jit { log, .. } = err else { panic!() };
        assert!(log.contains("compute_100a cannot run"), "{log}");
        assert_eq!(JitTarget::arch_specific(9, 0).compute_capability(), (9, 0));
    });
}

#[test]
fn the_linker_links_several_inputs_into_one_module() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let stream = Stream::new(&dev).unwrap();
        let mut linker = Linker::new(&dev, &JitConfig::new().optimization_level(2)).unwrap();
        assert!(linker.is_empty());
        linker
            .add_ptx("fill.ptx", &entries(&["fill_u32"]))
            .unwrap()
            .add_ptx("add.ptx", &entries(&["add_f32"]))
            .unwrap();
        assert_eq!(linker.len(), 2);
        assert!(linker.info_log().contains("added add.ptx (1 entry)"), "{}", linker.info_log());
        let module = linker.complete().unwrap();
        assert!(module.info_log().contains("linked 2 inputs into 2 entries"), "{}", module.info_log());
        assert!(module.compile_time().is_some());
        assert_eq!(fake_report().live_modules, 1);
        let fill = module.function("fill_u32").unwrap();
        module.function("add_f32").unwrap();
        assert!(module.function("empty").is_err(), "only what was linked is in the module");
        let mut out = DeviceBuffer::<u32>::zeroed(300, &stream).unwrap();
        // SAFETY: fill_u32(u32*, u32, u64) writes out[0..300].
        unsafe { fill.launch(LaunchConfig::for_num_elems(300), &stream, (&mut out, 42u32, 300u64)).unwrap() };
        assert_eq!(out.to_vec().unwrap(), vec![42; 300]);
    });
}

#[test]
fn linked_images_round_trip_through_cubins_files_and_libraries() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let mut first = Linker::new(&dev, &JitConfig::new()).unwrap();
        first.add_ptx("a.ptx", &entries(&["fill_u32", "empty"])).unwrap();
        let cubin = first.complete_cubin().unwrap();
        assert!(cubin.starts_with(b"\x7fELF"));
        // The linked image loads as a cubin ...
        Module::from_cubin(&dev, &cubin).unwrap().function("empty").unwrap();
        // ... and links again, as data and as files of every kind.
        let mut second = Linker::new(&dev, &JitConfig::new()).unwrap();
        second.add_cubin("a.cubin", &cubin).unwrap();
        second.add_file(write_temp("b.ptx", entries(&["add_f32"]).as_bytes())).unwrap();
        second.add_file_as(LinkInput::Library, write_temp("c.bin", &second_image(&dev))).unwrap();
        let module = second.complete().unwrap();
        for name in ["fill_u32", "empty", "add_f32", "spin_fill_u32"] {
            module.function(name).unwrap();
        }
        assert_eq!(LinkInput::from_path("x.o"), Some(LinkInput::Object));
        assert_eq!(LinkInput::from_path("x.fatbin"), Some(LinkInput::Fatbin));
    });
}

/// A linked image with `spin_fill_u32`.
fn second_image(dev: &Device) -> Vec<u8> {
    let mut l = Linker::new(dev, &JitConfig::new()).unwrap();
    l.add_ptx("spin.ptx", &entries(&["spin_fill_u32"])).unwrap();
    l.complete_cubin().unwrap()
}

#[test]
fn linker_errors_carry_the_log() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        // A compile error names the input and the line.
        let mut linker = Linker::new(&dev, &JitConfig::new()).unwrap();
        let err = linker.add_ptx("broken.ptx", &entries(&["no_such_kernel"])).unwrap_err();
        let Error::Jit { log, source } = &err else { panic!("{err:?}") };
        assert!(log.contains("broken.ptx") && log.contains("line 4") && log.contains("no_such_kernel"), "{log}");
        assert!(matches!(**source, Error::Driver { call: "cuLinkAddData", .. }), "{source:?}");
        assert!(linker.error_log().contains("broken.ptx"));
        // Nothing added: completing is refused before the driver.
        assert!(invalid_argument(linker.complete().unwrap_err()).contains("no inputs"));
        // A symbol defined twice fails the link.
        let mut linker = Linker::new(&dev, &JitConfig::new()).unwrap();
        linker.add_ptx("one.ptx", &entries(&["empty"])).unwrap();
        linker.add_ptx("two.ptx", &entries(&["empty"])).unwrap();
        let Error::Jit { log, .. } = linker.complete().unwrap_err() else { panic!() };
        assert!(log.contains("duplicate definition of 'empty' in two.ptx"), "{log}");
        // Inputs cudrv can check are checked before the driver.
        let mut linker = Linker::new(&dev, &JitConfig::new()).unwrap();
        assert!(invalid_argument(linker.add_cubin("x.cubin", b"junk").unwrap_err()).contains("ELF magic"));
        assert!(invalid_argument(linker.add_ptx("x.ptx", "a\0b").unwrap_err()).contains("NUL"));
        assert!(invalid_argument(linker.add_data(LinkInput::Object, "x.o", &[]).unwrap_err()).contains("empty"));
        assert!(invalid_argument(linker.add_file("README").unwrap_err()).contains("extension"));
        let missing = std::env::temp_dir().join("cudrv-no-such-input.ptx");
        assert!(invalid_argument(linker.add_file(&missing).unwrap_err()).contains("cudrv-no-such-input.ptx"));
        // A binary the driver does not take: its error, with the log.
        let mut object = vec![0u8; 80];
        object[..4].copy_from_slice(b"\x7fELF");
        let err = linker.add_object("host.o", &object).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU));
        // Options are checked as for modules.
        assert!(Linker::new(&dev, &JitConfig::new().optimization_level(9)).is_err());
        drop(linker); // destroys the link state
    });
}

#[cfg(cuda_12000)]
#[test]
fn library_kernels_launch_on_every_device() {
    use cudrv::module::Library;
    // Drivers before CUDA 12.0 have no libraries.
    let without_libraries = || assert_missing_on_oldest(Library::from_ptx(PTX), "cuLibraryLoadData");
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,tcc")], || {
        if oldest() {
            return without_libraries();
        }
        let library = Library::from_ptx_with(PTX, &JitConfig::new().max_registers(12)).unwrap();
        assert!(library.info_log().contains("max registers 12"), "{}", library.info_log());
        assert_eq!(fake_report().live_modules, 1);
        #[cfg(cuda_12050)]
        {
            let mut names = library.kernel_names().unwrap();
            names.sort();
            assert_eq!(names, ["add_f32", "empty", "fill_pattern_u8", "fill_u32", "spin_fill_u32"]);
        }
        let fill = library.kernel("fill_u32").unwrap();
        assert_eq!(fill.name(), "fill_u32");
        assert!(invalid_argument(library.kernel("nope").unwrap_err()).contains("\"nope\""));
        for dev in Device::all().unwrap() {
            let stream = Stream::new(&dev).unwrap();
            let mut out = DeviceBuffer::<u32>::zeroed(1000, &stream).unwrap();
            let value = 10 + dev.ordinal() as u32;
            // SAFETY: fill_u32(u32*, u32, u64) writes out[0..1000].
            unsafe { fill.launch(LaunchConfig::for_num_elems(1000), &stream, (&mut out, value, 1000u64)).unwrap() };
            assert_eq!(out.to_vec().unwrap(), vec![value; 1000]);
            let f = fill.function(&dev).unwrap();
            assert_eq!(f.device(), dev);
            assert_eq!(f.attributes().unwrap().num_registers, 12);
            // One function per device, shared.
            assert_eq!(fill.function(&dev).unwrap().as_raw(), f.as_raw());
        }
        // The library's code in each context is not a module of its own; the library goes with
        // its last kernel and function.
        assert_eq!(fake_report().live_modules, 1);
        let f = fill.function(&Device::get(0).unwrap()).unwrap();
        drop((library, fill));
        assert_eq!(fake_report().live_modules, 1, "the function keeps the library");
        drop(f);
        assert_eq!(fake_report().live_modules, 0);
        let err = Library::from_ptx(&entries(&["bogus"])).unwrap_err();
        assert!(matches!(err, Error::Jit { .. }), "{err:?}");
        Library::from_file(write_temp("lib.ptx", PTX.as_bytes())).unwrap().kernel("empty").unwrap();
    });
    let legacy = legacy_fake_driver_path().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &legacy)], without_libraries);
}

// ------------------------------------------------------------------------------------------------
// Launch attributes and cluster occupancy
// ------------------------------------------------------------------------------------------------

fn fill_setup() -> (Device, cudrv::Function, Stream) {
    let dev = Device::get(0).unwrap();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    (dev, module.function("fill_u32").unwrap(), Stream::new(&dev).unwrap())
}

/// On a driver without `cuLaunchKernelEx` (CUDA 11.1): the capabilities say so, every launch with
/// attributes (whatever they are, none included) and every cluster query is refused with
/// `MissingSymbol` before the driver, and plain and cooperative launches work.
fn launches_need_launch_kernel_ex() {
    let (dev, fill, stream) = fill_setup();
    let caps = dev.capabilities().unwrap();
    assert!(!caps.programmatic_dependent_launch && !caps.cluster_launch && !caps.preferred_cluster_dimension);
    let mut out = DeviceBuffer::<u32>::zeroed(64, &stream).unwrap();
    let cfg = LaunchConfig::linear(2, 32);
    let before = last_launch().launches;
    let window = AccessPolicyWindow::new(out.as_raw(), 256);
    for attrs in [
        LaunchAttributes::new(),
        LaunchAttributes::new().programmatic_stream_serialization(true),
        LaunchAttributes::new().priority(0),
        LaunchAttributes::new().access_policy_window(window),
        LaunchAttributes::new().cluster_dim((2, 1, 1)),
        LaunchAttributes::new().mem_sync_domain(MemSyncDomain::Remote),
        LaunchAttributes::new().cooperative(true),
    ] {
        // SAFETY: fill_u32 writes out[0..64]; refused.
        let launched = unsafe { fill.launch_with(cfg, &attrs, &stream, (&mut out, 1u32, 64u64)) };
        assert_missing_on_oldest(launched, "cuLaunchKernelEx");
    }
    assert_missing_on_oldest(fill.max_potential_cluster_size(cfg), "cuLaunchKernelEx");
    assert_missing_on_oldest(fill.max_active_clusters(cfg, (2, 1, 1)), "cuLaunchKernelEx");
    assert_missing_on_oldest(fill.set_non_portable_cluster_size_allowed(true), "cuLaunchKernelEx");
    assert_eq!(last_launch().launches, before, "nothing reached the driver");
    // SAFETY: fill_u32 writes out[0..64].
    unsafe { fill.launch(cfg, &stream, (&mut out, 5u32, 64u64)).unwrap() };
    assert_eq!(last_launch().api(), "cuLaunchKernel");
    // SAFETY: as above.
    unsafe { fill.launch_cooperative(cfg, &stream, (&mut out, 6u32, 64u64)).unwrap() };
    assert_eq!((last_launch().api(), last_launch().cooperative), ("cuLaunchCooperativeKernel", 1));
    assert_eq!(out.to_vec().unwrap(), vec![6; 64]);
}

#[test]
fn launch_attributes_reach_the_driver() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "100")], || {
        if oldest() {
            return launches_need_launch_kernel_ex();
        }
        let (dev, fill, stream) = fill_setup();
        let n = 4096usize;
        let mut out = DeviceBuffer::<u32>::zeroed(n, &stream).unwrap();
        let cfg = LaunchConfig { grid: (8, 2, 1), block: (128, 1, 1), shared_mem_bytes: 0 };
        let (least, greatest) = dev.capabilities().unwrap().stream_priority_range;
        assert_eq!((least, greatest), (0, -5));
        let window = AccessPolicyWindow { hit_ratio: 0.5, ..AccessPolicyWindow::persisting(&out, 0.5) };
        let (base, bytes) = (out.as_raw(), out.byte_len());
        let mut attrs = LaunchAttributes::new()
            .programmatic_stream_serialization(true)
            .priority(greatest)
            .access_policy_window(window)
            .cluster_dim((2, 2, 1))
            .mem_sync_domain(MemSyncDomain::Remote);
        if cfg!(cuda_12080) {
            attrs = attrs.preferred_cluster_dim((4, 2, 1));
        }
        // SAFETY: fill_u32(u32*, u32, u64) writes out[0..n].
        unsafe { fill.launch_with(cfg, &attrs, &stream, (&mut out, 5u32, n as u64)).unwrap() };
        assert_eq!(out.to_vec().unwrap(), vec![5; n]);
        let l = last_launch();
        assert_eq!(l.api(), "cuLaunchKernelEx");
        assert_eq!((l.grid, l.block), ([8, 2, 1], [128, 1, 1]));
        assert_eq!(l.programmatic_stream_serialization, 1);
        assert_eq!((l.has_priority, l.priority), (i32::from(cfg!(cuda_12000)), if cfg!(cuda_12000) { -5 } else { 0 }));
        assert_eq!(l.mem_sync_domain, if cfg!(cuda_12000) { 1 } else { -1 });
        assert_eq!(l.cluster, [2, 2, 1]);
        assert_eq!(l.preferred_cluster, if cfg!(cuda_12080) { [4, 2, 1] } else { [0; 3] });
        assert_eq!(l.has_access_policy_window, 1);
        assert_eq!((l.apw_base, l.apw_bytes, l.apw_hit_ratio), (base, bytes as u64, 0.5));
        assert_eq!((l.apw_hit, l.apw_miss), (2, 1)); // persisting, streaming
        // Cooperative through the attributes, and no attributes at all.
        let coop = LaunchAttributes::new().cooperative(true);
        // SAFETY: as above.
        unsafe { fill.launch_with(LaunchConfig::linear(4, 256), &coop, &stream, (&mut out, 6u32, n as u64)).unwrap() };
        assert_eq!(last_launch().cooperative, 1);
        // SAFETY: as above.
        unsafe { fill.launch_with(cfg, &LaunchAttributes::new(), &stream, (&mut out, 7u32, n as u64)).unwrap() };
        let l = last_launch();
        assert_eq!((l.cooperative, l.cluster, l.mem_sync_domain), (0, [0; 3], -1));
        assert_eq!(out.to_vec().unwrap(), vec![7; n]);
        // The existing entry points keep working, through the same path.
        // SAFETY: as above.
        unsafe { fill.launch_cluster(cfg, (2, 1, 1), &stream, (&mut out, 8u32, n as u64)).unwrap() };
        assert_eq!(last_launch().cluster, [2, 1, 1]);
        // SAFETY: as above.
        unsafe { fill.launch(cfg, &stream, (&mut out, 9u32, n as u64)).unwrap() };
        assert_eq!(last_launch().api(), "cuLaunchKernel");
        assert_eq!(out.to_vec().unwrap(), vec![9; n]);
        let _ = AccessProperty::Normal;
    });
}

#[test]
fn launch_attributes_are_checked_before_the_driver() {
    run_with_fake(&[], || {
        if oldest() {
            return launches_need_launch_kernel_ex();
        }
        let (_dev, fill, stream) = fill_setup();
        let mut out = DeviceBuffer::<u32>::zeroed(64, &stream).unwrap();
        let cfg = LaunchConfig::linear(4, 64);
        let before = last_launch().launches;
        let launch = |attrs: LaunchAttributes, out: &mut DeviceBuffer<u32>| {
            // SAFETY: fill_u32 writes out[0..64]; every launch here is refused anyway.
            unsafe { fill.launch_with(cfg, &attrs, &stream, (out, 1u32, 64u64)) }.unwrap_err()
        };
        if cfg!(cuda_12000) {
            let err = launch(LaunchAttributes::new().priority(1), &mut out);
            assert!(matches!(err, Error::InvalidPriority { requested: 1, least: 0, greatest: -5, .. }), "{err:?}");
        }
        let window = AccessPolicyWindow::new(out.as_raw(), 256);
        let msg = invalid_launch(launch(
            LaunchAttributes::new().access_policy_window(AccessPolicyWindow { hit_ratio: 1.5, ..window }),
            &mut out,
        ));
        assert!(msg.contains("hit ratio 1.5"), "{msg}");
        let msg = invalid_launch(launch(
            LaunchAttributes::new().access_policy_window(AccessPolicyWindow { num_bytes: 1 << 30, ..window }),
            &mut out,
        ));
        assert!(msg.contains("at most 134213632 bytes"), "{msg}");
        let msg = invalid_launch(launch(LaunchAttributes::new().cluster_dim((3, 1, 1)), &mut out));
        assert!(msg.contains("not a multiple of the cluster"), "{msg}");
        if cfg!(cuda_12080) {
            let msg = invalid_launch(launch(LaunchAttributes::new().preferred_cluster_dim((2, 1, 1)), &mut out));
            assert!(msg.contains("needs a cluster dimension"), "{msg}");
            let msg = invalid_launch(launch(
                LaunchAttributes::new().cluster_dim((2, 1, 1)).preferred_cluster_dim((3, 1, 1)),
                &mut out,
            ));
            assert!(msg.contains("multiple of the cluster"), "{msg}");
        }
        let coop = LaunchAttributes::new().cooperative(true);
        // SAFETY: as above; a grid that cannot be resident at once is refused.
        let err =
            unsafe { fill.launch_with(LaunchConfig::linear(100_000, 64), &coop, &stream, (&mut out, 1u32, 64u64)) };
        assert!(invalid_launch(err.unwrap_err()).contains("resident at once"));
        assert_eq!(last_launch().launches, before, "nothing reached the driver");
        // A priority refused by the fake driver itself would show here; an injected failure does.
    });
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuLaunchKernelEx:1:1")], || {
        let (_dev, fill, stream) = fill_setup();
        let mut out = DeviceBuffer::<u32>::zeroed(64, &stream).unwrap();
        // SAFETY: fill_u32 writes out[0..64].
        let err = unsafe {
            fill.launch_with(LaunchConfig::linear(1, 64), &LaunchAttributes::new(), &stream, (&mut out, 1u32, 64u64))
        }
        .unwrap_err();
        if oldest() {
            // Refused before the driver: the injected failure is never reached.
            assert_missing_on_oldest(Err::<(), _>(err), "cuLaunchKernelEx");
            return;
        }
        assert!(matches!(err, Error::Driver { call: "cuLaunchKernelEx", .. }), "{err:?}");
    });
}

#[test]
fn launch_attributes_are_gated_on_the_driver() {
    // Before CUDA 12.0: no launch priority, no memory synchronisation domains.
    run_with_fake(&[full_fake_driver(), ("CUDRV_FAKE_DRIVER_VERSION", "11080")], || {
        let (_dev, fill, stream) = fill_setup();
        let mut out = DeviceBuffer::<u32>::zeroed(64, &stream).unwrap();
        for attrs in
            [LaunchAttributes::new().priority(0), LaunchAttributes::new().mem_sync_domain(MemSyncDomain::Default)]
        {
            // SAFETY: fill_u32 writes out[0..64]; refused anyway.
            let err =
                unsafe { fill.launch_with(LaunchConfig::linear(1, 64), &attrs, &stream, (&mut out, 1u32, 64u64)) }
                    .unwrap_err();
            let (feature, reason) = unsupported(err);
            assert!(reason.contains("predates CUDA 12.0") || reason.contains("headers older"), "{feature}: {reason}");
        }
        let attrs = LaunchAttributes::new().cluster_dim((1, 1, 1)).preferred_cluster_dim((2, 1, 1));
        // SAFETY: as above.
        let err = unsafe { fill.launch_with(LaunchConfig::linear(2, 64), &attrs, &stream, (&mut out, 1u32, 64u64)) }
            .unwrap_err();
        assert_eq!(unsupported(err).0, "a preferred cluster dimension");
        // Programmatic dependent launch needs only cuLaunchKernelEx (11.8) and compute capability 9.0.
        let attrs = LaunchAttributes::new().programmatic_stream_serialization(true);
        // SAFETY: as above.
        unsafe { fill.launch_with(LaunchConfig::linear(1, 64), &attrs, &stream, (&mut out, 3u32, 64u64)).unwrap() };
        assert_eq!(out.to_vec().unwrap(), vec![3; 64]);
    });
    // Without cuLaunchKernelEx (CUDA 11.1).
    let legacy = legacy_fake_driver_path().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &legacy)], launches_need_launch_kernel_ex);
}

#[test]
fn cluster_occupancy() {
    run_with_fake(&[], || {
        if oldest() {
            return launches_need_launch_kernel_ex();
        }
        let (_dev, fill, _stream) = fill_setup();
        let cfg = LaunchConfig::linear(64, 256);
        assert_eq!(fill.max_potential_cluster_size(cfg).unwrap(), 8);
        // 8 blocks of 256 threads per SM (the fake's model), 132 SMs, 2 blocks per cluster.
        assert_eq!(fill.max_active_clusters(cfg, (2, 1, 1)).unwrap(), 8 * 132 / 2);
        assert_eq!(fill.max_active_clusters(cfg, (8, 1, 1)).unwrap(), 8 * 132 / 8);
        assert!(fill.max_active_clusters(cfg, (16, 1, 1)).unwrap_err().to_string().contains("portable size of 8"));
        fill.set_non_portable_cluster_size_allowed(true).unwrap();
        assert_eq!(fill.max_potential_cluster_size(cfg).unwrap(), 16);
        assert_eq!(fill.max_active_clusters(cfg, (16, 1, 1)).unwrap(), 8 * 132 / 16);
        let msg = invalid_launch(fill.max_active_clusters(cfg, (3, 1, 1)).unwrap_err());
        assert!(msg.contains("not a multiple"), "{msg}");
        assert!(fill.max_active_clusters(LaunchConfig::linear(64, 4096), (2, 1, 1)).is_err());
    });
}

// ------------------------------------------------------------------------------------------------
// Pitched memory, view copies, synchronous memsets
// ------------------------------------------------------------------------------------------------

#[test]
fn pitched_2d_buffers_copy_fill_and_launch() {
    run_with_fake_modes(&["linux", "tcc"], &[("CUDRV_FAKE_DELAY_US", "100")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (w, h) = (300usize, 7usize);
        let data: Vec<u32> = random_u64s(time_seed(), w * h).into_iter().map(|x| x as u32).collect();
        let mut a = DeviceBuffer2D::from_slice(&data, w, h, &s).unwrap();
        assert_eq!((a.width(), a.height(), a.len(), a.pitch()), (w, h, w * h, 1536));
        assert_eq!(a.to_vec().unwrap(), data);
        // Rows and rectangles.
        assert_eq!(a.row(3).unwrap().to_vec().unwrap(), &data[3 * w..4 * w]);
        let rect = a.view(10..20, 2..5).unwrap();
        assert_eq!((rect.width(), rect.height(), rect.pitch()), (10, 3, 1536));
        assert_eq!(rect.as_raw(), a.as_raw() + 2 * 1536 + 40);
        let expect: Vec<u32> = (2..5).flat_map(|y| data[y * w + 10..y * w + 20].to_vec()).collect();
        assert_eq!(rect.to_vec().unwrap(), expect);
        assert!(a.view(0..301, ..).is_err() && a.view(.., 5..8).is_err() && a.row(7).is_err());
        // Rectangles copy into another buffer, at an offset.
        let mut b = DeviceBuffer2D::<u32>::zeroed(40, 10, &s).unwrap();
        b.copy_rect_from((5, 6), &a.view(10..20, 2..5).unwrap()).unwrap();
        let got = b.to_vec().unwrap();
        for y in 0..10 {
            for x in 0..40 {
                let want = if (6..9).contains(&y) && (5..15).contains(&x) { data[(y - 4) * w + x + 5] } else { 0 };
                assert_eq!(got[y * 40 + x], want, "({x}, {y})");
            }
        }
        assert!(
            invalid_argument(b.copy_rect_from((35, 0), &a.view(0..10, 0..1).unwrap()).unwrap_err()).contains("fit")
        );
        // Whole buffers, to and from tight device buffers, strided host memory, pinned memory.
        let mut c = DeviceBuffer2D::<u32>::zeroed(w, h, &s).unwrap();
        c.copy_from(&a).unwrap();
        assert_eq!(c.to_vec().unwrap(), data);
        let mut tight = DeviceBuffer::<u32>::zeroed(w * h, &s).unwrap();
        c.copy_to_buffer(&mut tight).unwrap();
        assert_eq!(tight.to_vec().unwrap(), data);
        let mut d = DeviceBuffer2D::<u32>::zeroed(w, h, &s).unwrap();
        d.copy_from_buffer(&tight).unwrap();
        assert_eq!(d.to_vec().unwrap(), data);
        let mut strided = vec![0u32; (h - 1) * 512 + w];
        d.copy_to_host_strided(&mut strided, 512).unwrap();
        assert_eq!(&strided[512 * 6..512 * 6 + w], &data[6 * w..]);
        d.memset(0).unwrap();
        d.copy_from_host_strided(&strided, 512).unwrap();
        assert_eq!(d.to_vec().unwrap(), data);
        assert!(d.copy_from_host_strided(&strided[..100], 512).is_err());
        assert!(d.copy_from_host(&data[1..]).is_err());
        let mut pinned = PinnedBuffer::<u32>::new(&dev, w * h).unwrap();
        d.copy_to_pinned_async(&mut pinned).unwrap();
        assert_eq!(pinned.as_slice().unwrap(), &data[..]);
        let zeros = PinnedBuffer::<u32>::new(&dev, w * h).unwrap();
        d.copy_from_pinned_async(&zeros).unwrap();
        assert!(d.to_vec().unwrap().iter().all(|&v| v == 0));
        // Memsets, asynchronous and synchronous, of 8, 16 and 32 bits.
        a.fill(0xABCD_EF01).unwrap();
        assert!(a.to_vec().unwrap().iter().all(|&v| v == 0xABCD_EF01));
        a.fill(7).unwrap(); // queued: the synchronous memset below comes after it
        a.memset_sync(0x11).unwrap();
        assert!(a.to_vec().unwrap().iter().all(|&v| v == 0x1111_1111));
        a.fill_sync(3).unwrap();
        assert!(a.to_vec().unwrap().iter().all(|&v| v == 3));
        let mut h16 = DeviceBuffer2D::<u16>::zeroed(33, 3, &s).unwrap();
        h16.fill(0xBEEF).unwrap();
        assert_eq!(h16.to_vec().unwrap(), vec![0xBEEF; 99]);
        h16.fill_sync(2).unwrap();
        assert_eq!(h16.to_vec().unwrap(), vec![2; 99]);
        let mut wide = DeviceBuffer2D::<u64>::zeroed(3, 3, &s).unwrap();
        assert!(invalid_argument(wide.fill(1).unwrap_err()).contains("8-byte"));
        wide.memset_sync(0xFF).unwrap();
        assert_eq!(wide.to_vec().unwrap(), vec![u64::MAX; 9]);
        // A kernel writes one row through a view: the others stay as they are.
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let row = a.row(4).unwrap();
        // SAFETY: fill_u32(u32*, u32, u64) writes w elements from the row's start: row 4 only.
        unsafe { fill.launch(LaunchConfig::for_num_elems(w), &s, (row, 99u32, w as u64)).unwrap() };
        let got = a.to_vec().unwrap();
        assert!(got[4 * w..5 * w].iter().all(|&v| v == 99));
        assert!(got[..4 * w].iter().chain(&got[5 * w..]).all(|&v| v == 3));
        // Empty buffers are fine; shapes must match.
        let empty = DeviceBuffer2D::<u8>::zeroed(0, 5, &s).unwrap();
        assert!(empty.is_empty() && empty.to_vec().unwrap().is_empty());
        assert!(c.copy_from(&DeviceBuffer2D::zeroed(w, h + 1, &s).unwrap()).is_err());
        drop((a, b, c, d, h16, wide, empty, tight));
        assert!(fake_report().violations.is_empty());
    });
}

#[test]
fn pitched_buffers_on_other_streams_are_freed_after_them() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let home = Stream::new(&dev).unwrap();
        let other = Stream::new(&dev).unwrap();
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        let a = DeviceBuffer2D::<u32>::zeroed(64, 4, &home).unwrap();
        // SAFETY: fill_u32 writes 64 elements of row 0.
        unsafe { fill.launch(LaunchConfig::linear(1, 64), &other, (a.row(0).unwrap(), 1u32, 64u64)).unwrap() };
        drop(a); // waits for `other` before cuMemFree: no use after free in the fake's report
        assert!(fake_report().violations.is_empty());
        assert_no_leaks_but_streams();
    });
}

#[test]
fn pitched_3d_buffers_copy_boxes() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "100")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let (w, h, d) = (20usize, 6usize, 5usize);
        let data: Vec<u16> = (0..w * h * d).map(|i| i as u16).collect();
        let a = DeviceBuffer3D::from_slice(&data, (w, h, d), &s).unwrap();
        assert_eq!((a.extent(), a.pitch(), a.len()), ((w, h, d), 512, w * h * d));
        assert_eq!(a.to_vec().unwrap(), data);
        let at = |x: usize, y: usize, z: usize| data[(z * h + y) * w + x];
        // Slices are 2D views, with rows and rectangles of their own.
        let slice = a.slice(3).unwrap();
        assert_eq!((slice.width(), slice.height(), slice.pitch()), (w, h, 512));
        assert_eq!(slice.to_vec().unwrap(), &data[3 * w * h..4 * w * h]);
        assert_eq!(slice.row(2).unwrap().to_vec().unwrap(), &data[(3 * h + 2) * w..(3 * h + 3) * w]);
        assert_eq!(
            slice.view(1..3, 4..6).unwrap().to_vec().unwrap(),
            [at(1, 4, 3), at(2, 4, 3), at(1, 5, 3), at(2, 5, 3)]
        );
        assert!(slice.row(6).is_err());
        let mut b = DeviceBuffer3D::<u16>::zeroed((4, 3, 2), &s).unwrap();
        b.copy_box_from((0, 0, 0), &a, (7, 2, 1), (4, 3, 2)).unwrap();
        let got = b.to_vec().unwrap();
        for z in 0..2 {
            for y in 0..3 {
                for x in 0..4 {
                    assert_eq!(got[(z * 3 + y) * 4 + x], at(7 + x, 2 + y, 1 + z), "({x}, {y}, {z})");
                }
            }
        }
        assert!(b.copy_box_from((1, 0, 0), &a, (0, 0, 0), (4, 1, 1)).is_err());
        assert!(b.copy_box_from((0, 0, 0), &a, (18, 0, 0), (4, 1, 1)).is_err());
        let mut c = DeviceBuffer3D::<u16>::zeroed((w, h, d), &s).unwrap();
        c.copy_from(&a).unwrap();
        assert_eq!(c.to_vec().unwrap(), data);
        c.fill(5).unwrap();
        assert_eq!(c.to_vec().unwrap(), vec![5; w * h * d]);
        c.fill_sync(6).unwrap();
        assert_eq!(c.to_vec().unwrap(), vec![6; w * h * d]);
        assert_eq!(c.slice(4).unwrap().to_vec().unwrap(), vec![6; w * h]);
        assert!(c.slice(5).is_err());
    });
}

#[test]
fn copies_between_views_record_both_buffers() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "20000"), ("CUDRV_MEMORY_RESOURCE", "pool")], || {
        let dev = Device::get(0).unwrap();
        let (a, b, c) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
        let src = DeviceBuffer::from_slice(&(0..1000u32).collect::<Vec<_>>(), &a).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(500, &b).unwrap();
        c.wait_stream(&b).unwrap(); // dst's zeroing is done before c copies into it
        dst.copy_from_view(100, &src.view(200..400).unwrap(), &c).unwrap();
        drop(src); // freed on `a`, after the copy on `c` (recorded)
        // A new buffer on `a` reuses src's block only once the copy is done.
        let mut reuse = DeviceBuffer::<u32>::zeroed(1000, &a).unwrap();
        reuse.fill(0xDEAD).unwrap();
        b.wait_stream(&c).unwrap();
        let got = dst.to_vec().unwrap();
        assert!(got[..100].iter().chain(&got[300..]).all(|&v| v == 0));
        assert_eq!(&got[100..300], &(200..400u32).collect::<Vec<_>>()[..]);
        assert!(fake_report().violations.is_empty());
        // Errors: out of range, another device.
        assert!(dst.copy_from_view(400, &reuse.view(..200).unwrap(), &c).is_err());
        // Inside one buffer, without overlap.
        dst.copy_within(100..150, 400).unwrap();
        let got = dst.to_vec().unwrap();
        assert_eq!(&got[400..450], &(200..250u32).collect::<Vec<_>>()[..]);
        assert!(invalid_argument(dst.copy_within(0..100, 50).unwrap_err()).contains("overlap"));
        assert!(dst.copy_within(0..100, 450).is_err());
        dst.copy_within(0..0, 500).unwrap();
    });
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux")], || {
        let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
        let s0 = Stream::new(&d0).unwrap();
        let s1 = Stream::new(&d1).unwrap();
        let src = DeviceBuffer::from_slice(&[1u8; 16], &s1).unwrap();
        let mut dst = DeviceBuffer::<u8>::zeroed(16, &s0).unwrap();
        let err = dst.copy_from_view(0, &src.as_view(), &s0).unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { expected: 0, found: 1, .. }), "{err:?}");
        let own = DeviceBuffer::from_slice(&[1u8; 16], &s0).unwrap();
        let err = dst.copy_from_view(0, &own.as_view(), &s1).unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { .. }), "{err:?}");
    });
}

#[test]
fn synchronous_memsets_come_after_the_buffers_stream() {
    run_with_fake_modes(&["linux", "tcc"], &[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut b8 = DeviceBuffer::<u8>::zeroed(1000, &s).unwrap();
        b8.fill(9).unwrap(); // queued behind the delay
        b8.memset_sync(4).unwrap();
        assert!(s.query().unwrap(), "the stream's work was waited for");
        assert_eq!(b8.to_vec().unwrap(), vec![4; 1000]);
        let mut b16 = DeviceBuffer::<i16>::zeroed(100, &s).unwrap();
        b16.fill(1).unwrap();
        b16.fill_sync(-3).unwrap();
        assert_eq!(b16.to_vec().unwrap(), vec![-3; 100]);
        let mut b32 = DeviceBuffer::<f32>::zeroed(100, &s).unwrap();
        b32.fill_sync(2.5).unwrap();
        assert_eq!(b32.to_vec().unwrap(), vec![2.5; 100]);
        let mut b64 = DeviceBuffer::<u64>::zeroed(4, &s).unwrap();
        assert!(invalid_argument(b64.fill_sync(1).unwrap_err()).contains("8-byte"));
        DeviceBuffer::<u32>::zeroed(0, &s).unwrap().fill_sync(1).unwrap();
    });
}

// ------------------------------------------------------------------------------------------------
// Managed memory
// ------------------------------------------------------------------------------------------------

#[test]
fn managed_buffers_take_advice_and_prefetch() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux"), ("CUDRV_FAKE_DELAY_US", "100")], || {
        let dev = Device::get(0).unwrap();
        let dev1 = Device::get(1).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut m = ManagedBuffer::from_slice(&[1u32, 2, 3, 4], &s).unwrap();
        assert_eq!(m.as_slice().unwrap(), [1, 2, 3, 4]);
        m.as_mut_slice().unwrap()[0] = 10;
        assert_eq!(m.to_vec().unwrap(), [10, 2, 3, 4]);
        // Advice, read back from the driver.
        assert!(!m.is_read_mostly().unwrap());
        assert_eq!(m.preferred_location().unwrap(), None);
        m.advise(Advice::SetReadMostly).unwrap();
        assert!(m.is_read_mostly().unwrap());
        m.advise(Advice::UnsetReadMostly).unwrap();
        assert!(!m.is_read_mostly().unwrap());
        m.advise(Advice::SetPreferredLocation(Location::Device(dev1))).unwrap();
        assert_eq!(m.preferred_location().unwrap(), Some(Location::Device(dev1)));
        m.advise(Advice::SetPreferredLocation(Location::Host)).unwrap();
        assert_eq!(m.preferred_location().unwrap(), Some(Location::Host));
        m.advise(Advice::UnsetPreferredLocation).unwrap();
        assert_eq!(m.preferred_location().unwrap(), None);
        m.advise(Advice::SetAccessedBy(Location::Device(dev1))).unwrap();
        m.advise(Advice::SetAccessedBy(Location::Host)).unwrap();
        assert_eq!(m.accessed_by().unwrap(), [Location::Device(dev1), Location::Host]);
        m.advise(Advice::UnsetAccessedBy(Location::Host)).unwrap();
        assert_eq!(m.accessed_by().unwrap(), [Location::Device(dev1)]);
        // Prefetches, in stream order.
        assert_eq!(m.last_prefetch_location().unwrap(), None);
        m.prefetch_to(Location::Device(dev), &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(m.last_prefetch_location().unwrap(), Some(Location::Device(dev)));
        let s1 = Stream::new(&dev1).unwrap();
        m.prefetch_to(Location::Device(dev1), &s1).unwrap(); // a stream of the other device
        m.prefetch_to(Location::Host, &s1).unwrap();
        s1.synchronize().unwrap();
        assert_eq!(m.last_prefetch_location().unwrap(), Some(Location::Host));
        // A kernel writes it; host access waits for the kernel.
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        // SAFETY: fill_u32 writes m[0..4].
        unsafe { fill.launch(LaunchConfig::linear(1, 32), &s, (&mut m, 77u32, 4u64)).unwrap() };
        assert_eq!(m.as_slice().unwrap(), [77; 4]);
        m.fill(5).unwrap();
        assert_eq!(m.as_slice().unwrap(), [5; 4]);
        m.memset(0).unwrap();
        assert_eq!(m.to_vec().unwrap(), [0; 4]);
        m.copy_from_host(&[6, 7, 8, 9]).unwrap();
        assert_eq!(m.as_slice().unwrap(), [6, 7, 8, 9]);
        assert!(m.copy_from_host(&[1]).is_err());
        let z = ManagedBuffer::<u8>::zeroed(0, &s).unwrap();
        assert!(z.as_slice().unwrap().is_empty());
        z.prefetch_to(Location::Host, &s).unwrap();
        drop((m, z, s1));
        assert!(fake_report().violations.is_empty());
        assert_eq!(fake_report().live_allocations, 0);
    });
}

#[test]
fn managed_host_access_and_prefetch_need_concurrent_access() {
    run_with_fake_modes(&["wddm", "tcc"], &[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut m = ManagedBuffer::from_slice(&[1.5f32; 8], &s).unwrap();
        assert_eq!(m.to_vec().unwrap(), [1.5; 8], "copies work everywhere");
        let (feature, reason) = unsupported(m.as_slice().unwrap_err());
        assert_eq!(feature, "host access to managed memory");
        assert!(reason.contains("CONCURRENT_MANAGED_ACCESS is 0"), "{reason}");
        assert!(m.as_mut_slice().is_err());
        let (feature, _) = unsupported(m.prefetch_to(Location::Host, &s).unwrap_err());
        assert_eq!(feature, "prefetching managed memory");
        m.advise(Advice::SetReadMostly).unwrap();
        assert!(m.is_read_mostly().unwrap());
        // The resource moved next to the buffer still works.
        let buf = DeviceBuffer::from_slice_in(&[3u8; 5], &s, Arc::new(ManagedResource::new(&dev).unwrap())).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [3; 5]);
    });
    // A driver without cuMemPrefetchAsync_v2 and cuMemAdvise_v2 (CUDA 11.1): the first forms,
    // which cudrv-sys declares where the headers (13.0) no longer do.
    let legacy = legacy_fake_driver_path().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &legacy)], || {
        let d = cudrv::sys::Driver::global().unwrap();
        assert!(!d.has("cuMemPrefetchAsync_v2") && !d.has("cuMemAdvise_v2"));
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut m = ManagedBuffer::from_slice(&[1u8; 8], &s).unwrap();
        m.prefetch_to(Location::Device(dev), &s).unwrap();
        m.prefetch_to(Location::Host, &s).unwrap();
        m.advise(Advice::SetReadMostly).unwrap();
        assert!(m.is_read_mostly().unwrap());
        m.advise(Advice::SetPreferredLocation(Location::Host)).unwrap();
        assert_eq!(m.preferred_location().unwrap(), Some(Location::Host));
        m.as_mut_slice().unwrap()[3] = 9;
        assert_eq!(m.to_vec().unwrap(), [1, 1, 1, 9, 1, 1, 1, 1]);
    });
}

// ------------------------------------------------------------------------------------------------
// IPC
// ------------------------------------------------------------------------------------------------

const PEER_ROLE: &str = "CUDRV_TEST_PEER";
const PEER_DATA: &str = "CUDRV_TEST_PEER_DATA";

/// In a process started by [`run_peer`] for `role`: the data it was given.
pub(crate) fn peer_data(role: &str) -> Option<String> {
    (std::env::var(PEER_ROLE).ok()? == role).then(|| std::env::var(PEER_DATA).unwrap_or_default())
}

/// Runs the current test again in a new process of this binary, as `role` with `data` (it sees
/// the same driver and configuration, and returns early through [`peer_data`]); panics with its
/// output if it fails. Returns its standard output.
pub(crate) fn run_peer(role: &str, data: &str) -> String {
    let name = std::thread::current().name().expect("a test thread").to_string();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name.as_str(), "--exact", "--nocapture", "--test-threads=1", "--include-ignored"])
        .env(PEER_ROLE, role)
        .env(PEER_DATA, data)
        .env_remove("CUDRV_FAKE_CHILD")
        .stdin(Stdio::null());
    let out = output_retrying_start(&mut cmd).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let done = format!("peer done: {role}");
    assert!(
        out.status.success() && stdout.contains(&done),
        "peer {role} failed ({}):\n---- stdout ----\n{stdout}\n---- stderr ----\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Ends a peer: no violations, and the marker `run_peer` looks for.
fn peer_done(role: &str) {
    let report = fake_report();
    assert!(report.violations.is_empty(), "{report}");
    println!("peer done: {role}");
}

#[test]
fn ipc_handles_are_bytes() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &s) {
            return;
        }
        let buf = DeviceBuffer::from_slice_in(&[1u64; 32], &s, Arc::new(SyncResource::new(&dev).unwrap())).unwrap();
        let h = buf.ipc_handle().unwrap();
        assert_eq!((h.kind(), h.offset(), h.byte_len()), (IpcMemKind::Legacy, 0, 256));
        assert_eq!(h.device_uuid(), dev.uuid().unwrap());
        assert_eq!(IpcMemHandle::from_bytes(&h.to_bytes()).unwrap(), h);
        assert_eq!(h.to_string().parse::<IpcMemHandle>().unwrap(), h);
        assert!(IpcMemHandle::from_bytes(&h.to_bytes()[1..]).is_err());
        assert!("zz".parse::<IpcMemHandle>().is_err());
        let mut bad = h.to_bytes();
        bad[8] = 9;
        assert!(invalid_argument(IpcMemHandle::from_bytes(&bad).unwrap_err()).contains("unknown kind"));
        let e = IpcEvent::new(&dev).unwrap();
        let eh = e.handle().unwrap();
        assert_eq!(eh.to_string().parse::<IpcEventHandle>().unwrap(), eh);
        assert!("00".parse::<IpcEventHandle>().is_err());
        assert!(!e.is_opened());
        // Opening in the exporting process is the driver's error.
        let err = IpcBuffer::<u64>::open(&h, &s).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_INVALID_CONTEXT));
        assert!(IpcEvent::open(&dev, &eh).is_err());
        // The handle's size must be whole elements of the opening type.
        let msg = invalid_argument(IpcBuffer::<[u8; 3]>::open(&h, &s).unwrap_err());
        assert!(msg.contains("whole number"), "{msg}");
        drop((buf, e));
    });
}

#[test]
fn legacy_ipc_between_two_processes() {
    if let Some(data) = peer_data("importer") {
        // The second process: open the buffers and the event, check, write back, signal.
        let mut parts = data.split(',');
        let (sync_h, pool_h, event_h) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let done = IpcEvent::open(&dev, &event_h.parse().unwrap()).unwrap();
        assert!(done.is_opened());
        done.wait_in(&s).unwrap(); // the exporter's writes are ordered before this stream's work
        let mut a = IpcBuffer::<u32>::open(&sync_h.parse().unwrap(), &s).unwrap();
        assert_eq!(a.to_vec().unwrap(), (0..1024).collect::<Vec<u32>>());
        let pool_handle: IpcMemHandle = pool_h.parse().unwrap();
        assert!(pool_handle.offset() > 0, "a buffer inside the pool's chunk");
        let b = IpcBuffer::<u32>::open(&pool_handle, &s).unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![0xB0B0; 3000]);
        // A second buffer of the same allocation shares the mapping.
        let b2 = IpcBuffer::<u32>::open(&pool_handle, &s).unwrap();
        assert_eq!(b2.as_raw(), b.as_raw());
        // Write back with a kernel and a copy.
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let fill = module.function("fill_u32").unwrap();
        // SAFETY: fill_u32 writes b[0..3000].
        unsafe { fill.launch(LaunchConfig::for_num_elems(3000), &s, (&b, 0xCAFEu32, 3000u64)).unwrap() };
        a.copy_from_host(&vec![7; 1024]).unwrap();
        s.synchronize().unwrap();
        done.record(&s).unwrap();
        done.synchronize().unwrap();
        assert!(done.query().unwrap());
        drop((a, b, b2));
        assert_eq!(fake_report().live_allocations, 0, "the mappings are closed");
        peer_done("importer");
        return;
    }
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "2000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &s) {
            return;
        }
        let sync = Arc::new(SyncResource::new(&dev).unwrap());
        let a = DeviceBuffer::from_slice_in(&(0..1024).collect::<Vec<u32>>(), &s, sync).unwrap();
        // A buffer of a pool in segments of virtual memory cannot be shared with legacy IPC; the
        // error says what to use instead.
        let segments = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        assert!(segments.grows_in_segments(), "the fake's devices have virtual memory management");
        let v = DeviceBuffer::<u32>::zeroed_in(100, &s, segments).unwrap();
        let (feature, reason) = unsupported(v.ipc_handle().unwrap_err());
        assert_eq!(feature, "legacy IPC of this memory");
        assert!(reason.contains("PoolConfig::expandable"), "{reason}");
        drop(v); // and the pool with it: its mapping and its address range go back to the driver
        // A StreamOrderedPool buffer after another one: legacy IPC of its chunk, with the offset.
        let chunked = PoolConfig { expandable: false, ..PoolConfig::default() };
        let pool = Arc::new(StreamOrderedPool::with_config(&dev, chunked).unwrap());
        assert!(!pool.grows_in_segments());
        let filler = DeviceBuffer::<u8>::zeroed_in(4096, &s, pool.clone()).unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed_in(3000, &s, pool.clone()).unwrap();
        b.fill(0xB0B0).unwrap();
        let done = IpcEvent::new(&dev).unwrap();
        done.record(&s).unwrap(); // the fill, behind the delay, is before this record
        let data = format!("{},{},{}", a.ipc_handle().unwrap(), b.ipc_handle().unwrap(), done.handle().unwrap());
        run_peer("importer", &data);
        // The importer's writes are visible here.
        assert_eq!(a.to_vec().unwrap(), vec![7; 1024]);
        assert_eq!(b.to_vec().unwrap(), vec![0xCAFE; 3000]);
        done.synchronize().unwrap();
        drop((a, b, filler, done));
        pool.trim(0).unwrap();
        assert_no_leaks_but_streams();
    });
}

#[test]
fn pool_ipc_between_two_processes() {
    if let Some(data) = peer_data("importer") {
        let mut parts = data.split(',');
        let raw: u64 = parts.next().unwrap().parse().unwrap();
        let handle: IpcMemHandle = parts.next().unwrap().parse().unwrap();
        assert_eq!(handle.kind(), IpcMemKind::Pool);
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let pool =
            ImportedPool::import(&dev, PoolShareableHandle { handle_type: ShareableHandleType::PosixFd, raw }).unwrap();
        // A legacy open of a pool handle is refused.
        assert!(invalid_argument(IpcBuffer::<f64>::open(&handle, &s).unwrap_err()).contains("ImportedPool::open"));
        let mut b = pool.open::<f64>(&handle, &s).unwrap();
        assert_eq!(b.len(), 500);
        assert_eq!(b.to_vec().unwrap(), vec![0.25; 500]);
        b.copy_from_host(&vec![4.5; 500]).unwrap();
        let src = DeviceBuffer::from_slice(&vec![8.0; 500], &s).unwrap();
        let mut c = pool.open::<f64>(&handle, &s).unwrap();
        c.copy_from(&src).unwrap();
        s.synchronize().unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![8.0; 500]);
        drop((b, c, src));
        peer_done("importer");
        return;
    }
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if oldest() {
            // No memory pools, so no pool to share: legacy IPC is what remains.
            assert_no_pools_on_oldest(SharedPool::with_handle_type(&dev, ShareableHandleType::PosixFd));
            assert_no_pools_on_oldest(SharedPool::new(&dev));
            if !ipc_refused_on_oldest(&dev, &s) {
                // The default resource is cudrv's pool, in segments of virtual memory: refused,
                // saying what to use.
                let buf = DeviceBuffer::from_slice(&[0.25f64; 500], &s).unwrap();
                assert!(unsupported(buf.ipc_handle().unwrap_err()).1.contains("PoolConfig::expandable"));
            }
            return;
        }
        // The fake's linux mode exports file descriptors, also where the host is Windows.
        let pool = Arc::new(SharedPool::with_handle_type(&dev, ShareableHandleType::PosixFd).unwrap());
        assert_eq!(pool.handle_type(), ShareableHandleType::PosixFd);
        if cfg!(unix) {
            assert_eq!(SharedPool::new(&dev).unwrap().handle_type(), ShareableHandleType::native());
        }
        let exported = pool.export().unwrap();
        let buf = DeviceBuffer::from_slice_in(&vec![0.25f64; 500], &s, pool.clone()).unwrap();
        let h = buf.ipc_handle().unwrap();
        assert_eq!((h.kind(), h.byte_len()), (IpcMemKind::Pool, 4000));
        run_peer("importer", &format!("{},{}", exported.raw, h));
        assert_eq!(buf.to_vec().unwrap(), vec![8.0; 500]);
        assert!(pool.stats().unwrap().in_use >= 4000);
        drop(buf);
        s.synchronize().unwrap();
        pool.trim(0).unwrap();
    });
}

#[test]
fn ipc_refuses_what_cannot_be_shared() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        // The driver's pool (cudarc #521): refused, saying why.
        let driver_pool = DeviceBuffer::from_slice(&[1u32; 64], &s).unwrap();
        assert_eq!(driver_pool.resource().kind(), pool_kind(&dev));
        if oldest() {
            // No driver's pool on CUDA 11.1 (pool_kind checked that DriverPool is refused): the
            // default resource is cudrv's pool, in segments of virtual memory (refused, saying
            // what to use); in chunks, its memory has legacy IPC handles.
            if !ipc_refused_on_oldest(&dev, &s) {
                assert!(unsupported(driver_pool.ipc_handle().unwrap_err()).1.contains("PoolConfig::expandable"));
                let chunked = PoolConfig { expandable: false, ..PoolConfig::default() };
                let pool = Arc::new(StreamOrderedPool::with_config(&dev, chunked).unwrap());
                let buf = DeviceBuffer::from_slice_in(&[1u32; 64], &s, pool).unwrap();
                assert_eq!(buf.ipc_handle().unwrap().kind(), IpcMemKind::Legacy);
            }
        } else {
            let (feature, reason) = unsupported(driver_pool.ipc_handle().unwrap_err());
            assert_eq!(feature, "IPC of memory-pool allocations");
            assert!(reason.contains("without shareable handle types") && reason.contains("cudarc #521"), "{reason}");
            let pool = DriverPool::default_pool(&dev).unwrap();
            let (feature, reason) = unsupported(pool.export(ShareableHandleType::PosixFd).unwrap_err());
            assert_eq!(feature, "exporting a memory pool");
            assert!(reason.contains("without the PosixFd handle type"), "{reason}");
            let (_, reason) = unsupported(pool.export(ShareableHandleType::Win32).unwrap_err());
            assert!(reason.contains("posix-fd"), "{reason}");
        }
        // Managed and pinned memory.
        let managed =
            DeviceBuffer::from_slice_in(&[1u8; 8], &s, Arc::new(ManagedResource::new(&dev).unwrap())).unwrap();
        assert_eq!(unsupported(managed.ipc_handle().unwrap_err()).0, "IPC of this memory");
        let empty = DeviceBuffer::<u8>::zeroed(0, &s).unwrap();
        assert!(empty.ipc_handle().is_err());
        assert!(SharedPool::with_handle_type(&dev, ShareableHandleType::Win32Kmt).is_err());
    });
    run_with_fake_modes(&["wddm", "tcc"], &[("CUDRV_MEMORY_RESOURCE", "sync")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[1u32; 64], &s).unwrap();
        if oldest() && cfg!(target_os = "linux") {
            // Before CUDA 12.0 no attribute says whether IPC works (Capabilities::ipc_events: the
            // host is Linux), so cudrv asks the driver, which refuses it in these modes. And
            // CUDA 11.1 has no memory pools to share.
            let not_supported = Some(CUresult::CUDA_ERROR_NOT_SUPPORTED);
            assert_eq!(buf.ipc_handle().unwrap_err().code(), not_supported);
            assert_eq!(IpcEvent::new(&dev).unwrap().handle().unwrap_err().code(), not_supported);
            assert_no_pools_on_oldest(SharedPool::with_handle_type(&dev, ShareableHandleType::Win32Kmt));
            return;
        }
        assert_eq!(unsupported(buf.ipc_handle().unwrap_err()).0, "legacy IPC of device memory");
        assert_eq!(unsupported(IpcEvent::new(&dev).unwrap_err()).0, "interprocess events");
        let tcc = dev.capabilities().unwrap().driver_model == cudrv::DriverModel::Tcc;
        // No pools on TCC, nor on any device of CUDA 11.1.
        let pools = !tcc && !oldest();
        match SharedPool::new(&dev) {
            // Windows pools export NT handles: on a Windows host the native type is Win32.
            Ok(pool) => assert!(pools && cfg!(windows), "{pool:?}"),
            Err(e) if oldest() => assert_no_pools_on_oldest(Err::<(), _>(e)),
            Err(e) => assert!(!pools || !cfg!(windows), "{e}"),
        }
        if pools {
            let pool = SharedPool::with_handle_type(&dev, ShareableHandleType::Win32Kmt).unwrap();
            assert_eq!(pool.export().unwrap().handle_type, ShareableHandleType::Win32Kmt);
        }
    });
}

#[test]
fn ipc_event_orders_work_across_processes() {
    if let Some(data) = peer_data("waiter") {
        let mut parts = data.split(',');
        let event: IpcEventHandle = parts.next().unwrap().parse().unwrap();
        let buf: IpcMemHandle = parts.next().unwrap().parse().unwrap();
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let e = IpcEvent::open(&dev, &event).unwrap();
        e.wait_in(&s).unwrap();
        let b = IpcBuffer::<u32>::open(&buf, &s).unwrap();
        // Read on `s`, after the wait: the exporter's fill is complete.
        assert_eq!(b.to_vec().unwrap(), vec![0x5EED; 1 << 16]);
        assert!(e.query().unwrap());
        peer_done("waiter");
        return;
    }
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "300000"), ("CUDRV_MEMORY_RESOURCE", "sync")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        if ipc_refused_on_oldest(&dev, &s) {
            return;
        }
        let mut buf = DeviceBuffer::<u32>::zeroed(1 << 16, &s).unwrap();
        let h = buf.ipc_handle().unwrap();
        buf.fill(0x5EED).unwrap(); // behind 300 ms of delay
        let e = IpcEvent::new(&dev).unwrap();
        e.record(&s).unwrap();
        run_peer("waiter", &format!("{},{h}", e.handle().unwrap()));
        assert_eq!(buf.to_vec().unwrap(), vec![0x5EED; 1 << 16]);
    });
}

//! Modules and kernel launches on the fake driver: load errors with JIT logs, unknown functions,
//! argument marshalling (the fake's kernels read what cudrv passes), configuration checks,
//! cooperative and cluster launches and their gating, and buffer uses recorded across streams.
//!
//! Every test body runs in a child process of this test binary (`run_with_fake`).

use crate::{assert_missing_on_oldest, invalid_argument, invalid_launch, oldest};
use cudrv_test_support::{random_u64s, time_seed};
use std::ffi::c_void;

use cudrv::launch::LaunchConfig;
use cudrv::memory::{DeviceBuffer, DeviceRepr};
use cudrv::module::{Function, Module};
use cudrv::sys::CUresult;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{
    assert_no_leaks, fake_report, fill_pattern_u8, legacy_fake_driver_path, run_with_fake, run_with_fake_modes,
};

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");
const MODES: [&str; 3] = ["linux", "wddm", "tcc"];

fn setup() -> (Device, Module, Stream) {
    let dev = Device::get(0).unwrap();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let stream = Stream::new(&dev).unwrap();
    (dev, module, stream)
}

#[test]
fn the_example_ptx_loads_and_unloads() {
    run_with_fake(&[], || {
        let (dev, module, stream) = setup();
        assert!(module.info_log().contains("5 entries compiled"), "{}", module.info_log());
        assert_eq!(module.device(), dev);
        for name in ["add_f32", "fill_u32", "spin_fill_u32", "empty", "fill_pattern_u8"] {
            let f = module.function(name).unwrap();
            assert_eq!(f.name(), name);
            assert_eq!(f.device(), dev);
        }
        assert_eq!(fake_report().live_modules, 1);
        // A Function keeps its module loaded after the Module value is gone.
        let empty = module.function("empty").unwrap();
        drop(module);
        assert_eq!(fake_report().live_modules, 1);
        // SAFETY: `empty` takes no parameters.
        unsafe { empty.launch(LaunchConfig::linear(1, 1), &stream, ()).unwrap() };
        stream.synchronize().unwrap();
        drop(empty);
        assert_eq!(fake_report().live_modules, 0);
        drop(stream);
        assert_no_leaks();
    });
}

#[test]
fn modules_load_from_a_context_a_stream_and_a_file() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let ctx = dev.primary_context().unwrap();
        let stream = Stream::new(&dev).unwrap();
        Module::from_ptx(&ctx, PTX).unwrap().function("add_f32").unwrap();
        Module::from_ptx(&*ctx, PTX).unwrap().function("add_f32").unwrap();
        Module::from_ptx(&stream, PTX).unwrap().function("add_f32").unwrap();
        let file = std::env::temp_dir().join(format!("cudrv-launch-fake-{}.ptx", std::process::id()));
        std::fs::write(&file, PTX).unwrap();
        let module = Module::from_file(&dev, &file).unwrap();
        std::fs::remove_file(&file).unwrap();
        module.function("fill_u32").unwrap();
        let missing = std::env::temp_dir().join("cudrv-no-such-module.ptx");
        let msg = invalid_argument(Module::from_file(&dev, &missing).unwrap_err());
        assert!(msg.contains("cudrv-no-such-module.ptx"), "{msg}");
    });
}

#[test]
fn an_unknown_entry_is_a_jit_error_with_the_log() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let ptx = ".version 7.0\n.target sm_52\n.address_size 64\n.visible .entry no_such_kernel()\n{\n\tret;\n}\n";
        let err = Module::from_ptx(&dev, ptx).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_INVALID_PTX));
        let Error::Jit { source, log } = &err else { panic!("expected Error::Jit, got {err:?}") };
        assert!(matches!(**source, Error::Driver { call: "cuModuleLoadDataEx", .. }), "{source:?}");
        assert!(log.contains("line 4") && log.contains("unknown entry 'no_such_kernel'"), "{log}");
        let text = err.to_string();
        assert!(text.contains("CUDA_ERROR_INVALID_PTX") && text.contains("unknown entry"), "{text}");
        assert_eq!(fake_report().live_modules, 0);
    });
}

#[test]
fn a_syntax_error_is_a_jit_error_naming_the_line() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let ptx = PTX.replacen(".address_size 64", ".address_size 64\n.fake_syntax_error", 1);
        let line = ptx.lines().position(|l| l.contains(".fake_syntax_error")).unwrap() + 1;
        let Error::Jit { log, .. } = Module::from_ptx(&dev, &ptx).unwrap_err() else { panic!("expected Error::Jit") };
        assert!(log.contains(&format!("line {line}")) && log.contains(".fake_syntax_error"), "{log}");
        // No entry at all is refused too.
        let Error::Jit { log, .. } = Module::from_ptx(&dev, ".version 7.0\n").unwrap_err() else { panic!() };
        assert!(log.contains("no .entry"), "{log}");
    });
}

#[test]
fn a_nul_in_ptx_or_a_name_is_an_invalid_argument() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let msg = invalid_argument(Module::from_ptx(&dev, "abc\0def").unwrap_err());
        assert!(msg.contains("NUL") && msg.contains('3'), "{msg}");
        assert_eq!(fake_report().live_modules, 0);
        let module = Module::from_ptx(&dev, PTX).unwrap();
        let msg = invalid_argument(module.function("add\0f32").unwrap_err());
        assert!(msg.contains("NUL"), "{msg}");
    });
}

#[test]
fn an_unknown_function_name_is_named_in_the_error() {
    run_with_fake(&[], || {
        let (_dev, module, _stream) = setup();
        let msg = invalid_argument(module.function("add_f64").unwrap_err());
        assert!(msg.contains("\"add_f64\"") && msg.contains("CUDA_ERROR_NOT_FOUND"), "{msg}");
    });
}

/// A minimal 64-bit little-endian ELF header with no sections or segments.
fn minimal_elf() -> Vec<u8> {
    let mut elf = vec![0u8; 64];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2;
    elf[5] = 1;
    elf[6] = 1;
    elf
}

#[test]
fn cubins_and_fatbins_are_checked_then_passed_to_the_driver() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        // Not ELF, short, 32-bit, or with a section table beyond the end: refused before the driver.
        assert!(invalid_argument(Module::from_cubin(&dev, b"PTX?").unwrap_err()).contains("ELF magic"));
        assert!(invalid_argument(Module::from_cubin(&dev, b"\x7fELF\x02\x01").unwrap_err()).contains("shorter"));
        let mut elf32 = minimal_elf();
        elf32[4] = 1;
        assert!(invalid_argument(Module::from_cubin(&dev, &elf32).unwrap_err()).contains("64-bit"));
        let mut truncated = minimal_elf();
        truncated[0x28..0x30].copy_from_slice(&64u64.to_le_bytes()); // e_shoff
        truncated[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        truncated[0x3C..0x3E].copy_from_slice(&3u16.to_le_bytes()); // e_shnum
        assert!(invalid_argument(Module::from_cubin(&dev, &truncated).unwrap_err()).contains("beyond the end"));
        // A well-formed image reaches the driver, which (the fake) refuses binaries with a log.
        let err = Module::from_cubin(&dev, &minimal_elf()).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU));
        assert!(matches!(&err, Error::Jit { log, .. } if log.contains("binary images")), "{err:?}");

        let mut fatbin = vec![0u8; 32];
        fatbin[..4].copy_from_slice(&0xBA55_ED50u32.to_le_bytes());
        fatbin[6..8].copy_from_slice(&16u16.to_le_bytes());
        fatbin[8..16].copy_from_slice(&16u64.to_le_bytes());
        let err = Module::from_fatbin(&dev, &fatbin).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU));
        fatbin[8..16].copy_from_slice(&17u64.to_le_bytes());
        assert!(invalid_argument(Module::from_fatbin(&dev, &fatbin).unwrap_err()).contains("declares"));
        assert!(invalid_argument(Module::from_fatbin(&dev, &minimal_elf()).unwrap_err()).contains("magic"));

        // from_file tells the kinds apart by their magic.
        let file = std::env::temp_dir().join(format!("cudrv-launch-fake-{}.cubin", std::process::id()));
        std::fs::write(&file, minimal_elf()).unwrap();
        let err = Module::from_file(&dev, &file).unwrap_err();
        std::fs::remove_file(&file).unwrap();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU));
        assert_eq!(fake_report().live_modules, 0);
    });
}

#[test]
fn arguments_reach_the_kernels() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "100")], || {
        let (_dev, module, stream) = setup();
        let base = time_seed();
        for (round, n) in [1usize, 255, 256, 257, 10_000].into_iter().enumerate() {
            let r = random_u64s(base + round as u64, 2 * n + 1);
            // fill_u32(out, value, n)
            let value = r[0] as u32;
            let mut out = DeviceBuffer::<u32>::zeroed(n, &stream).unwrap();
            // SAFETY: fill_u32(u32*, u32, u64) writes out[0..n].
            unsafe {
                module
                    .function("fill_u32")
                    .unwrap()
                    .launch(LaunchConfig::for_num_elems(n), &stream, (&mut out, value, n as u64))
                    .unwrap()
            };
            let got = out.to_vec().unwrap();
            for (i, v) in got.iter().enumerate() {
                assert_eq!(*v, value, "fill_u32 element {i} of {n}");
            }

            // add_f32(a, b, out, n), on a grid smaller than the data.
            let a: Vec<f32> = r[1..=n].iter().map(|x| (*x >> 40) as f32 / 7.0 - 1e5).collect();
            let b: Vec<f32> = r[n + 1..].iter().map(|x| (*x >> 41) as f32 / 3.0).collect();
            let da = DeviceBuffer::from_slice(&a, &stream).unwrap();
            let db = DeviceBuffer::from_slice(&b, &stream).unwrap();
            let mut dc = DeviceBuffer::<f32>::zeroed(n, &stream).unwrap();
            // SAFETY: add_f32(const f32*, const f32*, f32*, u64) touches [0..n] of each.
            unsafe {
                module
                    .function("add_f32")
                    .unwrap()
                    .launch(LaunchConfig::linear(3, 64), &stream, (&da, &db, &mut dc, n as u64))
                    .unwrap()
            };
            let c = dc.to_vec().unwrap();
            for i in 0..n {
                assert_eq!(c[i].to_bits(), (a[i] + b[i]).to_bits(), "add_f32 element {i} of {n}");
            }

            // fill_pattern_u8(out, n, seed)
            let pattern_seed = r[2];
            let mut bytes = DeviceBuffer::<u8>::zeroed(n, &stream).unwrap();
            // SAFETY: fill_pattern_u8(u8*, u64, u64) writes out[0..n].
            unsafe {
                module
                    .function("fill_pattern_u8")
                    .unwrap()
                    .launch(LaunchConfig::for_num_elems(n), &stream, (&mut bytes, n as u64, pattern_seed))
                    .unwrap()
            };
            let got = bytes.to_vec().unwrap();
            for (i, v) in got.iter().enumerate() {
                assert_eq!(*v, fill_pattern_u8(pattern_seed, i as u64), "fill_pattern_u8 element {i} of {n}");
            }
        }
    });
}

/// A `#[repr(C)]` struct passed by value: the fake reads it as fill_pattern_u8's `seed`.
#[derive(Clone, Copy)]
#[repr(C)]
struct Seed {
    value: u64,
}
// SAFETY: repr(C), one u64: no padding, any bits valid.
unsafe impl DeviceRepr for Seed {}

#[test]
fn views_structs_and_raw_parameter_arrays_marshal_too() {
    run_with_fake(&[], || {
        let (_dev, module, stream) = setup();
        let fill = module.function("fill_u32").unwrap();
        let buf = DeviceBuffer::from_slice(&[1u32; 100], &stream).unwrap();
        {
            let view = buf.view(10..20).unwrap();
            // SAFETY: fill_u32 writes view[0..10], inside the view.
            unsafe { fill.launch(LaunchConfig::linear(1, 32), &stream, (view, 5u32, 10u64)).unwrap() };
            let view = buf.view(90..).unwrap();
            // SAFETY: as above, through a reference to a view.
            unsafe { fill.launch(LaunchConfig::linear(1, 32), &stream, (&view, 6u32, 10u64)).unwrap() };
        }
        let got = buf.to_vec().unwrap();
        for (i, v) in got.iter().enumerate() {
            let expected = match i {
                10..20 => 5,
                90.. => 6,
                _ => 1,
            };
            assert_eq!(*v, expected, "element {i}");
        }

        let mut bytes = DeviceBuffer::<u8>::zeroed(77, &stream).unwrap();
        // SAFETY: fill_pattern_u8(u8*, u64, u64); Seed has the layout of a u64.
        unsafe {
            module
                .function("fill_pattern_u8")
                .unwrap()
                .launch(LaunchConfig::linear(1, 1), &stream, (&mut bytes, 77u64, Seed { value: 99 }))
                .unwrap()
        };
        let got = bytes.to_vec().unwrap();
        assert!(got.iter().enumerate().all(|(i, b)| *b == fill_pattern_u8(99, i as u64)));

        // launch_raw with a hand-made kernelParams array.
        let (mut ptr, mut value, mut n) = (buf.as_raw(), 42u32, 100u64);
        let mut params =
            [(&raw mut ptr).cast::<c_void>(), (&raw mut value).cast::<c_void>(), (&raw mut n).cast::<c_void>()];
        // SAFETY: three pointers to values of fill_u32's parameter types, alive during the call;
        // the buffer (100 elements) is on `stream`.
        unsafe { fill.launch_raw(LaunchConfig::linear(2, 64), &stream, &mut params).unwrap() };
        assert_eq!(buf.to_vec().unwrap(), vec![42; 100]);
    });
}

/// fill_u32's arguments for the whole of `out`.
fn fill_args(out: &mut DeviceBuffer<u32>, value: u32) -> (&mut DeviceBuffer<u32>, u32, u64) {
    let n = out.len() as u64;
    (out, value, n)
}

fn fill(module: &Module) -> Function {
    module.function("fill_u32").unwrap()
}

#[test]
fn configurations_beyond_the_limits_are_refused_before_the_driver() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuLaunchKernel:1+:999")], || {
        // Every cuLaunchKernel would fail with 999: the errors below come from cudrv's checks.
        let (_dev, module, stream) = setup();
        let f = fill(&module);
        let mut out = DeviceBuffer::<u32>::zeroed(16, &stream).unwrap();
        let mut try_cfg = |cfg: LaunchConfig| {
            // SAFETY: fill_u32 writes out[0..16].
            unsafe { f.launch(cfg, &stream, (&mut out, 1u32, 16u64)) }
        };
        let cases: [(LaunchConfig, &[&str]); 8] = [
            (LaunchConfig::linear(1, 1025), &["dimension x is 1025", "at most 1024"]),
            (LaunchConfig { grid: (1, 1, 1), block: (32, 32, 2), shared_mem_bytes: 0 }, &["2048 threads"]),
            (LaunchConfig { grid: (1, 1, 1), block: (1, 1, 65), shared_mem_bytes: 0 }, &["dimension z is 65", "64"]),
            (LaunchConfig { grid: (1, 1, 1), block: (2048, 1, 1), shared_mem_bytes: 0 }, &["dimension x is 2048"]),
            (LaunchConfig::linear(0, 32), &["at least 1"]),
            (LaunchConfig { grid: (1, 65536, 1), block: (1, 1, 1), shared_mem_bytes: 0 }, &["dimension y is 65536"]),
            (LaunchConfig { grid: (1, 1, 1), block: (0, 1, 1), shared_mem_bytes: 0 }, &["at least 1"]),
            (LaunchConfig::linear(1, 32).with_shared_mem(232_449), &["232449 bytes", "232448"]),
        ];
        for (cfg, needles) in cases {
            let msg = invalid_launch(try_cfg(cfg).unwrap_err());
            assert!(msg.contains("`fill_u32`"), "{msg}");
            for needle in needles {
                assert!(msg.contains(needle), "{cfg:?}: {msg:?} lacks {needle:?}");
            }
            f.validate(&cfg).unwrap_err();
        }
        // A valid configuration reaches the driver (and its injected failure).
        let err = try_cfg(LaunchConfig::linear(1, 32)).unwrap_err();
        assert!(matches!(err, Error::Driver { call: "cuLaunchKernel", .. }), "{err:?}");
    });
}

#[test]
fn dynamic_shared_memory_limit_is_explained_and_can_be_raised() {
    run_with_fake(&[], || {
        let (dev, module, stream) = setup();
        let f = fill(&module);
        let mut out = DeviceBuffer::<u32>::zeroed(16, &stream).unwrap();
        let cfg = LaunchConfig::linear(1, 32).with_shared_mem(64 * 1024);
        // SAFETY: fill_u32 writes out[0..16].
        let msg = invalid_launch(unsafe { f.launch(cfg, &stream, (&mut out, 1u32, 16u64)) }.unwrap_err());
        assert!(msg.contains("set_max_dynamic_shared_memory") && msg.contains("49152"), "{msg}");
        let optin = dev.max_shared_memory_per_block_optin().unwrap() as u32;
        let msg = invalid_argument(f.set_max_dynamic_shared_memory(optin + 1).unwrap_err());
        assert!(msg.contains(&optin.to_string()), "{msg}");
        f.set_max_dynamic_shared_memory(64 * 1024).unwrap();
        assert_eq!(f.attributes().unwrap().max_dynamic_shared_memory, 64 * 1024);
        // SAFETY: as above.
        unsafe { f.launch(cfg, &stream, (&mut out, 3u32, 16u64)) }.unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![3; 16]);
    });
}

#[test]
fn attributes_and_occupancy() {
    run_with_fake(&[], || {
        let (_dev, module, _stream) = setup();
        let f = fill(&module);
        let attrs = f.attributes().unwrap();
        assert_eq!(attrs.max_threads_per_block, 1024);
        assert_eq!(attrs.num_registers, 16);
        assert_eq!(attrs.static_shared_memory, 0);
        assert_eq!(attrs.local_memory, 0);
        assert_eq!(attrs.max_dynamic_shared_memory, 48 * 1024);
        // The fake: 16 registers x 256 threads -> limited by threads, 2048 / 256 = 8 blocks.
        assert_eq!(f.max_active_blocks_per_multiprocessor(256, 0).unwrap(), 8);
        assert!(f.max_active_blocks_per_multiprocessor(1024, 100_000).unwrap() <= 2);
        assert!(invalid_argument(f.max_active_blocks_per_multiprocessor(0, 0).unwrap_err()).contains("1..=1024"));
        assert!(f.max_active_blocks_per_multiprocessor(1025, 0).is_err());
        let s = f.suggested_block_size(0).unwrap();
        assert!(s.block_size > 0 && s.block_size <= 1024 && s.block_size.is_multiple_of(32), "{s:?}");
        assert!(s.min_grid_size >= 132, "{s:?}");
    });
}

#[test]
fn streams_and_buffers_of_another_device_are_refused() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,linux")], || {
        let (_dev0, module, stream0) = setup();
        let dev1 = Device::get(1).unwrap();
        let stream1 = Stream::new(&dev1).unwrap();
        let f = fill(&module);
        let mut on1 = DeviceBuffer::<u32>::zeroed(16, &stream1).unwrap();
        // SAFETY: refused before the launch.
        let err = unsafe { f.launch(LaunchConfig::linear(1, 16), &stream1, (&mut on1, 1u32, 16u64)) }.unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { expected: 0, found: 1, .. }), "{err:?}");
        // SAFETY: refused before the launch (the buffer is of device 1).
        let err = unsafe { f.launch(LaunchConfig::linear(1, 16), &stream0, (&mut on1, 1u32, 16u64)) }.unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { expected: 1, found: 0, .. }), "{err:?}");
        // A module loaded on device 1 runs there.
        let m1 = Module::from_ptx(&dev1, PTX).unwrap();
        // SAFETY: fill_u32 writes on1[0..16], a buffer of device 1, on device 1's stream.
        unsafe { fill(&m1).launch(LaunchConfig::linear(1, 16), &stream1, (&mut on1, 4u32, 16u64)) }.unwrap();
        assert_eq!(on1.to_vec().unwrap(), vec![4; 16]);
    });
}

#[test]
fn cooperative_launches_fit_on_the_device() {
    run_with_fake(&[], || {
        let (_dev, module, stream) = setup();
        let f = fill(&module);
        let mut out = DeviceBuffer::<u32>::zeroed(1000, &stream).unwrap();
        // SAFETY: fill_u32 writes out[0..1000].
        unsafe { f.launch_cooperative(LaunchConfig::linear(132, 256), &stream, (&mut out, 8u32, 1000u64)) }.unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![8; 1000]);
        // 8 blocks of 256 threads per SM x 132 SMs = 1056 blocks at most.
        // SAFETY: refused before the launch.
        let err = unsafe { f.launch_cooperative(LaunchConfig::linear(1057, 256), &stream, (&mut out, 8u32, 1000u64)) }
            .unwrap_err();
        let msg = invalid_launch(err);
        assert!(msg.contains("1057 blocks") && msg.contains("1056"), "{msg}");
    });
}

#[test]
fn cluster_launches_are_checked_and_run() {
    run_with_fake(&[], || {
        if oldest() {
            return cluster_launches_are_refused_without_launch_kernel_ex();
        }
        let (dev, module, stream) = setup();
        assert!(dev.capabilities().unwrap().cluster_launch);
        let f = fill(&module);
        let mut out = DeviceBuffer::<u32>::zeroed(500, &stream).unwrap();
        // SAFETY (all launches below): fill_u32 writes out[0..500].
        unsafe { f.launch_cluster(LaunchConfig::linear(4, 128), (2, 1, 1), &stream, fill_args(&mut out, 2)) }.unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![2; 500]);
        let err = unsafe { f.launch_cluster(LaunchConfig::linear(3, 128), (2, 1, 1), &stream, fill_args(&mut out, 2)) };
        assert!(invalid_launch(err.unwrap_err()).contains("not a multiple of the cluster in dimension x"));
        let err = unsafe { f.launch_cluster(LaunchConfig::linear(4, 128), (0, 1, 1), &stream, fill_args(&mut out, 2)) };
        assert!(invalid_launch(err.unwrap_err()).contains("at least 1"));
        let err =
            unsafe { f.launch_cluster(LaunchConfig::linear(16, 128), (16, 1, 1), &stream, fill_args(&mut out, 2)) };
        assert!(invalid_launch(err.unwrap_err()).contains("set_non_portable_cluster_size_allowed"));
        f.set_non_portable_cluster_size_allowed(true).unwrap();
        unsafe { f.launch_cluster(LaunchConfig::linear(16, 128), (16, 1, 1), &stream, fill_args(&mut out, 2)) }
            .unwrap();
        let err =
            unsafe { f.launch_cluster(LaunchConfig::linear(32, 128), (32, 1, 1), &stream, fill_args(&mut out, 2)) };
        assert!(invalid_launch(err.unwrap_err()).contains("16"));
        stream.synchronize().unwrap();
    });
}

/// On a driver without `cuLaunchKernelEx` (CUDA 11.1): no clusters, and plain and cooperative
/// launches work.
fn cluster_launches_are_refused_without_launch_kernel_ex() {
    let (dev, module, stream) = setup();
    assert!(!dev.capabilities().unwrap().cluster_launch);
    let f = fill(&module);
    let mut out = DeviceBuffer::<u32>::zeroed(64, &stream).unwrap();
    // SAFETY: refused before the launch.
    let err = unsafe { f.launch_cluster(LaunchConfig::linear(2, 32), (2, 1, 1), &stream, (&mut out, 1u32, 64u64)) };
    assert_missing_on_oldest(err, "cuLaunchKernelEx");
    assert_missing_on_oldest(f.set_non_portable_cluster_size_allowed(true), "cuLaunchKernelEx");
    // Plain and cooperative launches work on the old driver.
    // SAFETY: fill_u32 writes out[0..64].
    unsafe { f.launch(LaunchConfig::linear(2, 32), &stream, (&mut out, 5u32, 64u64)) }.unwrap();
    // SAFETY: as above.
    unsafe { f.launch_cooperative(LaunchConfig::linear(2, 32), &stream, (&mut out, 6u32, 64u64)) }.unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![6; 64]);
}

#[test]
fn cluster_launch_needs_launch_kernel_ex() {
    let legacy = legacy_fake_driver_path().to_string_lossy().into_owned();
    run_with_fake(&[("CUDRV_DRIVER_PATH", &legacy)], cluster_launches_are_refused_without_launch_kernel_ex);
}

/// The scenario of the memory issue: a kernel on stream B writes a buffer of stream A and is slow;
/// the buffer is dropped and its memory allocated again on A and filled. The launch recorded the
/// use, so A waits for B before the free: the late kernel write never lands in the new buffer, and
/// the fake sees no access to freed memory.
fn buffer_use_is_recorded_across_streams() {
    let (dev, module, home) = setup();
    let other = Stream::new(&dev).unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let n = 4096;
    for round in 0..3u32 {
        let mut buf = DeviceBuffer::<u32>::zeroed(n, &home).unwrap();
        other.wait_stream(&home).unwrap(); // the zeroing comes first
        // SAFETY: spin_fill_u32(u32*, u32, u64, u64) writes buf[0..n] after spinning 30 ms.
        unsafe {
            spin.launch(LaunchConfig::for_num_elems(n), &other, (&mut buf, 0xDEAD_0000 + round, n as u64, 30_000u64))
        }
        .unwrap();
        drop(buf); // freed on `home`, after `other`'s kernel
        let mut again = DeviceBuffer::<u32>::zeroed(n, &home).unwrap();
        again.fill(7).unwrap();
        assert_eq!(again.to_vec().unwrap(), vec![7; n], "round {round}: the kernel wrote into reused memory");
        other.synchronize().unwrap();
        assert_eq!(again.to_vec().unwrap(), vec![7; n], "round {round}: the kernel wrote into reused memory");
    }
    let report = fake_report();
    assert!(report.violations.is_empty(), "{report}");
}

#[test]
fn buffer_use_is_recorded_across_streams_in_every_mode() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "2000")], buffer_use_is_recorded_across_streams);
}

#[test]
fn buffer_use_is_recorded_across_streams_with_every_resource() {
    for resource in ["pool", "sync"] {
        run_with_fake(
            &[("CUDRV_FAKE_DELAY_US", "2000"), ("CUDRV_MEMORY_RESOURCE", resource)],
            buffer_use_is_recorded_across_streams,
        );
    }
}

#[test]
fn launch_failures_are_driver_errors() {
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuLaunchCooperativeKernel:1:700,cuModuleLoadDataEx:2:2")], || {
        let (dev, module, stream) = setup();
        let f = fill(&module);
        let mut out = DeviceBuffer::<u32>::zeroed(8, &stream).unwrap();
        // SAFETY: fill_u32 writes out[0..8]; the driver fails the call.
        let err =
            unsafe { f.launch_cooperative(LaunchConfig::linear(1, 8), &stream, (&mut out, 1u32, 8u64)) }.unwrap_err();
        assert!(matches!(err, Error::Driver { call: "cuLaunchCooperativeKernel", .. }), "{err:?}");
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
        // A load failure without a log is the plain driver error.
        let err = Module::from_ptx(&dev, PTX).unwrap_err();
        assert!(matches!(err, Error::Driver { code: CUresult::CUDA_ERROR_OUT_OF_MEMORY, .. }), "{err:?}");
    });
}

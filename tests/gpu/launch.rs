//! Modules and kernel launches on a real GPU (`--features gpu`): the hand-written PTX of
//! `examples/kernels/vector_add.ptx` JIT-compiled by the driver, checked element by element on
//! fresh random data; a bad PTX's log; cooperative and cluster launches (an H200 has compute
//! capability 9.0).

use cudrv::launch::LaunchConfig;
use cudrv::memory::DeviceBuffer;
use cudrv::module::{Function, Module};
use cudrv::sys::CUresult;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{random_u64s, time_seed};

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");

fn device() -> Device {
    Device::get(0).expect("a CUDA device (these tests need a GPU)")
}

fn setup() -> (Device, Module, Stream) {
    let dev = device();
    let module = Module::from_ptx(&dev, PTX).unwrap_or_else(|e| panic!("the example PTX does not load: {e}"));
    let stream = Stream::new(&dev).unwrap();
    (dev, module, stream)
}

/// Random finite floats over a wide range of magnitudes (random sign, exponent and mantissa).
fn random_f32s(seed: u64, n: usize) -> Vec<f32> {
    random_u64s(seed, n)
        .into_iter()
        .map(|r| {
            let sign = (r >> 63) as u32;
            let exponent = 97 + ((r >> 40) % 60) as u32; // 2^-30 .. 2^29
            let mantissa = (r as u32) & 0x7F_FFFF;
            f32::from_bits(sign << 31 | exponent << 23 | mantissa)
        })
        .collect()
}

fn fill_pattern_u8(seed: u64, i: u64) -> u8 {
    (seed.wrapping_mul(2_654_435_761).wrapping_add(i.wrapping_mul(31)) >> 3) as u8
}

#[test]
fn the_example_ptx_compiles_for_the_device() {
    let (_dev, module, _stream) = setup();
    println!("JIT info log:\n{}", module.info_log());
    for name in ["add_f32", "fill_u32", "spin_fill_u32", "empty", "fill_pattern_u8"] {
        let f = module.function(name).unwrap();
        let a = f.attributes().unwrap();
        println!("{name}: {a:?}");
        assert!(a.max_threads_per_block >= 256, "{name}: {a:?}");
        assert!(a.ptx_version >= 52, "{name}: {a:?}");
    }
    let err = module.function("no_such_kernel").unwrap_err();
    assert!(err.to_string().contains("no_such_kernel"), "{err}");
}

#[test]
fn vector_add_on_fresh_random_data() {
    let (_dev, module, stream) = setup();
    let add = module.function("add_f32").unwrap();
    let base = time_seed();
    for (round, (n, cfg)) in [
        (1usize, LaunchConfig::for_num_elems(1)),
        (1000, LaunchConfig::for_num_elems(1000)),
        ((1 << 22) + 17, LaunchConfig::for_num_elems((1 << 22) + 17)),
        ((1 << 20) + 3, LaunchConfig::linear(7, 96)), // grid-stride: a small grid covers it all
        (4096, LaunchConfig { grid: (2, 3, 1), block: (64, 2, 1), shared_mem_bytes: 0 }),
    ]
    .into_iter()
    .enumerate()
    {
        let a = random_f32s(base + 2 * round as u64, n);
        let b = random_f32s(base + 2 * round as u64 + 1, n);
        let da = DeviceBuffer::from_slice(&a, &stream).unwrap();
        let db = DeviceBuffer::from_slice(&b, &stream).unwrap();
        let mut dc = DeviceBuffer::<f32>::zeroed(n, &stream).unwrap();
        // SAFETY: add_f32(const float*, const float*, float*, size_t) touches [0, n) of each.
        unsafe { add.launch(cfg, &stream, (&da, &db, &mut dc, n as u64)).unwrap() };
        let c = dc.to_vec().unwrap();
        for i in 0..n {
            assert_eq!(c[i].to_bits(), (a[i] + b[i]).to_bits(), "n {n}, {cfg:?}: element {i}: {} + {}", a[i], b[i]);
        }
    }
}

#[test]
fn fill_kernels_on_fresh_random_data() {
    let (_dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let pattern = module.function("fill_pattern_u8").unwrap();
    let r = random_u64s(time_seed(), 16);
    for (k, n) in [1usize, 31, 4097, (1 << 24) + 5].into_iter().enumerate() {
        // Start from random contents, so a skipped element shows.
        let noise: Vec<u32> = random_u64s(r[k], n).into_iter().map(|x| x as u32).collect();
        let mut out = DeviceBuffer::from_slice(&noise, &stream).unwrap();
        let value = r[8 + k] as u32;
        // SAFETY: fill_u32(unsigned*, unsigned, size_t) writes [0, n).
        unsafe { fill.launch(LaunchConfig::for_num_elems(n), &stream, (&mut out, value, n as u64)).unwrap() };
        let got = out.to_vec().unwrap();
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, value, "fill_u32 n {n}: element {i}");
        }
        // Only a view's range changes.
        if n > 8 {
            let view = out.view(3..n - 3).unwrap();
            // SAFETY: writes [0, n - 6) of the view.
            unsafe { fill.launch(LaunchConfig::linear(5, 128), &stream, (view, !value, (n - 6) as u64)).unwrap() };
            let got = out.to_vec().unwrap();
            for (i, v) in got.iter().enumerate() {
                let expected = if (3..n - 3).contains(&i) { !value } else { value };
                assert_eq!(*v, expected, "fill_u32 through a view, n {n}: element {i}");
            }
        }

        let seed = r[12 + k % 4];
        let noise: Vec<u8> = random_u64s(seed ^ 1, n).into_iter().map(|x| x as u8).collect();
        let mut bytes = DeviceBuffer::from_slice(&noise, &stream).unwrap();
        // SAFETY: fill_pattern_u8(unsigned char*, size_t, size_t) writes [0, n).
        unsafe { pattern.launch(LaunchConfig::for_num_elems(n), &stream, (&mut bytes, n as u64, seed)).unwrap() };
        let got = bytes.to_vec().unwrap();
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, fill_pattern_u8(seed, i as u64), "fill_pattern_u8 n {n}: element {i}");
        }
    }
}

#[test]
fn a_bad_ptx_gives_a_readable_log() {
    let dev = device();
    // An undeclared register on line 9.
    let ptx = ".version 7.0\n.target sm_52\n.address_size 64\n\n.visible .entry broken()\n{\n\t.reg .b32 %r<2>;\n\tmov.u32 %r1, 1;\n\tmov.u32 %r7, %r1;\n\tret;\n}\n";
    let err = Module::from_ptx(&dev, ptx).unwrap_err();
    println!("{err}");
    let Error::Jit { source, log } = &err else { panic!("expected Error::Jit, got {err:?}") };
    assert_eq!(source.code(), Some(CUresult::CUDA_ERROR_INVALID_PTX), "{err}");
    assert!(log.contains("ptxas") || log.contains("line 9"), "the log names neither ptxas nor the line: {log}");
    assert!(err.to_string().contains(log.as_str()));
    // A truncated file is a syntax error with a log too.
    let err =
        Module::from_ptx(&dev, ".version 7.0\n.target sm_52\n.address_size 64\n.visible .entry x(\n").unwrap_err();
    println!("{err}");
    assert!(matches!(&err, Error::Jit { log, .. } if !log.is_empty()), "{err:?}");
}

#[test]
fn configurations_are_checked_against_the_device() {
    let (dev, module, stream) = setup();
    let fill = module.function("fill_u32").unwrap();
    let max = dev.max_threads_per_block().unwrap() as u32;
    let mut out = DeviceBuffer::<u32>::zeroed(16, &stream).unwrap();
    // SAFETY: refused before the launch.
    let err = unsafe { fill.launch(LaunchConfig::linear(1, max + 1), &stream, (&mut out, 1u32, 16u64)) }.unwrap_err();
    assert!(matches!(err, Error::InvalidLaunch { .. }), "{err:?}");
    // Shared memory beyond the default needs the limit raised first.
    let cfg = LaunchConfig::linear(1, 32).with_shared_mem(64 * 1024);
    // SAFETY: fill_u32 writes out[0..16]; the kernel ignores its dynamic shared memory.
    let err = unsafe { fill.launch(cfg, &stream, (&mut out, 1u32, 16u64)) }.unwrap_err();
    assert!(err.to_string().contains("set_max_dynamic_shared_memory"), "{err}");
    fill.set_max_dynamic_shared_memory(64 * 1024).unwrap();
    // SAFETY: as above.
    unsafe { fill.launch(cfg, &stream, (&mut out, 9u32, 16u64)) }.unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![9; 16]);
    let s = fill.suggested_block_size(0).unwrap();
    println!("suggested: {s:?}");
    assert!(s.block_size >= 32 && s.block_size <= max);
    assert!(fill.max_active_blocks_per_multiprocessor(s.block_size, 0).unwrap() >= 1);
}

fn fill_args(out: &mut DeviceBuffer<u32>, value: u32) -> (&mut DeviceBuffer<u32>, u32, u64) {
    let n = out.len() as u64;
    (out, value, n)
}

fn check_filled(out: &DeviceBuffer<u32>, value: u32, what: &str) {
    for (i, v) in out.to_vec().unwrap().iter().enumerate() {
        assert_eq!(*v, value, "{what}: element {i}");
    }
}

#[test]
fn cooperative_launch() {
    let (dev, module, stream) = setup();
    let fill: Function = module.function("fill_u32").unwrap();
    if !dev.capabilities().unwrap().cooperative_launch {
        println!("note: device 0 has no cooperative launch; skipped");
        return;
    }
    let sms = dev.multiprocessor_count().unwrap() as u32;
    let mut out = DeviceBuffer::<u32>::zeroed(100_003, &stream).unwrap();
    // SAFETY: fill_u32 writes the whole buffer.
    unsafe { fill.launch_cooperative(LaunchConfig::linear(sms, 256), &stream, fill_args(&mut out, 0xC0)) }.unwrap();
    check_filled(&out, 0xC0, "cooperative fill");
    let per_sm = fill.max_active_blocks_per_multiprocessor(256, 0).unwrap();
    // SAFETY: refused before the launch.
    let err = unsafe {
        fill.launch_cooperative(LaunchConfig::linear(per_sm * sms + 1, 256), &stream, fill_args(&mut out, 1))
    }
    .unwrap_err();
    assert!(matches!(err, Error::InvalidLaunch { .. }), "{err:?}");
}

#[test]
fn cluster_launch_on_compute_capability_9() {
    let (dev, module, stream) = setup();
    let caps = dev.capabilities().unwrap();
    let fill = module.function("fill_u32").unwrap();
    if !caps.cluster_launch {
        println!(
            "note: device 0 (compute capability {}.{}) has no thread-block clusters; skipped",
            caps.compute_capability.0, caps.compute_capability.1
        );
        return;
    }
    let mut out = DeviceBuffer::<u32>::zeroed(1 << 20, &stream).unwrap();
    // SAFETY (all launches below): fill_u32 writes the whole buffer.
    unsafe { fill.launch_cluster(LaunchConfig::linear(64, 256), (2, 1, 1), &stream, fill_args(&mut out, 0xC1)) }
        .unwrap();
    check_filled(&out, 0xC1, "cluster (2,1,1)");
    unsafe { fill.launch_cluster(LaunchConfig::linear(64, 128), (8, 1, 1), &stream, fill_args(&mut out, 0xC8)) }
        .unwrap();
    check_filled(&out, 0xC8, "cluster (8,1,1)");
    let cfg = LaunchConfig { grid: (4, 4, 2), block: (32, 4, 1), shared_mem_bytes: 0 };
    unsafe { fill.launch_cluster(cfg, (2, 2, 2), &stream, fill_args(&mut out, 0xC3)) }.unwrap();
    check_filled(&out, 0xC3, "cluster (2,2,2)");
    let err = unsafe { fill.launch_cluster(LaunchConfig::linear(3, 256), (2, 1, 1), &stream, fill_args(&mut out, 0)) }
        .unwrap_err();
    assert!(matches!(err, Error::InvalidLaunch { .. }), "{err:?}");
}

#[test]
fn a_buffer_used_by_a_slow_kernel_on_another_stream_is_not_reused_early() {
    let (dev, module, home) = setup();
    let other = Stream::new(&dev).unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let n = 1 << 20;
    for round in 0..3u32 {
        let mut buf = DeviceBuffer::<u32>::zeroed(n, &home).unwrap();
        other.wait_stream(&home).unwrap();
        // SAFETY: spin_fill_u32 spins 20 ms, then writes buf[0..n].
        unsafe {
            spin.launch(LaunchConfig::for_num_elems(n), &other, (&mut buf, 0xDEAD_0000 + round, n as u64, 20_000u64))
        }
        .unwrap();
        drop(buf);
        let mut again = DeviceBuffer::<u32>::zeroed(n, &home).unwrap();
        again.fill(7).unwrap();
        other.synchronize().unwrap();
        check_filled(&again, 7, "memory reused after a kernel on another stream");
    }
}

#[test]
fn launch_and_synchronise_many_times() {
    let (_dev, module, stream) = setup();
    let empty = module.function("empty").unwrap();
    for _ in 0..10_000 {
        // SAFETY: `empty` takes no parameters.
        unsafe { empty.launch(LaunchConfig::linear(1, 1), &stream, ()) }.unwrap();
    }
    stream.synchronize().unwrap();
}

/// Issue 12, item 5, on the GPU: a buffer whose block the pool took from a buffer with a copy
/// still queued (behind a 20 ms kernel) on its stream; a peer copy and a kernel on another stream
/// write the new buffer. They wait for the buffer's stream, so the old copy reads the old data.
#[test]
fn writes_from_other_streams_wait_for_the_buffer_stream() {
    let (dev, module, home) = setup();
    let other = Stream::new(&dev).unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let fill = module.function("fill_u32").unwrap();
    let n = 1 << 20;
    let src = DeviceBuffer::from_slice(&vec![0xFFFF_FFFFu32; n], &other).unwrap();
    let mut slow = DeviceBuffer::<u32>::zeroed(16, &home).unwrap();
    for round in 0..4u32 {
        let old_data: Vec<u32> = (0..n as u32).map(|i| i ^ round).collect();
        let old = DeviceBuffer::from_slice(&old_data, &home).unwrap();
        // SAFETY: spin_fill_u32 spins 20 ms, then writes slow[0..16].
        unsafe { spin.launch(LaunchConfig::linear(1, 32), &home, (&mut slow, 1u32, 16u64, 20_000u64)) }.unwrap();
        let mut saved = cudrv::memory::PinnedBuffer::<u32>::new(&dev, n).unwrap();
        old.copy_to_pinned_async(&mut saved).unwrap(); // runs after the 20 ms kernel
        drop(old);
        // SAFETY: every element is written below before anything reads it.
        let mut dst = unsafe { DeviceBuffer::<u32>::uninit(n, &home) }.unwrap();
        if round % 2 == 0 {
            src.copy_to_peer(&mut dst, &other).unwrap();
        } else {
            // SAFETY: fill_u32(u32*, u32, u64) writes dst[0..n].
            unsafe { fill.launch(LaunchConfig::for_num_elems(n), &other, (&mut dst, 0xFFFF_FFFFu32, n as u64)) }
                .unwrap();
        }
        let wrong = saved.as_slice().unwrap().iter().zip(&old_data).filter(|(a, b)| a != b).count();
        assert_eq!(wrong, 0, "round {round}: the old buffer's queued copy saw new data in {wrong} elements");
        other.synchronize().unwrap();
        home.wait_stream(&other).unwrap();
        check_filled(&dst, 0xFFFF_FFFF, "the new buffer");
    }
}

/// Issue 12, item 3, on the GPU: a buffer of thread A's per-thread stream, written there by a slow
/// kernel and dropped on thread B, is freed through the legacy stream, after the kernel; thread B
/// then allocates on its own per-thread stream and its data stays intact.
#[test]
fn per_thread_streams_keep_their_identity_across_threads() {
    let (dev, module, _home) = setup();
    let spin = module.function("spin_fill_u32").unwrap();
    let n = 1 << 20;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let a = Stream::per_thread(&dev).unwrap();
            assert_eq!(a.id(), Stream::per_thread(&dev).unwrap().id(), "one identity per thread");
            let mut buf = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
            // SAFETY: spin_fill_u32 spins 30 ms, then writes buf[0..n].
            unsafe { spin.launch(LaunchConfig::for_num_elems(n), &a, (&mut buf, 0xBAD0_BAD0u32, n as u64, 30_000u64)) }
                .unwrap();
            tx.send((buf, a.id())).unwrap();
        });
    });
    let (buf, a_id) = rx.recv().unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let b = Stream::per_thread(&dev).unwrap();
            assert_ne!(b.id(), a_id, "another thread's per-thread stream is another stream");
            drop(buf); // freed on A's stream, from here: through the legacy stream
            let mut mine = DeviceBuffer::<u32>::zeroed(n, &b).unwrap();
            mine.fill(7).unwrap();
            b.synchronize().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(60));
            check_filled(&mine, 7, "a block of another thread's per-thread stream");
        });
    });
}

/// Issue 12, item 7, on the GPU: host functions that drop buffers (the keep-alive pattern) while
/// another thread trims the pool: no deadlock, and everything is given back. In segments (where
/// the device has virtual memory management, unmapped by the trims) and in chunks.
#[test]
fn host_functions_drop_buffers_while_another_thread_trims() {
    let (dev, module, home) = setup();
    let spin = module.function("spin_fill_u32").unwrap();
    for expandable in [true, false] {
        let config = cudrv::memory::PoolConfig { expandable, ..Default::default() };
        let pool = cudrv::memory::StreamOrderedPool::with_config(&dev, config).unwrap();
        host_functions_drop_buffers_while_trimmed(&home, &spin, std::sync::Arc::new(pool));
    }
}

/// The body of [`host_functions_drop_buffers_while_another_thread_trims`], on `pool`.
fn host_functions_drop_buffers_while_trimmed(
    home: &Stream,
    spin: &Function,
    pool: std::sync::Arc<dyn cudrv::memory::MemoryResource>,
) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        // Owned here, so that a panic below drops it and the trimmer stops.
        let done_tx = done_tx;
        let pool = &pool;
        let trimmer = scope.spawn(move || {
            // Until told, or until the sender is gone.
            while matches!(done_rx.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty)) {
                pool.trim(0).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        });
        for round in 0..50u32 {
            let mut kept = DeviceBuffer::<u32>::zeroed_in(1 << 16, home, pool.clone()).unwrap();
            // SAFETY: spin_fill_u32 spins 200 µs, then writes kept[0..65536].
            unsafe { spin.launch(LaunchConfig::for_num_elems(1 << 16), home, (&mut kept, round, 1u64 << 16, 200u64)) }
                .unwrap();
            home.launch_host_fn(move || drop(kept)).unwrap();
            drop(DeviceBuffer::<u8>::zeroed_in(3 << 20, home, pool.clone()).unwrap());
        }
        home.synchronize().unwrap();
        done_tx.send(()).unwrap();
        trimmer.join().unwrap();
    });
    cudrv::flush_deferred_drops().unwrap();
    pool.trim(0).unwrap();
    let st = pool.stats().unwrap();
    assert_eq!((st.in_use, st.reserved), (0, 0));
}

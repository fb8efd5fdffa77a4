//! Memory resources, buffers and copies on a real GPU (`--features gpu`).
//!
//! Run with the device's default resource, and with `CUDRV_MEMORY_RESOURCE=pool` and `=sync`;
//! `CUDRV_EXPECT_RESOURCE` (DriverPool, StreamOrderedPool, SyncResource) makes the run check which
//! one is in use. Data is written by memsets and copies and read back, byte for byte.

use cudrv_test_support::{random_bytes, time_seed};
use std::sync::Arc;

use cudrv::memory::{DeviceBuffer, MemoryResource, PinnedBuffer, ResourceKind, StreamOrderedPool};
use cudrv::{Device, Error, Stream};

fn device() -> Device {
    Device::get(0).expect("a CUDA device (these tests need a GPU)")
}

#[test]
fn the_expected_resource_is_in_use() {
    let dev = device();
    let (resource, choice) = dev.memory_resource_choice().unwrap();
    println!("device 0 uses {}: {}", choice.kind, choice.reason);
    if let Ok(expected) = std::env::var("CUDRV_EXPECT_RESOURCE") {
        assert_eq!(resource.kind().to_string(), expected);
    } else if std::env::var_os("CUDRV_MEMORY_RESOURCE").is_none() {
        let pools = dev.capabilities().unwrap().memory_pools;
        let expected = if pools { ResourceKind::DriverPool } else { ResourceKind::StreamOrderedPool };
        assert_eq!(resource.kind(), expected);
    }
}

#[test]
fn random_round_trips_at_many_sizes() {
    let dev = device();
    let s = Stream::new(&dev).unwrap();
    let base = time_seed();
    for (i, n) in [0usize, 1, 7, 4096, 1 << 20, (64 << 20) + 3].into_iter().enumerate() {
        let data = random_bytes(base + i as u64, n);
        let buf = DeviceBuffer::from_slice(&data, &s).unwrap();
        assert_eq!(buf.to_vec().unwrap(), data, "size {n}");
        if n > 16 {
            assert_eq!(buf.view(3..n - 5).unwrap().to_vec().unwrap(), &data[3..n - 5]);
        }
        let mut copy = DeviceBuffer::<u8>::zeroed(n, &s).unwrap();
        copy.copy_from(&buf).unwrap();
        assert_eq!(copy.to_vec().unwrap(), data);
    }
    let mut f = DeviceBuffer::<u32>::zeroed(1 << 20, &s).unwrap();
    f.fill(0xDEAD_BEEF).unwrap();
    assert!(f.to_vec().unwrap().iter().all(|&v| v == 0xDEAD_BEEF));
    let mut h = DeviceBuffer::<u16>::zeroed(1001, &s).unwrap();
    h.fill(0xBEEF).unwrap();
    assert!(h.to_vec().unwrap().iter().all(|&v| v == 0xBEEF));
}

#[test]
fn pinned_async_copies() {
    let dev = device();
    let s = Stream::new(&dev).unwrap();
    let n = 32 << 20;
    let data = random_bytes(time_seed(), n);
    let src = PinnedBuffer::from_slice(&dev, &data).unwrap();
    let mut buf = DeviceBuffer::<u8>::zeroed(n, &s).unwrap();
    buf.copy_from_pinned_async(&src).unwrap();
    let mut back = PinnedBuffer::<u8>::new(&dev, n).unwrap();
    buf.copy_to_pinned_async(&mut back).unwrap();
    assert_eq!(back.as_slice().unwrap(), &data[..]);
}

#[test]
fn a_block_freed_on_a_busy_stream_is_not_overwritten_by_its_late_write() {
    let dev = device();
    let a = Stream::new(&dev).unwrap();
    let b = Stream::new(&dev).unwrap();
    let n = 256 << 20; // u32s: 1 GiB, several ms of writes per memset
    for round in 0..4u32 {
        {
            let mut x = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
            for _ in 0..4 {
                x.fill(0xAAAA_0000 | round).unwrap();
            }
        } // freed on A while A is still writing it
        let mut y = DeviceBuffer::<u32>::zeroed(n, &b).unwrap();
        y.fill(0x5555_0000 | round).unwrap();
        a.synchronize().unwrap();
        let v = y.to_vec().unwrap();
        let bad = v.iter().filter(|&&x| x != (0x5555_0000 | round)).count();
        assert_eq!(bad, 0, "round {round}: {bad} words of B's buffer were overwritten");
    }
}

#[test]
fn buffers_used_on_a_second_stream() {
    let dev = device();
    let home = Stream::new(&dev).unwrap();
    let other = Stream::new(&dev).unwrap();
    let n = 128 << 20;
    for round in 0..3u8 {
        let data = vec![round + 1; n];
        let src = DeviceBuffer::from_slice(&data, &home).unwrap();
        let mut dst = DeviceBuffer::<u8>::zeroed(n, &other).unwrap();
        other.wait_stream(&home).unwrap();
        dst.copy_from(&src).unwrap(); // reads src on `other`
        drop(src); // its free waits for `other`
        let mut reuse = DeviceBuffer::<u8>::zeroed(n, &home).unwrap();
        reuse.memset(0xEE).unwrap();
        assert!(dst.to_vec().unwrap().iter().all(|&v| v == round + 1));
        assert!(reuse.to_vec().unwrap().iter().all(|&v| v == 0xEE));
    }
}

#[test]
fn many_threads_and_streams() {
    let dev = device();
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            std::thread::spawn(move || {
                let streams: Vec<Stream> = (0..4).map(|_| Stream::new(&dev).unwrap()).collect();
                let mut live: Vec<(DeviceBuffer<u32>, u32)> = Vec::new();
                let mut x = 0x9e37_79b9u32 ^ (t * 7919);
                for i in 0..400u32 {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    let s = &streams[(x % 4) as usize];
                    let len = 1 + (x as usize % (1 << 20));
                    let value = t << 24 | i;
                    let mut b = DeviceBuffer::<u32>::zeroed(len, s).unwrap();
                    b.fill(value).unwrap();
                    live.push((b, value));
                    if live.len() > 8 {
                        let (b, value) = live.swap_remove((x as usize / 7) % live.len());
                        assert!(b.to_vec().unwrap().iter().all(|&v| v == value), "thread {t} op {i}");
                    }
                }
                for (b, value) in live {
                    assert!(b.to_vec().unwrap().iter().all(|&v| v == value));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn stream_ordered_pool_on_the_gpu() {
    let dev = device();
    let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    let s = Stream::new(&dev).unwrap();
    let p = pool.allocate(1 << 20, &s).unwrap();
    // SAFETY: unused.
    unsafe { pool.deallocate(p, 1 << 20, &s).unwrap() };
    let before = pool.pool_stats();
    for _ in 0..1000 {
        let q = pool.allocate(1 << 20, &s).unwrap();
        assert_eq!(q, p);
        // SAFETY: unused.
        unsafe { pool.deallocate(q, 1 << 20, &s).unwrap() };
    }
    assert_eq!(pool.pool_stats().driver_allocs, before.driver_allocs);
    let data = random_bytes(time_seed(), 3 << 20);
    let b = DeviceBuffer::from_slice_in(&data, &s, pool.clone()).unwrap();
    assert_eq!(b.to_vec().unwrap(), data);
    drop(b);
    pool.trim(0).unwrap();
    assert_eq!(pool.pool_stats().reserved, 0);
}

#[test]
fn out_of_memory_is_a_typed_error() {
    let dev = device();
    let s = Stream::new(&dev).unwrap();
    let too_much = dev.total_memory().unwrap() * 2;
    // SAFETY: the allocation fails.
    let err = unsafe { DeviceBuffer::<u8>::uninit(too_much, &s) }.unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    if let Error::OutOfMemory { requested, .. } = err {
        assert_eq!(requested, too_much);
    }
    // Memory still works afterwards.
    let b = DeviceBuffer::from_slice(&[1u8, 2, 3], &s).unwrap();
    assert_eq!(b.to_vec().unwrap(), [1, 2, 3]);
}

/// `DriverPool` makes no context current for streams that carry their own: it must work with no
/// context current, and with another context current (then that one stays current).
#[test]
fn driver_pool_works_whatever_context_is_current() {
    use cudrv::sys::CUresult;
    let dev = device();
    if !dev.capabilities().unwrap().memory_pools {
        return;
    }
    let pool: Arc<dyn MemoryResource> = Arc::new(cudrv::memory::DriverPool::default_pool(&dev).unwrap());
    let s = Stream::new(&dev).unwrap();
    let d = cudrv::sys::Driver::global().unwrap();
    let data = random_bytes(time_seed(), 1 << 20);
    let mut other = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and device; a context of our own, destroyed below.
    let created = unsafe { d.cuCtxCreate_v4(&mut other, std::ptr::null_mut(), 0, dev.as_raw()) };
    assert_eq!(created, Ok(CUresult::CUDA_SUCCESS));
    for (what, current) in [("no context", std::ptr::null_mut()), ("another context", other)] {
        let set_current = || {
            // SAFETY: null or a live context.
            assert_eq!(unsafe { d.cuCtxSetCurrent(current) }, Ok(CUresult::CUDA_SUCCESS));
        };
        set_current();
        let p = pool.allocate(1 << 20, &s).unwrap();
        // SAFETY: `p` came from the pool with this size and is unused.
        unsafe { pool.deallocate(p, 1 << 20, &s) }.unwrap();
        set_current();
        let buf = DeviceBuffer::from_slice_in(&data, &s, pool.clone()).unwrap();
        assert_eq!(buf.to_vec().unwrap(), data, "{what}");
        if !current.is_null() {
            let mut now = std::ptr::null_mut();
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { d.cuCtxGetCurrent(&mut now) }, Ok(CUresult::CUDA_SUCCESS));
            assert_eq!(now, current, "cudrv restores the context it found");
        }
    }
    // SAFETY: our context, destroyed once; nothing of it is in use.
    assert_eq!(unsafe { d.cuCtxDestroy_v2(other) }, Ok(CUresult::CUDA_SUCCESS));
}

/// A pool in segments of virtual memory: memory freed between live buffers is unmapped (trim)
/// and mapped again where new buffers go (the holes it left), while every buffer keeps its data.
/// Through the TCC interposer this is the device's default pool.
#[test]
fn a_pool_in_segments_unmaps_gaps_and_maps_them_again() {
    let dev = device();
    if !dev.capabilities().unwrap().virtual_memory_management {
        println!("note: no virtual memory management on device 0; skipped");
        return;
    }
    let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
    assert!(pool.grows_in_segments());
    let s = Stream::new(&dev).unwrap();
    const WORDS: usize = 8 << 20; // 32 MiB
    let mut bufs: Vec<Option<DeviceBuffer<u32>>> = (0..8u32)
        .map(|i| {
            let mut b = DeviceBuffer::<u32>::zeroed_in(WORDS, &s, pool.clone()).unwrap();
            b.fill(i).unwrap();
            Some(b)
        })
        .collect();
    let mut gaps: Vec<u64> = bufs.iter().step_by(2).map(|b| b.as_ref().unwrap().as_raw()).collect();
    for b in bufs.iter_mut().step_by(2) {
        *b = None;
    }
    let before = pool.pool_stats();
    assert_eq!(before.reserved, 256 << 20, "{before:?}");
    pool.trim(128 << 20).unwrap();
    let after = pool.pool_stats();
    assert_eq!(after.reserved, 128 << 20, "{after:?}");
    assert!(after.driver_frees >= before.driver_frees + 4, "{after:?}");
    let again: Vec<DeviceBuffer<u32>> = (0..4u32)
        .map(|i| {
            let mut b = DeviceBuffer::<u32>::zeroed_in(WORDS, &s, pool.clone()).unwrap();
            b.fill(100 + i).unwrap();
            b
        })
        .collect();
    let mut addrs: Vec<u64> = again.iter().map(|b| b.as_raw()).collect();
    addrs.sort_unstable();
    gaps.sort_unstable();
    assert_eq!(addrs, gaps, "the new buffers did not go into the holes");
    assert_eq!(pool.pool_stats().reserved, 256 << 20);
    for (i, b) in bufs.iter().enumerate().filter_map(|(i, b)| Some((i, b.as_ref()?))) {
        assert!(b.to_vec().unwrap().iter().all(|&x| x == i as u32), "buffer {i} lost its data");
    }
    for (i, b) in again.iter().enumerate() {
        assert!(b.to_vec().unwrap().iter().all(|&x| x == 100 + i as u32), "new buffer {i} lost its data");
    }
    drop((bufs, again));
    pool.trim(0).unwrap();
    assert_eq!(pool.pool_stats().reserved, 0);
}

//! Memory resources, buffers and copies on the fake driver, in every driver model.
//!
//! Every test body runs in a child process of this test binary (`run_with_fake`); see
//! `fake_core.rs`. The fake checks every queued memory access when it runs, so a block reused too
//! early, or freed while still in use, fails the test.

use std::sync::Arc;

use cudrv::memory::{
    DeviceBuffer, DriverPool, DriverPoolConfig, MemoryResource, PinnedBuffer, PoolConfig, ResourceKind,
    StreamOrderedPool, SyncResource, register_host,
};
use cudrv::sys::CUresult;
use cudrv::{Device, Error, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, run_with_fake, run_with_fake_modes};

use crate::graph_cases::release_everything;
use crate::{assert_no_leaks_but_streams, assert_no_pools_on_oldest, oldest, pool_kind};

const MODES: [&str; 3] = ["linux", "wddm", "tcc"];

#[test]
fn resource_is_chosen_per_mode() {
    for mode in MODES {
        run_with_fake(&[("CUDRV_FAKE_MODE", mode)], || {
            let dev = Device::get(0).unwrap();
            let (resource, choice) = dev.memory_resource_choice().unwrap();
            let expected = if mode == "tcc" { ResourceKind::StreamOrderedPool } else { pool_kind(&dev) };
            assert_eq!(choice.kind, expected, "{}", choice.reason);
            assert_eq!(resource.kind(), expected);
            if mode == "tcc" {
                assert!(choice.reason.contains("TCC"), "{}", choice.reason);
            }
        });
    }
}

#[test]
fn environment_overrides_the_choice() {
    for (value, kind) in [("pool", ResourceKind::StreamOrderedPool), ("sync", ResourceKind::Sync)] {
        run_with_fake_modes(&MODES, &[("CUDRV_MEMORY_RESOURCE", value)], || {
            let dev = Device::get(0).unwrap();
            let (_, choice) = dev.memory_resource_choice().unwrap();
            assert_eq!(choice.kind, kind);
            let s = Stream::new(&dev).unwrap();
            let buf = DeviceBuffer::from_slice(&[1u16, 2, 3], &s).unwrap();
            assert_eq!(buf.to_vec().unwrap(), [1, 2, 3]);
            assert_eq!(buf.resource().kind(), kind);
        });
    }
    run_with_fake(&[("CUDRV_MEMORY_RESOURCE", "pools")], || {
        let err = Device::get(0).unwrap().memory_resource().unwrap_err();
        assert!(matches!(err, Error::InvalidEnvironment { var: "CUDRV_MEMORY_RESOURCE", .. }), "{err}");
        assert_eq!(err.to_string(), "CUDRV_MEMORY_RESOURCE=\"pools\" is not valid: expected driver-pool, pool or sync");
    });
    run_with_fake(&[("CUDRV_MEMORY_RESOURCE", "driver-pool"), ("CUDRV_FAKE_MODE", "tcc")], || {
        let err = Device::get(0).unwrap().memory_resource().unwrap_err();
        assert!(matches!(err, Error::Unsupported { feature: "memory pools", .. }), "{err}");
    });
}

#[test]
fn resource_can_be_set_in_code() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        dev.set_memory_resource(Arc::new(SyncResource::new(&dev).unwrap()), "the test asked").unwrap();
        let (r, choice) = dev.memory_resource_choice().unwrap();
        assert_eq!((r.kind(), choice.reason.as_str()), (ResourceKind::Sync, "the test asked"));
    });
}

#[test]
fn driver_refusing_pools_at_run_time_switches_to_the_fallback() {
    // The device says it has pools, but the driver answers 801: cudrv must not fail.
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuDeviceGetDefaultMemPool:1+:801")], || {
        let dev = Device::get(0).unwrap();
        if oldest() {
            // CUDA 11.1 has no pools to refuse: cudrv's pool from the start, saying why.
            assert_eq!(pool_kind(&dev), ResourceKind::StreamOrderedPool);
            return;
        }
        let (_, choice) = dev.memory_resource_choice().unwrap();
        assert_eq!(choice.kind, ResourceKind::StreamOrderedPool);
        assert!(choice.reason.contains("refused"), "{}", choice.reason);
    });
    run_with_fake(&[("CUDRV_FAKE_FAIL", "cuMemAllocFromPoolAsync:2+:801")], || {
        let dev = Device::get(0).unwrap();
        if oldest() {
            assert_eq!(pool_kind(&dev), ResourceKind::StreamOrderedPool);
            return;
        }
        let s = Stream::new(&dev).unwrap();
        let first = DeviceBuffer::from_slice(&[1u32; 8], &s).unwrap(); // from the driver's pool
        let pool = dev.memory_resource().unwrap();
        assert_eq!(pool.kind(), ResourceKind::DriverPool);
        let second = DeviceBuffer::from_slice(&[2u32; 8], &s).unwrap(); // refused: fallback
        assert_eq!(pool.kind(), ResourceKind::StreamOrderedPool);
        assert_eq!(first.to_vec().unwrap(), [1; 8]);
        assert_eq!(second.to_vec().unwrap(), [2; 8]);
        drop((first, second, s)); // one freed to each resource
        pool.trim(0).unwrap();
        release_everything(&dev);
        assert_no_leaks();
    });
}

#[test]
fn buffers_and_copies_in_every_mode() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "200")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let data: Vec<u32> = (0..10_000).map(|i| i * 7 + 3).collect();
        let buf = DeviceBuffer::from_slice(&data, &s).unwrap();
        assert_eq!(buf.len(), data.len());
        assert_eq!(buf.to_vec().unwrap(), data);
        // Views.
        let view = buf.view(100..110).unwrap();
        assert_eq!(view.to_vec().unwrap(), &data[100..110]);
        assert_eq!(view.as_raw(), buf.as_raw() + 400);
        assert!(matches!(buf.view(5..10_001), Err(Error::InvalidArgument(_))));
        assert_eq!(buf.view(..).unwrap().len(), 10_000);
        // Zeroed, memset, fill.
        let mut z = DeviceBuffer::<u64>::zeroed(300, &s).unwrap();
        assert!(z.to_vec().unwrap().iter().all(|&v| v == 0));
        z.memset(0xff).unwrap();
        assert!(z.to_vec().unwrap().iter().all(|&v| v == u64::MAX));
        assert!(matches!(z.fill(5), Err(Error::InvalidArgument(_))));
        let mut f = DeviceBuffer::<f32>::zeroed(33, &s).unwrap();
        f.fill(1.5).unwrap();
        assert_eq!(f.to_vec().unwrap(), vec![1.5; 33]);
        let mut h = DeviceBuffer::<i16>::zeroed(5, &s).unwrap();
        h.fill(-2).unwrap();
        assert_eq!(h.to_vec().unwrap(), vec![-2; 5]);
        // Device to device.
        let mut copy = DeviceBuffer::<u32>::zeroed(data.len(), &s).unwrap();
        copy.copy_from(&buf).unwrap();
        assert_eq!(copy.to_vec().unwrap(), data);
        // Lengths must match; nothing is done otherwise.
        let mut small = DeviceBuffer::<u32>::zeroed(3, &s).unwrap();
        assert!(matches!(small.copy_from(&buf), Err(Error::LengthMismatch { expected: 3, found: 10_000, .. })));
        assert!(matches!(small.copy_from_host(&[1, 2]), Err(Error::LengthMismatch { expected: 3, found: 2, .. })));
        assert!(matches!(small.copy_to_host(&mut [0; 4]), Err(Error::LengthMismatch { expected: 3, found: 4, .. })));
        assert_eq!(small.to_vec().unwrap(), [0, 0, 0]);
        // Zero-length buffers are well defined.
        let empty = DeviceBuffer::<u8>::from_slice(&[], &s).unwrap();
        assert!(empty.is_empty());
        assert_eq!(empty.to_vec().unwrap(), Vec::<u8>::new());
        // Sizes that overflow are errors, not allocations.
        // SAFETY: the allocation fails before any memory exists.
        let huge = unsafe { DeviceBuffer::<u64>::uninit(usize::MAX / 4, &s) };
        assert!(matches!(huge, Err(Error::InvalidArgument(_))));
        drop((buf, z, f, h, copy, small, empty, s));
        release_everything(&dev);
        assert_no_leaks();
    });
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
struct Particle {
    pos: [f32; 3],
    id: u32,
}
// SAFETY: repr(C), 16 bytes of 4-byte fields without padding; every bit pattern is valid.
unsafe impl cudrv::memory::DeviceRepr for Particle {}

#[test]
fn repr_c_structs_round_trip() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let ps: Vec<Particle> = (0..100).map(|i| Particle { pos: [i as f32, 1.0, -2.0], id: i }).collect();
        let buf = DeviceBuffer::from_slice(&ps, &s).unwrap();
        assert_eq!(buf.byte_len(), 1600);
        assert_eq!(buf.to_vec().unwrap(), ps);
    });
}

#[test]
fn pinned_async_copies_wait_before_host_access() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let src = PinnedBuffer::from_slice(&dev, &[9u32; 4096]).unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(4096, &s).unwrap();
        // The copies wait for this host function until the query is made.
        let (release, held) = std::sync::mpsc::channel::<()>();
        s.launch_host_fn(move || {
            let _ = held.recv();
        })
        .unwrap();
        buf.copy_from_pinned_async(&src).unwrap();
        let mut back = PinnedBuffer::<u32>::new(&dev, 4096).unwrap();
        buf.fill(11).unwrap();
        buf.copy_to_pinned_async(&mut back).unwrap();
        assert!(!s.query().unwrap(), "the copies are still queued behind the host function");
        release.send(()).unwrap();
        // Host access waits for the copy into `back`: it must see the data, never zeros.
        assert!(back.as_slice().unwrap().iter().all(|&v| v == 11));
        drop(src);
        let mut too_short = PinnedBuffer::<u32>::new(&dev, 2).unwrap();
        assert!(matches!(buf.copy_to_pinned_async(&mut too_short), Err(Error::LengthMismatch { found: 2, .. })));
    });
}

#[test]
fn block_freed_on_a_busy_stream_is_not_overwritten_by_its_late_write() {
    // A is slow; a block freed on A while A still has a write into it queued is reused on B. B's
    // data must never be overwritten by A's late write.
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        // 2 MiB: a chunk of its own in cudrv's pool, so B can only reuse A's block.
        let n = 512 * 1024;
        let old_ptr;
        {
            let mut x = DeviceBuffer::<u32>::zeroed(n, &a).unwrap();
            x.fill(0xAAAA_AAAA).unwrap(); // queued on A behind two delays
            old_ptr = x.as_raw();
        } // freed on A, in A's order
        let mut y = DeviceBuffer::<u32>::zeroed(n, &b).unwrap();
        y.fill(0x5555_5555).unwrap();
        let got = y.to_vec().unwrap();
        a.synchronize().unwrap();
        let again = y.to_vec().unwrap();
        assert!(got.iter().chain(&again).all(|&v| v == 0x5555_5555), "B's data was overwritten");
        let resource = dev.memory_resource().unwrap();
        if resource.kind() == ResourceKind::StreamOrderedPool {
            // The pool reused A's block for B after a GPU-side wait.
            assert_eq!(y.as_raw(), old_ptr);
        }
        assert!(fake_report().violations.is_empty());
    });
}

#[test]
fn stream_ordered_pool_reuses_on_the_same_stream_without_driver_calls() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let pool = StreamOrderedPool::new(&dev).unwrap();
        let s = Stream::new(&dev).unwrap();
        // Two 1 MiB blocks fill one small chunk.
        const MIB: usize = 1 << 20;
        let p = pool.allocate(MIB, &s).unwrap();
        let fill = pool.allocate(MIB, &s).unwrap();
        // SAFETY: `p` is unused.
        unsafe { pool.deallocate(p, MIB, &s).unwrap() };
        let before = pool.pool_stats();
        for _ in 0..100 {
            let q = pool.allocate(MIB, &s).unwrap();
            assert_eq!(q, p);
            // SAFETY: `q` is unused.
            unsafe { pool.deallocate(q, MIB, &s).unwrap() };
        }
        let after = pool.pool_stats();
        assert_eq!(after.driver_allocs, before.driver_allocs);
        assert_eq!(after.cache_hits, before.cache_hits + 100);
        assert_eq!(after.event_records, before.event_records);
        // Freeing what the pool did not hand out is refused and changes nothing.
        // SAFETY: the pool refuses the pointer.
        let bad = unsafe { pool.deallocate(p + 512, MIB, &s) };
        assert!(
            matches!(bad, Err(Error::NotFromResource { resource: "StreamOrderedPool", ptr, bytes: MIB }) if ptr == p + 512),
            "{bad:?}"
        );
        // SAFETY: as above (double free).
        assert!(unsafe { pool.deallocate(p, MIB, &s) }.is_err());
        assert_eq!(pool.pool_stats(), after);
        let other = Stream::new(&Device::get(0).unwrap()).unwrap();
        let q = pool.allocate(MIB, &other).unwrap();
        let stats = pool.pool_stats();
        assert_eq!(q, p, "the block freed on `s` is reused on `other` after a GPU-side wait");
        assert_eq!((stats.event_records, stats.event_waits, stats.driver_allocs), (1, 1, 1));
        // SAFETY: unused.
        unsafe {
            pool.deallocate(q, MIB, &other).unwrap();
            pool.deallocate(fill, MIB, &s).unwrap();
        }
        drop((pool, s, other));
        assert_no_leaks();
    });
}

#[test]
fn dropping_a_stream_lets_the_pool_forget_it() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_DELAY_US", "1000")], || {
        let dev = Device::get(0).unwrap();
        for _ in 0..20 {
            let s = Stream::new(&dev).unwrap();
            let mut b = DeviceBuffer::<u8>::zeroed(4096, &s).unwrap();
            b.memset(1).unwrap();
        }
        // Every stream was destroyed: the pool did not keep them alive.
        dev.primary_context().unwrap().synchronize().unwrap();
        assert_eq!(fake_report().live_streams, 0);
        release_everything(&dev);
        assert_no_leaks();
    });
}

#[test]
fn buffer_used_on_a_second_stream_is_not_reused_too_early() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "20000")], || {
        let dev = Device::get(0).unwrap();
        let home = Stream::new(&dev).unwrap();
        let other = Stream::new(&dev).unwrap();
        let n = 4096;
        let src = DeviceBuffer::from_slice(&vec![3u32; n], &home).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(n, &other).unwrap();
        other.wait_stream(&home).unwrap();
        dst.copy_from(&src).unwrap(); // reads `src` on `other`, behind delays
        drop(src); // freed on `home`, but must wait for `other`
        let mut reuse = DeviceBuffer::<u32>::zeroed(n, &home).unwrap();
        reuse.fill(9).unwrap();
        assert_eq!(dst.to_vec().unwrap(), vec![3; n]);
        assert_eq!(reuse.to_vec().unwrap(), vec![9; n]);
        assert!(fake_report().violations.is_empty());
    });
}

#[test]
fn many_threads_and_streams() {
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "50")], || {
        let dev = Device::get(0).unwrap();
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                std::thread::spawn(move || {
                    let streams: Vec<Stream> = (0..3).map(|_| Stream::new(&dev).unwrap()).collect();
                    let mut live: Vec<(DeviceBuffer<u32>, u32)> = Vec::new();
                    let mut x = 0x9e37_79b9u32 ^ t;
                    for i in 0..150u32 {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        let s = &streams[(x % 3) as usize];
                        let len = 1 + (x as usize % 5000);
                        let value = t << 24 | i;
                        let mut b = DeviceBuffer::<u32>::zeroed(len, s).unwrap();
                        b.fill(value).unwrap();
                        live.push((b, value));
                        if live.len() > 6 {
                            let (b, value) = live.swap_remove((x as usize / 7) % live.len());
                            assert!(b.to_vec().unwrap().iter().all(|&v| v == value));
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
        assert!(fake_report().violations.is_empty());
        dev.primary_context().unwrap().synchronize().unwrap();
        release_everything(&dev);
        assert_no_leaks();
    });
}

#[test]
fn a_mapping_refused_access_and_then_its_undo_is_an_error_reported_twice() {
    // The pool grows in segments (the fake's tcc mode has virtual memory management): access to a
    // new mapping refused with and without the peers, and the unmap that undoes it refused too.
    let fail = "cuMemSetAccess:1:999,cuMemUnmap:1:400";
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_FAIL", fail)], || {
        let dev = Device::get(0).unwrap();
        let ctx = dev.primary_context().unwrap();
        let s = Stream::new(&dev).unwrap();
        let err = DeviceBuffer::<u8>::zeroed(1 << 20, &s).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_UNKNOWN), "{err}");
        let Err(Error::Deferred(unmap)) = ctx.take_deferred() else { panic!("the failed undo was not reported") };
        assert_eq!(unmap.code(), Some(CUresult::CUDA_ERROR_INVALID_HANDLE), "{unmap}");
        // The driver kept the range mapped; the pool unmaps it again (the fault is spent) before
        // it maps there or gives the range back, and the next growth serves.
        let again = DeviceBuffer::from_slice(&[7u8; 1 << 20], &s).unwrap();
        assert!(again.to_vec().unwrap().iter().all(|&x| x == 7));
        drop(again);
        dev.memory_resource().unwrap().trim(0).unwrap();
        assert!(ctx.take_deferred().is_ok(), "nothing more to report");
    });
}

#[test]
fn the_drop_error_hook_may_use_the_pool_whose_lock_met_the_error() {
    // The failed undo of a mapping is met with the pool's arena locked; the hook asks the pool for
    // its figures, which locks the arena: it must run once the lock is let go.
    static SEEN: std::sync::Mutex<Vec<(Option<CUresult>, usize)>> = std::sync::Mutex::new(Vec::new());
    fn hook(e: &Error) {
        let reserved = Device::get(0).unwrap().memory_resource().unwrap().stats().unwrap().reserved;
        SEEN.lock().unwrap().push((e.code(), reserved));
    }
    let fail = "cuMemSetAccess:1:999,cuMemUnmap:1:400";
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_FAIL", fail)], || {
        assert!(cudrv::set_drop_error_hook(hook));
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let err = DeviceBuffer::<u8>::zeroed(1 << 20, &s).unwrap_err();
        assert_eq!(err.code(), Some(CUresult::CUDA_ERROR_UNKNOWN), "{err}");
        assert_eq!(*SEEN.lock().unwrap(), [(Some(CUresult::CUDA_ERROR_INVALID_HANDLE), 0)]);
    });
}

#[test]
fn out_of_memory_releases_the_cache_and_retries() {
    let mib = 1usize << 20;
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_MEMORY", "67108864")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        {
            let _a = DeviceBuffer::<u8>::zeroed(40 * mib, &s).unwrap();
        } // cached by the pool: 40 MiB of the 64 reserved
        let pool = dev.memory_resource().unwrap();
        assert!(pool.stats().unwrap().reserved >= 40 * mib);
        // 50 MiB fits only once the cached 40 are given back.
        let b = DeviceBuffer::<u8>::zeroed(50 * mib, &s).unwrap();
        assert_eq!(b.len(), 50 * mib);
        // 100 MiB cannot fit at all: a typed error with the figures.
        // SAFETY: the allocation fails.
        let err = unsafe { DeviceBuffer::<u8>::uninit(100 * mib, &s) }.unwrap_err();
        let Error::OutOfMemory { requested, device, in_use, .. } = err else { panic!("{err}") };
        assert_eq!((requested, device, in_use), (100 * mib, 0, 50 * mib));
        drop((b, s));
        pool.trim(0).unwrap();
        assert_no_leaks();
    });
    // An injected failure of the driver's allocation is recovered from the same way.
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_FAIL", "cuMemAlloc_v2:2:2")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let a = DeviceBuffer::<u8>::zeroed(8 * mib, &s).unwrap(); // first cuMemAlloc
        let b = DeviceBuffer::<u8>::zeroed(32 * mib, &s).unwrap(); // second fails, retried
        assert_eq!((a.len(), b.len()), (8 * mib, 32 * mib));
    });
}

#[test]
fn sync_resource_waits_before_freeing() {
    run_with_fake(&[("CUDRV_FAKE_DELAY_US", "20000"), ("CUDRV_MEMORY_RESOURCE", "sync")], || {
        let dev = Device::get(0).unwrap();
        let s = Stream::new(&dev).unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed(1024, &s).unwrap();
        b.fill(1).unwrap();
        drop(b); // cuMemFree after the stream's work: no use-after-free in the fake's report
        assert!(fake_report().violations.is_empty());
        drop(s);
        release_everything(&dev);
        assert_no_leaks();
    });
}

#[test]
fn driver_pool_stats_trim_and_owned_pools() {
    run_with_fake_modes(&["linux", "wddm"], &[], || {
        let dev = Device::get(0).unwrap();
        if oldest() {
            // CUDA 11.1 predates memory pools: no pool of the driver's, owned or not.
            assert_no_pools_on_oldest(DriverPool::with_config(&dev, DriverPoolConfig::default()));
            assert_no_pools_on_oldest(DriverPool::default_pool(&dev));
            return;
        }
        let s = Stream::new(&dev).unwrap();
        let pool = Arc::new(DriverPool::with_config(&dev, DriverPoolConfig::default()).unwrap());
        {
            let b = DeviceBuffer::from_slice_in(&[1u8; 1 << 20], &s, pool.clone()).unwrap();
            assert_eq!(b.to_vec().unwrap()[12345], 1);
            let st = pool.stats().unwrap();
            assert!(st.in_use >= 1 << 20 && st.reserved >= st.in_use, "{st:?}");
        }
        s.synchronize().unwrap();
        let st = pool.stats().unwrap();
        assert_eq!(st.in_use, 0);
        assert!(st.reserved > 0, "the raised release threshold keeps memory cached: {st:?}");
        pool.trim(0).unwrap();
        assert_eq!(pool.stats().unwrap().reserved, 0);
        assert!(st.peak_in_use >= 1 << 20);
        pool.reset_peaks().unwrap();
    });
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let err = DriverPool::with_config(&dev, DriverPoolConfig::default()).unwrap_err();
        assert!(matches!(err, Error::Unsupported { feature: "memory pools", .. }), "{err}");
    });
}

#[test]
fn stream_and_resource_of_different_devices_are_rejected() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,tcc")], || {
        let d0 = Device::get(0).unwrap();
        let d1 = Device::get(1).unwrap();
        let s1 = Stream::new(&d1).unwrap();
        let r0 = d0.memory_resource().unwrap();
        // SAFETY: the allocation is refused.
        let err = unsafe { DeviceBuffer::<u8>::uninit_in(16, &s1, r0.clone()) }.unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { expected: 0, found: 1, .. }), "{err}");
        assert!(d1.set_memory_resource(r0, "wrong device").is_err());
        assert_eq!(d0.memory_resource().unwrap().kind(), pool_kind(&d0));
        assert_eq!(d1.memory_resource().unwrap().kind(), ResourceKind::StreamOrderedPool);
        // Peer copies between them are correct, both ways.
        let s0 = Stream::new(&d0).unwrap();
        let a = DeviceBuffer::from_slice(&[4u32, 5, 6], &s0).unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed(3, &s1).unwrap();
        s1.wait_stream(&s0).unwrap();
        a.copy_to_peer(&mut b, &s1).unwrap();
        assert_eq!(b.to_vec().unwrap(), [4, 5, 6]);
        let mut c = DeviceBuffer::<u32>::zeroed(3, &s0).unwrap();
        s0.wait_stream(&s1).unwrap();
        b.copy_to_peer(&mut c, &s0).unwrap();
        assert_eq!(c.to_vec().unwrap(), [4, 5, 6]);
        assert!(matches!(c.copy_from(&b), Err(Error::DeviceMismatch { .. })));
    });
}

#[test]
fn host_registration_and_managed_memory_are_gated() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let mut host = vec![0u32; 1024];
        let mut reg = register_host(&dev, &mut host).unwrap();
        assert_eq!(reg.byte_len(), 4096);
        reg.as_mut_slice()[0] = 5;
        drop(reg);
        assert_eq!(host[0], 5);
        let managed = cudrv::memory::ManagedResource::new(&dev).unwrap();
        let s = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice_in(&[1u8, 2], &s, Arc::new(managed)).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [1, 2]);
    });
}

#[test]
fn pool_with_a_small_config_still_merges_and_trims() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::with_config(&dev, PoolConfig::default()).unwrap());
        let s = Stream::new(&dev).unwrap();
        let bufs: Vec<DeviceBuffer<u8>> =
            (0..64).map(|i| DeviceBuffer::from_slice_in(&[i as u8; 1000], &s, pool.clone()).unwrap()).collect();
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.to_vec().unwrap().iter().all(|&v| v == i as u8));
        }
        let live = pool.pool_stats();
        assert_eq!(live.driver_allocs, 1, "64 small buffers share one chunk");
        drop(bufs);
        pool.trim(0).unwrap();
        assert_eq!(pool.pool_stats().reserved, 0);
        let err = CUresult::CUDA_SUCCESS;
        assert_eq!(err.0, 0);
    });
}

#[test]
fn peer_access_is_idempotent_and_per_device_pools_stay_apart() {
    run_with_fake(&[("CUDRV_FAKE_DEVICES", "linux,tcc")], || {
        let d0 = Device::get(0).unwrap();
        let d1 = Device::get(1).unwrap();
        assert!(d0.can_access_peer(&d1).unwrap());
        d0.enable_peer_access(&d1).unwrap();
        d0.enable_peer_access(&d1).unwrap(); // already enabled: still Ok
        d0.enable_peer_access(&d0).unwrap();
        d1.enable_peer_access(&d0).unwrap();
        // Each device has its own resource and its own statistics.
        let s0 = Stream::new(&d0).unwrap();
        let s1 = Stream::new(&d1).unwrap();
        let a = DeviceBuffer::<u8>::zeroed(3 << 20, &s1).unwrap();
        let r1 = d1.memory_resource().unwrap();
        assert_eq!(r1.kind(), ResourceKind::StreamOrderedPool);
        assert!(r1.stats().unwrap().in_use >= 3 << 20);
        let b = DeviceBuffer::<u8>::zeroed(1 << 20, &s0).unwrap();
        assert_eq!(d0.memory_resource().unwrap().kind(), pool_kind(&d0));
        // A stream of device 0 cannot allocate from device 1's pool.
        assert!(matches!(r1.allocate(16, &s0), Err(Error::DeviceMismatch { expected: 1, found: 0, .. })));
        // Peer copies of 1 MiB both ways, checked.
        let data: Vec<u8> = (0..1 << 20).map(|i| (i * 31 % 251) as u8).collect();
        let src = DeviceBuffer::from_slice(&data, &s0).unwrap();
        let mut mid = DeviceBuffer::<u8>::zeroed(data.len(), &s1).unwrap();
        // Streams are ordered only by the caller: the copy on s0 must come after mid's memset on s1.
        s0.wait_stream(&s1).unwrap();
        src.copy_to_peer(&mut mid, &s0).unwrap();
        let mut back = DeviceBuffer::<u8>::zeroed(data.len(), &s0).unwrap();
        s1.wait_stream(&s0).unwrap();
        mid.copy_to_peer(&mut back, &s1).unwrap();
        s0.wait_stream(&s1).unwrap(); // `back` is read on s0, its home stream
        assert!(back.to_vec().unwrap() == data, "the round trip through device 1 changed the data");
        drop((a, b));
    });
}

/// A resource outside cudrv that breaks the alignment contract: it hands out its inner
/// resource's memory 64 bytes in, and counts what it gets back.
#[derive(Debug)]
struct Misaligning {
    inner: SyncResource,
    freed: std::sync::atomic::AtomicUsize,
}

// SAFETY: every pointer is the inner resource's, 64 bytes in, and goes back to it as it came;
// only the alignment contract is broken, which is what the test checks cudrv refuses.
unsafe impl MemoryResource for Misaligning {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<u64> {
        Ok(self.inner.allocate(bytes + 64, stream)? + 64)
    }
    unsafe fn deallocate(&self, ptr: u64, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        self.freed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `ptr - 64` came from the inner resource with `bytes + 64`.
        unsafe { self.inner.deallocate(ptr - 64, bytes + 64, stream) }
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn kind(&self) -> ResourceKind {
        ResourceKind::Custom
    }
}

#[test]
fn a_resource_that_misaligns_gets_its_memory_back_and_the_caller_an_error() {
    run_with_fake(&[], || {
        let dev = Device::get(0).unwrap();
        let stream = Stream::new(&dev).unwrap();
        let r = Arc::new(Misaligning { inner: SyncResource::new(&dev).unwrap(), freed: Default::default() });
        // Given to the buffer, and as the device's resource (each path of `uninit`).
        // SAFETY: nothing reads the contents.
        let err = unsafe { DeviceBuffer::<u8>::uninit_in(1000, &stream, r.clone()) }.err().unwrap();
        assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("not aligned to 256")), "{err}");
        dev.set_memory_resource(r.clone(), "misaligning").unwrap();
        // SAFETY: as above.
        let err = unsafe { DeviceBuffer::<u8>::uninit(1000, &stream) }.err().unwrap();
        assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("custom returned")), "{err}");
        assert_eq!(r.freed.load(std::sync::atomic::Ordering::Relaxed), 2, "each allocation went back");
        drop(stream);
        release_everything(&dev);
        assert_no_leaks();
    });
}

/// A pool in segments of virtual memory on a device that live buffers nearly fill: memory is
/// mapped, unmapped between live buffers (leaving holes) and mapped again where a new buffer needs
/// it. Every buffer keeps its data, the fake sees no access to memory that is not mapped (it
/// checks each queued copy and kernel when it runs, 200 µs late), and nothing leaks.
#[test]
fn a_pool_in_segments_moves_memory_where_it_is_needed_and_keeps_the_data() {
    let memory = (72u64 << 20).to_string();
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "200"), ("CUDRV_FAKE_MEMORY", &memory)], || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        assert!(pool.grows_in_segments(), "the fake's devices have virtual memory management");
        let s = Stream::new(&dev).unwrap();
        let words = cudrv_test_support::random_u64s(cudrv_test_support::time_seed(), 400);
        let mut live: Vec<(DeviceBuffer<u32>, u32)> = Vec::new();
        let mut live_bytes = 0usize;
        for (i, w) in words.iter().enumerate() {
            // Up to 12 MiB; at most 40 MiB live (what a mapping shares with a live buffer stays
            // mapped: a few MiB per gap between live buffers).
            let len = 1 + (w % (3 << 20)) as usize;
            let mut pick = w >> 32;
            while !live.is_empty() && (live_bytes + 4 * len > 40 << 20 || pick % 3 == 0) {
                let (buf, _) = live.remove(pick as usize % live.len());
                live_bytes -= 4 * buf.len();
                pick = pick / 3 + 1;
            }
            let mut buf = DeviceBuffer::<u32>::zeroed_in(len, &s, pool.clone()).unwrap();
            buf.fill(i as u32).unwrap();
            live_bytes += 4 * len;
            live.push((buf, i as u32));
            if i % 16 == 15 {
                // The host sees the frees complete: the next growth may unmap their memory.
                s.synchronize().unwrap();
                for (buf, v) in &live {
                    let back = buf.to_vec().unwrap();
                    assert!(back.iter().all(|x| x == v), "a buffer of {} words lost its data", buf.len());
                }
            }
        }
        drop(live);
        drop(pool);
        let report = fake_report();
        assert!(report.violations.is_empty(), "{report}");
        assert_no_leaks_but_streams();
    });
}

/// Freed memory between live buffers goes where a larger buffer needs it: on a full device, the
/// pool unmaps the gaps and maps that memory again at the top of its segment.
#[test]
fn a_pool_in_segments_unmaps_gaps_to_serve_a_larger_buffer() {
    let memory = (72u64 << 20).to_string();
    run_with_fake_modes(&MODES, &[("CUDRV_FAKE_DELAY_US", "200"), ("CUDRV_FAKE_MEMORY", &memory)], || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        let s = Stream::new(&dev).unwrap();
        const MIB_WORDS: usize = 1 << 18;
        let mut bufs: Vec<Option<DeviceBuffer<u32>>> = (0..8u32)
            .map(|i| {
                let mut b = DeviceBuffer::<u32>::zeroed_in(8 * MIB_WORDS, &s, pool.clone()).unwrap();
                b.fill(i).unwrap();
                Some(b)
            })
            .collect();
        let full = pool.pool_stats();
        assert_eq!(full.reserved, 64 << 20, "{full:?}");
        // Every other one goes: 32 MiB free, in 8 MiB gaps, and 6 MiB left on the device.
        for b in bufs.iter_mut().step_by(2) {
            *b = None;
        }
        let mut big = DeviceBuffer::<u32>::zeroed_in(24 * MIB_WORDS, &s, pool.clone()).unwrap();
        big.fill(0xB16).unwrap();
        let st = pool.pool_stats();
        assert!(st.driver_frees >= 2, "the gaps were not unmapped: {st:?}");
        // The gaps are unmapped as far as the request needs: whole where each is one mapping;
        // in small mappings (the pool holds more than an eighth of the device), only what the
        // device lacks (it holds 72 MiB, less what the driver keeps): within 1.10x the peak.
        assert!(st.reserved <= (64 << 20) / 100 * 110, "{st:?}");
        for (i, b) in bufs.iter().enumerate().filter_map(|(i, b)| Some((i, b.as_ref()?))) {
            assert!(b.to_vec().unwrap().iter().all(|&x| x == i as u32), "buffer {i} lost its data");
        }
        assert!(big.to_vec().unwrap().iter().all(|&x| x == 0xB16));
        // Then everything goes, and one buffer takes nearly all the device: holes and top alike.
        drop((bufs, big));
        let mut huge = DeviceBuffer::<u32>::zeroed_in(64 * MIB_WORDS, &s, pool.clone()).unwrap();
        huge.fill(7).unwrap();
        assert!(huge.to_vec().unwrap().iter().all(|&x| x == 7));
        drop(huge);
        drop(pool);
        let report = fake_report();
        assert!(report.violations.is_empty(), "{report}");
        assert_no_leaks_but_streams();
    });
}

/// A growth that meets an unmap in flight waits for it, then maps the memory it needs. Another
/// thread trims the pool while the driver's unmap takes a second; a buffer allocated meanwhile
/// finds its segment's memory being unmapped (off the pool's free lists), waits without a lock
/// held, and maps anew once the unmap is done: it keeps its data, the trim ends, and nothing
/// leaks. (It checks that the wait ends and loses nothing, not how the waiter waits.)
#[test]
fn a_growth_waits_for_an_unmap_in_flight() {
    run_with_fake(&[("CUDRV_FAKE_UNMAP_US", "1000000")], || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        assert!(pool.grows_in_segments());
        let s = Stream::new(&dev).unwrap();
        drop(DeviceBuffer::<u8>::zeroed_in(32 << 20, &s, pool.clone()).unwrap());
        s.synchronize().unwrap();
        let trimmer = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.trim(0))
        };
        // Let the trim take the mapping off the free lists and start unmapping it (it has a
        // fifth of the unmap's second to start; the allocation below would otherwise split the
        // cached block, and the counts below say so).
        std::thread::sleep(std::time::Duration::from_millis(200));
        let mut buf = DeviceBuffer::<u32>::zeroed_in(4 << 20, &s, pool.clone()).unwrap();
        buf.fill(9).unwrap();
        trimmer.join().unwrap().unwrap();
        assert!(buf.to_vec().unwrap().iter().all(|&x| x == 9));
        let st = pool.pool_stats();
        // (The 32 MiB growth maps two handles of 16 MiB, the smallest coarse handle.)
        assert_eq!((st.driver_allocs, st.driver_frees), (3, 2), "mapped, unmapped, mapped again: {st:?}");
        assert_eq!(st.reserved, 16 << 20, "{st:?}");
        drop(buf);
        drop(pool);
        let report = fake_report();
        assert!(report.violations.is_empty(), "{report}");
        assert_no_leaks_but_streams();
    });
}

/// Where the device has no virtual memory management, the pool grows in chunks of `cuMemAlloc`.
#[test]
fn a_pool_without_virtual_memory_grows_in_chunks() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_VMM", "0")], || {
        let dev = Device::get(0).unwrap();
        assert!(!dev.capabilities().unwrap().virtual_memory_management);
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        assert!(!pool.grows_in_segments());
        let s = Stream::new(&dev).unwrap();
        let buf = DeviceBuffer::from_slice_in(&[3u8; 5000], &s, pool.clone()).unwrap();
        assert_eq!(buf.to_vec().unwrap(), [3u8; 5000]);
        assert_eq!(pool.pool_stats().chunks, 1);
    });
}

/// Where the driver makes a `cuMemAlloc` that comes soon after a `cuMemFree` wait for the free's
/// background work (driver 580 waits 5-7.5 ms: BENCHMARKS.md, run 81), the pool learns it from
/// one such wait and paces its later chunk allocations: it first waits out its estimate of the
/// work left (2.5 µs a MiB), and the driver no longer makes it wait. The fake leaves 2 ms of
/// work per GiB freed and makes an allocation before it is done sleep 3 ms. A driver that never
/// makes an allocation wait is never paced.
#[test]
fn chunk_allocations_soon_after_frees_are_paced_once_the_driver_was_seen_to_wait() {
    let round = |pool: &Arc<StreamOrderedPool>, s: &Stream| {
        // A raw allocation: a buffer of 1 GiB would be filled in host memory by the fake.
        let ptr = pool.allocate(1 << 30, s).unwrap();
        // SAFETY: allocated just above on `s`, freed once, and never used.
        unsafe { pool.deallocate(ptr, 1 << 30, s) }.unwrap();
        s.synchronize().unwrap();
        // Gives the chunk back (`cuMemFree`): the next round's growth comes right after it.
        pool.trim(0).unwrap();
        let st = pool.pool_stats();
        assert_eq!(st.reserved, 0);
        st
    };
    let chunks = [("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_VMM", "0")];
    run_with_fake(&[chunks[0], chunks[1], ("CUDRV_FAKE_FREE_US_PER_GIB", "2000")], || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        assert!(!pool.grows_in_segments());
        let s = Stream::new(&dev).unwrap();
        let first = round(&pool, &s);
        assert_eq!((first.driver_waits_after_free, first.paced_allocations), (0, 0), "no free before: {first:?}");
        // The next growth comes within the free's 2 ms (a host thread preempted that long would
        // miss it: a few rounds are allowed).
        let mut seen = first;
        for _ in 0..10 {
            seen = round(&pool, &s);
            if seen.driver_waits_after_free > 0 {
                break;
            }
        }
        assert_eq!((seen.driver_waits_after_free, seen.paced_allocations), (1, 0), "{seen:?}");
        // Paced from now on: 1 GiB at 2.5 µs a MiB is 2.56 ms, past the fake's 2 ms.
        let paced = round(&pool, &s);
        assert_eq!(paced.driver_waits_after_free, 1, "the paced allocation did not wait: {paced:?}");
        assert_eq!(paced.paced_allocations, 1, "{paced:?}");
        let most = std::time::Duration::from_micros(2560);
        assert!(paced.pacing_time > std::time::Duration::ZERO && paced.pacing_time <= most, "{paced:?}");
        assert_eq!(paced.driver_allocs, seen.driver_allocs + 1);
    });
    run_with_fake(&chunks, || {
        let dev = Device::get(0).unwrap();
        let pool = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        let s = Stream::new(&dev).unwrap();
        for _ in 0..4 {
            let st = round(&pool, &s);
            assert_eq!((st.driver_waits_after_free, st.paced_allocations, st.pacing_time), (0, 0, Default::default()));
        }
    });
}

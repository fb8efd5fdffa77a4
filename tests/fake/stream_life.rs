//! How long a stream lives: as long as a `Stream` value, a buffer allocated on it, or a live
//! allocation of `StreamOrderedPool` made on it needs it, and no longer. Buffers of the device's
//! `StreamOrderedPool` refer to their stream without a reference count of their own (the pool
//! keeps the stream pinned while it holds allocations made there), so these tests race the
//! last user's drop against the buffers' frees and check that every stream is destroyed once,
//! after its last use, with the data intact.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudrv::memory::{DeviceBuffer, MemoryResource, StreamOrderedPool};
use cudrv::{Device, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, run_with_fake};

use crate::driver_pool_refused;

fn live_streams() -> u64 {
    fake_report().live_streams
}

fn trim_all(dev: &Device) {
    cudrv::flush_deferred_drops().unwrap();
    dev.memory_resource().unwrap().trim(0).unwrap();
}

/// With every resource: a buffer outlives the last `Stream` of its stream, which stays valid
/// (queued work, copies, new buffers on the view it hands out) until the last buffer goes.
#[test]
fn buffers_keep_their_stream_after_its_last_user_drops_it() {
    for resource in ["pool", "driver-pool", "sync"] {
        let mode = if resource == "driver-pool" { "linux" } else { "tcc" };
        run_with_fake(&[("CUDRV_MEMORY_RESOURCE", resource), ("CUDRV_FAKE_MODE", mode)], || {
            if driver_pool_refused(resource) {
                return; // CUDA 11.1: no driver's pool (checked); the others still run
            }
            let dev = Device::get(0).unwrap();
            let base = live_streams();
            let stream = Stream::new(&dev).unwrap();
            let id = stream.id();
            let data: Vec<u32> = (0..4096).map(|i| i * 3 + 1).collect();
            let first = DeviceBuffer::from_slice(&data, &stream).unwrap();
            drop(stream);
            assert_eq!(live_streams(), base + 1, "{resource}: the buffer keeps its stream");
            assert_eq!(first.stream().id(), id);
            assert_eq!(first.to_vec().unwrap(), data, "{resource}");
            // A second buffer on the view, written on the GPU from the first.
            let mut second = DeviceBuffer::<u32>::zeroed(data.len(), first.stream()).unwrap();
            second.copy_from(&first).unwrap();
            // A user made from the view, and let go again.
            let again = first.stream().clone();
            again.synchronize().unwrap();
            drop(again);
            drop(first);
            assert_eq!(live_streams(), base + 1, "{resource}: the second buffer keeps it");
            assert_eq!(second.to_vec().unwrap(), data, "{resource}");
            drop(second);
            trim_all(&dev);
            assert_eq!(live_streams(), base, "{resource}: destroyed with its last buffer");
            assert_no_leaks();
        });
    }
}

/// A stream whose buffers are all gone is destroyed with its last user, although the pool kept
/// it pinned between its allocations.
#[test]
fn a_stream_goes_with_its_last_user_when_no_buffer_needs_it() {
    run_with_fake(&[("CUDRV_MEMORY_RESOURCE", "pool"), ("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let base = live_streams();
        let stream = Stream::new(&dev).unwrap();
        for i in 0..10usize {
            let mut b = DeviceBuffer::<u8>::zeroed(1000 + i * 4096, &stream).unwrap();
            b.fill(i as u8).unwrap();
            assert!(b.to_vec().unwrap().iter().all(|&v| v == i as u8));
        }
        let copy = stream.clone();
        drop(stream);
        assert_eq!(live_streams(), base + 1, "a clone is left");
        drop(copy);
        assert_eq!(live_streams(), base, "the pool let go of its pin");
        trim_all(&dev);
        assert_no_leaks();
    });
}

/// The raw pool API: an allocation keeps its stream until it is freed, even on another stream.
#[test]
fn a_raw_pool_allocation_keeps_its_stream_until_it_is_freed() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let pool = StreamOrderedPool::new(&dev).unwrap();
        let base = live_streams();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let p = pool.allocate(1 << 20, &a).unwrap();
        drop(a);
        assert_eq!(live_streams(), base + 2, "the allocation keeps its stream");
        // SAFETY: `p` came from `pool` with this size; nothing used it.
        unsafe { pool.deallocate(p, 1 << 20, &b) }.unwrap();
        assert_eq!(live_streams(), base + 1, "let go with the free");
        // The block is reusable on `b` now (it was freed there).
        let q = pool.allocate(1 << 20, &b).unwrap();
        assert_eq!(p, q);
        // SAFETY: as above.
        unsafe { pool.deallocate(q, 1 << 20, &b) }.unwrap();
        drop(b);
        pool.trim(0).unwrap();
        drop(pool);
        assert_eq!(live_streams(), base);
        assert_no_leaks();
    });
}

/// The last user's drop races the frees of the stream's buffers on other threads, and other
/// threads make users from the buffers' views: every buffer reads back its own data, and every
/// stream is destroyed once its last buffer and user are gone.
#[test]
fn last_user_drops_race_buffer_frees() {
    run_with_fake(&[("CUDRV_MEMORY_RESOURCE", "pool"), ("CUDRV_FAKE_MODE", "tcc")], || {
        crate::soundness::within(Duration::from_secs(60), "racing stream and buffer drops", || {
            let dev = Device::get(0).unwrap();
            let base = live_streams();
            const THREADS: usize = 4;
            for round in 0..40u32 {
                let stream = Stream::new(&dev).unwrap();
                let buffers: Vec<DeviceBuffer<u32>> = (0..THREADS as u32)
                    .map(|t| DeviceBuffer::from_slice(&vec![round * 100 + t; 256 + t as usize * 64], &stream).unwrap())
                    .collect();
                let start = Arc::new(Barrier::new(THREADS + 1));
                let workers: Vec<_> = buffers
                    .into_iter()
                    .enumerate()
                    .map(|(t, buf)| {
                        let start = start.clone();
                        std::thread::spawn(move || {
                            start.wait();
                            let expect = round * 100 + t as u32;
                            if t % 2 == 0 {
                                // A user made from the view, used, dropped.
                                let user = buf.stream().clone();
                                user.synchronize().unwrap();
                                drop(user);
                            }
                            assert!(buf.to_vec().unwrap().iter().all(|&v| v == expect), "round {round}");
                            // A new buffer on the view, then both freed.
                            let more = DeviceBuffer::<u32>::zeroed(64, buf.stream()).unwrap();
                            drop(buf);
                            assert_eq!(more.to_vec().unwrap(), vec![0; 64]);
                        })
                    })
                    .collect();
                start.wait();
                drop(stream);
                for w in workers {
                    w.join().unwrap();
                }
                assert_eq!(live_streams(), base, "round {round}: a stream outlived its buffers");
            }
            trim_all(&dev);
            assert_no_leaks();
        });
    });
}

/// A buffer dropped inside a host function is its stream's last reference: the stream's
/// destruction is handed to cudrv's thread, like the free.
#[test]
fn a_host_function_may_drop_a_streams_last_buffer() {
    run_with_fake(
        &[("CUDRV_MEMORY_RESOURCE", "pool"), ("CUDRV_FAKE_MODE", "tcc"), ("CUDRV_FAKE_DELAY_US", "1000")],
        || {
            let dev = Device::get(0).unwrap();
            let base = live_streams();
            let other = Stream::new(&dev).unwrap();
            let stream = Stream::new(&dev).unwrap();
            let buf = DeviceBuffer::from_slice(&[7u32; 1024], &stream).unwrap();
            drop(stream);
            other.launch_host_fn(move || drop(buf)).unwrap();
            other.synchronize().unwrap();
            cudrv::flush_deferred_drops().unwrap();
            assert_eq!(live_streams(), base + 1, "only `other` is left");
            drop(other);
            trim_all(&dev);
            assert_no_leaks();
        },
    );
}

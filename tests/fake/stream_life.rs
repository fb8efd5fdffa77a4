//! How long a stream lives: as long as a `Stream` value or a buffer allocated on it needs it, and
//! no longer. Buffers of the device's `StreamOrderedPool` refer to their stream without a
//! reference count of their own (the pool keeps the stream pinned while such buffers live), so
//! these tests race the last user's drop against the buffers' frees, the per-thread stream's
//! users made again, host functions, captures, resource switches and failed frees, and check
//! that every stream is destroyed once, after its last use, with the data intact. (The second
//! half came from a review of the pins.)

use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use cudrv::graph::{CaptureMode, CaptureStatus};
use cudrv::memory::{DeviceBuffer, MemoryResource, StreamOrderedPool, SyncResource};
use cudrv::{Device, Stream};
use cudrv_test_support::{assert_no_leaks, fake_report, run_with_fake};

const POOL: [(&str, &str); 2] = [("CUDRV_MEMORY_RESOURCE", "pool"), ("CUDRV_FAKE_MODE", "tcc")];

use crate::driver_pool_refused;
use crate::graph_cases::release_everything;

fn live_streams() -> u64 {
    fake_report().live_streams
}

/// Every stream made since `base` was counted is gone, and nothing leaked or was misused.
fn all_gone(dev: &Device, base: u64) {
    release_everything(dev);
    assert_eq!(live_streams(), base);
    assert!(fake_report().violations.is_empty(), "{:?}", fake_report().violations);
    assert_no_leaks();
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
            release_everything(&dev);
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
        release_everything(&dev);
        assert_no_leaks();
    });
}

/// A buffer served from the stream's cache (no arena, the fast path) pins the stream again when
/// the pool had let go of its pin: here the stream's last user is gone and only another
/// resource's buffer keeps it, then goes too.
#[test]
fn a_cached_block_pins_a_stream_the_pool_had_let_go() {
    run_with_fake(&POOL, || {
        let dev = Device::get(0).unwrap();
        let base = live_streams();
        let stream = Stream::new(&dev).unwrap();
        // A block of 64 KiB cached on the stream.
        drop(DeviceBuffer::<u8>::zeroed(1 << 16, &stream).unwrap());
        // Another resource's buffer holds a pin of its own; the last user goes, and with no
        // kept allocation the pool lets go of its pin.
        let other = DeviceBuffer::<u8>::zeroed_in(256, &stream, Arc::new(SyncResource::new(&dev).unwrap())).unwrap();
        drop(stream);
        assert_eq!(live_streams(), base + 1, "the other buffer keeps the stream");
        // On the view: the cached block serves it, and the pool must pin the stream again.
        let r = dev.memory_resource().unwrap();
        let pool = (r.as_ref() as &dyn std::any::Any).downcast_ref::<StreamOrderedPool>().unwrap();
        let hits = pool.pool_stats().cache_hits;
        let mut kept = DeviceBuffer::<u8>::zeroed(1 << 16, other.stream()).unwrap();
        assert_eq!(pool.pool_stats().cache_hits, hits + 1, "served from the stream's cache");
        drop(other);
        assert_eq!(live_streams(), base + 1, "the kept buffer keeps the stream");
        kept.fill(7).unwrap();
        assert_eq!(kept.to_vec().unwrap(), vec![7u8; 1 << 16]);
        drop(kept);
        drop(r);
        all_gone(&dev, base);
    });
}

/// The raw pool API: an allocation does not keep its stream (only buffers do); once the stream
/// is gone, the allocation may be freed on another stream.
#[test]
fn a_raw_pool_allocation_does_not_keep_its_stream() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let pool = StreamOrderedPool::new(&dev).unwrap();
        let base = live_streams();
        let a = Stream::new(&dev).unwrap();
        let b = Stream::new(&dev).unwrap();
        let p = pool.allocate(1 << 20, &a).unwrap();
        drop(a);
        assert_eq!(live_streams(), base + 1, "only `b` is left");
        // SAFETY: `p` came from `pool` with this size; nothing used it.
        unsafe { pool.deallocate(p, 1 << 20, &b) }.unwrap();
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

/// The last user of a capturing stream that holds a raw allocation ends the capture (its
/// stream goes), as without the allocation.
#[test]
fn a_raw_allocation_does_not_keep_an_abandoned_capture() {
    run_with_fake(&POOL, || {
        let dev = Device::get(0).unwrap();
        let res = dev.memory_resource().unwrap();
        let origin = Stream::new(&dev).unwrap();
        let side = Stream::new(&dev).unwrap();
        let p = res.allocate(4096, &origin).unwrap();
        origin.begin_capture(CaptureMode::Relaxed).unwrap();
        side.wait_stream(&origin).unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::Active);
        drop(origin);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(side.capture_status().unwrap(), CaptureStatus::None, "the last user ended the capture");
        // SAFETY: from `res` with this size; nothing used it.
        unsafe { res.deallocate(p, 4096, &side) }.unwrap();
        side.synchronize().unwrap();
    });
}

/// A buffer whose free fails (it leaks its memory, which is sound) does not leak its stream.
#[test]
fn a_failed_free_does_not_keep_the_stream() {
    run_with_fake(
        &[
            ("CUDRV_MEMORY_RESOURCE", "pool"),
            ("CUDRV_FAKE_MODE", "tcc"),
            ("CUDRV_FAKE_FAIL", "cuStreamWaitEvent:2+:999,cuStreamSynchronize:1+:999"),
        ],
        || {
            let dev = Device::get(0).unwrap();
            let base = live_streams();
            let (a, b) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
            // SAFETY: never read.
            let buf = unsafe { DeviceBuffer::<u32>::uninit(1024, &a) }.unwrap();
            buf.record_use(&b).unwrap();
            drop(buf); // the free cannot be ordered after `b`: the memory leaks
            drop(a);
            drop(b);
            cudrv::flush_deferred_drops().unwrap();
            assert_eq!(live_streams(), base, "the leaked memory kept a stream");
        },
    );
}

/// The last user's drop races the frees of the stream's buffers on other threads, and other
/// threads make users from the buffers' views, while the thread that allocated them goes on
/// allocating on the stream: every buffer reads back its own data, and every stream is destroyed
/// once its last buffer and user are gone. With the pool's buffers (kept by the pool) and with
/// owner pins (let go on other threads, see `PINNING`).
#[test]
fn last_user_drops_race_buffer_frees() {
    let resources = [&[("pool", "tcc")], PINNING].concat();
    with_resources(&resources, 120, "racing stream and buffer drops", |resource, dev, base| {
        const THREADS: usize = 4;
        for round in 0..40u32 {
            let stream = Stream::new(dev).unwrap();
            // This thread allocates on the stream first: it is the stream's owner.
            let buffers: Vec<DeviceBuffer<u32>> = (0..THREADS as u32)
                .map(|t| DeviceBuffer::from_slice(&vec![round * 100 + t; 256 + t as usize * 64], &stream).unwrap())
                .collect();
            let start = Arc::new(Barrier::new(THREADS + 1));
            let workers: Vec<_> = buffers
                .into_iter()
                .enumerate()
                .map(|(t, buf)| {
                    let start = start.clone();
                    let resource = resource.to_string();
                    std::thread::spawn(move || {
                        start.wait();
                        let expect = round * 100 + t as u32;
                        if t % 2 == 0 {
                            // A user made from the view, used, dropped.
                            let user = buf.stream().clone();
                            user.synchronize().unwrap();
                            drop(user);
                        }
                        assert!(buf.to_vec().unwrap().iter().all(|&v| v == expect), "{resource} round {round}");
                        // A new buffer on the view, then both freed.
                        let more = DeviceBuffer::<u32>::zeroed(64, buf.stream()).unwrap();
                        drop(buf);
                        assert_eq!(more.to_vec().unwrap(), vec![0; 64]);
                    })
                })
                .collect();
            start.wait();
            for i in 0..20u32 {
                let b = DeviceBuffer::from_slice(&[i; 32], &stream).unwrap();
                assert_eq!(b.to_vec().unwrap(), vec![i; 32]);
            }
            drop(stream);
            for w in workers {
                w.join().unwrap();
            }
            cudrv::flush_deferred_drops().unwrap();
            assert_eq!(live_streams(), base, "{resource} round {round}: a stream outlived its buffers");
        }
        release_everything(dev);
        assert_no_leaks();
    });
}

/// The last user's drop races buffers made on a view of the stream that another resource's buffer
/// keeps, while the pool holds no kept allocation there: a request the stream's cache serves, and
/// one it does not (the pool may find its pin unneeded in the middle of it). Every buffer reads
/// back its data, nothing deadlocks, and the stream goes with the last buffer.
#[test]
fn buffers_on_a_view_race_the_last_user() {
    run_with_fake(&POOL, || {
        crate::soundness::within(Duration::from_secs(60), "buffers on a view racing the last user", || {
            let dev = Device::get(0).unwrap();
            let base = live_streams();
            let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&dev).unwrap());
            for round in 0..60u8 {
                let stream = Stream::new(&dev).unwrap();
                // A block cached on the stream; the pool keeps its pin between allocations.
                drop(DeviceBuffer::<u8>::zeroed(4096, &stream).unwrap());
                let other = DeviceBuffer::<u8>::zeroed_in(256, &stream, sync.clone()).unwrap();
                let start = Arc::new(Barrier::new(2));
                let worker = {
                    let start = start.clone();
                    std::thread::spawn(move || {
                        start.wait();
                        // A cache hit, then a request the cache cannot serve.
                        for bytes in [4096, (1 << 20) + usize::from(round) * 512] {
                            let mut b = DeviceBuffer::<u8>::zeroed(bytes, other.stream()).unwrap();
                            b.fill(round).unwrap();
                            assert!(b.to_vec().unwrap().iter().all(|&v| v == round), "round {round}");
                        }
                        drop(other);
                    })
                };
                start.wait();
                drop(stream);
                worker.join().unwrap();
                // The last handle may have gone on cudrv's thread (settling the stream's bank).
                cudrv::flush_deferred_drops().unwrap();
                assert_eq!(live_streams(), base, "round {round}: the stream outlived its buffers");
            }
            drop(sync);
            all_gone(&dev, base);
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
            release_everything(&dev);
            assert_no_leaks();
        },
    );
}

/// The per-thread stream: its owner makes users again (Weak upgrade) while other threads
/// free its last buffers, round after round. Every buffer reads its data back; nothing leaks.
#[test]
fn per_thread_users_race_buffer_frees() {
    run_with_fake(&POOL, || {
        crate::soundness::within(Duration::from_secs(120), "per-thread pins", || {
            let dev = Device::get(0).unwrap();
            let base = live_streams();
            for round in 0..30u32 {
                let s = Stream::per_thread(&dev).unwrap();
                let id = s.id();
                let bufs: Vec<DeviceBuffer<u32>> =
                    (0..3).map(|t| DeviceBuffer::from_slice(&[round * 10 + t; 300], &s).unwrap()).collect();
                drop(s); // only the pool's pin is left
                let start = Arc::new(Barrier::new(bufs.len() + 1));
                let workers: Vec<_> = bufs
                    .into_iter()
                    .enumerate()
                    .map(|(t, b)| {
                        let start = start.clone();
                        std::thread::spawn(move || {
                            start.wait();
                            assert!(b.to_vec().unwrap().iter().all(|&v| v == round * 10 + t as u32));
                            let c = b.stream().clone();
                            drop(b);
                            drop(c);
                        })
                    })
                    .collect();
                start.wait();
                for _ in 0..50 {
                    let again = Stream::per_thread(&dev).unwrap();
                    if again.id() == id {
                        // The same stream while a pin holds it: usable.
                        let x = DeviceBuffer::from_slice(&[round; 16], &again).unwrap();
                        drop(again);
                        assert_eq!(x.to_vec().unwrap(), vec![round; 16]);
                    }
                }
                for w in workers {
                    w.join().unwrap();
                }
            }
            all_gone(&dev, base);
        });
    });
}

/// The last user of a stream is dropped in a host function (its pin released there) while
/// other threads free the stream's buffers, and make buffers on their views.
#[test]
fn last_user_in_a_host_function_races_frees() {
    run_with_fake(&[POOL[0], POOL[1], ("CUDRV_FAKE_DELAY_US", "200")], || {
        crate::soundness::within(Duration::from_secs(120), "host-fn last user", || {
            let dev = Device::get(0).unwrap();
            let base = live_streams();
            let other = Stream::new(&dev).unwrap();
            for round in 0..20u32 {
                let s = Stream::new(&dev).unwrap();
                let bufs: Vec<DeviceBuffer<u32>> =
                    (0..3).map(|t| DeviceBuffer::from_slice(&[round + t; 500], &s).unwrap()).collect();
                let (go, wait) = mpsc::channel::<()>();
                other
                    .launch_host_fn(move || {
                        wait.recv().unwrap();
                        drop(s);
                    })
                    .unwrap();
                let workers: Vec<_> = bufs
                    .into_iter()
                    .enumerate()
                    .map(|(t, b)| {
                        std::thread::spawn(move || {
                            let more = DeviceBuffer::<u32>::zeroed(64, b.stream()).unwrap();
                            assert!(b.to_vec().unwrap().iter().all(|&v| v == round + t as u32));
                            drop(b);
                            assert_eq!(more.to_vec().unwrap(), vec![0; 64]);
                        })
                    })
                    .collect();
                go.send(()).unwrap();
                for w in workers {
                    w.join().unwrap();
                }
                other.synchronize().unwrap();
            }
            drop(other);
            all_gone(&dev, base);
        });
    });
}

/// A buffer of the device's pool allocated before a capture, used by it on another stream and
/// dropped while the graph lives, then every user of its stream goes: the stream goes once the
/// graph is released and the deferred free has run.
#[test]
fn buffer_used_by_a_capture_keeps_its_stream_until_the_graph_goes() {
    run_with_fake(&POOL, || {
        let dev = Device::get(0).unwrap();
        let base = live_streams();
        let a = Stream::new(&dev).unwrap();
        let c = Stream::new(&dev).unwrap();
        let src = DeviceBuffer::from_slice(&[9u32; 256], &a).unwrap();
        let mut dst = DeviceBuffer::<u32>::zeroed(256, &c).unwrap();
        c.begin_capture(CaptureMode::Global).unwrap();
        dst.copy_from(&src).unwrap(); // `src` used by the capture, on `c`
        let graph = c.end_capture().unwrap();
        let exec = graph.instantiate().unwrap();
        drop(src); // its free waits for the graph
        drop(a); // the Free's counted reference keeps `a`
        exec.launch(&c).unwrap();
        c.synchronize().unwrap();
        assert_eq!(dst.to_vec().unwrap(), vec![9; 256]);
        assert_eq!(live_streams(), base + 2);
        drop((exec, graph));
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_streams(), base + 1, "`a` goes with the graph's release");
        drop((dst, c));
        all_gone(&dev, base);
    });
}

/// The device's resource is switched while buffers of the old pool live on a stream without
/// users; new buffers on the view come from the new resource. Everything goes at the end.
#[test]
fn switching_the_device_resource_while_kept_buffers_live() {
    run_with_fake(&POOL, || {
        let dev = Device::get(0).unwrap();
        let base = live_streams();
        let s = Stream::new(&dev).unwrap();
        let old = DeviceBuffer::from_slice(&[1u32; 1000], &s).unwrap();
        drop(s);
        let mine = Arc::new(StreamOrderedPool::new(&dev).unwrap());
        dev.set_memory_resource(mine.clone(), "review").unwrap();
        let newer = DeviceBuffer::from_slice(&[2u32; 1000], old.stream()).unwrap();
        // The same pool through `uninit_in` too (a pin of its own), and a sync buffer.
        let given = DeviceBuffer::from_slice_in(&[3u32; 10], old.stream(), mine.clone()).unwrap();
        let sync =
            DeviceBuffer::from_slice_in(&[4u32; 10], old.stream(), Arc::new(SyncResource::new(&dev).unwrap())).unwrap();
        drop(old);
        assert_eq!(live_streams(), base + 1);
        assert_eq!(newer.to_vec().unwrap(), vec![2; 1000]);
        drop(newer);
        assert_eq!(given.to_vec().unwrap(), vec![3; 10]);
        drop(given);
        assert_eq!(live_streams(), base + 1, "the sync buffer keeps it");
        drop(sync);
        assert_eq!(live_streams(), base, "gone with the last buffer");
        cudrv::flush_deferred_drops().unwrap();
        mine.trim(0).unwrap();
    });
}

/// A pool that is not the device's is dropped while a raw allocation keeps a stream that has
/// no users: the pool's teardown lets go of the stream (the allocation is reported leaked).
#[test]
fn dropping_a_pool_with_a_live_raw_allocation() {
    run_with_fake(&[("CUDRV_FAKE_MODE", "tcc")], || {
        let dev = Device::get(0).unwrap();
        let base = live_streams();
        let pool = StreamOrderedPool::new(&dev).unwrap();
        let a = Stream::new(&dev).unwrap();
        let p = pool.allocate(1 << 16, &a).unwrap();
        let buf = DeviceBuffer::<u8>::zeroed(1 << 16, &a).unwrap();
        drop(a);
        assert_eq!(live_streams(), base + 1, "the buffer keeps the stream");
        drop(buf);
        assert_eq!(live_streams(), base, "a raw allocation does not keep its stream");
        drop(pool); // reports the raw allocation as leaked
        let _ = cudrv::flush_deferred_drops();
        assert_eq!(live_streams(), base);
        let _ = p;
    });
}

/// Raw allocations on one stream freed on another race the stream's last user and its
/// buffers' frees on several threads.
#[test]
fn raw_cross_stream_frees_race_the_last_user() {
    run_with_fake(&POOL, || {
        crate::soundness::within(Duration::from_secs(120), "raw cross-stream frees", || {
            let dev = Device::get(0).unwrap();
            let res = dev.memory_resource().unwrap();
            let base = live_streams();
            let b = Stream::new(&dev).unwrap();
            for round in 0..40usize {
                let a = Stream::new(&dev).unwrap();
                let raw: Vec<u64> = (0..4).map(|i| res.allocate(512 * (i + 1), &a).unwrap()).collect();
                let buf = DeviceBuffer::from_slice(&[round as u32; 64], &a).unwrap();
                let start = Arc::new(Barrier::new(3));
                let (r2, b2, s2) = (res.clone(), b.clone(), start.clone());
                let freer = std::thread::spawn(move || {
                    s2.wait();
                    for (i, p) in raw.into_iter().enumerate() {
                        // SAFETY: from `r2` with this size, unused.
                        unsafe { r2.deallocate(p, 512 * (i + 1), &b2) }.unwrap();
                    }
                });
                let s3 = start.clone();
                let dropper = std::thread::spawn(move || {
                    s3.wait();
                    assert_eq!(buf.to_vec().unwrap(), vec![round as u32; 64]);
                    drop(buf);
                });
                start.wait();
                drop(a);
                freer.join().unwrap();
                dropper.join().unwrap();
                assert_eq!(live_streams(), base + 1, "round {round}");
            }
            drop(b);
            release_everything(&dev);
            assert_eq!(live_streams(), base);
            assert_no_leaks();
        });
    });
}

/// The resources whose buffers pin their stream themselves (the owner thread's pins share one
/// counted reference, the bank), with the driver mode each needs.
const PINNING: &[(&str, &str)] = &[("driver-pool", "linux"), ("sync", "tcc")];

/// Runs `body` (within `limit`, as `what`) with each of `resources` (name and driver mode) as
/// the device's: `body` gets the resource's name, the device and the live streams before.
fn with_resources(resources: &[(&str, &str)], limit: u64, what: &str, body: impl Fn(&str, &Device, u64)) {
    for &(resource, mode) in resources {
        run_with_fake(&[("CUDRV_MEMORY_RESOURCE", resource), ("CUDRV_FAKE_MODE", mode)], || {
            if driver_pool_refused(resource) {
                return; // CUDA 11.1: no driver's pool (checked)
            }
            crate::soundness::within(Duration::from_secs(limit), what, || {
                let dev = Device::get(0).unwrap();
                body(resource, &dev, live_streams());
            });
        });
    }
}

/// The owner thread goes on allocating on a buffer's view of its stream while another thread
/// lets go of the stream's last user: each of its pins, counted without a read-modify-write,
/// either is seen by the other thread's look at the pins, or sees the users gone itself.
#[test]
fn the_owner_allocates_on_a_view_while_the_last_user_goes() {
    with_resources(PINNING, 120, "owner pins on a view", |resource, dev, base| {
        for round in 0..20u32 {
            let stream = Stream::new(dev).unwrap();
            let user = stream.clone();
            let start = Arc::new(Barrier::new(2));
            let owner = {
                let start = start.clone();
                let resource = resource.to_string();
                std::thread::spawn(move || {
                    // This thread owns the stream: it allocates on it first.
                    let keep = DeviceBuffer::from_slice(&[round; 100], &user).unwrap();
                    drop(user);
                    start.wait();
                    for i in 0..300u32 {
                        let mut b = DeviceBuffer::<u32>::zeroed(16 + i as usize % 7, keep.stream()).unwrap();
                        b.fill(i).unwrap();
                        assert!(b.to_vec().unwrap().iter().all(|&v| v == i), "{resource} round {round}");
                    }
                    assert_eq!(keep.to_vec().unwrap(), vec![round; 100]);
                })
            };
            start.wait();
            std::thread::sleep(Duration::from_micros(50 * u64::from(round % 5)));
            drop(stream);
            owner.join().unwrap();
            cudrv::flush_deferred_drops().unwrap();
            assert_eq!(live_streams(), base, "{resource} round {round}");
        }
        all_gone(dev, base);
    });
}

/// A `SyncResource` that runs `before` on each of its allocations and frees (true for a free)
/// before the work: a custom resource, whose calls cudrv makes under the stream's gate.
struct Hooked {
    inner: SyncResource,
    before: Box<dyn Fn(bool) + Send + Sync>,
}

impl Hooked {
    fn new(dev: &Device, before: impl Fn(bool) + Send + Sync + 'static) -> Arc<Hooked> {
        Arc::new(Hooked { inner: SyncResource::new(dev).unwrap(), before: Box::new(before) })
    }
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hooked")
    }
}

// SAFETY: forwards to a resource that keeps the contract.
unsafe impl MemoryResource for Hooked {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cudrv::Result<cudrv::memory::DevicePtr> {
        (self.before)(false);
        self.inner.allocate(bytes, stream)
    }
    unsafe fn deallocate(&self, ptr: cudrv::memory::DevicePtr, bytes: usize, stream: &Stream) -> cudrv::Result<()> {
        (self.before)(true);
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn kind(&self) -> cudrv::memory::ResourceKind {
        cudrv::memory::ResourceKind::Custom
    }
}

/// A custom resource whose free lets go of its stream's last user, then waits for cudrv's
/// deferred work: that runs under the stream's gate, on the owner thread, while the bank must be
/// let go. Neither this thread nor cudrv's waits for the gate (a deadlock in the first build of
/// owner pins, found in review), and the stream goes.
#[test]
fn the_last_user_dropped_under_the_streams_own_gate() {
    with_resources(PINNING, 60, "last user under the gate", |resource, dev, base| {
        let stream = Stream::new(dev).unwrap();
        let victim = std::sync::Mutex::new(Some(stream.clone()));
        let dropper = Hooked::new(dev, move |free| {
            if free {
                drop(victim.lock().unwrap().take());
                cudrv::flush_deferred_drops().unwrap();
            }
        });
        let device_buf = DeviceBuffer::from_slice(&[5u32; 64], &stream).unwrap();
        let custom = DeviceBuffer::from_slice_in(&[6u32; 64], &stream, dropper.clone()).unwrap();
        drop(stream);
        assert_eq!(device_buf.to_vec().unwrap(), vec![5; 64]);
        drop(device_buf);
        assert_eq!(custom.to_vec().unwrap(), vec![6; 64]);
        drop(custom); // the last user goes in its free
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_streams(), base, "{resource}");
        drop(dropper);
        all_gone(dev, base);
    });
}

/// A host function frees an owner pin's buffer after the stream's last user went: the pin is
/// let go on the host function's thread, and the stream goes.
#[test]
fn a_host_function_lets_go_of_an_owner_pin() {
    with_resources(PINNING, 60, "owner pins let go in host functions", |resource, dev, base| {
        let other = Stream::new(dev).unwrap();
        let stream = Stream::new(dev).unwrap();
        let buf = DeviceBuffer::from_slice(&[7u32; 1024], &stream).unwrap();
        let buf2 = DeviceBuffer::from_slice(&[8u32; 1024], &stream).unwrap();
        drop(stream);
        assert_eq!(live_streams(), base + 2, "{resource}: the buffers keep the stream");
        other.launch_host_fn(move || drop(buf)).unwrap();
        other.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_streams(), base + 2, "{resource}: the second buffer keeps it");
        assert_eq!(buf2.to_vec().unwrap(), vec![8; 1024]);
        other.launch_host_fn(move || drop(buf2)).unwrap();
        other.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_streams(), base + 1, "{resource}: only `other` is left");
        drop(other);
        all_gone(dev, base);
    });
}

/// A host function lets go of an owner pin after the stream's users went (its thread hands the
/// settling of the bank to cudrv's thread), while a custom resource's `allocate` on the stream
/// waits, under the stream's gate, for cudrv's deferred work. Nothing waits for ever (found in
/// review), and the stream goes.
#[test]
fn deferred_work_does_not_wait_for_a_gate_whose_holder_waits_for_it() {
    with_resources(PINNING, 60, "deferred work against a gate's holder", |resource, dev, base| {
        let other = Stream::new(dev).unwrap();
        let stream = Stream::new(dev).unwrap();
        let (go_tx, go_rx) = mpsc::channel();
        let (inside_tx, inside_rx) = mpsc::channel::<()>();
        let wait = std::sync::Mutex::new(Some((inside_tx, go_rx)));
        let flusher = Hooked::new(dev, move |free| {
            if let Some((inside, go)) = wait.lock().unwrap().take().filter(|_| !free) {
                inside.send(()).unwrap();
                go.recv().unwrap();
                cudrv::flush_deferred_drops().unwrap();
            }
        });
        let a = DeviceBuffer::from_slice(&[1u32; 64], &stream).unwrap();
        let b = DeviceBuffer::from_slice(&[2u32; 64], &stream).unwrap();
        drop(stream);
        // Once the allocation below holds the stream's gate, a host function lets go of `a`.
        other
            .launch_host_fn(move || {
                inside_rx.recv().unwrap();
                drop(a);
                std::thread::sleep(Duration::from_millis(20));
                go_tx.send(()).unwrap();
            })
            .unwrap();
        let c = DeviceBuffer::<u32>::zeroed_in(64, b.stream(), flusher.clone()).unwrap();
        assert_eq!(c.to_vec().unwrap(), vec![0; 64], "{resource}");
        drop(c);
        assert_eq!(b.to_vec().unwrap(), vec![2; 64], "{resource}");
        drop(b);
        other.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_streams(), base + 1, "{resource}: only `other` is left");
        drop((other, flusher));
        all_gone(dev, base);
    });
}

/// A custom resource whose `deallocate` waits for cudrv's deferred work, for a buffer dropped in
/// a host function: the free runs on cudrv's own thread, where the wait returns at once instead
/// of waiting for that thread itself (found in review: every later deferred drop hung).
#[test]
fn flushing_deferred_drops_on_cudrvs_own_thread_returns() {
    with_resources(PINNING, 60, "a flush on cudrv's thread", |resource, dev, base| {
        let stream = Stream::new(dev).unwrap();
        let flushed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = flushed.clone();
        let flusher = Hooked::new(dev, move |free| {
            if free {
                cudrv::flush_deferred_drops().unwrap();
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let in_host_fn = DeviceBuffer::from_slice_in(&[3u32; 64], &stream, flusher.clone()).unwrap();
        let later = DeviceBuffer::from_slice(&[4u32; 64], &stream).unwrap();
        stream.launch_host_fn(move || drop(in_host_fn)).unwrap();
        stream.synchronize().unwrap();
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(flushed.load(std::sync::atomic::Ordering::SeqCst), 1, "{resource}: freed on cudrv's thread");
        // cudrv's thread still serves later drops.
        stream.launch_host_fn(move || drop(later)).unwrap();
        stream.synchronize().unwrap();
        drop(stream);
        cudrv::flush_deferred_drops().unwrap();
        assert_eq!(live_streams(), base, "{resource}: the stream went with its last buffer");
        drop(flusher);
        all_gone(dev, base);
    });
}

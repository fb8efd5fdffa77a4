//! Review 28c: an adversarial review of how a `DeviceBuffer` refers to its stream (`StreamPin`:
//! the pool's "kept" allocations, whose cache pins the stream, and the owner pins of other
//! resources' buffers), of a stream's last user going (`Handle`'s drop, `users_gone`, the bank),
//! of parked streams revived by frees and per-thread streams made again, and of the pool's
//! retirement of a stream's cache, for a path from safe code where a buffer uses or frees its
//! memory on a stream that was destroyed (or whose handle names another stream now), or whose pin
//! was given up while the buffer still refers to it.
//!
//! Every test runs on the emulated Linux and TCC drivers, with the device's resource chosen by
//! `CUDRV_MEMORY_RESOURCE` (`pool`: cudrv's `StreamOrderedPool`, whose buffers hold an uncounted
//! view of their stream; `sync`; `driver-pool`, Linux only: their buffers hold pins of their own,
//! owner pins on the stream's owner thread), with delayed stream work. A test fails on a violation
//! of the emulated driver (queued work touching freed memory, as `cuMemFree` and `cuMemUnmap` do
//! not wait), on any error a `Drop` met (a destroyed stream's handle is `CUDA_ERROR_INVALID_HANDLE`
//! there), on a buffer whose `stream()` became another stream (a view left dangling, its handle's
//! memory reused by a newer stream), on data that changed behind a buffer (a block handed out while
//! an old kernel still writes it), and on an allocation left at the end.
//!
//! Covered (all found sound unless said otherwise):
//! - a buffer outliving its stream: the `Stream` dropped first (on the thread that made it, which
//!   then exits, for a new stream and for that thread's per-thread stream), other streams made and
//!   destroyed meanwhile (the driver may reuse the handle), then the buffer checked, written with a
//!   memset and a kernel, and dropped on the main thread, on another thread, or in a host function
//!   of another stream, with its last kernel still running:
//!   `a_buffer_outlives_its_stream_and_is_dropped_anywhere`, found sound;
//! - per-thread streams made again every round by their thread (`Stream::per_thread`, a new
//!   `Handle` once the last went) while another thread uses and drops the buffers of the earlier
//!   rounds (where the legacy stream stands in), and drops the stream's last user half of the
//!   time: `per_thread_streams_revived_while_another_thread_drops_their_buffers`, found sound;
//! - the last user of a stream going on one thread while another thread allocates and frees
//!   buffers on a buffer's view of it (the pool's cache pins and lets go on each), a third makes
//!   and drops users from that view again and again (`users_gone` each time), and a fourth drops
//!   buffers of it (the owner's pins let go elsewhere), half of them in host functions:
//!   `the_last_user_races_allocations_on_a_view_and_revived_users`, found sound;
//! - a buffer used on a second stream, dropped while a blocking stream captures, on a per-thread
//!   stream of another thread whose last user went just before: its free parks the stream and
//!   waits for the capture (the legacy stream stands in), as does the pool's retirement of the
//!   stream's cache; the free revives the stream (`ParkedStream::revive`, a new handle and a new
//!   cache) before or after that retirement, while the stream's thread makes it again and writes
//!   buffers on it: `a_parked_stream_revived_by_a_free_around_its_deferred_retirement`, found sound;
//! - a buffer of a per-thread stream used by a captured graph, the stream's last user gone before
//!   the graph's launch, then the buffer (and the executable graph, in either order) dropped with
//!   the launch in flight, and the stream made again at once, allocating the same size: the free
//!   waits for the launch (`GraphUse`, `after_launches`) before the block returns to the stream's
//!   cache: `a_buffer_used_by_a_graph_outlives_its_stream`, found sound.
//!
//! Not found: a path from safe code that moves a kept allocation to another cache (only raw,
//! `unsafe` frees on another stream reach `deallocate_elsewhere` with one; a buffer's own free
//! with uses elsewhere unkeeps first, under a user of its stream), nor one that retires a cache
//! while it holds a kept allocation (its pin keeps the stream's `Handle`, whose drop is what
//! retires the cache; only a dropped pool's teardown takes caches off, and the device's pool is
//! never dropped).

use std::sync::Mutex;
use std::sync::mpsc;
use std::time::Duration;

use cudrv::graph::CaptureMode;
use cudrv::memory::DeviceBuffer;
use cudrv::{Device, Function, LaunchConfig, Module, Stream};
use cudrv_test_support::run_with_fake_modes;

use crate::soundness::within;

const PTX: &str = include_str!("../../examples/kernels/vector_add.ptx");
const LIMIT: Duration = Duration::from_secs(60);
/// Elements (u32) of the tests' buffers.
const N: usize = 1 << 14;

/// The device resources every test runs with, and the emulated drivers for each.
const RESOURCES: [(&[&str], &str); 3] =
    [(&["linux", "tcc"], "pool"), (&["linux", "tcc"], "sync"), (&["linux"], "driver-pool")];

/// Errors that cudrv's drops met in this (child) process.
static DROP_ERRORS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn note_drop_error(e: &cudrv::Error) {
    DROP_ERRORS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(e.to_string());
}

/// Runs `body` on each resource of [`RESOURCES`] (each in a child process per emulated driver),
/// with `delay_us` before each stream operation, then checks that no drop met an error and no
/// allocation is left.
fn each_resource(delay_us: &str, what: &str, body: impl Fn() + Copy) {
    for (modes, resource) in RESOURCES {
        run_with_fake_modes(modes, &[("CUDRV_MEMORY_RESOURCE", resource), ("CUDRV_FAKE_DELAY_US", delay_us)], || {
            if crate::driver_pool_refused(resource) {
                return;
            }
            assert!(cudrv::set_drop_error_hook(note_drop_error));
            within(LIMIT, what, body);
            finish();
        });
    }
}

/// Settles cudrv's deferred work and the device's resource, and checks that no drop met an
/// error and no allocation is left. The context's work is waited for first: a host function
/// queued on a stream that was dropped meanwhile (its work still runs) may not have run yet, and
/// the buffer it drops would still be live (a CI run met that: a small chunk "leaked", with that
/// stream and the pool's events).
fn finish() {
    let dev = Device::get(0).unwrap();
    dev.primary_context().unwrap().synchronize().expect("the context's work, and errors kept from drops");
    cudrv::flush_deferred_drops().unwrap();
    dev.memory_resource().unwrap().trim(0).unwrap();
    cudrv::flush_deferred_drops().unwrap();
    let s = Stream::new(&dev).unwrap();
    s.synchronize().unwrap();
    drop(s);
    let errors = DROP_ERRORS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    assert!(errors.is_empty(), "cudrv's drops met {} error(s):\n  {}", errors.len(), errors.join("\n  "));
    crate::assert_no_leaks_but_streams();
}

/// Checks that `got` holds `want` everywhere.
#[track_caller]
fn check(got: &[u32], want: u32, what: &str) {
    let bad = got.iter().filter(|&&v| v != want).count();
    assert_eq!(
        bad,
        0,
        "{what}: {bad} of {} words are not {want:#x}: first {:#x}",
        got.len(),
        got.iter().find(|&&v| v != want).copied().unwrap_or(0)
    );
}

/// Writes `value` into `buf` with a kernel on `stream`, spinning `spin_us` first.
fn spin_fill(spin: &Function, stream: &Stream, buf: &mut DeviceBuffer<u32>, value: u32, spin_us: u64) {
    let n = buf.len();
    // SAFETY: spin_fill_u32 writes buf[0..n].
    unsafe { spin.launch(LaunchConfig::for_num_elems(n), stream, (buf, value, n as u64, spin_us)) }.unwrap();
}

/// Buffers on streams made for them, each written with a kernel, read back after stale kernels
/// had time to land: none may have changed behind them (a block handed out while an earlier
/// buffer's kernel still wrote it).
fn fresh_buffers_stay_theirs(dev: &Device, fill: &Function, tag: u32) {
    let mut made = Vec::new();
    for i in 0..6u32 {
        let s = Stream::new(dev).unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed(N, &s).unwrap();
        let value = 0x5000_0000 | (tag << 8) | i;
        // SAFETY: fill_u32 writes b[0..N].
        unsafe { fill.launch(LaunchConfig::for_num_elems(N), &s, (&mut b, value, N as u64)) }.unwrap();
        made.push((s, b, value));
    }
    std::thread::sleep(Duration::from_millis(60));
    for (s, b, value) in made {
        check(&b.to_vec().unwrap(), value, "a fresh buffer");
        drop(b);
        drop(s);
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    New,
    PerThread,
}

#[derive(Clone, Copy, Debug)]
enum DropOn {
    Main,
    OtherThread,
    HostFn,
}

/// Buffers whose `Stream` was dropped first, on the thread that made it (which then exits): other
/// streams are made and destroyed meanwhile (the driver may give a new stream the old handle, or
/// a new `Handle` the old one's memory). Each buffer must still name its stream (`stream().id()`),
/// hold its data, take a memset and a kernel (on a user made from its view), and be freed after
/// that kernel, dropped on the main thread, on another thread, or in a host function of another
/// stream: no driver error, no violation, and no fresh buffer written behind its back.
#[test]
fn a_buffer_outlives_its_stream_and_is_dropped_anywhere() {
    each_resource("20", "a buffer outliving its stream", || {
        for kind in [Kind::New, Kind::PerThread] {
            for drop_on in [DropOn::Main, DropOn::OtherThread, DropOn::HostFn] {
                outlive(kind, drop_on);
            }
        }
    });
}

fn outlive(kind: Kind, drop_on: DropOn) {
    let dev = Device::get(0).unwrap();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let (mut bufs, id) = std::thread::scope(|t| {
        t.spawn(|| {
            let s = match kind {
                Kind::New => Stream::new(&dev),
                Kind::PerThread => Stream::per_thread(&dev),
            }
            .unwrap();
            let id = s.id();
            let bufs: Vec<DeviceBuffer<u32>> = (0..4u32)
                .map(|i| {
                    let mut b = DeviceBuffer::<u32>::zeroed(N, &s).unwrap();
                    spin_fill(&spin, &s, &mut b, 0xA000_0000 | i, 5_000);
                    b
                })
                .collect();
            drop(s);
            (bufs, id)
        })
        .join()
        .unwrap()
    });
    // New streams take the driver's handles and the memory of `Handle`s that went.
    let churn: Vec<Stream> = (0..8).map(|_| Stream::new(&dev).unwrap()).collect();
    for s in &churn {
        drop(DeviceBuffer::<u32>::zeroed(64, s).unwrap());
    }
    drop(churn);
    let more: Vec<Stream> = (0..4).map(|_| Stream::new(&dev).unwrap()).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        let i = i as u32;
        assert_eq!(b.stream().id(), id, "{kind:?}: buffer {i} names another stream now");
        check(&b.to_vec().unwrap(), 0xA000_0000 | i, "a buffer whose stream was dropped");
        b.fill(0xB000_0000 | i).unwrap();
        check(&b.to_vec().unwrap(), 0xB000_0000 | i, "a memset after the stream's drop");
        let user = b.stream().clone();
        spin_fill(&spin, &user, b, 0xC000_0000 | i, 30_000);
        drop(user);
    }
    match drop_on {
        DropOn::Main => drop(bufs),
        DropOn::OtherThread => std::thread::spawn(move || drop(bufs)).join().unwrap(),
        DropOn::HostFn => {
            let x = Stream::new(&dev).unwrap();
            x.launch_host_fn(move || drop(bufs)).unwrap();
            drop(x);
        }
    }
    drop(more);
    fresh_buffers_stay_theirs(&dev, &fill, 1);
    cudrv::flush_deferred_drops().unwrap();
}

/// A thread makes its per-thread stream again every round (a new `Handle` once the last user of
/// the previous went), allocates and writes buffers on it, and hands them (and half of the time
/// the stream's user) to another thread, which checks them, writes them with a kernel (on the
/// legacy stream, which stands in there), and drops them there or in a host function, while the
/// first thread goes on with the next round.
#[test]
fn per_thread_streams_revived_while_another_thread_drops_their_buffers() {
    each_resource("10", "per-thread streams revived", per_thread_revived);
}

fn per_thread_revived() {
    const ROUNDS: u32 = 12;
    let dev = Device::get(0).unwrap();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let (tx, rx) = mpsc::channel::<(u32, u64, Option<Stream>, Vec<DeviceBuffer<u32>>)>();
    std::thread::scope(|t| {
        let (dev, spin, fill) = (&dev, &spin, &fill);
        t.spawn(move || {
            let mut id = None;
            for round in 0..ROUNDS {
                let p = Stream::per_thread(dev).unwrap();
                assert_eq!(*id.get_or_insert(p.id()), p.id(), "a per-thread stream is one stream");
                let bufs: Vec<DeviceBuffer<u32>> = (0..3u32)
                    .map(|i| {
                        let mut b = DeviceBuffer::<u32>::zeroed(N << (i % 2), &p).unwrap();
                        spin_fill(spin, &p, &mut b, (round << 8) | i, 2_000);
                        b
                    })
                    .collect();
                // A buffer of this round that stays here until the next round's are written.
                let mut mine = DeviceBuffer::<u32>::zeroed(N, &p).unwrap();
                spin_fill(spin, &p, &mut mine, 0xE000_0000 | round, 1_000);
                let user = (round % 2 == 0).then(|| p.clone());
                tx.send((round, p.id(), user, bufs)).unwrap();
                drop(p);
                std::thread::sleep(Duration::from_millis(u64::from(round % 3)));
                let again = Stream::per_thread(dev).unwrap();
                let mut next = DeviceBuffer::<u32>::zeroed(N, &again).unwrap();
                // SAFETY: fill_u32 writes next[0..N].
                unsafe {
                    fill.launch(LaunchConfig::for_num_elems(N), &again, (&mut next, 0xF000_0000 | round, N as u64))
                }
                .unwrap();
                check(&mine.to_vec().unwrap(), 0xE000_0000 | round, "the per-thread stream's own buffer");
                check(&next.to_vec().unwrap(), 0xF000_0000 | round, "a buffer of the stream made again");
                drop((mine, next, again));
            }
        });
        for (round, id, user, bufs) in rx {
            let x = Stream::new(dev).unwrap();
            for (i, mut b) in bufs.into_iter().enumerate() {
                let i = i as u32;
                assert_eq!(b.stream().id(), id, "round {round}: buffer {i} names another stream");
                check(&b.to_vec().unwrap(), (round << 8) | i, "a per-thread stream's buffer on another thread");
                let u = b.stream().clone();
                spin_fill(spin, &u, &mut b, 0xD000_0000 | round, 3_000);
                drop(u);
                match (round + i) % 3 {
                    0 => drop(b),
                    1 => x.launch_host_fn(move || drop(b)).unwrap(),
                    _ => {
                        // Used on `x` too: its free waits for `x`.
                        spin_fill(spin, &x, &mut b, 0xD100_0000 | round, 1_000);
                        drop(b);
                    }
                }
            }
            drop(user);
            drop(x);
        }
    });
    fresh_buffers_stay_theirs(&dev, &fill, 2);
}

/// The last user of a stream goes (on the main thread) while: a thread that holds a buffer of it
/// allocates, writes and frees buffers on that buffer's view of the stream (a kept allocation pins
/// the stream in the pool's cache, and its free lets the pin go once the users are gone; other
/// resources take the owner's pins, or counted ones once the users are gone); another thread makes
/// users from the view and drops them again and again (`users_gone` at each last one); a third
/// drops buffers the first made (owner pins let go elsewhere), half of them in host functions of
/// another stream. The stream must stay valid (no driver error) and be the buffers' own until the
/// last goes.
#[test]
fn the_last_user_races_allocations_on_a_view_and_revived_users() {
    each_resource("0", "the last user against a view's allocations", || {
        for round in 0..40u32 {
            last_user_race(round);
        }
    });
}

fn last_user_race(round: u32) {
    let dev = Device::get(0).unwrap();
    let (anchor_tx, anchor_rx) = mpsc::channel::<(Stream, u64)>();
    let (far_tx, far_rx) = mpsc::channel::<DeviceBuffer<u32>>();
    let go = std::sync::Barrier::new(4);
    std::thread::scope(|t| {
        let go = &go;
        let dev = &dev;
        let owner = t.spawn(move || {
            // The stream's owner: the first thread in its gate.
            let s = Stream::new(dev).unwrap();
            let id = s.id();
            let mut anchor = DeviceBuffer::<u32>::zeroed(N, &s).unwrap();
            anchor.fill(round).unwrap();
            anchor_tx.send((s, id)).unwrap();
            let anchor = anchor;
            std::thread::scope(|t2| {
                let anchor = &anchor;
                t2.spawn(move || {
                    go.wait();
                    for _ in 0..40 {
                        let u = anchor.stream().clone();
                        std::hint::black_box(&u);
                        drop(u);
                    }
                });
                go.wait();
                for k in 0..40u32 {
                    let v = anchor.stream();
                    assert_eq!(v.id(), id, "round {round}: the buffer's stream changed");
                    let mut b = DeviceBuffer::<u32>::zeroed(256 << (k % 3), v).unwrap();
                    b.fill(k).unwrap();
                    if k % 4 == 0 {
                        far_tx.send(b).unwrap();
                    } else if k % 7 == 0 {
                        check(&b.to_vec().unwrap(), k, "a buffer made on a view");
                    } else {
                        drop(b);
                    }
                }
            });
            drop(far_tx);
            check(&anchor.to_vec().unwrap(), round, "the anchor");
            assert_eq!(anchor.stream().id(), id);
            drop(anchor);
        });
        let (s, _id) = anchor_rx.recv().unwrap();
        let far = t.spawn(move || {
            let x = Stream::new(dev).unwrap();
            go.wait();
            for (k, b) in far_rx.into_iter().enumerate() {
                if k % 2 == 0 {
                    drop(b);
                } else {
                    // Dropped on a driver thread; its free (and any pin let go) on cudrv's.
                    x.launch_host_fn(move || drop(b)).unwrap();
                }
            }
            drop(x);
        });
        go.wait();
        if round % 2 == 1 {
            std::thread::yield_now();
        }
        drop(s);
        owner.join().unwrap();
        far.join().unwrap();
    });
}

/// A per-thread stream's buffer, used on a second stream, is dropped on another thread while a
/// blocking stream captures, just after the stream's last user went there: the pool retires the
/// stream's cache once the capture ends (the legacy stream stands in for the stream there, and
/// the capture holds it), and the buffer's free, which parked the stream, waits for it too; it
/// revives the stream (a new `Handle`, and in the pool a new cache of the same stream) before or
/// after that retirement. Meanwhile the stream's thread makes it again and writes buffers on it,
/// checked after a new stream's block was freed while its kernel still ran.
#[test]
fn a_parked_stream_revived_by_a_free_around_its_deferred_retirement() {
    each_resource("0", "a parked stream revived around its retirement", || {
        for host_fn in [false, true] {
            parked_revived(host_fn);
        }
    });
}

fn parked_revived(in_host_fn: bool) {
    let dev = Device::get(0).unwrap();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let (to_main, from_t) = mpsc::channel::<(Stream, Stream, DeviceBuffer<u32>)>();
    let (to_t, from_main) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let (dev, fill, spin) = (&dev, &fill, &spin);
        let t = scope.spawn(move || {
            let p = Stream::per_thread(dev).unwrap();
            let x = Stream::new(dev).unwrap();
            let mut b = DeviceBuffer::<u32>::zeroed(N, &p).unwrap();
            spin_fill(spin, &p, &mut b, 0x1111_1111, 2_000);
            x.wait_stream(&p).unwrap();
            // Used on `x`: its free waits for `x`, and parks the streams.
            spin_fill(spin, &x, &mut b, 0x2222_2222, 20_000);
            let mut keep = DeviceBuffer::<u32>::zeroed(N, &p).unwrap();
            spin_fill(spin, &p, &mut keep, 0x3333_3333, 1_000);
            to_main.send((p, x, b)).unwrap();
            from_main.recv().unwrap();
            // The capture is on; the stream's last user went on the main thread, and the buffer
            // was dropped: make the stream again, and write on it.
            let p = Stream::per_thread(dev).unwrap();
            let mut ys: Vec<DeviceBuffer<u32>> = Vec::new();
            for i in 0..4u32 {
                let mut y = DeviceBuffer::<u32>::zeroed(N, &p).unwrap();
                // SAFETY: fill_u32 writes y[0..N].
                unsafe { fill.launch(LaunchConfig::for_num_elems(N), &p, (&mut y, 0x4444_0000 | i, N as u64)) }
                    .unwrap();
                ys.push(y);
            }
            done_rx.recv().unwrap();
            // After the capture's end and the retirement; a new stream freed a block while its
            // kernel ran.
            for i in 0..4u32 {
                let mut y = DeviceBuffer::<u32>::zeroed(N, &p).unwrap();
                // SAFETY: as above.
                unsafe { fill.launch(LaunchConfig::for_num_elems(N), &p, (&mut y, 0x5555_0000 | i, N as u64)) }
                    .unwrap();
                ys.push(y);
            }
            std::thread::sleep(Duration::from_millis(60));
            for (i, y) in ys.iter().enumerate() {
                let want = if i < 4 { 0x4444_0000 } else { 0x5555_0000 } | (i as u32 % 4);
                check(&y.to_vec().unwrap(), want, "a buffer of the per-thread stream made again");
            }
            check(&keep.to_vec().unwrap(), 0x3333_3333, "the per-thread stream's first buffer");
        });
        let q = Stream::per_thread(dev).unwrap();
        let (p, x, b) = from_t.recv().unwrap();
        q.begin_capture(CaptureMode::Relaxed).unwrap();
        // Here the per-thread stream stands for the legacy stream, which the capture holds.
        drop(p);
        if in_host_fn {
            x.launch_host_fn(move || drop(b)).unwrap();
        } else {
            drop(b);
        }
        to_t.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        drop(q.end_capture().unwrap());
        cudrv::flush_deferred_drops().unwrap();
        let r = Stream::new(dev).unwrap();
        let mut z = DeviceBuffer::<u32>::zeroed(N, &r).unwrap();
        spin_fill(spin, &r, &mut z, 0x6666_6666, 40_000);
        drop(z);
        done_tx.send(()).unwrap();
        t.join().unwrap();
        r.synchronize().unwrap();
        drop((r, x));
    });
    fresh_buffers_stay_theirs(&dev, &fill, 3);
    cudrv::flush_deferred_drops().unwrap();
}

/// A buffer of a per-thread stream used by a captured graph (allocated before the capture, on
/// another stream), whose stream's last user goes before the graph is launched on a third stream
/// and the buffer is dropped: its free waits for the graph's launch (and revives the parked
/// stream), and the stream made again by its thread allocates at once the same size and writes
/// it. A block handed back to the stream's cache before the graph's kernel is done would be
/// written by both.
#[test]
fn a_buffer_used_by_a_graph_outlives_its_stream() {
    each_resource("0", "a graph's buffer outliving its stream", || {
        for drop_exec_first in [false, true] {
            graph_buffer_outlives(drop_exec_first);
        }
    });
}

fn graph_buffer_outlives(drop_exec_first: bool) {
    let dev = Device::get(0).unwrap();
    let module = Module::from_ptx(&dev, PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    let spin = module.function("spin_fill_u32").unwrap();
    let s = Stream::per_thread(&dev).unwrap();
    let mut b = DeviceBuffer::<u32>::zeroed(N, &s).unwrap();
    b.fill(1).unwrap();
    s.synchronize().unwrap();
    let c = Stream::new(&dev).unwrap();
    c.begin_capture(CaptureMode::ThreadLocal).unwrap();
    spin_fill(&spin, &c, &mut b, 0x7777_7777, 40_000);
    let exec = c.end_capture().unwrap().instantiate().unwrap();
    drop(s);
    let l = Stream::new(&dev).unwrap();
    exec.launch(&l).unwrap();
    if drop_exec_first {
        drop(exec);
        drop(b);
    } else {
        drop(b);
        drop(exec);
    }
    let s = Stream::per_thread(&dev).unwrap();
    let mut ys = Vec::new();
    for i in 0..3u32 {
        let mut y = DeviceBuffer::<u32>::zeroed(N, &s).unwrap();
        // SAFETY: fill_u32 writes y[0..N].
        unsafe { fill.launch(LaunchConfig::for_num_elems(N), &s, (&mut y, 0x8888_0000 | i, N as u64)) }.unwrap();
        ys.push(y);
    }
    std::thread::sleep(Duration::from_millis(70));
    for (i, y) in ys.iter().enumerate() {
        check(&y.to_vec().unwrap(), 0x8888_0000 | i as u32, "a buffer of the stream made again");
    }
    drop(ys);
    l.synchronize().unwrap();
    drop((s, c, l));
    fresh_buffers_stay_theirs(&dev, &fill, 4);
    cudrv::flush_deferred_drops().unwrap();
}

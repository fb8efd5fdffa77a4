//! Copy benchmark: cudrv's copies against the raw driver's, in one run.
//!
//! ```text
//! cargo bench --features gpu --bench copies
//! ```
//!
//! 1 GiB host-to-device and device-to-host, from pinned and from pageable host memory, and
//! device-to-device: GB/s (median of rounds, each timed with host clocks around a synchronised
//! copy) for raw `cuMemcpy*Async` + `cuStreamSynchronize` and for cudrv's `DeviceBuffer` copies.
//! Then small synchronous copies with pageable host memory (64 B and 4 KiB): µs per copy, the
//! median of rounds of 500, raw against cudrv's `copy_to_host` / `copy_from_host`, which add the
//! gate, a question whether the stream is idle, and a wait for an event instead of the stream.
//! In both tables the raw side's rounds and cudrv's alternate. Without a driver it prints the
//! error and exits 0.

use std::time::Instant;

use cudrv::memory::{DeviceBuffer, PinnedBuffer};
use cudrv::sys::{CUcontext, CUresult, Driver};
use cudrv::{Device, Stream};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const BYTES: usize = 1 << 30;
const ROUNDS: usize = 9;
/// Copies per round of the small-copy table, and its rounds (each side alternately).
const SMALL_REPS: u32 = 500;
const SMALL_ROUNDS: usize = 15;

fn main() {
    if let Err(e) = run() {
        eprintln!("copies bench: {e}");
    }
}

fn ok(rc: Result<CUresult, cudrv::sys::MissingSymbol>) -> Res<()> {
    match rc? {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(format!("driver call failed with {}", code.0).into()),
    }
}

/// GB/s of a 1 GiB copy by `raw` and by `ours`: see [`alternating`].
fn gbps(raw: impl FnMut() -> Res<()>, ours: impl FnMut() -> Res<()>) -> Res<(f64, f64)> {
    alternating(ROUNDS, raw, ours, |f| {
        let t = Instant::now();
        f()?;
        Ok(BYTES as f64 / t.elapsed().as_secs_f64() / 1e9)
    })
}

/// µs per call of `raw` and of `ours`, timed over rounds of [`SMALL_REPS`] calls: see
/// [`alternating`].
fn small_latency(raw: impl FnMut() -> Res<()>, ours: impl FnMut() -> Res<()>) -> Res<(f64, f64)> {
    alternating(SMALL_ROUNDS, raw, ours, |f| {
        let t = Instant::now();
        for _ in 0..SMALL_REPS {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / f64::from(SMALL_REPS))
    })
}

/// The medians of what `round` measures (one round of a side: a figure for that round) over
/// `rounds` rounds of `raw` and of `ours`, the two alternating round by round after a warm-up
/// round each, so that what drifts during the run (clocks, the host's memory) moves both alike.
fn alternating(
    rounds: usize,
    mut raw: impl FnMut() -> Res<()>,
    mut ours: impl FnMut() -> Res<()>,
    round: impl Fn(&mut dyn FnMut() -> Res<()>) -> Res<f64>,
) -> Res<(f64, f64)> {
    round(&mut raw)?;
    round(&mut ours)?;
    let (mut r, mut o) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..rounds {
        r.push(round(&mut raw)?);
        o.push(round(&mut ours)?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(r), median(o)))
}

/// [`gbps`] of a peer copy from `src` to `dst` (each with its context), queued on `s`: raw
/// `cuMemcpyPeerAsync` against `DeviceBuffer::copy_to_peer`.
fn peer_gbps(
    d: &Driver,
    s: &Stream,
    (src, src_ctx): (&DeviceBuffer<u8>, CUcontext),
    (dst, dst_ctx): (&mut DeviceBuffer<u8>, CUcontext),
) -> Res<(f64, f64)> {
    let (ps, pd, raw_s) = (src.as_raw(), dst.as_raw(), s.as_raw());
    gbps(
        // SAFETY: live buffers of BYTES bytes each; every copy is waited for before the next one.
        || {
            ok(unsafe { d.cuMemcpyPeerAsync(pd, dst_ctx, ps, src_ctx, BYTES, raw_s) })?;
            Ok(s.synchronize()?)
        },
        || {
            src.copy_to_peer(dst, s)?;
            Ok(s.synchronize()?)
        },
    )
}

/// The small-copy table: synchronous copies of `bytes` bytes between a `DeviceBuffer` and
/// pageable host memory, raw (`cuMemcpy*Async` + `cuStreamSynchronize`) and through cudrv.
fn small_copies(d: &Driver, s: &Stream) -> Res<()> {
    println!("\n| small copy (pageable) | raw driver µs | cudrv µs | cudrv / raw |\n|---|---|---|---|");
    for bytes in [64usize, 4096] {
        let mut buf = DeviceBuffer::<u8>::zeroed(bytes, s)?;
        let mut host = vec![3u8; bytes];
        let (p, hs, raw_s) = (buf.as_raw(), host.as_mut_ptr(), s.as_raw());
        // SAFETY (raw closures): a live device buffer and host memory of `bytes` bytes; every copy
        // is waited for before the next one and before the memory is touched again.
        let wait = || ok(unsafe { d.cuStreamSynchronize(raw_s) });
        let (raw, ours) = small_latency(
            || {
                ok(unsafe { d.cuMemcpyDtoHAsync_v2(hs.cast(), p, bytes, raw_s) })?;
                wait()
            },
            || Ok(buf.copy_to_host(unsafe { std::slice::from_raw_parts_mut(hs, bytes) })?),
        )?;
        println!("| D2H {bytes} B | {raw:.2} | {ours:.2} | {:.3}x |", ours / raw);
        let (raw, ours) = small_latency(
            || {
                ok(unsafe { d.cuMemcpyHtoDAsync_v2(p, hs.cast(), bytes, raw_s) })?;
                wait()
            },
            || Ok(buf.copy_from_host(unsafe { std::slice::from_raw_parts(hs, bytes) })?),
        )?;
        println!("| H2D {bytes} B | {raw:.2} | {ours:.2} | {:.3}x |", ours / raw);
        drop(host);
    }
    Ok(())
}

fn run() -> Res<()> {
    let dev = Device::get(0)?;
    let ctx = dev.primary_context()?;
    let _b = ctx.bind()?;
    let d = Driver::global()?;
    println!("# copies bench: {}, driver {}, 1 GiB per copy, median of {ROUNDS}", dev.name()?, d.version());
    let s = Stream::new(&dev)?;
    let raw_s = s.as_raw();
    let mut dev_a = DeviceBuffer::<u8>::zeroed(BYTES, &s)?;
    let dev_b = DeviceBuffer::<u8>::zeroed(BYTES, &s)?;
    let mut pinned = PinnedBuffer::<u8>::new(&dev, BYTES)?;
    pinned.as_mut_slice()?.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let mut pageable = vec![7u8; BYTES];
    let (pa, pb) = (dev_a.as_raw(), dev_b.as_raw());
    let pin_ptr = pinned.as_mut_slice()?.as_mut_ptr();
    let sync = |s: &Stream| -> Res<()> { Ok(s.synchronize()?) };

    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    // SAFETY (raw closures): live device buffers and host memory of BYTES bytes each; every copy is
    // waited for before the next one and before the memory is touched again.
    let (raw, ours) = gbps(
        || {
            ok(unsafe { d.cuMemcpyHtoDAsync_v2(pa, pin_ptr.cast(), BYTES, raw_s) })?;
            sync(&s)
        },
        || {
            dev_a.copy_from_pinned_async(&pinned)?;
            pinned.wait()?;
            Ok(())
        },
    )?;
    rows.push(("H2D pinned".into(), raw, ours));
    let (raw, ours) = gbps(
        || {
            ok(unsafe { d.cuMemcpyDtoHAsync_v2(pin_ptr.cast(), pa, BYTES, raw_s) })?;
            sync(&s)
        },
        || {
            dev_a.copy_to_pinned_async(&mut pinned)?;
            pinned.wait()?;
            Ok(())
        },
    )?;
    rows.push(("D2H pinned".into(), raw, ours));
    let pg = pageable.as_mut_ptr();
    let (raw, ours) = gbps(
        || {
            ok(unsafe { d.cuMemcpyHtoDAsync_v2(pa, pg.cast(), BYTES, raw_s) })?;
            sync(&s)
        },
        || Ok(dev_a.copy_from_host(&pageable)?),
    )?;
    rows.push(("H2D pageable".into(), raw, ours));
    let (raw, ours) = gbps(
        || {
            ok(unsafe { d.cuMemcpyDtoHAsync_v2(pg.cast(), pa, BYTES, raw_s) })?;
            sync(&s)
        },
        || Ok(dev_a.copy_to_host(&mut pageable)?),
    )?;
    rows.push(("D2H pageable".into(), raw, ours));
    let (raw, ours) = gbps(
        || {
            ok(unsafe { d.cuMemcpyDtoDAsync_v2(pa, pb, BYTES, raw_s) })?;
            sync(&s)
        },
        || {
            dev_a.copy_from(&dev_b)?;
            sync(&s)
        },
    )?;
    rows.push(("D2D".into(), raw, ours));

    if Device::count()? >= 2 {
        let d1 = Device::get(1)?;
        let s1 = Stream::new(&d1)?;
        let mut on1 = DeviceBuffer::<u8>::zeroed(BYTES, &s1)?;
        s1.synchronize()?;
        let (ctx0, ctx1) = (ctx.as_raw(), d1.primary_context()?.as_raw());
        for peer in [false, true] {
            if peer {
                if !dev.can_access_peer(&d1)? {
                    break;
                }
                dev.enable_peer_access(&d1)?;
                d1.enable_peer_access(&dev)?;
            }
            let on = if peer { "on" } else { "off" };
            let (raw, ours) = peer_gbps(d, &s, (&dev_a, ctx0), (&mut on1, ctx1))?;
            rows.push((format!("peer 0->1 (peer access {on})"), raw, ours));
            let (raw, ours) = peer_gbps(d, &s, (&on1, ctx1), (&mut dev_a, ctx0))?;
            rows.push((format!("peer 1->0 (peer access {on})"), raw, ours));
        }
    }

    println!("\n| copy | raw driver GB/s | cudrv GB/s | cudrv / raw |\n|---|---|---|---|");
    for (name, raw, ours) in rows {
        println!("| {name} | {raw:.1} | {ours:.1} | {:.3}x |", ours / raw);
    }
    small_copies(d, &s)
}

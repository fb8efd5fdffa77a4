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
//! median of rounds of 500 that alternate between the raw pair and cudrv's `copy_to_host` /
//! `copy_from_host`, which add the gate, a question whether the stream is idle, and a wait for an
//! event instead of the stream. Without a driver it prints the error and exits 0.

use std::time::Instant;

use cudrv::memory::{DeviceBuffer, PinnedBuffer};
use cudrv::sys::{CUresult, Driver};
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

fn gbps(mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    f()?; // warm-up
    let mut v = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        f()?;
        v.push(BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

/// µs per call of `raw` and of `ours`: the medians of [`SMALL_ROUNDS`] rounds of
/// [`SMALL_REPS`] calls each, the two alternating round by round.
fn small_latency(mut raw: impl FnMut() -> Res<()>, mut ours: impl FnMut() -> Res<()>) -> Res<(f64, f64)> {
    let round = |f: &mut dyn FnMut() -> Res<()>| -> Res<f64> {
        let t = Instant::now();
        for _ in 0..SMALL_REPS {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / f64::from(SMALL_REPS))
    };
    round(&mut raw)?; // warm-up
    round(&mut ours)?;
    let (mut r, mut o) = (Vec::new(), Vec::new());
    for _ in 0..SMALL_ROUNDS {
        r.push(round(&mut raw)?);
        o.push(round(&mut ours)?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(r), median(o)))
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

    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    // SAFETY (raw closures): live device buffers and host memory of BYTES bytes each; every copy is
    // waited for before the next one and before the memory is touched again.
    let raw = gbps(|| {
        ok(unsafe { d.cuMemcpyHtoDAsync_v2(pa, pin_ptr.cast(), BYTES, raw_s) })?;
        sync(&s)
    })?;
    let ours = gbps(|| {
        dev_a.copy_from_pinned_async(&pinned)?;
        pinned.wait()?;
        Ok(())
    })?;
    rows.push(("H2D pinned", raw, ours));
    let raw = gbps(|| {
        ok(unsafe { d.cuMemcpyDtoHAsync_v2(pin_ptr.cast(), pa, BYTES, raw_s) })?;
        sync(&s)
    })?;
    let ours = gbps(|| {
        dev_a.copy_to_pinned_async(&mut pinned)?;
        pinned.wait()?;
        Ok(())
    })?;
    rows.push(("D2H pinned", raw, ours));
    let pg = pageable.as_mut_ptr();
    let raw = gbps(|| {
        ok(unsafe { d.cuMemcpyHtoDAsync_v2(pa, pg.cast(), BYTES, raw_s) })?;
        sync(&s)
    })?;
    let ours = gbps(|| Ok(dev_a.copy_from_host(&pageable)?))?;
    rows.push(("H2D pageable", raw, ours));
    let raw = gbps(|| {
        ok(unsafe { d.cuMemcpyDtoHAsync_v2(pg.cast(), pa, BYTES, raw_s) })?;
        sync(&s)
    })?;
    let ours = gbps(|| Ok(dev_a.copy_to_host(&mut pageable)?))?;
    rows.push(("D2H pageable", raw, ours));
    let raw = gbps(|| {
        ok(unsafe { d.cuMemcpyDtoDAsync_v2(pa, pb, BYTES, raw_s) })?;
        sync(&s)
    })?;
    let ours = gbps(|| {
        dev_a.copy_from(&dev_b)?;
        sync(&s)
    })?;
    rows.push(("D2D", raw, ours));

    if Device::count()? >= 2 {
        let d1 = Device::get(1)?;
        let s1 = Stream::new(&d1)?;
        let mut on1 = DeviceBuffer::<u8>::zeroed(BYTES, &s1)?;
        s1.synchronize()?;
        let (ctx0, ctx1) = (ctx.as_raw(), d1.primary_context()?.as_raw());
        let p1 = on1.as_raw();
        for peer in [false, true] {
            if peer {
                if !dev.can_access_peer(&d1)? {
                    break;
                }
                dev.enable_peer_access(&d1)?;
                d1.enable_peer_access(&dev)?;
            }
            let raw = gbps(|| {
                ok(unsafe { d.cuMemcpyPeerAsync(p1, ctx1, pa, ctx0, BYTES, raw_s) })?;
                sync(&s)
            })?;
            let ours = gbps(|| {
                dev_a.copy_to_peer(&mut on1, &s)?;
                sync(&s)
            })?;
            rows.push((if peer { "peer 0->1 (peer access on)" } else { "peer 0->1 (peer access off)" }, raw, ours));
            let raw = gbps(|| {
                ok(unsafe { d.cuMemcpyPeerAsync(pa, ctx0, p1, ctx1, BYTES, raw_s) })?;
                sync(&s)
            })?;
            let ours = gbps(|| {
                on1.copy_to_peer(&mut dev_a, &s)?;
                sync(&s)
            })?;
            rows.push((if peer { "peer 1->0 (peer access on)" } else { "peer 1->0 (peer access off)" }, raw, ours));
        }
    }

    println!("\n| copy | raw driver GB/s | cudrv GB/s | cudrv / raw |\n|---|---|---|---|");
    for (name, raw, ours) in rows {
        println!("| {name} | {raw:.1} | {ours:.1} | {:.3}x |", ours / raw);
    }
    small_copies(d, &s)
}

//! Which streams a piece of memory was used on, so that its free and host access wait for them.

use std::sync::{Arc, Mutex};

use crate::capture::RelaxedCaptureMode;
use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::MemoryResource;
use crate::session::CaptureSession;
use crate::stream::{Borrower, Gate, KeyedGate, Lender, ParkedStream, Stream, StreamKey, borrower, lend_gates};

/// Checks that `stream` belongs to `device`.
pub(crate) fn check_stream(what: &'static str, device: Device, stream: &Stream) -> Result<()> {
    if stream.device() == device {
        Ok(())
    } else {
        Err(Error::DeviceMismatch { what, expected: device.ordinal_i32(), found: stream.device().ordinal_i32() })
    }
}

/// A resource's synchronous free (`free`: `cuMemFree`, `cuMemFreeHost`) of memory whose uses are
/// queued on `stream`, once the stream's work is done; run with `ctx` current and captures
/// relaxed (never part of one). The wait is [`Stream::wait_to_free`], which lets a dropping
/// buffer's gates go while it waits. Where `stream` stands for the legacy default stream while a
/// blocking stream captures, a wait now would join that capture (the driver refuses it, and
/// invalidates the capture) and could not end before the capture does (for ever when this thread
/// is to end it): the free then waits on cudrv's deferred-work thread, its error reported as a
/// drop's, and `Ok` comes back at once.
///
/// # Errors
/// The wait's error (the stream is capturing, or its work failed): `free` does not run, and the
/// memory stays the caller's. Otherwise the bind's or `free`'s.
pub(crate) fn free_when_done<R: MemoryResource>(
    resource: &R,
    ctx: &Arc<Context>,
    stream: &Stream,
    free: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<()> {
    if stream.key().legacy_held_by_capture() {
        let ctx = ctx.clone();
        crate::session::after_stream_work(stream.clone(), move || {
            if let Err(e) = uncaptured(&ctx, free) {
                report_drop_error(Some(&ctx), e);
            }
        });
        return Ok(());
    }
    stream.wait_to_free(borrower(resource))?;
    uncaptured(ctx, free)
}

/// Runs `f`, a synchronous free, with `ctx` current and the thread's capture mode relaxed: never
/// part of a capture, and allowed whatever captures other threads make (`cuMemFree` is a
/// "potentially unsafe" call, which a capture in global mode on any thread would refuse, and be
/// invalidated for).
pub(crate) fn uncaptured(ctx: &Context, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let _b = ctx.bind()?;
    let _relaxed = RelaxedCaptureMode::enter();
    f()
}

/// The streams other than its own that a piece of memory was used on, so that its free and host
/// access wait for them. Shared by the buffer types that free synchronously
/// ([`DeviceBuffer2D`](super::DeviceBuffer2D), [`ManagedBuffer`](super::ManagedBuffer),
/// [`crate::ipc::IpcBuffer`]); [`DeviceBuffer`](super::DeviceBuffer) keeps its
/// list beside its graphs and uses [`note_use`].
#[derive(Debug, Default)]
pub(crate) struct StreamUses(Mutex<Vec<Stream>>);

impl StreamUses {
    /// [`note_use`] on this list.
    pub(crate) fn record(&self, owner: &Stream, stream: &Stream) -> Result<()> {
        note_use(&mut self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner), owner, stream)
    }

    /// A use on `stream` of memory that belongs to `owner`'s order, refused (with
    /// [`Error::Capturing`], `what`) where either stream captures: a graph could not keep the
    /// memory alive, and ordering the one after the other would make it join the capture. The use
    /// is recorded ([`note_use`]), and the gates of both streams come back: hold them until the
    /// use's work is queued, so that no capture begins on them in between and takes the work.
    pub(crate) fn use_on<'s>(&self, owner: &'s Stream, stream: &'s Stream, what: &'static str) -> Result<UseGates<'s>> {
        let gate = stream.refuse_in_capture(what)?;
        if stream.id() == owner.id() {
            return Ok((gate, None));
        }
        let own = owner.refuse_in_capture(what)?;
        self.record(owner, stream)?;
        Ok((gate, Some(own)))
    }

    /// Orders `owner` after every stream recorded (on the GPU), for work of its own that must see
    /// their uses (a copy to or from the host). Refused (with [`Error::Capturing`], `what`) where
    /// one of them captures: the wait would make `owner` join its capture. Each stream's gate is
    /// held until `owner`'s wait for it is queued.
    pub(crate) fn order_after_all(&self, owner: &Stream, what: &'static str) -> Result<()> {
        self.snapshot().iter().try_for_each(|s| {
            let _gate = s.refuse_in_capture(what)?;
            owner.wait_stream_in_gate(s)
        })
    }

    /// The streams recorded so far.
    pub(crate) fn snapshot(&self) -> Vec<Stream> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Takes the list (the memory is being freed).
    pub(crate) fn take(&mut self) -> Vec<Stream> {
        std::mem::take(self.0.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// The gates a use of memory holds until its work is queued ([`StreamUses::use_on`],
/// `DeviceBuffer::use_on`): of the use's stream, and of the owner's when it is another.
pub(crate) type UseGates<'s> = (Gate<'s>, Option<Gate<'s>>);

/// Notes a use on `stream` of memory that belongs to `owner`'s order: the first time, `stream`
/// waits (on the GPU) for `owner`'s work so far, so that nothing it runs touches the memory before
/// it is allocated, and `stream` joins `used` so that the free waits for it.
///
/// # Errors
/// The driver's error (then nothing was recorded).
pub(crate) fn note_use(used: &mut Vec<Stream>, owner: &Stream, stream: &Stream) -> Result<()> {
    if stream.id() != owner.id() && !used.contains(stream) {
        stream.wait_stream_in_gate(owner)?;
        used.push(stream.clone());
    }
    Ok(())
}

/// Waits on the host for `owner` and every stream of `used` (never returning while their work
/// may still run; see `Stream::wait_for_memory`).
///
/// # Errors
/// The first failed wait's error.
pub(crate) fn wait_for_uses(owner: &Stream, used: &[Stream]) -> Result<()> {
    used.iter().chain(std::iter::once(owner)).try_for_each(Stream::wait_for_memory)
}

/// Orders `stream` after the work queued so far on every stream of `used`, for a free on
/// `stream`: on the GPU where it can, else by a wait for that stream on the host (which never
/// returns while its work may still run). Under the gates of all of them, none capturing.
///
/// # Errors
/// A failed host wait's error: the memory may still be in use.
pub(crate) fn order_after_uses(stream: &Stream, used: &[Stream]) -> Result<()> {
    for other in used {
        if stream.wait_stream_in_gate(other).is_err() {
            other.wait_for_memory()?;
        }
    }
    Ok(())
}

/// A synchronous free (`cuMemFree` does not wait for queued work) of memory used on `owner` and
/// `used`: waits for them, then runs `free`. Outside host functions (deferred from inside one),
/// and after the end of a capture that any of the streams takes part in. The streams wait parked
/// ([`FreeStreams`]).
///
/// A failed wait leaks the memory (its work may still run), which is sound, and reports the
/// error: `free` is then forgotten, never run nor dropped.
pub(crate) fn free_after_waiting<F: FnOnce() -> Result<()> + Send + 'static>(
    owner: Stream,
    used: Vec<Stream>,
    free: F,
) {
    let streams = FreeStreams::park(owner, used);
    if crate::host_fn::in_host_fn() {
        crate::host_fn::defer(move || wait_then_free(streams, free));
    } else {
        wait_then_free(streams, free);
    }
}

/// [`free_after_waiting`], outside host functions. Held by a capture that cudrv cannot wait for
/// the end of: tried again on cudrv's thread.
fn wait_then_free<F: FnOnce() -> Result<()> + Send + 'static>(streams: FreeStreams, free: F) {
    crate::host_fn::attempt_until_done((streams, free), |(streams, free)| try_wait_then_free(streams, free));
}

/// [`wait_then_free`], once: what it gets back where the streams cannot be used just then (see
/// [`FreeStreams::revive`]).
fn try_wait_then_free<F: FnOnce() -> Result<()> + Send + 'static>(
    streams: FreeStreams,
    free: F,
) -> Option<(FreeStreams, F)> {
    if let Some(session) = streams.held_by_capture(0) {
        session.after_end(Box::new(move || wait_then_free(streams, free)));
        return None;
    }
    let Some(users) = streams.revive() else { return Some((streams, free)) };
    let (owner, used) = (&users.owner, &users.used);
    // A stream that takes part in a capture cannot be waited for (and work queued on it would be
    // captured): the free waits for the end of the capture.
    let mut free = Some(free);
    let held = unless_capturing(users.all(), 0, None, || {
        let Some(free) = free.take() else { return };
        let done = match order_after_uses(owner, used).and_then(|()| owner.wait_to_free(Borrower::Cudrv)) {
            Ok(()) => free(),
            Err(e) => {
                // The work may still run: the closure is not run, and not dropped either (what it
                // owns, such as a mapping that its drop would close, must outlive that work).
                std::mem::forget(free);
                Err(e)
            }
        };
        if let Err(e) = done {
            crate::context::report_drop_error(Some(owner.context()), e);
        }
    });
    // Before the free waits on: the users go (see [`FreeStreams`]).
    drop(users);
    match (held, free) {
        (Some(Held::Capture(session)), Some(free)) => {
            session.after_end(Box::new(move || wait_then_free(streams, free)));
            None
        }
        (Some(Held::Legacy), Some(free)) => Some((streams, free)),
        _ => None,
    }
}

/// The streams that a free waits for, the memory's own first, held parked
/// ([`ParkedStream`]): the free may wait for the end of a capture on one of them, or for a graph's
/// launches, and must not keep a capture's origin from being abandoned when its last user goes
/// (then the free runs).
pub(crate) struct FreeStreams {
    owner: ParkedStream,
    used: Vec<ParkedStream>,
}

impl FreeStreams {
    /// Parks `owner` and `used` (letting go of these users).
    pub(crate) fn park(owner: Stream, used: Vec<Stream>) -> FreeStreams {
        FreeStreams { owner: owner.park(), used: used.into_iter().map(Stream::park).collect() }
    }

    /// Whether the buffer's own stream can be named on this thread (see
    /// [`StreamKey::named_here`](crate::stream::StreamKey::named_here)).
    pub(crate) fn owner_named_here(&self) -> bool {
        self.owner.key().named_here()
    }

    /// A capture cudrv tracks, other than `own` (0: none), that one of the streams takes part in:
    /// the free waits for its end. Seen without making a user of the streams, so that the last
    /// user of a capture's origin stays its owner's (were it cudrv's, on cudrv's thread, the
    /// driver could refuse to end the abandoned capture there). [`unless_capturing`] looks again,
    /// under the streams' gates, once users are made.
    pub(crate) fn held_by_capture(&self, own: u64) -> Option<Arc<CaptureSession>> {
        capture_of(std::iter::once(&self.owner).chain(&self.used).map(ParkedStream::key), own)
    }

    /// Users of the streams, to do the free with. `None` where one cannot be made just then
    /// ([`ParkedStream::revive`]): try again later. Drop them before the free waits on, so that
    /// the capture it waits for may be abandoned.
    pub(crate) fn revive(&self) -> Option<FreeUsers> {
        Some(FreeUsers {
            owner: self.owner.revive()?,
            used: self.used.iter().map(ParkedStream::revive).collect::<Option<_>>()?,
        })
    }
}

/// Users of [`FreeStreams`], while a free is tried.
pub(crate) struct FreeUsers {
    /// The memory's own stream.
    pub(crate) owner: Stream,
    /// The others it was used on.
    pub(crate) used: Vec<Stream>,
}

impl FreeUsers {
    /// Every stream, the owner first.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Stream> + Clone {
        std::iter::once(&self.owner).chain(&self.used)
    }
}

/// What keeps work on some streams (a free, and the waits before it) from running now
/// ([`unless_capturing`]).
pub(crate) enum Held {
    /// One of the streams takes part in this capture: the work runs after its end.
    Capture(Arc<CaptureSession>),
    /// Work queued on one of the streams from this thread would go to the legacy default stream,
    /// while a blocking stream of its context captures (see
    /// [`StreamKey::legacy_held_by_capture`](crate::stream::StreamKey::legacy_held_by_capture)):
    /// the driver would refuse it and invalidate that capture. Try again later.
    Legacy,
}

/// The capture cudrv tracks, other than `own` (0: none), that one of `keys` takes part in.
fn capture_of<'a>(keys: impl Iterator<Item = &'a StreamKey>, own: u64) -> Option<Arc<CaptureSession>> {
    keys.map(StreamKey::capture_id).filter(|&id| id != 0 && id != own).find_map(CaptureSession::active)
}

/// Runs `f` unless one of `streams` takes part in a capture that cudrv tracks, other than `own`
/// (0: none), or stands for the legacy default stream while a blocking stream captures; then `f`
/// does not run, and what holds it comes back. The streams' gates are held from the look to the
/// end of `f`, so that no capture begins on them in between, and lent to the wait of `to` before
/// its synchronous free ([`lend_gates`]): `f` is that free, and queues nothing after the wait.
pub(crate) fn unless_capturing<'a>(
    mut streams: impl Iterator<Item = &'a Stream> + Clone,
    own: u64,
    to: Lender<'_>,
    f: impl FnOnce(),
) -> Option<Held> {
    let gates: Vec<KeyedGate<'_>> = streams.clone().map(|s| (s.key(), s.key().enter())).collect();
    if let Some(session) = capture_of(streams.clone().map(Stream::key), own) {
        return Some(Held::Capture(session));
    }
    if streams.any(|s| s.key().legacy_held_by_capture()) {
        return Some(Held::Legacy);
    }
    lend_gates(&gates, to, f);
    None
}

/// [`Error::LengthMismatch`] unless `found` (the other side's length) is `expected` (the length of
/// `what`, the buffer).
pub(crate) fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found { Ok(()) } else { Err(Error::LengthMismatch { what, expected, found }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_len_names_both_lengths() {
        assert!(check_len("the DeviceBuffer", 4, 4).is_ok());
        match check_len("the DeviceBuffer", 4, 3) {
            Err(e @ Error::LengthMismatch { what: "the DeviceBuffer", expected: 4, found: 3 }) => {
                assert_eq!(e.to_string(), "length mismatch: the DeviceBuffer has 4 elements, the other side 3");
            }
            other => panic!("{other:?}"),
        }
    }
}

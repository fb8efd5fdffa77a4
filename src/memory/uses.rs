//! Which streams a piece of memory was used on, so that its free and host access wait for them.

use std::sync::{Arc, Mutex};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::session::CaptureSession;
use crate::stream::{Gate, Stream};

/// Checks that `stream` belongs to `device`.
pub(crate) fn check_stream(what: &'static str, device: Device, stream: &Stream) -> Result<()> {
    if stream.device() == device {
        Ok(())
    } else {
        Err(Error::DeviceMismatch { what, expected: device.ordinal_i32(), found: stream.device().ordinal_i32() })
    }
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

    /// The streams recorded so far.
    pub(crate) fn snapshot(&self) -> Vec<Stream> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Takes the list (the memory is being freed).
    pub(crate) fn take(&mut self) -> Vec<Stream> {
        std::mem::take(self.0.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

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

/// A synchronous free (`cuMemFree` does not wait for queued work) of memory used on `owner` and
/// `used`: waits for them, then runs `free`. Outside host functions (deferred from inside one),
/// and after the end of a capture that any of the streams takes part in.
/// A failed wait leaks the memory (its work may still run), which is sound, and reports the
/// error.
pub(crate) fn free_after_waiting(owner: Stream, used: Vec<Stream>, free: impl FnOnce() -> Result<()> + Send + 'static) {
    if crate::host_fn::in_host_fn() {
        crate::host_fn::defer(move || free_after_waiting(owner, used, free));
        return;
    }
    // A stream that takes part in a capture cannot be waited for (and work queued on it would be
    // captured): the free waits for the end of the capture.
    let mut free = Some(free);
    let capturing = unless_capturing(std::iter::once(&owner).chain(&used), 0, || {
        let Some(free) = free.take() else { return };
        if let Err(e) = wait_for_uses(&owner, &used).and_then(|()| free()) {
            crate::context::report_drop_error(Some(owner.context()), e);
        }
    });
    if let (Some(session), Some(free)) = (capturing, free) {
        session.after_end(Box::new(move || free_after_waiting(owner, used, free)));
    }
}

/// Runs `f` unless one of `streams` takes part in a capture that cudrv tracks, other than `own`
/// (0: none); then `f` does not run, and that capture's session comes back. The streams' gates
/// are held from the look to the end of `f`, so that no capture begins on them in between.
pub(crate) fn unless_capturing<'a>(
    streams: impl Iterator<Item = &'a Stream> + Clone,
    own: u64,
    f: impl FnOnce(),
) -> Option<Arc<CaptureSession>> {
    let _gates: Vec<Gate<'_>> = streams.clone().map(|s| s.key().enter()).collect();
    let capturing =
        streams.map(|s| s.key().capture_id()).filter(|&id| id != 0 && id != own).find_map(CaptureSession::active);
    if capturing.is_none() {
        f();
    }
    capturing
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

//! Events: markers in a stream, for ordering across streams and for timing.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudrv_sys::CUevent;

use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::error::{check, check_done};
#[cfg(cuda_12080)]
use crate::result::drv_compat;
use crate::result::{driver, drv};
use crate::stream::Stream;

/// How an event is created.
///
/// ```
/// use cudrv::EventFlags;
/// assert!(!EventFlags::default().timing);
/// assert!(EventFlags::timing().timing);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventFlags {
    /// Record timestamps, so that [`Event::elapsed`] works. Off by default: events without
    /// timing are cheaper to record and wait on.
    pub timing: bool,
    /// Make [`Event::synchronize`] block the thread instead of spinning.
    pub blocking_sync: bool,
}

impl EventFlags {
    /// Flags with timing enabled.
    pub fn timing() -> EventFlags {
        EventFlags { timing: true, ..EventFlags::default() }
    }
}

/// A CUDA event: a point in a stream's order, to wait for (on the GPU with
/// [`Stream::wait_event`], on the host with [`Event::synchronize`]) or to time.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Event, EventFlags, Stream};
/// let device = Device::get(0)?;
/// let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
/// let (start, end) = (Event::with_flags(&device, EventFlags::timing())?, Event::with_flags(&device, EventFlags::timing())?);
/// start.record(&a)?;
/// // ... work on `a` ...
/// end.record(&a)?;
/// b.wait_event(&end)?; // work queued on `b` from now on runs after `a`'s work above
/// end.synchronize()?;
/// println!("{:?}", Event::elapsed(&start, &end)?);
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct Event {
    raw: CUevent,
    ctx: Arc<Context>,
    flags: EventFlags,
    /// The id of the capture cudrv tracks that the event was last recorded in (0: recorded
    /// outside one, or never): querying or waiting for it on the host is refused while that
    /// capture is active (the driver would refuse it too, and invalidate the capture).
    captured: AtomicU64,
}

// SAFETY: CUevent handles may be used from any thread; cudrv binds the context before each use.
unsafe impl Send for Event {}
// SAFETY: as above; all methods take `&self` and call thread-safe driver functions.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on `device`, without timing.
    ///
    /// # Errors
    /// The driver's error.
    pub fn new(device: &Device) -> Result<Event> {
        Self::with_flags(device, EventFlags::default())
    }

    /// A new event on `device` with `flags`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn with_flags(device: &Device, flags: EventFlags) -> Result<Event> {
        let ctx = device.primary_context()?;
        let mut bits = 0;
        if !flags.timing {
            bits |= cudrv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        }
        if flags.blocking_sync {
            bits |= cudrv_sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC.0;
        }
        let mut raw = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: `raw` is a valid out-pointer and the context is current.
            unsafe { drv!(cuEventCreate(&mut raw, bits)) }?;
        }
        Ok(Event { raw, ctx, flags, captured: AtomicU64::new(0) })
    }

    /// The raw `CUevent`.
    pub fn as_raw(&self) -> CUevent {
        self.raw
    }

    /// The event's device.
    pub fn device(&self) -> Device {
        self.ctx.device()
    }

    /// The flags the event was created with.
    pub fn flags(&self) -> EventFlags {
        self.flags
    }

    /// Records the event at this point of `stream`: it completes when all work queued there
    /// before it is done. Recording again moves it.
    ///
    /// Recorded on a stream that takes part in a capture, the event marks a point of the graph
    /// (other streams that wait on it join the capture): until the capture ends,
    /// [`Event::query`], [`Event::synchronize`] and [`Event::elapsed`] refuse it.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device; the driver's error.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if stream.device() != self.ctx.device() {
            return Err(Error::DeviceMismatch {
                what: "Event::record",
                expected: self.ctx.device().ordinal_i32(),
                found: stream.device().ordinal_i32(),
            });
        }
        let _b = self.ctx.bind()?;
        // SAFETY: both handles are valid while their owners live; the context is current.
        unsafe { drv!(cuEventRecord(self.raw, stream.as_raw())) }?;
        // The capture the stream takes part in, as far as cudrv knows it. Not settled while a
        // capture is beginning on the stream (this thread may be the one beginning it, recording
        // where the stream stands before): such a record is not in the capture, or raced it.
        self.captured.store(stream.key().capture_id_unsettled(), Ordering::Relaxed);
        Ok(())
    }

    /// Refuses `what` while the capture the event was last recorded in is active.
    fn refuse_if_captured(&self, what: &'static str) -> Result<()> {
        let id = self.captured.load(Ordering::Relaxed);
        if id != 0 && crate::capture::is_tracked(id) {
            return Err(Error::Capturing { what });
        }
        Ok(())
    }

    /// Waits until the event completes (at once for an event never recorded), then returns an
    /// error kept from a `Drop` on the event's context, if any (see [`crate::context`]). Captures
    /// on other threads go on: the wait is made with the thread's capture mode relaxed (in the
    /// global mode, the driver would refuse it during another thread's global-mode capture, and
    /// invalidate that).
    ///
    /// # Errors
    /// [`Error::Capturing`] for an event recorded in a capture that is still active; the
    /// driver's error, else [`Error::Deferred`].
    pub fn synchronize(&self) -> Result<()> {
        self.refuse_if_captured("Event::synchronize of an event recorded in the capture")?;
        self.wait()?;
        self.ctx.take_deferred()
    }

    /// Waits until the event completes, reporting no kept `Drop` error.
    pub(crate) fn wait(&self) -> Result<()> {
        // With the thread's capture mode relaxed: in the global mode the driver refuses the wait
        // during another thread's global-mode capture, and invalidates it; the event is not of a
        // capture cudrv tracks (refused above, or recorded by cudrv outside one). After the bind,
        // which refuses in host functions: relaxing the mode is a driver call of its own.
        let _b = self.ctx.bind()?;
        let _relaxed = crate::capture::RelaxedCaptureMode::enter();
        // SAFETY: the event is valid; the context is current.
        unsafe { drv!(cuEventSynchronize(self.raw)) }
    }

    /// Whether the event has completed, without waiting.
    ///
    /// # Errors
    /// [`Error::Capturing`] for an event recorded in a capture that is still active; the
    /// driver's error (other than "not ready").
    pub fn query(&self) -> Result<bool> {
        self.refuse_if_captured("Event::query of an event recorded in the capture")?;
        let _b = self.ctx.bind()?;
        // Relaxed as for `wait`.
        let _relaxed = crate::capture::RelaxedCaptureMode::enter();
        // SAFETY: the event is valid; the context is current.
        check_done("cuEventQuery", unsafe { driver()?.cuEventQuery(self.raw) })
    }

    /// The time between two completed events with timing enabled.
    ///
    /// # Errors
    /// [`Error::TimingDisabled`] when either was created without timing; [`Error::Capturing`]
    /// when either was recorded in a capture that is still active; `CUDA_ERROR_NOT_READY` when
    /// either has not completed; the driver's error.
    pub fn elapsed(start: &Event, end: &Event) -> Result<Duration> {
        if !start.flags.timing || !end.flags.timing {
            return Err(Error::TimingDisabled);
        }
        for event in [start, end] {
            event.refuse_if_captured("Event::elapsed of an event recorded in the capture")?;
        }
        let _b = start.ctx.bind()?;
        let mut ms = 0f32;
        // SAFETY: valid out-pointer and events; the context is current. Both variants take the
        // same arguments; drivers before 12.8 have only the first.
        #[cfg(cuda_12080)]
        unsafe { drv_compat!(cuEventElapsedTime_v2 | cuEventElapsedTime(&mut ms, start.raw, end.raw)) }?;
        // SAFETY: as above.
        #[cfg(not(cuda_12080))]
        unsafe { drv!(cuEventElapsedTime(&mut ms, start.raw, end.raw)) }?;
        // `max` takes NaN to 0; an infinite or huge answer saturates (`from_secs_f64` would panic).
        Ok(Duration::try_from_secs_f64(f64::from(ms.max(0.0)) / 1e3).unwrap_or(Duration::MAX))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let (raw, ctx) = (crate::host_fn::SendHandle(self.raw), self.ctx.clone());
        let destroy = move || {
            let Ok(driver) = crate::result::driver() else { return };
            // SAFETY: the event was created by cudrv and is destroyed once, here. Destroying an
            // event that is recorded but not complete is allowed: the driver frees it once it
            // completes.
            let rc = unsafe { driver.cuEventDestroy_v2(raw.get()) };
            if let Err(e) = check("cuEventDestroy", rc) {
                report_drop_error(Some(&ctx), e);
            }
        };
        crate::host_fn::now_or_deferred(destroy)
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event").field("raw", &self.raw).field("flags", &self.flags).finish()
    }
}

impl Stream {
    /// Makes work queued on this stream after this call wait until `event` completes (the GPU
    /// waits, not the host). An event never recorded is complete. Recording is
    /// [`Event::record`]. If the event was recorded in a capture, this stream joins it (as the
    /// driver does); other threads' cudrv work on this stream waits until the join is done, so
    /// that it is either queued before the join or part of the capture, as it sees.
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.wait_raw_event(event.as_raw())
    }

    /// [`Stream::wait_event`] for a raw event of the stream's context (an IPC event): if the event
    /// was recorded in a capture, the wait makes the stream join it, and cudrv notes where the
    /// stream stood before, for the graph's first launch (see `crate::graph`).
    pub(crate) fn wait_raw_event(&self, event: cudrv_sys::CUevent) -> Result<()> {
        // Before the mark: a host function must not wait for the stream's gate (its holder may
        // wait for the host function).
        crate::host_fn::refuse_in_host_fn("Stream::wait_event")?;
        let hooks = crate::stream::join_hooks()
            .filter(|_| crate::capture::any_active() && crate::capture::session(self.key().capture_id()).is_none());
        let Some(hooks) = hooks else { return self.wait_raw_untracked(event) };
        // Other threads' cudrv work on this stream waits until a join, if the wait makes one, is
        // tracked. Where the stream stands is noted under the mark, after all work queued before
        // the join (see `Stream::wait_stream`).
        self.key().joining(0, || {
            let before = (hooks.before)(self)?;
            self.wait_raw_untracked(event)?;
            (hooks.waited)(self, before);
            Ok(())
        })
    }

    /// `cuStreamWaitEvent`, for an event known not to be of a capture.
    pub(crate) fn wait_event_untracked(&self, event: &Event) -> Result<()> {
        self.wait_raw_untracked(event.as_raw())
    }

    fn wait_raw_untracked(&self, event: cudrv_sys::CUevent) -> Result<()> {
        let _b = self.context().bind()?;
        // SAFETY: both handles are valid while their owners live (the caller holds the event);
        // the context is current.
        unsafe { drv!(cuStreamWaitEvent(self.as_raw(), event, 0)) }
    }
}

//! Streams: queues of device work that run in order.

use std::ffi::c_void;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudrv_sys::{CUresult, CUstream};

use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::result::{check, driver, drv};

/// `CU_STREAM_LEGACY`, a macro in cuda.h that bindgen cannot translate.
const CU_STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`, likewise.
const CU_STREAM_PER_THREAD: usize = 0x2;

/// A CUDA stream: work queued on it runs in order, asynchronously to the host.
///
/// `Stream` is a cheap handle (`Clone` shares it); the stream is destroyed when the last clone is
/// dropped, and work still queued on it completes anyway (the driver's semantics). Streams made by
/// [`Stream::new`] are non-blocking: they do not synchronise with the legacy default stream.
///
/// ```no_run
/// use cudrv::{Device, Stream};
/// let stream = Stream::new(&Device::get(0)?)?;
/// stream.launch_host_fn(|| println!("everything queued before this has run"))?;
/// stream.synchronize()?;
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Clone)]
pub struct Stream {
    handle: Arc<Handle>,
}

/// The users' share of a stream. When the last user clone goes, memory pools that cached blocks
/// freed on the stream are told to forget it (while it is still valid), and release their own
/// references; the stream is destroyed once those are gone too.
struct Handle {
    key: StreamKey,
}

/// A stream's identity for memory pools: keeps the stream alive, compares by [`Stream::id`].
#[derive(Clone)]
pub(crate) struct StreamKey(Arc<Inner>);

impl StreamKey {
    pub(crate) fn as_raw(&self) -> CUstream {
        self.0.raw
    }

    pub(crate) fn device(&self) -> Device {
        self.0.ctx.device()
    }
}

impl PartialEq for StreamKey {
    fn eq(&self, other: &StreamKey) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for StreamKey {}

impl std::hash::Hash for StreamKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.id.hash(state);
    }
}

impl fmt::Debug for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamKey({})", self.0.id)
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        crate::memory::stream_retired(&self.key);
    }
}

struct Inner {
    raw: CUstream,
    ctx: Arc<Context>,
    owned: bool,
    id: u64,
}

// SAFETY: a CUstream may be used from any thread (the driver API is thread-safe for streams);
// cudrv makes the stream's context current before each use.
unsafe impl Send for Inner {}
// SAFETY: as above; all uses go through `&self` and thread-safe driver calls.
unsafe impl Sync for Inner {}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Stream {
    /// A new non-blocking stream on `device` (`CU_STREAM_NON_BLOCKING`), at default priority.
    ///
    /// # Errors
    /// The driver's error.
    pub fn new(device: &Device) -> Result<Stream> {
        Self::create(device, None)
    }

    /// A new non-blocking stream with `priority`, which must lie in the device's range
    /// ([`crate::Capabilities::stream_priority_range`]; lower numbers run first).
    ///
    /// # Errors
    /// [`Error::InvalidPriority`] outside the range; the driver's error.
    pub fn with_priority(device: &Device, priority: i32) -> Result<Stream> {
        let (least, greatest) = device.capabilities()?.stream_priority_range;
        if priority < greatest || priority > least {
            return Err(Error::InvalidPriority { requested: priority, device: device.ordinal_i32(), least, greatest });
        }
        Self::create(device, Some(priority))
    }

    fn create(device: &Device, priority: Option<i32>) -> Result<Stream> {
        let ctx = device.primary_context()?;
        let _bound = ctx.bind()?;
        let flags = cudrv_sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and the context is current.
        unsafe {
            match priority {
                Some(p) => drv!(cuStreamCreateWithPriority(&mut raw, flags, p)),
                None => drv!(cuStreamCreate(&mut raw, flags)),
            }
        }?;
        Ok(Self::wrap(raw, ctx, true))
    }

    fn wrap(raw: CUstream, ctx: Arc<Context>, owned: bool) -> Stream {
        let inner = Arc::new(Inner { raw, ctx, owned, id: NEXT_ID.fetch_add(1, Ordering::Relaxed) });
        Stream { handle: Arc::new(Handle { key: StreamKey(inner) }) }
    }

    /// The legacy default stream of `device` (`CU_STREAM_LEGACY`), which synchronises with every
    /// blocking stream of the context.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn legacy(device: &Device) -> Result<Stream> {
        Ok(Self::wrap(CU_STREAM_LEGACY as CUstream, device.primary_context()?, false))
    }

    /// The per-thread default stream of `device` (`CU_STREAM_PER_THREAD`): each host thread that
    /// uses it gets its own stream.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn per_thread(device: &Device) -> Result<Stream> {
        Ok(Self::wrap(CU_STREAM_PER_THREAD as CUstream, device.primary_context()?, false))
    }

    /// Borrows a stream made elsewhere (by another library) without owning it: dropping the
    /// returned `Stream` does not destroy it.
    ///
    /// # Safety
    /// `raw` must be a valid stream of `device`'s primary context (or a special stream value),
    /// and must stay valid for as long as the returned `Stream`, its clones, and any work or
    /// buffer that refers to them exist.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub unsafe fn from_raw(device: &Device, raw: CUstream) -> Result<Stream> {
        Ok(Self::wrap(raw, device.primary_context()?, false))
    }

    fn inner(&self) -> &Inner {
        &self.handle.key.0
    }

    pub(crate) fn key(&self) -> &StreamKey {
        &self.handle.key
    }

    /// The raw `CUstream`.
    pub fn as_raw(&self) -> CUstream {
        self.inner().raw
    }

    /// The stream's device.
    pub fn device(&self) -> Device {
        self.inner().ctx.device()
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner().ctx
    }

    /// A number unique to this stream for the life of the process (raw handles can be reused
    /// after a stream is destroyed; this cannot).
    pub fn id(&self) -> u64 {
        self.inner().id
    }

    /// Waits until all work queued on the stream is done.
    ///
    /// # Errors
    /// The driver's error; an asynchronous error of earlier work shows up here.
    pub fn synchronize(&self) -> Result<()> {
        let _b = self.inner().ctx.bind()?;
        // SAFETY: the stream is valid while `self` lives; its context is current.
        unsafe { drv!(cuStreamSynchronize(self.inner().raw)) }
    }

    /// Whether all work queued on the stream is done, without waiting.
    ///
    /// # Errors
    /// The driver's error (other than "not ready").
    pub fn query(&self) -> Result<bool> {
        let _b = self.inner().ctx.bind()?;
        // SAFETY: the stream is valid while `self` lives; its context is current.
        let rc = unsafe { driver()?.cuStreamQuery(self.inner().raw) };
        match rc {
            Ok(CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            other => check("cuStreamQuery", other).map(|()| true),
        }
    }

    /// Makes work queued on this stream after this call wait until `event` completes (the GPU
    /// waits, not the host). An event never recorded is complete.
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let _b = self.inner().ctx.bind()?;
        // SAFETY: both handles are valid while their owners live; the context is current.
        unsafe { drv!(cuStreamWaitEvent(self.inner().raw, event.as_raw(), 0)) }
    }

    /// Makes work queued on this stream after this call wait for all work queued on `other` so
    /// far. Returns at once.
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        if other.inner().raw == self.inner().raw && Arc::ptr_eq(&other.inner().ctx, &self.inner().ctx) {
            return Ok(());
        }
        let event = Event::new(&other.device())?;
        event.record(other)?;
        self.wait_event(&event)
    }

    /// Records `event` at this point of the stream.
    ///
    /// # Errors
    /// The driver's error.
    pub fn record_event(&self, event: &Event) -> Result<()> {
        event.record(self)
    }

    /// Queues `f` to run on a driver thread once all work queued before it is done; later work
    /// waits for it to return.
    ///
    /// `f` must not call into CUDA (the driver forbids it in host functions, and may deadlock).
    /// A panic in `f` is caught and printed; it does not cross into the driver.
    ///
    /// # Errors
    /// The driver's error (then `f` is dropped without running).
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, f: F) -> Result<()> {
        type Boxed = Box<dyn FnOnce() + Send + 'static>;
        unsafe extern "C" fn trampoline(data: *mut c_void) {
            // SAFETY: `data` is the pointer made by Box::into_raw below, handed to the driver
            // exactly once, and the driver calls this exactly once with it.
            let f = unsafe { Box::from_raw(data.cast::<Boxed>()) };
            if catch_unwind(AssertUnwindSafe(f)).is_err() {
                eprintln!("cudrv: a host function queued with Stream::launch_host_fn panicked");
            }
        }
        let data = Box::into_raw(Box::new(Box::new(f) as Boxed));
        let _b = self.inner().ctx.bind();
        let rc = match _b {
            // SAFETY: the stream is valid, the trampoline has the driver's CUhostFn signature and
            // `data` stays valid until the trampoline takes it back.
            Ok(_) => driver().and_then(|d| {
                check("cuLaunchHostFunc", unsafe {
                    d.cuLaunchHostFunc(self.inner().raw, Some(trampoline), data.cast())
                })
            }),
            Err(e) => Err(e),
        };
        if rc.is_err() {
            // SAFETY: the driver did not take `data`, so it is still ours to free.
            drop(unsafe { Box::from_raw(data) });
        }
        rc
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(driver) = crate::result::driver() else { return };
        // Destroying a stream needs no current context. Work still queued completes.
        // SAFETY: the stream was created by cudrv and is destroyed once, here.
        let rc = unsafe { driver.cuStreamDestroy_v2(self.raw) };
        if let Err(e) = check("cuStreamDestroy", rc) {
            report_drop_error(Some(&self.ctx), e);
        }
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        self.inner().id == other.inner().id
    }
}

impl Eq for Stream {}

impl std::hash::Hash for Stream {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.inner().id.hash(state);
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("raw", &self.inner().raw)
            .field("device", &self.device().ordinal())
            .field("id", &self.inner().id)
            .finish()
    }
}

//! Host-side memory: pinned buffers, the pinned resource, host registration.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::{align_of, size_of, size_of_val};
use std::sync::{Arc, Mutex};

use super::buffer::{DeviceRepr, byte_len};
use super::{DevicePtr, MemoryResource, ResourceKind, check_stream, free_when_done};
use crate::capture::RelaxedCaptureMode;
use crate::context::{Context, bound_drop_call, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::result::drv;
use crate::stream::Stream;

/// Page-locked ("pinned") host memory for `len` elements of `T` (`cuMemHostAlloc`, portable to
/// every context), the host side of asynchronous copies.
///
/// While an asynchronous copy may still read or write it, host access waits: [`as_slice`],
/// [`as_mut_slice`] and `Drop` first wait for every copy queued with this buffer. So safe code
/// can neither read data the GPU is still writing nor change or free memory the GPU is still
/// reading. Copies queued with it on different streams are ordered with each other (a later copy
/// waits, on the GPU, for the earlier ones of other streams). If a wait fails, the host access
/// returns the error and `Drop` leaks the memory rather than free it under a copy.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, memory::{DeviceBuffer, PinnedBuffer}};
/// let device = Device::get(0)?;
/// let stream = Stream::new(&device)?;
/// let src = PinnedBuffer::from_slice(&device, &[1.0f32, 2.0, 3.0])?;
/// let mut buf = DeviceBuffer::<f32>::zeroed(3, &stream)?;
/// buf.copy_from_pinned_async(&src)?; // returns at once
/// let mut dst = PinnedBuffer::<f32>::new(&device, 3)?;
/// buf.copy_to_pinned_async(&mut dst)?;
/// assert_eq!(dst.as_slice()?, [1.0, 2.0, 3.0]); // waits for the copy
/// # Ok::<(), cudrv::Error>(())
/// ```
///
/// [`as_slice`]: PinnedBuffer::as_slice
/// [`as_mut_slice`]: PinnedBuffer::as_mut_slice
pub struct PinnedBuffer<T: DeviceRepr> {
    /// The first element: `base`, or past it when `T` needs more alignment than the driver gave.
    ptr: *mut T,
    /// What `cuMemHostAlloc` returned, and is freed.
    base: *mut c_void,
    len: usize,
    ctx: Arc<Context>,
    /// Copies that may still use the memory: at most one per stream (a later copy on a stream
    /// covers the earlier ones there). Shared, so that a wait need not hold the lock.
    pending: Mutex<Vec<Arc<Pending>>>,
    _t: PhantomData<T>,
}

/// A copy that may still use a pinned buffer.
struct Pending {
    stream: Stream,
    /// Recorded after the copy. `None` when recording failed: then only waiting for the whole
    /// stream proves the copy done.
    event: Option<Event>,
}

impl Pending {
    /// Waits for the copy on the host: on the event, or, should that fail, on the stream (which
    /// never returns while the copy may still run).
    fn wait(&self) -> Result<()> {
        // The event was recorded outside every capture (pinned copies refuse capturing streams):
        // `Event::wait` relaxes the capture mode, so that the wait leaves other threads'
        // global-mode captures alone.
        match &self.event {
            Some(ev) => ev.wait().or_else(|_| self.stream.wait_for_memory()),
            None => self.stream.wait_for_memory(),
        }
    }

    /// Makes `stream` wait, on the GPU, for this copy.
    fn order_before(&self, stream: &Stream) -> Result<()> {
        if self.stream == *stream {
            return Ok(());
        }
        match &self.event {
            Some(ev) => stream.wait_event_untracked(ev),
            None => {
                // Held until the wait is queued: ordering `stream` after a capturing stream would
                // make it join the capture, and the copy queued next with it.
                let _gate =
                    self.stream.refuse_in_capture("a copy with a PinnedBuffer whose earlier copy's stream captures")?;
                stream.wait_stream_in_gate(&self.stream)
            }
        }
    }
}

/// A copy about to be queued with a pinned buffer ([`PinnedBuffer::prepare`]): made before the copy
/// so that nothing that can fail stands between queuing the copy and tracking it.
pub(crate) struct PendingCopy {
    event: Option<Event>,
}

// SAFETY: the buffer owns its memory (like a Box<[T]>) and T is Send + Sync; the pending list
// is behind a Mutex.
unsafe impl<T: DeviceRepr> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads (after waiting for pending copies) or appends to the Mutex.
unsafe impl<T: DeviceRepr> Sync for PinnedBuffer<T> {}

/// How [`PinnedBuffer::with_flags`] allocates pinned memory. The default is cudrv's: portable
/// (usable from every context), not write-combined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PinnedFlags {
    /// Write-combined (`CU_MEMHOSTALLOC_WRITECOMBINED`): faster for the GPU to read over PCIe,
    /// very slow for the host to read. Off by default (cudarc #579).
    pub write_combined: bool,
}

impl PinnedFlags {
    /// With write-combining set to `on`.
    #[must_use]
    pub fn write_combined(mut self, on: bool) -> PinnedFlags {
        self.write_combined = on;
        self
    }
}

impl<T: DeviceRepr> PinnedBuffer<T> {
    /// `len` zeroed elements of pinned memory, not write-combined.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on overflow; the driver's error (out of memory).
    pub fn new(device: &Device, len: usize) -> Result<PinnedBuffer<T>> {
        Self::with_flags(device, len, PinnedFlags::default())
    }

    /// As [`PinnedBuffer::new`], with `flags` (`cuMemHostAlloc` flags beyond cudrv's portable
    /// default).
    ///
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
    /// use cudrv::{Device, memory::{PinnedBuffer, PinnedFlags}};
    /// let device = Device::get(0)?;
    /// let upload = PinnedBuffer::<f32>::with_flags(&device, 1 << 20, PinnedFlags::default().write_combined(true))?;
    /// assert_eq!(upload.len(), 1 << 20);
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`PinnedBuffer::new`].
    pub fn with_flags(device: &Device, len: usize, flags: PinnedFlags) -> Result<PinnedBuffer<T>> {
        let write_combined = flags.write_combined;
        let bytes = byte_len::<T>(len)?;
        let align = align_of::<T>();
        let ctx = device.primary_context()?;
        let mut base = host_alloc(&ctx, bytes, write_combined)?;
        let mut offset = (base as usize).wrapping_neg() % align;
        if offset != 0 {
            // The driver aligns to pages; a type aligned beyond that gets room to align itself.
            host_free(&ctx, base);
            let padded = bytes.checked_add(align - 1).filter(|b| *b <= isize::MAX as usize).ok_or_else(|| {
                Error::InvalidArgument(format!("{len} elements of {} bytes overflow", size_of::<T>()))
            })?;
            base = host_alloc(&ctx, padded, write_combined)?;
            offset = (base as usize).wrapping_neg() % align;
        }
        // SAFETY: `offset + bytes` lies within the allocation (it is `bytes`, or `bytes + align - 1`
        // with `offset < align`).
        let ptr = unsafe { base.cast::<u8>().add(offset) }.cast::<T>();
        // SAFETY: `ptr` is valid for `bytes` bytes; zero bits are a valid T (DeviceRepr).
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(PinnedBuffer { ptr, base, len, ctx, pending: Mutex::new(Vec::new()), _t: PhantomData })
    }

    /// Pinned memory holding a copy of `data`.
    ///
    /// # Errors
    /// As [`PinnedBuffer::new`].
    pub fn from_slice(device: &Device, data: &[T]) -> Result<PinnedBuffer<T>> {
        let mut b = Self::new(device, data.len())?;
        b.as_mut_slice()?.copy_from_slice(data);
        Ok(b)
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The contents, after waiting for queued copies.
    ///
    /// # Errors
    /// The driver's error while waiting.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait()?;
        // SAFETY: no copy queued before this call is pending, so nothing writes the memory (a copy
        // queued since, through `&self`, only reads it); it is valid and aligned for `len`
        // elements.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// The contents, mutable, after waiting for queued copies.
    ///
    /// # Errors
    /// The driver's error while waiting.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        // SAFETY: no copy is pending and `&mut self` excludes new ones; valid and aligned for `len`.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Waits for every copy queued with this buffer. A copy whose wait fails stays pending, so
    /// host access keeps failing and `Drop` leaks the memory.
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait(&self) -> Result<()> {
        // The lock is not held while waiting: a host function may lock it (it touches this
        // buffer), and a copy waited for may be queued after that host function. What is queued
        // meanwhile, through `&self`, only reads the memory, as host access through `&self` does.
        for p in self.pending_now().iter().rev() {
            p.wait()?;
            self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|q| !Arc::ptr_eq(q, p));
        }
        Ok(())
    }

    /// The copies pending now (the lock is let go at once).
    fn pending_now(&self) -> Vec<Arc<Pending>> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    pub(crate) fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// The pointer, without waiting: only for queuing a copy between [`prepare`](Self::prepare)
    /// and [`commit`](Self::commit).
    pub(crate) fn as_mut_ptr_unsynced(&mut self) -> *mut T {
        self.ptr
    }

    /// Gets ready to queue a copy with this buffer on `stream`: orders `stream` after the copies
    /// of other streams still pending with it, and makes the event that will track the new copy.
    /// Nothing is queued if this fails.
    pub(crate) fn prepare(&self, stream: &Stream) -> Result<PendingCopy> {
        let event = Event::new(&stream.device())?;
        // Not under the lock, which host functions may take (see `wait`).
        for p in self.pending_now().iter() {
            p.order_before(stream)?;
        }
        Ok(PendingCopy { event: Some(event) })
    }

    /// Tracks a copy just queued on `stream` (after [`prepare`](Self::prepare)). It cannot fail: if
    /// the event cannot be recorded, the copy is tracked by its stream instead.
    pub(crate) fn commit(&self, copy: PendingCopy, stream: &Stream) {
        let event = copy.event.filter(|ev| ev.record(stream).is_ok());
        let mut pending = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A copy queued on a stream comes after the earlier ones there: it covers them.
        pending.retain(|p| p.stream != *stream);
        pending.push(Arc::new(Pending { stream: stream.clone(), event }));
    }
}

impl<T: DeviceRepr> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        let pending = std::mem::take(self.pending.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner));
        let (base, ctx) = (crate::host_fn::SendHandle(self.base), self.ctx.clone());
        let free = move || {
            for p in pending.iter().rev() {
                if let Err(e) = p.wait() {
                    // The copy may still run: leaking the memory is the only sound choice.
                    report_drop_error(Some(&ctx), e);
                    return;
                }
            }
            host_free(&ctx, base.get());
        };
        crate::host_fn::now_or_deferred(free)
    }
}

impl<T: DeviceRepr> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

fn host_alloc(ctx: &Context, bytes: usize, write_combined: bool) -> Result<*mut c_void> {
    let mut flags = cudrv_sys::CU_MEMHOSTALLOC_PORTABLE;
    if write_combined {
        flags |= cudrv_sys::CU_MEMHOSTALLOC_WRITECOMBINED;
    }
    let _b = ctx.bind()?;
    let _relaxed = RelaxedCaptureMode::enter();
    let mut ptr = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context is current. Zero bytes take one.
    unsafe { drv!(cuMemHostAlloc(&mut ptr, bytes.max(1), flags)) }?;
    if ptr.is_null() {
        // The host writes through it (`PinnedBuffer` zeroes it): a driver's success with no
        // memory is its failure.
        return Err(Error::driver("cuMemHostAlloc", cudrv_sys::CUresult::CUDA_ERROR_UNKNOWN));
    }
    Ok(ptr)
}

fn host_free(ctx: &Context, ptr: *mut c_void) {
    bound_drop_call(ctx, || {
        let _relaxed = RelaxedCaptureMode::enter();
        // SAFETY: `ptr` came from cuMemHostAlloc and no copy uses it any more; the context is
        // current.
        unsafe { drv!(cuMemFreeHost(ptr)) }
    });
}

/// Pinned host memory as a [`MemoryResource`] (`cuMemHostAlloc`, portable, not write-combined).
/// A free waits for its stream first: host memory is not freed in stream order by the driver.
#[derive(Debug)]
pub struct PinnedHostResource {
    ctx: Arc<Context>,
}

impl PinnedHostResource {
    /// A resource on `device`.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn new(device: &Device) -> Result<PinnedHostResource> {
        Ok(PinnedHostResource { ctx: device.primary_context()? })
    }
}

// SAFETY: fresh page-locked memory (page-aligned); a free first waits for the stream.
unsafe impl MemoryResource for PinnedHostResource {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream("PinnedHostResource::allocate", self.device(), stream)?;
        Ok(host_alloc(&self.ctx, bytes, false)? as DevicePtr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, _bytes: usize, stream: &Stream) -> Result<()> {
        let ptr = crate::host_fn::SendHandle(ptr as *mut c_void);
        // SAFETY: the caller passes memory from `allocate`, freed once; `free_when_done` runs the
        // free once the stream's uses are complete, with the context current.
        free_when_done(self, &self.ctx, stream, move || unsafe { drv!(cuMemFreeHost(ptr.get())) })
    }

    fn device(&self) -> Device {
        self.ctx.device()
    }

    fn kind(&self) -> ResourceKind {
        ResourceKind::PinnedHost
    }

    fn is_device_accessible(&self) -> bool {
        false
    }

    fn is_host_accessible(&self) -> bool {
        true
    }
}

/// Existing host memory, page-locked for the life of this guard (`cuMemHostRegister`,
/// portable). The slice stays mutably borrowed, so nothing else can free or move it meanwhile.
pub struct HostRegistration<'a, T: DeviceRepr> {
    slice: &'a mut [T],
    ctx: Arc<Context>,
}

/// Page-locks `slice` (gated on the device's host-registration support).
///
/// # Errors
/// [`Error::Unsupported`] when the device cannot register host memory; the driver's error.
pub fn register_host<'a, T: DeviceRepr>(device: &Device, slice: &'a mut [T]) -> Result<HostRegistration<'a, T>> {
    if !device.capabilities()?.host_register {
        return Err(device.unsupported(
            "host memory registration",
            "CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED is 0",
            Some("PinnedBuffer"),
        ));
    }
    let ctx = device.primary_context()?;
    // Zero bytes (an empty slice, or zero-sized elements) register nothing: the driver refuses a
    // size of 0.
    if size_of_val(slice) != 0 {
        let _b = ctx.bind()?;
        let _relaxed = RelaxedCaptureMode::enter();
        // SAFETY: the slice is valid for its length and stays borrowed until unregistered.
        unsafe {
            drv!(cuMemHostRegister_v2(
                slice.as_mut_ptr().cast(),
                size_of_val(slice),
                cudrv_sys::CU_MEMHOSTREGISTER_PORTABLE
            ))
        }?;
    }
    Ok(HostRegistration { slice, ctx })
}

impl<T: DeviceRepr> HostRegistration<'_, T> {
    /// The registered memory.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.slice
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// Its size in bytes.
    pub fn byte_len(&self) -> usize {
        size_of_val(self.slice)
    }
}

impl<T: DeviceRepr> Drop for HostRegistration<'_, T> {
    fn drop(&mut self) {
        if self.byte_len() == 0 {
            return; // nothing was registered
        }
        // Inside a host function, where the driver may not be called, the unregistration is
        // deferred. Only a registration of a `'static` slice can be there (a host function is
        // `'static`), so the memory outlives the deferral; elsewhere it runs now, before the
        // borrow of the slice ends.
        // (Not `context::drop_call`: its retry after a failed bind would come after the borrow
        // of a slice that is not `'static` ended.)
        let (ptr, ctx) =
            (crate::host_fn::SendHandle(self.slice.as_mut_ptr().cast::<std::ffi::c_void>()), self.ctx.clone());
        crate::host_fn::now_or_deferred(move || {
            bound_drop_call(&ctx, || {
                let _relaxed = RelaxedCaptureMode::enter();
                // SAFETY: the memory was registered by `register_host` and is unregistered once;
                // the context is current.
                unsafe { drv!(cuMemHostUnregister(ptr.get())) }
            });
        });
    }
}

impl<T: DeviceRepr> fmt::Debug for HostRegistration<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration").field("len", &self.slice.len()).finish()
    }
}

//! Host-side memory: pinned buffers, the pinned and managed resources, host registration.

use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of_val;
use std::sync::{Arc, Mutex};

use super::buffer::{DeviceRepr, byte_len};
use super::{DevicePtr, MemoryResource, ResourceKind, check_stream};
use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::Result;
use crate::event::Event;
use crate::result::{check, driver, drv};
use crate::stream::Stream;

/// Page-locked ("pinned") host memory for `len` elements of `T` (`cuMemHostAlloc`, portable to
/// every context), the host side of asynchronous copies.
///
/// While an asynchronous copy may still read or write it, host access waits: [`as_slice`],
/// [`as_mut_slice`] and `Drop` first wait for every copy queued with this buffer. So safe code
/// can neither read data the GPU is still writing nor change or free memory the GPU is still
/// reading.
///
/// [`as_slice`]: PinnedBuffer::as_slice
/// [`as_mut_slice`]: PinnedBuffer::as_mut_slice
pub struct PinnedBuffer<T: DeviceRepr> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<Context>,
    pending: Mutex<Vec<Event>>,
    _t: PhantomData<T>,
}

// SAFETY: the buffer owns its memory (like a Box<[T]>) and T is Send + Sync; the pending list
// is behind a Mutex.
unsafe impl<T: DeviceRepr> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads (after waiting for pending copies) or appends to the Mutex.
unsafe impl<T: DeviceRepr> Sync for PinnedBuffer<T> {}

impl<T: DeviceRepr> PinnedBuffer<T> {
    /// `len` zeroed elements of pinned memory, not write-combined.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) on overflow; the driver's error (out of memory).
    pub fn new(device: &Device, len: usize) -> Result<PinnedBuffer<T>> {
        Self::with_flags(device, len, false)
    }

    /// As [`PinnedBuffer::new`], write-combined when `write_combined` is set: faster for the GPU
    /// to read over PCIe, very slow for the host to read. Off by default (cudarc #579).
    ///
    /// # Errors
    /// As [`PinnedBuffer::new`].
    pub fn with_flags(device: &Device, len: usize, write_combined: bool) -> Result<PinnedBuffer<T>> {
        let bytes = byte_len::<T>(len)?;
        let ctx = device.primary_context()?;
        let ptr = host_alloc(&ctx, bytes, write_combined)?;
        // SAFETY: `ptr` is valid for `bytes` bytes; zero bits are a valid T (DeviceRepr).
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(PinnedBuffer { ptr: ptr.cast(), len, ctx, pending: Mutex::new(Vec::new()), _t: PhantomData })
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
        // SAFETY: no copy is pending, so nothing writes the memory; it is valid for `len`.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// The contents, mutable, after waiting for queued copies.
    ///
    /// # Errors
    /// The driver's error while waiting.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        // SAFETY: no copy is pending and `&mut self` excludes new ones; valid for `len`.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Waits for every copy queued with this buffer.
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait(&self) -> Result<()> {
        let mut pending = self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while let Some(ev) = pending.last() {
            ev.synchronize()?;
            pending.pop();
        }
        Ok(())
    }

    pub(crate) fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// The pointer, without waiting: only for queuing a copy, which `add_pending` then tracks.
    pub(crate) fn as_mut_ptr_unsynced(&mut self) -> *mut T {
        self.ptr
    }

    /// Records that a copy queued on `stream` uses the buffer.
    pub(crate) fn add_pending(&self, stream: &Stream) -> Result<()> {
        let event = Event::new(&stream.device())?;
        let recorded = event.record(stream);
        if let Err(e) = recorded {
            // The copy is queued but cannot be tracked: wait for it here rather than risk a race.
            stream.synchronize()?;
            return Err(e);
        }
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(event);
        Ok(())
    }
}

impl<T: DeviceRepr> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            // The copy may still run: leaking the memory is the only sound choice.
            report_drop_error(Some(&self.ctx), e);
            return;
        }
        host_free(&self.ctx, self.ptr.cast());
    }
}

impl<T: DeviceRepr> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

fn host_alloc(ctx: &Context, bytes: usize, write_combined: bool) -> Result<*mut std::ffi::c_void> {
    let mut flags = cudrv_sys::CU_MEMHOSTALLOC_PORTABLE;
    if write_combined {
        flags |= cudrv_sys::CU_MEMHOSTALLOC_WRITECOMBINED;
    }
    let _b = ctx.bind()?;
    let mut ptr = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context is current. Zero bytes take one.
    unsafe { drv!(cuMemHostAlloc(&mut ptr, bytes.max(1), flags)) }?;
    Ok(ptr)
}

fn host_free(ctx: &Context, ptr: *mut std::ffi::c_void) {
    let Ok(_b) = ctx.make_current() else { return };
    let Ok(d) = driver() else { return };
    // SAFETY: `ptr` came from cuMemHostAlloc and no copy uses it any more.
    if let Err(e) = check("cuMemFreeHost", unsafe { d.cuMemFreeHost(ptr) }) {
        report_drop_error(Some(ctx), e);
    }
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
        stream.synchronize()?;
        let _b = self.ctx.bind()?;
        // SAFETY: the caller passes memory from `allocate`; the stream's uses are complete.
        unsafe { drv!(cuMemFreeHost(ptr as *mut std::ffi::c_void)) }
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

/// Managed (unified) memory as a [`MemoryResource`] (`cuMemAllocManaged`, attached globally),
/// gated on the device's managed-memory support. A free waits for its stream first.
#[derive(Debug)]
pub struct ManagedResource {
    ctx: Arc<Context>,
}

impl ManagedResource {
    /// A resource on `device`.
    ///
    /// # Errors
    /// [`Error::Unsupported`](crate::Error::Unsupported) when the device has no managed memory.
    pub fn new(device: &Device) -> Result<ManagedResource> {
        if !device.capabilities()?.managed_memory {
            return Err(device.unsupported(
                "managed memory",
                "CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY is 0",
                Some("DeviceBuffer with explicit copies"),
            ));
        }
        Ok(ManagedResource { ctx: device.primary_context()? })
    }
}

// SAFETY: fresh managed memory; a free first waits for the stream.
unsafe impl MemoryResource for ManagedResource {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream("ManagedResource::allocate", self.device(), stream)?;
        let _b = self.ctx.bind()?;
        let mut ptr = 0;
        let flags = cudrv_sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL.0;
        // SAFETY: valid out-pointer; the context is current.
        unsafe { drv!(cuMemAllocManaged(&mut ptr, bytes.max(1), flags)) }?;
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, _bytes: usize, stream: &Stream) -> Result<()> {
        stream.synchronize()?;
        let _b = self.ctx.bind()?;
        // SAFETY: the caller passes memory from `allocate`; the stream's uses are complete.
        unsafe { drv!(cuMemFree_v2(ptr)) }
    }

    fn device(&self) -> Device {
        self.ctx.device()
    }

    fn kind(&self) -> ResourceKind {
        ResourceKind::Managed
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
/// [`Error::Unsupported`](crate::Error::Unsupported) when the device cannot register host memory; the driver's error.
pub fn register_host<'a, T: DeviceRepr>(device: &Device, slice: &'a mut [T]) -> Result<HostRegistration<'a, T>> {
    if !device.capabilities()?.host_register {
        return Err(device.unsupported(
            "host memory registration",
            "CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED is 0",
            Some("PinnedBuffer"),
        ));
    }
    let ctx = device.primary_context()?;
    if !slice.is_empty() {
        let _b = ctx.bind()?;
        // SAFETY: the slice is valid for its length and stays borrowed until unregistered.
        unsafe {
            drv!(cuMemHostRegister_v2(
                slice.as_mut_ptr().cast(),
                std::mem::size_of_val(slice),
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
        if self.slice.is_empty() {
            return;
        }
        let Ok(_b) = self.ctx.make_current() else { return };
        let Ok(d) = driver() else { return };
        // SAFETY: the memory was registered by `register_host` and is unregistered once.
        if let Err(e) = check("cuMemHostUnregister", unsafe { d.cuMemHostUnregister(self.slice.as_mut_ptr().cast()) }) {
            report_drop_error(Some(&self.ctx), e);
        }
    }
}

impl<T: DeviceRepr> fmt::Debug for HostRegistration<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration").field("len", &self.slice.len()).finish()
    }
}

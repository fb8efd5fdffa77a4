//! `DeviceBuffer<T>`: typed device memory, freed in stream order, with copies.

use std::fmt;
use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::ops::{Bound as RangeBound, RangeBounds};
use std::sync::{Arc, Mutex};

use super::host::PinnedBuffer;
use super::{DevicePtr, MemoryResource, check_stream};
use crate::context::report_drop_error;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::result::drv;
use crate::stream::Stream;

/// Plain-old-data types that may live in device memory and be copied byte-wise to and from it.
///
/// # Safety
/// The type must be `Copy`, have no padding bytes, contain no pointers
/// or references that the device copy would invalidate, and *every bit pattern* must be a valid
/// value (device memory can hold anything, including zeroes from `memset`). Implement it for
/// `#[repr(C)]` structs of such fields:
///
/// ```
/// #[derive(Clone, Copy)]
/// #[repr(C)]
/// struct Particle { x: f32, y: f32, mass: f32, id: u32 }
/// // SAFETY: repr(C), four 4-byte fields (no padding), any bits are a valid value.
/// unsafe impl cudrv::memory::DeviceRepr for Particle {}
/// ```
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}

macro_rules! device_repr {
    ($($t:ty),*) => { $(
        // SAFETY: a primitive number: no padding, every bit pattern is valid.
        unsafe impl DeviceRepr for $t {}
    )* };
}
device_repr!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);

// SAFETY: an array of such values has no padding between elements and inherits their validity.
unsafe impl<T: DeviceRepr, const N: usize> DeviceRepr for [T; N] {}

/// The alignment every [`MemoryResource`] guarantees, and so the most a [`DeviceBuffer`]'s element
/// type may need.
pub(crate) const MAX_ALIGN: usize = 256;

/// Bytes for `len` elements of `T`, or an error when that overflows.
pub(crate) fn byte_len<T>(len: usize) -> Result<usize> {
    len.checked_mul(size_of::<T>())
        .filter(|b| *b <= isize::MAX as usize)
        .ok_or_else(|| Error::InvalidArgument(format!("{len} elements of {} bytes overflow", size_of::<T>())))
}

/// A buffer of `T` in device memory, from a [`MemoryResource`], allocated on a stream.
///
/// * It is freed in stream order on its stream when dropped: the memory is reused only after
///   the work queued on that stream before the drop.
/// * Used on another stream ([`DeviceBuffer::record_use`], done for you by cudrv's copies and
///   launches), it makes its free wait for that stream's work too (as PyTorch's `record_stream`),
///   so the memory is never reused while another stream may still touch it.
/// * The synchronous copies (`copy_from_host`, `copy_to_host`, `to_vec`) run on the buffer's
///   stream and wait for it; the asynchronous ones take a [`PinnedBuffer`], which blocks host
///   access to itself until the copy is done.
/// * As everywhere in CUDA, work on *different* streams is ordered only by you
///   ([`Stream::wait_stream`], [`Stream::wait_event`]): a buffer written on stream B and read
///   with `to_vec` (on its own stream A) needs A to wait for B first. cudrv orders what memory
///   safety needs (the buffer's free, and host access to pinned memory); the order of your data
///   between streams is yours.
///
/// ```no_run
/// use cudrv::{Device, Stream, memory::DeviceBuffer};
/// let stream = Stream::new(&Device::get(0)?)?;
/// let buf = DeviceBuffer::from_slice(&[1u32, 2, 3], &stream)?;
/// assert_eq!(buf.to_vec()?, [1, 2, 3]);
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct DeviceBuffer<T: DeviceRepr> {
    ptr: DevicePtr,
    len: usize,
    resource: ResourceRef,
    stream: Stream,
    used_on: Mutex<Vec<Stream>>,
    _t: PhantomData<T>,
}

/// Where a buffer's memory came from: the device's resource (which lives for the rest of the
/// process, so the buffer holds it without a reference count that every thread would share), or
/// one the caller gave.
#[derive(Clone)]
enum ResourceRef {
    Device(&'static dyn MemoryResource),
    Given(Arc<dyn MemoryResource>),
}

impl std::ops::Deref for ResourceRef {
    type Target = dyn MemoryResource;

    #[inline]
    fn deref(&self) -> &(dyn MemoryResource + 'static) {
        match self {
            ResourceRef::Device(r) => *r,
            ResourceRef::Given(r) => &**r,
        }
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// A buffer of `len` elements on `stream`, from the device's [`Device::memory_resource`],
    /// with unspecified contents.
    ///
    /// # Safety
    /// The contents are whatever the memory held: every bit pattern is a valid `T`
    /// ([`DeviceRepr`]), so reading it is not undefined behaviour, but it may be another
    /// allocation's old data. The function is `unsafe` so that this is a choice.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`], [`Error::InvalidArgument`] on overflow, the driver's error.
    #[inline]
    pub unsafe fn uninit(len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let resource = super::device_resource_for_buffers(&stream.device())?;
        // SAFETY: forwarded; the device's own resource, checked device-accessible.
        unsafe { Self::allocate(ResourceRef::Device(resource), len, stream) }
    }

    /// As [`DeviceBuffer::uninit`], from `resource`.
    ///
    /// # Safety
    /// As [`DeviceBuffer::uninit`].
    ///
    /// # Errors
    /// As [`DeviceBuffer::uninit`], and [`Error::DeviceMismatch`] when the stream and the
    /// resource belong to different devices.
    pub unsafe fn uninit_in(len: usize, stream: &Stream, resource: Arc<dyn MemoryResource>) -> Result<DeviceBuffer<T>> {
        // SAFETY: forwarded.
        unsafe { Self::uninit_from(ResourceRef::Given(resource), len, stream) }
    }

    /// # Safety
    /// As [`DeviceBuffer::uninit`].
    #[inline]
    unsafe fn uninit_from(resource: ResourceRef, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        check_stream("DeviceBuffer::uninit_in", resource.device(), stream)?;
        if !resource.is_device_accessible() {
            return Err(Error::InvalidArgument(format!("{} is not device-accessible memory", resource.kind())));
        }
        // SAFETY: forwarded; checked above.
        unsafe { Self::allocate(resource, len, stream) }
    }

    /// Allocates from `resource`, which belongs to `stream`'s device and is device-accessible.
    ///
    /// # Safety
    /// As [`DeviceBuffer::uninit`].
    #[inline]
    unsafe fn allocate(resource: ResourceRef, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        if align_of::<T>() > MAX_ALIGN {
            return Err(Error::InvalidArgument(format!(
                "DeviceBuffer needs align_of::<T>() <= {MAX_ALIGN} (what memory resources guarantee); {} has {}",
                std::any::type_name::<T>(),
                align_of::<T>()
            )));
        }
        let bytes = byte_len::<T>(len)?;
        let ptr = resource.allocate(bytes, stream)?;
        if ptr % MAX_ALIGN as u64 != 0 {
            // A resource outside cudrv broke its contract; give the memory back unused.
            // SAFETY: `ptr` came from `resource` with `bytes`, and nothing has used it.
            let _ = unsafe { resource.deallocate(ptr, bytes, stream) };
            return Err(Error::InvalidArgument(format!(
                "{} returned {ptr:#x}, which is not aligned to {MAX_ALIGN} bytes",
                resource.kind()
            )));
        }
        Ok(DeviceBuffer {
            ptr,
            len,
            resource,
            stream: stream.clone(),
            used_on: Mutex::new(Vec::new()),
            _t: PhantomData,
        })
    }

    /// A buffer of `len` zeroed elements (a memset queued on `stream`).
    ///
    /// # Errors
    /// As [`DeviceBuffer::uninit`].
    pub fn zeroed(len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        // SAFETY: the memory is zeroed (in stream order) before anything can read it.
        let mut buf = unsafe { Self::uninit(len, stream)? };
        buf.memset(0)?;
        Ok(buf)
    }

    /// As [`DeviceBuffer::zeroed`], from `resource`.
    ///
    /// # Errors
    /// As [`DeviceBuffer::uninit_in`].
    pub fn zeroed_in(len: usize, stream: &Stream, resource: Arc<dyn MemoryResource>) -> Result<DeviceBuffer<T>> {
        // SAFETY: the memory is zeroed (in stream order) before anything can read it.
        let mut buf = unsafe { Self::uninit_in(len, stream, resource)? };
        buf.memset(0)?;
        Ok(buf)
    }

    /// A buffer holding a copy of `data`. Waits for the copy.
    ///
    /// # Errors
    /// As [`DeviceBuffer::uninit`].
    pub fn from_slice(data: &[T], stream: &Stream) -> Result<DeviceBuffer<T>> {
        // SAFETY: every element is written by the copy before anyone can read it.
        let mut buf = unsafe { Self::uninit(data.len(), stream)? };
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// A buffer from `resource` holding a copy of `data`. Waits for the copy.
    ///
    /// # Errors
    /// As [`DeviceBuffer::uninit_in`].
    pub fn from_slice_in(data: &[T], stream: &Stream, resource: Arc<dyn MemoryResource>) -> Result<DeviceBuffer<T>> {
        // SAFETY: every element is written by the copy before anyone can read it.
        let mut buf = unsafe { Self::uninit_in(data.len(), stream, resource)? };
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address.
    pub fn as_raw(&self) -> DevicePtr {
        self.ptr
    }

    /// The stream the buffer was allocated on and is freed on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The buffer's device.
    pub fn device(&self) -> Device {
        self.stream.device()
    }

    /// The resource the memory came from.
    pub fn resource(&self) -> &dyn MemoryResource {
        &*self.resource
    }

    /// Records that work on `stream` uses the buffer, and orders that work after the buffer's
    /// allocation. The first time a stream is recorded, it is made to wait (on the GPU) for the
    /// buffer's own stream up to now, so that nothing it runs can touch the memory before the
    /// memory is the buffer's (the pool may have taken it from a block whose previous owner still
    /// had work queued there); and the buffer's free, on its own stream, waits for that stream's
    /// work, as PyTorch's `record_stream`. Needed only for work cudrv does not queue itself (raw
    /// driver calls); cudrv's copies and launches call it.
    ///
    /// The order of *data* between streams stays the caller's: a later write on the buffer's
    /// stream is not ordered before reads already queued on `stream`.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device; the driver's error (then
    /// nothing was recorded).
    pub fn record_use(&self, stream: &Stream) -> Result<()> {
        if stream.id() == self.stream.id() {
            return Ok(());
        }
        check_stream("DeviceBuffer::record_use", self.device(), stream)?;
        self.record_use_any(stream)
    }

    /// A view of the elements in `range`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer.
    pub fn view(&self, range: impl RangeBounds<usize>) -> Result<DeviceView<'_, T>> {
        let (start, end) = bounds(range, self.len)?;
        Ok(DeviceView { ptr: self.ptr + (start * size_of::<T>()) as u64, len: end - start, buffer: self })
    }

    /// The whole buffer as a view.
    pub fn as_view(&self) -> DeviceView<'_, T> {
        DeviceView { ptr: self.ptr, len: self.len, buffer: self }
    }

    /// Sets every byte to `byte` (queued on the buffer's stream).
    ///
    /// # Errors
    /// The driver's error.
    pub fn memset(&mut self, byte: u8) -> Result<()> {
        memset_range(self.ptr, self.byte_len(), byte, &self.stream)
    }

    /// Sets every element to `value`, for element sizes of 1, 2 or 4 bytes (queued on the
    /// buffer's stream).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for other sizes; the driver's error.
    pub fn fill(&mut self, value: T) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let _b = self.stream.context().bind()?;
        let s = self.stream.as_raw();
        // SAFETY: `value` is plain data of the matched size; reading its bytes is sound.
        let bits = |n: usize| unsafe { std::slice::from_raw_parts((&raw const value).cast::<u8>(), n) }.to_vec();
        // SAFETY (all three): the range is this buffer's memory; the fill is ordered on its stream.
        match size_of::<T>() {
            1 => unsafe { drv!(cuMemsetD8Async(self.ptr, bits(1)[0], self.len, s)) },
            2 => {
                let b = bits(2);
                unsafe { drv!(cuMemsetD16Async(self.ptr, u16::from_ne_bytes([b[0], b[1]]), self.len, s)) }
            }
            4 => {
                let b = bits(4);
                unsafe { drv!(cuMemsetD32Async(self.ptr, u32::from_ne_bytes([b[0], b[1], b[2], b[3]]), self.len, s)) }
            }
            n => Err(Error::InvalidArgument(format!("fill needs 1-, 2- or 4-byte elements, not {n}-byte ones"))),
        }
    }

    /// Copies `src` into the buffer and waits for the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; the driver's error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.as_view().copy_from_host_inner(src)
    }

    /// Copies the buffer into `dst` and waits for the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; the driver's error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.as_view().copy_to_host(dst)
    }

    /// The buffer's contents, copied to a `Vec` (waits for the buffer's stream).
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.as_view().to_vec()
    }

    /// Queues a copy from pinned host memory on the buffer's stream and returns at once. `src`
    /// cannot be changed or freed until the copy is done: its host access waits for it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; the driver's error.
    pub fn copy_from_pinned_async(&mut self, src: &PinnedBuffer<T>) -> Result<()> {
        check_len(self.len, src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let copy = src.prepare(&self.stream)?;
        {
            let _b = self.stream.context().bind()?;
            // SAFETY: both ranges are valid for `byte_len` bytes; `src` stays allocated and
            // unchanged until the copy is done (`commit` tracks it, and PinnedBuffer's host access
            // and drop wait for it).
            unsafe {
                drv!(cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), self.byte_len(), self.stream.as_raw()))
            }?;
        }
        src.commit(copy, &self.stream);
        Ok(())
    }

    /// Queues a copy into pinned host memory on the buffer's stream and returns at once. `dst`
    /// cannot be read, changed or freed until the copy is done: its host access waits for it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; the driver's error.
    pub fn copy_to_pinned_async(&self, dst: &mut PinnedBuffer<T>) -> Result<()> {
        check_len(self.len, dst.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let copy = dst.prepare(&self.stream)?;
        {
            let _b = self.stream.context().bind()?;
            // SAFETY: as in copy_from_pinned_async; `dst` waits for the copy before host access.
            unsafe {
                drv!(cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr_unsynced().cast(),
                    self.ptr,
                    self.byte_len(),
                    self.stream.as_raw()
                ))
            }?;
        }
        dst.commit(copy, &self.stream);
        Ok(())
    }

    /// Copies `src` (same device) into this buffer, queued on this buffer's stream. `src`'s use
    /// on that stream is recorded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ, [`Error::DeviceMismatch`] across
    /// devices (use [`DeviceBuffer::copy_to_peer`]); the driver's error.
    pub fn copy_from(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        check_len(self.len, src.len)?;
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch {
                what: "DeviceBuffer::copy_from (use copy_to_peer across devices)",
                expected: self.device().ordinal_i32(),
                found: src.device().ordinal_i32(),
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        src.record_use(&self.stream)?;
        let _b = self.stream.context().bind()?;
        // SAFETY: both ranges are live device memory of `byte_len` bytes, ordered on the stream.
        unsafe { drv!(cuMemcpyDtoDAsync_v2(self.ptr, src.ptr, self.byte_len(), self.stream.as_raw())) }
    }

    /// Copies this buffer into `dst` on another (or the same) device, queued on `stream` (of
    /// either device) with `cuMemcpyPeerAsync`. Works with and without peer access enabled.
    /// Both buffers' use on `stream` is recorded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; [`Error::DeviceMismatch`] when
    /// `stream` belongs to neither device; the driver's error.
    pub fn copy_to_peer(&self, dst: &mut DeviceBuffer<T>, stream: &Stream) -> Result<()> {
        check_len(self.len, dst.len)?;
        if stream.device() != self.device() && stream.device() != dst.device() {
            return Err(Error::DeviceMismatch {
                what: "DeviceBuffer::copy_to_peer (the stream must belong to one of the two devices)",
                expected: self.device().ordinal_i32(),
                found: stream.device().ordinal_i32(),
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        // Record on the buffer of the stream's device directly; the other buffer's free waits on
        // an event, which works across devices.
        self.record_use_any(stream)?;
        dst.record_use_any(stream)?;
        let _b = stream.context().bind()?;
        let (dctx, sctx) = (dst.stream.context().as_raw(), self.stream.context().as_raw());
        // SAFETY: both ranges are live memory of their contexts, ordered on `stream`.
        unsafe { drv!(cuMemcpyPeerAsync(dst.ptr, dctx, self.ptr, sctx, self.byte_len(), stream.as_raw())) }
    }

    /// [`DeviceBuffer::record_use`] for a stream of any device (peer copies): events order
    /// streams across devices too.
    fn record_use_any(&self, stream: &Stream) -> Result<()> {
        if stream.id() == self.stream.id() {
            return Ok(());
        }
        let mut used = self.used_on.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !used.contains(stream) {
            stream.wait_stream(&self.stream)?;
            used.push(stream.clone());
        }
        Ok(())
    }
}

impl<T: DeviceRepr> Drop for DeviceBuffer<T> {
    #[inline]
    fn drop(&mut self) {
        let bytes = self.byte_len();
        let used_on = self.used_on.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if used_on.is_empty() && !crate::host_fn::in_host_fn() {
            // The usual case: used on its own stream only.
            // SAFETY: the pointer came from this resource with this size and is freed once; every
            // use is queued on the buffer's stream.
            if let Err(e) = unsafe { self.resource.deallocate(self.ptr, bytes, &self.stream) } {
                report_drop_error(Some(self.stream.context()), e);
            }
            return;
        }
        let used_on = std::mem::take(used_on);
        if crate::host_fn::in_host_fn() {
            let (resource, ptr, stream) = (self.resource.clone(), self.ptr, self.stream.clone());
            crate::host_fn::defer(move || free_after_uses(&*resource, ptr, bytes, &stream, &used_on));
        } else {
            free_after_uses(&*self.resource, self.ptr, bytes, &self.stream, &used_on);
        }
    }
}

/// A buffer's stream-ordered free, after the work of every stream it was used on. An error leaks
/// the memory (it may still be in use, or the resource refused it), which is sound, and is
/// reported as a drop error.
fn free_after_uses(resource: &dyn MemoryResource, ptr: DevicePtr, bytes: usize, stream: &Stream, used_on: &[Stream]) {
    let freed = (|| {
        for other in used_on {
            if stream.wait_stream(other).is_err() {
                // Cannot order the free after `other` on the GPU: wait for it on the host (this
                // never returns while its work may still run). If even that fails, the memory leaks.
                other.wait_for_memory()?;
            }
        }
        // SAFETY: the pointer came from this resource with this size and is freed once; every use
        // is queued on `stream` or ordered before this point (above).
        unsafe { resource.deallocate(ptr, bytes, stream) }
    })();
    if let Err(e) = freed {
        report_drop_error(Some(stream.context()), e);
    }
}

impl<T: DeviceRepr> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device().ordinal())
            .field("resource", &self.resource.kind())
            .finish()
    }
}

/// A borrowed range of a [`DeviceBuffer`].
#[derive(Clone, Copy)]
pub struct DeviceView<'a, T: DeviceRepr> {
    ptr: DevicePtr,
    len: usize,
    buffer: &'a DeviceBuffer<T>,
}

impl<T: DeviceRepr> DeviceView<'_, T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first element.
    pub fn as_raw(&self) -> DevicePtr {
        self.ptr
    }

    /// The buffer the view borrows.
    pub fn buffer(&self) -> &DeviceBuffer<T> {
        self.buffer
    }

    /// Copies the view into `dst` and waits for the copy (on the buffer's stream).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; the driver's error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        check_len(self.len, dst.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let stream = &self.buffer.stream;
        let _b = stream.context().bind()?;
        // SAFETY: the source is live device memory; `dst` is valid for writes of that many bytes
        // and stays borrowed until the stream is synchronised below.
        unsafe {
            drv!(cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, self.len * size_of::<T>(), stream.as_raw()))
        }?;
        // Waits even if an unrelated error is pending, and never returns while the copy may
        // still write `dst` (it may be pinned or registered, and then the copy is asynchronous).
        stream.wait_for_memory()
    }

    /// The view's contents as a `Vec`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(self.len);
        let spare = v.spare_capacity_mut();
        // SAFETY: MaybeUninit<T> has T's layout; the copy writes all `len` elements (or fails, and
        // then the length stays 0).
        let dst = unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr().cast::<T>(), self.len) };
        self.copy_to_host(dst)?;
        // SAFETY: all `len` elements were written by the completed copy.
        unsafe { v.set_len(self.len) };
        Ok(v)
    }

    fn copy_from_host_inner(&self, src: &[T]) -> Result<()> {
        check_len(self.len, src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let stream = &self.buffer.stream;
        let _b = stream.context().bind()?;
        // SAFETY: the destination is live device memory the caller holds mutably (through the
        // buffer); `src` stays borrowed until the stream is synchronised below.
        unsafe {
            drv!(cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), self.len * size_of::<T>(), stream.as_raw()))
        }?;
        stream.wait_for_memory()
    }
}

impl<T: DeviceRepr> fmt::Debug for DeviceView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceView").field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}

fn bounds(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        RangeBound::Included(&s) => s,
        RangeBound::Excluded(&s) => s.checked_add(1).ok_or_else(|| Error::InvalidArgument("range overflows".into()))?,
        RangeBound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        RangeBound::Included(&e) => e.checked_add(1).ok_or_else(|| Error::InvalidArgument("range overflows".into()))?,
        RangeBound::Excluded(&e) => e,
        RangeBound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::InvalidArgument(format!("range {start}..{end} is outside a buffer of {len} elements")));
    }
    Ok((start, end))
}

fn check_len(expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "length mismatch: the device side has {expected} elements, the other {found}"
        )))
    }
}

/// Queues a byte memset of `bytes` bytes at `ptr` on `stream`.
pub(crate) fn memset_range(ptr: DevicePtr, bytes: usize, byte: u8, stream: &Stream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let _b = stream.context().bind()?;
    // SAFETY: the caller passes live device memory of `bytes` bytes it may write.
    unsafe { drv!(cuMemsetD8Async(ptr, byte, bytes, stream.as_raw())) }
}

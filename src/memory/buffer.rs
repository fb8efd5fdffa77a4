//! `DeviceBuffer<T>`: typed device memory, freed in stream order, with copies.

use std::fmt;
use std::marker::PhantomData;
use std::mem::{ManuallyDrop, MaybeUninit, align_of, size_of};
use std::ops::{Bound as RangeBound, RangeBounds};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::host::PinnedBuffer;
use super::uses::{FreeStreams, Held, order_after_uses};
use super::{
    DevicePtr, DeviceResource, MemoryResource, StreamOrderedPool, UseGates, check_len, check_stream, unless_capturing,
};
use crate::context::report_drop_error;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::result::drv;
use crate::session::{CaptureSession, GraphOwned, GraphUse};
use crate::stream::{Gate, Stream, StreamPin, lend_gates};

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
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
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
    /// A view of the buffer's stream (see [`StreamPin`]), which no `Stream` counts as a user:
    /// with [`ResourceRef::Kept`] the pool's pin keeps it valid until the buffer's free, else it
    /// is the buffer's own pin ([`StreamPin::for_buffer`]), let go by hand in `Drop`.
    stream: ManuallyDrop<Stream>,
    /// Whether the buffer's own pin is its stream owner's (counted without a read-modify-write).
    owner_pin: bool,
    /// The capture the buffer was allocated in (its memory then belongs to that capture's graph),
    /// or 0.
    capture: u64,
    /// Made on the first use on another stream or in a capture: most buffers never need it, and
    /// an empty one would cost every buffer's creation and drop.
    uses: Mutex<Option<Box<Uses>>>,
    _t: PhantomData<T>,
}

/// What a buffer's free must wait for besides its own stream.
#[derive(Default)]
struct Uses {
    /// Other streams it was used on.
    streams: Vec<Stream>,
    /// Graphs whose capture used it (allocated before the capture).
    graphs: Vec<GraphUse>,
}

impl Uses {
    #[inline]
    fn is_empty(&self) -> bool {
        self.streams.is_empty() && self.graphs.is_empty()
    }
}

/// Where a buffer's memory came from: the device's resource (which lives for the rest of the
/// process, so the buffer holds it without a reference count that every thread would share), or
/// one the caller gave.
#[derive(Clone)]
enum ResourceRef {
    Device(&'static dyn MemoryResource),
    /// The device's [`StreamOrderedPool`], which holds the allocation in the stream's cache and
    /// so keeps the stream pinned until it is freed: the buffer's stream is a view, and the
    /// buffer touches no shared reference count at all.
    Kept(&'static StreamOrderedPool),
    Given(Arc<dyn MemoryResource>),
}

impl ResourceRef {
    /// The resource as a [`StreamOrderedPool`], if it is one (the device's, or one given).
    #[inline]
    fn stream_ordered_pool(&self) -> Option<&StreamOrderedPool> {
        match self {
            ResourceRef::Kept(pool) => Some(pool),
            r => (&**r as &dyn std::any::Any).downcast_ref(),
        }
    }
}

impl std::ops::Deref for ResourceRef {
    type Target = dyn MemoryResource;

    #[inline]
    fn deref(&self) -> &(dyn MemoryResource + 'static) {
        match self {
            ResourceRef::Device(r) => *r,
            ResourceRef::Kept(p) => *p,
            ResourceRef::Given(r) => &**r,
        }
    }
}

/// The bytes of `len` elements of `T` for a buffer of kind `what` whose memory comes from a memory
/// resource or the driver: [`Error::InvalidArgument`] when `T` needs more alignment than they
/// guarantee ([`MAX_ALIGN`]: host slices and kernels would see misaligned elements), or on
/// overflow.
#[inline]
pub(crate) fn aligned_bytes<T>(what: &str, len: usize) -> Result<usize> {
    if align_of::<T>() > MAX_ALIGN {
        return Err(Error::InvalidArgument(format!(
            "{what} needs align_of::<T>() <= {MAX_ALIGN} (what memory resources guarantee); {} has {}",
            std::any::type_name::<T>(),
            align_of::<T>()
        )));
    }
    byte_len::<T>(len)
}

/// `dst` as memory for a copy from the device to write: only whole `T`s are written through the
/// result (device bytes, every pattern of which is a valid `T`: [`DeviceRepr`]), so `dst` stays
/// initialised.
#[inline]
pub(crate) fn as_uninit<T: DeviceRepr>(dst: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: `MaybeUninit<T>` has `T`'s size, alignment and layout, and every `T` is a valid
    // `MaybeUninit<T>`; what is written through the result is a valid `T` (above).
    unsafe { &mut *(std::ptr::from_mut(dst) as *mut [MaybeUninit<T>]) }
}

/// A `Vec` of the `len` elements that `fill` writes, without a reference to them before they are
/// written.
///
/// # Safety
/// `fill` returns `Ok` only once it has written all `len` elements (with valid `T`s), and writes
/// nothing after it returns.
#[inline]
pub(crate) unsafe fn vec_written<T>(
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<T>]) -> Result<()>,
) -> Result<Vec<T>> {
    let mut v = Vec::with_capacity(len);
    fill(&mut v.spare_capacity_mut()[..len])?;
    // SAFETY: all `len` elements were written (the caller's promise).
    unsafe { v.set_len(len) };
    Ok(v)
}

/// Checks that `resource` kept its contract to align `ptr` to [`MAX_ALIGN`] bytes; a resource
/// outside cudrv that broke it gets the memory back unused, and the caller an error.
///
/// # Safety
/// `ptr` came from `resource` with `bytes` on `stream`, and nothing has used it: it may be freed.
#[inline]
unsafe fn check_aligned(resource: &dyn MemoryResource, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
    if ptr.is_multiple_of(MAX_ALIGN as u64) {
        return Ok(());
    }
    // SAFETY: as the caller promised.
    let _ = unsafe { resource.deallocate(ptr, bytes, stream) };
    Err(Error::InvalidArgument(format!(
        "{} returned {ptr:#x}, which is not aligned to {MAX_ALIGN} bytes",
        resource.kind()
    )))
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
        let resource = match super::device_resource_for_buffers(&stream.device())? {
            DeviceResource::StreamOrdered(pool) if stream.key().capture_id() == 0 => {
                // SAFETY: forwarded; the device's own pool, and no capture.
                return unsafe { Self::allocate_kept(pool, len, stream) };
            }
            DeviceResource::StreamOrdered(pool) => ResourceRef::Kept(pool),
            DeviceResource::Other(r) => {
                // Its allocation may be queued on the stream (a driver pool's): under the
                // stream's gate no capture begins between the look and the allocation, which
                // would make it the graph's allocation unseen.
                let gate = stream.key().enter();
                if stream.key().capture_id() == 0 {
                    // SAFETY: forwarded; the device's own resource, and no capture.
                    return unsafe { Self::allocate_uncaptured(r, len, stream, &gate) };
                }
                ResourceRef::Device(r)
            }
        };
        // SAFETY: forwarded; the device's own resource, checked device-accessible.
        unsafe { Self::allocate(resource, len, stream) }
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

    /// The bytes of `len` elements, for a buffer: `T` must not need more alignment than
    /// resources give.
    #[inline]
    fn buffer_bytes(len: usize) -> Result<usize> {
        aligned_bytes::<T>("DeviceBuffer", len)
    }

    /// The usual case of [`DeviceBuffer::uninit`]: from the device's `StreamOrderedPool`, on a
    /// stream that showed no capture. The pool keeps the stream for the buffer.
    ///
    /// # Safety
    /// As [`DeviceBuffer::uninit`]; `pool` is the resource of `stream`'s device.
    #[inline]
    unsafe fn allocate_kept(pool: &'static StreamOrderedPool, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let ptr = pool.allocate_kept(Self::buffer_bytes(len)?, stream)?;
        Ok(DeviceBuffer {
            ptr,
            len,
            resource: ResourceRef::Kept(pool),
            // SAFETY: the pool holds the allocation in `stream`'s cache, so it keeps the stream
            // pinned until the allocation is freed; the buffer frees it last, in `Drop`, and does
            // not use the view after.
            stream: unsafe { StreamPin::view(stream) },
            owner_pin: false,
            capture: 0,
            uses: Mutex::new(None),
            _t: PhantomData,
        })
    }

    /// The usual case of [`DeviceBuffer::uninit`] for the device's other resources: on a stream
    /// that showed no capture, under its gate (held by the caller). Built in place, as [`DeviceBuffer::allocate_kept`]: the general
    /// path moves the resource's enum, which the profile showed stalling on the H200's host.
    ///
    /// # Safety
    /// As [`DeviceBuffer::uninit`]; `resource` is the resource of `stream`'s device.
    #[inline]
    unsafe fn allocate_uncaptured(
        resource: &'static dyn MemoryResource,
        len: usize,
        stream: &Stream,
        gate: &Gate<'_>,
    ) -> Result<DeviceBuffer<T>> {
        let bytes = Self::buffer_bytes(len)?;
        let ptr = resource.allocate(bytes, stream)?;
        // SAFETY: forwarded; `ptr` came from `resource` with `bytes` on `stream`, unused.
        unsafe { check_aligned(resource, ptr, bytes, stream)? };
        let (stream, owner_pin) = StreamPin::for_buffer(stream, gate);
        Ok(DeviceBuffer {
            ptr,
            len,
            resource: ResourceRef::Device(resource),
            stream,
            owner_pin,
            capture: 0,
            uses: Mutex::new(None),
            _t: PhantomData,
        })
    }

    /// Allocates from `resource`, which belongs to `stream`'s device and is device-accessible.
    ///
    /// # Safety
    /// As [`DeviceBuffer::uninit`].
    #[inline]
    unsafe fn allocate(resource: ResourceRef, len: usize, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let bytes = Self::buffer_bytes(len)?;
        // Another resource's allocation may be stream-ordered (a driver pool's): under the
        // stream's gate no capture begins between the look and the allocation, which would make
        // it the graph's allocation unseen. A `StreamOrderedPool`'s needs no gate outside a
        // capture: its block comes from the stream's cache, valid outside any graph, and its
        // later uses see the capture. (Nor should it hold one: when it runs out of memory it
        // waits on the host for other streams' frees, which may wait for a capture that another
        // thread begins on this stream.) Inside one, the gate keeps the capture from ending
        // between the look and the count of the capture's live buffers (`end_capture` looks at
        // that count).
        //
        // Without the gate the stream is looked at once: a capture that another thread begins
        // after that look must not count the buffer as its own (it is not the graph's memory),
        // and the pool hands out a block of the stream's cache, which a capture begun meanwhile
        // does not take. Under the gate the look is taken again, and holds.
        let pool = resource.stream_ordered_pool().is_some();
        let look = stream.key().capture_id();
        let gate = (!pool || look != 0).then(|| stream.key().enter());
        let capture = if gate.is_some() { stream.key().capture_id() } else { 0 };
        // A pool's capture that ended before the gate was entered: no capture, seen under the
        // gate, which then goes (a pool holds none outside a capture).
        let gate = gate.filter(|_| !pool || capture != 0);
        let session = if capture == 0 { None } else { Self::capture_for_allocation(&resource, stream)? };
        let (ptr, resource) = match resource {
            ResourceRef::Kept(pool) if gate.is_none() => (pool.allocate_kept(bytes, stream)?, resource),
            ResourceRef::Kept(pool) => match pool.allocate_keeping(bytes, stream)? {
                (ptr, true) => (ptr, resource),
                // A graph's block: the pool does not keep the stream for it.
                (ptr, false) => (ptr, ResourceRef::Device(pool)),
            },
            r => {
                let ptr = match r.stream_ordered_pool() {
                    Some(pool) if gate.is_none() => pool.allocate_uncaptured(bytes, stream)?,
                    _ => r.allocate(bytes, stream)?,
                };
                (ptr, r)
            }
        };
        // SAFETY: forwarded; `ptr` came from `resource` with `bytes` on `stream`, unused.
        unsafe { check_aligned(&*resource, ptr, bytes, stream)? };
        let capture = match session {
            Some(s) => {
                s.live_buffers.fetch_add(1, Ordering::AcqRel);
                s.id
            }
            None => 0,
        };
        let (stream, owner_pin) = match (&resource, &gate) {
            // SAFETY: the pool holds the allocation in `stream`'s cache, so it keeps the stream
            // pinned until the allocation is freed; the buffer frees it last, in `Drop`, and does
            // not use the view after.
            (ResourceRef::Kept(_), _) => (unsafe { StreamPin::view(stream) }, false),
            (_, Some(gate)) => StreamPin::for_buffer(stream, gate),
            (_, None) => (StreamPin::new(stream).into_view(), false),
        };
        Ok(DeviceBuffer { ptr, len, resource, stream, owner_pin, capture, uses: Mutex::new(None), _t: PhantomData })
    }

    /// The capture an allocation on `stream` takes part in (`stream` showed a capture id), if
    /// cudrv tracks it; refused for resources that cannot allocate inside a graph.
    #[cold]
    fn capture_for_allocation(resource: &ResourceRef, stream: &Stream) -> Result<Option<Arc<CaptureSession>>> {
        let Some(session) = stream.capture() else { return Ok(None) };
        if !resource.supports_capture() {
            return Err(Error::Capturing {
                what: "allocating from a resource that cannot allocate inside a graph (use DriverPool or \
                       StreamOrderedPool)",
            });
        }
        Ok(Some(session))
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
        if stream.id() != self.stream.id() {
            check_stream("DeviceBuffer::record_use", self.device(), stream)?;
        }
        self.use_on(stream).map(drop)
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
        let _use = self.use_on(&self.stream)?;
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
        let bits = element_bits(&value)?;
        let _use = self.use_on(&self.stream)?;
        memset_async_range(self.ptr, self.len, bits, size_of::<T>(), &self.stream)
    }

    /// Sets every byte to `byte` and returns once it is done, after the work queued on the
    /// buffer's stream before the call: a `cuMemsetD8Async` on the buffer's stream, waited for.
    /// (The driver's synchronous memsets run on the legacy default stream, which refuses work
    /// while any blocking stream of the context captures, another thread's included, and
    /// invalidates that capture.) Work queued on the buffer's stream afterwards sees the new
    /// contents.
    ///
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
    /// use cudrv::{Device, Stream, memory::DeviceBuffer};
    /// let stream = Stream::new(&Device::get(0)?)?;
    /// let mut buf = DeviceBuffer::<u8>::zeroed(1024, &stream)?;
    /// buf.memset_sync(0xAB)?;
    /// assert_eq!(buf.to_vec()?, vec![0xAB; 1024]);
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn memset_sync(&mut self, byte: u8) -> Result<()> {
        let access = self.host_access("DeviceBuffer::memset_sync")?;
        memset_sync_range(self.ptr, self.byte_len(), u32::from(byte), 1, &self.stream, access)
    }

    /// Sets every element to `value` and returns once it is done, for element sizes of 1, 2 or 4
    /// bytes (`cuMemsetD8/16/32Async`, waited for), ordered as [`DeviceBuffer::memset_sync`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for other sizes; the driver's error.
    pub fn fill_sync(&mut self, value: T) -> Result<()> {
        let bits = element_bits(&value)?;
        let access = self.host_access("DeviceBuffer::fill_sync")?;
        memset_sync_range(self.ptr, self.len, bits, size_of::<T>(), &self.stream, access)
    }

    /// Copies the elements of `src` (a view of another buffer of the same device) into this buffer
    /// from element `offset` on, queued on `stream` (`cuMemcpyDtoDAsync`). Both buffers' uses on
    /// `stream` are recorded ([`DeviceBuffer::record_use`]), so neither is freed before the copy
    /// has run. The borrows keep the source and destination apart (use
    /// [`DeviceBuffer::copy_within`] inside one buffer).
    ///
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
    /// use cudrv::{Device, Stream, memory::DeviceBuffer};
    /// let device = Device::get(0)?;
    /// let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
    /// let src = DeviceBuffer::from_slice(&[1u32, 2, 3, 4, 5, 6], &a)?;
    /// let mut dst = DeviceBuffer::<u32>::zeroed(8, &b)?;
    /// b.wait_stream(&a)?; // the data of `src` is ready on `a`: order `b` after it
    /// dst.copy_from_view(2, &src.view(1..4)?, &b)?;
    /// assert_eq!(dst.to_vec()?, [0, 0, 2, 3, 4, 0, 0, 0]);
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the view does not fit from `offset`;
    /// [`Error::DeviceMismatch`] when `src` or `stream` belongs to another device (use
    /// [`DeviceBuffer::copy_to_peer`] across devices); the driver's error.
    pub fn copy_from_view(&mut self, offset: usize, src: &DeviceView<'_, T>, stream: &Stream) -> Result<()> {
        if offset.checked_add(src.len).is_none_or(|end| end > self.len) {
            return Err(Error::InvalidArgument(format!(
                "a view of {} elements does not fit at offset {offset} of a buffer of {} elements",
                src.len, self.len
            )));
        }
        if src.buffer.device() != self.device() {
            return Err(Error::DeviceMismatch {
                what: "DeviceBuffer::copy_from_view (use copy_to_peer across devices)",
                expected: self.device().ordinal_i32(),
                found: src.buffer.device().ordinal_i32(),
            });
        }
        check_stream("DeviceBuffer::copy_from_view", self.device(), stream)?;
        if src.len == 0 {
            return Ok(());
        }
        // The uses' gates are held until the copy is queued (as in `copy_from`): a capture begun
        // by another thread in between would take the copy into its graph unseen, and the
        // buffers could be freed before the graph runs.
        let _dst_use = self.use_on(stream)?;
        let _src_use = src.buffer.use_on(stream)?;
        let dst = self.ptr + (offset * size_of::<T>()) as u64;
        let _b = stream.context().bind()?;
        // SAFETY: both ranges lie in live buffers of this device (checked above), ordered on
        // `stream` after both buffers' allocation (`use_on`, whose gates keep a capture from
        // beginning on either stream before the copy is queued); `&mut self` and `&src` do not
        // alias.
        unsafe { drv!(cuMemcpyDtoDAsync_v2(dst, src.ptr, src.len * size_of::<T>(), stream.as_raw())) }
    }

    /// Copies the elements in `src` to the elements from `dst_offset` on, inside this buffer,
    /// queued on the buffer's stream. The two ranges must not overlap.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer, or overlapping ranges; the
    /// driver's error.
    pub fn copy_within(&mut self, src: impl RangeBounds<usize>, dst_offset: usize) -> Result<()> {
        let (start, end) = bounds(src, self.len)?;
        let n = end - start;
        if dst_offset.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(Error::InvalidArgument(format!(
                "copy_within: {n} elements do not fit at offset {dst_offset} of a buffer of {} elements",
                self.len
            )));
        }
        if n == 0 {
            return Ok(());
        }
        if start < dst_offset + n && dst_offset < end {
            return Err(Error::InvalidArgument(format!(
                "copy_within: the ranges {start}..{end} and {dst_offset}..{} overlap",
                dst_offset + n
            )));
        }
        let _use = self.use_on(&self.stream)?;
        let t = size_of::<T>() as u64;
        let _b = self.stream.context().bind()?;
        // SAFETY: both ranges lie in this buffer and do not overlap; ordered on its stream.
        unsafe {
            drv!(cuMemcpyDtoDAsync_v2(
                self.ptr + dst_offset as u64 * t,
                self.ptr + start as u64 * t,
                n * size_of::<T>(),
                self.stream.as_raw()
            ))
        }
    }

    /// Copies `src` into the buffer and waits for the copy.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.as_view().copy_from_host_inner(src)
    }

    /// Copies the buffer into `dst` and waits for the copy.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
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
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_from_pinned_async(&mut self, src: &PinnedBuffer<T>) -> Result<()> {
        check_len("the DeviceBuffer", self.len, src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let _access = self.host_access("DeviceBuffer::copy_from_pinned_async")?;
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
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_to_pinned_async(&self, dst: &mut PinnedBuffer<T>) -> Result<()> {
        check_len("the DeviceBuffer", self.len, dst.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let _access = self.host_access("DeviceBuffer::copy_to_pinned_async")?;
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
    /// [`Error::LengthMismatch`] when the lengths differ, [`Error::DeviceMismatch`] across
    /// devices (use [`DeviceBuffer::copy_to_peer`]); the driver's error.
    pub fn copy_from(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        check_len("the DeviceBuffer", self.len, src.len)?;
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
        let _dst_use = self.use_on(&self.stream)?;
        let _src_use = src.use_on(&self.stream)?;
        let _b = self.stream.context().bind()?;
        // SAFETY: both ranges are live device memory of `byte_len` bytes, ordered on the stream.
        unsafe { drv!(cuMemcpyDtoDAsync_v2(self.ptr, src.ptr, self.byte_len(), self.stream.as_raw())) }
    }

    /// Copies this buffer into `dst` on another (or the same) device, queued on `stream` (of
    /// either device) with `cuMemcpyPeerAsync`. Works with and without peer access enabled.
    /// Both buffers' use on `stream` is recorded.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; [`Error::DeviceMismatch`] when
    /// `stream` belongs to neither device; the driver's error.
    pub fn copy_to_peer(&self, dst: &mut DeviceBuffer<T>, stream: &Stream) -> Result<()> {
        check_len("the DeviceBuffer", self.len, dst.len)?;
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
        let _src_use = self.use_on(stream)?;
        let _dst_use = dst.use_on(stream)?;
        let _b = stream.context().bind()?;
        let (dctx, sctx) = (dst.stream.context().as_raw(), self.stream.context().as_raw());
        // SAFETY: both ranges are live memory of their contexts, ordered on `stream`.
        unsafe { drv!(cuMemcpyPeerAsync(dst.ptr, dctx, self.ptr, sctx, self.byte_len(), stream.as_raw())) }
    }

    /// Notes that work queued on `stream` (of any device: events order streams across devices
    /// too) uses the buffer, as [`DeviceBuffer::record_use`] describes; and, during a capture,
    /// what the graph needs (see [`crate::graph`]).
    ///
    /// Returns the gates of `stream` and of the buffer's stream (see [`crate::stream::StreamKey::enter`]): the
    /// caller holds them until its work is queued, so that no capture begins on either stream
    /// between this look at their captures and that work.
    #[inline]
    pub(crate) fn use_on<'s>(&'s self, stream: &'s Stream) -> Result<UseGates<'s>> {
        let gates = (stream.key().enter(), (stream.id() != self.stream.id()).then(|| self.stream.key().enter()));
        let capture = stream.key().capture_id();
        let owner = if stream.id() == self.stream.id() { capture } else { self.stream.key().capture_id() };
        if capture | owner | self.capture != 0 {
            self.use_in_capture(stream, capture)?;
        } else {
            self.order_use(stream)?;
        }
        Ok(gates)
    }

    /// The cross-stream part of [`DeviceBuffer::use_on`]: the first use on another stream orders
    /// that stream after the buffer's, and the free after that stream.
    #[inline]
    fn order_use(&self, stream: &Stream) -> Result<()> {
        if stream.id() == self.stream.id() {
            return Ok(());
        }
        self.with_uses(|uses| super::note_use(&mut uses.streams, &self.stream, stream))
    }

    /// A use on `stream`, which shows capture id `capture`, of a buffer that may belong to a
    /// capture itself.
    #[cold]
    fn use_in_capture(&self, stream: &Stream, capture: u64) -> Result<()> {
        let session = if capture == 0 { None } else { stream.capture() };
        if session.is_none() && stream.id() != self.stream.id() && self.stream.capture().is_some() {
            // Ordering `stream` after the buffer's capturing stream would make it join the
            // capture without cudrv (or the caller) knowing.
            return Err(Error::Capturing {
                what: "using a buffer whose stream is capturing on a stream outside the capture (make \
                       that stream join it first: stream.wait_stream(buffer.stream()))",
            });
        }
        let Some(session) = session else {
            if self.capture == 0 {
                // A capture that has ended.
                return self.order_use(stream);
            }
            return Err(Error::Capturing {
                what: "using a buffer allocated during a capture outside that capture (its memory \
                       belongs to the graph)",
            });
        };
        if session.id == self.capture {
            // Allocated in this capture: ordered inside the graph like any stream-ordered use.
            return self.order_use(stream);
        }
        if self.capture != 0 {
            return Err(Error::Capturing { what: "using a buffer allocated during another capture" });
        }
        // Allocated before the capture: the graph's launches keep it alive, and its first launch
        // waits for the allocation.
        self.with_uses(|uses| {
            if uses.graphs.iter().any(|g| g.is(&session.res)) {
                return Ok(());
            }
            // Graphs whose launches have all completed need nothing of the buffer any more.
            uses.graphs.retain(|g| !g.is_done());
            let allocated = match self.stream.key().capture_id() {
                // The buffer's stream takes part in the capture: the session noted where it stood
                // when it began or joined, after the allocation.
                id if id == session.id => None,
                _ if self.stream.capture().is_some() => {
                    return Err(Error::Capturing { what: "using a buffer whose stream is capturing another graph" });
                }
                _ => Some(crate::session::mark_before_join(&self.stream)?),
            };
            uses.graphs.push(session.res.use_buffer(allocated));
            Ok(())
        })
    }

    /// Runs `f` on the buffer's uses (made empty on the first call), under their lock.
    fn with_uses<R>(&self, f: impl FnOnce(&mut Uses) -> R) -> R {
        f(self.uses.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert_default())
    }

    /// Refuses `what` (host access: synchronous or pinned copies) on a buffer of a capture, or
    /// while its stream is capturing, or stands for the legacy default stream while a blocking
    /// stream captures (the driver would refuse the work and invalidate that capture, and the wait
    /// for the stream could not end before the capture does).
    /// Returns the gate of the buffer's stream, to hold until the access is done (see
    /// [`Stream::refuse_in_capture`]).
    #[inline]
    fn host_access(&self, what: &'static str) -> Result<Gate<'_>> {
        if self.capture != 0 {
            return Err(Error::Capturing { what });
        }
        self.stream.refuse_host_access(what)
    }
}

impl<T: DeviceRepr> Drop for DeviceBuffer<T> {
    #[inline]
    fn drop(&mut self) {
        let bytes = self.byte_len();
        let uses = self.uses.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if uses.as_ref().is_none_or(|u| u.is_empty()) && self.capture == 0 && !crate::host_fn::in_host_fn() {
            // The usual case: used on its own stream only, and no capture. The pointer came from
            // this resource with this size and is freed once; every use is queued on the
            // buffer's stream.
            match self.resource {
                // The pool's free queues nothing: a capture begun meanwhile by another thread
                // cannot take it (the block waits in the stream's cache, ordered after the work
                // queued before the capture).
                ResourceRef::Kept(pool) if self.stream.key().capture_id() == 0 => {
                    // SAFETY: as above. The pool may let go of the stream with the free: the view
                    // is not used after.
                    unsafe { pool.free_kept(self.ptr, bytes, &self.stream) };
                    return;
                }
                ResourceRef::Kept(_) => {}
                _ => {
                    // Another resource's free may queue work (or wait for the stream): under the
                    // stream's gate no capture begins between the look and the free.
                    let gates = [(self.stream.key(), self.stream.key().enter())];
                    if self.stream.key().capture_id() == 0 && !self.stream.key().legacy_held_by_capture() {
                        // The free is the last work queued under the gate: lent to the wait of a
                        // resource whose free waits for the stream (see `lend_gates`).
                        let resource = &*self.resource;
                        // SAFETY: as above.
                        let freed = lend_gates(&gates, Some(resource), || unsafe {
                            resource.deallocate(self.ptr, bytes, &self.stream)
                        });
                        if let Err(e) = freed {
                            report_drop_error(Some(self.stream.context()), e);
                        }
                        let [(_, gate)] = gates;
                        // SAFETY: the buffer's own pin, let go once, here, under its stream's
                        // gate; the view is not used after. (The stream may go with what the
                        // call returns, dropped here, after it.)
                        drop(unsafe { StreamPin::let_go(&self.stream, self.owner_pin, gate) });
                        return;
                    }
                }
            }
        }
        self.drop_slow(bytes);
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    #[cold]
    fn drop_slow(&mut self, bytes: usize) {
        // Counted out of the capture's live buffers once its free is queued (below).
        let session = CaptureSession::active(self.capture);
        let uses = self.uses.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take().unwrap_or_default();
        // A user, which keeps the view valid while the buffer's pin is let go below; the free
        // keeps the stream parked.
        let stream = Stream::clone(&self.stream);
        match self.resource {
            // The pool keeps the stream for the allocation no more, so that a free that waits
            // forever or fails (leaking the memory) does not keep the stream too.
            ResourceRef::Kept(pool) => pool.unkeep(self.ptr, &stream),
            // SAFETY: the buffer's own counted pin, let go once, here; the view is not used after
            // (`stream` is a counted user made above).
            _ if !self.owner_pin => drop(unsafe { StreamPin::from_view(&self.stream) }),
            _ => {
                // The owner's pin is let go under the stream's gate, which a host function does
                // not enter (it would hold back for a capture's or a retirement's mark).
                // SAFETY: a copy of the view that the buffer does not use after; its pin keeps it
                // valid until it is let go, once, with it.
                let view = unsafe { std::ptr::read(&self.stream) };
                // SAFETY: as above.
                let go = move || drop(unsafe { StreamPin::let_go(&view, true, view.key().enter()) });
                crate::host_fn::now_or_deferred(go)
            }
        }
        let Uses { streams: used, graphs } = *uses;
        let free = Free {
            resource: self.resource.clone(),
            ptr: self.ptr,
            bytes,
            streams: FreeStreams::park(stream, used),
            capture: self.capture,
            graphs,
        };
        match session {
            None => crate::host_fn::now_or_deferred(move || free.run()),
            // Counted out once the free is queued into the capture, where the buffer's memory
            // belongs (or handed to what it waits for), not while it is tried again: a capture
            // ended on the count's fall then does not miss it.
            Some(session) => crate::host_fn::now_or_deferred(move || {
                crate::host_fn::attempt_until_done(free, move |free| {
                    let again = free.attempt();
                    if again.is_none() {
                        session.buffer_gone();
                    }
                    again
                })
            }),
        }
    }
}

/// A buffer's stream-ordered free that must wait for more than the buffer's stream: other
/// streams it was used on, graphs that use it, a capture in progress. It holds the streams
/// parked, so that a capture it waits for still ends when its origin's last user goes.
struct Free {
    resource: ResourceRef,
    ptr: DevicePtr,
    bytes: usize,
    /// The buffer's stream, then the others it was used on.
    streams: FreeStreams,
    capture: u64,
    /// Graphs whose capture used the buffer.
    graphs: Vec<GraphUse>,
}

impl GraphOwned for Free {
    fn release(self: Box<Self>) {
        self.run();
    }
}

impl Free {
    /// Frees now if nothing stands in the way, else hands itself to what does; where that is the
    /// legacy default stream held by a capture ([`Held::Legacy`]), or a stream cannot be used
    /// just then ([`FreeStreams::revive`]), cudrv's thread tries again.
    fn run(self) {
        crate::host_fn::attempt_until_done(self, Free::attempt);
    }

    /// [`Free::run`], once: the free back where it cannot be done yet.
    fn attempt(mut self) -> Option<Free> {
        // Graphs whose launches have all completed need nothing (and handing the free to each in
        // turn would recurse once per graph).
        self.graphs.retain(|g| !g.is_done());
        if let Some(graph) = self.graphs.pop() {
            // After that graph's last launch (then the next graph, if any).
            graph.after_launches(Box::new(self));
            return None;
        }
        if let Some(session) = self.streams.held_by_capture(self.capture) {
            session.after_end(Box::new(move || self.run()));
            return None;
        }
        let Some(streams) = self.streams.revive() else { return Some(self) };
        // A capture in progress on the buffer's stream, or on a stream it was used on, that the
        // buffer does not belong to: the free would be captured (or join the capture); it waits
        // for the end of the capture.
        let held = unless_capturing(streams.all(), self.capture, Some(&*self.resource), || {
            free_after_uses(&*self.resource, self.ptr, self.bytes, &streams.owner, &streams.used);
        });
        // Before the free waits on: the users go (see [`FreeStreams`]).
        drop(streams);
        match held {
            Some(Held::Capture(session)) => {
                session.after_end(Box::new(move || self.run()));
                None
            }
            Some(Held::Legacy) => self.free_at_capture_end(),
            None => None,
        }
    }

    /// A buffer allocated during a capture on a per-thread stream, dropped on another thread (or
    /// in a host function, its free then on cudrv's thread): the legacy stream stands in for the
    /// stream here, and the capture holds it. The free belongs in the capture, so it is queued on
    /// the capture's origin at its end ([`CaptureSession::free_at_end`]). Otherwise (another
    /// capture holds the legacy stream, or this one has ended) it is tried again later.
    fn free_at_capture_end(self) -> Option<Free> {
        let capture = CaptureSession::active(self.capture);
        let Some(session) = capture.filter(|_| !self.streams.owner_named_here()) else { return Some(self) };
        let (resource, ptr, bytes) = (self.resource.clone(), self.ptr, self.bytes);
        let at_end = Box::new(move |origin: &Stream| free_after_uses(&*resource, ptr, bytes, origin, &[]));
        match session.free_at_end(at_end) {
            Ok(()) => None,
            Err(_) => Some(self),
        }
    }
}

/// A buffer's stream-ordered free, after the work of every stream it was used on. An error leaks
/// the memory (it may still be in use, or the resource refused it), which is sound, and is
/// reported as a drop error.
fn free_after_uses(resource: &dyn MemoryResource, ptr: DevicePtr, bytes: usize, stream: &Stream, used_on: &[Stream]) {
    // If a host wait for another stream fails, the memory leaks.
    // SAFETY: the pointer came from this resource with this size and is freed once; every use is
    // queued on `stream` or ordered before this point (`order_after_uses`).
    let freed = order_after_uses(stream, used_on).and_then(|()| unsafe { resource.deallocate(ptr, bytes, stream) });
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
    /// [`DeviceBuffer::record_use`] on the view's buffer.
    pub(crate) fn record_use(&self, stream: &Stream) -> Result<()> {
        self.buffer.record_use(stream)
    }

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
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.copy_to_host_uninit(as_uninit(dst))
    }

    /// [`DeviceView::copy_to_host`] into memory that may not be initialised yet; it is, once
    /// this returns `Ok`.
    fn copy_to_host_uninit(&self, dst: &mut [MaybeUninit<T>]) -> Result<()> {
        check_len("the DeviceBuffer", self.len, dst.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let what = "copying a DeviceBuffer to the host";
        let stream = &self.buffer.stream;
        let access = stream.after_earlier_work(self.buffer.host_access(what)?, what)?;
        let _b = stream.context().bind()?;
        // SAFETY: the source is live device memory; `dst` is valid for writes of that many bytes
        // and stays borrowed until the stream is synchronised below.
        unsafe {
            drv!(cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, self.len * size_of::<T>(), stream.as_raw()))
        }?;
        // Waits even if an unrelated error is pending, and never returns while the copy may
        // still write `dst` (it may be pinned or registered, and then the copy is asynchronous).
        stream.wait_for_access(access)
    }

    /// The view's contents as a `Vec`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // SAFETY: the copy writes all `len` elements when it returns `Ok`, having waited for it.
        unsafe { vec_written(self.len, |dst| self.copy_to_host_uninit(dst)) }
    }

    fn copy_from_host_inner(&self, src: &[T]) -> Result<()> {
        check_len("the DeviceBuffer", self.len, src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let what = "copying host memory into a DeviceBuffer";
        let stream = &self.buffer.stream;
        let access = stream.after_earlier_work(self.buffer.host_access(what)?, what)?;
        let _b = stream.context().bind()?;
        // SAFETY: the destination is live device memory the caller holds mutably (through the
        // buffer); `src` stays borrowed until the stream is synchronised below.
        unsafe {
            drv!(cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), self.len * size_of::<T>(), stream.as_raw()))
        }?;
        stream.wait_for_access(access)
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

/// Queues a byte memset of `bytes` bytes at `ptr` on `stream`.
pub(crate) fn memset_range(ptr: DevicePtr, bytes: usize, byte: u8, stream: &Stream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let _b = stream.context().bind()?;
    // SAFETY: the caller passes live device memory of `bytes` bytes it may write.
    unsafe { drv!(cuMemsetD8Async(ptr, byte, bytes, stream.as_raw())) }
}

/// The bits of a 1-, 2- or 4-byte element, for the `cuMemsetD8/16/32` families.
pub(crate) fn element_bits<T: DeviceRepr>(value: &T) -> Result<u32> {
    let n = size_of::<T>();
    if !matches!(n, 1 | 2 | 4) {
        return Err(Error::InvalidArgument(format!("fill needs 1-, 2- or 4-byte elements, not {n}-byte ones")));
    }
    let mut bytes = [0u8; 4];
    // SAFETY: `value` is plain data of `n` bytes (DeviceRepr: no padding); reading them is sound,
    // and `bytes` has room for them.
    unsafe { std::ptr::copy_nonoverlapping(std::ptr::from_ref(value).cast::<u8>(), bytes.as_mut_ptr(), n) };
    Ok(match n {
        1 => u32::from(bytes[0]),
        2 => u32::from(u16::from_ne_bytes([bytes[0], bytes[1]])),
        _ => u32::from_ne_bytes(bytes),
    })
}

/// Queues a memset of `count` elements of `elem` bytes (1, 2 or 4) at `ptr` on `stream`, each set
/// to the low `elem` bytes of `bits`.
pub(crate) fn memset_async_range(ptr: DevicePtr, count: usize, bits: u32, elem: usize, stream: &Stream) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let _b = stream.context().bind()?;
    let s = stream.as_raw();
    match elem {
        // SAFETY: the caller passes live device memory of `count` elements of `elem` bytes that it
        // may write, with its uses ordered on `stream`; the context is current.
        1 => unsafe { drv!(cuMemsetD8Async(ptr, bits as u8, count, s)) },
        // SAFETY: as above.
        2 => unsafe { drv!(cuMemsetD16Async(ptr, bits as u16, count, s)) },
        // SAFETY: as above.
        _ => unsafe { drv!(cuMemsetD32Async(ptr, bits, count, s)) },
    }
}

/// A synchronous memset of `count` elements of `elem` bytes (1, 2 or 4) at `ptr`: after the work
/// queued on `stream` so far, and finished when this returns. Queued on `stream` and waited for,
/// not the driver's synchronous memset: that runs on the legacy default stream, which refuses
/// work while any blocking stream of the context captures (another thread's, say) and
/// invalidates that capture. `access` is the caller's gate of `stream`, taken for host access
/// ([`Stream::refuse_host_access`]); it goes once the wait's event is recorded.
pub(crate) fn memset_sync_range(
    ptr: DevicePtr,
    count: usize,
    bits: u32,
    elem: usize,
    stream: &Stream,
    access: Gate<'_>,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    memset_async_range(ptr, count, bits, elem, stream)?;
    // Never returns while the memset may still run.
    stream.wait_for_access(access)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_accept_every_range_form_inside_the_buffer() {
        assert_eq!(bounds(.., 10).unwrap(), (0, 10));
        assert_eq!(bounds(2..5, 10).unwrap(), (2, 5));
        assert_eq!(bounds(2..=5, 10).unwrap(), (2, 6));
        assert_eq!(bounds(..=9, 10).unwrap(), (0, 10));
        assert_eq!(bounds(7.., 10).unwrap(), (7, 10));
        assert_eq!(bounds(10.., 10).unwrap(), (10, 10), "an empty range at the end");
        assert_eq!(bounds(3..3, 10).unwrap(), (3, 3));
        use std::ops::Bound::{Excluded, Included};
        assert_eq!(bounds((Excluded(2), Included(4)), 10).unwrap(), (3, 5));
    }

    #[test]
    fn bounds_refuse_ranges_outside_or_reversed_or_overflowing() {
        for bad in [bounds(0..11, 10), bounds(..=10, 10), bounds(11.., 10), bounds(0..usize::MAX, 10)] {
            assert!(matches!(bad, Err(Error::InvalidArgument(ref m)) if m.contains("outside")), "{bad:?}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = bounds(5..2, 10);
        assert!(matches!(reversed, Err(Error::InvalidArgument(_))), "{reversed:?}");
        assert!(matches!(bounds(..=usize::MAX, 10), Err(Error::InvalidArgument(ref m)) if m.contains("overflow")));
        use std::ops::Bound::{Excluded, Unbounded};
        let past = bounds((Excluded(usize::MAX), Unbounded), 10);
        assert!(matches!(past, Err(Error::InvalidArgument(ref m)) if m.contains("overflow")), "{past:?}");
    }

    #[test]
    fn byte_len_refuses_overflow() {
        assert_eq!(byte_len::<u32>(10).unwrap(), 40);
        assert!(byte_len::<u64>(usize::MAX / 4).is_err());
    }
}

//! Managed (unified) memory: [`ManagedBuffer`], which the host and every device can address, with
//! prefetches and advice (`cuMemPrefetchAsync`, `cuMemAdvise`); and [`ManagedResource`], the
//! [`MemoryResource`] over `cuMemAllocManaged`.
//!
//! # What the host may do, and when
//!
//! On a device with concurrent managed access ([`crate::Capabilities::concurrent_managed_access`]:
//! Linux, compute capability 6.0 and newer), the host and the GPU may touch managed memory at the
//! same time, and pages migrate on demand; [`ManagedBuffer::as_slice`] hands the host the memory
//! once the work recorded on it is done. Without it (Windows, TCC, WSL), the host must not touch
//! managed memory while *any* kernel runs on the device, which cudrv cannot guarantee while other
//! threads launch work: there host access is refused with [`Error::Unsupported`], and the copies
//! ([`ManagedBuffer::to_vec`], [`ManagedBuffer::copy_from_host`]) go through the driver instead.
//! Prefetching needs concurrent managed access too (the driver refuses it otherwise).

use std::fmt;
use std::marker::PhantomData;
use std::mem::{MaybeUninit, size_of};
use std::sync::Arc;

use super::buffer::{DeviceRepr, aligned_bytes, as_uninit, element_bits, vec_written};
use super::{DevicePtr, MemoryResource, ResourceKind, StreamUses, check_len, check_stream, free_when_done};
use crate::capture::RelaxedCaptureMode;
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result, check};
use crate::result::drv;
use crate::stream::Stream;

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
    /// [`Error::Unsupported`] when the device has no managed memory.
    pub fn new(device: &Device) -> Result<ManagedResource> {
        require_managed(device)?;
        Ok(ManagedResource { ctx: device.primary_context()? })
    }
}

fn require_managed(device: &Device) -> Result<()> {
    if device.capabilities()?.managed_memory {
        Ok(())
    } else {
        Err(device.unsupported(
            "managed memory",
            "CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY is 0",
            Some("DeviceBuffer with explicit copies"),
        ))
    }
}

/// `cuMemFree` of managed memory, in `ctx`, whatever captures are active (it is never part of
/// one, as the allocation).
///
/// # Safety
/// `ptr` came from [`alloc_managed`] in `ctx`, is freed once, and no queued work uses it any more.
unsafe fn free_managed(ctx: &Context, ptr: DevicePtr) -> Result<()> {
    // SAFETY: forwarded to the caller.
    super::uses::uncaptured(ctx, || unsafe { drv!(cuMemFree_v2(ptr)) })
}

/// `cuMemAllocManaged` of `bytes` (at least 1), attached globally, in `ctx`.
fn alloc_managed(ctx: &Context, bytes: usize) -> Result<DevicePtr> {
    let _b = ctx.bind()?;
    let mut ptr = 0;
    let flags = cudrv_sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL.0;
    // Never part of a capture: allowed whatever captures are active (a "potentially unsafe" call,
    // which a capture in global mode on any thread would refuse, and be invalidated for).
    let _relaxed = RelaxedCaptureMode::enter();
    // SAFETY: valid out-pointer; the context is current.
    unsafe { drv!(cuMemAllocManaged(&mut ptr, bytes.max(1), flags)) }?;
    if ptr == 0 {
        // The host may read and write through it (`ManagedBuffer::as_slice`): a driver's success
        // with no memory is its failure.
        return Err(Error::driver("cuMemAllocManaged", cudrv_sys::CUresult::CUDA_ERROR_UNKNOWN));
    }
    Ok(ptr)
}

// SAFETY: fresh managed memory; a free first waits for the stream.
unsafe impl MemoryResource for ManagedResource {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream("ManagedResource::allocate", self.device(), stream)?;
        alloc_managed(&self.ctx, bytes)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, _bytes: usize, stream: &Stream) -> Result<()> {
        // SAFETY: the caller passes memory from `allocate`, freed once; `free_when_done` runs the
        // free once the stream's uses are complete, with the context current.
        free_when_done(self, &self.ctx, stream, move || unsafe { drv!(cuMemFree_v2(ptr)) })
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

/// Where managed memory is, or should be: a device's memory, or the host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// A device's memory.
    Device(Device),
    /// Host memory.
    Host,
}

impl Location {
    #[cfg(cuda_12050)]
    fn raw(self) -> cudrv_sys::CUmemLocation {
        use cudrv_sys::CUmemLocationType as T;
        match self {
            Location::Device(d) => {
                cudrv_sys::CUmemLocation { type_: T::CU_MEM_LOCATION_TYPE_DEVICE, id: d.ordinal_i32() }
            }
            Location::Host => cudrv_sys::CUmemLocation { type_: T::CU_MEM_LOCATION_TYPE_HOST, id: 0 },
        }
    }

    /// The legacy encoding: a device ordinal, or `CU_DEVICE_CPU` (-1) for the host.
    #[cfg_attr(cuda_13000, allow(dead_code))]
    fn legacy(self) -> i32 {
        match self {
            Location::Device(d) => d.ordinal_i32(),
            Location::Host => -1,
        }
    }

    /// Decodes a legacy location: -1 is the host, -2 (`CU_DEVICE_INVALID`) none.
    fn from_legacy(v: i32) -> Result<Option<Location>> {
        Ok(match v {
            -1 => Some(Location::Host),
            v if v >= 0 => Some(Location::Device(Device::get(v as usize)?)),
            _ => None,
        })
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Device(d) => write!(f, "device {}", d.ordinal()),
            Location::Host => f.write_str("the host"),
        }
    }
}

/// Advice about how managed memory will be used (`cuMemAdvise`). Advice changes where pages live
/// and how faults are served, never what the memory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Advice {
    /// Mostly read: each reader gets a read-only copy, and a write drops the copies
    /// (`CU_MEM_ADVISE_SET_READ_MOSTLY`).
    SetReadMostly,
    /// Undoes [`Advice::SetReadMostly`].
    UnsetReadMostly,
    /// Keep the pages at this location where possible (`CU_MEM_ADVISE_SET_PREFERRED_LOCATION`).
    SetPreferredLocation(Location),
    /// Undoes [`Advice::SetPreferredLocation`].
    UnsetPreferredLocation,
    /// This location will access the memory: keep it mapped there, wherever the pages are
    /// (`CU_MEM_ADVISE_SET_ACCESSED_BY`).
    SetAccessedBy(Location),
    /// Undoes [`Advice::SetAccessedBy`] for that location.
    UnsetAccessedBy(Location),
}

/// What a capture refuses of managed buffers: their free does not wait for graphs.
const CAPTURE: &str = "ManagedBuffer during a capture (capture work on DeviceBuffers, which graphs keep alive)";
/// A host copy of a buffer used on a stream that captures now: ordering the copy after that
/// stream would make the buffer's stream join the capture.
const USED_IN_CAPTURE: &str = "a ManagedBuffer host copy while a stream it was used on captures";
/// Host access or a host copy where the buffer's stream, or one it was used on, stands for the
/// legacy default stream while a blocking stream of its context captures.
const LEGACY_HELD: &str =
    "host access to a ManagedBuffer used on the legacy default stream while a blocking stream captures";

/// `CU_MEM_ATTACH_GLOBAL`-managed memory for `len` elements of `T` (`cuMemAllocManaged`),
/// addressable by the host and every device, migrated on demand.
///
/// * Launches, copies and prefetches record their use ([`ManagedBuffer::record_use`]); host
///   access ([`ManagedBuffer::as_slice`]) waits for every recorded use, and so does `Drop`
///   before it frees (`cuMemFree`).
/// * [`ManagedBuffer::prefetch_to`] moves the pages ahead of use, in stream order;
///   [`ManagedBuffer::advise`] tells the driver how the memory will be used; the `*_location` and
///   [`ManagedBuffer::is_read_mostly`] read back what the driver holds
///   (`cuMemRangeGetAttribute`).
///
/// # What the host may do, and when
///
/// On a device with concurrent managed access ([`crate::Capabilities::concurrent_managed_access`]:
/// Linux, compute capability 6.0 and newer), the host and the GPU may touch managed memory at the
/// same time, and pages migrate on demand; [`ManagedBuffer::as_slice`] hands the host the memory
/// once the work recorded on it is done. Without it (Windows, TCC, WSL), the host must not touch
/// managed memory while *any* kernel runs on the device, which cudrv cannot guarantee while other
/// threads launch work: there host access is refused with [`Error::Unsupported`], and the copies
/// ([`ManagedBuffer::to_vec`], [`ManagedBuffer::copy_from_host`]) go through the driver instead.
/// Prefetching needs concurrent managed access too (the driver refuses it otherwise).
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, memory::{Advice, Location, ManagedBuffer}};
/// let device = Device::get(0)?;
/// let stream = Stream::new(&device)?;
/// let mut data = ManagedBuffer::from_slice(&[1.0f32; 1 << 20], &stream)?;
/// data.advise(Advice::SetPreferredLocation(Location::Device(device)))?;
/// data.prefetch_to(Location::Device(device), &stream)?; // before the kernels that use it
/// // ... launch kernels with `&mut data` on `stream` ...
/// data.prefetch_to(Location::Host, &stream)?;
/// let sum: f32 = data.as_slice()?.iter().sum(); // waits for the stream
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct ManagedBuffer<T: DeviceRepr> {
    ptr: DevicePtr,
    len: usize,
    stream: Stream,
    used_on: StreamUses,
    _t: PhantomData<T>,
}

impl<T: DeviceRepr> ManagedBuffer<T> {
    /// `len` elements of managed memory on `stream`'s device, with unspecified contents.
    ///
    /// # Safety
    /// As [`super::DeviceBuffer::uninit`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `T` needs more than 256-byte alignment (as
    /// [`super::DeviceBuffer`]: the most the driver's allocations guarantee) or on overflow;
    /// [`Error::Unsupported`] without managed memory; the driver's error.
    pub unsafe fn uninit(len: usize, stream: &Stream) -> Result<ManagedBuffer<T>> {
        let device = stream.device();
        require_managed(&device)?;
        // The host slices (`as_slice`) need `T`'s alignment, which allocations guarantee up to
        // MAX_ALIGN only.
        let bytes = aligned_bytes::<T>("ManagedBuffer", len)?;
        let ptr = alloc_managed(stream.context(), bytes)?;
        Ok(ManagedBuffer { ptr, len, stream: stream.clone(), used_on: StreamUses::default(), _t: PhantomData })
    }

    /// `len` zeroed elements (a memset queued on `stream`).
    ///
    /// # Errors
    /// As [`ManagedBuffer::uninit`].
    pub fn zeroed(len: usize, stream: &Stream) -> Result<ManagedBuffer<T>> {
        // SAFETY: zeroed in stream order before anything can read it (host access waits).
        let mut b = unsafe { Self::uninit(len, stream)? };
        b.memset(0)?;
        Ok(b)
    }

    /// A buffer holding a copy of `data`. Waits for the copy.
    ///
    /// # Errors
    /// As [`ManagedBuffer::uninit`].
    pub fn from_slice(data: &[T], stream: &Stream) -> Result<ManagedBuffer<T>> {
        // SAFETY: every element is written before anyone can read it.
        let mut b = unsafe { Self::uninit(data.len(), stream)? };
        b.copy_from_host(data)?;
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

    /// The size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The address, valid on the host and on every device.
    pub fn as_raw(&self) -> DevicePtr {
        self.ptr
    }

    /// The stream the buffer's copies and memsets are queued on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device whose context allocated the memory.
    pub fn device(&self) -> Device {
        self.stream.device()
    }

    /// Records that work on `stream` (of any device) uses the buffer: the stream first waits for
    /// the buffer's stream, and host access and the free wait for the stream.
    ///
    /// # Errors
    /// The driver's error.
    pub fn record_use(&self, stream: &Stream) -> Result<()> {
        // A graph could not keep this memory alive: refused in a capture (see crate::graph), on
        // the use's stream and on the buffer's (ordering the one after the other would join it).
        self.used_on.use_on(&self.stream, stream, CAPTURE).map(drop)
    }

    /// Waits on the host for the buffer's stream and every stream its use was recorded on.
    fn wait_uses(&self) -> Result<()> {
        let used = self.used_on.snapshot();
        self.refuse_legacy_held(&used)?;
        super::wait_for_uses(&self.stream, &used)
    }

    /// Refuses host access where the buffer's stream or one of `used` stands for the legacy
    /// default stream while a blocking stream of its context captures: the driver refuses work
    /// there and invalidates that capture, and a wait for the stream could not end before the
    /// capture does (for ever, when the waiting thread is to end it). As `DeviceBuffer`'s host
    /// access.
    fn refuse_legacy_held(&self, used: &[Stream]) -> Result<()> {
        if std::iter::once(&self.stream).chain(used).any(|s| s.key().legacy_held_by_capture()) {
            return Err(Error::Capturing { what: LEGACY_HELD });
        }
        Ok(())
    }

    fn require_host_access(&self) -> Result<()> {
        let device = self.device();
        if device.capabilities()?.concurrent_managed_access {
            return Ok(());
        }
        Err(device.unsupported(
            "host access to managed memory",
            "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0 (the host may not touch managed memory while any \
             kernel runs on the device, which cudrv cannot rule out)",
            Some("ManagedBuffer::to_vec and ManagedBuffer::copy_from_host"),
        ))
    }

    /// The contents, for the host, after waiting for every recorded use.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without concurrent managed access (see
    /// [`ManagedBuffer`]); the driver's error while waiting.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.require_host_access()?;
        self.wait_uses()?;
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: the memory holds `len` initialised elements (every bit pattern is a valid T),
        // is host-addressable (concurrent managed access), and the work recorded on it is done.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as usize as *const T, self.len) })
    }

    /// The contents, mutable, for the host, after waiting for every recorded use.
    ///
    /// # Errors
    /// As [`ManagedBuffer::as_slice`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.require_host_access()?;
        self.wait_uses()?;
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in as_slice; `&mut self` excludes new uses while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as usize as *mut T, self.len) })
    }

    /// Sets every byte to `byte` (queued on the buffer's stream).
    ///
    /// # Errors
    /// The driver's error.
    pub fn memset(&mut self, byte: u8) -> Result<()> {
        // Held until the memset is queued: a capture begun meanwhile would take it unseen.
        let _gate = self.stream.refuse_in_capture(CAPTURE)?;
        super::buffer::memset_range(self.ptr, self.byte_len(), byte, &self.stream)
    }

    /// Sets every element to `value`, for element sizes of 1, 2 or 4 bytes (queued on the
    /// buffer's stream).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for other sizes; the driver's error.
    pub fn fill(&mut self, value: T) -> Result<()> {
        let bits = element_bits(&value)?;
        if self.len == 0 {
            return Ok(());
        }
        let _gate = self.stream.refuse_in_capture(CAPTURE)?;
        super::buffer::memset_async_range(self.ptr, self.len, bits, size_of::<T>(), &self.stream)
    }

    /// Copies `src` into the buffer through the driver (on the buffer's stream) and waits: works
    /// with and without concurrent managed access.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        check_len("the ManagedBuffer", self.len, src.len())?;
        // Captured, the copy would touch `src` at every launch, long after this call.
        let what = "ManagedBuffer::copy_from_host during a capture";
        let gate = self.stream.refuse_in_capture(what)?;
        if self.len == 0 {
            return Ok(());
        }
        self.refuse_legacy_held(&self.used_on.snapshot())?;
        self.used_on.order_after_all(&self.stream, USED_IN_CAPTURE)?;
        let gate = self.stream.after_earlier_work(gate, what)?;
        {
            let _b = self.stream.context().bind()?;
            // SAFETY: the destination is this buffer, held mutably; `src` stays borrowed until the
            // stream is synchronised below.
            unsafe {
                drv!(cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), self.byte_len(), self.stream.as_raw()))
            }?;
        }
        self.stream.wait_for_access(gate)
    }

    /// Copies the buffer into `dst` through the driver (on the buffer's stream) and waits.
    ///
    /// # Errors
    /// As [`ManagedBuffer::copy_from_host`].
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.copy_to_host_uninit(as_uninit(dst))
    }

    /// [`ManagedBuffer::copy_to_host`] into memory that may not be initialised yet; it is, once
    /// this returns `Ok`.
    fn copy_to_host_uninit(&self, dst: &mut [MaybeUninit<T>]) -> Result<()> {
        check_len("the ManagedBuffer", self.len, dst.len())?;
        // Captured, the copy would touch `dst` at every launch, long after this call.
        let what = "ManagedBuffer::copy_to_host during a capture";
        let gate = self.stream.refuse_in_capture(what)?;
        if self.len == 0 {
            return Ok(());
        }
        self.refuse_legacy_held(&self.used_on.snapshot())?;
        self.used_on.order_after_all(&self.stream, USED_IN_CAPTURE)?;
        let gate = self.stream.after_earlier_work(gate, what)?;
        {
            let _b = self.stream.context().bind()?;
            // SAFETY: `dst` is valid for the whole copy and stays borrowed until the stream is
            // synchronised below.
            unsafe {
                drv!(cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, self.byte_len(), self.stream.as_raw()))
            }?;
        }
        self.stream.wait_for_access(gate)
    }

    /// The contents in a `Vec`, copied through the driver.
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // SAFETY: the copy writes every element when it returns `Ok`, having waited for it.
        unsafe { vec_written(self.len, |dst| self.copy_to_host_uninit(dst)) }
    }

    /// Migrates the pages to `location` ahead of their use, queued on `stream`
    /// (`cuMemPrefetchAsync`): later work on `stream` finds them there. The use is recorded on
    /// `stream`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without concurrent managed access on the buffer's device or the
    /// target device ([`crate::Capabilities::managed_prefetch`]); [`Error::MissingSymbol`] with a
    /// driver that lacks the function; the driver's error.
    pub fn prefetch_to(&self, location: Location, stream: &Stream) -> Result<()> {
        for device in std::iter::once(self.device()).chain(match location {
            Location::Device(d) => Some(d),
            Location::Host => None,
        }) {
            if !device.capabilities()?.managed_prefetch {
                return Err(device.unsupported(
                    "prefetching managed memory",
                    "it needs concurrent managed access (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0)",
                    Some("no prefetch: pages migrate when touched (or copies into a DeviceBuffer)"),
                ));
            }
        }
        if self.len == 0 {
            return Ok(());
        }
        // Held until the prefetch is queued: a capture begun meanwhile would take it unseen.
        let _gates = self.used_on.use_on(&self.stream, stream, CAPTURE)?;
        let _b = stream.context().bind()?;
        // SAFETY: the range is this live managed allocation; the prefetch is ordered on `stream`,
        // which the buffer's free waits for (its use is recorded); the stream's context is current.
        unsafe { prefetch(self.ptr, self.byte_len(), location, stream.as_raw()) }
    }

    /// Gives the driver `advice` about the whole buffer (`cuMemAdvise`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] without managed memory; [`Error::MissingSymbol`] with a driver that
    /// lacks the function; the driver's error (advice a system cannot follow).
    pub fn advise(&self, advice: Advice) -> Result<()> {
        use cudrv_sys::CUmem_advise as A;
        require_managed(&self.device())?;
        if self.len == 0 {
            return Ok(());
        }
        let (kind, location) = match advice {
            Advice::SetReadMostly => (A::CU_MEM_ADVISE_SET_READ_MOSTLY, Location::Device(self.device())),
            Advice::UnsetReadMostly => (A::CU_MEM_ADVISE_UNSET_READ_MOSTLY, Location::Device(self.device())),
            Advice::SetPreferredLocation(l) => (A::CU_MEM_ADVISE_SET_PREFERRED_LOCATION, l),
            Advice::UnsetPreferredLocation => {
                (A::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION, Location::Device(self.device()))
            }
            Advice::SetAccessedBy(l) => (A::CU_MEM_ADVISE_SET_ACCESSED_BY, l),
            Advice::UnsetAccessedBy(l) => (A::CU_MEM_ADVISE_UNSET_ACCESSED_BY, l),
        };
        let _b = self.stream.context().bind()?;
        // SAFETY: the range is this live managed allocation.
        unsafe { advise(self.ptr, self.byte_len(), kind, location) }
    }

    /// One `int`-valued range attribute of the whole buffer (`cuMemRangeGetAttribute`).
    fn range_attribute(&self, attribute: cudrv_sys::CUmem_range_attribute) -> Result<i32> {
        let mut v: i32 = 0;
        let _b = self.stream.context().bind()?;
        // SAFETY: `v` is 4 writable bytes, as passed; the range is this live managed allocation.
        unsafe { drv!(cuMemRangeGetAttribute((&raw mut v).cast(), 4, attribute, self.ptr, self.byte_len().max(1))) }?;
        Ok(v)
    }

    /// Whether [`Advice::SetReadMostly`] holds for the whole buffer.
    ///
    /// # Errors
    /// The driver's error.
    pub fn is_read_mostly(&self) -> Result<bool> {
        Ok(self.range_attribute(cudrv_sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY)? != 0)
    }

    /// The preferred location of the whole buffer, if one is set for all of it.
    ///
    /// # Errors
    /// The driver's error.
    pub fn preferred_location(&self) -> Result<Option<Location>> {
        Location::from_legacy(
            self.range_attribute(cudrv_sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION)?,
        )
    }

    /// Where the whole buffer was last prefetched to, if all of it was prefetched to one place.
    /// Prefetches still queued may not show yet.
    ///
    /// # Errors
    /// The driver's error.
    pub fn last_prefetch_location(&self) -> Result<Option<Location>> {
        Location::from_legacy(
            self.range_attribute(cudrv_sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION)?,
        )
    }

    /// The locations that [`Advice::SetAccessedBy`] names for the whole buffer.
    ///
    /// # Errors
    /// The driver's error.
    pub fn accessed_by(&self) -> Result<Vec<Location>> {
        let n = crate::device::Device::count()? + 1;
        let mut v = vec![-2i32; n];
        let _b = self.stream.context().bind()?;
        // SAFETY: `v` has room for `n` ints, as passed.
        unsafe {
            drv!(cuMemRangeGetAttribute(
                v.as_mut_ptr().cast(),
                n * 4,
                cudrv_sys::CUmem_range_attribute::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY,
                self.ptr,
                self.byte_len().max(1)
            ))
        }?;
        v.into_iter().filter_map(|x| Location::from_legacy(x).transpose()).collect()
    }
}

/// `cuMemPrefetchAsync`: the `_v2` form (a `CUmemLocation`, CUDA 12.2) where the headers and the
/// driver have it, else the first form (a device ordinal, -1 for the host), which cudrv-sys
/// declares where the headers no longer do.
///
/// # Safety
/// `[ptr, ptr + bytes)` must be live managed memory; `stream` a valid stream of the current
/// context, which the memory's free waits for.
unsafe fn prefetch(ptr: DevicePtr, bytes: usize, location: Location, stream: cudrv_sys::CUstream) -> Result<()> {
    let d = crate::result::driver()?;
    #[cfg(cuda_12050)]
    // SAFETY: forwarded to the caller.
    match unsafe { d.cuMemPrefetchAsync_v2(ptr, bytes, location.raw(), 0, stream) } {
        Err(_) => {} // not in this driver
        rc => return check("cuMemPrefetchAsync_v2", rc),
    }
    // SAFETY: forwarded to the caller.
    check("cuMemPrefetchAsync", unsafe { d.cuMemPrefetchAsync(ptr, bytes, location.legacy(), stream) })
}

/// `cuMemAdvise`, in the form the headers and the driver have (as [`prefetch`]).
///
/// # Safety
/// `[ptr, ptr + bytes)` must be live managed memory.
unsafe fn advise(ptr: DevicePtr, bytes: usize, advice: cudrv_sys::CUmem_advise, location: Location) -> Result<()> {
    let d = crate::result::driver()?;
    #[cfg(cuda_12050)]
    // SAFETY: forwarded to the caller.
    match unsafe { d.cuMemAdvise_v2(ptr, bytes, advice, location.raw()) } {
        Err(_) => {} // not in this driver
        rc => return check("cuMemAdvise_v2", rc),
    }
    // SAFETY: forwarded to the caller.
    check("cuMemAdvise", unsafe { d.cuMemAdvise(ptr, bytes, advice, location.legacy()) })
}

// SAFETY: the buffer owns its memory (as a Box<[T]>); host access goes through methods that wait
// for recorded uses; the use list is behind a Mutex.
unsafe impl<T: DeviceRepr> Send for ManagedBuffer<T> {}
// SAFETY: as above.
unsafe impl<T: DeviceRepr> Sync for ManagedBuffer<T> {}

impl<T: DeviceRepr> Drop for ManagedBuffer<T> {
    fn drop(&mut self) {
        let (ptr, ctx) = (self.ptr, self.stream.context().clone());
        super::free_after_waiting(self.stream.clone(), self.used_on.take(), move || {
            // SAFETY: the memory came from cuMemAllocManaged and is freed once; nothing queued
            // uses it any more (waited for).
            unsafe { free_managed(&ctx, ptr) }
        });
    }
}

impl<T: DeviceRepr> fmt::Debug for ManagedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device().ordinal())
            .finish()
    }
}

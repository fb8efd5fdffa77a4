//! Pitched device memory: [`DeviceBuffer2D`] and [`DeviceBuffer3D`] (`cuMemAllocPitch`), their
//! views ([`DeviceView2D`]), 2D and 3D copies (`cuMemcpy2DAsync`, `cuMemcpy3DAsync`) and memsets
//! (`cuMemsetD2D8/16/32`).
//!
//! A pitched allocation pads each row to the *pitch* the driver picks (a multiple of the device's
//! alignment, so that every row starts aligned and coalesced accesses stay coalesced). Element
//! `(x, y)` of a 2D buffer is at `as_raw() + y * pitch() + x * size_of::<T>()`; element `(x, y, z)`
//! of a 3D buffer at `as_raw() + (z * height + y) * pitch() + x * size_of::<T>()`. Kernels take the
//! pitch as an argument.
//!
//! Allocation and free are synchronous (`cuMemAllocPitch`, `cuMemFree`): a drop waits on the host
//! for the work queued on the buffer's stream and on every stream its use was recorded on, then
//! frees. For buffers made and dropped on a hot path, allocate a [`DeviceBuffer`] with a pitch of
//! your own instead: it is freed in stream order.

use std::fmt;
use std::marker::PhantomData;
use std::mem::{MaybeUninit, size_of};
use std::ops::{Bound as RangeBound, RangeBounds};
use std::sync::Arc;

use cudrv_sys::{CUDA_MEMCPY2D, CUDA_MEMCPY3D, CUmemorytype};

use super::buffer::{DeviceBuffer, DeviceRepr, as_uninit, byte_len, element_bits, vec_written};
use super::host::PinnedBuffer;
use super::{DevicePtr, StreamUses, UseGates, check_len, check_stream, free_after_waiting};
use crate::capture::RelaxedCaptureMode;
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::result::drv;
use crate::stream::Stream;

/// The allocation behind a pitched buffer, and where it is used.
struct Pitched {
    ptr: DevicePtr,
    /// Bytes from one row to the next (0 for an empty buffer).
    pitch: usize,
    /// Bytes of data in a row: `width * size_of::<T>()`.
    row_bytes: usize,
    /// Rows in all: `height` (2D) or `height * depth` (3D).
    rows: usize,
    stream: Stream,
    ctx: Arc<Context>,
    used_on: StreamUses,
}

/// What a capture refuses of pitched buffers: their free does not wait for graphs.
const CAPTURE: &str =
    "DeviceBuffer2D and DeviceBuffer3D during a capture (capture work on DeviceBuffers, which graphs keep alive)";

impl Pitched {
    /// `rows` rows of `row_bytes` bytes (`cuMemAllocPitch`), for `elem`-byte elements.
    fn new(row_bytes: usize, rows: usize, elem: usize, stream: &Stream) -> Result<Pitched> {
        let ctx = stream.context().clone();
        let mut p =
            Pitched { ptr: 0, pitch: 0, row_bytes, rows, stream: stream.clone(), ctx, used_on: StreamUses::default() };
        if row_bytes == 0 || rows == 0 {
            return Ok(p);
        }
        if row_bytes.checked_mul(rows).is_none_or(|b| b > isize::MAX as usize) {
            return Err(Error::InvalidArgument(format!("{rows} rows of {row_bytes} bytes overflow")));
        }
        // The largest access kernels make: 4, 8 or 16 bytes (what cuMemAllocPitch accepts).
        let access = elem.next_power_of_two().clamp(4, 16) as u32;
        let ctx = p.ctx.clone();
        let _b = ctx.bind()?;
        // Never part of a capture: allowed whatever captures are active (a "potentially unsafe"
        // call, which a capture in global mode on any thread would refuse, and be invalidated for).
        let _relaxed = RelaxedCaptureMode::enter();
        // SAFETY: valid out-pointers; the context is current.
        unsafe { drv!(cuMemAllocPitch_v2(&mut p.ptr, &mut p.pitch, row_bytes, rows, access)) }.map_err(|e| {
            if e.is_out_of_memory() {
                Error::OutOfMemory {
                    requested: row_bytes.saturating_mul(rows),
                    device: stream.device().ordinal_i32(),
                    resource: "cuMemAllocPitch",
                    reserved: 0,
                    in_use: 0,
                }
            } else {
                e
            }
        })?;
        Ok(p)
    }

    fn device(&self) -> Device {
        self.ctx.device()
    }

    /// Records a use on `stream` (any stream of the device), as [`DeviceBuffer::record_use`]:
    /// the stream first waits for the buffer's stream, and the free waits for the stream.
    fn record_use(&self, stream: &Stream) -> Result<()> {
        self.use_on(stream).map(drop)
    }

    /// [`Pitched::record_use`], with the gates of both streams, to be held until the use's work
    /// is queued ([`StreamUses::use_on`]).
    fn use_on<'s>(&'s self, stream: &'s Stream) -> Result<UseGates<'s>> {
        if stream.id() != self.stream.id() {
            check_stream("DeviceBuffer2D::record_use", self.device(), stream)?;
        }
        // A graph could not keep this memory alive: refused in a capture (see crate::graph), on
        // the use's stream and on the buffer's (ordering the one after the other would join it).
        self.used_on.use_on(&self.stream, stream, CAPTURE)
    }

    /// The address of byte `x_bytes` of row `row`.
    fn at(&self, x_bytes: usize, row: usize) -> DevicePtr {
        self.ptr + (row * self.pitch + x_bytes) as u64
    }

    /// A 2D memset of `rows` rows of `count` elements from row `first`, queued on the stream.
    fn memset_async(&self, first: usize, rows: usize, count: usize, bits: u32, elem: usize) -> Result<()> {
        if count == 0 || rows == 0 {
            return Ok(());
        }
        let _gate = self.stream.refuse_in_capture(CAPTURE)?;
        let (ptr, pitch, s) = (self.at(0, first), self.pitch, self.stream.as_raw());
        let _b = self.ctx.bind()?;
        // SAFETY (all three): the rows lie in this allocation, which the caller holds mutably;
        // ordered on the buffer's stream.
        match elem {
            // SAFETY: as above.
            1 => unsafe { drv!(cuMemsetD2D8Async(ptr, pitch, bits as u8, count, rows, s)) },
            // SAFETY: as above.
            2 => unsafe { drv!(cuMemsetD2D16Async(ptr, pitch, bits as u16, count, rows, s)) },
            // SAFETY: as above.
            _ => unsafe { drv!(cuMemsetD2D32Async(ptr, pitch, bits, count, rows, s)) },
        }
    }

    /// A synchronous 2D memset: after the stream's work, and done when this returns (see
    /// [`DeviceBuffer::memset_sync`]). Queued on the buffer's stream and waited for: the driver's
    /// synchronous memsets (`cuMemsetD2D8`, ...) run on the legacy default stream, which, while any
    /// blocking stream of the context captures (another thread's, say), refuses work and
    /// invalidates that capture.
    fn memset_sync(&self, count: usize, bits: u32, elem: usize) -> Result<()> {
        if count == 0 || self.rows == 0 {
            return Ok(());
        }
        let access = self.stream.refuse_host_access("a synchronous memset of a pitched buffer")?;
        self.memset_async(0, self.rows, count, bits, elem)?;
        // Never returns while the memset may still run.
        self.stream.wait_for_access(access)
    }
}

impl Drop for Pitched {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let (ptr, ctx) = (self.ptr, self.ctx.clone());
        free_after_waiting(self.stream.clone(), self.used_on.take(), move || {
            // SAFETY: the allocation came from cuMemAllocPitch and is freed once; no queued work
            // uses it any more (waited for).
            super::uncaptured(&ctx, || unsafe { drv!(cuMemFree_v2(ptr)) })
        });
    }
}

/// One side of a 2D or 3D copy: where its first byte is, its pitch, and (3D) its rows per slice.
#[derive(Clone, Copy)]
enum Side {
    Host { ptr: *const u8, pitch: usize, height: usize },
    Device { ptr: DevicePtr, pitch: usize, height: usize },
}

/// A 2D (`depth == 1`) or 3D copy of `rows` rows (per slice) of `row_bytes` bytes, queued on
/// `stream` (`cuMemcpy2DAsync` or `cuMemcpy3DAsync`).
///
/// # Safety
/// Both sides must be valid for the region (pitches, rows and slices included) until the copy has
/// run; the destination must be writable and not aliased by the source.
unsafe fn copy_region(
    dst: Side,
    src: Side,
    row_bytes: usize,
    rows: usize,
    depth: usize,
    stream: &Stream,
) -> Result<()> {
    if row_bytes == 0 || rows == 0 || depth == 0 {
        return Ok(());
    }
    let _gate = stream.refuse_in_capture(CAPTURE)?;
    let _b = stream.context().bind()?;
    if depth == 1 {
        let mut c = CUDA_MEMCPY2D { WidthInBytes: row_bytes, Height: rows, ..Default::default() };
        match src {
            Side::Host { ptr, pitch, .. } => {
                (c.srcMemoryType, c.srcHost, c.srcPitch) = (CUmemorytype::CU_MEMORYTYPE_HOST, ptr.cast(), pitch);
            }
            Side::Device { ptr, pitch, .. } => {
                (c.srcMemoryType, c.srcDevice, c.srcPitch) = (CUmemorytype::CU_MEMORYTYPE_DEVICE, ptr, pitch);
            }
        }
        match dst {
            Side::Host { ptr, pitch, .. } => {
                (c.dstMemoryType, c.dstHost, c.dstPitch) =
                    (CUmemorytype::CU_MEMORYTYPE_HOST, ptr.cast_mut().cast(), pitch);
            }
            Side::Device { ptr, pitch, .. } => {
                (c.dstMemoryType, c.dstDevice, c.dstPitch) = (CUmemorytype::CU_MEMORYTYPE_DEVICE, ptr, pitch);
            }
        }
        // SAFETY: a fully initialised descriptor of valid regions (the caller's promise); the
        // stream's context is current.
        unsafe { drv!(cuMemcpy2DAsync_v2(&c, stream.as_raw())) }
    } else {
        let mut c = CUDA_MEMCPY3D { WidthInBytes: row_bytes, Height: rows, Depth: depth, ..Default::default() };
        match src {
            Side::Host { ptr, pitch, height } => {
                (c.srcMemoryType, c.srcHost, c.srcPitch, c.srcHeight) =
                    (CUmemorytype::CU_MEMORYTYPE_HOST, ptr.cast(), pitch, height);
            }
            Side::Device { ptr, pitch, height } => {
                (c.srcMemoryType, c.srcDevice, c.srcPitch, c.srcHeight) =
                    (CUmemorytype::CU_MEMORYTYPE_DEVICE, ptr, pitch, height);
            }
        }
        match dst {
            Side::Host { ptr, pitch, height } => {
                (c.dstMemoryType, c.dstHost, c.dstPitch, c.dstHeight) =
                    (CUmemorytype::CU_MEMORYTYPE_HOST, ptr.cast_mut().cast(), pitch, height);
            }
            Side::Device { ptr, pitch, height } => {
                (c.dstMemoryType, c.dstDevice, c.dstPitch, c.dstHeight) =
                    (CUmemorytype::CU_MEMORYTYPE_DEVICE, ptr, pitch, height);
            }
        }
        // SAFETY: as above.
        unsafe { drv!(cuMemcpy3DAsync_v2(&c, stream.as_raw())) }
    }
}

/// Checks that a host slice of `len` elements of `T` holds `rows` rows of `width` elements, `stride`
/// elements apart, and returns the stride in bytes (the host pitch). With one row the slice does
/// not bound the stride, so its bytes are checked apart.
fn check_host<T>(what: &str, len: usize, width: usize, rows: usize, stride: usize) -> Result<usize> {
    if stride < width {
        return Err(Error::InvalidArgument(format!(
            "{what}: a row stride of {stride} elements is less than the width {width}"
        )));
    }
    let need = if rows == 0 || width == 0 { 0 } else { (rows - 1).saturating_mul(stride).saturating_add(width) };
    if len < need {
        return Err(Error::InvalidArgument(format!(
            "{what}: {rows} rows of {width} elements, {stride} apart, need {need} elements; the slice has {len}"
        )));
    }
    byte_len::<T>(stride).map_err(|_| {
        Error::InvalidArgument(format!(
            "{what}: a row stride of {stride} elements of {} bytes overflows (more than isize::MAX bytes)",
            size_of::<T>()
        ))
    })
}

/// Checks that `width * height * depth` elements can be counted (`len()`): with zero-sized
/// elements, or with no rows, the allocation's own size check does not bound them.
fn check_count(width: usize, height: usize, depth: usize) -> Result<()> {
    match width.checked_mul(height).and_then(|n| n.checked_mul(depth)) {
        Some(_) => Ok(()),
        None => Err(Error::InvalidArgument(format!("{width}x{height}x{depth} elements overflow"))),
    }
}

/// A 2D array of `T` in pitched device memory (`cuMemAllocPitch`): `height` rows of `width`
/// elements, each row starting [`pitch`](DeviceBuffer2D::pitch) bytes after the previous one.
///
/// * Its copies and memsets are queued on its stream, as [`DeviceBuffer`]'s; the synchronous ones
///   (`copy_from_host`, `to_vec`, `memset_sync`) wait.
/// * [`DeviceBuffer2D::view`] and [`DeviceBuffer2D::row`] borrow rectangles of it, which copy
///   ([`DeviceBuffer2D::copy_rect_from`]) and launch like the buffer.
/// * Used on another stream (done for you by copies and launches), its free waits for that
///   stream too.
/// * Element `(x, y)` is at `as_raw() + y * pitch() + x * size_of::<T>()`: kernels take the
///   pitch as an argument.
/// * Allocation and free are synchronous (`cuMemAllocPitch`, `cuMemFree`): a drop waits on the
///   host for the work queued on the buffer's stream and on every stream its use was recorded on,
///   then frees. For buffers made and dropped on a hot path, allocate a [`DeviceBuffer`] with a
///   pitch of your own instead: it is freed in stream order.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, memory::DeviceBuffer2D};
/// let stream = Stream::new(&Device::get(0)?)?;
/// let image: Vec<f32> = (0..640 * 480).map(|i| i as f32).collect();
/// let mut a = DeviceBuffer2D::from_slice(&image, 640, 480, &stream)?;
/// assert!(a.pitch() >= 640 * 4);
/// let mut b = DeviceBuffer2D::<f32>::zeroed(320, 240, &stream)?;
/// b.copy_rect_from((0, 0), &a.view(160..480, 120..360)?)?; // the centre
/// assert_eq!(b.row(0)?.to_vec()?, image[120 * 640 + 160..120 * 640 + 480]);
/// a.fill(1.0)?;
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct DeviceBuffer2D<T: DeviceRepr> {
    mem: Pitched,
    width: usize,
    height: usize,
    _t: PhantomData<T>,
}

impl<T: DeviceRepr> DeviceBuffer2D<T> {
    /// `height` rows of `width` elements on `stream`'s device, with unspecified contents.
    ///
    /// # Safety
    /// As [`DeviceBuffer::uninit`]: every bit pattern is a valid `T`, but the memory may hold
    /// another allocation's old data.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`]; [`Error::InvalidArgument`] on overflow; the driver's error (a row
    /// wider than `CU_DEVICE_ATTRIBUTE_MAX_PITCH`).
    pub unsafe fn uninit(width: usize, height: usize, stream: &Stream) -> Result<DeviceBuffer2D<T>> {
        check_count(width, height, 1)?;
        let row_bytes = width
            .checked_mul(size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("{width} elements of {} bytes overflow", size_of::<T>())))?;
        Ok(DeviceBuffer2D {
            mem: Pitched::new(row_bytes, height, size_of::<T>(), stream)?,
            width,
            height,
            _t: PhantomData,
        })
    }

    /// `height` rows of `width` zeroed elements (a memset queued on `stream`).
    ///
    /// # Errors
    /// As [`DeviceBuffer2D::uninit`].
    pub fn zeroed(width: usize, height: usize, stream: &Stream) -> Result<DeviceBuffer2D<T>> {
        // SAFETY: zeroed (in stream order) before anything can read it.
        let mut b = unsafe { Self::uninit(width, height, stream)? };
        b.memset(0)?;
        Ok(b)
    }

    /// A buffer holding `data`, `height` rows of `width` elements one after the other. Waits for
    /// the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `data.len()` is not `width * height`; as
    /// [`DeviceBuffer2D::uninit`].
    pub fn from_slice(data: &[T], width: usize, height: usize, stream: &Stream) -> Result<DeviceBuffer2D<T>> {
        if width.checked_mul(height) != Some(data.len()) {
            return Err(Error::InvalidArgument(format!("{} elements are not {height} rows of {width}", data.len())));
        }
        // SAFETY: every element is written by the copy before anyone can read it.
        let mut b = unsafe { Self::uninit(width, height, stream)? };
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// Elements per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows.
    pub fn height(&self) -> usize {
        self.height
    }

    /// Elements in all: `width * height`.
    pub fn len(&self) -> usize {
        self.width * self.height
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes from the start of one row to the start of the next (at least
    /// `width * size_of::<T>()`; 0 for an empty buffer).
    pub fn pitch(&self) -> usize {
        self.mem.pitch
    }

    /// The device address of element (0, 0) (0 for an empty buffer).
    pub fn as_raw(&self) -> DevicePtr {
        self.mem.ptr
    }

    /// The stream the buffer's copies and memsets are queued on, and its free waits for.
    pub fn stream(&self) -> &Stream {
        &self.mem.stream
    }

    /// The buffer's device.
    pub fn device(&self) -> Device {
        self.mem.device()
    }

    /// Records that work on `stream` uses the buffer, as [`DeviceBuffer::record_use`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device; the driver's error.
    pub fn record_use(&self, stream: &Stream) -> Result<()> {
        self.mem.record_use(stream)
    }

    /// The rectangle of columns `cols` and rows `rows`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer.
    pub fn view(&self, cols: impl RangeBounds<usize>, rows: impl RangeBounds<usize>) -> Result<DeviceView2D<'_, T>> {
        let (x0, x1) = range(cols, self.width, "columns")?;
        let (y0, y1) = range(rows, self.height, "rows")?;
        Ok(DeviceView2D {
            ptr: self.mem.at(x0 * size_of::<T>(), y0),
            width: x1 - x0,
            height: y1 - y0,
            mem: &self.mem,
            _t: PhantomData,
        })
    }

    /// Row `y`, as a view one row high.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a row outside the buffer.
    pub fn row(&self, y: usize) -> Result<DeviceView2D<'_, T>> {
        self.view(.., y..=y)
    }

    /// The whole buffer as a view.
    pub fn as_view(&self) -> DeviceView2D<'_, T> {
        DeviceView2D { ptr: self.mem.ptr, width: self.width, height: self.height, mem: &self.mem, _t: PhantomData }
    }

    /// Sets every byte of every row's data to `byte` (`cuMemsetD2D8Async`, queued on the
    /// buffer's stream); the padding after each row is left alone.
    ///
    /// # Errors
    /// The driver's error.
    pub fn memset(&mut self, byte: u8) -> Result<()> {
        self.mem.memset_async(0, self.height, self.mem.row_bytes, u32::from(byte), 1)
    }

    /// Sets every element to `value`, for element sizes of 1, 2 or 4 bytes
    /// (`cuMemsetD2D8/16/32Async`, queued on the buffer's stream).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for other sizes; the driver's error.
    pub fn fill(&mut self, value: T) -> Result<()> {
        let bits = element_bits(&value)?;
        self.mem.memset_async(0, self.height, self.width, bits, size_of::<T>())
    }

    /// Sets every byte of every row's data to `byte` and returns once it is done (a
    /// `cuMemsetD2D8Async` on the buffer's stream, waited for), ordered as
    /// [`DeviceBuffer::memset_sync`].
    ///
    /// # Errors
    /// The driver's error.
    pub fn memset_sync(&mut self, byte: u8) -> Result<()> {
        self.mem.memset_sync(self.mem.row_bytes, u32::from(byte), 1)
    }

    /// Sets every element to `value` and returns once it is done (`cuMemsetD2D8/16/32Async` on the
    /// buffer's stream, waited for), for element sizes of 1, 2 or 4 bytes, ordered as
    /// [`DeviceBuffer::memset_sync`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for other sizes; the driver's error.
    pub fn fill_sync(&mut self, value: T) -> Result<()> {
        let bits = element_bits(&value)?;
        self.mem.memset_sync(self.width, bits, size_of::<T>())
    }

    /// Copies `src` (`height` rows of `width` elements, one after the other) into the buffer and
    /// waits for the copy.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `src.len()` is not `width * height`; the driver's error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        if src.len() != self.len() {
            return Err(Error::LengthMismatch { what: "the DeviceBuffer2D", expected: self.len(), found: src.len() });
        }
        self.copy_from_host_strided(src, self.width)
    }

    /// Copies `height` rows of `width` elements from `src`, whose rows are `src_stride` elements
    /// apart, into the buffer, and waits for the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `src` is too short or the stride less than the width; the
    /// driver's error.
    pub fn copy_from_host_strided(&mut self, src: &[T], src_stride: usize) -> Result<()> {
        let pitch =
            check_host::<T>("DeviceBuffer2D::copy_from_host_strided", src.len(), self.width, self.height, src_stride)?;
        let access = self.mem.stream.refuse_host_copy("copying host memory into a DeviceBuffer2D")?;
        let host = Side::Host { ptr: src.as_ptr().cast(), pitch, height: self.height };
        let dev = Side::Device { ptr: self.mem.ptr, pitch: self.mem.pitch, height: self.height };
        // SAFETY: the device side is this buffer, held mutably; `src` covers the region (checked)
        // and stays borrowed until the stream is synchronised below.
        unsafe { copy_region(dev, host, self.mem.row_bytes, self.height, 1, &self.mem.stream) }?;
        self.mem.stream.wait_for_access(access)
    }

    /// Copies the buffer into `dst` (`height` rows of `width` elements, one after the other) and
    /// waits for the copy.
    ///
    /// # Errors
    /// As [`DeviceBuffer2D::copy_from_host`].
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.as_view().copy_to_host(dst)
    }

    /// Copies the buffer into `dst`, whose rows are `dst_stride` elements apart, and waits.
    ///
    /// # Errors
    /// As [`DeviceBuffer2D::copy_from_host_strided`].
    pub fn copy_to_host_strided(&self, dst: &mut [T], dst_stride: usize) -> Result<()> {
        self.as_view().copy_to_host_strided(dst, dst_stride)
    }

    /// The buffer's contents, row after row, in a `Vec` (waits for the buffer's stream).
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.as_view().to_vec()
    }

    /// Copies `src`, a rectangle of any 2D buffer of the device, into this buffer with its
    /// corner at `at` = (column, row), queued on this buffer's stream (`cuMemcpy2DAsync`). The
    /// source's use on that stream is recorded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the rectangle does not fit at `at`;
    /// [`Error::DeviceMismatch`] for a source of another device; the driver's error.
    pub fn copy_rect_from(&mut self, at: (usize, usize), src: &DeviceView2D<'_, T>) -> Result<()> {
        let (x, y) = at;
        if x.checked_add(src.width).is_none_or(|e| e > self.width)
            || y.checked_add(src.height).is_none_or(|e| e > self.height)
        {
            return Err(Error::InvalidArgument(format!(
                "a {}x{} rectangle does not fit at ({x}, {y}) of a {}x{} buffer",
                src.width, src.height, self.width, self.height
            )));
        }
        same_device("DeviceBuffer2D::copy_rect_from", self.device(), src.mem.device())?;
        // Held until the copy is queued: a capture begun meanwhile would take it unseen.
        let _gates = src.mem.use_on(&self.mem.stream)?;
        let dst = Side::Device { ptr: self.mem.at(x * size_of::<T>(), y), pitch: self.mem.pitch, height: self.height };
        let from = Side::Device { ptr: src.ptr, pitch: src.mem.pitch, height: src.height };
        // SAFETY: both rectangles lie in live allocations (checked); the destination is held
        // mutably and so is not the source's buffer; ordered on this buffer's stream, after the
        // source's stream (record_use).
        unsafe { copy_region(dst, from, src.width * size_of::<T>(), src.height, 1, &self.mem.stream) }
    }

    /// Copies all of `src` (of the same width and height) into this buffer, queued on this
    /// buffer's stream.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the shapes differ; as [`DeviceBuffer2D::copy_rect_from`].
    pub fn copy_from(&mut self, src: &DeviceBuffer2D<T>) -> Result<()> {
        same_shape((self.width, self.height), (src.width, src.height))?;
        self.copy_rect_from((0, 0), &src.as_view())
    }

    /// Copies a [`DeviceBuffer`] holding `height` rows of `width` elements one after the other
    /// into this buffer, queued on this buffer's stream (`src`'s use there is recorded).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `src.len()` is not `width * height`;
    /// [`Error::DeviceMismatch`] across devices; the driver's error.
    pub fn copy_from_buffer(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        check_len("the pitched buffer", self.len(), src.len())?;
        same_device("DeviceBuffer2D::copy_from_buffer", self.device(), src.device())?;
        let _gates = src.use_on(&self.mem.stream)?;
        let dst = Side::Device { ptr: self.mem.ptr, pitch: self.mem.pitch, height: self.height };
        let from = Side::Device { ptr: src.as_raw(), pitch: self.mem.row_bytes, height: self.height };
        // SAFETY: the source holds `height` tight rows (checked); the destination is held
        // mutably; ordered on this buffer's stream after `src`'s.
        unsafe { copy_region(dst, from, self.mem.row_bytes, self.height, 1, &self.mem.stream) }
    }

    /// Copies this buffer into a [`DeviceBuffer`] of `width * height` elements, row after row,
    /// queued on `dst`'s stream (this buffer's use there is recorded).
    ///
    /// # Errors
    /// As [`DeviceBuffer2D::copy_from_buffer`].
    pub fn copy_to_buffer(&self, dst: &mut DeviceBuffer<T>) -> Result<()> {
        check_len("the pitched buffer", self.len(), dst.len())?;
        same_device("DeviceBuffer2D::copy_to_buffer", self.device(), dst.device())?;
        let _gates = self.mem.use_on(dst.stream())?;
        let to = Side::Device { ptr: dst.as_raw(), pitch: self.mem.row_bytes, height: self.height };
        let from = Side::Device { ptr: self.mem.ptr, pitch: self.mem.pitch, height: self.height };
        // SAFETY: the destination holds `height` tight rows (checked) and is held mutably;
        // ordered on its stream after this buffer's.
        unsafe { copy_region(to, from, self.mem.row_bytes, self.height, 1, dst.stream()) }
    }

    /// Queues a copy from pinned host memory (`height` rows of `width` elements, one after the
    /// other) on the buffer's stream and returns at once; `src`'s host access waits for it, as
    /// with [`DeviceBuffer::copy_from_pinned_async`].
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_from_pinned_async(&mut self, src: &PinnedBuffer<T>) -> Result<()> {
        check_len("the pitched buffer", self.len(), src.len())?;
        if self.is_empty() {
            return Ok(());
        }
        // First, and held until the copy is tracked: a capturing stream is refused before
        // anything is queued on it, and no capture begins before the tracking record.
        let _gate = self.mem.stream.refuse_host_access(CAPTURE)?;
        let copy = src.prepare(&self.mem.stream)?;
        let host = Side::Host { ptr: src.as_ptr().cast(), pitch: self.mem.row_bytes, height: self.height };
        let dev = Side::Device { ptr: self.mem.ptr, pitch: self.mem.pitch, height: self.height };
        // SAFETY: `src` stays allocated and unchanged until the copy is done (`commit` tracks it);
        // the destination is held mutably.
        unsafe { copy_region(dev, host, self.mem.row_bytes, self.height, 1, &self.mem.stream) }?;
        src.commit(copy, &self.mem.stream);
        Ok(())
    }

    /// Queues a copy into pinned host memory on the buffer's stream and returns at once; `dst`'s
    /// host access waits for it.
    ///
    /// # Errors
    /// As [`DeviceBuffer2D::copy_from_pinned_async`].
    pub fn copy_to_pinned_async(&self, dst: &mut PinnedBuffer<T>) -> Result<()> {
        check_len("the pitched buffer", self.len(), dst.len())?;
        if self.is_empty() {
            return Ok(());
        }
        // As in copy_from_pinned_async.
        let _gate = self.mem.stream.refuse_host_access(CAPTURE)?;
        let copy = dst.prepare(&self.mem.stream)?;
        let host = Side::Host {
            ptr: dst.as_mut_ptr_unsynced().cast_const().cast(),
            pitch: self.mem.row_bytes,
            height: self.height,
        };
        let dev = Side::Device { ptr: self.mem.ptr, pitch: self.mem.pitch, height: self.height };
        // SAFETY: `dst` waits for the copy before host access and before it is freed.
        unsafe { copy_region(host, dev, self.mem.row_bytes, self.height, 1, &self.mem.stream) }?;
        dst.commit(copy, &self.mem.stream);
        Ok(())
    }
}

impl<T: DeviceRepr> fmt::Debug for DeviceBuffer2D<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer2D")
            .field("ptr", &format_args!("{:#x}", self.mem.ptr))
            .field("width", &self.width)
            .field("height", &self.height)
            .field("pitch", &self.mem.pitch)
            .field("device", &self.device().ordinal())
            .finish()
    }
}

/// A borrowed rectangle of a [`DeviceBuffer2D`] (or a slice of a [`DeviceBuffer3D`]): `height`
/// rows of `width` elements, [`pitch`](DeviceView2D::pitch) bytes apart.
#[derive(Clone, Copy)]
pub struct DeviceView2D<'a, T: DeviceRepr> {
    ptr: DevicePtr,
    width: usize,
    height: usize,
    mem: &'a Pitched,
    _t: PhantomData<&'a T>,
}

impl<T: DeviceRepr> DeviceView2D<'_, T> {
    /// Records a use of the view's buffer on `stream` (see [`DeviceBuffer2D::record_use`]).
    pub(crate) fn record_use(&self, stream: &Stream) -> Result<()> {
        self.mem.record_use(stream)
    }

    /// Elements per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows.
    pub fn height(&self) -> usize {
        self.height
    }

    /// Elements in all.
    pub fn len(&self) -> usize {
        self.width * self.height
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes from one row to the next (the buffer's pitch).
    pub fn pitch(&self) -> usize {
        self.mem.pitch
    }

    /// The device address of the view's first element.
    pub fn as_raw(&self) -> DevicePtr {
        self.ptr
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.mem.device()
    }

    /// The rectangle of columns `cols` and rows `rows` of this view.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the view.
    pub fn view(&self, cols: impl RangeBounds<usize>, rows: impl RangeBounds<usize>) -> Result<Self> {
        let (x0, x1) = range(cols, self.width, "columns")?;
        let (y0, y1) = range(rows, self.height, "rows")?;
        let ptr = self.ptr + (y0 * self.mem.pitch + x0 * size_of::<T>()) as u64;
        Ok(DeviceView2D { ptr, width: x1 - x0, height: y1 - y0, mem: self.mem, _t: PhantomData })
    }

    /// Row `y` of this view, as a view one row high.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a row outside the view.
    pub fn row(&self, y: usize) -> Result<Self> {
        self.view(.., y..=y)
    }

    /// Copies the view into `dst` (rows one after the other) and waits (on the buffer's stream).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when `dst.len()` is not `width * height`; the driver's error.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        check_len("the pitched buffer", self.len(), dst.len())?;
        self.copy_to_host_strided_uninit(as_uninit(dst), self.width)
    }

    /// Copies the view into `dst`, whose rows are `dst_stride` elements apart, and waits.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `dst` is too short or the stride less than the width; the
    /// driver's error.
    pub fn copy_to_host_strided(&self, dst: &mut [T], dst_stride: usize) -> Result<()> {
        self.copy_to_host_strided_uninit(as_uninit(dst), dst_stride)
    }

    /// [`DeviceView2D::copy_to_host_strided`] into memory that may not be initialised yet; the
    /// rows are, once this returns `Ok`.
    fn copy_to_host_strided_uninit(&self, dst: &mut [MaybeUninit<T>], dst_stride: usize) -> Result<()> {
        let pitch =
            check_host::<T>("DeviceView2D::copy_to_host_strided", dst.len(), self.width, self.height, dst_stride)?;
        let access = self.mem.stream.refuse_host_copy("copying a DeviceBuffer2D to the host")?;
        let host = Side::Host { ptr: dst.as_mut_ptr().cast_const().cast(), pitch, height: self.height };
        let dev = Side::Device { ptr: self.ptr, pitch: self.mem.pitch, height: self.height };
        // SAFETY: `dst` covers the region (checked) and stays borrowed until the stream is
        // synchronised below; the source is live device memory.
        unsafe { copy_region(host, dev, self.width * size_of::<T>(), self.height, 1, &self.mem.stream) }?;
        // Never returns while the copy may still write `dst`.
        self.mem.stream.wait_for_access(access)
    }

    /// The view's contents, row after row, in a `Vec`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // SAFETY: rows of `width` elements one after the other: the copy writes all of them when
        // it returns `Ok`, having waited for it.
        unsafe { vec_written(self.len(), |dst| self.copy_to_host_strided_uninit(dst, self.width)) }
    }
}

impl<T: DeviceRepr> fmt::Debug for DeviceView2D<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceView2D")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("width", &self.width)
            .field("height", &self.height)
            .field("pitch", &self.mem.pitch)
            .finish()
    }
}

/// A 3D array of `T` in pitched device memory: `depth` slices of `height` rows of `width`
/// elements, allocated as `height * depth` pitched rows (`cuMemAllocPitch`), copied with
/// `cuMemcpy3DAsync`. Element `(x, y, z)` is at
/// `as_raw() + (z * height + y) * pitch() + x * size_of::<T>()`.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, memory::DeviceBuffer3D};
/// let stream = Stream::new(&Device::get(0)?)?;
/// let volume: Vec<u16> = (0..64 * 64 * 16).map(|i| i as u16).collect();
/// let a = DeviceBuffer3D::from_slice(&volume, (64, 64, 16), &stream)?;
/// let mut b = DeviceBuffer3D::<u16>::zeroed((8, 8, 8), &stream)?;
/// b.copy_box_from((0, 0, 0), &a, (10, 20, 4), (8, 8, 8))?; // an 8x8x8 box of `a`
/// assert_eq!(b.slice(0)?.row(0)?.to_vec()?, volume[(4 * 64 + 20) * 64 + 10..][..8]);
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct DeviceBuffer3D<T: DeviceRepr> {
    mem: Pitched,
    width: usize,
    height: usize,
    depth: usize,
    _t: PhantomData<T>,
}

impl<T: DeviceRepr> DeviceBuffer3D<T> {
    /// A buffer of `(width, height, depth)` elements with unspecified contents.
    ///
    /// # Safety
    /// As [`DeviceBuffer::uninit`].
    ///
    /// # Errors
    /// As [`DeviceBuffer2D::uninit`].
    pub unsafe fn uninit(extent: (usize, usize, usize), stream: &Stream) -> Result<DeviceBuffer3D<T>> {
        let (width, height, depth) = extent;
        check_count(width, height, depth)?;
        let overflow = || {
            Error::InvalidArgument(format!("a {width}x{height}x{depth} volume of {} bytes overflows", size_of::<T>()))
        };
        let row_bytes = width.checked_mul(size_of::<T>()).ok_or_else(overflow)?;
        let rows = height.checked_mul(depth).ok_or_else(overflow)?;
        Ok(DeviceBuffer3D {
            mem: Pitched::new(row_bytes, rows, size_of::<T>(), stream)?,
            width,
            height,
            depth,
            _t: PhantomData,
        })
    }

    /// A zeroed buffer (a memset queued on `stream`).
    ///
    /// # Errors
    /// As [`DeviceBuffer3D::uninit`].
    pub fn zeroed(extent: (usize, usize, usize), stream: &Stream) -> Result<DeviceBuffer3D<T>> {
        // SAFETY: zeroed (in stream order) before anything can read it.
        let mut b = unsafe { Self::uninit(extent, stream)? };
        b.memset(0)?;
        Ok(b)
    }

    /// A buffer holding `data` (x fastest, then y, then z). Waits for the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `data.len()` is not `width * height * depth`; as
    /// [`DeviceBuffer3D::uninit`].
    pub fn from_slice(data: &[T], extent: (usize, usize, usize), stream: &Stream) -> Result<DeviceBuffer3D<T>> {
        let (w, h, d) = extent;
        if w.checked_mul(h).and_then(|n| n.checked_mul(d)) != Some(data.len()) {
            return Err(Error::InvalidArgument(format!("{} elements are not a {w}x{h}x{d} volume", data.len())));
        }
        // SAFETY: every element is written by the copy before anyone can read it.
        let mut b = unsafe { Self::uninit(extent, stream)? };
        b.copy_from_host(data)?;
        Ok(b)
    }

    /// `(width, height, depth)`.
    pub fn extent(&self) -> (usize, usize, usize) {
        (self.width, self.height, self.depth)
    }

    /// Elements in all.
    pub fn len(&self) -> usize {
        self.width * self.height * self.depth
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes from one row to the next; a slice is `pitch() * height` bytes.
    pub fn pitch(&self) -> usize {
        self.mem.pitch
    }

    /// The device address of element (0, 0, 0).
    pub fn as_raw(&self) -> DevicePtr {
        self.mem.ptr
    }

    /// The buffer's stream.
    pub fn stream(&self) -> &Stream {
        &self.mem.stream
    }

    /// The buffer's device.
    pub fn device(&self) -> Device {
        self.mem.device()
    }

    /// Records that work on `stream` uses the buffer, as [`DeviceBuffer::record_use`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device; the driver's error.
    pub fn record_use(&self, stream: &Stream) -> Result<()> {
        self.mem.record_use(stream)
    }

    /// Slice `z`, as a 2D view of `height` rows of `width` elements.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a slice outside the buffer.
    pub fn slice(&self, z: usize) -> Result<DeviceView2D<'_, T>> {
        if z >= self.depth {
            return Err(Error::InvalidArgument(format!("slice {z} of a volume {} deep", self.depth)));
        }
        Ok(DeviceView2D {
            ptr: self.mem.at(0, z * self.height),
            width: self.width,
            height: self.height,
            mem: &self.mem,
            _t: PhantomData,
        })
    }

    /// Sets every byte of the data to `byte` (queued on the buffer's stream).
    ///
    /// # Errors
    /// The driver's error.
    pub fn memset(&mut self, byte: u8) -> Result<()> {
        self.mem.memset_async(0, self.mem.rows, self.mem.row_bytes, u32::from(byte), 1)
    }

    /// Sets every element to `value`, for element sizes of 1, 2 or 4 bytes (queued).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for other sizes; the driver's error.
    pub fn fill(&mut self, value: T) -> Result<()> {
        let bits = element_bits(&value)?;
        self.mem.memset_async(0, self.mem.rows, self.width, bits, size_of::<T>())
    }

    /// Sets every element to `value` and returns once it is done, ordered as
    /// [`DeviceBuffer::memset_sync`].
    ///
    /// # Errors
    /// As [`DeviceBuffer3D::fill`].
    pub fn fill_sync(&mut self, value: T) -> Result<()> {
        let bits = element_bits(&value)?;
        self.mem.memset_sync(self.width, bits, size_of::<T>())
    }

    /// Copies `src` (x fastest, then y, then z) into the buffer and waits (`cuMemcpy3DAsync`).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        check_len("the pitched buffer", self.len(), src.len())?;
        let access = self.mem.stream.refuse_host_copy("copying host memory into a DeviceBuffer3D")?;
        let host = Side::Host { ptr: src.as_ptr().cast(), pitch: self.mem.row_bytes, height: self.height };
        let dev = Side::Device { ptr: self.mem.ptr, pitch: self.mem.pitch, height: self.height };
        // SAFETY: `src` holds the whole volume (checked) and stays borrowed until the stream is
        // synchronised; the buffer is held mutably.
        unsafe { copy_region(dev, host, self.mem.row_bytes, self.height, self.depth, &self.mem.stream) }?;
        self.mem.stream.wait_for_access(access)
    }

    /// Copies the buffer into `dst` (x fastest, then y, then z) and waits.
    ///
    /// # Errors
    /// As [`DeviceBuffer3D::copy_from_host`].
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.copy_to_host_uninit(as_uninit(dst))
    }

    /// [`DeviceBuffer3D::copy_to_host`] into memory that may not be initialised yet; it is, once
    /// this returns `Ok`.
    fn copy_to_host_uninit(&self, dst: &mut [MaybeUninit<T>]) -> Result<()> {
        check_len("the pitched buffer", self.len(), dst.len())?;
        let access = self.mem.stream.refuse_host_copy("copying a DeviceBuffer3D to the host")?;
        let host =
            Side::Host { ptr: dst.as_mut_ptr().cast_const().cast(), pitch: self.mem.row_bytes, height: self.height };
        let dev = Side::Device { ptr: self.mem.ptr, pitch: self.mem.pitch, height: self.height };
        // SAFETY: `dst` holds the whole volume and stays borrowed until the stream is synchronised.
        unsafe { copy_region(host, dev, self.mem.row_bytes, self.height, self.depth, &self.mem.stream) }?;
        self.mem.stream.wait_for_access(access)
    }

    /// The buffer's contents in a `Vec` (x fastest, then y, then z).
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // SAFETY: the copy writes the whole volume when it returns `Ok`, having waited for it.
        unsafe { vec_written(self.len(), |dst| self.copy_to_host_uninit(dst)) }
    }

    /// Copies the box of `extent` elements at `src_at` = (x, y, z) of `src` (any 3D buffer of the
    /// device) to `at` in this buffer, queued on this buffer's stream (`cuMemcpy3DAsync`); `src`'s
    /// use there is recorded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the box lies outside either buffer;
    /// [`Error::DeviceMismatch`] across devices; the driver's error.
    pub fn copy_box_from(
        &mut self,
        at: (usize, usize, usize),
        src: &DeviceBuffer3D<T>,
        src_at: (usize, usize, usize),
        extent: (usize, usize, usize),
    ) -> Result<()> {
        let inside = |o: (usize, usize, usize), e: (usize, usize, usize)| {
            o.0.checked_add(extent.0).is_some_and(|v| v <= e.0)
                && o.1.checked_add(extent.1).is_some_and(|v| v <= e.1)
                && o.2.checked_add(extent.2).is_some_and(|v| v <= e.2)
        };
        if !inside(at, self.extent()) || !inside(src_at, src.extent()) {
            return Err(Error::InvalidArgument(format!(
                "a {extent:?} box at {src_at:?} of a {:?} volume does not fit at {at:?} of a {:?} volume",
                src.extent(),
                self.extent()
            )));
        }
        same_device("DeviceBuffer3D::copy_box_from", self.device(), src.device())?;
        if extent.0 == 0 || extent.1 == 0 || extent.2 == 0 {
            // Nothing to copy (as in copy_region); the corner may then lie one past the last row
            // of the last slice, whose row index (`z * height + y`) could overflow.
            return Ok(());
        }
        let _gates = src.mem.use_on(&self.mem.stream)?;
        let t = size_of::<T>();
        let dst = Side::Device {
            ptr: self.mem.at(at.0 * t, at.2 * self.height + at.1),
            pitch: self.mem.pitch,
            height: self.height,
        };
        let from = Side::Device {
            ptr: src.mem.at(src_at.0 * t, src_at.2 * src.height + src_at.1),
            pitch: src.mem.pitch,
            height: src.height,
        };
        // SAFETY: both boxes lie in live allocations (checked), each slice step is the buffer's
        // own; the destination is held mutably; ordered after the source's stream.
        unsafe { copy_region(dst, from, extent.0 * t, extent.1, extent.2, &self.mem.stream) }
    }

    /// Copies all of `src` (of the same extent) into this buffer, queued on this buffer's stream.
    ///
    /// # Errors
    /// As [`DeviceBuffer3D::copy_box_from`].
    pub fn copy_from(&mut self, src: &DeviceBuffer3D<T>) -> Result<()> {
        if src.extent() != self.extent() {
            return Err(Error::InvalidArgument(format!("extents differ: {:?} and {:?}", self.extent(), src.extent())));
        }
        self.copy_box_from((0, 0, 0), src, (0, 0, 0), self.extent())
    }
}

impl<T: DeviceRepr> fmt::Debug for DeviceBuffer3D<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer3D")
            .field("ptr", &format_args!("{:#x}", self.mem.ptr))
            .field("extent", &self.extent())
            .field("pitch", &self.mem.pitch)
            .field("device", &self.device().ordinal())
            .finish()
    }
}

fn range(r: impl RangeBounds<usize>, len: usize, what: &str) -> Result<(usize, usize)> {
    let start = match r.start_bound() {
        RangeBound::Included(&s) => Some(s),
        RangeBound::Excluded(&s) => s.checked_add(1),
        RangeBound::Unbounded => Some(0),
    };
    let end = match r.end_bound() {
        RangeBound::Included(&e) => e.checked_add(1),
        RangeBound::Excluded(&e) => Some(e),
        RangeBound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e)),
        _ => Err(Error::InvalidArgument(format!(
            "{what} {:?}..{:?} are outside 0..{len}",
            r.start_bound(),
            r.end_bound()
        ))),
    }
}

fn same_shape(a: (usize, usize), b: (usize, usize)) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("shapes differ: {}x{} and {}x{}", a.0, a.1, b.0, b.1)))
    }
}

fn same_device(what: &'static str, expected: Device, found: Device) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(Error::DeviceMismatch { what, expected: expected.ordinal_i32(), found: found.ordinal_i32() })
    }
}

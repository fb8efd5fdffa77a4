//! `SyncResource`: `cuMemAlloc` / `cuMemFree`, synchronising the stream before each free.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{DevicePtr, MemoryResource, MemoryStats, ResourceKind, check_stream, free_when_done};
use crate::capture::RelaxedCaptureMode;
use crate::context::Context;
use crate::device::Device;
use crate::error::Result;
use crate::result::drv;
use crate::stream::Stream;

/// Plain `cuMemAlloc` / `cuMemFree`, with a host synchronisation of the freeing stream before each
/// free (the free must not overtake work still queued on that stream). This is what cuda.core and
/// cudarc do on devices without memory pools: it keeps no memory cached, and it is slow (about
/// 90 µs per allocation and free on an H200, plus the synchronisation). cudrv keeps it as a
/// reference point and for when memory is tighter than speed.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use std::sync::Arc;
/// use cudrv::{Device, Stream, memory::{DeviceBuffer, MemoryResource, SyncResource}};
/// let device = Device::get(0)?;
/// let stream = Stream::new(&device)?;
/// let sync: Arc<dyn MemoryResource> = Arc::new(SyncResource::new(&device)?);
/// let buf = DeviceBuffer::from_slice_in(&[1u8, 2, 3], &stream, sync)?;
/// assert_eq!(buf.to_vec()?, [1, 2, 3]);
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Debug)]
pub struct SyncResource {
    ctx: Arc<Context>,
    in_use: AtomicUsize,
    peak: AtomicUsize,
    allocs: AtomicU64,
}

impl SyncResource {
    /// A resource on `device`.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn new(device: &Device) -> Result<SyncResource> {
        Ok(SyncResource {
            ctx: device.primary_context()?,
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            allocs: AtomicU64::new(0),
        })
    }
}

// SAFETY: cuMemAlloc returns fresh memory (256-byte aligned); a free first waits for the stream,
// so no queued work can touch the memory once it is back with the driver.
unsafe impl MemoryResource for SyncResource {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream("SyncResource::allocate", self.device(), stream)?;
        let _b = self.ctx.bind()?;
        // Never part of a capture: in the global mode the driver would refuse it (a "potentially
        // unsafe" call) and invalidate another thread's capture.
        let _relaxed = RelaxedCaptureMode::enter();
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current. Zero bytes is an error
        // for cuMemAlloc, so a zero-sized request takes one byte.
        unsafe { drv!(cuMemAlloc_v2(&mut ptr, bytes.max(1))) }.map_err(|e| {
            if e.is_out_of_memory() {
                crate::Error::OutOfMemory {
                    requested: bytes,
                    resource: "SyncResource",
                    device: self.device().ordinal_i32(),
                    reserved: self.in_use.load(Ordering::Relaxed),
                    in_use: self.in_use.load(Ordering::Relaxed),
                }
            } else {
                e
            }
        })?;
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        self.allocs.fetch_add(1, Ordering::Relaxed);
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        // Waits even if an unrelated error is pending; never frees while the stream may use it.
        // SAFETY: the caller passes a pointer from `allocate`, freed once; `free_when_done` runs
        // the free once the stream's work is done, with the context current.
        free_when_done(self, &self.ctx, stream, move || unsafe { drv!(cuMemFree_v2(ptr)) })?;
        // Freed, or to be freed on cudrv's thread once the stream's work is done (a failed wait
        // leaks the memory, which stays counted).
        self.in_use.fetch_sub(bytes, Ordering::Relaxed);
        Ok(())
    }

    fn device(&self) -> Device {
        self.ctx.device()
    }

    fn kind(&self) -> ResourceKind {
        ResourceKind::Sync
    }

    fn reset_peaks(&self) -> Result<()> {
        self.peak.store(self.in_use.load(Ordering::Relaxed), Ordering::Relaxed);
        Ok(())
    }

    fn stats(&self) -> Option<MemoryStats> {
        let in_use = self.in_use.load(Ordering::Relaxed);
        let peak = self.peak.load(Ordering::Relaxed);
        Some(MemoryStats {
            reserved: in_use,
            peak_reserved: peak,
            in_use,
            peak_in_use: peak,
            driver_allocations: self.allocs.load(Ordering::Relaxed),
        })
    }
}

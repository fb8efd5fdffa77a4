//! The memory-resource trait, and what resources report.

use std::any::Any;
use std::fmt;

#[cfg(doc)]
use super::*;
use crate::device::Device;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::stream::Stream;

/// A raw device address (`CUdeviceptr`).
pub type DevicePtr = cudrv_sys::CUdeviceptr;

/// A stream-ordered memory resource: memory is allocated for use on a stream and freed in that
/// stream's order, like `cuMemAllocAsync` / `cuMemFreeAsync`.
///
/// Most code allocates through [`DeviceBuffer`], which holds the resource and
/// frees in order; the raw calls:
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, memory::MemoryResource};
/// let device = Device::get(0)?;
/// let stream = Stream::new(&device)?;
/// let resource = device.memory_resource()?; // the driver's pool, or StreamOrderedPool on TCC
/// let ptr = resource.allocate(1 << 20, &stream)?;
/// // ... work on `stream` that uses `ptr` ...
/// // SAFETY: `ptr` came from this resource with this size, and its uses are queued on `stream`.
/// unsafe { resource.deallocate(ptr, 1 << 20, &stream)? };
/// if let Some(stats) = resource.stats() {
///     println!("{} bytes reserved", stats.reserved);
/// }
/// resource.trim(0)?; // give cached memory back to the driver
/// # Ok::<(), cudrv::Error>(())
/// ```
///
/// Resources are `'static` ([`Any`]), so that a `dyn MemoryResource` can be downcast to what it
/// is (cudrv calls its own [`StreamOrderedPool`] directly, for example).
///
/// When a [`DeviceBuffer`] calls a resource's `allocate` or `deallocate`, it holds the stream's
/// capture gate, so that no capture begins or ends on the stream between its look at the stream
/// and the resource's work there: an implementation must not begin a capture on that stream (it
/// would wait for ever), nor wait for another thread to begin one there or to end one that the
/// stream takes part in (that thread waits for the gate). Ending such a capture itself is
/// refused ([`Error::Capturing`]). Queueing work on it, and waiting for it, are fine; but a wait
/// holds the gate while it lasts, so a capture that another thread begins on the stream waits
/// for it too. cudrv's own resources whose free waits for the stream ([`SyncResource`],
/// [`ManagedResource`], [`PinnedHostResource`])
/// let the buffer's gate go while they wait, when the buffer holds them directly (not through a
/// resource that wraps them, which may queue work after their free); a [`StreamOrderedPool`],
/// whose allocation may wait for other streams' frees when memory runs short, allocates without
/// the gate outside a capture.
///
/// # Safety
/// Implementations must return from [`allocate`](MemoryResource::allocate) memory of at least
/// `bytes` bytes, aligned to at least 256 bytes, that is not in use by anything else on the GPU or
/// host once work queued on `stream` after the call runs; and must not hand the same memory out
/// again before work queued on the freeing stream before [`deallocate`](MemoryResource::deallocate)
/// has completed (or is ordered before the new user).
pub unsafe trait MemoryResource: Any + Send + Sync + fmt::Debug {
    /// Allocates `bytes` bytes for use on `stream`. The memory is usable by work queued on
    /// `stream` after this call (other streams must be ordered after it).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`], [`Error::DeviceMismatch`] for a stream of another device, or the
    /// driver's error.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr>;

    /// Frees `ptr` in `stream`'s order: it may be reused once work queued on `stream` before this
    /// call has run.
    ///
    /// # Safety
    /// `ptr` must come from `allocate` of this resource with the same `bytes`, not be freed
    /// already, and every use of it must be queued on `stream` before this call or be ordered
    /// before it (completed, or waited on by `stream`).
    ///
    /// # Errors
    /// [`Error::NotFromResource`] (or the driver's error) for a pointer this resource did not hand out
    /// (nothing changes);
    /// the driver's error.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()>;

    /// The device the memory belongs to.
    fn device(&self) -> Device;

    /// Which resource this is.
    fn kind(&self) -> ResourceKind;

    /// Whether kernels on the device can access the memory.
    fn is_device_accessible(&self) -> bool {
        true
    }

    /// Whether the resource can allocate on a stream that is capturing a graph (see
    /// [`crate::graph`]): its allocation and free must then become part of the graph, or the
    /// memory must stay reserved for the graph's life. `false` unless a resource says so: cudrv
    /// then refuses such allocations with [`Error::Capturing`].
    fn supports_capture(&self) -> bool {
        false
    }

    /// Whether the host can access the memory directly.
    fn is_host_accessible(&self) -> bool {
        false
    }

    /// Byte counts, where the resource keeps them.
    fn stats(&self) -> Option<MemoryStats> {
        None
    }

    /// Gives cached memory back to the driver until at most `keep_bytes` stay reserved. Resources
    /// that cache nothing do nothing.
    ///
    /// # Errors
    /// The driver's error.
    fn trim(&self, keep_bytes: usize) -> Result<()> {
        let _ = keep_bytes;
        Ok(())
    }

    /// Sets the release threshold: the most memory the resource keeps cached before giving free
    /// memory back to the driver as it goes (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` for the driver's
    /// pools). Resources that cache nothing ignore it.
    ///
    /// # Errors
    /// The driver's error.
    fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        let _ = bytes;
        Ok(())
    }

    /// Resets the high-water marks of [`MemoryResource::stats`] to the current values.
    ///
    /// # Errors
    /// The driver's error.
    fn reset_peaks(&self) -> Result<()> {
        Ok(())
    }
}

/// Byte counts of a resource, current and highest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held from the driver.
    pub reserved: usize,
    /// Highest `reserved`.
    pub peak_reserved: usize,
    /// Bytes handed out and not freed.
    pub in_use: usize,
    /// Highest `in_use`.
    pub peak_in_use: usize,
    /// Allocations made from the driver (`cuMemAlloc` calls), where known.
    pub driver_allocations: u64,
}

/// The kinds of memory resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResourceKind {
    /// [`DriverPool`].
    DriverPool,
    /// [`StreamOrderedPool`].
    StreamOrderedPool,
    /// [`SyncResource`].
    Sync,
    /// [`ManagedResource`].
    Managed,
    /// [`PinnedHostResource`].
    PinnedHost,
    /// A resource written outside cudrv.
    Custom,
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ResourceKind::DriverPool => "DriverPool",
            ResourceKind::StreamOrderedPool => "StreamOrderedPool",
            ResourceKind::Sync => "SyncResource",
            ResourceKind::Managed => "ManagedResource",
            ResourceKind::PinnedHost => "PinnedHostResource",
            ResourceKind::Custom => "custom",
        })
    }
}

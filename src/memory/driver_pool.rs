//! `DriverPool`: the driver's stream-ordered allocator (`cuMemAllocFromPoolAsync`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudrv_sys::{CUmemPool_attribute as Attr, CUmemoryPool, CUresult, cuuint64_t};

use super::{DevicePtr, MemoryResource, MemoryStats, ResourceKind, StreamOrderedPool, check_stream};
use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::check;
use crate::error::{Error, Result};
use crate::result::{driver, drv};
use crate::stream::Stream;

/// The configuration of an owned pool ([`DriverPool::with_config`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverPoolConfig {
    /// Bytes the pool keeps cached at a synchronisation point before giving memory back to the
    /// driver. The default is `u64::MAX`, see [`DriverPool`].
    pub release_threshold: u64,
    /// The most bytes the pool may reserve (0: no limit). Needs a driver and headers of CUDA 12.8
    /// or newer (`CUmemPoolProps::maxSize`).
    pub max_size: usize,
}

impl Default for DriverPoolConfig {
    fn default() -> Self {
        DriverPoolConfig { release_threshold: u64::MAX, max_size: 0 }
    }
}

/// The driver's memory pool: the device's default pool, or one of its own.
///
/// The release threshold is raised to `u64::MAX` by default. The driver's default is 0, which
/// gives every cached byte back to the OS at each synchronisation, so that the next allocation
/// after a `synchronize` pays for a fresh mapping: about twice as slow overall (cuda.core #756).
/// Use [`MemoryResource::trim`] to give memory back explicitly.
///
/// If the driver refuses pool allocation at run time (`CUDA_ERROR_NOT_SUPPORTED`) although the
/// device reports pools, the resource switches to a [`StreamOrderedPool`] for the rest of its
/// life and says so on stderr, instead of failing.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use std::sync::Arc;
/// use cudrv::{Device, Stream, memory::{DeviceBuffer, DriverPool, DriverPoolConfig, MemoryResource}};
/// let device = Device::get(0)?;
/// if device.capabilities()?.memory_pools {
///     // A pool of its own, that gives memory back above 1 GiB cached.
///     let pool = Arc::new(DriverPool::with_config(&device, DriverPoolConfig { release_threshold: 1 << 30, ..Default::default() })?);
///     let stream = Stream::new(&device)?;
///     let buf = DeviceBuffer::<f32>::zeroed_in(1 << 20, &stream, pool.clone())?;
///     assert_eq!(buf.len(), 1 << 20);
/// }
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Debug)]
pub struct DriverPool {
    ctx: Arc<Context>,
    /// `ctx`'s device, kept here for the hot path's device check (one dependent load less).
    device: Device,
    pool: RawPool,
    owned: bool,
    fallback: OnceLock<StreamOrderedPool>,
    switched: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct RawPool(CUmemoryPool);

impl RawPool {
    /// The handle. (A method, so that closures capture the whole `Send` wrapper.)
    fn get(self) -> CUmemoryPool {
        self.0
    }
}

// SAFETY: a CUmemoryPool handle may be used from any thread; the driver serialises pool access.
unsafe impl Send for RawPool {}
// SAFETY: as above.
unsafe impl Sync for RawPool {}

impl DriverPool {
    fn require_pools(device: &Device) -> Result<()> {
        let caps = device.capabilities()?;
        if caps.memory_pools {
            Ok(())
        } else {
            Err(device.unsupported("memory pools", super::pools_missing_reason(caps), Some("StreamOrderedPool")))
        }
    }

    /// Asks the driver for the device's default pool, without keeping it.
    pub(crate) fn probe(device: &Device) -> Result<()> {
        Self::require_pools(device)?;
        let ctx = device.primary_context()?;
        let _b = ctx.bind()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device.
        unsafe { drv!(cuDeviceGetDefaultMemPool(&mut pool, device.as_raw())) }
    }

    /// The device's default pool, with the release threshold raised to `u64::MAX`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no pools; the driver's error.
    pub fn default_pool(device: &Device) -> Result<DriverPool> {
        Self::require_pools(device)?;
        let ctx = device.primary_context()?;
        let mut pool = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: valid out-pointer and device.
            unsafe { drv!(cuDeviceGetDefaultMemPool(&mut pool, device.as_raw())) }?;
        }
        let p = DriverPool {
            ctx,
            device: *device,
            pool: RawPool(pool),
            owned: false,
            fallback: OnceLock::new(),
            switched: AtomicBool::new(false),
        };
        p.set_attribute(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)?;
        Ok(p)
    }

    /// A new pool of the device's own (`cuMemPoolCreate`), destroyed with this value.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device has no pools (or `max_size` is asked of headers or a
    /// driver older than 12.2); the driver's error.
    pub fn with_config(device: &Device, config: DriverPoolConfig) -> Result<DriverPool> {
        Self::require_pools(device)?;
        let ctx = device.primary_context()?;
        #[allow(unused_mut)]
        let mut props = cudrv_sys::CUmemPoolProps {
            allocType: cudrv_sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: cudrv_sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: cudrv_sys::CUmemLocation {
                type_: cudrv_sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device.ordinal_i32(),
            },
            ..Default::default()
        };
        if config.max_size != 0 {
            #[cfg(cuda_12080)]
            {
                props.maxSize = config.max_size;
            }
            #[cfg(not(cuda_12080))]
            return Err(device.unsupported(
                "a pool size limit",
                "cudrv was built against headers older than CUDA 12.8",
                None,
            ));
        }
        let mut pool = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: valid out-pointer and fully initialised properties.
            unsafe { drv!(cuMemPoolCreate(&mut pool, &props)) }?;
        }
        let p = DriverPool {
            ctx,
            device: *device,
            pool: RawPool(pool),
            owned: true,
            fallback: OnceLock::new(),
            switched: AtomicBool::new(false),
        };
        p.set_attribute(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, config.release_threshold)?;
        Ok(p)
    }

    /// The raw `CUmemoryPool`.
    pub fn as_raw(&self) -> CUmemoryPool {
        self.pool.0
    }

    /// Whether the pool was refused at run time and the fallback is in use.
    pub fn switched_to_fallback(&self) -> bool {
        self.switched.load(Ordering::Acquire)
    }

    fn set_attribute(&self, attr: Attr, mut value: cuuint64_t) -> Result<()> {
        let _b = self.ctx.bind()?;
        // SAFETY: the attribute takes a cuuint64_t, passed by pointer.
        unsafe { drv!(cuMemPoolSetAttribute(self.pool.0, attr, (&raw mut value).cast())) }
    }

    fn attribute(&self, attr: Attr) -> Result<u64> {
        let _b = self.ctx.bind()?;
        let mut value: cuuint64_t = 0;
        // SAFETY: the attribute is a cuuint64_t, written through the pointer.
        unsafe { drv!(cuMemPoolGetAttribute(self.pool.0, attr, (&raw mut value).cast())) }?;
        Ok(value)
    }

    /// Reserved and used bytes, current and high-water, as the driver counts them.
    fn driver_stats(&self) -> Result<MemoryStats> {
        Ok(MemoryStats {
            reserved: self.attribute(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)? as usize,
            peak_reserved: self.attribute(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)? as usize,
            in_use: self.attribute(Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)? as usize,
            peak_in_use: self.attribute(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)? as usize,
            driver_allocations: 0,
        })
    }

    /// Lets `peer` access memory of this pool (`cuMemPoolSetAccess`, read and write).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when `peer` cannot access this device; the driver's error.
    pub fn grant_access(&self, peer: &Device) -> Result<()> {
        if !peer.can_access_peer(&self.device())? {
            return Err(peer.unsupported(
                "peer access to a memory pool",
                format!(
                    "cuDeviceCanAccessPeer says device {} cannot reach device {}",
                    peer.ordinal(),
                    self.device().ordinal()
                ),
                Some("DeviceBuffer::copy_to_peer (copies through the driver)"),
            ));
        }
        let desc = cudrv_sys::CUmemAccessDesc {
            location: cudrv_sys::CUmemLocation {
                type_: cudrv_sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: peer.ordinal_i32(),
            },
            flags: cudrv_sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let _b = self.ctx.bind()?;
        // SAFETY: one valid descriptor, count 1.
        unsafe { drv!(cuMemPoolSetAccess(self.pool.0, &desc, 1)) }
    }

    fn fallback(&self) -> Result<&StreamOrderedPool> {
        if let Some(f) = self.fallback.get() {
            return Ok(f);
        }
        let pool = StreamOrderedPool::new(&self.device())?;
        Ok(self.fallback.get_or_init(|| pool))
    }

    /// Makes a stream-ordered driver call. A stream of its own carries its context, and the
    /// driver takes the context from it, so cudrv makes no context current first (that saves a
    /// `cuCtxGetCurrent` per call on the hot path). The legacy and per-thread streams mean "the
    /// current context's", so for them the context is bound first; and if the driver answers
    /// `CUDA_ERROR_INVALID_CONTEXT` anyway, the call is made again with the context bound.
    #[inline]
    fn stream_call(
        &self,
        stream: &Stream,
        mut call: impl FnMut() -> std::result::Result<CUresult, cudrv_sys::MissingSymbol>,
    ) -> Result<std::result::Result<CUresult, cudrv_sys::MissingSymbol>> {
        if crate::host_fn::in_host_fn() {
            return Err(Error::InHostFunction { call: "DriverPool" });
        }
        if stream.carries_context() {
            let rc = call();
            if rc != Ok(CUresult::CUDA_ERROR_INVALID_CONTEXT) {
                return Ok(rc);
            }
        }
        let _b = self.ctx.bind()?;
        Ok(call())
    }

    fn out_of_memory(&self, bytes: usize) -> Error {
        let stats = self.driver_stats().unwrap_or_default();
        Error::OutOfMemory {
            requested: bytes,
            resource: "DriverPool",
            device: self.device().ordinal_i32(),
            reserved: stats.reserved,
            in_use: stats.in_use,
        }
    }
}

// SAFETY: the driver's pool gives stream-ordered memory with exactly these semantics; the
// fallback is a StreamOrderedPool, which upholds them too.
unsafe impl MemoryResource for DriverPool {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream("DriverPool::allocate", self.device(), stream)?;
        if self.switched.load(Ordering::Acquire) {
            return self.fallback()?.allocate(bytes, stream);
        }
        let mut ptr = 0;
        let d = driver()?;
        // SAFETY: valid out-pointer, pool and stream; the stream's context is current or carried
        // by the stream (`stream_call`). Zero bytes is an error for the driver, so a zero-sized
        // request takes one byte.
        let rc = self.stream_call(stream, || unsafe {
            d.cuMemAllocFromPoolAsync(&mut ptr, bytes.max(1), self.pool.0, stream.as_raw())
        })?;
        match rc {
            Ok(CUresult::CUDA_SUCCESS) => Ok(ptr),
            Ok(CUresult::CUDA_ERROR_NOT_SUPPORTED) => {
                if !self.switched.swap(true, Ordering::AcqRel) {
                    warn_line!(
                        "cudrv: device {}: the driver refused memory-pool allocation (CUDA_ERROR_NOT_SUPPORTED); switching to cudrv's StreamOrderedPool",
                        self.device().ordinal()
                    );
                }
                self.fallback()?.allocate(bytes, stream)
            }
            Ok(CUresult::CUDA_ERROR_OUT_OF_MEMORY) => Err(self.out_of_memory(bytes)),
            other => check("cuMemAllocFromPoolAsync", other).map(|()| ptr),
        }
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        if let Some(f) = self.fallback.get()
            && f.owns(ptr, stream)
        {
            // SAFETY: forwarded from the caller; the fallback handed `ptr` out.
            return unsafe { f.deallocate(ptr, bytes, stream) };
        }
        let d = driver()?;
        // SAFETY: the caller passes a live pointer from this pool; the free is ordered on `stream`,
        // whose context is current or carried by the stream (`stream_call`).
        let rc = self.stream_call(stream, || unsafe { d.cuMemFreeAsync(ptr, stream.as_raw()) })?;
        check("cuMemFreeAsync", rc)
    }

    fn device(&self) -> Device {
        self.device
    }

    fn supports_capture(&self) -> bool {
        // The driver records memory nodes; the fallback reserves blocks for the graph.
        true
    }

    fn kind(&self) -> ResourceKind {
        if self.switched_to_fallback() { ResourceKind::StreamOrderedPool } else { ResourceKind::DriverPool }
    }

    fn stats(&self) -> Option<MemoryStats> {
        self.driver_stats().ok()
    }

    fn reset_peaks(&self) -> Result<()> {
        if let Some(f) = self.fallback.get() {
            f.reset_peaks()?;
        }
        self.set_attribute(Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
        self.set_attribute(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
    }

    fn trim(&self, keep_bytes: usize) -> Result<()> {
        if let Some(f) = self.fallback.get() {
            f.trim(keep_bytes)?;
        }
        let _b = self.ctx.bind()?;
        // SAFETY: valid pool handle.
        unsafe { drv!(cuMemPoolTrimTo(self.pool.0, keep_bytes)) }
    }

    fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        if let Some(f) = self.fallback.get() {
            f.set_release_threshold(bytes)?;
        }
        self.set_attribute(Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes as u64)
    }
}

impl Drop for DriverPool {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (pool, ctx) = (self.pool, self.ctx.clone());
        let destroy = move || {
            let Ok(driver) = driver() else { return };
            // SAFETY: the pool was created by this value and is destroyed once. The driver defers
            // the release while allocations are outstanding.
            let rc = unsafe { driver.cuMemPoolDestroy(pool.get()) };
            if let Err(e) = check("cuMemPoolDestroy", rc) {
                report_drop_error(Some(&ctx), e);
            }
        };
        crate::host_fn::now_or_deferred(destroy)
    }
}

//! `StreamOrderedPool`: cudrv's stream-ordered caching pool over `cuMemAlloc`, for devices
//! without memory pools. The decisions are made by the plain-Rust [`PoolCore`]; this file only
//! performs the driver calls it asks for.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use cudrv_sys::{CUevent, CUresult};

use super::pool_core::{Backend, PoolConfig, PoolCore, PoolError, PoolStats};
use super::{DevicePtr, MemoryResource, MemoryStats, ResourceKind, check_stream};
use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::result::{check, driver, drv};
use crate::stream::{Stream, StreamKey};

/// A stream-ordered caching pool written in plain Rust over `cuMemAlloc` / `cuMemFree`, with the
/// semantics of `cuMemAllocAsync` / `cuMemFreeAsync`. It is what cudrv uses where the driver has
/// no memory pools (Windows TCC), and anyone may choose it.
///
/// * Free lists are kept per stream; a free files the block on the freeing stream's list and
///   makes no driver call at all.
/// * An allocation first reuses a block freed on its own stream: pure Rust, no driver call, no
///   synchronisation.
/// * Failing that, it takes blocks freed on another stream. One event, recorded lazily on that
///   stream when first needed, covers every block freed there before it; the allocating stream
///   waits on it on the GPU (`cuStreamWaitEvent`). The host never waits.
/// * Only then does it grow with `cuMemAlloc`, in chunks (2 MiB for requests up to 1 MiB, 16 MiB
///   up to 8 MiB, the request rounded to 2 MiB above), split and merged so that reserved memory
///   stays close to live memory.
/// * On out-of-memory it gives cached chunks back (waiting on their events) and retries once;
///   then it returns [`Error::OutOfMemory`] with what was asked, reserved and in use.
///
/// The pool keeps a reference to each stream it has cached blocks for. When the last user's
/// `Stream` is dropped, the pool records one last event on it (so other streams can still reuse
/// those blocks after a GPU-side wait) and lets it go; the stream is then destroyed.
///
/// ```no_run
/// use cudrv::{Device, Stream, memory::{MemoryResource, StreamOrderedPool}};
/// let device = Device::get(0)?;
/// let pool = StreamOrderedPool::new(&device)?;
/// let stream = Stream::new(&device)?;
/// let p = pool.allocate(1 << 20, &stream)?;
/// // SAFETY: `p` came from this pool with this size and nothing uses it.
/// unsafe { pool.deallocate(p, 1 << 20, &stream)? };
/// let q = pool.allocate(1 << 20, &stream)?; // the same block, with no driver call
/// assert_eq!(p, q);
/// # unsafe { pool.deallocate(q, 1 << 20, &stream)? };
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Debug)]
pub struct StreamOrderedPool {
    ctx: Arc<Context>,
    core: Arc<Mutex<PoolCore<CudaBackend>>>,
}

type SharedCore = Mutex<PoolCore<CudaBackend>>;

/// Every live pool, so that a retired stream can be forgotten by each.
fn pools() -> &'static Mutex<Vec<Weak<SharedCore>>> {
    static POOLS: OnceLock<Mutex<Vec<Weak<SharedCore>>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

/// Called when the last user of a stream lets go of it: each pool that knows the stream records a
/// last event on it and drops its reference.
pub(crate) fn stream_retired(key: &StreamKey) {
    let live: Vec<Arc<SharedCore>> = {
        let mut list = pools().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        list.retain(|w| w.strong_count() > 0);
        list.iter().filter_map(Weak::upgrade).collect()
    };
    for core in live {
        let mut core = core.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Ok(ctx) = key.device().primary_context() else { continue };
        let Ok(_b) = ctx.bind() else { continue };
        if let Err(e) = core.forget_stream(&mut CudaBackend, key) {
            report_drop_error(Some(&ctx), e);
        }
    }
}

/// The driver calls the core asks for. The device's context is current while the core runs
/// (`StreamOrderedPool::lock` binds it first).
#[derive(Debug)]
struct CudaBackend;

/// An event owned by the pool (one per stream, reused).
#[derive(Debug)]
struct PoolEvent(CUevent);

// SAFETY: CUevent handles may be used from any thread.
unsafe impl Send for PoolEvent {}

impl Backend for CudaBackend {
    type Stream = StreamKey;
    type Event = PoolEvent;
    type Error = Error;

    fn alloc_chunk(&mut self, bytes: usize) -> Result<u64> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; the context is current.
        unsafe { drv!(cuMemAlloc_v2(&mut ptr, bytes)) }?;
        Ok(ptr)
    }

    fn free_chunk(&mut self, ptr: u64, _bytes: usize) -> Result<()> {
        // SAFETY: the core frees a chunk once, after the host saw every use of it complete.
        unsafe { drv!(cuMemFree_v2(ptr)) }
    }

    fn is_out_of_memory(&self, err: &Error) -> bool {
        err.code() == Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }

    fn create_event(&mut self) -> Result<PoolEvent> {
        let mut ev = std::ptr::null_mut();
        let flags = cudrv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        // SAFETY: valid out-pointer; the context is current.
        unsafe { drv!(cuEventCreate(&mut ev, flags)) }?;
        Ok(PoolEvent(ev))
    }

    fn destroy_event(&mut self, event: PoolEvent) {
        let Ok(d) = driver() else { return };
        // SAFETY: the core destroys each event it created once.
        if let Err(e) = check("cuEventDestroy", unsafe { d.cuEventDestroy_v2(event.0) }) {
            report_drop_error(None, e);
        }
    }

    fn record(&mut self, event: &PoolEvent, stream: &StreamKey) -> Result<()> {
        // SAFETY: valid event and stream (the core holds a clone of the stream).
        unsafe { drv!(cuEventRecord(event.0, stream.as_raw())) }
    }

    fn wait(&mut self, waiter: &StreamKey, event: &PoolEvent) -> Result<()> {
        // SAFETY: valid stream and event.
        unsafe { drv!(cuStreamWaitEvent(waiter.as_raw(), event.0, 0)) }
    }

    fn synchronize(&mut self, event: &PoolEvent) -> Result<()> {
        // SAFETY: valid event.
        unsafe { drv!(cuEventSynchronize(event.0)) }
    }

    fn query(&mut self, event: &PoolEvent) -> Result<bool> {
        // SAFETY: valid event.
        match unsafe { driver()?.cuEventQuery(event.0) } {
            Ok(CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            other => check("cuEventQuery", other).map(|()| true),
        }
    }
}

impl StreamOrderedPool {
    /// A pool on `device` with the default configuration.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn new(device: &Device) -> Result<StreamOrderedPool> {
        Self::with_config(device, PoolConfig::default())
    }

    /// A pool on `device` with `config` (chunk sizes, release threshold).
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn with_config(device: &Device, config: PoolConfig) -> Result<StreamOrderedPool> {
        let core = Arc::new(Mutex::new(PoolCore::new(config)));
        pools().lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(Arc::downgrade(&core));
        Ok(StreamOrderedPool { ctx: device.primary_context()?, core })
    }

    /// Whether `ptr` is a live allocation of this pool.
    pub(crate) fn owns(&self, ptr: DevicePtr) -> bool {
        self.lock().is_allocated(ptr)
    }

    fn lock(&self) -> MutexGuard<'_, PoolCore<CudaBackend>> {
        // A panic while the core is locked cannot leave it half-updated in a way that matters
        // more than losing the pool: keep going with what is there.
        self.core.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The pool's counters: reserved and in-use bytes with their peaks, driver allocations,
    /// cache hits, cross-stream reuses, event records and waits.
    pub fn pool_stats(&self) -> PoolStats {
        self.lock().stats()
    }

    /// Gives whole free chunks back to the driver until at most `keep_bytes` are reserved. Waits
    /// on the host for the frees in those chunks to complete.
    ///
    /// # Errors
    /// The driver's error.
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        let _b = self.ctx.bind()?;
        self.lock().trim_to(&mut CudaBackend, keep_bytes)
    }

    /// Sets the release threshold: when growing would reserve more than this, chunks whose frees
    /// have completed (checked without waiting) are given back first.
    pub fn set_release_threshold(&self, bytes: usize) {
        self.lock().set_release_threshold(bytes);
    }

    fn map_error(&self, e: PoolError<Error>) -> Error {
        match e {
            PoolError::OutOfMemory { requested, reserved, in_use } => Error::OutOfMemory {
                requested,
                device: self.device().ordinal_i32(),
                resource: "StreamOrderedPool",
                reserved,
                in_use,
            },
            PoolError::TooLarge { requested } => {
                Error::InvalidArgument(format!("an allocation of {requested} bytes is too large"))
            }
            PoolError::InvalidFree { ptr } => Error::InvalidArgument(format!(
                "{ptr:#x} is not a live allocation of this StreamOrderedPool with that size"
            )),
            PoolError::Backend(e) => e,
            #[allow(unreachable_patterns)]
            _ => Error::InvalidArgument("the pool refused the request".into()),
        }
    }
}

// SAFETY: PoolCore hands out blocks of its chunks (cuMemAlloc, 512-byte granules) only when they
// are free and ordered after their last free: same stream, host-observed completion, or a GPU
// wait on an event recorded after the free (its property tests check exactly this).
unsafe impl MemoryResource for StreamOrderedPool {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream("StreamOrderedPool::allocate", self.device(), stream)?;
        let _b = self.ctx.bind()?;
        self.lock().allocate(&mut CudaBackend, bytes, stream.key()).map_err(|e| self.map_error(e))
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream("StreamOrderedPool::deallocate", self.device(), stream)?;
        self.lock().deallocate(ptr, bytes, stream.key()).map_err(|e| self.map_error(e))
    }

    fn device(&self) -> Device {
        self.ctx.device()
    }

    fn kind(&self) -> ResourceKind {
        ResourceKind::StreamOrderedPool
    }

    fn trim(&self, keep_bytes: usize) -> Result<()> {
        self.trim_to(keep_bytes)
    }

    fn reset_peaks(&self) -> Result<()> {
        self.lock().reset_peaks();
        Ok(())
    }

    fn stats(&self) -> Option<MemoryStats> {
        let s = self.pool_stats();
        Some(MemoryStats {
            reserved: s.reserved,
            peak_reserved: s.peak_reserved,
            in_use: s.in_use,
            peak_in_use: s.peak_in_use,
            driver_allocations: s.driver_allocs,
        })
    }
}

impl Drop for StreamOrderedPool {
    fn drop(&mut self) {
        let (core, ctx) = (self.core.clone(), self.ctx.clone());
        let release = move || release_pool(&core, &ctx);
        if crate::host_fn::in_host_fn() { crate::host_fn::defer(release) } else { release() }
    }
}

/// Gives everything a dropped pool holds back to the driver.
fn release_pool(core: &SharedCore, ctx: &Context) {
    {
        let Ok(_b) = ctx.bind() else { return };
        let mut core = core.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match core.release_all(&mut CudaBackend) {
            Ok(leaked) if leaked.allocations > 0 => report_drop_error(
                Some(ctx),
                Error::InvalidArgument(format!(
                    "StreamOrderedPool dropped with {} live allocations ({} bytes); their {} chunks are leaked",
                    leaked.allocations, leaked.bytes, leaked.chunks
                )),
            ),
            Ok(_) => {}
            Err(e) => report_drop_error(Some(ctx), e),
        }
    }
}

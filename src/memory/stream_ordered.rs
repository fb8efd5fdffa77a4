//! `StreamOrderedPool`: cudrv's stream-ordered caching pool over `cuMemAlloc`, for devices
//! without memory pools. The decisions are made by the plain-Rust bookkeeping in [`super::pool`];
//! this file keeps its state (the arena behind a lock, each stream's cache on the stream) and
//! performs the driver calls it asks for.

use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

use cudrv_sys::{CUevent, CUresult};

use super::pool::arena::Arena;
use super::pool::backend::{Backend, RANGE_PER_BYTE, Segments};
use super::pool::cache::{Cache, Found};
use super::pool::config::PoolConfig;
use super::pool::error::PoolError;
use super::pool::pacing::{Pacing, PacingStats};
use super::pool::stats::PoolStats;
use super::pool::{self, Host};
use super::{DevicePtr, MemoryResource, MemoryStats, ResourceKind, check_stream};
use crate::capture::RelaxedCaptureMode;
use crate::context::{Context, HoldHook, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::error::{check, check_done};
use crate::host_fn::{self, SendHandle};
use crate::result::{driver, drv};
use crate::session::{CaptureSession, GraphOwned};
use crate::stream::{Attachment, Stream, StreamKey, StreamPin, attachment_owner_id};

/// A stream-ordered caching pool written in plain Rust over `cuMemAlloc` / `cuMemFree`, with the
/// semantics of `cuMemAllocAsync` / `cuMemFreeAsync`. It is what cudrv uses where the driver has
/// no memory pools (Windows TCC), and anyone may choose it.
///
/// * **Per-stream caches.** A block freed on a stream is cached on that stream; the next request
///   of the same rounded size there takes it with no shared lock, no driver call and no
///   synchronisation. Threads that allocate on their own streams never contend.
/// * **A shared arena** (one lock) serves the rest: the best fit across chunks, from blocks freed
///   on the same stream, then from other streams' after one lazily recorded event and a GPU-side
///   wait (`cuStreamWaitEvent`; the host never waits); then growth with `cuMemAlloc`: small
///   requests share 2 MiB chunks, medium ones 32 MiB chunks, and a large request gets a chunk of
///   exactly its size (rounded to 2 MiB).
/// * **Memory stays close to live memory.** Before growing, the streams' caches go back to the
///   arena to merge; past 20% above the most memory live at once, whole free chunks whose frees
///   the GPU has completed are given back first ([`PoolConfig::headroom_percent`]).
/// * **Out of memory**: everything free goes back to the driver (waiting for the frees with no
///   lock held) and the request is retried at its exact size; then [`Error::OutOfMemory`] says
///   what was asked, reserved and in use.
/// * No lock is held across a blocking driver call (`cuEventSynchronize`, `cuMemFree`).
///
/// While [`DeviceBuffer`](crate::memory::DeviceBuffer)s of the device's pool live on a stream,
/// the pool keeps the stream alive (a pin that is no user of it), so that such a buffer refers to
/// its stream without a reference count of its own: creating and dropping it touches no memory
/// that other threads share. When a stream's last user has dropped it and no such buffer is left,
/// the pool records one last event on it (so other streams can still reuse its blocks after a
/// GPU-side wait) and lets it go; allocations of [`MemoryResource::allocate`] still live on it
/// then may be freed on any stream.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, memory::{MemoryResource, StreamOrderedPool}};
/// let device = Device::get(0)?;
/// let pool = StreamOrderedPool::new(&device)?;
/// let stream = Stream::new(&device)?;
/// let p = pool.allocate(1 << 20, &stream)?;
/// // SAFETY: `p` came from this pool with this size and nothing uses it.
/// unsafe { pool.deallocate(p, 1 << 20, &stream)? };
/// let q = pool.allocate(1 << 20, &stream)?; // the same block, from the stream's cache
/// assert_eq!(p, q);
/// # unsafe { pool.deallocate(q, 1 << 20, &stream)? };
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Debug)]
pub struct StreamOrderedPool {
    shared: Arc<Shared>,
}

/// What the pool shares with the caches it attaches to streams.
struct Shared {
    /// This pool's number, which finds its cache among a stream's attachments.
    id: u64,
    me: Weak<Shared>,
    backend: CudaBackend,
    arena: Mutex<Arena<CudaBackend>>,
    /// Notified when releases made with no lock held are settled ([`Host::released`]).
    settled: Condvar,
    /// The `StreamOrderedPool` was dropped; graphs may still hold blocks of it (and this).
    dropped: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamOrderedPool").field("id", &self.id).field("device", &self.backend.ctx.device()).finish()
    }
}

/// A pool's cache of one stream, kept on the stream, alone on its cache lines (threads allocating
/// on different streams write their caches all the time).
#[repr(align(128))]
struct StreamCache {
    cache: Cache,
    pool: Weak<Shared>,
    /// Held while `cache` holds kept allocations ([`Cache::kept`]), so that the buffers of those
    /// allocations may refer to the stream without a count of their own (see [`StreamPin`]);
    /// kept between them while the stream has users, so that a stream's usual allocate-and-free
    /// costs no shared reference count.
    pin: Option<StreamPin>,
}

impl StreamCache {
    /// Keeps the pin in step with the cache after an operation of the pool changed it: pins the
    /// stream on its first kept allocation (`here` is the stream when the operation is on it; only
    /// such an operation allocates), and gives the pin up once no kept allocation is live and the
    /// stream has no users.
    #[inline]
    fn settle_pin(&mut self, here: Option<&Stream>) -> Option<StreamPin> {
        let kept = self.cache.kept > 0;
        if kept == self.pin.is_some() {
            return None;
        }
        if kept {
            debug_assert!(here.is_some(), "an allocation made on another stream than the operation's");
            if let Some(stream) = here {
                self.pin_for_kept(stream);
            }
            None
        } else if self.pin.as_ref().is_some_and(StreamPin::users_gone) {
            self.pin.take()
        } else {
            None
        }
    }

    /// The cache holds a kept allocation made on `stream` (the operation's own): pins the stream
    /// if the cache has no pin. Never lets a pin go (see [`StreamCache::settle_pin`]).
    #[inline]
    fn pin_for_kept(&mut self, stream: &Stream) {
        debug_assert!(self.cache.kept > 0, "pinning for a cache without kept allocations");
        if self.pin.is_none() {
            self.pin = Some(StreamPin::new(stream));
        }
    }
}

impl Attachment for StreamCache {
    fn retire(self: Box<Self>, stream: &StreamKey) {
        let Some(shared) = self.pool.upgrade() else { return };
        let mut cache = self.cache;
        // At once, even while a capture defers the rest: other streams' frees look there.
        pool::orphan_live(&*shared, &mut cache);
        retire_when_not_capturing(shared, stream.clone(), cache);
    }

    fn users_gone(&mut self) -> Option<StreamPin> {
        if self.cache.kept == 0 { self.pin.take() } else { None }
    }
}

/// Forgets `stream` in the pool, which records one last event on it: not while the stream
/// captures a graph (the record would be captured, and order nothing), but once the capture has
/// ended, on cudrv's deferred-work thread ([`host_fn::attempt_until_done`]). The key keeps the
/// stream valid meanwhile.
fn retire_when_not_capturing(shared: Arc<Shared>, stream: StreamKey, cache: Cache) {
    host_fn::attempt_until_done((shared, stream, cache), |(shared, stream, cache)| {
        if shared.backend.is_capturing(&stream) {
            return Some((shared, stream, cache));
        }
        if let Err(e) = pool::retire(&*shared, &stream, cache) {
            report_drop_error(Some(&shared.backend.ctx), e);
        }
        if shared.dropped.load(std::sync::atomic::Ordering::Acquire) {
            // The pool went while a capture deferred this (its teardown could not see the blocks
            // the cache held): give back what they were in.
            release_pool(&shared);
        }
        None
    });
}

impl Host for Shared {
    type B = CudaBackend;

    #[inline]
    fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    #[inline]
    fn arena<R>(&self, f: impl FnOnce(&mut Arena<CudaBackend>) -> R) -> R {
        // Errors met with the arena locked (an event destroyed, a mapping left behind) reach the
        // drop-error hook once it is unlocked: the hook may ask the pool for its figures.
        let _hook = HoldHook::enter();
        // A panic while the arena is locked cannot leave it half-updated in a way that matters
        // more than losing the pool: keep going with what is there.
        let mut arena = self.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut arena)
    }

    fn cache<R>(&self, stream: &StreamKey, f: impl FnOnce(&mut Cache) -> R) -> R {
        stream.with_attachment(self.id, || self.new_cache(stream), |sc: &mut StreamCache| f(&mut sc.cache))
    }

    fn existing_cache<R>(&self, stream: &StreamKey, f: impl FnOnce(&mut Cache) -> R) -> Option<R> {
        stream.with_existing_attachment(self.id, |sc: &mut StreamCache| f(&mut sc.cache))
    }

    fn wait_for_release(&self) {
        let arena = self.arena.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if arena.releasing_bytes() > 0 {
            // Bounded: the waiter looks again at least every millisecond.
            drop(self.settled.wait_timeout(arena, RELEASE_WAIT).unwrap_or_else(std::sync::PoisonError::into_inner));
        }
    }

    fn released(&self) {
        self.settled.notify_all();
    }
}

/// The longest a growth waits at once for another thread's release ([`Host::wait_for_release`])
/// before it looks again.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

impl Shared {
    fn new_cache(&self, stream: &StreamKey) -> StreamCache {
        StreamCache { cache: self.arena(|a| a.new_cache(stream)), pool: self.me.clone(), pin: None }
    }
}

/// One allocation, free or unkeep of a kept allocation on `stream`: the pool's [`Host`] for the
/// operations that change which allocations are kept. Each cache it touches keeps its pin in step
/// ([`StreamCache::settle_pin`]); the pins given up are dropped with the `Op`, once the pool is
/// done with every stream (the last pin may take its stream with it).
struct Op<'a> {
    shared: &'a Shared,
    stream: &'a Stream,
    let_go: RefCell<Vec<StreamPin>>,
}

impl<'a> Op<'a> {
    #[inline]
    fn new(shared: &'a Shared, stream: &'a Stream) -> Self {
        Op { shared, stream, let_go: RefCell::new(Vec::new()) }
    }

    /// The allocation at `ptr` on the operation's stream is kept no more.
    fn unkeep(&self, ptr: DevicePtr) {
        self.existing_cache(self.stream.key(), |c| c.unkeep(ptr));
    }

    /// The operation's stream, if `key` is it.
    #[inline]
    fn here(&self, key: &StreamKey) -> Option<&'a Stream> {
        Some(self.stream).filter(|s| s.key() == key)
    }

    #[inline]
    fn let_go(&self, pin: Option<StreamPin>) {
        #[cold]
        fn push(list: &RefCell<Vec<StreamPin>>, pin: StreamPin) {
            list.borrow_mut().push(pin);
        }
        if let Some(pin) = pin {
            push(&self.let_go, pin);
        }
    }
}

impl Host for Op<'_> {
    type B = CudaBackend;

    #[inline]
    fn backend(&self) -> &CudaBackend {
        &self.shared.backend
    }

    #[inline]
    fn arena<R>(&self, f: impl FnOnce(&mut Arena<CudaBackend>) -> R) -> R {
        self.shared.arena(f)
    }

    #[inline]
    fn cache<R>(&self, stream: &StreamKey, f: impl FnOnce(&mut Cache) -> R) -> R {
        let here = self.here(stream);
        let (r, pin) = stream.with_attachment(
            self.shared.id,
            || self.shared.new_cache(stream),
            |sc: &mut StreamCache| {
                let r = f(&mut sc.cache);
                (r, sc.settle_pin(here))
            },
        );
        self.let_go(pin);
        r
    }

    #[inline]
    fn existing_cache<R>(&self, stream: &StreamKey, f: impl FnOnce(&mut Cache) -> R) -> Option<R> {
        let here = self.here(stream);
        let (r, pin) = stream.with_existing_attachment(self.shared.id, |sc: &mut StreamCache| {
            let r = f(&mut sc.cache);
            (r, sc.settle_pin(here))
        })?;
        self.let_go(pin);
        Some(r)
    }

    fn wait_for_release(&self) {
        self.shared.wait_for_release();
    }

    fn released(&self) {
        self.shared.released();
    }
}

/// The driver calls the pool asks for. Each makes the device's context current first.
#[derive(Debug)]
struct CudaBackend {
    ctx: Arc<Context>,
    /// How the pool grows in segments, where the device has virtual memory management.
    segments: Option<Segments>,
    /// Who may read and write what segments map: the device, and every device that can access
    /// it peer to peer (as `cuMemAlloc` memory, which peers reach once peer access is enabled).
    access: Vec<cudrv_sys::CUmemAccessDesc>,
    /// Ranges that a failed [`Backend::map`] left mapped (its undo, `cuMemUnmap`, failed too),
    /// as (address, bytes). The pool never handed them out; they are unmapped again before
    /// anything is mapped over them or their address range is given back
    /// ([`CudaBackend::unstick`]).
    stuck: Mutex<Vec<(u64, usize)>>,
    /// Paces chunk allocations after the pool's frees, where the driver makes an allocation that
    /// comes too soon after a free wait for it.
    pacing: Pacing,
}

impl CudaBackend {
    /// Unmaps the ranges left mapped ([`CudaBackend::stuck`]) that overlap the `bytes` from `va`:
    /// those that the driver still refuses to unmap stay, and the first refusal is returned.
    fn unstick(&self, va: u64, bytes: usize) -> Result<()> {
        let end = va.saturating_add(bytes as u64);
        let mut stuck = self.stuck.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if stuck.is_empty() {
            return Ok(());
        }
        let d = driver()?;
        let mut first = Ok(());
        stuck.retain(|&(at, bytes)| {
            if at.saturating_add(bytes as u64) <= va || at >= end {
                return true;
            }
            // SAFETY: a range mapped whole by `map`, which the pool never handed out (the map
            // failed), unmapped whole; the context is current (the caller bound it).
            match check("cuMemUnmap", unsafe { d.cuMemUnmap(at, bytes) }) {
                Ok(()) => false,
                Err(e) => {
                    if first.is_ok() {
                        first = Err(e);
                    }
                    true
                }
            }
        });
        first
    }

    /// What segments need on `device`: its mapping granularity and its memory. `None` where it has
    /// no virtual memory management, or the driver cannot tell.
    fn segments_on(device: &Device) -> Option<Segments> {
        if !device.capabilities().ok()?.virtual_memory_management {
            return None;
        }
        let prop = Self::allocation_prop(device);
        let mut granularity = 0;
        let minimum = cudrv_sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: valid out-pointer and property; no context is needed.
        check("cuMemGetAllocationGranularity", unsafe {
            driver().ok()?.cuMemGetAllocationGranularity(&mut granularity, &prop, minimum)
        })
        .ok()?;
        let total = device.total_memory().ok()?;
        let reserve = total.checked_mul(RANGE_PER_BYTE)?.checked_next_multiple_of(granularity.max(1))?;
        Some(Segments { granularity, reserve })
    }

    /// Pinned device memory on `device`, with no handle to share it.
    fn allocation_prop(device: &Device) -> cudrv_sys::CUmemAllocationProp {
        cudrv_sys::CUmemAllocationProp {
            type_: cudrv_sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            location: Self::location(device),
            ..Default::default()
        }
    }

    /// Read and write access for `device` and every device that can access it peer to peer.
    fn access_on(device: &Device) -> Vec<cudrv_sys::CUmemAccessDesc> {
        let desc = |d: &Device| cudrv_sys::CUmemAccessDesc {
            location: Self::location(d),
            flags: cudrv_sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut access = vec![desc(device)];
        let peers = Device::all().unwrap_or_default();
        access.extend(
            peers
                .iter()
                .filter(|p| p.ordinal() != device.ordinal() && p.can_access_peer(device).unwrap_or(false))
                .map(desc),
        );
        access
    }

    fn location(device: &Device) -> cudrv_sys::CUmemLocation {
        cudrv_sys::CUmemLocation {
            type_: cudrv_sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.ordinal_i32(),
        }
    }
}

/// An event owned by the pool (one per stream, reused), destroyed with its last clone.
#[derive(Debug)]
struct PoolEvent {
    raw: CUevent,
    ctx: Arc<Context>,
}

// SAFETY: CUevent handles may be used from any thread.
unsafe impl Send for PoolEvent {}
// SAFETY: as above; the pool only records, waits on and queries it, which the driver allows from
// any thread.
unsafe impl Sync for PoolEvent {}

impl Drop for PoolEvent {
    fn drop(&mut self) {
        let (raw, ctx) = (SendHandle(self.raw), self.ctx.clone());
        let destroy = move || {
            let Ok(d) = driver() else { return };
            // SAFETY: the pool destroys each event it created once, when no clone is left.
            if let Err(e) = check("cuEventDestroy", unsafe { d.cuEventDestroy_v2(raw.get()) }) {
                report_drop_error(Some(&ctx), e);
            }
        };
        crate::host_fn::now_or_deferred(destroy)
    }
}

/// What the pool's record or wait on a stream that began a capture after the pool last asked
/// refuses (a race with another thread: the pool's call fails instead of being captured).
const CAPTURED_MEANWHILE: &str = "the pool's ordering of a stream that began a capture meanwhile";

impl Backend for CudaBackend {
    type Stream = StreamKey;
    type Event = Arc<PoolEvent>;
    type Error = Error;

    fn alloc_chunk(&self, bytes: usize) -> Result<u64> {
        let _b = self.ctx.bind()?;
        // Never part of a capture: allowed whatever captures are active.
        let _relaxed = RelaxedCaptureMode::enter();
        let mut ptr = 0;
        // Where the driver makes an allocation soon after a free wait for it, a short pause first.
        self.pacing.alloc(|| {
            // SAFETY: valid out-pointer; the context is current.
            unsafe { drv!(cuMemAlloc_v2(&mut ptr, bytes)) }
        })?;
        Ok(ptr)
    }

    fn free_chunk(&self, ptr: u64, bytes: usize) -> Result<()> {
        let _b = self.ctx.bind()?;
        // Never part of a capture: allowed whatever captures are active.
        let _relaxed = RelaxedCaptureMode::enter();
        // SAFETY: the pool frees a chunk once, after the host saw every use of it complete.
        unsafe { drv!(cuMemFree_v2(ptr)) }?;
        self.pacing.freed(bytes, Instant::now());
        Ok(())
    }

    fn pacing(&self) -> PacingStats {
        self.pacing.stats()
    }

    fn segments(&self) -> Option<Segments> {
        self.segments
    }

    fn reserve(&self, bytes: usize) -> Result<u64> {
        let _b = self.ctx.bind()?;
        let _relaxed = RelaxedCaptureMode::enter();
        let alignment = self.segments.map_or(0, |s| s.granularity);
        let mut va = 0;
        // SAFETY: valid out-pointer; a size that is a multiple of the granularity; no fixed
        // address.
        unsafe { drv!(cuMemAddressReserve(&mut va, bytes, alignment, 0, 0)) }?;
        Ok(va)
    }

    fn free_reserve(&self, va: u64, bytes: usize) -> Result<()> {
        let _b = self.ctx.bind()?;
        let _relaxed = RelaxedCaptureMode::enter();
        self.unstick(va, bytes)?;
        // SAFETY: a range from `reserve`, given back once, with nothing mapped in it (the arena's
        // mappings are unmapped, and what a failed map left behind was just unmapped).
        unsafe { drv!(cuMemAddressFree(va, bytes)) }
    }

    fn map(&self, va: u64, bytes: usize) -> Result<u64> {
        let _b = self.ctx.bind()?;
        // Never part of a capture: allowed whatever captures are active.
        let _relaxed = RelaxedCaptureMode::enter();
        // What a failed map left behind there goes first.
        self.unstick(va, bytes)?;
        let device = self.ctx.device();
        let prop = Self::allocation_prop(&device);
        let mut handle = 0;
        // SAFETY: valid out-pointer and property; `bytes` is a multiple of the granularity.
        unsafe { drv!(cuMemCreate(&mut handle, bytes, &prop, 0)) }?;
        let undo_create = |e: Error| {
            if let Ok(d) = driver() {
                // SAFETY: the handle just created, mapped nowhere, released once.
                let _ = unsafe { d.cuMemRelease(handle) };
            }
            e
        };
        // SAFETY: `[va, va + bytes)` lies in a range from `reserve`, and nothing is mapped there
        // (the pool maps above what it mapped before, and unmaps before it maps there again;
        // what a failed map left there was unmapped above).
        unsafe { drv!(cuMemMap(va, bytes, 0, handle, 0)) }.map_err(undo_create)?;
        // SAFETY: the range just mapped; valid descriptors, as many as passed.
        let mut granted = unsafe { drv!(cuMemSetAccess(va, bytes, self.access.as_ptr(), self.access.len())) };
        if granted.is_err() && self.access.len() > 1 {
            // A driver that refuses a peer still lets the device itself at its memory.
            // SAFETY: as above, with the first descriptor (the device's own) only.
            granted = unsafe { drv!(cuMemSetAccess(va, bytes, self.access.as_ptr(), 1)) };
        }
        if let Err(e) = granted {
            // SAFETY: the range just mapped, which nothing has used.
            if let Err(unmapped) = unsafe { drv!(cuMemUnmap(va, bytes)) } {
                // The range stays mapped (its memory goes once it is unmapped, or with the
                // context): reported, and unmapped again before the pool maps over it.
                report_drop_error(Some(&self.ctx), unmapped);
                self.stuck.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((va, bytes));
            }
            return Err(undo_create(e));
        }
        Ok(handle)
    }

    fn unmap(&self, va: u64, bytes: usize, handle: u64) -> Result<()> {
        let _b = self.ctx.bind()?;
        let _relaxed = RelaxedCaptureMode::enter();
        // SAFETY: a range the pool mapped, unmapped once, after the host saw every use of it
        // complete.
        unsafe { drv!(cuMemUnmap(va, bytes)) }?;
        // Unmapped, the range is gone whatever happens next: a failed release only leaks the
        // memory, which is reported, not the pool's business any more.
        // SAFETY: the handle of that range, released once.
        if let Err(e) = unsafe { drv!(cuMemRelease(handle)) } {
            report_drop_error(Some(&self.ctx), e);
        }
        Ok(())
    }

    fn free_memory(&self) -> Option<usize> {
        let _b = self.ctx.bind().ok()?;
        let _relaxed = RelaxedCaptureMode::enter();
        let (mut free, mut total) = (0, 0);
        let d = driver().ok()?;
        // SAFETY: valid out-pointers; the context is current.
        check("cuMemGetInfo", unsafe { d.cuMemGetInfo_v2(&mut free, &mut total) }).ok()?;
        Some(free)
    }

    fn is_out_of_memory(&self, err: &Error) -> bool {
        err.code() == Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }

    fn is_unsupported(&self, err: &Error) -> bool {
        matches!(err.code(), Some(CUresult::CUDA_ERROR_NOT_SUPPORTED | CUresult::CUDA_ERROR_NOT_PERMITTED))
    }

    fn create_event(&self) -> Result<Arc<PoolEvent>> {
        let _b = self.ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        let flags = cudrv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        // SAFETY: valid out-pointer; the context is current.
        unsafe { drv!(cuEventCreate(&mut raw, flags)) }?;
        Ok(Arc::new(PoolEvent { raw, ctx: self.ctx.clone() }))
    }

    fn record(&self, event: &Arc<PoolEvent>, stream: &StreamKey) -> Result<()> {
        // The pool asked `is_capturing` before; another thread may have begun a capture on the
        // stream since. Under the stream's gate the answer holds until the record is queued:
        // captured, the record would order nothing (and make waiters join the capture).
        let _gate = stream.refuse_in_capture(CAPTURED_MEANWHILE)?;
        let _b = self.ctx.bind()?;
        // SAFETY: valid event and stream (the pool holds a clone of the stream).
        unsafe { drv!(cuEventRecord(event.raw, stream.as_raw())) }
    }

    fn wait(&self, waiter: &StreamKey, event: &Arc<PoolEvent>) -> Result<()> {
        // As in `record`: a captured wait would not order the waiter's later work.
        let _gate = waiter.refuse_in_capture(CAPTURED_MEANWHILE)?;
        let _b = self.ctx.bind()?;
        // SAFETY: valid stream and event.
        unsafe { drv!(cuStreamWaitEvent(waiter.as_raw(), event.raw, 0)) }
    }

    fn synchronize(&self, event: &Arc<PoolEvent>) -> Result<()> {
        let _b = self.ctx.bind()?;
        // Never part of a capture: allowed whatever captures are active.
        let _relaxed = RelaxedCaptureMode::enter();
        // SAFETY: valid event.
        unsafe { drv!(cuEventSynchronize(event.raw)) }
    }

    fn report(&self, error: Error) {
        report_drop_error(Some(&self.ctx), error);
    }

    fn is_capturing(&self, stream: &StreamKey) -> bool {
        // The captures cudrv tracks. Raw-driver captures of a cudrv stream are the caller's to
        // keep apart from the pool's work (they go through `unsafe` code). Asked with the arena
        // locked: no reference to the session is taken (dropping the last would lock it again).
        // The legacy stream, while a blocking stream of its context captures, counts too: work
        // queued there would join that capture.
        stream.is_capturing() || stream.legacy_held_by_capture()
    }

    fn query(&self, event: &Arc<PoolEvent>) -> Result<bool> {
        let _b = self.ctx.bind()?;
        let _relaxed = RelaxedCaptureMode::enter();
        // SAFETY: valid event.
        check_done("cuEventQuery", unsafe { driver()?.cuEventQuery(event.raw) })
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

    /// A pool on `device` with `config` (segments or chunks, headroom, release threshold).
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn with_config(device: &Device, config: PoolConfig) -> Result<StreamOrderedPool> {
        let ctx = device.primary_context()?;
        let segments = if config.expandable { CudaBackend::segments_on(device) } else { None };
        let access = if segments.is_some() { CudaBackend::access_on(device) } else { Vec::new() };
        let backend = CudaBackend { ctx, segments, access, stuck: Mutex::new(Vec::new()), pacing: Pacing::default() };
        let mut arena = Arena::new(config);
        arena.use_segments(backend.segments());
        let shared = Arc::new_cyclic(|me| Shared {
            id: attachment_owner_id(),
            me: me.clone(),
            arena: Mutex::new(arena),
            settled: Condvar::new(),
            backend,
            dropped: std::sync::atomic::AtomicBool::new(false),
        });
        Ok(StreamOrderedPool { shared })
    }

    /// Whether the pool grows in segments of virtual memory ([`PoolConfig::expandable`], where the
    /// device has virtual memory management) rather than in `cuMemAlloc` chunks. (A driver that
    /// refuses every address range at the first growth turns a pool to chunks for good.)
    ///
    /// ```no_run
    /// use cudrv::{Device, memory::{PoolConfig, StreamOrderedPool}};
    /// let device = Device::get(0)?;
    /// let vmm = device.capabilities()?.virtual_memory_management;
    /// assert_eq!(StreamOrderedPool::new(&device)?.grows_in_segments(), vmm);
    /// let chunked = StreamOrderedPool::with_config(&device, PoolConfig { expandable: false, ..PoolConfig::default() })?;
    /// assert!(!chunked.grows_in_segments());
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    pub fn grows_in_segments(&self) -> bool {
        self.shared.arena(|a| a.segments.is_some())
    }

    /// The pool's counters: reserved and in-use bytes with their peaks, driver allocations, cache
    /// hits, cross-stream reuses, event records and waits.
    pub fn pool_stats(&self) -> PoolStats {
        pool::stats(&*self.shared)
    }

    /// Allocates `bytes` on `stream`, as [`MemoryResource::allocate`], for a buffer that refers to
    /// its stream through the pool: `true` comes back with the pointer when the allocation is
    /// held in the stream's cache (not a graph's block), and the pool then keeps the stream alive
    /// until it is freed (or [`StreamOrderedPool::unkeep`]), so that the buffer may hold a view of
    /// the stream ([`StreamPin::view`]) instead of a counted reference.
    ///
    /// # Errors
    /// As [`MemoryResource::allocate`].
    #[inline]
    pub(crate) fn allocate_keeping(&self, bytes: usize, stream: &Stream) -> Result<(DevicePtr, bool)> {
        self.allocate_on(bytes, stream, true)
    }

    /// [`StreamOrderedPool::allocate_keeping`] for a caller that checked what it checks: `stream`
    /// is of the pool's device and showed no capture. The pool keeps the stream for the
    /// allocation.
    ///
    /// # Errors
    /// As [`MemoryResource::allocate`].
    #[inline]
    pub(crate) fn allocate_kept(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        // The fast path, a block of the size in the stream's cache: the cache now holds a kept
        // allocation, so it pins the stream if it has no pin, in the same lock. A miss changes
        // nothing here; the slow path settles the pin through its `Op`.
        let key = stream.key();
        let size = Arena::<CudaBackend>::rounded(bytes)
            .ok_or_else(|| self.map_error(PoolError::TooLarge { requested: bytes }))?;
        let (hit, slot) = key.with_attachment(
            self.shared.id,
            || self.shared.new_cache(key),
            |sc: &mut StreamCache| {
                let hit = sc.cache.take(size, bytes, true);
                if hit.is_some() {
                    sc.pin_for_kept(stream);
                }
                (hit, sc.cache.slot)
            },
        );
        match hit {
            Some(ptr) => Ok(ptr),
            None => {
                let op = Op::new(&self.shared, stream);
                pool::allocate_slow(&op, key, slot, size, bytes, true).map_err(|e| self.map_error(e))
            }
        }
    }

    /// An allocation on `stream` held in the stream's cache, not a graph's block, for a caller
    /// that checked that `stream` is of the pool's device and saw no capture on it (without a
    /// gate: a buffer from a pool it was given, see `DeviceBuffer::allocate`). A capture that
    /// another thread begins meanwhile does not take it: the block is valid outside any graph, as
    /// one allocated before the capture. Nothing is kept: no pin changes, so the pool's plain
    /// host serves.
    ///
    /// # Errors
    /// As [`MemoryResource::allocate`].
    #[inline]
    pub(crate) fn allocate_uncaptured(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        pool::allocate(&*self.shared, bytes, stream.key(), false).map_err(|e| self.map_error(e))
    }

    /// An allocation on `stream`: a graph's block while the stream captures, else one held in the
    /// stream's cache, kept (`true` with the pointer) when `keep` asks for it.
    #[inline]
    fn allocate_on(&self, bytes: usize, stream: &Stream, keep: bool) -> Result<(DevicePtr, bool)> {
        check_stream("StreamOrderedPool::allocate", self.device(), stream)?;
        if stream.key().capture_id() != 0
            && let Some(session) = stream.capture()
        {
            return self.allocate_for_graph(bytes, &session).map(|ptr| (ptr, false));
        }
        if keep {
            return self.allocate_kept(bytes, stream).map(|ptr| (ptr, true));
        }
        self.allocate_uncaptured(bytes, stream).map(|ptr| (ptr, false))
    }

    /// Frees a kept allocation ([`StreamOrderedPool::allocate_keeping`]) on the stream it was made
    /// on, and reports an error to the pool's context (a buffer's drop). If the free fails, the
    /// memory leaks (which is sound) but the stream is kept for it no more.
    ///
    /// # Safety
    /// As [`MemoryResource::deallocate`], on the allocation's own stream. `stream` may be a view
    /// that only the pool keeps valid: it may go with the free, and the caller must not use
    /// `stream` after this call.
    #[inline]
    pub(crate) unsafe fn free_kept(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) {
        // The fast path, a live allocation of this stream's cache, settles the pin in the same
        // lock and lets go of it (if it does) after the last use of `stream`.
        let fast = stream.key().with_existing_attachment(self.shared.id, |sc: &mut StreamCache| {
            match sc.cache.free_here(ptr, bytes) {
                Found::Here(_) => Some(sc.settle_pin(Some(stream))),
                Found::WrongSize | Found::Missing => None,
            }
        });
        if let Some(let_go) = fast.flatten() {
            drop(let_go);
            return;
        }
        // Elsewhere (another stream's cache, an orphan, a graph's block) or an error.
        let op = Op::new(&self.shared, stream);
        let freed = pool::deallocate(&op, ptr, bytes, stream.key());
        if freed.is_err() {
            op.unkeep(ptr);
        }
        // The pins given up go here, after the last use of `stream`.
        drop(op);
        if let Err(e) = freed {
            report_drop_error(Some(&self.shared.backend.ctx), self.map_error(e));
        }
    }

    /// The kept allocation at `ptr`, made on `stream`, is kept no more: its buffer holds a counted
    /// reference to the stream from now on (its free may wait, or fail).
    pub(crate) fn unkeep(&self, ptr: DevicePtr, stream: &Stream) {
        Op::new(&self.shared, stream).unkeep(ptr);
    }

    /// Whether `ptr` is a live allocation of this pool (`stream` is where to look first).
    pub(crate) fn owns(&self, ptr: DevicePtr, stream: &Stream) -> bool {
        pool::owns(&*self.shared, ptr, stream.key())
    }

    /// An allocation on a capturing stream: a block reserved for the graph the capture makes,
    /// until that graph is released (see [`crate::graph`] and `pool::graph`).
    #[cold]
    fn allocate_for_graph(&self, bytes: usize, session: &CaptureSession) -> Result<DevicePtr> {
        // Before the block is reserved: from then on another thread may allocate in the capture,
        // end it and instantiate the graph before `own` below runs (review 28d).
        session.res.expect_pool_memory();
        let (ptr, first) =
            pool::graph::allocate_for_graph(&*self.shared, bytes, session.id).map_err(|e| self.map_error(e))?;
        if first {
            session.res.own(Box::new(GraphBlocks { shared: self.shared.clone(), graph: session.id }), true);
        }
        Ok(ptr)
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
            PoolError::InvalidFree { ptr, bytes } => {
                Error::NotFromResource { resource: "StreamOrderedPool", ptr, bytes }
            }
            PoolError::Backend(e) => e,
        }
    }
}

// SAFETY: the pool hands out blocks of its chunks (cuMemAlloc, 512-byte granules) only when they
// are free and ordered after their last free: from the same stream's cache or free list, after
// the host saw the free complete, or after a GPU wait on an event recorded after the free (its
// property tests check exactly this, also with threads).
unsafe impl MemoryResource for StreamOrderedPool {
    #[inline]
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate_on(bytes, stream, false).map(|(ptr, _)| ptr)
    }

    fn supports_capture(&self) -> bool {
        true
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream("StreamOrderedPool::deallocate", self.device(), stream)?;
        // Kept allocations are freed by `free_kept` only (a buffer that frees otherwise unkeeps
        // first), so no pin changes here: the pool's plain host serves.
        pool::deallocate(&*self.shared, ptr, bytes, stream.key()).map_err(|e| self.map_error(e))
    }

    fn device(&self) -> Device {
        self.shared.backend.ctx.device()
    }

    fn kind(&self) -> ResourceKind {
        ResourceKind::StreamOrderedPool
    }

    /// Gives free memory back to the driver until at most `keep_bytes` are reserved. Waits on the
    /// host (with no lock held) for the frees in that memory to complete.
    fn trim(&self, keep_bytes: usize) -> Result<()> {
        pool::trim_to(&*self.shared, keep_bytes)
    }

    /// When growing would reserve more than `bytes`, chunks whose frees have completed (checked
    /// without waiting) are given back first.
    fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        self.shared.arena(|a| a.config.release_threshold = bytes);
        Ok(())
    }

    fn reset_peaks(&self) -> Result<()> {
        pool::reset_peaks(&*self.shared);
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

/// The blocks a graph holds in a pool, given back when the graph is released.
struct GraphBlocks {
    shared: Arc<Shared>,
    graph: u64,
}

impl GraphOwned for GraphBlocks {
    fn release(self: Box<Self>) {
        pool::graph::release_graph(&*self.shared, self.graph);
        if self.shared.dropped.load(std::sync::atomic::Ordering::Acquire) {
            // The pool went first: give back what the graph held.
            release_pool(&self.shared);
        }
    }
}

impl Drop for StreamOrderedPool {
    fn drop(&mut self) {
        self.shared.dropped.store(true, std::sync::atomic::Ordering::Release);
        let shared = self.shared.clone();
        let release = move || release_pool(&shared);
        crate::host_fn::now_or_deferred(release)
    }
}

/// Gives everything a dropped pool holds back to the driver, and takes its caches off the streams.
fn release_pool(shared: &Shared) {
    let keys = shared.arena(|a| a.stream_keys());
    let ctx = &shared.backend.ctx;
    match pool::teardown(shared) {
        Ok(leaked) if leaked.allocations > 0 => report_drop_error(
            Some(ctx),
            Error::LeakedAtDrop {
                resource: "StreamOrderedPool",
                allocations: leaked.allocations,
                bytes: leaked.bytes,
                chunks: leaked.chunks,
            },
        ),
        Ok(_) => {}
        Err(e) => report_drop_error(Some(ctx), e),
    }
    for key in keys {
        drop(key.remove_attachment(shared.id));
    }
}

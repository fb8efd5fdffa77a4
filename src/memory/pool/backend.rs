//! [`Backend`]: the few driver calls the pool's bookkeeping asks for.

use std::hash::Hash;

/// What `cuMemAlloc` needs at least beyond the request, of the free memory `cuMemGetInfo` reports.
/// Measured on an H200 with driver 580 (`nvidia-h200`, 2026-12-01): with the rest of the device
/// taken, requests of 8 MiB to 8 GiB each failed with 1.12 MiB of the reported free memory to
/// spare and succeeded with 3.12 MiB. In a budgeted replay the same driver also refused requests
/// that left 3.1 and 5.1 MiB.
///
/// The pool starts planning with this margin and raises it when the driver refuses a request that
/// left more ([`Arena::learn_spare`](super::arena::Arena::learn_spare)); where a driver keeps less,
/// at most this much of a full device stays unused.
pub(crate) const DRIVER_SPARE: usize = 2 << 20;

/// The most the pool learns to leave free for the driver.
pub(crate) const MAX_DRIVER_SPARE: usize = 64 << 20;

/// What a backend with virtual memory management offers for segments (see
/// [`arena`](super::arena)'s segments): address ranges are reserved in `reserve` bytes, and
/// memory is mapped into them in multiples of `granularity` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segments {
    /// The mapping granularity (`cuMemGetAllocationGranularity`, 2 MiB on current GPUs).
    pub(crate) granularity: usize,
    /// The size of each address range reserved: [`RANGE_PER_BYTE`] times the device's memory,
    /// so that holes (addresses whose memory went elsewhere) leave room for growth.
    pub(crate) reserve: usize,
}

/// The addresses a segment reserves per byte of the device's memory. Addresses are plentiful (47
/// bits on x86-64 Linux: 1,000 times an H200's memory), and a reservation holds no memory.
pub(crate) const RANGE_PER_BYTE: usize = 4;

/// The driver work the pool's bookkeeping asks for. The real implementation calls the CUDA
/// driver; the simulator emulates a device; tests use a mock that checks stream ordering.
///
/// Every method takes `&self`: the pool calls the blocking ones ([`synchronize`](Self::synchronize)
/// and [`free_chunk`](Self::free_chunk), which may wait for the device) only while it holds no lock.
pub(crate) trait Backend {
    /// Identity of a stream. `Clone` must be cheap (an `Arc` in the real backend); `Eq` and `Hash`
    /// go by identity. The pool keeps a clone of every stream it knows until it forgets it.
    type Stream: Clone + Eq + Hash;
    /// A reusable event (`CUevent`, created without timing). Clones share one event, which is
    /// destroyed when the last clone is dropped, so that a clone taken under a lock can be waited
    /// on after the lock is released.
    type Event: Clone;
    /// The backend's error.
    type Error;

    /// Allocates a chunk of `bytes` device bytes (`cuMemAlloc`), aligned to at least 256 bytes.
    fn alloc_chunk(&self, bytes: usize) -> Result<u64, Self::Error>;
    /// Frees a chunk from [`alloc_chunk`](Self::alloc_chunk) (`cuMemFree`, which may wait for the
    /// device). Called only once the host has seen every use of the chunk complete, and never
    /// with a lock held.
    fn free_chunk(&self, ptr: u64, bytes: usize) -> Result<(), Self::Error>;
    /// Whether the backend can map memory into reserved address ranges, and how; `None` where the
    /// device has no virtual memory management. Asked once, when the pool is made.
    fn segments(&self) -> Option<Segments>;
    /// Reserves `bytes` of addresses (`cuMemAddressReserve`), aligned to the granularity. They
    /// hold no memory until [`map`](Self::map) puts some there.
    fn reserve(&self, bytes: usize) -> Result<u64, Self::Error>;
    /// Gives back a range from [`reserve`](Self::reserve) with nothing mapped in it
    /// (`cuMemAddressFree`).
    fn free_reserve(&self, va: u64, bytes: usize) -> Result<(), Self::Error>;
    /// Backs `[va, va + bytes)` of a reserved range with new device memory, readable and writable
    /// by the device (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`); returns the handle of the
    /// memory. On error nothing stays mapped or allocated (unless the driver also refuses to undo
    /// the mapping, which the backend reports as it reports errors in `Drop`).
    fn map(&self, va: u64, bytes: usize) -> Result<u64, Self::Error>;
    /// Unmaps a range from [`map`](Self::map) and frees its memory (`cuMemUnmap`, `cuMemRelease`;
    /// the unmap may wait for the device). As [`free_chunk`](Self::free_chunk): called only once
    /// the host has seen every use of the range complete, and never with a lock held.
    fn unmap(&self, va: u64, bytes: usize, handle: u64) -> Result<(), Self::Error>;
    /// The device's free memory as the driver reports it (`cuMemGetInfo`), if the backend can
    /// tell; a new chunk may take all but what the driver keeps back ([`DRIVER_SPARE`] or more).
    /// Asked only when the pool grows, to grow exactly when memory runs short.
    fn free_memory(&self) -> Option<usize>;
    /// Whether `err` means that the device is out of memory.
    fn is_out_of_memory(&self, err: &Self::Error) -> bool;
    /// Whether `err` says that the driver does not offer what was asked
    /// (`CUDA_ERROR_NOT_SUPPORTED`, `CUDA_ERROR_NOT_PERMITTED`): a refusal that lasts, unlike a
    /// call that failed once.
    fn is_unsupported(&self, err: &Self::Error) -> bool {
        let _ = err;
        false
    }
    /// Creates an event (`cuEventCreate` with `CU_EVENT_DISABLE_TIMING`).
    fn create_event(&self) -> Result<Self::Event, Self::Error>;
    /// Records `event` on `stream` (`cuEventRecord`), replacing its previous recording.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<(), Self::Error>;
    /// Makes `waiter` wait on the GPU for `event` (`cuStreamWaitEvent`); the host does not wait.
    fn wait(&self, waiter: &Self::Stream, event: &Self::Event) -> Result<(), Self::Error>;
    /// Blocks the host until `event` completes (`cuEventSynchronize`). Called only to release
    /// memory (trim, out of memory, teardown), and never with a lock held.
    fn synchronize(&self, event: &Self::Event) -> Result<(), Self::Error>;
    /// Whether `event` has completed (`cuEventQuery`), without blocking.
    fn query(&self, event: &Self::Event) -> Result<bool, Self::Error>;
    /// Reports an error of the pool's housekeeping that decides nothing for the caller (a free,
    /// an unmapping, a wait, or a record or query that polls frees, made to make room; an
    /// address range that could not be given back):
    /// the CUDA backend hands it to the drop-error hook, which runs once no lock is held.
    fn report(&self, error: Self::Error) {
        let _ = error;
    }
    /// What pacing chunk allocations after frees has counted, where the backend paces them (the
    /// CUDA backend: [`Pacing`](super::pacing::Pacing)).
    fn pacing(&self) -> super::pacing::PacingStats {
        super::pacing::PacingStats::default()
    }
    /// Whether `stream` is capturing a graph: then nothing may be recorded, waited or queried on
    /// it (it would be captured, not run), and its frees are not ordered before anything outside
    /// the capture. The real backend answers for the captures cudrv tracks.
    fn is_capturing(&self, stream: &Self::Stream) -> bool {
        let _ = stream;
        false
    }
}

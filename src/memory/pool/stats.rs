//! [`PoolStats`] and [`Leaked`]: what a stream-ordered pool reports.

/// Counters and gauges of a stream-ordered pool. Byte figures are gauges (with their peaks); the
/// others count events since the pool was created.
///
/// The figures are kept per stream where they change on the fast path, and summed when read: a
/// read is exact when no other thread allocates at the same time. `peak_in_use` is the highest
/// sum seen at the pool's slower operations (growth, reuse across streams, reads) and the highest
/// of any single stream, so it is exact for a pool used on one stream and never above the truth.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes held from the driver (the sum of the live chunks, or of the segments' mappings).
    pub reserved: usize,
    /// Highest `reserved` so far.
    pub peak_reserved: usize,
    /// Bytes of live allocations, as requested.
    pub in_use: usize,
    /// Highest `in_use` so far (see above).
    pub peak_in_use: usize,
    /// Bytes of the blocks handed out for live allocations (requests after rounding).
    pub in_use_blocks: usize,
    /// Number of live allocations.
    pub live_allocations: usize,
    /// Bytes of free blocks cached per stream, for reuse on that stream with no synchronisation.
    pub cached: usize,
    /// Number of live chunks (in segments: of segments, each one reserved address range).
    pub chunks: usize,
    /// Number of streams the pool knows (including forgotten streams whose free blocks are still
    /// cached).
    pub streams: usize,
    /// Successful chunk allocations (`cuMemAlloc`), or mappings in segments (`cuMemCreate` and
    /// `cuMemMap`).
    pub driver_allocs: u64,
    /// Bytes of those allocations, summed (a measure of the time spent growing: `cuMemAlloc` and
    /// `cuMemFree` cost a fixed part and a part per byte).
    pub driver_alloc_bytes: u64,
    /// Chunks given back to the driver (`cuMemFree`), or mappings unmapped in segments
    /// (`cuMemUnmap` and `cuMemRelease`).
    pub driver_frees: u64,
    /// Successful allocations.
    pub allocations: u64,
    /// Allocations served from the allocating stream's own cache, with no shared lock and no
    /// driver call.
    pub cache_hits: u64,
    /// Allocations served from blocks freed on another stream (after a GPU-side wait, or once the
    /// host saw the frees complete).
    pub cross_stream_reuses: u64,
    /// Times the per-stream caches were given back to the shared layer (to merge, or to release).
    pub cache_flushes: u64,
    /// Events created.
    pub events_created: u64,
    /// Event records.
    pub event_records: u64,
    /// GPU-side waits (`cuStreamWaitEvent`).
    pub event_waits: u64,
    /// Host waits (`cuEventSynchronize`; only to release memory: trim, out of memory, teardown).
    pub event_syncs: u64,
    /// Event queries (`cuEventQuery`).
    pub event_queries: u64,
    /// Times a chunk allocation failed for lack of memory and the pool released what it caches to
    /// retry.
    pub oom_recoveries: u64,
    /// Reservoirs taken: near the device's capacity, the free chunks given back and what the
    /// device had left taken in one chunk ([`PoolConfig::reservoir`](crate::memory::PoolConfig::reservoir)).
    pub reservoirs: u64,
    /// What the pool leaves of the device's reported free memory for the driver's own use when it
    /// plans a growth near capacity: 2 MiB at first, raised when the driver refuses a request that
    /// left more.
    pub driver_spare: usize,
    /// Chunk allocations (`cuMemAlloc`) that first waited a little after the pool's own frees.
    /// The pool paces them once it saw the driver make an allocation that came soon after a free
    /// wait for it (on an H100 with driver 580: 5-7.5 ms, where a pause of 0.5 ms avoids the wait);
    /// it never paces on a driver that does not, and stops where pauses of its longest estimate do
    /// not avoid the wait. Always 0 in segments.
    pub paced_allocations: u64,
    /// Those allocations' pauses, summed.
    pub pacing_time: std::time::Duration,
    /// Chunk allocations soon after a free that the driver made wait (2 ms or longer).
    pub driver_waits_after_free: u64,
}

/// What tearing a pool down could not free, because allocations are still live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leaked {
    /// Live allocations left.
    pub allocations: usize,
    /// Their bytes, as requested.
    pub bytes: usize,
    /// Chunks (or segments) kept because they hold live allocations.
    pub chunks: usize,
    /// Bytes of those chunks.
    pub chunk_bytes: usize,
}

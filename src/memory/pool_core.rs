//! Bookkeeping of the stream-ordered caching pool (`StreamOrderedPool`).
//!
//! This module is plain Rust: no FFI, no `unsafe`, no dependencies. [`PoolCore`] decides what to do
//! with device memory; a [`Backend`] performs the few driver calls it asks for (`cuMemAlloc`,
//! `cuMemFree`, and events). Miri and property tests run it against a mock backend.
//!
//! # Model
//!
//! Device memory is obtained from the backend in *chunks*. Each chunk is cut into contiguous
//! *blocks*, linked in address order. A block is either handed out (*used*) or *free*. A free block
//! belongs to exactly one *stream state*: the stream on which it was freed (or to which it was moved
//! later), together with a sequence number `seq` that says when, in that stream's order, it became
//! free. Each stream state keeps:
//!
//! * `seq`: a counter bumped by every free filed on it;
//! * `recorded`: the value of `seq` when its one reusable event was last recorded. A free block
//!   with `seq <= recorded` is *covered*: a stream that waits on the event is ordered after the free;
//! * `completed`: the value of `recorded` the last time the host saw the event complete
//!   (`cuEventSynchronize` or a successful `cuEventQuery`). A free block with `seq <= completed` is
//!   *host-safe*: every piece of work issued from now on, on any stream, runs after the free.
//!   Blocks of a freshly allocated chunk have `seq == 0`, which is always host-safe.
//!
//! A free block is therefore always safe to hand out on the stream that owns it; to any other stream
//! only when it is host-safe, or after that stream waited (on the GPU) on the owner's event recorded
//! after the free. When such a wait is paid, *every* covered free block of the owner moves to the
//! waiting stream (as RMM does), so that one wait pays for many blocks.
//!
//! Adjacent free blocks of one chunk are merged when they belong to the same stream, or when both are
//! host-safe; no two adjacent free blocks of the same stream ever stay apart.
//!
//! Requests are rounded to [`GRANULE`] bytes. Requests up to [`PoolConfig::small_limit`] are *small*
//! and are served from small chunks only; larger ones from medium or large chunks only, so small
//! blocks never fragment the big chunks.
//!
//! # Growth
//!
//! Chunks are sized so that driver calls are rare and reserved memory stays close to live memory:
//! small requests share 2 MiB chunks, medium ones 8 MiB chunks, and a large request gets a chunk of
//! at least an eighth of what the pool already holds ([`PoolConfig::large_growth_divisor`]), so that
//! large blocks share chunks and merge when freed. Before growing, whole free chunks whose frees the
//! GPU has already completed are released when the pool would otherwise exceed its release threshold
//! or hold more than 5% above its peak of live memory ([`PoolConfig::recycle_margin_percent`]).
//! Completion is only *queried* there; the host waits for the GPU only when memory must be returned
//! ([`PoolCore::trim_to`], out of memory, [`PoolCore::release_all`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};

/// The alignment and rounding unit of every block, in bytes. Every block offset inside a chunk is a
/// multiple of it, so a block is as aligned as its chunk up to this value (`cuMemAlloc` aligns to
/// at least 256 bytes).
pub const GRANULE: usize = 512;

/// The largest request accepted; anything above is [`PoolError::TooLarge`].
pub const MAX_REQUEST: usize = (isize::MAX as usize) / 2;

const MIB: usize = 1 << 20;

/// Index of "no block" in the block links.
const NIL: u32 = u32::MAX;

/// The driver work that [`PoolCore`] asks for. The real implementation calls the CUDA driver; tests
/// use a mock that checks stream ordering.
pub trait Backend {
    /// Identity of a stream. `Clone` must be cheap (an `Arc` in the real backend); `Eq` and `Hash` go
    /// by identity. The pool keeps a clone of every stream it has seen until
    /// [`PoolCore::forget_stream`] or [`PoolCore::release_all`].
    type Stream: Clone + Eq + Hash;
    /// A reusable event (`CUevent`, created with timing disabled).
    type Event;
    /// The backend's error.
    type Error;

    /// Allocates a chunk of `bytes` device bytes (`cuMemAlloc`), aligned to at least 256 bytes.
    fn alloc_chunk(&mut self, bytes: usize) -> Result<u64, Self::Error>;
    /// Frees a chunk obtained from [`alloc_chunk`](Backend::alloc_chunk) (`cuMemFree`). The pool
    /// calls it only once the host has seen every use of the chunk complete.
    fn free_chunk(&mut self, ptr: u64, bytes: usize) -> Result<(), Self::Error>;
    /// Whether `err` means that the device is out of memory.
    fn is_out_of_memory(&self, err: &Self::Error) -> bool;
    /// Creates an event (`cuEventCreate` with `CU_EVENT_DISABLE_TIMING`).
    fn create_event(&mut self) -> Result<Self::Event, Self::Error>;
    /// Destroys an event (`cuEventDestroy`); errors are the backend's to keep or drop.
    fn destroy_event(&mut self, event: Self::Event);
    /// Records `event` on `stream` (`cuEventRecord`), replacing its previous recording.
    fn record(&mut self, event: &Self::Event, stream: &Self::Stream) -> Result<(), Self::Error>;
    /// Makes `waiter` wait on the GPU for `event` (`cuStreamWaitEvent`); the host does not wait.
    fn wait(&mut self, waiter: &Self::Stream, event: &Self::Event) -> Result<(), Self::Error>;
    /// Blocks the host until `event` completes (`cuEventSynchronize`). The pool calls it only to
    /// release memory (trim, out of memory, teardown), never on an allocation that succeeds from
    /// the cache or from a new chunk.
    fn synchronize(&mut self, event: &Self::Event) -> Result<(), Self::Error>;
    /// Whether `event` has completed (`cuEventQuery`), without blocking.
    fn query(&mut self, event: &Self::Event) -> Result<bool, Self::Error>;
}

/// Errors of [`PoolCore::allocate`] and [`PoolCore::deallocate`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolError<E> {
    /// The device is out of memory, even after the pool returned its cached chunks and retried.
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// Bytes the pool holds from the driver after releasing what it could.
        reserved: usize,
        /// Bytes of live allocations (as requested).
        in_use: usize,
    },
    /// The request is larger than [`MAX_REQUEST`] or its chunk size overflows.
    TooLarge {
        /// Bytes asked for.
        requested: usize,
    },
    /// `deallocate` of a pointer that is not a live allocation of this pool, or with a size other
    /// than the one it was allocated with (a double free is one case). Nothing was changed.
    InvalidFree {
        /// The pointer passed.
        ptr: u64,
    },
    /// A backend call failed. The pool is consistent: nothing was lost or handed out twice.
    Backend(E),
}

impl<E: fmt::Display> fmt::Display for PoolError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutOfMemory { requested, reserved, in_use } => write!(
                f,
                "out of device memory: {requested} bytes requested, {reserved} bytes reserved by \
                 the pool, {in_use} bytes in use"
            ),
            Self::TooLarge { requested } => {
                write!(f, "allocation of {requested} bytes is too large")
            }
            Self::InvalidFree { ptr } => {
                write!(f, "invalid free of {ptr:#x}: not a live allocation of this pool, or wrong size")
            }
            Self::Backend(e) => write!(f, "driver call failed: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for PoolError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Backend(e) => Some(e),
            _ => None,
        }
    }
}

/// Tuning of a [`PoolCore`]. Sizes are rounded up to [`GRANULE`] by [`PoolCore::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// When growing would take the reserved bytes above this, free chunks whose frees the GPU has
    /// already completed are released first (checked with `cuEventQuery`, never waited for).
    /// `usize::MAX` (the default) keeps everything.
    pub release_threshold: usize,
    /// Requests up to this many bytes are small: they share small chunks. Default 1 MiB.
    pub small_limit: usize,
    /// Size of a small chunk. Default 2 MiB.
    pub small_chunk: usize,
    /// Requests above `small_limit` and up to this many bytes share medium chunks. Default 8 MiB.
    pub medium_limit: usize,
    /// Size of a medium chunk. Default 8 MiB.
    pub medium_chunk: usize,
    /// Larger requests get a chunk of their own, rounded up to a multiple of this. Default 2 MiB.
    pub large_granule: usize,
    /// A chunk for a large request is at least the reserved bytes divided by this (rounded to
    /// `large_granule`), so that large blocks share chunks and can merge, and growth is geometric
    /// (fewer driver calls). 0 disables. Default 8 (chunks of at least 12.5% of the pool), chosen
    /// on the PyTorch training traces in `traces/`.
    pub large_growth_divisor: usize,
    /// A free block of a medium or large chunk is split only when what is left over would be at
    /// least this many bytes; otherwise the whole block is handed out. Default 512 bytes (always
    /// split).
    pub min_large_split: usize,
    /// Fragmentation guard: when a new chunk would take the reserved bytes more than this many
    /// percent above the highest live block bytes seen so far, whole free chunks whose frees the
    /// GPU has already completed are released first (checked with `cuEventQuery`; the host never
    /// waits). Without it, chunks that are free but each too small for a new large request pile
    /// up. `None` keeps every chunk (up to `release_threshold`). Default `Some(5)`.
    pub recycle_margin_percent: Option<u32>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            release_threshold: usize::MAX,
            small_limit: MIB,
            small_chunk: 2 * MIB,
            medium_limit: 8 * MIB,
            medium_chunk: 8 * MIB,
            large_granule: 2 * MIB,
            large_growth_divisor: 8,
            min_large_split: GRANULE,
            recycle_margin_percent: Some(5),
        }
    }
}

impl PoolConfig {
    /// Rounds every size to the granule and makes the limits consistent.
    fn normalized(mut self) -> Self {
        let up = |v: usize| round_up(v.max(GRANULE), GRANULE).unwrap_or(MAX_REQUEST);
        self.small_limit = up(self.small_limit);
        self.small_chunk = up(self.small_chunk).max(self.small_limit);
        self.medium_limit = up(self.medium_limit).max(self.small_limit);
        self.medium_chunk = up(self.medium_chunk).max(self.medium_limit);
        self.large_granule = up(self.large_granule);
        self.min_large_split = up(self.min_large_split);
        self
    }
}

/// Counters and gauges of a [`PoolCore`]. Byte figures are gauges (with their peaks); the others
/// count events since the pool was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held from the driver (sum of the live chunks).
    pub reserved: usize,
    /// Highest `reserved` so far.
    pub peak_reserved: usize,
    /// Bytes of live allocations, as requested.
    pub in_use: usize,
    /// Highest `in_use` so far.
    pub peak_in_use: usize,
    /// Bytes of the blocks handed out for live allocations (requests after rounding and unsplit
    /// remainders).
    pub in_use_blocks: usize,
    /// Highest `in_use_blocks` so far.
    pub peak_in_use_blocks: usize,
    /// Number of live allocations.
    pub live_allocations: usize,
    /// Number of live chunks.
    pub chunks: usize,
    /// Number of stream states (streams seen and not yet forgotten, plus forgotten streams whose
    /// free blocks are still cached).
    pub streams: usize,
    /// Successful `alloc_chunk` calls.
    pub driver_allocs: u64,
    /// Successful `free_chunk` calls.
    pub driver_frees: u64,
    /// Successful allocations.
    pub allocations: u64,
    /// Allocations served from the allocating stream's own free list, with no backend call.
    pub cache_hits: u64,
    /// Allocations served from blocks freed on another stream.
    pub cross_stream_reuses: u64,
    /// `create_event` calls that succeeded.
    pub events_created: u64,
    /// `record` calls that succeeded.
    pub event_records: u64,
    /// `wait` calls that succeeded (GPU-side waits).
    pub event_waits: u64,
    /// `synchronize` calls that succeeded (host waits; only when releasing memory).
    pub event_syncs: u64,
    /// `query` calls that succeeded.
    pub event_queries: u64,
    /// Times an `alloc_chunk` failed for lack of memory and the pool released its cache to retry.
    pub oom_recoveries: u64,
}

/// What [`PoolCore::release_all`] could not free, because allocations are still live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Leaked {
    /// Live allocations left.
    pub allocations: usize,
    /// Their bytes, as requested.
    pub bytes: usize,
    /// Chunks kept because they hold live allocations.
    pub chunks: usize,
    /// Bytes of those chunks.
    pub chunk_bytes: usize,
}

/// Whether a block lives in small chunks or in medium/large ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Small = 0,
    Large = 1,
}

/// The state of a block slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Free, filed in the list of stream state `stream`, having become free at `seq` in its order.
    Free { stream: u32, seq: u64 },
    /// Handed out for a request of `requested` bytes.
    Used { requested: usize },
    /// The slot is unused (its block was merged away or its chunk released).
    Vacant,
}

/// A contiguous piece of a chunk.
#[derive(Debug, Clone)]
struct Block {
    ptr: u64,
    size: usize,
    chunk: u32,
    kind: Kind,
    /// Neighbours in the same chunk, in address order (`NIL` at the ends).
    prev: u32,
    next: u32,
    state: State,
}

/// Memory obtained from one `alloc_chunk` call.
#[derive(Debug, Clone)]
struct Chunk {
    ptr: u64,
    size: usize,
    /// The block at the chunk's start; merges always keep the lower block, so it never changes.
    first: u32,
    /// Number of used blocks; a chunk with none may be released.
    live: u32,
}

/// Free blocks of one kind and one stream, best fit first: key `(size, ptr)`, value block index.
type FreeList = BTreeMap<(usize, u64), u32>;

/// What the pool knows about one stream.
struct StreamState<B: Backend> {
    /// The stream; `None` once forgotten (its remaining free blocks are all covered by `event`).
    stream: Option<B::Stream>,
    /// The one reusable event of the stream, created on first need.
    event: Option<B::Event>,
    /// Bumped by every free filed on this stream.
    seq: u64,
    /// `seq` at the last successful record of `event`.
    recorded: u64,
    /// `recorded` at the last time the host saw `event` complete. `completed <= recorded <= seq`.
    completed: u64,
    /// Free lists, indexed by `Kind`.
    free: [FreeList; 2],
}

impl<B: Backend> StreamState<B> {
    fn new(stream: B::Stream) -> Self {
        Self {
            stream: Some(stream),
            event: None,
            seq: 0,
            recorded: 0,
            completed: 0,
            free: [FreeList::new(), FreeList::new()],
        }
    }

    fn is_empty(&self) -> bool {
        self.free.iter().all(BTreeMap::is_empty)
    }
}

/// How to learn that an event completed when releasing memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Completion {
    /// Block the host (`synchronize`).
    Wait,
    /// Ask without blocking (`query`); give up on the chunk if not complete.
    Poll,
}

/// A fast hasher for device pointers and stream identities (the keys are not attacker-controlled).
/// It folds a 128-bit product, so both the low and the high bits of the hash depend on every bit of
/// the key (pointers have their low bits all zero).
#[derive(Debug, Default, Clone, Copy)]
pub struct FoldHasher {
    state: u64,
}

impl FoldHasher {
    #[inline]
    fn mix(&mut self, v: u64) {
        let p = u128::from(self.state ^ v) * 0x9E37_79B9_7F4A_7C15_u128;
        self.state = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl Hasher for FoldHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
    fn write(&mut self, bytes: &[u8]) {
        for piece in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..piece.len()].copy_from_slice(piece);
            self.mix(u64::from_le_bytes(buf));
        }
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.mix(u64::from(v));
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.mix(v);
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.mix(v as u64);
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

fn round_up(v: usize, to: usize) -> Option<usize> {
    Some(v.checked_add(to - 1)? / to * to)
}

/// The engine of the stream-ordered caching pool. See the [module documentation](self) for its
/// model. It is not thread-safe by itself (`&mut self`); it is `Send` when the backend's stream and
/// event types are.
///
/// The owner must call [`release_all`](Self::release_all) before dropping it: dropping it does not
/// free device memory or destroy events (it has no backend to do so).
pub struct PoolCore<B: Backend> {
    config: PoolConfig,
    /// Block slots; `vacant_blocks` lists the `Vacant` ones for reuse.
    blocks: Vec<Block>,
    vacant_blocks: Vec<u32>,
    /// Chunk slots; `None` once released.
    chunks: Vec<Option<Chunk>>,
    vacant_chunks: Vec<u32>,
    /// Stream states; `None` once reaped.
    streams: Vec<Option<StreamState<B>>>,
    vacant_streams: Vec<u32>,
    /// Streams not forgotten, to their state's slot.
    stream_slots: FastMap<B::Stream, u32>,
    /// The stream last looked up, so that the hot path skips hashing.
    last_stream: Option<(B::Stream, u32)>,
    /// Live allocations: pointer to used block.
    allocated: FastMap<u64, u32>,
    stats: PoolStats,
}

impl<B: Backend> fmt::Debug for PoolCore<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolCore").field("config", &self.config).field("stats", &self.stats).finish_non_exhaustive()
    }
}

impl<B: Backend> Default for PoolCore<B> {
    fn default() -> Self {
        Self::new(PoolConfig::default())
    }
}

impl<B: Backend> PoolCore<B> {
    /// Creates an empty pool; it holds no memory until the first allocation.
    pub fn new(config: PoolConfig) -> Self {
        Self {
            config: config.normalized(),
            blocks: Vec::new(),
            vacant_blocks: Vec::new(),
            chunks: Vec::new(),
            vacant_chunks: Vec::new(),
            streams: Vec::new(),
            vacant_streams: Vec::new(),
            stream_slots: FastMap::default(),
            last_stream: None,
            allocated: FastMap::default(),
            stats: PoolStats::default(),
        }
    }

    /// The configuration in force (after rounding).
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Whether `ptr` is a live allocation of this pool.
    pub fn is_allocated(&self, ptr: u64) -> bool {
        self.allocated.contains_key(&ptr)
    }

    /// Counters and gauges.
    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    /// Resets the high-water marks of reserved and in-use bytes to their current values.
    pub fn reset_peaks(&mut self) {
        self.stats.peak_reserved = self.stats.reserved;
        self.stats.peak_in_use = self.stats.in_use;
    }

    /// Sets [`PoolConfig::release_threshold`]. It takes effect at the next growth; nothing is
    /// released now (call [`trim_to`](Self::trim_to) for that).
    pub fn set_release_threshold(&mut self, bytes: usize) {
        self.config.release_threshold = bytes;
    }

    /// Allocates `bytes` for use on `stream`, in stream order: the memory may be used by work
    /// enqueued on `stream` after this call.
    ///
    /// Order of attempts: a free block of `stream` itself (no backend call at all); a block freed on
    /// another stream (one event record there if needed, and a GPU-side wait of `stream` on it; the
    /// host never waits); a new chunk from the driver. If the driver is out of memory, the pool
    /// waits for and releases its cached chunks, merges what it can and tries once more.
    ///
    /// `allocate(0)` hands out a distinct minimal block, to be passed back with size 0.
    pub fn allocate(&mut self, b: &mut B, bytes: usize, stream: &B::Stream) -> Result<u64, PoolError<B::Error>> {
        if bytes > MAX_REQUEST {
            return Err(PoolError::TooLarge { requested: bytes });
        }
        // Cannot overflow below MAX_REQUEST.
        let size = round_up(bytes.max(1), GRANULE).unwrap_or(MAX_REQUEST);
        let kind = self.kind_for(size);
        let s = self.stream_slot(stream);
        // Hot path: the stream's own free list, pure Rust.
        if let Some(blk) = self.take_free(s, kind, size) {
            self.stats.cache_hits += 1;
            return Ok(self.hand_out(blk, size, bytes));
        }
        self.allocate_slow(b, s, kind, size, bytes)
    }

    /// Returns an allocation to the pool, in stream order: the memory becomes reusable by work
    /// enqueued on `stream` after this call, and by other streams only once they are ordered after
    /// it. `bytes` must be the size passed to `allocate`.
    ///
    /// Makes no backend call. Takes no backend argument for that reason.
    pub fn deallocate(&mut self, ptr: u64, bytes: usize, stream: &B::Stream) -> Result<(), PoolError<B::Error>> {
        let Some(&blk) = self.allocated.get(&ptr) else {
            return Err(PoolError::InvalidFree { ptr });
        };
        let block = &self.blocks[blk as usize];
        let State::Used { requested } = block.state else { unreachable!("allocated map points at a used block") };
        if requested != bytes {
            return Err(PoolError::InvalidFree { ptr });
        }
        let (size, chunk) = (block.size, block.chunk);
        self.allocated.remove(&ptr);
        self.chunk_mut(chunk).live -= 1;
        self.stats.in_use -= requested;
        self.stats.in_use_blocks -= size;
        self.stats.live_allocations -= 1;
        let s = self.stream_slot(stream);
        let st = self.st_mut(s);
        st.seq += 1;
        let seq = st.seq;
        self.file_free(blk, s, seq);
        Ok(())
    }

    /// Releases whole free chunks to the driver until at most `keep_bytes` are reserved (or no
    /// whole free chunk is left). Blocks the host on the events that cover those chunks' frees.
    pub fn trim_to(&mut self, b: &mut B, keep_bytes: usize) -> Result<(), B::Error> {
        self.release_free_chunks(b, keep_bytes, Completion::Wait)
    }

    /// Tears the pool down (for `Drop`): waits for every stream's frees, frees every chunk without
    /// live allocations, destroys every event and forgets every stream that has no cached block
    /// left. Chunks holding live allocations are kept and reported; their allocations can still be
    /// deallocated, and a later call frees them.
    pub fn release_all(&mut self, b: &mut B) -> Result<Leaked, B::Error> {
        self.sync_all(b)?;
        self.release_free_chunks(b, 0, Completion::Wait)?;
        // Every free block left is host-safe now, so no event is needed any more.
        self.last_stream = None;
        for i in 0..self.streams.len() {
            let Some(st) = self.streams[i].as_mut() else {
                continue;
            };
            if let Some(ev) = st.event.take() {
                b.destroy_event(ev);
            }
            if st.is_empty() {
                if let Some(stream) = st.stream.take() {
                    self.stream_slots.remove(&stream);
                }
                self.streams[i] = None;
                self.vacant_streams.push(i as u32);
                self.stats.streams -= 1;
            }
        }
        let mut leaked =
            Leaked { allocations: self.stats.live_allocations, bytes: self.stats.in_use, ..Leaked::default() };
        for c in self.chunks.iter().flatten() {
            leaked.chunks += 1;
            leaked.chunk_bytes += c.size;
        }
        Ok(leaked)
    }

    /// Forgets `stream`, which its owner is about to destroy: call it while the stream is still
    /// valid. Its free blocks stay cached: one last event is recorded on the stream to cover them,
    /// and other streams reuse them after waiting on it. Later calls with an equal stream value
    /// start afresh, so a recycled stream handle is safe. Unknown streams are ignored. On error
    /// nothing changes.
    pub fn forget_stream(&mut self, b: &mut B, stream: &B::Stream) -> Result<(), B::Error> {
        let Some(&s) = self.stream_slots.get(stream) else {
            return Ok(());
        };
        let st = self.st(s);
        if !st.is_empty() && st.seq > st.recorded {
            self.record(b, s)?;
        }
        self.stream_slots.remove(stream);
        if self.last_stream.as_ref().is_some_and(|(_, i)| *i == s) {
            self.last_stream = None;
        }
        self.st_mut(s).stream = None;
        self.reap_forgotten(b);
        Ok(())
    }

    // ----- allocation ---------------------------------------------------------------------------

    fn kind_for(&self, size: usize) -> Kind {
        if size <= self.config.small_limit { Kind::Small } else { Kind::Large }
    }

    /// The slot of `stream`'s state, created if new. No backend call.
    #[inline]
    fn stream_slot(&mut self, stream: &B::Stream) -> u32 {
        if let Some((last, s)) = &self.last_stream
            && last == stream
        {
            return *s;
        }
        self.stream_slot_lookup(stream)
    }

    #[inline(never)]
    fn stream_slot_lookup(&mut self, stream: &B::Stream) -> u32 {
        let s = match self.stream_slots.get(stream) {
            Some(&s) => s,
            None => {
                let state = Some(StreamState::new(stream.clone()));
                let s = match self.vacant_streams.pop() {
                    Some(s) => {
                        self.streams[s as usize] = state;
                        s
                    }
                    None => {
                        self.streams.push(state);
                        (self.streams.len() - 1) as u32
                    }
                };
                self.stream_slots.insert(stream.clone(), s);
                self.stats.streams += 1;
                s
            }
        };
        self.last_stream = Some((stream.clone(), s));
        s
    }

    /// Removes and returns the best-fitting free block of stream `s`.
    #[inline]
    fn take_free(&mut self, s: u32, kind: Kind, size: usize) -> Option<u32> {
        let list = &mut self.st_mut(s).free[kind as usize];
        let (&key, &blk) = list.range((size, 0)..).next()?;
        list.remove(&key);
        Some(blk)
    }

    /// Hands out `blk` (free, unlisted, owned by the allocating stream) for a request of `size`
    /// rounded bytes, splitting off the rest when worth it; the rest stays with the same stream and
    /// sequence number.
    fn hand_out(&mut self, blk: u32, size: usize, requested: usize) -> u64 {
        let block = &self.blocks[blk as usize];
        let State::Free { stream, seq } = block.state else { unreachable!("handing out a block that is not free") };
        let rest = block.size - size;
        let min_split = match block.kind {
            Kind::Small => GRANULE,
            Kind::Large => self.config.min_large_split,
        };
        if rest >= min_split {
            let rest_block = Block {
                ptr: block.ptr + size as u64,
                size: rest,
                chunk: block.chunk,
                kind: block.kind,
                prev: blk,
                next: block.next,
                state: State::Free { stream, seq },
            };
            let rest_blk = self.new_block(rest_block);
            let next = self.blocks[blk as usize].next;
            if next != NIL {
                self.blocks[next as usize].prev = rest_blk;
            }
            let block = &mut self.blocks[blk as usize];
            block.next = rest_blk;
            block.size = size;
            // The rest keeps the neighbours the whole block had, so it needs no merge.
            self.list(rest_blk);
        }
        let block = &mut self.blocks[blk as usize];
        block.state = State::Used { requested };
        let (ptr, size, chunk) = (block.ptr, block.size, block.chunk);
        self.chunk_mut(chunk).live += 1;
        self.allocated.insert(ptr, blk);
        let stats = &mut self.stats;
        stats.allocations += 1;
        stats.live_allocations += 1;
        stats.in_use += requested;
        stats.in_use_blocks += size;
        stats.peak_in_use = stats.peak_in_use.max(stats.in_use);
        stats.peak_in_use_blocks = stats.peak_in_use_blocks.max(stats.in_use_blocks);
        ptr
    }

    #[inline(never)]
    fn allocate_slow(
        &mut self,
        b: &mut B,
        s: u32,
        kind: Kind,
        size: usize,
        requested: usize,
    ) -> Result<u64, PoolError<B::Error>> {
        self.reap_forgotten(b);
        if let Some(blk) = self.borrow_from_others(b, s, kind, size).map_err(PoolError::Backend)? {
            self.stats.cross_stream_reuses += 1;
            return Ok(self.hand_out(blk, size, requested));
        }
        let blk = self.grow(b, s, kind, size, requested)?;
        Ok(self.hand_out(blk, size, requested))
    }

    /// Finds the best-fitting free block among the other streams and makes it (and, after a wait,
    /// every other block the wait covers) stream `a`'s. Returns the block, taken off `a`'s list.
    fn borrow_from_others(&mut self, b: &mut B, a: u32, kind: Kind, size: usize) -> Result<Option<u32>, B::Error> {
        let mut best: Option<((usize, u64), u32, u32)> = None;
        for (i, st) in self.streams.iter().enumerate() {
            let Some(st) = st else { continue };
            if i as u32 == a {
                continue;
            }
            if let Some((&key, &blk)) = st.free[kind as usize].range((size, 0)..).next()
                && best.is_none_or(|(k, _, _)| key < k)
            {
                best = Some((key, blk, i as u32));
            }
        }
        let Some((_, blk, src)) = best else {
            return Ok(None);
        };
        let State::Free { seq, .. } = self.blocks[blk as usize].state else {
            unreachable!("free list holds a non-free block")
        };
        if self.host_safe(src, seq) {
            // Ordered before everything issued from now on: no wait needed, move just this block.
            self.unlist(blk);
            self.file_free(blk, a, 0);
        } else {
            if seq > self.st(src).recorded {
                self.record(b, src)?;
            }
            self.wait(b, a, src)?;
            self.move_covered(src, a);
        }
        self.maybe_reap(b, src);
        let taken = self.take_free(a, kind, size);
        debug_assert!(taken.is_some(), "a borrowed block must fit");
        Ok(taken)
    }

    /// Moves every free block of `src` covered by its last record to stream `a`, which has just
    /// waited on that record. In `a`'s order the blocks become free now (after the wait).
    fn move_covered(&mut self, src: u32, a: u32) {
        let st = self.st(src);
        let recorded = st.recorded;
        let moved: Vec<u32> = st
            .free
            .iter()
            .flat_map(|list| list.values().copied())
            .filter(|&blk| matches!(self.blocks[blk as usize].state, State::Free { seq, .. } if seq <= recorded))
            .collect();
        let st = self.st_mut(a);
        st.seq += 1;
        let new_seq = st.seq;
        let mut chunks = Vec::with_capacity(moved.len());
        for &blk in &moved {
            let State::Free { stream, seq } = self.blocks[blk as usize].state else { unreachable!() };
            let seq = if self.host_safe(stream, seq) { 0 } else { new_seq };
            self.unlist(blk);
            self.blocks[blk as usize].state = State::Free { stream: a, seq };
            self.list(blk);
            chunks.push(self.blocks[blk as usize].chunk);
        }
        chunks.sort_unstable();
        chunks.dedup();
        for c in chunks {
            self.coalesce_chunk(c);
        }
    }

    /// Gets a new chunk for a request of `size` rounded bytes; returns its single block, free,
    /// unlisted and owned by stream `a`.
    fn grow(
        &mut self,
        b: &mut B,
        a: u32,
        kind: Kind,
        size: usize,
        requested: usize,
    ) -> Result<u32, PoolError<B::Error>> {
        let chunk_size = self.chunk_size(kind, size).ok_or(PoolError::TooLarge { requested })?;
        let mut limit = self.config.release_threshold;
        if let Some(pct) = self.config.recycle_margin_percent {
            let live = (self.stats.in_use_blocks + size).max(self.stats.peak_in_use_blocks);
            let margin = (live / 100).saturating_mul(pct as usize);
            limit = limit.min(live.saturating_add(margin));
        }
        if self.stats.reserved.saturating_add(chunk_size) > limit {
            self.release_free_chunks(b, limit.saturating_sub(chunk_size), Completion::Poll)
                .map_err(PoolError::Backend)?;
        }
        match b.alloc_chunk(chunk_size) {
            Ok(ptr) => Ok(self.add_chunk(a, kind, ptr, chunk_size)),
            Err(e) if b.is_out_of_memory(&e) => self.grow_after_oom(b, a, kind, size, chunk_size, requested),
            Err(e) => Err(PoolError::Backend(e)),
        }
    }

    /// The out-of-memory path: wait for every stream's frees, release every whole free chunk,
    /// merge what became adjacent and host-safe, then look in the cache again and retry the driver
    /// (with the chunk size, then with the smallest chunk that fits the request).
    #[cold]
    fn grow_after_oom(
        &mut self,
        b: &mut B,
        a: u32,
        kind: Kind,
        size: usize,
        chunk_size: usize,
        requested: usize,
    ) -> Result<u32, PoolError<B::Error>> {
        self.stats.oom_recoveries += 1;
        self.sync_all(b).map_err(PoolError::Backend)?;
        self.release_free_chunks(b, 0, Completion::Wait).map_err(PoolError::Backend)?;
        for c in 0..self.chunks.len() {
            if self.chunks[c].is_some() {
                self.coalesce_chunk(c as u32);
            }
        }
        // Merging may have made a fitting block; all free blocks are host-safe now, so taking one
        // needs no backend call.
        if let Some(blk) = self.take_free(a, kind, size) {
            return Ok(blk);
        }
        if let Some(blk) = self.borrow_from_others(b, a, kind, size).map_err(PoolError::Backend)? {
            return Ok(blk);
        }
        let granule = match kind {
            Kind::Small => GRANULE,
            Kind::Large => self.config.large_granule,
        };
        let smallest = round_up(size, granule).unwrap_or(chunk_size).min(chunk_size);
        let mut last_err = None;
        for bytes in [chunk_size, smallest] {
            if last_err.is_some() && bytes == chunk_size {
                continue;
            }
            match b.alloc_chunk(bytes) {
                Ok(ptr) => return Ok(self.add_chunk(a, kind, ptr, bytes)),
                Err(e) if b.is_out_of_memory(&e) => last_err = Some(e),
                Err(e) => return Err(PoolError::Backend(e)),
            }
        }
        Err(PoolError::OutOfMemory { requested, reserved: self.stats.reserved, in_use: self.stats.in_use })
    }

    /// The chunk to allocate for a request of `size` rounded bytes.
    fn chunk_size(&self, kind: Kind, size: usize) -> Option<usize> {
        let c = &self.config;
        match kind {
            Kind::Small => Some(c.small_chunk),
            Kind::Large if size <= c.medium_limit => Some(c.medium_chunk),
            Kind::Large => {
                let grow = self.stats.reserved.checked_div(c.large_growth_divisor).unwrap_or(0);
                round_up(size.max(grow), c.large_granule)
            }
        }
    }

    /// Records a new chunk; returns its single block (free, seq 0, owned by `a`, unlisted).
    fn add_chunk(&mut self, a: u32, kind: Kind, ptr: u64, size: usize) -> u32 {
        debug_assert!(ptr.is_multiple_of(256), "the driver aligns chunks to 256 bytes");
        let c = match self.vacant_chunks.pop() {
            Some(c) => c,
            None => {
                self.chunks.push(None);
                (self.chunks.len() - 1) as u32
            }
        };
        let blk = self.new_block(Block {
            ptr,
            size,
            chunk: c,
            kind,
            prev: NIL,
            next: NIL,
            state: State::Free { stream: a, seq: 0 },
        });
        self.chunks[c as usize] = Some(Chunk { ptr, size, first: blk, live: 0 });
        let stats = &mut self.stats;
        stats.driver_allocs += 1;
        stats.chunks += 1;
        stats.reserved += size;
        stats.peak_reserved = stats.peak_reserved.max(stats.reserved);
        blk
    }

    // ----- free blocks ----------------------------------------------------------------------------

    /// Files `blk` (just freed or moved, unlisted) on stream `s` at `seq`, merging it with its
    /// neighbours where allowed. (Merging a host-safe neighbour of another stream hands it to
    /// `stream`, and the block beyond may then be `stream`'s too: hence the loops. A just-freed
    /// block is never host-safe, so on `deallocate` each loop runs at most once.)
    fn file_free(&mut self, mut blk: u32, stream: u32, mut seq: u64) {
        loop {
            let prev = self.blocks[blk as usize].prev;
            if prev == NIL {
                break;
            }
            let Some(q) = self.merge_target(prev, stream, seq) else {
                break;
            };
            self.unlist(prev);
            self.absorb(prev, blk);
            (blk, seq) = (prev, q);
        }
        loop {
            let next = self.blocks[blk as usize].next;
            if next == NIL {
                break;
            }
            let Some(q) = self.merge_target(next, stream, seq) else {
                break;
            };
            self.unlist(next);
            self.absorb(blk, next);
            seq = q;
        }
        self.blocks[blk as usize].state = State::Free { stream, seq };
        self.list(blk);
    }

    /// Whether a block free on `stream` at `seq` may merge with neighbour `nb`, and if so the
    /// sequence number of the merged block, which `stream` owns. Allowed when `nb` is free on the
    /// same stream, or when both are host-safe (then the result is host-safe too).
    fn merge_target(&self, nb: u32, stream: u32, seq: u64) -> Option<u64> {
        let State::Free { stream: nb_stream, seq: nb_seq } = self.blocks[nb as usize].state else {
            return None;
        };
        if nb_stream == stream {
            Some(seq.max(nb_seq))
        } else if self.host_safe(stream, seq) && self.host_safe(nb_stream, nb_seq) {
            Some(0)
        } else {
            None
        }
    }

    /// Merges every pair of adjacent free blocks of chunk `c` that may merge.
    fn coalesce_chunk(&mut self, c: u32) {
        let mut cur = self.chunk(c).first;
        while cur != NIL {
            let next = self.blocks[cur as usize].next;
            if next == NIL {
                break;
            }
            if let State::Free { stream, seq } = self.blocks[cur as usize].state
                && let Some(q) = self.merge_target(next, stream, seq)
            {
                self.unlist(cur);
                self.unlist(next);
                self.absorb(cur, next);
                self.blocks[cur as usize].state = State::Free { stream, seq: q };
                self.list(cur);
                continue;
            }
            cur = next;
        }
    }

    /// Grows `lo` over its upper neighbour `hi` (both unlisted) and frees `hi`'s slot.
    fn absorb(&mut self, lo: u32, hi: u32) {
        let (hi_size, hi_next) = {
            let h = &self.blocks[hi as usize];
            (h.size, h.next)
        };
        let l = &mut self.blocks[lo as usize];
        debug_assert_eq!(l.next, hi);
        l.size += hi_size;
        l.next = hi_next;
        if hi_next != NIL {
            self.blocks[hi_next as usize].prev = lo;
        }
        self.blocks[hi as usize].state = State::Vacant;
        self.vacant_blocks.push(hi);
    }

    fn new_block(&mut self, block: Block) -> u32 {
        match self.vacant_blocks.pop() {
            Some(i) => {
                self.blocks[i as usize] = block;
                i
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    /// Adds free block `blk` to its owner's list.
    fn list(&mut self, blk: u32) {
        let block = &self.blocks[blk as usize];
        let State::Free { stream, .. } = block.state else { unreachable!("listing a block that is not free") };
        let (key, kind) = ((block.size, block.ptr), block.kind);
        let old = self.st_mut(stream).free[kind as usize].insert(key, blk);
        debug_assert!(old.is_none());
    }

    /// Removes free block `blk` from its owner's list.
    fn unlist(&mut self, blk: u32) {
        let block = &self.blocks[blk as usize];
        let State::Free { stream, .. } = block.state else { unreachable!("unlisting a block that is not free") };
        let (key, kind) = ((block.size, block.ptr), block.kind);
        let old = self.st_mut(stream).free[kind as usize].remove(&key);
        debug_assert_eq!(old, Some(blk));
    }

    // ----- events ---------------------------------------------------------------------------------

    /// Whether a block freed on stream `s` at `seq` is ordered before all work issued from now on.
    fn host_safe(&self, s: u32, seq: u64) -> bool {
        seq <= self.st(s).completed
    }

    /// Records stream `s`'s event, covering every block freed on it so far.
    fn record(&mut self, b: &mut B, s: u32) -> Result<(), B::Error> {
        let st = self.streams[s as usize].as_mut().expect("live stream slot");
        let stream = st.stream.as_ref().expect("a forgotten stream has all its blocks covered");
        if st.event.is_none() {
            st.event = Some(b.create_event()?);
            self.stats.events_created += 1;
        }
        b.record(st.event.as_ref().expect("created above"), stream)?;
        st.recorded = st.seq;
        self.stats.event_records += 1;
        Ok(())
    }

    /// Makes stream `a` wait on the GPU for stream `src`'s last record.
    fn wait(&mut self, b: &mut B, a: u32, src: u32) -> Result<(), B::Error> {
        let waiter = self.st(a).stream.as_ref().expect("allocating stream is live");
        let event = self.st(src).event.as_ref().expect("a recorded stream with uncompleted frees has an event");
        b.wait(waiter, event)?;
        self.stats.event_waits += 1;
        Ok(())
    }

    /// Makes sure that stream `s`'s frees up to `seq` are complete, recording its event if needed.
    /// Returns false (in `Poll` mode) when they are not complete yet.
    fn ensure_complete(&mut self, b: &mut B, s: u32, seq: u64, how: Completion) -> Result<bool, B::Error> {
        if seq <= self.st(s).completed {
            return Ok(true);
        }
        if seq > self.st(s).recorded {
            self.record(b, s)?;
        }
        let st = self.streams[s as usize].as_mut().expect("live stream slot");
        let event = st.event.as_ref().expect("recorded above or before");
        let done = match how {
            Completion::Wait => {
                b.synchronize(event)?;
                self.stats.event_syncs += 1;
                true
            }
            Completion::Poll => {
                let done = b.query(event)?;
                self.stats.event_queries += 1;
                done
            }
        };
        if done {
            st.completed = st.recorded;
        }
        Ok(done)
    }

    /// Waits on the host for every stream that has free blocks not known to be complete.
    fn sync_all(&mut self, b: &mut B) -> Result<(), B::Error> {
        for s in 0..self.streams.len() as u32 {
            if let Some(st) = &self.streams[s as usize]
                && !st.is_empty()
            {
                let seq = st.seq;
                self.ensure_complete(b, s, seq, Completion::Wait)?;
            }
        }
        Ok(())
    }

    // ----- releasing chunks -----------------------------------------------------------------------

    /// Releases whole free chunks until at most `target` bytes are reserved: first the smallest
    /// one that alone is enough, then the largest first.
    ///
    /// In `Poll` mode nothing blocks, and a chunk whose frees are not covered by a record yet is
    /// skipped; its streams are recorded at the end, so that a later call can find them complete
    /// (recording first and querying at once would only find the GPU busy, and re-recording every
    /// time would push completion away for ever).
    fn release_free_chunks(&mut self, b: &mut B, target: usize, how: Completion) -> Result<(), B::Error> {
        if self.stats.reserved <= target {
            return Ok(());
        }
        let mut idle: Vec<(usize, u32)> = self
            .chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().filter(|c| c.live == 0).map(|c| (c.size, i as u32)))
            .collect();
        idle.sort_unstable_by(|x, y| y.cmp(x));
        let need = self.stats.reserved - target;
        let enough = idle.partition_point(|&(size, _)| size >= need);
        if enough > 0 {
            idle[..enough].rotate_right(1);
        }
        let mut uncovered = Vec::new();
        for (_, c) in idle {
            if self.stats.reserved <= target {
                break;
            }
            if self.make_chunk_safe(b, c, how, &mut uncovered)? {
                self.release_chunk(b, c)?;
            }
        }
        if self.stats.reserved > target {
            uncovered.sort_unstable();
            uncovered.dedup();
            for s in uncovered {
                // Re-record only once the pending record is complete: re-recording the one event
                // of the stream earlier would move its completion away each time.
                let Some(st) = &self.streams[s as usize] else {
                    continue;
                };
                if st.seq == st.recorded {
                    continue;
                }
                if st.completed < st.recorded {
                    let recorded = st.recorded;
                    if !self.ensure_complete(b, s, recorded, Completion::Poll)? {
                        continue;
                    }
                }
                self.record(b, s)?;
            }
        }
        self.reap_forgotten(b);
        Ok(())
    }

    /// Makes every block of free chunk `c` host-safe; false if one is not complete (`Poll`), in
    /// which case streams whose frees still need a record are added to `uncovered`.
    fn make_chunk_safe(
        &mut self,
        b: &mut B,
        c: u32,
        how: Completion,
        uncovered: &mut Vec<u32>,
    ) -> Result<bool, B::Error> {
        let mut cur = self.chunk(c).first;
        while cur != NIL {
            let block = &self.blocks[cur as usize];
            let State::Free { stream, seq } = block.state else {
                unreachable!("a chunk without live blocks has only free blocks")
            };
            let next = block.next;
            if how == Completion::Poll && seq > self.st(stream).recorded {
                uncovered.push(stream);
                return Ok(false);
            }
            if !self.ensure_complete(b, stream, seq, how)? {
                return Ok(false);
            }
            cur = next;
        }
        Ok(true)
    }

    /// Frees chunk `c` (all its blocks free and host-safe) to the driver and forgets it.
    fn release_chunk(&mut self, b: &mut B, c: u32) -> Result<(), B::Error> {
        let chunk = self.chunk(c).clone();
        b.free_chunk(chunk.ptr, chunk.size)?;
        let mut owners = Vec::new();
        let mut cur = chunk.first;
        while cur != NIL {
            let State::Free { stream, .. } = self.blocks[cur as usize].state else {
                unreachable!("released chunk holds a used block")
            };
            self.unlist(cur);
            owners.push(stream);
            let next = self.blocks[cur as usize].next;
            self.blocks[cur as usize].state = State::Vacant;
            self.vacant_blocks.push(cur);
            cur = next;
        }
        self.chunks[c as usize] = None;
        self.vacant_chunks.push(c);
        self.stats.reserved -= chunk.size;
        self.stats.chunks -= 1;
        self.stats.driver_frees += 1;
        owners.sort_unstable();
        owners.dedup();
        for s in owners {
            self.maybe_reap(b, s);
        }
        Ok(())
    }

    /// Drops the state of every forgotten stream that caches no block any more. (A merge of two
    /// host-safe blocks, which needs no backend, may have emptied one.)
    fn reap_forgotten(&mut self, b: &mut B) {
        for s in 0..self.streams.len() as u32 {
            if self.streams[s as usize].is_some() {
                self.maybe_reap(b, s);
            }
        }
    }

    /// Drops the state of forgotten stream `s` once it caches no block.
    fn maybe_reap(&mut self, b: &mut B, s: u32) {
        let st = self.st(s);
        if st.stream.is_none() && st.is_empty() {
            let st = self.streams[s as usize].take().expect("live stream slot");
            if let Some(ev) = st.event {
                b.destroy_event(ev);
            }
            self.vacant_streams.push(s);
            self.stats.streams -= 1;
        }
    }

    // ----- accessors ------------------------------------------------------------------------------

    fn st(&self, s: u32) -> &StreamState<B> {
        self.streams[s as usize].as_ref().expect("live stream slot")
    }

    fn st_mut(&mut self, s: u32) -> &mut StreamState<B> {
        self.streams[s as usize].as_mut().expect("live stream slot")
    }

    fn chunk(&self, c: u32) -> &Chunk {
        self.chunks[c as usize].as_ref().expect("live chunk slot")
    }

    fn chunk_mut(&mut self, c: u32) -> &mut Chunk {
        self.chunks[c as usize].as_mut().expect("live chunk slot")
    }
}

#[cfg(test)]
impl<B: Backend> PoolCore<B> {
    /// Checks every structural invariant; panics on the first broken one.
    fn check_invariants(&self) {
        let mut free_blocks = 0usize;
        let (mut reserved, mut used_bytes, mut requested_bytes, mut used) = (0, 0, 0, 0);
        for (c, chunk) in self.chunks.iter().enumerate() {
            let Some(chunk) = chunk else { continue };
            reserved += chunk.size;
            let (mut cur, mut prev, mut addr, mut live) = (chunk.first, NIL, chunk.ptr, 0);
            while cur != NIL {
                let bl = &self.blocks[cur as usize];
                assert_eq!(bl.chunk as usize, c);
                assert_eq!(bl.prev, prev);
                assert_eq!(bl.ptr, addr);
                assert!(bl.size > 0 && bl.size.is_multiple_of(GRANULE));
                match bl.state {
                    State::Free { stream, seq } => {
                        free_blocks += 1;
                        let st = self.st(stream);
                        assert!(seq <= st.seq);
                        assert_eq!(st.free[bl.kind as usize].get(&(bl.size, bl.ptr)), Some(&cur));
                        if bl.next != NIL
                            && let State::Free { stream: s2, .. } = self.blocks[bl.next as usize].state
                        {
                            assert_ne!(s2, stream, "adjacent free blocks of one stream");
                        }
                    }
                    State::Used { requested } => {
                        live += 1;
                        used += 1;
                        used_bytes += bl.size;
                        requested_bytes += requested;
                        assert!(requested <= bl.size);
                        assert_eq!(self.allocated.get(&bl.ptr), Some(&cur));
                    }
                    State::Vacant => panic!("vacant block linked in a chunk"),
                }
                addr += bl.size as u64;
                prev = cur;
                cur = bl.next;
            }
            assert_eq!(addr, chunk.ptr + chunk.size as u64);
            assert_eq!(live, chunk.live);
        }
        let listed: usize =
            self.streams.iter().flatten().map(|st| st.free.iter().map(BTreeMap::len).sum::<usize>()).sum();
        assert_eq!(listed, free_blocks);
        for st in self.streams.iter().flatten() {
            assert!(st.completed <= st.recorded && st.recorded <= st.seq);
            if st.stream.is_none() {
                assert_eq!(st.recorded, st.seq);
            }
        }
        for (stream, &s) in &self.stream_slots {
            assert!(self.st(s).stream.as_ref() == Some(stream));
        }
        if let Some((stream, s)) = &self.last_stream {
            assert_eq!(self.stream_slots.get(stream), Some(s));
        }
        let s = &self.stats;
        assert_eq!(s.reserved, reserved);
        assert_eq!(s.chunks, self.chunks.iter().flatten().count());
        assert_eq!(s.streams, self.streams.iter().flatten().count());
        assert_eq!(s.in_use, requested_bytes);
        assert_eq!(s.in_use_blocks, used_bytes);
        assert_eq!(s.live_allocations, used);
        assert_eq!(self.allocated.len(), used);
        assert!(s.peak_reserved >= s.reserved && s.peak_in_use >= s.in_use);
    }
}

#[cfg(test)]
mod tests {
    //! Unit tests, property tests against a mock backend that checks stream ordering, and trace
    //! replays.

    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Where the allocation traces live.
    fn trace_path(name: &str) -> String {
        format!("{}/{name}", concat!(env!("CARGO_MANIFEST_DIR"), "/traces"))
    }

    /// A mock stream: an index into the mock's streams.
    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    struct S(usize);

    /// A mock event: an index into the mock's events.
    #[derive(Debug)]
    struct Ev(usize);

    /// Mock errors.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum MockErr {
        Oom,
        Injected,
    }

    impl fmt::Display for MockErr {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            fmt::Debug::fmt(self, f)
        }
    }

    /// Which backend call to fail once.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Call {
        Alloc,
        Free,
        Create,
        Record,
        Wait,
        Sync,
        Query,
    }

    /// A vector clock: entry `i` is how far stream `i`'s work is known to be ordered before.
    type Clock = Vec<u64>;

    fn join(into: &mut Clock, from: &Clock) {
        if into.len() < from.len() {
            into.resize(from.len(), 0);
        }
        for (a, b) in into.iter_mut().zip(from) {
            *a = (*a).max(*b);
        }
    }

    fn at(c: &Clock, i: usize) -> u64 {
        c.get(i).copied().unwrap_or(0)
    }

    /// A device with streams in logical time. Every operation on a stream ticks its clock; events
    /// carry the clock of their record; waits and host synchronisations join clocks. It checks
    /// that memory is reused only when ordered after its free, and freed to the driver only when
    /// the host has seen it free.
    struct Mock {
        capacity: usize,
        reserved: usize,
        next_ptr: u64,
        chunks: BTreeMap<u64, usize>,
        chunk_allocs: u64,
        chunk_frees: u64,
        clocks: Vec<Clock>,
        destroyed: Vec<bool>,
        host: Clock,
        /// `None`: destroyed; `Some(None)`: never recorded; else the clock and `now` at record.
        events: Vec<Option<Option<(Clock, u64)>>>,
        /// Host time, advanced by the test driver.
        now: u64,
        /// An event completes (for `query`) this long after its record; `None`: never.
        query_lag: Option<u64>,
        live_events: usize,
        calls: u64,
        records: u64,
        waits: u64,
        syncs: u64,
        queries: u64,
        fail: Option<Call>,
        /// Whether to keep and check free records (off for trace replays, for speed).
        check: bool,
        /// Live allocations: ptr -> (bytes, stream).
        live: BTreeMap<u64, (usize, usize)>,
        /// Past frees: (ptr, bytes, stream, time on that stream).
        frees: Vec<(u64, usize, usize, u64)>,
    }

    impl Mock {
        fn new(streams: usize) -> Self {
            Self {
                capacity: usize::MAX,
                reserved: 0,
                next_ptr: 1 << 30,
                chunks: BTreeMap::new(),
                chunk_allocs: 0,
                chunk_frees: 0,
                clocks: vec![Clock::new(); streams],
                destroyed: vec![false; streams],
                host: Clock::new(),
                events: Vec::new(),
                live_events: 0,
                calls: 0,
                records: 0,
                waits: 0,
                syncs: 0,
                queries: 0,
                fail: None,
                now: 0,
                query_lag: Some(0),
                check: true,
                live: BTreeMap::new(),
                frees: Vec::new(),
            }
        }

        fn new_stream(&mut self) -> usize {
            self.clocks.push(Clock::new());
            self.destroyed.push(false);
            self.clocks.len() - 1
        }

        /// Enqueues one operation on stream `s`; returns its time there.
        fn tick(&mut self, s: usize) -> u64 {
            assert!(!self.destroyed[s], "operation on destroyed stream {s}");
            let host = self.host.clone();
            let c = &mut self.clocks[s];
            join(c, &host);
            if c.len() <= s {
                c.resize(s + 1, 0);
            }
            c[s] += 1;
            c[s]
        }

        fn call(&mut self, which: Call) -> Result<(), MockErr> {
            self.calls += 1;
            if self.fail == Some(which) {
                self.fail = None;
                return Err(MockErr::Injected);
            }
            Ok(())
        }

        fn event_clock(&self, ev: &Ev) -> &(Clock, u64) {
            self.events[ev.0].as_ref().expect("use of destroyed event").as_ref().expect("use of never-recorded event")
        }

        /// Allocates through the pool and checks the result.
        fn alloc(&mut self, pool: &mut PoolCore<Mock>, bytes: usize, s: usize) -> Result<u64, PoolError<MockErr>> {
            let before = pool.stats();
            let r = pool.allocate(self, bytes, &S(s));
            match r {
                Ok(p) => {
                    self.tick(s);
                    assert_eq!(p % 256, 0, "misaligned");
                    let len = bytes.max(1);
                    let end = p + len as u64;
                    let (&cp, &clen) = self.chunks.range(..=p).next_back().expect("in no chunk");
                    assert!(end <= cp + clen as u64, "allocation beyond its chunk");
                    if let Some((&q, &(n, _))) = self.live.range(..=p).next_back() {
                        assert!(q + n.max(1) as u64 <= p, "overlaps a live allocation");
                    }
                    if let Some((&q, _)) = self.live.range(p..).next() {
                        assert!(end <= q, "overlaps a live allocation");
                    }
                    for &(fp, fl, fs, ft) in &self.frees {
                        if fp < end && p < fp + fl as u64 {
                            assert!(
                                at(&self.clocks[s], fs) >= ft,
                                "block reused on stream {s} before its free on stream {fs} \
                                 (time {ft}) is ordered before it"
                            );
                        }
                    }
                    self.live.insert(p, (bytes, s));
                }
                Err(_) => {
                    let after = pool.stats();
                    assert_eq!(after.in_use, before.in_use);
                    assert_eq!(after.live_allocations, before.live_allocations);
                }
            }
            r
        }

        /// Frees through the pool on stream `s` and records the free.
        fn free(&mut self, pool: &mut PoolCore<Mock>, p: u64, s: usize) {
            let (bytes, a) = self.live.remove(&p).expect("freeing a live allocation");
            if a != s {
                // A correct user orders the freeing stream after every use on the allocating
                // stream (with its own event); model that.
                let c = self.clocks[a].clone();
                join(&mut self.clocks[s], &c);
            }
            pool.deallocate(p, bytes, &S(s)).expect("valid free");
            let t = self.tick(s);
            if self.check {
                self.frees.push((p, bytes.max(1), s, t));
            }
        }
    }

    impl Backend for Mock {
        type Stream = S;
        type Event = Ev;
        type Error = MockErr;

        fn alloc_chunk(&mut self, bytes: usize) -> Result<u64, MockErr> {
            self.call(Call::Alloc)?;
            assert!(bytes > 0);
            if self.capacity - self.reserved < bytes {
                return Err(MockErr::Oom);
            }
            let p = self.next_ptr;
            // Leave a gap, so that chunks are never adjacent.
            self.next_ptr += bytes.next_multiple_of(1 << 21) as u64 + (1 << 21);
            self.chunks.insert(p, bytes);
            self.reserved += bytes;
            self.chunk_allocs += 1;
            Ok(p)
        }

        fn free_chunk(&mut self, ptr: u64, bytes: usize) -> Result<(), MockErr> {
            self.call(Call::Free)?;
            assert_eq!(self.chunks.remove(&ptr), Some(bytes), "bad or double chunk free");
            let end = ptr + bytes as u64;
            assert!(self.live.range(ptr..end).next().is_none(), "chunk freed with a live allocation");
            let host = &self.host;
            for &(fp, _, fs, ft) in &self.frees {
                if (ptr..end).contains(&fp) {
                    assert!(at(host, fs) >= ft, "chunk freed before the host saw its frees");
                }
            }
            self.frees.retain(|&(fp, ..)| !(ptr..end).contains(&fp));
            self.reserved -= bytes;
            self.chunk_frees += 1;
            Ok(())
        }

        fn is_out_of_memory(&self, err: &MockErr) -> bool {
            *err == MockErr::Oom
        }

        fn create_event(&mut self) -> Result<Ev, MockErr> {
            self.call(Call::Create)?;
            self.events.push(Some(None));
            self.live_events += 1;
            Ok(Ev(self.events.len() - 1))
        }

        fn destroy_event(&mut self, ev: Ev) {
            self.calls += 1;
            assert!(self.events[ev.0].take().is_some(), "double destroy");
            self.live_events -= 1;
        }

        fn record(&mut self, ev: &Ev, on: &S) -> Result<(), MockErr> {
            self.call(Call::Record)?;
            self.tick(on.0);
            let c = self.clocks[on.0].clone();
            *self.events[ev.0].as_mut().expect("record of destroyed event") = Some((c, self.now));
            self.records += 1;
            Ok(())
        }

        fn wait(&mut self, waiter: &S, ev: &Ev) -> Result<(), MockErr> {
            self.call(Call::Wait)?;
            let c = self.event_clock(ev).0.clone();
            self.tick(waiter.0);
            join(&mut self.clocks[waiter.0], &c);
            self.waits += 1;
            Ok(())
        }

        fn synchronize(&mut self, ev: &Ev) -> Result<(), MockErr> {
            self.call(Call::Sync)?;
            let c = self.event_clock(ev).0.clone();
            join(&mut self.host, &c);
            self.syncs += 1;
            Ok(())
        }

        fn query(&mut self, ev: &Ev) -> Result<bool, MockErr> {
            self.call(Call::Query)?;
            let (c, at) = self.event_clock(ev).clone();
            self.queries += 1;
            let done = self.query_lag.is_some_and(|lag| self.now >= at + lag);
            if done {
                join(&mut self.host, &c);
            }
            Ok(done)
        }
    }

    /// The default configuration less the growth policies (geometric chunks, recycling), so
    /// that unit tests can predict chunk sizes.
    fn plain() -> PoolConfig {
        PoolConfig {
            medium_chunk: 16 * MIB,
            large_growth_divisor: 0,
            recycle_margin_percent: None,
            ..PoolConfig::default()
        }
    }

    fn pool() -> PoolCore<Mock> {
        PoolCore::new(plain())
    }

    /// Frees everything left, releases the pool and checks that nothing leaked.
    fn teardown(pool: &mut PoolCore<Mock>, m: &mut Mock) {
        let live: Vec<(u64, usize)> = m.live.iter().map(|(&p, &(_, s))| (p, s)).collect();
        let alive = m.destroyed.iter().rposition(|d| !d).expect("a live stream");
        for (p, s) in live {
            let s = if m.destroyed[s] { alive } else { s };
            m.free(pool, p, s);
        }
        m.fail = None;
        let leaked = pool.release_all(m).unwrap();
        assert_eq!(leaked, Leaked::default());
        pool.check_invariants();
        let st = pool.stats();
        assert_eq!(st.reserved, 0);
        assert_eq!(st.chunks, 0);
        assert_eq!(st.streams, 0);
        assert!(m.chunks.is_empty());
        assert_eq!(m.reserved, 0);
        assert_eq!(m.chunk_allocs, m.chunk_frees);
        assert_eq!(st.driver_allocs, m.chunk_allocs);
        assert_eq!(st.driver_frees, m.chunk_frees);
        assert_eq!(m.live_events, 0);
    }

    const KIB: usize = 1 << 10;

    #[test]
    fn same_stream_reuse_makes_no_backend_call() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        let p = m.alloc(&mut pool, 1000, 0).unwrap();
        m.free(&mut pool, p, 0);
        let calls = m.calls;
        for _ in 0..10 {
            let q = m.alloc(&mut pool, 1000, 0).unwrap();
            assert_eq!(q, p);
            m.free(&mut pool, q, 0);
        }
        assert_eq!(m.calls, calls, "the hot path called the backend");
        let st = pool.stats();
        assert_eq!(st.cache_hits, 10);
        assert_eq!(st.driver_allocs, 1);
        assert_eq!(st.event_records, 0);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn deallocate_makes_no_backend_call() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        let ps: Vec<u64> = (0..8).map(|_| m.alloc(&mut pool, 5000, 0).unwrap()).collect();
        let calls = m.calls;
        for (i, p) in ps.into_iter().enumerate() {
            m.free(&mut pool, p, i % 2);
        }
        assert_eq!(m.calls, calls);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn cross_stream_reuse_records_once_and_waits_on_the_gpu() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        // Fill one small chunk exactly, so that stream 1 cannot grow into its tail.
        let ps: Vec<u64> = (0..4).map(|_| m.alloc(&mut pool, 512 * KIB, 0).unwrap()).collect();
        for &p in &ps {
            m.free(&mut pool, p, 0);
        }
        let calls = m.calls;
        let q = m.alloc(&mut pool, 512 * KIB, 1).unwrap();
        assert!(ps.contains(&q) || q == ps[0]);
        assert_eq!((m.records, m.waits, m.syncs), (1, 1, 0));
        assert_eq!(m.calls - calls, 3, "create + record + wait");
        let st = pool.stats();
        assert_eq!((st.cross_stream_reuses, st.event_records, st.event_waits), (1, 1, 1));
        // The same wait covered the whole chunk: the next allocations on stream 1 are hits.
        for _ in 0..3 {
            m.alloc(&mut pool, 512 * KIB, 1).unwrap();
        }
        assert_eq!((m.records, m.waits), (1, 1));
        assert_eq!(pool.stats().cache_hits, st.cache_hits + 3);
        assert_eq!(pool.stats().driver_allocs, 1);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn blocks_covered_by_the_same_record_need_no_new_record() {
        let (mut pool, mut m) = (pool(), Mock::new(3));
        let a = m.alloc(&mut pool, 2 * MIB, 0).unwrap(); // own chunk (16 MiB medium)
        let b = m.alloc(&mut pool, 2 * MIB, 0).unwrap();
        let _keep = m.alloc(&mut pool, 12 * MIB, 0).unwrap(); // fills the chunk
        m.free(&mut pool, a, 0);
        m.free(&mut pool, b, 0); // merged with a
        m.alloc(&mut pool, 2 * MIB, 1).unwrap();
        assert_eq!(m.records, 1);
        // Stream 2 takes what stream 1 received: stream 1 was never recorded after the move, so
        // that needs one record on stream 1, not a second on stream 0.
        m.alloc(&mut pool, 2 * MIB, 2).unwrap();
        assert_eq!(m.records, 2);
        assert_eq!(m.waits, 2);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn second_reuse_of_blocks_covered_by_one_event_does_not_record_again() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        let ps: Vec<u64> = (0..4).map(|_| m.alloc(&mut pool, 512 * KIB, 0).unwrap()).collect();
        for &p in &ps {
            m.free(&mut pool, p, 0);
        }
        // Keep stream 0's blocks split: take them back in between on stream 1 one by one.
        let q1 = m.alloc(&mut pool, 512 * KIB, 1).unwrap();
        let q2 = m.alloc(&mut pool, 512 * KIB, 1).unwrap();
        assert_ne!(q1, q2);
        assert_eq!((m.records, m.waits), (1, 1));
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn blocks_freed_after_the_record_need_a_new_record() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        let ps: Vec<u64> = (0..4).map(|_| m.alloc(&mut pool, 512 * KIB, 0).unwrap()).collect();
        m.free(&mut pool, ps[0], 0);
        m.alloc(&mut pool, 512 * KIB, 1).unwrap();
        assert_eq!((m.records, m.waits), (1, 1));
        // Freed after that record: not covered.
        m.free(&mut pool, ps[1], 0);
        m.alloc(&mut pool, 512 * KIB, 1).unwrap();
        assert_eq!((m.records, m.waits), (2, 2));
        assert_eq!(pool.stats().events_created, 1, "one reusable event per stream");
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn oom_releases_the_cache_and_retries() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        m.capacity = 64 * MIB;
        let a = m.alloc(&mut pool, 40 * MIB, 0).unwrap();
        m.free(&mut pool, a, 1); // cached on stream 1, not covered by any event
        let calls_syncs = m.syncs;
        let b = m.alloc(&mut pool, 50 * MIB, 0).unwrap();
        let st = pool.stats();
        assert_eq!(st.oom_recoveries, 1);
        assert_eq!(st.driver_frees, 1);
        assert_eq!(st.reserved, 50 * MIB);
        assert!(m.syncs > calls_syncs, "the host waited before freeing");
        m.free(&mut pool, b, 0);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn oom_merges_host_safe_blocks_of_different_streams() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        m.capacity = 40 * MIB;
        let a = m.alloc(&mut pool, 16 * MIB, 0).unwrap();
        let b = m.alloc(&mut pool, 16 * MIB, 0).unwrap();
        let c = m.alloc(&mut pool, 32 * MIB, 0);
        assert!(matches!(c, Err(PoolError::OutOfMemory { .. })));
        // Two halves of one chunk? No: each 16 MiB request got its own chunk; free both on
        // different streams and ask for 20 MiB: the cache is released and the retry succeeds.
        m.free(&mut pool, a, 0);
        m.free(&mut pool, b, 1);
        let d = m.alloc(&mut pool, 20 * MIB, 0).unwrap();
        assert_eq!(pool.stats().reserved, 20 * MIB);
        m.free(&mut pool, d, 0);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn oom_error_reports_the_figures() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        m.capacity = 10 * MIB;
        let _a = m.alloc(&mut pool, 3 * MIB, 0).unwrap(); // a 2 MiB-rounded own chunk? no: medium
        let st = pool.stats();
        let e = m.alloc(&mut pool, 100 * MIB, 0).unwrap_err();
        assert_eq!(e, PoolError::OutOfMemory { requested: 100 * MIB, reserved: st.reserved, in_use: 3 * MIB });
        assert!(e.to_string().contains("104857600 bytes requested"));
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn oom_falls_back_to_the_smallest_chunk() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        m.capacity = 4 * MIB; // a 16 MiB medium chunk does not fit, a 4 MiB one does
        let a = m.alloc(&mut pool, 3 * MIB, 0).unwrap();
        assert_eq!(pool.stats().reserved, 4 * MIB);
        m.free(&mut pool, a, 0);
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn invalid_frees_change_nothing() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        let p = m.alloc(&mut pool, 1000, 0).unwrap();
        let before = pool.stats();
        let s = S(0);
        assert_eq!(pool.deallocate(p + 512, 1000, &s), Err(PoolError::InvalidFree { ptr: p + 512 }));
        assert_eq!(pool.deallocate(p, 999, &s), Err(PoolError::InvalidFree { ptr: p }));
        assert_eq!(pool.deallocate(p, 1024, &s), Err(PoolError::InvalidFree { ptr: p }));
        assert_eq!(pool.deallocate(12345, 1, &s), Err(PoolError::InvalidFree { ptr: 12345 }));
        assert_eq!(pool.stats(), before);
        pool.check_invariants();
        m.free(&mut pool, p, 0);
        let before = pool.stats();
        // Double free.
        assert_eq!(pool.deallocate(p, 1000, &s), Err(PoolError::InvalidFree { ptr: p }));
        assert_eq!(pool.stats(), before);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn zero_sized_allocations_are_distinct_blocks() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        let a = m.alloc(&mut pool, 0, 0).unwrap();
        let b = m.alloc(&mut pool, 0, 0).unwrap();
        assert_ne!(a, b);
        assert_eq!(pool.stats().in_use, 0);
        assert_eq!(pool.stats().in_use_blocks, 2 * GRANULE);
        assert_eq!(pool.deallocate(a, 1, &S(0)), Err(PoolError::InvalidFree { ptr: a }));
        m.free(&mut pool, a, 0);
        m.free(&mut pool, b, 0);
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn too_large_requests_are_refused() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        for n in [usize::MAX, usize::MAX - 10, MAX_REQUEST + 1] {
            assert_eq!(m.alloc(&mut pool, n, 0), Err(PoolError::TooLarge { requested: n }));
        }
        assert_eq!(m.calls, 0);
        // Huge but accepted: the driver says no.
        m.capacity = 1 << 30;
        assert!(matches!(m.alloc(&mut pool, MAX_REQUEST, 0), Err(PoolError::OutOfMemory { .. })));
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn trim_to_releases_whole_free_chunks() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        let a = m.alloc(&mut pool, 30 * MIB, 0).unwrap();
        let b = m.alloc(&mut pool, 20 * MIB, 1).unwrap();
        let c = m.alloc(&mut pool, 10 * MIB, 0).unwrap();
        m.free(&mut pool, a, 0);
        m.free(&mut pool, b, 1);
        assert_eq!(pool.stats().reserved, 60 * MIB);
        pool.trim_to(&mut m, 40 * MIB).unwrap();
        // The smallest free chunk that is enough alone goes: the 20 MiB one.
        assert_eq!(pool.stats().reserved, 40 * MIB);
        assert_eq!(m.syncs, 1);
        pool.trim_to(&mut m, 0).unwrap();
        assert_eq!(pool.stats().reserved, 10 * MIB, "the chunk in use stays");
        pool.check_invariants();
        m.free(&mut pool, c, 0);
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn release_threshold_releases_only_completed_chunks_without_blocking() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        pool.set_release_threshold(40 * MIB);
        let a = m.alloc(&mut pool, 30 * MIB, 0).unwrap();
        m.free(&mut pool, a, 0);
        // Not complete yet: the pool may not block, so it grows above the threshold.
        m.query_lag = None;
        let b = m.alloc(&mut pool, 32 * MIB, 0).unwrap();
        assert_eq!(pool.stats().reserved, 62 * MIB);
        assert_eq!(m.syncs, 0);
        assert_eq!(m.records, 1, "recorded to cover the free, for later");
        m.free(&mut pool, b, 0);
        // Now the GPU is done with the first chunk, whose free that record covers: growing
        // releases it first. The second chunk's free is not covered yet: it is recorded now.
        m.query_lag = Some(0);
        let c = m.alloc(&mut pool, 36 * MIB, 0).unwrap();
        assert_eq!(m.syncs, 0);
        assert_eq!(pool.stats().driver_frees, 1);
        assert_eq!(pool.stats().reserved, 68 * MIB);
        assert_eq!(m.records, 2);
        m.free(&mut pool, c, 0);
        // Next growth: the second chunk's record is complete, so it goes; the third's free is
        // recorded for later.
        let d = m.alloc(&mut pool, 40 * MIB, 0).unwrap();
        assert_eq!(m.syncs, 0);
        assert_eq!(pool.stats().driver_frees, 2);
        assert_eq!(pool.stats().reserved, 36 * MIB + 40 * MIB);
        assert_eq!(m.records, 3);
        m.free(&mut pool, d, 0);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn backend_errors_leave_the_pool_consistent() {
        {
            let (mut pool, mut m) = (pool(), Mock::new(1));
            let p = m.alloc(&mut pool, 100, 0).unwrap();
            let before = pool.stats();
            m.fail = Some(Call::Alloc);
            let r = m.alloc(&mut pool, 30 * MIB, 0);
            assert_eq!(r, Err(PoolError::Backend(MockErr::Injected)));
            assert_eq!(pool.stats(), before);
            pool.check_invariants();
            m.free(&mut pool, p, 0);
            teardown(&mut pool, &mut m);
        }
        for call in [Call::Create, Call::Record, Call::Wait] {
            let (mut pool, mut m) = (pool(), Mock::new(2));
            let p = m.alloc(&mut pool, 512 * KIB, 0).unwrap();
            let _fill: Vec<u64> = (0..3).map(|_| m.alloc(&mut pool, 512 * KIB, 0).unwrap()).collect();
            m.free(&mut pool, p, 0);
            m.fail = Some(call);
            let r = m.alloc(&mut pool, 512 * KIB, 1);
            assert_eq!(r, Err(PoolError::Backend(MockErr::Injected)), "{call:?}");
            pool.check_invariants();
            // And it works afterwards.
            let q = m.alloc(&mut pool, 512 * KIB, 1).unwrap();
            assert_eq!(q, p);
            pool.check_invariants();
            teardown(&mut pool, &mut m);
        }
        for call in [Call::Sync, Call::Free] {
            let (mut pool, mut m) = (pool(), Mock::new(1));
            let p = m.alloc(&mut pool, 30 * MIB, 0).unwrap();
            m.free(&mut pool, p, 0);
            m.fail = Some(call);
            assert_eq!(pool.trim_to(&mut m, 0), Err(MockErr::Injected));
            assert_eq!(pool.stats().reserved, 30 * MIB);
            pool.check_invariants();
            pool.trim_to(&mut m, 0).unwrap();
            assert_eq!(pool.stats().reserved, 0);
            teardown(&mut pool, &mut m);
        }
    }

    #[test]
    fn forgotten_streams_blocks_are_reused_after_their_event() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        let ps: Vec<u64> = (0..4).map(|_| m.alloc(&mut pool, 512 * KIB, 1).unwrap()).collect();
        for &p in &ps {
            m.free(&mut pool, p, 1);
        }
        pool.forget_stream(&mut m, &S(1)).unwrap();
        assert_eq!(m.records, 1);
        m.destroyed[1] = true;
        assert_eq!(pool.stats().streams, 1, "kept while it caches blocks");
        let q = m.alloc(&mut pool, MIB, 0).unwrap();
        assert_eq!(q, ps[0], "merged and reused");
        assert_eq!(m.waits, 1);
        assert_eq!(pool.stats().driver_allocs, 1);
        assert_eq!(pool.stats().streams, 1, "the forgotten stream was reaped");
        assert_eq!(m.live_events, 0, "its event was destroyed");
        // An equal stream value later is a new stream.
        m.destroyed[1] = false;
        m.free(&mut pool, q, 1);
        pool.check_invariants();
        pool.forget_stream(&mut m, &S(1)).unwrap();
        pool.forget_stream(&mut m, &S(7)).unwrap(); // unknown: ignored
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn splitting_and_merging_keep_reserved_close_to_live() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        let ps: Vec<u64> = (0..64).map(|i| m.alloc(&mut pool, 1000 + i * 37, 0).unwrap()).collect();
        assert_eq!(pool.stats().driver_allocs, 1, "small requests share a chunk");
        for &p in ps.iter().step_by(2).chain(ps.iter().skip(1).step_by(2)) {
            m.free(&mut pool, p, 0);
        }
        // Everything merged back: a 1 MiB request fits without growing.
        m.alloc(&mut pool, MIB, 0).unwrap();
        assert_eq!(pool.stats().driver_allocs, 1);
        let big: Vec<u64> = (0..4).map(|_| m.alloc(&mut pool, 3 * MIB, 0).unwrap()).collect();
        assert_eq!(pool.stats().driver_allocs, 2, "medium requests share a chunk");
        for p in big {
            m.free(&mut pool, p, 0);
        }
        m.alloc(&mut pool, 12 * MIB, 0).unwrap();
        assert_eq!(pool.stats().driver_allocs, 2);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn recycling_releases_completed_free_chunks_before_growing() {
        let config = PoolConfig { recycle_margin_percent: Some(5), ..plain() };
        let (mut pool, mut m) = (PoolCore::new(config), Mock::new(2));
        m.query_lag = Some(2);
        let a = m.alloc(&mut pool, 100 * MIB, 0).unwrap();
        m.free(&mut pool, a, 0);
        // The free 100 MiB chunk is too small: the pool would reach 220 MiB for 120 MiB live.
        // Its free is not covered yet: recorded now, not waited for.
        let b = m.alloc(&mut pool, 120 * MIB, 0).unwrap();
        assert_eq!((pool.stats().reserved, m.records, m.syncs), (220 * MIB, 1, 0));
        m.free(&mut pool, b, 0);
        m.now += 5;
        // Later, the record is complete: the free chunks go before the pool grows.
        let c = m.alloc(&mut pool, 130 * MIB, 0).unwrap();
        assert_eq!(m.syncs, 0);
        assert!(pool.stats().reserved <= 130 * MIB + 120 * MIB);
        assert!(pool.stats().driver_frees >= 1);
        m.free(&mut pool, c, 0);
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn large_chunks_grow_geometrically() {
        let config = PoolConfig { large_growth_divisor: 4, ..plain() };
        let (mut pool, mut m) = (PoolCore::new(config), Mock::new(1));
        let _a = m.alloc(&mut pool, 400 * MIB, 0).unwrap();
        let _b = m.alloc(&mut pool, 20 * MIB, 0).unwrap();
        assert_eq!(pool.stats().reserved, 500 * MIB, "a 100 MiB chunk (1/4 of 400)");
        for _ in 0..4 {
            m.alloc(&mut pool, 20 * MIB, 0).unwrap();
        }
        assert_eq!(pool.stats().driver_allocs, 2, "later requests share it");
        pool.check_invariants();
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn release_all_reports_live_allocations() {
        let (mut pool, mut m) = (pool(), Mock::new(2));
        let a = m.alloc(&mut pool, 100, 0).unwrap();
        let b = m.alloc(&mut pool, 30 * MIB, 1).unwrap();
        m.free(&mut pool, b, 1);
        let leaked = pool.release_all(&mut m).unwrap();
        assert_eq!(leaked, Leaked { allocations: 1, bytes: 100, chunks: 1, chunk_bytes: 2 * MIB });
        assert_eq!(m.live_events, 0);
        pool.check_invariants();
        // The survivor can still be freed, and a second release frees its chunk.
        m.free(&mut pool, a, 0);
        teardown(&mut pool, &mut m);
    }

    #[test]
    fn pool_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<PoolCore<Mock>>();
    }

    #[test]
    fn errors_display() {
        let e: PoolError<MockErr> = PoolError::InvalidFree { ptr: 0x1000 };
        assert!(e.to_string().contains("0x1000"));
        let e: PoolError<std::io::Error> = PoolError::Backend(std::io::Error::other("x"));
        assert!(std::error::Error::source(&e).is_some());
    }

    /// One step of a random workload.
    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize, usize),
        Free(usize, usize),
        BadFree(usize, u8),
        Trim(usize),
        Forget(usize),
        Threshold(Option<usize>),
        QueryLag(Option<u64>),
        Fail(u8),
    }

    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![
            3 => 0..=4096usize,
            3 => 4096..=(2 * MIB),
            2 => (2 * MIB)..=(24 * MIB),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            10 => (size(), 0..4usize).prop_map(|(n, s)| Op::Alloc(n, s)),
            8 => (any::<usize>(), 0..4usize).prop_map(|(i, s)| Op::Free(i, s)),
            1 => (any::<usize>(), 0..3u8).prop_map(|(i, k)| Op::BadFree(i, k)),
            1 => (0..(64 * MIB)).prop_map(Op::Trim),
            1 => (0..4usize).prop_map(Op::Forget),
            1 => proptest::option::of(0..(96 * MIB)).prop_map(Op::Threshold),
            1 => proptest::option::of(0..4u64).prop_map(Op::QueryLag),
            1 => (0..7u8).prop_map(Op::Fail),
        ]
    }

    fn run_ops(nstreams: usize, default_config: bool, ops: Vec<Op>) {
        let config = if default_config { PoolConfig::default() } else { plain() };
        let (mut pool, mut m) = (PoolCore::new(config), Mock::new(nstreams));
        m.capacity = 96 * MIB;
        // Logical stream slot -> current mock stream (a forgotten stream is replaced by a new one).
        let mut handles: Vec<usize> = (0..nstreams).collect();
        for op in ops {
            m.now += 1;
            match op {
                Op::Alloc(n, s) => {
                    let s = handles[s % nstreams];
                    match m.alloc(&mut pool, n, s) {
                        Ok(_) | Err(PoolError::OutOfMemory { .. }) => {}
                        Err(PoolError::Backend(MockErr::Injected)) => {}
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                }
                Op::Free(i, s) => {
                    if !m.live.is_empty() {
                        let p = *m.live.keys().nth(i % m.live.len()).unwrap();
                        m.free(&mut pool, p, handles[s % nstreams]);
                    }
                }
                Op::BadFree(i, k) => {
                    let before = pool.stats();
                    let (p, n) = match (m.live.iter().nth(i % m.live.len().max(1)), k) {
                        (Some((&p, &(n, _))), 0) => (p, n + 1),
                        (Some((&p, &(n, _))), 1) => (p + 256, n),
                        (_, _) => (i as u64 & !255, 512),
                    };
                    if !m.live.contains_key(&p) || m.live[&p].0 != n {
                        let r = pool.deallocate(p, n, &S(handles[0]));
                        assert_eq!(r, Err(PoolError::InvalidFree { ptr: p }));
                        assert_eq!(pool.stats(), before);
                    }
                }
                Op::Trim(keep) => {
                    let _ = pool.trim_to(&mut m, keep);
                }
                Op::Forget(s) => {
                    let slot = s % nstreams;
                    let old = handles[slot];
                    if pool.forget_stream(&mut m, &S(old)).is_ok() {
                        // The stream is destroyed; new work goes to a fresh stream.
                        m.destroyed[old] = true;
                        handles[slot] = m.new_stream();
                    }
                }
                Op::Threshold(t) => pool.set_release_threshold(t.unwrap_or(usize::MAX)),
                Op::QueryLag(l) => m.query_lag = l,
                Op::Fail(k) => {
                    m.fail = Some(
                        [Call::Alloc, Call::Free, Call::Create, Call::Record, Call::Wait, Call::Sync, Call::Query]
                            [k as usize],
                    );
                }
            }
            pool.check_invariants();
            let st = pool.stats();
            assert_eq!(st.in_use, m.live.values().map(|&(n, _)| n).sum::<usize>());
            assert_eq!(st.live_allocations, m.live.len());
            assert_eq!(st.reserved, m.reserved);
            assert_eq!(st.chunks, m.chunks.len());
            assert_eq!(st.driver_allocs, m.chunk_allocs);
            assert_eq!(st.driver_frees, m.chunk_frees);
        }
        teardown(&mut pool, &mut m);
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            // PROPTEST_CASES overrides the number of cases outside Miri.
            cases: if cfg!(miri) {
                4
            } else {
                std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
            },
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn random_workloads_are_safe_and_consistent(
            nstreams in 1..=4usize,
            default_config in any::<bool>(),
            ops in proptest::collection::vec(op(), 0..if cfg!(miri) { 40 } else { 300 }),
        ) {
            run_ops(nstreams, default_config, ops);
        }
    }

    /// Replays a trace on one stream; returns (peak reserved / peak live, stats, events).
    /// `lag`: how many trace events an event takes to complete on the mock GPU.
    fn replay(name: &str, config: PoolConfig, lag: Option<u64>) -> (f64, PoolStats, usize) {
        let text = std::fs::read_to_string(trace_path(name)).expect("trace file");
        let mut pool = PoolCore::<Mock>::new(config);
        let mut m = Mock::new(1);
        m.check = false;
        m.query_lag = lag;
        let (mut live, mut peak_live, mut events) = (0usize, 0usize, 0usize);
        let mut ids: HashMap<u64, (u64, usize)> = HashMap::new();
        for line in text.lines() {
            if line.starts_with('#') || line.starts_with("op,") || line.is_empty() {
                continue;
            }
            let mut f = line.split(',');
            let (op, id, n) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
            let (id, n): (u64, usize) = (id.parse().unwrap(), n.parse().unwrap());
            events += 1;
            m.now += 1;
            if op == "a" {
                let p = pool.allocate(&mut m, n, &S(0)).unwrap();
                ids.insert(id, (p, n));
                live += n;
                peak_live = peak_live.max(live);
            } else {
                let (p, n) = ids.remove(&id).unwrap();
                pool.deallocate(p, n, &S(0)).unwrap();
                live -= n;
            }
        }
        for (_, (p, n)) in ids {
            pool.deallocate(p, n, &S(0)).unwrap();
        }
        let st = pool.stats();
        pool.check_invariants();
        assert_eq!(pool.release_all(&mut m).unwrap(), Leaked::default());
        (st.peak_reserved as f64 / peak_live as f64, st, events)
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads files and replays thousands of events")]
    fn traces_stay_within_ten_percent_of_live() {
        for name in ["gpt2_train.csv", "resnet50_train.csv"] {
            // GPU lag: events complete 100 trace events after their record, or never (a host far
            // ahead of the GPU, where no release can happen without blocking).
            for lag in [Some(100), None] {
                let (ratio, st, events) = replay(name, PoolConfig::default(), lag);
                let runs = 20;
                let t = std::time::Instant::now();
                for _ in 0..runs {
                    std::hint::black_box(replay(name, PoolConfig::default(), lag));
                }
                let ns = t.elapsed().as_nanos() as f64 / (runs * events) as f64;
                println!(
                    "{name} (lag {lag:?}): peak reserved / peak live = {ratio:.4} \
                     (/ peak in-use blocks = {:.4}), driver_allocs = {}, driver_frees = {}, \
                     {ns:.0} ns per event (mock backend, parsing included)",
                    st.peak_reserved as f64 / st.peak_in_use_blocks as f64,
                    st.driver_allocs,
                    st.driver_frees,
                );
                assert!(ratio <= 1.10, "{name}: ratio {ratio:.4}");
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "timing loop")]
    fn hot_path_timing() {
        let (mut pool, mut m) = (pool(), Mock::new(1));
        let s = S(0);
        let keep: Vec<u64> = (0..32).map(|i| pool.allocate(&mut m, 4096 * (i + 1), &s).unwrap()).collect();
        let n = 1_000_000;
        let t = std::time::Instant::now();
        for _ in 0..n {
            let p = pool.allocate(&mut m, std::hint::black_box(8192), &s).unwrap();
            pool.deallocate(p, 8192, &s).unwrap();
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("hot path (split + merge): {ns:.1} ns per same-stream allocate+deallocate pair");
        // An exact fit between two used blocks: no split, no merge.
        let p = pool.allocate(&mut m, 8192, &s).unwrap();
        let fence = pool.allocate(&mut m, 512, &s).unwrap();
        pool.deallocate(p, 8192, &s).unwrap();
        let t = std::time::Instant::now();
        for _ in 0..n {
            let p = pool.allocate(&mut m, std::hint::black_box(8192), &s).unwrap();
            pool.deallocate(p, 8192, &s).unwrap();
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("hot path (exact fit): {ns:.1} ns per same-stream allocate+deallocate pair");
        pool.deallocate(fence, 512, &s).unwrap();
        for (i, p) in keep.into_iter().enumerate() {
            pool.deallocate(p, 4096 * (i + 1), &s).unwrap();
        }
        pool.release_all(&mut m).unwrap();
    }
}

//! [`PoolConfig`]: the tuning of a stream-ordered pool.

use super::blocks::Kind;
use super::{GRANULE, MAX_REQUEST, round_up};

const MIB: usize = 1 << 20;

/// [`PoolConfig::headroom_percent`]'s default.
pub(crate) const DEFAULT_HEADROOM_PERCENT: u32 = 20;

/// Tuning of a stream-ordered pool ([`StreamOrderedPool`](crate::memory::StreamOrderedPool), or
/// [`SimulatedPool`](crate::memory::SimulatedPool)). Sizes are rounded up to 512 bytes.
///
/// The defaults keep reserved memory within about 20% of the most memory that was live at once
/// (counting the bytes asked for, not the pages the driver rounds chunks to), and make a driver
/// call only when that memory has to grow.
///
/// ```
/// use cudrv::memory::PoolConfig;
/// // Keep at most 4 GiB cached, and grow in larger steps for mid-sized requests.
/// let config = PoolConfig { release_threshold: 4 << 30, medium_chunk: 64 << 20, ..PoolConfig::default() };
/// assert_eq!(config.small_limit, 1 << 20);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// The most bytes the pool keeps reserved before it gives free memory back when it grows:
    /// growing past it first releases whole free chunks whose frees the GPU has completed (asked
    /// with `cuEventQuery`; the host never waits for it). `usize::MAX` (the default) sets no bound
    /// beyond [`headroom_percent`](Self::headroom_percent).
    pub release_threshold: usize,
    /// Requests up to this many bytes are *small*: they share small chunks, apart from larger
    /// blocks. Default 1 MiB.
    pub small_limit: usize,
    /// The size of a small chunk. Default 2 MiB.
    pub small_chunk: usize,
    /// Requests above `small_limit` and up to this many bytes share medium chunks. Default 8 MiB.
    pub medium_limit: usize,
    /// The size of a medium chunk (at least `medium_limit`). Default 32 MiB.
    pub medium_chunk: usize,
    /// Requests above `medium_limit` get a chunk of their own, rounded up to a multiple of this
    /// (the driver maps device memory in pages of 2 MiB anyway). Default 2 MiB.
    pub large_granule: usize,
    /// A large request gets a chunk rounded up to a size class: this many classes per doubling of
    /// size (8: classes about 9% apart). A tensor that grows a little at each step (a KV cache
    /// grown by concatenation) then reuses the chunk it freed two steps before, until it crosses
    /// into the next class, instead of needing a new chunk every step. 0 rounds to
    /// `large_granule` only. Where the class would pass the headroom, the chunk takes what the
    /// headroom leaves where the request's pages still fit, so that the buffer a step later, a little
    /// larger, still fits it. Near the device's capacity the pool grows exactly instead, and
    /// so it does while what the rounding leaves unused in the blocks that are out adds up to
    /// 0.25% of the device's memory (so that a device filled with live buffers is filled as
    /// tightly as the driver's own pool fills it). Default 8.
    pub large_classes_per_octave: u32,
    /// A free block of a large chunk serves a request only if the request is at least this many
    /// percent of it; otherwise the request gets a chunk of its own, and the free block stays
    /// whole (to serve a request of its size, or to go back to the driver whole). Splitting a
    /// large block for a much smaller request would leave most of its chunk pinned by that block.
    /// (What the request leaves becomes the chunk's tail, which small requests take only when
    /// nothing else is left, and medium ones also once the most memory live at once has settled
    /// and a chunk of their own would pass the headroom.) Past the headroom, in chunks, where the
    /// alternative is to give memory back and allocate anew, a large request takes a free tail
    /// that holds it, or else a free large block that holds it, while what blocks leave unused
    /// stays within the headroom's share of the most memory live at once and within 1% of the
    /// device's memory (once that peak has settled, or a sixteenth of the room the device leaves
    /// above it, if more). Where the device leaves little room above the most memory live at
    /// once, a request takes a free block larger than the chunk it would get (its size class)
    /// only while what blocks leave unused stays within half that room; past it, it gets a chunk
    /// of its own (the free block is given back when the device needs the room). Default 75.
    pub large_fit_percent: u32,
    /// A free block of a medium or large chunk is split only when what is left over would be at
    /// least this many bytes; otherwise the whole block is handed out. Default 512 bytes (always
    /// split).
    pub min_large_split: usize,
    /// How far reserved memory may grow above the most memory live at once, in percent, before
    /// the pool releases free memory instead of caching more: when a new chunk would take it
    /// past that, the pool first gives the free blocks cached per stream back to its shared
    /// layer (where they merge), releases whole free chunks whose frees the GPU has completed,
    /// and grows by exactly the request. `None` caches everything (up to `release_threshold`).
    /// Near the device's capacity the device's free memory is the bound instead. Live memory
    /// counts the blocks handed out, not the tails of their chunks, so this bounds what the
    /// driver's 2 MiB pages and the size classes add as well. Default `Some(20)`.
    pub headroom_percent: Option<u32>,
    /// Where the device has virtual memory management (`cuMemCreate`, `cuMemMap`), grow in
    /// *segments* instead of chunks: one address range of the device's size per group of requests
    /// (small ones, and the rest), reserved once, into which memory is mapped at the top as the
    /// pool grows, and from which free memory is unmapped as it shrinks (between live blocks too:
    /// a later growth maps the hole again where it needs it). Freed blocks then merge
    /// across what each growth added, so requests whose sizes keep changing reuse memory instead
    /// of growing the pool: reserved memory stays close to live memory, and a warm workload makes
    /// no driver call. The chunk settings above then apply only where the device has no virtual
    /// memory management, or where the driver refuses the pool's first address range or first
    /// mapping (it then grows in chunks for good).
    ///
    /// Memory in segments cannot be shared with legacy IPC (`cuIpcGetMemHandle` takes only
    /// `cuMemAlloc` memory): [`DeviceBuffer::ipc_handle`](crate::memory::DeviceBuffer::ipc_handle)
    /// refuses it. A pool for buffers shared that way sets this to `false`. Default `true`.
    pub expandable: bool,
    /// In chunks, near the device's capacity (the device would be left with less than a tenth
    /// of what the pool holds), grow by *consolidating* instead of by exactly each request: give
    /// back every free chunk whose frees the GPU has completed, and take what the device has left
    /// (less what the driver keeps back) in one chunk, a *reservoir*, which then serves requests
    /// of every size by best fit, split and merged like a heap, before the pool grows again.
    ///
    /// Growing exactly lets the driver put memory back together: a chunk goes back whole when its
    /// block is freed, and the next request gets a chunk of its own size. But a workload whose
    /// sizes change from step to step then trades chunks with the driver at every step, and near
    /// capacity each `cuMemFree` and `cuMemAlloc` of a large chunk costs 0.1 to 2 ms on an H200.
    /// A reservoir places those requests in memory the pool already holds, with no driver call.
    /// The price is fit: a block live in a reservoir keeps all of it from the driver, and a heap
    /// that the frees leave in pieces may have no piece large enough for a request that exact
    /// growth would have served. In simulation, on 60 synthetic training loops whose activations
    /// change size every step, reservoirs made 4 to 8 times fewer driver allocations, and ran out
    /// of memory in 1 of them with 1.10 times their peak of live memory (exact growth: none), in
    /// 28 with 1.05 times (exact growth: 5), and in none with 1.20 times. On three of the five
    /// traces in `traces/` (the other two ask for more than an eighth of memory, below) they
    /// made 1.3 to 20 times fewer (cold) and none at all replaying warm, against 9 to 949, and
    /// fitted in as little memory or less. Turn it on where there is some headroom (a fifth, say)
    /// and the driver calls near capacity are what costs.
    ///
    /// Even when on, a workload that has asked for an eighth of the memory the pool can reach in
    /// one request takes no reservoir: such requests rely on the driver's reassembly. Near
    /// capacity the pool then holds all the memory it could take, as a cache, until
    /// [`trim`](crate::memory::MemoryResource::trim) or the release rules give back a reservoir
    /// with nothing live in it; other allocators of the process find the device full sooner.
    /// Default `false`: growth near capacity is exact.
    pub reservoir: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            release_threshold: usize::MAX,
            small_limit: MIB,
            small_chunk: 2 * MIB,
            medium_limit: 8 * MIB,
            medium_chunk: 32 * MIB,
            large_granule: 2 * MIB,
            min_large_split: GRANULE,
            large_fit_percent: 75,
            large_classes_per_octave: 8,
            headroom_percent: Some(DEFAULT_HEADROOM_PERCENT),
            expandable: true,
            reservoir: false,
        }
    }
}

impl PoolConfig {
    /// The kind of a request of `size` rounded bytes where the pool grows in chunks: small up to
    /// `small_limit`, medium up to `medium_limit`, large above.
    pub(crate) fn kind_in_chunks(&self, size: usize) -> Kind {
        if size <= self.small_limit {
            Kind::Small
        } else if size <= self.medium_limit {
            Kind::Medium
        } else {
            Kind::Large
        }
    }

    /// Rounds every size to the granule and makes the limits consistent.
    pub(crate) fn normalized(mut self) -> Self {
        let up = |v: usize| round_up(v.max(GRANULE), GRANULE).unwrap_or(MAX_REQUEST).min(MAX_REQUEST);
        self.small_limit = up(self.small_limit);
        self.small_chunk = up(self.small_chunk).max(self.small_limit);
        self.medium_limit = up(self.medium_limit).max(self.small_limit);
        self.medium_chunk = up(self.medium_chunk).max(self.medium_limit);
        self.large_granule = up(self.large_granule);
        self.min_large_split = up(self.min_large_split);
        self
    }
}

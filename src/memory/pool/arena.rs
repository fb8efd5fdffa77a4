//! The arena: the pool's shared layer. It holds every chunk and every free block that is not
//! cached by a stream, finds the best fit across chunks and streams, orders reuse across streams
//! with events, decides when to grow and by how much, and which chunks to give back.
//!
//! It is plain data behind one lock (`&mut self`), and never blocks: what needs a host wait or a
//! `cuMemFree` is handed back to the caller to do with the lock released.

use super::backend::{Backend, DRIVER_SPARE, MAX_DRIVER_SPARE, Segments};
use super::blocks::{Block, Chunk, KINDS, Kind, NIL, State, best_fit};
use super::config::{DEFAULT_HEADROOM_PERCENT, PoolConfig};
use super::events::StreamState;
use super::slots::Slots;
use super::{FastMap, GRANULE, Handout, Live, round_up};
use std::time::{Duration, Instant};

/// The arena's counters (the per-stream ones live in the caches).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ArenaStats {
    pub(crate) reserved: usize,
    pub(crate) peak_reserved: usize,
    /// Bytes of blocks outside the arena (live, or cached by a stream).
    pub(crate) out_bytes: usize,
    /// The most block bytes live at once, as seen when growing (the streams' caches are given back
    /// first, so that what is out then is live).
    pub(crate) peak_live: usize,
    /// The highest in-use sum seen when the caches were visited.
    pub(crate) peak_in_use: usize,
    /// Bytes of the blocks out of the arena beyond the requests they were handed out for.
    pub(crate) slack: usize,
    /// Bytes of the free tails of large chunks ([`Kind::Tail`]).
    pub(crate) free_tails: usize,
    pub(crate) chunks: usize,
    pub(crate) driver_allocs: u64,
    pub(crate) driver_alloc_bytes: u64,
    pub(crate) driver_frees: u64,
    pub(crate) cross_stream_reuses: u64,
    pub(crate) cache_flushes: u64,
    pub(crate) events_created: u64,
    pub(crate) event_records: u64,
    pub(crate) event_waits: u64,
    pub(crate) event_syncs: u64,
    pub(crate) event_queries: u64,
    pub(crate) oom_recoveries: u64,
    /// Growths made exactly because the device's memory ran short.
    pub(crate) tight_growths: u64,
    /// Reservoirs taken near capacity ([`Arena::grow_reservoir`]).
    pub(crate) reservoirs: u64,
    /// Requests served past the headroom by a free tail, or (large ones) by a free block they fill
    /// to less than `large_fit_percent`, instead of releasing memory to grow
    /// ([`Arena::reuse_past_headroom`], [`Arena::tail_past_headroom`]).
    pub(crate) loose_fits: u64,
    /// Allocations and cache hits of streams that were forgotten (their caches are gone).
    pub(crate) retired_allocations: u64,
    pub(crate) retired_hits: u64,
}

/// A chunk taken off the free lists, to be freed (`Backend::free_chunk`) with no lock held, then
/// reported with [`Arena::finish_release`]; or a segment's mapping cut off its top, to be
/// unmapped (`Backend::unmap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Detached {
    pub(crate) chunk: u32,
    pub(crate) ptr: u64,
    pub(crate) size: usize,
    /// The mapping's handle, for a segment's mapping.
    pub(crate) handle: Option<u64>,
}

/// How long a report of the device's free memory serves [`Arena::device_free`] (with the pool's
/// own growth and release since counted) before the driver is asked again.
const FREE_MEMORY_FRESH: Duration = Duration::from_millis(1);

/// A report of the device's free memory: what it said, what the pool held then, and when.
#[derive(Debug, Clone, Copy)]
struct FreeSeen {
    reported: usize,
    reserved: usize,
    at: Instant,
}

/// What [`Arena::grow`] did.
pub(crate) enum Grow {
    /// A new chunk; its first block is handed out.
    Block(Handout),
    /// Chunks were taken out to stay within the headroom: free them, then call `grow` again.
    Release(Vec<Detached>),
    /// The driver is out of memory, even for exactly the request.
    OutOfMemory,
    /// The segment to grow is being unmapped by another thread (with no lock held): call `grow`
    /// again once it is done.
    Busy,
    /// Out of memory after part of the request was mapped: unmap these, then report out of
    /// memory.
    Refused(Vec<Detached>),
}

/// The shared layer of a stream-ordered pool. See the module documentation.
pub(crate) struct Arena<B: Backend> {
    pub(crate) config: PoolConfig,
    pub(crate) blocks: Slots<Block>,
    pub(crate) chunks: Slots<Chunk>,
    pub(crate) streams: Slots<StreamState<B>>,
    /// Streams not forgotten, to their state's slot.
    pub(crate) stream_slots: FastMap<B::Stream, u32>,
    next_epoch: u64,
    /// Streams whose forgetting failed, flagged `retired` (see [`Arena::retry_forgets`]).
    pub(crate) unforgotten: usize,
    /// Live allocations whose stream was forgotten before they were freed.
    pub(crate) orphans: FastMap<u64, Live>,
    /// Blocks reserved for graphs (see [`super::graph`]).
    pub(crate) graphs: super::graph::GraphBlocks,
    pub(crate) stats: ArenaStats,
    /// What the pool leaves of the device's reported free memory for the driver: [`DRIVER_SPARE`]
    /// at first, raised by [`Arena::learn_spare`].
    pub(crate) driver_spare: usize,
    /// The device's free memory as last reported, for [`Arena::device_free`].
    free_seen: Option<FreeSeen>,
    /// How long such a report serves ([`FREE_MEMORY_FRESH`]; tests change it).
    pub(crate) free_fresh: Duration,
    /// Set where the pool grows in segments ([`super::segment`]) instead of chunks.
    pub(crate) segments: Option<Segments>,
    /// Each kind's segment (`NIL`: none yet).
    pub(crate) segment_of: [u32; KINDS],
    /// Free chunks were given back to take a reservoir ([`Arena::grow_reservoir`]): the next
    /// growth takes it.
    consolidating: bool,
    /// The largest growth asked for (exact bytes): no reservoir is taken once a request has
    /// been an eighth of what the pool can reach ([`Arena::grow_reservoir`]).
    largest_growth: usize,
    /// The rounded sizes of the last [`RECENT_GROWTHS`] large growths in chunks while memory was
    /// not tight (a ring, next slot at `recent_next`): a size among them recurs
    /// ([`Arena::packed_large_chunk`]).
    recent_large: [usize; RECENT_GROWTHS],
    recent_next: usize,
    /// Blocks the arena has handed out ([`Arena::handout`]), their count when the most memory
    /// live at once ([`ArenaStats::peak_live`]) last began to settle, and that peak: see
    /// [`Arena::peak_settled`].
    handouts: u64,
    handouts_at_peak: u64,
    settling_peak: usize,
}

/// How many of the last large growths tell whether a large request's size recurs.
const RECENT_GROWTHS: usize = 8;

/// How many blocks the arena hands out, at least, with the most memory live at once staying where
/// it is, before that peak counts as settled ([`Arena::peak_settled`]).
const PEAK_SETTLES_AFTER: u64 = 1000;

/// Once the most memory live at once has settled, a rise by at most this share of it (1/64,
/// 1.6%) leaves it settled ([`Arena::peak_settled`]).
const PEAK_SETTLE_MARGIN: usize = 64;

/// How many free blocks of packed chunks [`Arena::take_packed`] looks at.
const PACKED_SCAN: usize = 16;

/// Whether a growth of `bytes` would leave the device, with `free` usable bytes, less than a
/// tenth of what a pool holding `reserved` bytes then holds ([`Arena::runs_short`]).
fn short(free: usize, reserved: usize, bytes: usize) -> bool {
    free < bytes.saturating_add(reserved.saturating_add(bytes) / 10)
}

impl<B: Backend> Arena<B> {
    pub(crate) fn new(config: PoolConfig) -> Self {
        Self {
            config: config.normalized(),
            blocks: Slots::default(),
            chunks: Slots::default(),
            streams: Slots::default(),
            stream_slots: FastMap::default(),
            unforgotten: 0,
            next_epoch: 1,
            orphans: FastMap::default(),
            graphs: super::graph::GraphBlocks::default(),
            stats: ArenaStats::default(),
            driver_spare: DRIVER_SPARE,
            free_seen: None,
            free_fresh: FREE_MEMORY_FRESH,
            segments: None,
            segment_of: [NIL; KINDS],
            consolidating: false,
            largest_growth: 0,
            recent_large: [0; RECENT_GROWTHS],
            recent_next: 0,
            handouts: 0,
            handouts_at_peak: 0,
            settling_peak: 0,
        }
    }

    /// Makes the arena grow in segments where the backend offers them (`segments`) and the
    /// configuration allows them ([`PoolConfig::expandable`]). Call before the first allocation.
    pub(crate) fn use_segments(&mut self, segments: Option<Segments>) {
        debug_assert!(self.chunks.iter().next().is_none(), "the arena's growth changes before it grows");
        self.segments = segments.filter(|s| self.config.expandable && s.granularity > 0 && s.reserve > 0);
    }

    /// The slot of `stream`'s state, created if new.
    pub(crate) fn register(&mut self, stream: &B::Stream) -> u32 {
        if let Some(&s) = self.stream_slots.get(stream) {
            // A stream the arena could not forget has a user again.
            self.unretire(s);
            return s;
        }
        let epoch = self.new_epoch();
        let s = self.streams.insert(StreamState::new(Some(stream.clone()), epoch));
        self.stream_slots.insert(stream.clone(), s);
        s
    }

    /// A cache for `stream`, registered ([`Arena::register`]) and counted among the stream's
    /// caches until it retires ([`Arena::retire_cache`]).
    pub(crate) fn new_cache(&mut self, stream: &B::Stream) -> super::cache::Cache {
        let s = self.register(stream);
        self.streams[s].caches += 1;
        super::cache::Cache::new(s, self.config.small_limit)
    }

    /// A number that tells a stream state from any earlier one in the same slot.
    pub(crate) fn new_epoch(&mut self) -> u64 {
        self.next_epoch += 1;
        self.next_epoch
    }

    /// The streams the arena knows and has not forgotten.
    pub(crate) fn stream_keys(&self) -> Vec<B::Stream> {
        self.stream_slots.keys().cloned().collect()
    }

    /// The kind of a request of `size` rounded bytes: as in chunks ([`PoolConfig::kind_in_chunks`]),
    /// but in segments medium requests share the large requests' segment.
    pub(crate) fn kind_for(&self, size: usize) -> Kind {
        match self.config.kind_in_chunks(size) {
            Kind::Medium if self.segments.is_some() => Kind::Large,
            kind => kind,
        }
    }

    /// A free block of at least `size` bytes for stream `s`, out of the arena: the best fit among
    /// the blocks freed on `s`, else the best fit among the other streams' (a GPU-side wait on
    /// their event, or none if the host saw their frees complete). `None` if no free block is
    /// large enough. A large request that only a block beyond its size class holds, and a medium
    /// request past a settled peak's headroom, look at the device's free memory first
    /// ([`Arena::device_free`]: a driver call where the last report is no longer fresh); other
    /// takes make no backend call but the wait.
    pub(crate) fn take(&mut self, b: &B, s: u32, size: usize) -> Result<Option<Handout>, B::Error> {
        let kind = self.kind_for(size);
        let largest = self.largest_fit(kind, size, self.config.large_fit_percent);
        // In chunks, a large request takes a free block up to the size of the chunk it would get
        // by growing (its size class) freely; a larger one only while what blocks leave unused
        // stays within the room the device leaves above the most memory live at once.
        let class = match (kind, &self.segments) {
            (Kind::Large, None) => self.chunk_sizes(kind, size).map_or(largest, |(chunk, _)| chunk.min(largest)),
            _ => largest,
        };
        // A packed chunk grown for requests of this size first (in chunks only; no backend call).
        let mut blk = if kind == Kind::Large && self.segments.is_none() { self.take_packed(s, size) } else { None };
        if blk.is_none() {
            blk = self.take_kind(b, s, kind, size, class)?;
        }
        if blk.is_none() && class < largest {
            let loose = size.saturating_add(self.room_to_pin(b));
            if loose > class {
                blk = self.take_kind(b, s, kind, size, largest.min(loose))?;
            }
        }
        if blk.is_none() && kind == Kind::Medium {
            blk = self.tail_past_headroom(b, s, size)?;
        }
        Ok(blk.map(|blk| self.handout(blk, size)))
    }

    /// For a medium request of `size` rounded bytes that no free medium block holds: the
    /// best-fitting free tail of a large chunk (memory that the chunk's live large block keeps
    /// from the driver anyway), taken off its list, where growing would pass the headroom, memory
    /// does not run short, and the most memory live at once has settled ([`Arena::peak_settled`]).
    /// Elsewhere a tail is the last resort ([`Arena::take_last_resort`]): a block in it keeps its
    /// chunk from going back to the driver once the large block is freed, which near capacity, or
    /// while the workload still rises, may be what a later request needs. Past a settled peak's
    /// headroom the pool would instead give a free chunk back and grow a medium one: a warm pass
    /// of mixed_images (simulated without a budget) traded medium chunks of 2-8 MiB with the
    /// driver so, 19 `cuMemAlloc` calls on an H200's 139 GiB and 57 on 24 GiB; with this, 1 and
    /// 37, every budgeted fit of the sweeps as before. Looked at before the streams' caches are
    /// given back, so that the next request of the size still finds its block cached. (Letting
    /// such a request also take a whole free large block, in [`Arena::reuse_past_headroom`], cut
    /// decode_kvcache's warm calls from 47 to 20 but raised its reserved memory from 1.19x its
    /// peak of live memory to 1.23x, and cost a third of its warm cache hits.)
    fn tail_past_headroom(&mut self, b: &B, s: u32, size: usize) -> Result<Option<u32>, B::Error> {
        // The peak counts this request as growth would ([`Arena::note_live`]): one that raises
        // it past the settled margin grows, and the growth notes the new peak.
        let live = self.stats.out_bytes.saturating_add(size);
        if self.segments.is_some() || !self.stays_settled_with(live) {
            return Ok(None);
        }
        let Some((chunk, exact)) = self.chunk_sizes(Kind::Medium, size) else { return Ok(None) };
        let (_, soft) = self.growth_limits(self.stats.peak_live.max(live), true, false, None);
        if self.stats.reserved.saturating_add(exact) <= soft {
            return Ok(None);
        }
        // Near capacity as growth tells it (for the chunk it would first try): the tail stays
        // the last resort there.
        let free = self.device_free(b).map(|f| self.usable(f));
        if free.is_some_and(|free| short(free, self.stats.reserved, chunk)) {
            return Ok(None);
        }
        let blk = self.take_kind_within(b, s, Kind::Tail, size, usize::MAX)?;
        if blk.is_some() {
            self.stats.loose_fits += 1;
        }
        Ok(blk)
    }

    /// The best-fitting free block, freed on stream `s`, of a packed chunk grown for requests of
    /// `size` rounded bytes ([`Arena::packed_large_chunk`]), taken off its list. Only requests of
    /// that size take its room, so that it holds as many of them as it was grown for: with any
    /// large request allowed in, stacked beam search placed its 12.5 MiB weights in the room of
    /// chunks grown for its 9.4 MiB ones, and left as much of the last pages unused as chunks of
    /// their own did. Of the free blocks that hold the request, the [`PACKED_SCAN`] smallest are
    /// looked at (those of chunks packed for other sizes may come first; few packed chunks have
    /// room at once). Blocks freed on other streams are not: they serve this stream as its last
    /// resort.
    fn take_packed(&mut self, s: u32, size: usize) -> Option<u32> {
        let list = &self.streams[s].free[Kind::Packed as usize];
        let blk = list
            .range((size, 0)..)
            .take(PACKED_SCAN)
            .map(|(_, &blk)| blk)
            .find(|&blk| self.chunks[self.blocks[blk].chunk].unit == size)?;
        self.unlist(blk);
        Some(blk)
    }

    /// How many more bytes blocks may leave unused in their chunks (their slack and the free
    /// tails) when a large request takes a free block larger than its size class: half of what
    /// the device's memory leaves above the most memory live at once (the pool's and the device's
    /// usable free memory), less what they leave already. Unbounded where the backend does not
    /// know its free memory, and in effect wherever the device is much larger than the workload.
    ///
    /// A block taken so stays out, with its slack pinned, until its request is freed: were that
    /// to outlast the next peak, the peak would need that slack on top. A warm replay of a KV
    /// cache decoder, whose per-layer tensors of 27.3 MiB took the 32 MiB chunks the first replay
    /// left, pinned 113 MiB that way and ran out of memory under 1.10x its peak of live memory;
    /// the first replay, which had no such chunks to take, fitted.
    fn room_to_pin(&mut self, b: &B) -> usize {
        let free = self.device_free(b).map(|f| self.usable(f));
        self.unused_within_room(free, 2)
    }

    /// The last resort before out of memory for a request of `size` rounded bytes on stream `s`,
    /// once every free chunk has gone back to the driver: the best-fitting free tail of a large
    /// chunk, then a free block of the request's own kind that holds it however little of it the
    /// request fills, then one of another kind (what is free there stays because a live block in
    /// its chunk pins it). Never earlier, since a block there keeps its whole chunk from going back
    /// to the driver, and a request of another size class from reusing it. Without the other
    /// kinds, a heavy-tailed trace replayed warm in chunks in 1.10x its peak of live memory ran
    /// out of memory with 18 MiB free in a medium chunk for a request of 8.6 MiB, above the
    /// medium class.
    pub(crate) fn take_last_resort(&mut self, b: &B, s: u32, size: usize) -> Result<Option<Handout>, B::Error> {
        let own = self.kind_for(size);
        // Shared chunks (pinned by their other blocks already) before a large chunk of its own.
        let others =
            [Kind::Medium, Kind::Reservoir, Kind::Packed, Kind::Small, Kind::Large].into_iter().filter(|&k| k != own);
        for kind in [Kind::Tail, own].into_iter().chain(others) {
            if let Some(blk) = self.take_kind(b, s, kind, size, usize::MAX)? {
                return Ok(Some(self.handout(blk, size)));
            }
        }
        Ok(None)
    }

    /// The largest free block of `kind` that may serve a request of `size` bytes: for a large
    /// request, one it fills to at least `percent`; any for the other kinds.
    pub(crate) fn largest_fit(&self, kind: Kind, size: usize, percent: u32) -> usize {
        match (kind, percent.min(100)) {
            // A segment's blocks have no chunk of their own to pin: best fit, always split.
            _ if self.segments.is_some() => usize::MAX,
            (Kind::Large, percent @ 1..) => {
                usize::try_from(size as u128 * 100 / u128::from(percent)).unwrap_or(usize::MAX)
            }
            _ => usize::MAX,
        }
    }

    /// The best-fitting free block of `kind` with `size` to `largest` bytes for stream `s`, taken
    /// off its list: `s`'s own first, then other streams' (after an event). The graphs' host-side
    /// state, which has no stream to wait with, takes only its own.
    fn take_kind(&mut self, b: &B, s: u32, kind: Kind, size: usize, largest: usize) -> Result<Option<u32>, B::Error> {
        if let Some(blk) = self.take_free(s, kind, size, largest) {
            return Ok(Some(blk));
        }
        if self.streams[s].key.is_none() {
            return Ok(None);
        }
        let blk = self.borrow_from_others(b, s, kind, size, largest)?;
        if blk.is_some() {
            self.stats.cross_stream_reuses += 1;
        }
        Ok(blk)
    }

    /// As [`Arena::take_kind`], but only a block of `kind` and at most `largest` bytes: a block
    /// borrowed from another stream may merge there with free neighbours into a block of another
    /// kind or past the bound (a tail into its free large block), which `take_kind` hands out
    /// whole. A rule that takes memory only of some kind and size (past the headroom) leaves
    /// such a block listed, now on stream `s`, and takes nothing.
    fn take_kind_within(
        &mut self,
        b: &B,
        s: u32,
        kind: Kind,
        size: usize,
        largest: usize,
    ) -> Result<Option<u32>, B::Error> {
        let Some(blk) = self.take_kind(b, s, kind, size, largest)? else { return Ok(None) };
        if self.blocks[blk].kind == kind && self.blocks[blk].size <= largest {
            return Ok(Some(blk));
        }
        // Only a borrowed block merges so (`take_free` keeps to the kind and the bound): moved,
        // but not reused.
        self.list(blk);
        self.stats.cross_stream_reuses -= 1;
        Ok(None)
    }

    pub(crate) fn handout(&mut self, blk: u32, size: usize) -> Handout {
        self.handouts += 1;
        let (ptr, size) = self.hand_out(blk, size);
        Handout { ptr, blk, size }
    }

    /// Finds the best-fitting free block among the other streams and makes it (and, after a wait,
    /// every other block the wait covers) stream `a`'s. Returns the block, taken off `a`'s list.
    fn borrow_from_others(
        &mut self,
        b: &B,
        a: u32,
        kind: Kind,
        size: usize,
        largest: usize,
    ) -> Result<Option<u32>, B::Error> {
        // A stream that captures a graph can neither record nor wait (either would be captured):
        // only host-safe blocks can move to or from it.
        let capturing = |st: &StreamState<B>| st.key.as_ref().is_some_and(|k| b.is_capturing(k));
        let a_capturing = capturing(&self.streams[a]);
        let mut best: Option<((usize, u64), u32, u32)> = None;
        for (i, st) in self.streams.iter() {
            if i == a {
                continue;
            }
            let list = &st.free[kind as usize];
            if let Some(key) = best_fit(list, size, largest)
                && best.is_none_or(|(k, _, _)| key < k)
            {
                let blk = list[&key];
                let host_safe = matches!(self.blocks[blk].state, State::Free { seq, .. } if seq <= st.completed);
                if host_safe || !(a_capturing || capturing(st)) {
                    best = Some((key, blk, i));
                }
            }
        }
        let Some((_, blk, src)) = best else { return Ok(None) };
        let State::Free { seq, .. } = self.blocks[blk].state else { unreachable!("a free list holds a used block") };
        let (chunk, ptr) = (self.blocks[blk].chunk, self.blocks[blk].ptr);
        if self.host_safe(src, seq) {
            // Ordered before everything issued from now on: no wait needed; move just this block.
            self.unlist(blk);
            self.file_free(blk, a, 0);
        } else {
            if seq > self.streams[src].recorded {
                self.record(b, src)?;
            }
            self.wait_on(b, a, src)?;
            self.move_covered(src, a);
        }
        self.maybe_reap(src);
        if let Some(taken) = self.take_free(a, kind, size, largest) {
            return Ok(Some(taken));
        }
        // Moved, the block merged with free neighbours: past `largest` (a large block with its
        // tail), or into another kind (a tail into its large block). The block that now holds it
        // is large enough, and `a`'s or host-safe.
        let holder = self.free_block_at(chunk, ptr);
        self.unlist(holder);
        Ok(Some(holder))
    }

    /// The block of chunk `c` that holds address `ptr`, which must be in a free block.
    pub(crate) fn free_block_at(&self, c: u32, ptr: u64) -> u32 {
        let cur = self.block_at(c, ptr);
        debug_assert!(matches!(self.blocks[cur].state, State::Free { .. }), "the block at {ptr:#x} is not free");
        cur
    }

    /// The block of chunk `c` that holds address `ptr`.
    pub(crate) fn block_at(&self, c: u32, ptr: u64) -> u32 {
        let mut cur = self.chunks[c].first;
        while self.blocks[cur].ptr + self.blocks[cur].size as u64 <= ptr {
            cur = self.blocks[cur].next;
        }
        cur
    }

    /// Moves every free block of `src` covered by its last record to stream `a`, which has just
    /// waited on that record. In `a`'s order the blocks become free now (after the wait).
    fn move_covered(&mut self, src: u32, a: u32) {
        let recorded = self.streams[src].recorded;
        let moved: Vec<u32> = self.streams[src]
            .free
            .iter()
            .flat_map(|list| list.values().copied())
            .filter(|&blk| matches!(self.blocks[blk].state, State::Free { seq, .. } if seq <= recorded))
            .collect();
        self.streams[a].seq += 1;
        let new_seq = self.streams[a].seq;
        let mut chunks = Vec::with_capacity(moved.len());
        for &blk in &moved {
            let State::Free { stream, seq } = self.blocks[blk].state else { unreachable!() };
            let seq = if self.host_safe(stream, seq) { 0 } else { new_seq };
            self.unlist(blk);
            self.blocks[blk].state = State::Free { stream: a, seq };
            self.list(blk);
            chunks.push(self.blocks[blk].chunk);
        }
        chunks.sort_unstable();
        chunks.dedup();
        for c in chunks {
            self.coalesce_chunk(c);
        }
    }

    /// Gives blocks cached by stream `s` (freed on it, in its order) back to the arena, where
    /// they merge with their free neighbours.
    pub(crate) fn give_back(&mut self, s: u32, blocks: &[(u64, u32)]) {
        if blocks.is_empty() {
            return;
        }
        self.streams[s].seq += 1;
        let seq = self.streams[s].seq;
        for &(ptr, blk) in blocks {
            let block = &self.blocks[blk];
            debug_assert!(block.ptr == ptr && block.state == State::Out, "giving back a block that is not out");
            self.give_back_at(blk, s, seq);
        }
    }

    /// Files block `blk` (out of the arena) as freed on stream state `s` at `seq`.
    pub(crate) fn give_back_at(&mut self, blk: u32, s: u32, seq: u64) {
        let (size, chunk) = (self.blocks[blk].size, self.blocks[blk].chunk);
        self.chunks[chunk].out -= 1;
        self.stats.out_bytes -= size;
        self.file_free(blk, s, seq);
    }

    /// The chunk to allocate for a request of `size` rounded bytes, and the smallest that would do.
    fn chunk_sizes(&self, kind: Kind, size: usize) -> Option<(usize, usize)> {
        let c = &self.config;
        Some(match kind {
            Kind::Small => (c.small_chunk, c.small_chunk),
            Kind::Medium => (c.medium_chunk, round_up(size, c.large_granule)?),
            // (No request is of kind `Tail`: tails are the rests of large chunks.)
            Kind::Large | Kind::Tail | Kind::Reservoir | Kind::Packed => {
                let exact = round_up(size, c.large_granule)?;
                (round_up(size_class(size, c.large_classes_per_octave), c.large_granule)?.max(exact), exact)
            }
        })
    }

    /// Grows the arena for a request of `size` rounded bytes on stream `s` and hands out the new
    /// chunk's first block. The caller gives the streams' caches back first, so that what is out
    /// of the arena is live. Growing past `(1 + headroom) × the most live at once` first takes
    /// out whole free chunks whose frees the GPU has completed (asked without blocking), and
    /// grows by exactly the request.
    /// With `headroom` false the check is skipped (after rounds that could not take enough out);
    /// with `may_release` false nothing is taken out at all (during a stream capture, where
    /// `cuMemFree` is not allowed).
    ///
    /// The request counts towards the most live at once ([`ArenaStats::peak_live`]), and towards
    /// the largest growth asked for (which decides whether reservoirs are taken), only if it is
    /// handed out: one the driver refuses (or that first waits for a release) leaves both as they
    /// were, or a single refused request too large for the device would lift the headroom bound,
    /// and turn reservoirs off, for good.
    pub(crate) fn grow(
        &mut self,
        b: &B,
        s: u32,
        size: usize,
        headroom: bool,
        may_release: bool,
    ) -> Result<Grow, super::PoolError<B::Error>> {
        let (peak, at_peak, settling, largest) =
            (self.stats.peak_live, self.handouts_at_peak, self.settling_peak, self.largest_growth);
        let grown = if self.segments.is_some() {
            let kind = self.kind_for(size);
            self.grow_segment(b, s, kind, size, headroom, may_release)
        } else {
            self.grow_chunk(b, s, size, headroom, may_release)
        };
        if !matches!(grown, Ok(Grow::Block(_))) {
            (self.stats.peak_live, self.handouts_at_peak, self.settling_peak, self.largest_growth) =
                (peak, at_peak, settling, largest);
        }
        grown
    }

    /// [`Arena::grow`] in chunks.
    fn grow_chunk(
        &mut self,
        b: &B,
        s: u32,
        size: usize,
        headroom: bool,
        may_release: bool,
    ) -> Result<Grow, super::PoolError<B::Error>> {
        let kind = self.kind_for(size);
        let (mut chunk, exact) = self.chunk_sizes(kind, size).ok_or(super::PoolError::TooLarge { requested: size })?;
        let peak = self.note_live(size);
        self.largest_growth = self.largest_growth.max(exact);
        // What a reservoir holds serves before the device is asked for more.
        if self.config.reservoir
            && let Some(blk) = self.take_kind(b, s, Kind::Reservoir, size, usize::MAX)?
        {
            return Ok(Grow::Block(self.handout(blk, size)));
        }
        // Memory runs short when the device would be left with less than a tenth of what the pool
        // then holds: consolidate into a reservoir, or grow by exactly the request, releasing
        // whatever free chunk can go first.
        let before = self.device_free(b);
        let free = before.map(|f| self.usable(f));
        // (A reservoir whose chunks were just given back is taken even though their memory makes
        // the device look roomy again.)
        let consolidating = std::mem::take(&mut self.consolidating);
        let tight = self.runs_short(free, chunk) || consolidating;
        if tight {
            if self.config.reservoir
                && let Some(grown) = self.grow_reservoir(b, s, size, exact, before, may_release)?
            {
                return Ok(grown);
            }
            chunk = exact;
        }
        // Rounding a large chunk up to a size class leaves its rest unused while its block is out:
        // keep what all out blocks leave so below 0.25% of the device's memory, so that a
        // device filled with live buffers is filled as tightly as the driver fills it.
        if kind == Kind::Large && chunk - size > self.may_leave_unused(free) {
            chunk = exact;
        }
        let (_, limit) = self.growth_limits(peak, headroom, tight, free);
        if self.stats.reserved.saturating_add(chunk) > limit {
            // A large chunk rounded up to its size class would pass the headroom (or, with
            // `headroom` off, the release threshold): it takes what the bound leaves, if that is
            // more than the request's pages, so that the same buffer a step later, a little
            // larger, still fits it. (serving_batching's logits, 780-886 MiB, traded a chunk with
            // the driver at most steps that grew them: its replay without a budget made 255
            // driver allocations cold and 124 warm; now 197 and 82.) Where even the request's
            // pages pass the bound, they are what is grown, after the reuse and release below;
            // near capacity, exactly the request's pages.
            let room =
                limit.saturating_sub(self.stats.reserved) / self.config.large_granule * self.config.large_granule;
            chunk = if kind == Kind::Large && !tight { room.min(chunk).max(exact) } else { exact };
        }
        // A medium chunk cut down to the request (near the headroom or the device's capacity)
        // still takes a few requests of its size where the bound allows.
        if kind == Kind::Medium && chunk == exact {
            let packed = self.packed_medium_chunk(size);
            if self.stats.reserved.saturating_add(packed) <= limit {
                chunk = packed;
            }
        }
        if self.stats.reserved.saturating_add(exact) > limit {
            if kind == Kind::Large
                && !tight
                && let Some(handout) = self.reuse_past_headroom(b, s, size, free)?
            {
                return Ok(Grow::Block(handout));
            }
            if may_release {
                let target = limit.saturating_sub(exact);
                let detached = self.detach_free_chunks(b, target, super::release::Completion::Poll);
                if !detached.is_empty() {
                    return Ok(Grow::Release(detached));
                }
            }
        }
        // A large request whose size recurs gets a chunk packed for a few requests of its size,
        // where that is within the headroom (growths that skip it, for a graph or after rounds of
        // release, never pack) and memory does not run short for it, and where what the chunk
        // keeps beyond the request is at most a quarter of the device's free memory. (Without
        // that last rule, a synthetic KV decoder's chunk packed for its last layers kept room
        // that no request then took, and its 76 MiB scratch buffer found no room beside it: its
        // ten replays in 1.10x its peak plus 0 to 16 MiB ran out of memory, seven of which fitted
        // without packing.)
        let mut chunk_kind = kind;
        if kind == Kind::Large && headroom && !tight && self.recent_large.contains(&size) {
            let packed = self.packed_large_chunk(size);
            let room = free.is_none_or(|free| {
                (packed - size).saturating_mul(4) <= free && !short(free, self.stats.reserved, packed)
            });
            if packed > exact && room && self.stats.reserved.saturating_add(packed) <= limit {
                (chunk, chunk_kind) = (packed, Kind::Packed);
            }
        }
        for bytes in [chunk, exact] {
            let grown = if bytes == chunk { chunk_kind } else { kind };
            if let Some(blk) = self.new_chunk(b, s, grown, bytes, before)? {
                if grown == Kind::Packed {
                    let c = self.blocks[blk].chunk;
                    self.chunks[c].unit = size;
                }
                if kind == Kind::Large && !tight {
                    self.note_large_growth(size);
                }
                return Ok(Grow::Block(self.handout(blk, size)));
            }
            if bytes == exact {
                break;
            }
        }
        Ok(Grow::OutOfMemory)
    }

    /// The chunk for a medium request of `size` rounded bytes where a whole medium chunk would
    /// pass the pool's bound (its headroom, or near the device's capacity): room for as few
    /// requests of its size as leave at most an eighth of the chunk unused, in whole pages; else
    /// exactly the request. Grown by exactly the request, a chunk rarely holds the next one: a
    /// layer's 2.4 MiB KV tensor takes a 4 MiB chunk and leaves 1.6 MiB that the next layer's
    /// cannot use, while a chunk of 8 MiB holds three. Tensors of one shape often come one after
    /// another (a model's layers), and what they leave serves any medium request that fits. At
    /// most three exact chunks' worth (and a medium chunk), so that where no other request of the
    /// size comes the chunk leaves little more unused than exact growth would: with up to a medium
    /// chunk, a 3.44 MiB tensor took 14 MiB, and decode_kvcache no longer fit in 1.12x its peak.
    /// (Replayed in 1.10 times their peak of live memory, 11 of 60 synthetic KV-cache decoders
    /// and none of 40 heavy-tailed traces ran out of memory in chunks, against 14 and 1 when grown
    /// by exactly the request.)
    ///
    /// The chunks are tried smallest first, each with as many requests as it holds (the fewest
    /// requests whose pages make it, counted one by one, would reach the same chunk), so that
    /// the search takes a few steps whatever the sizes: counting requests one by one took
    /// `medium_chunk / size` steps, 10^16 for a request of a few KiB with pages of
    /// [`MAX_REQUEST`](super::MAX_REQUEST) bytes (a hang; and `unused * 8` overflowed).
    pub(crate) fn packed_medium_chunk(&self, size: usize) -> usize {
        let granule = self.config.large_granule;
        let size = size.max(1);
        let exact = round_up(size, granule).unwrap_or(size);
        let most = self.config.medium_chunk.min(exact.saturating_mul(3));
        let mut n: usize = 1;
        while let Some(chunk) = n.checked_mul(size).and_then(|b| round_up(b, granule)).filter(|&c| c <= most) {
            let holds = chunk / size;
            if chunk - holds * size <= chunk / 8 {
                return chunk;
            }
            n = holds + 1;
        }
        exact
    }

    /// Records a large growth of `size` rounded bytes (one the driver granted, while memory was
    /// not tight) among the last [`RECENT_GROWTHS`]: a later request of its size recurs. (Were a
    /// refused growth recorded, the out-of-memory recovery's retry of the same request would find
    /// its own size there and pack.)
    fn note_large_growth(&mut self, size: usize) {
        self.recent_large[self.recent_next] = size;
        self.recent_next = (self.recent_next + 1) % RECENT_GROWTHS;
    }

    /// The chunk for a large request of `size` rounded bytes whose size recurs (a model's
    /// weights, a layer's tensors): room for two or three requests of its size, whichever leaves
    /// the fewest bytes of the last page unused per request, where that is at most half of what a
    /// chunk of its own leaves; else exactly its pages. Only where a chunk of its own would leave
    /// at least a sixteenth of the request unused: a 12.5 MiB weight takes a 14 MiB chunk of its
    /// own and leaves 1.5 MiB, three take 38 MiB together and leave 0.17 MiB each.
    ///
    /// Requests of its size take a packed chunk's room first (what was freed on their own
    /// stream, [`Arena::take_packed`]); other requests only as their last resort. While its room
    /// waits for them, a packed chunk keeps two requests' worth and less than a page beyond its
    /// block, and it is grown only within the headroom, where memory does not run short for it,
    /// and where that is at most a quarter of the device's free memory ([`Arena::grow`]). Its
    /// room is not counted with what rounding leaves unused
    /// ([`PoolConfig::large_classes_per_octave`]'s bound). Without packing, stacked beam search
    /// over a model of 12.5 and 9.4 MiB weights could not fit in 1.10 times its peak of live
    /// memory in chunks (it needed 1.119 times, with every large tensor in a chunk of its own).
    /// Up to four requests to a chunk, the workload families ran out of memory in 1.10x a little
    /// more often (628 of 2,400 replays, against 618; 755 without packing).
    pub(crate) fn packed_large_chunk(&self, size: usize) -> usize {
        let granule = self.config.large_granule;
        let pages = |n: usize| n.checked_mul(size).and_then(|b| round_up(b, granule));
        let Some(exact) = pages(1) else { return size };
        let alone = exact - size;
        if alone.saturating_mul(16) < size {
            return exact;
        }
        let mut best = (alone, exact);
        for n in 2..=3 {
            let Some(chunk) = pages(n) else { break };
            let each = (chunk - n * size) / n;
            if each * 2 <= alone && each < best.0 {
                best = (each, chunk);
            }
        }
        best.1
    }

    /// Allocates a chunk of `bytes` of `kind` for stream `s` and returns its single block. `None`
    /// when the driver is out of memory (with `before` bytes free as last known: the spare is
    /// learnt from the refusal).
    fn new_chunk(
        &mut self,
        b: &B,
        s: u32,
        kind: Kind,
        bytes: usize,
        before: Option<usize>,
    ) -> Result<Option<u32>, super::PoolError<B::Error>> {
        match b.alloc_chunk(bytes) {
            Ok(ptr) => Ok(Some(self.add_chunk(s, kind, ptr, bytes))),
            Err(e) if b.is_out_of_memory(&e) => {
                self.learn_spare_after_refusal(b, before, bytes);
                Ok(None)
            }
            Err(e) => Err(super::PoolError::Backend(e)),
        }
    }

    /// Near capacity ([`PoolConfig::reservoir`]): gives back every free chunk whose frees the GPU
    /// has completed (asked without blocking; `Release`, after which the caller calls again), then
    /// takes what the device has left, less what the driver keeps back, in one reservoir chunk
    /// and hands out the request's block from its start. `None` where that is not enough for
    /// the request (`exact` bytes), or the driver refuses it: the caller grows exactly instead.
    /// During a capture (`may_release` false) nothing is given back, and the reservoir takes
    /// only what the device has free.
    fn grow_reservoir(
        &mut self,
        b: &B,
        s: u32,
        size: usize,
        exact: usize,
        before: Option<usize>,
        may_release: bool,
    ) -> Result<Option<Grow>, super::PoolError<B::Error>> {
        let Some(reported) = before else { return Ok(None) };
        // A workload with a request of an eighth of what the pool can reach relies on the driver
        // to put memory back together for it (a `cuMemFree` of whole chunks, then a `cuMemAlloc`):
        // a reservoir, pinned by any block live in it, would keep that memory apart.
        if self.largest_growth > self.stats.reserved.saturating_add(self.usable(reported)) / 8 {
            return Ok(None);
        }
        if may_release {
            let detached = self.detach_free_chunks(b, 0, super::release::Completion::Poll);
            if !detached.is_empty() {
                self.consolidating = true;
                return Ok(Some(Grow::Release(detached)));
            }
        }
        let bytes = self.usable(reported) / GRANULE * GRANULE;
        if bytes < exact {
            return Ok(None);
        }
        let Some(blk) = self.new_chunk(b, s, Kind::Reservoir, bytes, before)? else { return Ok(None) };
        self.stats.reservoirs += 1;
        Ok(Some(Grow::Block(self.handout(blk, size))))
    }

    /// Past the headroom, where growing would mean giving memory back and allocating anew, a
    /// large request takes cached memory it passes over otherwise: first the best-fitting free
    /// tail that holds it (memory that its chunk's live block pins anyway), then the
    /// best-fitting free large block, whose rest becomes its chunk's tail. (A medium request
    /// takes only a tail there: [`Arena::tail_past_headroom`].) What blocks leave
    /// unused beside them (their slack and the free tails; not a large block freed in a chunk that
    /// a block in its tail keeps, which later requests still reuse) stays within the headroom's
    /// share of the most memory live at once ([`PoolConfig::headroom_percent`], 20% where none is
    /// set), and within [`Arena::may_pin_past_headroom`]: past that, a pinned chunk could be what
    /// a later request needs, and the pool would have to grow instead of releasing it. Never near
    /// capacity (the caller checks), for the same reason.
    fn reuse_past_headroom(
        &mut self,
        b: &B,
        s: u32,
        size: usize,
        free: Option<usize>,
    ) -> Result<Option<Handout>, B::Error> {
        let share = self.config.headroom_percent.unwrap_or(DEFAULT_HEADROOM_PERCENT) as usize;
        let allowance = (self.stats.peak_live / 100).saturating_mul(share).saturating_sub(self.unused());
        let largest = size.saturating_add(allowance.min(self.may_pin_past_headroom(free)));
        for (kind, largest) in [(Kind::Tail, usize::MAX), (Kind::Large, largest)] {
            if let Some(blk) = self.take_kind_within(b, s, kind, size, largest)? {
                self.stats.loose_fits += 1;
                return Ok(Some(self.handout(blk, size)));
            }
        }
        Ok(None)
    }

    /// Counts a request of `size` bytes about to be served by growth as live (what is out of the
    /// arena is live then: the caches were given back). Returns the most live at once.
    /// [`Arena::grow`] takes the count back if the request is not handed out.
    pub(crate) fn note_live(&mut self, size: usize) -> usize {
        let live = self.stats.out_bytes.saturating_add(size);
        if live > self.stats.peak_live {
            self.stats.peak_live = live;
            if !self.stays_settled_with(live) {
                self.restart_settling();
            }
        }
        self.stats.peak_live
    }

    /// The most the pool may hold after growing, as (hard, soft) bounds. Hard: the release
    /// threshold and, near capacity (memory `tight`), the device's `free` memory: the pool makes
    /// room by releasing free memory (only what the request lacks, and none not known to be done
    /// with) before asking for more than the device has. Soft: also the headroom over `peak` live
    /// bytes, unless memory is tight. With `headroom` off (after rounds that could not release
    /// enough), only the release threshold.
    pub(crate) fn growth_limits(
        &self,
        peak: usize,
        headroom: bool,
        tight: bool,
        free: Option<usize>,
    ) -> (usize, usize) {
        let mut hard = self.config.release_threshold;
        if tight
            && headroom
            && let Some(free) = free
        {
            hard = hard.min(self.stats.reserved.saturating_add(free));
        }
        let mut soft = hard;
        if let Some(pct) = self.config.headroom_percent.filter(|_| headroom && !tight) {
            soft = soft.min(peak.saturating_add((peak / 100).saturating_mul(pct as usize)));
        }
        (hard, soft)
    }

    /// Whether memory runs short for a growth of `bytes`: the device would be left with less
    /// than a tenth of what the pool then holds (of `free` usable bytes). Counted.
    pub(crate) fn runs_short(&mut self, free: Option<usize>, bytes: usize) -> bool {
        let tight = free.is_some_and(|free| short(free, self.stats.reserved, bytes));
        if tight {
            self.stats.tight_growths += 1;
        }
        tight
    }

    /// The device's free memory (`None` where the backend does not know it): the last report
    /// while it is fresh (the pool's own growth and release since counted, as the driver counts
    /// them), else a new one. A report costs a driver call (`cuMemGetInfo`: 7 µs on the H200),
    /// more than a growth that reuses cached memory costs in all; within
    /// [`FREE_MEMORY_FRESH`], only other allocators' changes go unseen, and a driver that then
    /// refuses memory is asked afresh ([`Arena::fresh_device_free`]).
    pub(crate) fn device_free(&mut self, b: &B) -> Option<usize> {
        if let Some(seen) = self.free_seen
            && seen.at.elapsed() < self.free_fresh
        {
            return Some((seen.reported.saturating_add(seen.reserved)).saturating_sub(self.stats.reserved));
        }
        self.fresh_device_free(b)
    }

    /// Makes the next [`Arena::device_free`] ask the driver.
    pub(crate) fn forget_free_report(&mut self) {
        self.free_seen = None;
    }

    /// The device's free memory as the backend reports it now, kept for [`Arena::device_free`].
    pub(crate) fn fresh_device_free(&mut self, b: &B) -> Option<usize> {
        let reported = b.free_memory();
        self.free_seen =
            reported.map(|reported| FreeSeen { reported, reserved: self.stats.reserved, at: Instant::now() });
        reported
    }

    /// What may stay reserved so that the device has room for an exact chunk for `size` rounded
    /// bytes, as far as the backend knows its free memory (0 when it does not).
    pub(crate) fn reserved_after_making_room(&mut self, b: &B, size: usize) -> usize {
        let Some((_, exact)) = self.chunk_sizes(self.kind_for(size), size) else { return 0 };
        match self.fresh_device_free(b) {
            Some(free) => self.stats.reserved.saturating_sub(exact.saturating_sub(self.usable(free))),
            None => 0,
        }
    }

    /// How many more bytes blocks may leave unused (their slack and the free tails) when a large
    /// request past the headroom takes a free block larger than it ([`Arena::reuse_past_headroom`]):
    /// within 1% of the device's memory, so that what pinned blocks keep from the driver never
    /// decides whether a full device fits a request; once the most memory live at once has
    /// settled ([`Arena::peak_settled`]), within a sixteenth of the room the device leaves above
    /// it where that is more. Unbounded when the backend does not know its free memory.
    ///
    /// A share of the device alone made the pool's calls depend on the device's size: mixed_images
    /// (a 5.7 GB peak, a new image size every step) left 250-830 MiB of slack at its headroom,
    /// past 1% of a 24-80 GB device, and so traded a chunk with the driver for each new size
    /// (simulated, without a budget: 710 `cuMemAlloc` calls cold and 516 warm on 24 GB, 210 and
    /// 63 on 79 GB, 210 and 9 where the size is unknown; now 408 and 257, 205 and 10). The room
    /// above the peak is trusted only once the peak has settled: before it, a workload that will
    /// fill the device looks roomy (bounded so from the start, 23 more of the sweeps' replays in
    /// 1.10x their peak ran out of memory, four of the traces' among them). Under such a budget,
    /// a sixteenth of what it leaves above the peak is less than 1% of the device, so fits there
    /// are as before.
    fn may_pin_past_headroom(&self, free: Option<usize>) -> usize {
        let within_device = self.unused_within(free, 100);
        if self.peak_settled() { within_device.max(self.unused_within_room(free, 16)) } else { within_device }
    }

    /// Counts the blocks handed out with the most memory live at once where it is now.
    fn restart_settling(&mut self) {
        (self.handouts_at_peak, self.settling_peak) = (self.handouts, self.stats.peak_live);
    }

    /// Whether the most memory live at once has stayed where it is over the last
    /// [`PEAK_SETTLES_AFTER`] blocks the arena handed out, and over the last quarter of all of
    /// them: the workload has reached its peak, and the room the device leaves above it is what
    /// the workload leaves (a warm pass of a training loop, a server in its steady state). Once
    /// settled, it stays so through rises within [`PEAK_SETTLE_MARGIN`] of that peak.
    ///
    /// The pool sees the peak only when it grows, so a warm pass that meets its peak a little
    /// higher than the cold pass saw it (mixed_images: 5.71 GB where the cold pass grew at most
    /// to 5.69) would otherwise settle anew, and on a 24-40 GB device trade chunks with the
    /// driver for the first half of its length (simulated without a budget, warm `cuMemAlloc`
    /// calls: 257 on 24 GB and 174 on 40 GB with every rise counted, 57 and 38 now; cold as
    /// before). The margin is only for a peak that has settled: applied while settling too, a
    /// heavy-tailed trace that stays at a quarter of its peak for a while took that for its
    /// peak, and three of its budgeted replays ran out of memory (seed 15 of the robustness
    /// sweep). As it is, every budgeted replay of the sweeps fits as before.
    fn peak_settled(&self) -> bool {
        let since = self.handouts - self.handouts_at_peak;
        since >= PEAK_SETTLES_AFTER.max(self.handouts / 4)
    }

    /// Whether the peak is settled and stays so with `live` bytes live: within
    /// [`PEAK_SETTLE_MARGIN`] of the peak it settled at ([`Arena::peak_settled`]).
    fn stays_settled_with(&self, live: usize) -> bool {
        self.peak_settled() && live <= self.settling_peak.saturating_add(self.settling_peak / PEAK_SETTLE_MARGIN)
    }

    /// How many more bytes the blocks that are out may leave unused in their chunks (size-class
    /// rounding, tails): together at most 0.25% of the device's memory, so that a device filled
    /// with live buffers is filled as tightly as the driver's own pool fills it. Unbounded when
    /// the backend does not know its free memory.
    fn may_leave_unused(&self, free: Option<usize>) -> usize {
        self.unused_within(free, 400)
    }

    /// How many more bytes blocks may leave unused (their slack and the free tails) for all of it
    /// to stay within `1 / divisor` of the device's memory (the pool's, and `free` beyond it).
    /// Unbounded when the backend does not know its free memory.
    fn unused_within(&self, free: Option<usize>, divisor: usize) -> usize {
        let Some(free) = free else { return usize::MAX };
        (self.stats.reserved.saturating_add(free) / divisor).saturating_sub(self.unused())
    }

    /// How many more bytes blocks may leave unused for all of it to stay within `1 / divisor` of
    /// the room the device's memory (the pool's, and `free` beyond it) leaves above the most
    /// memory live at once. Unbounded when the backend does not know its free memory.
    fn unused_within_room(&self, free: Option<usize>, divisor: usize) -> usize {
        let Some(free) = free else { return usize::MAX };
        let room = self.stats.reserved.saturating_add(free).saturating_sub(self.stats.peak_live);
        (room / divisor).saturating_sub(self.unused())
    }

    /// Bytes that blocks leave unused: what out blocks hold beyond their requests, and the free
    /// tails of large chunks.
    fn unused(&self) -> usize {
        self.stats.slack.saturating_add(self.stats.free_tails)
    }

    /// What new chunks may take of `reported` free bytes: all but what the driver keeps back.
    pub(crate) fn usable(&self, reported: usize) -> usize {
        reported.saturating_sub(self.driver_spare)
    }

    /// The driver refused `bytes`: learns the spare ([`Arena::learn_spare`]) from the smaller of
    /// the free memory known `before` the call and a report asked now (another thread's release
    /// that completed in between would make the later one too large, and the spare never goes
    /// down).
    pub(crate) fn learn_spare_after_refusal(&mut self, b: &B, before: Option<usize>, bytes: usize) {
        let now = self.fresh_device_free(b);
        if let Some(reported) = before.into_iter().chain(now).min() {
            self.learn_spare(reported, bytes);
        }
    }

    /// The driver refused a chunk of `bytes` with `reported` bytes free: if that left more than
    /// the pool plans to leave it, plan from now on to leave more than it did (rounded up to 2 MiB,
    /// at most [`MAX_DRIVER_SPARE`]), so that the pool releases what a request needs before asking
    /// instead of failing and recovering. How much the driver keeps varies with its state (see
    /// [`DRIVER_SPARE`]).
    pub(crate) fn learn_spare(&mut self, reported: usize, bytes: usize) {
        let left = reported.saturating_sub(bytes);
        if left >= self.driver_spare && self.driver_spare < MAX_DRIVER_SPARE {
            let needed = round_up(left + 1, DRIVER_SPARE).unwrap_or(MAX_DRIVER_SPARE);
            self.driver_spare = needed.clamp(self.driver_spare, MAX_DRIVER_SPARE);
        }
    }

    /// Records a new chunk; returns its single block (free, host-safe, owned by `s`, unlisted).
    pub(crate) fn add_chunk(&mut self, s: u32, kind: Kind, ptr: u64, size: usize) -> u32 {
        debug_assert!(ptr.is_multiple_of(256), "the driver aligns chunks to 256 bytes");
        // The chunk's slot is taken first so that the block can name it.
        let c = self.chunks.insert(Chunk { ptr, size, first: NIL, out: 0, releasing: false, segment: None, unit: 0 });
        let blk = self.blocks.insert(Block {
            ptr,
            size,
            chunk: c,
            kind,
            prev: NIL,
            next: NIL,
            state: State::Free { stream: s, seq: 0 },
            slack: 0,
        });
        self.chunks[c].first = blk;
        let stats = &mut self.stats;
        stats.driver_allocs += 1;
        stats.driver_alloc_bytes = stats.driver_alloc_bytes.saturating_add(size as u64);
        stats.chunks += 1;
        stats.reserved += size;
        stats.peak_reserved = stats.peak_reserved.max(stats.reserved);
        blk
    }

    /// Notes the in-use total seen when visiting the caches, for the peak.
    pub(crate) fn note_in_use(&mut self, in_use: usize) {
        self.stats.peak_in_use = self.stats.peak_in_use.max(in_use);
    }

    /// `GRANULE`-rounded size of a request, or `None` above the largest request.
    pub(crate) fn rounded(bytes: usize) -> Option<usize> {
        if bytes > super::MAX_REQUEST { None } else { round_up(bytes.max(1), GRANULE) }
    }
}

/// The smallest size class at or above `size`: classes are `2^(k / per_octave)` scaled to whole
/// numbers of 64 KiB, `per_octave` to a doubling (`size` itself when 0).
pub(crate) fn size_class(size: usize, per_octave: u32) -> usize {
    if per_octave == 0 || size == 0 {
        return size;
    }
    let octave = usize::BITS - 1 - size.leading_zeros(); // 2^octave <= size
    let base = 1usize << octave;
    if base == size {
        return size;
    }
    let step = (base / per_octave as usize).max(1 << 16);
    round_up(size, step).unwrap_or(size)
}

#[cfg(test)]
impl<B: Backend> Arena<B> {
    /// Every chunk with its blocks (`+size` out, `-size` free), for tests that explain a decision.
    pub(crate) fn describe(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        for (c, chunk) in self.chunks.iter() {
            let _ = write!(out, "chunk {c} {:>6.1} MiB:", chunk.size as f64 / (1 << 20) as f64);
            let mut cur = chunk.first;
            while cur != NIL {
                let b = &self.blocks[cur];
                let sign = match b.state {
                    State::Out => '+',
                    State::Free { .. } => '-',
                    State::Hole => '~',
                };
                let _ = write!(out, " {sign}{:.2}", b.size as f64 / (1 << 20) as f64);
                cur = b.next;
            }
            out.push('\n');
            if let Some(seg) = &chunk.segment {
                // Free bytes, and those of them in whole mappings (which could be unmapped).
                let (mut free, mut whole) = (0usize, 0usize);
                let mut cur = chunk.first;
                while cur != NIL {
                    let b = &self.blocks[cur];
                    if matches!(b.state, State::Free { .. }) {
                        let end = b.ptr + b.size as u64;
                        free += b.size;
                        whole += seg.maps_within(b.ptr, end).map(|(_, n, _)| n).sum::<usize>();
                    }
                    cur = b.next;
                }
                let sizes: std::collections::BTreeMap<usize, usize> =
                    seg.maps.values().fold(Default::default(), |mut m, &(n, _)| {
                        *m.entry(n >> 20).or_default() += 1;
                        m
                    });
                let _ = writeln!(
                    out,
                    "  {} mappings (MiB: count) {sizes:?}; free {:.1} MiB, {:.1} MiB of it in whole mappings",
                    seg.maps.len(),
                    free as f64 / (1 << 20) as f64,
                    whole as f64 / (1 << 20) as f64
                );
            }
        }
        out
    }
}

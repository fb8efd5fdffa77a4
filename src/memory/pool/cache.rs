//! A stream's own cache: the fast path. Blocks freed on a stream wait here for the next request
//! of the same size on that stream, which takes one with no shared lock, no driver call and no
//! synchronisation (stream order alone makes it safe). The cache also knows the stream's live
//! allocations, so that a free on the same stream needs nothing shared either.

use super::{FastMap, Handout, Live};

/// Per-stream figures, summed by the pool's statistics.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CacheStats {
    /// Requested bytes of the live allocations held here.
    pub(crate) live_bytes: usize,
    /// Their block bytes.
    pub(crate) live_block_bytes: usize,
    /// Their number.
    pub(crate) live: usize,
    /// Highest `live_bytes`.
    pub(crate) peak_live_bytes: usize,
    /// Bytes of free blocks cached.
    pub(crate) free_bytes: usize,
    pub(crate) allocations: u64,
    pub(crate) hits: u64,
}

/// (pointer, arena block) pairs.
#[cfg(test)]
pub(crate) type BlockList = Vec<(u64, u32)>;

/// What a free found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// A live allocation of this cache, with that size.
    Here(Live),
    /// A live allocation of this cache, with another size (nothing changed).
    WrongSize,
    /// Not a live allocation of this cache.
    Missing,
}

/// One stream's cache of one pool.
#[derive(Debug)]
pub(crate) struct Cache {
    /// The stream's slot in the arena.
    pub(crate) slot: u32,
    /// Free blocks of up to `small_limit` bytes by size, most recently freed last: (pointer,
    /// arena block).
    free: FastMap<usize, Vec<(u64, u32)>>,
    /// The same for larger blocks, apart so that they can be given back alone
    /// ([`Cache::take_free_large`]) without going through the small ones.
    free_large: FastMap<usize, Vec<(u64, u32)>>,
    /// The pool's [`PoolConfig::small_limit`](super::config::PoolConfig::small_limit).
    small_limit: usize,
    /// Live allocations made on, or moved to, this stream.
    live: FastMap<u64, Live>,
    /// How many of them are *kept*: buffers' allocations whose buffer refers to the stream through
    /// the pool, which keeps the stream alive while there are any
    /// ([`StreamPin`](crate::stream::StreamPin)).
    pub(crate) kept: usize,
    pub(crate) stats: CacheStats,
}

impl Cache {
    /// The cache of the stream in arena slot `slot`, of a pool whose small requests are up to
    /// `small_limit` bytes.
    pub(crate) fn new(slot: u32, small_limit: usize) -> Self {
        Cache {
            slot,
            free: FastMap::default(),
            free_large: FastMap::default(),
            small_limit,
            live: FastMap::default(),
            kept: 0,
            stats: CacheStats::default(),
        }
    }

    /// The free list for blocks of `size` bytes.
    #[inline]
    fn free_of(&mut self, size: usize) -> &mut FastMap<usize, Vec<(u64, u32)>> {
        if size > self.small_limit { &mut self.free_large } else { &mut self.free }
    }

    /// A cached block of exactly `size` rounded bytes, for a request of `requested` bytes
    /// (`kept`: see [`Cache::kept`]).
    #[inline]
    pub(crate) fn take(&mut self, size: usize, requested: usize, kept: bool) -> Option<u64> {
        let (ptr, blk) = self.free_of(size).get_mut(&size)?.pop()?;
        self.stats.free_bytes -= size;
        self.stats.hits += 1;
        self.adopt_block(ptr, Live { blk, size, requested, kept });
        Some(ptr)
    }

    /// Takes a block handed out by the arena as a live allocation of `requested` bytes.
    pub(crate) fn adopt(&mut self, h: Handout, requested: usize, kept: bool) -> u64 {
        self.adopt_block(h.ptr, Live { blk: h.blk, size: h.size, requested, kept });
        h.ptr
    }

    #[inline]
    fn adopt_block(&mut self, ptr: u64, live: Live) {
        let s = &mut self.stats;
        s.allocations += 1;
        s.live += 1;
        s.live_bytes += live.requested;
        s.live_block_bytes += live.size;
        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        self.kept += usize::from(live.kept);
        let old = self.live.insert(ptr, live);
        debug_assert!(old.is_none(), "a pointer handed out twice");
    }

    /// Removes the live allocation at `ptr` if it is this cache's and has `requested` bytes.
    #[inline]
    pub(crate) fn remove_live(&mut self, ptr: u64, requested: usize) -> Found {
        match self.live.get(&ptr) {
            None => Found::Missing,
            Some(l) if l.requested != requested => Found::WrongSize,
            Some(_) => {
                let live = self.live.remove(&ptr).expect("found above");
                self.kept -= usize::from(live.kept);
                let s = &mut self.stats;
                s.live -= 1;
                s.live_bytes -= live.requested;
                s.live_block_bytes -= live.size;
                Found::Here(live)
            }
        }
    }

    /// The allocation at `ptr` is kept no more (its buffer now holds a counted reference to the
    /// stream); whether it was.
    pub(crate) fn unkeep(&mut self, ptr: u64) -> bool {
        match self.live.get_mut(&ptr) {
            Some(l) if l.kept => {
                l.kept = false;
                self.kept -= 1;
                true
            }
            _ => false,
        }
    }

    /// Whether `ptr` is a live allocation of this cache.
    pub(crate) fn contains(&self, ptr: u64) -> bool {
        self.live.contains_key(&ptr)
    }

    /// Frees the live allocation at `ptr` of `requested` bytes on this cache's own stream: its
    /// block is cached here. What the lookup found (nothing changes unless it is `Here`).
    #[inline]
    pub(crate) fn free_here(&mut self, ptr: u64, requested: usize) -> Found {
        let found = self.remove_live(ptr, requested);
        if let Found::Here(live) = found {
            self.put_free(ptr, live);
        }
        found
    }

    /// Caches the block of an allocation freed on this stream.
    #[inline]
    pub(crate) fn put_free(&mut self, ptr: u64, live: Live) {
        self.stats.free_bytes += live.size;
        self.free_of(live.size).entry(live.size).or_default().push((ptr, live.blk));
    }

    /// Takes every cached free block, to give back to the arena.
    pub(crate) fn take_free(&mut self) -> Vec<(u64, u32)> {
        let mut out = self.take_free_large();
        for (_, list) in self.free.iter_mut() {
            out.append(list);
        }
        self.free.clear();
        self.stats.free_bytes = 0;
        out
    }

    /// Takes the cached free blocks of more than `small_limit` bytes.
    pub(crate) fn take_free_large(&mut self) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        for (&size, list) in self.free_large.iter_mut() {
            self.stats.free_bytes -= size * list.len();
            out.append(list);
        }
        self.free_large.clear();
        out
    }

    /// Takes every live allocation (the stream is going away; they become the arena's orphans).
    pub(crate) fn take_live(&mut self) -> Vec<(u64, Live)> {
        let s = &mut self.stats;
        (s.live, s.live_bytes, s.live_block_bytes) = (0, 0, 0);
        self.kept = 0;
        self.live.drain().collect()
    }

    /// The cached free blocks and the live allocations, as (pointer, block) pairs.
    #[cfg(test)]
    pub(crate) fn contents_for_tests(&self) -> (BlockList, BlockList) {
        let free = self.free.values().chain(self.free_large.values()).flatten().copied().collect();
        let live = self.live.iter().map(|(&p, l)| (p, l.blk)).collect();
        (free, live)
    }
}

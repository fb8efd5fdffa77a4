//! Chunks and blocks: the memory the arena holds, cut into address-ordered blocks, and the free
//! lists that find, split and merge them.

use std::collections::BTreeMap;

use super::arena::Arena;
use super::backend::Backend;

/// Index of "no block" in the block links.
pub(crate) const NIL: u32 = u32::MAX;

/// The class of a request, and of the chunks that serve it: each class has chunks and free
/// lists of its own, so that a long-lived block of one class does not pin a chunk of another
/// (save a tail, taken only as the last resort before out of memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Up to `small_limit`: shared small chunks.
    Small = 0,
    /// Up to `medium_limit`: shared medium chunks.
    Medium = 1,
    /// Above: a chunk per request, reused only by requests of nearly its size.
    Large = 2,
    /// What a large block leaves of its chunk: the driver maps chunks in whole 2 MiB pages, so a
    /// large request rarely fills its chunk. When the device has no room left for a small or
    /// medium request's own chunk, even after the out-of-memory recovery, the request takes a
    /// tail: bytes the device has given up anyway. Only then, since a block in a tail keeps its
    /// whole chunk from going back to the driver. A tail merges back into its large block when
    /// both are free.
    Tail = 3,
    /// A *reservoir* ([`PoolConfig::reservoir`](super::config::PoolConfig::reservoir)): near the
    /// device's capacity, the arena gives back its free chunks and takes what the device has left
    /// in one chunk, which serves requests of every kind by best fit, split and merged as a heap
    /// is, before the arena grows again. Its blocks are all of this kind.
    Reservoir = 4,
    /// A *packed* large chunk: grown for two or three large requests of one recurring size at
    /// once (a model's weights), so that the driver's 2 MiB pages are rounded once for all of
    /// them. Requests of that size ([`Chunk::unit`]) take its free blocks (freed on their own
    /// stream) before any other; other requests only as their last resort.
    Packed = 5,
}

/// The number of kinds.
pub(crate) const KINDS: usize = 6;

/// The state of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// Free in the arena, filed in the list of stream state `stream`, having become free at
    /// `seq` in that stream's order.
    Free { stream: u32, seq: u64 },
    /// Outside the arena: handed out to a user, or cached by a stream for reuse there.
    Out,
    /// Addresses of a segment with no memory mapped (or being unmapped): never listed, never
    /// handed out; adjacent holes merge.
    Hole,
}

/// A contiguous piece of a chunk.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) ptr: u64,
    pub(crate) size: usize,
    pub(crate) chunk: u32,
    pub(crate) kind: Kind,
    /// Neighbours in the same chunk, in address order (`NIL` at the ends).
    pub(crate) prev: u32,
    pub(crate) next: u32,
    pub(crate) state: State,
    /// While out: the bytes of it beyond the request it was handed out for (a large block is
    /// handed out whole); 0 while free.
    pub(crate) slack: usize,
}

/// Memory from one `alloc_chunk` call, or a segment: a reserved address range mapped from its
/// start (see [`Segment`]).
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub(crate) ptr: u64,
    /// The chunk's bytes; for a segment, the bytes its blocks span, holes included.
    pub(crate) size: usize,
    /// The block at the chunk's start; merges always keep the lower block, so it never changes.
    pub(crate) first: u32,
    /// Blocks outside the arena; a chunk with none is entirely free and may be released.
    pub(crate) out: u32,
    /// Being freed by a caller with no lock held: its blocks are off the free lists.
    pub(crate) releasing: bool,
    /// `Some` for a segment.
    pub(crate) segment: Option<Segment>,
    /// For a packed chunk ([`Kind::Packed`]): the rounded size of the requests it was grown for.
    pub(crate) unit: usize,
}

/// A segment: one reserved address range per kind, into which device memory is mapped as the
/// pool grows (at its top, or into a hole), and from which free memory is unmapped as the pool
/// shrinks (leaving a hole). Its blocks split and merge across what each mapping added, so a
/// request of a new size is served by merged free space instead of new memory: no chunk
/// boundaries. The chunk's blocks cover `[chunk.ptr, chunk.ptr + chunk.size)`: mapped blocks and
/// holes.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    /// The reserved bytes: the range is `[chunk.ptr, chunk.ptr + reserved)`.
    pub(crate) reserved: usize,
    /// The kind of every block of the segment.
    pub(crate) kind: Kind,
    /// The mappings: address -> (bytes, handle). They cover exactly the blocks that are not holes.
    pub(crate) maps: BTreeMap<u64, (usize, u64)>,
    /// The bytes of `maps`.
    pub(crate) mapped: usize,
    /// Bytes being unmapped by a caller with no lock held (holes already). The segment neither
    /// grows nor releases more meanwhile.
    pub(crate) unmapping: usize,
    /// Whether giving the range back (`cuMemAddressFree`) failed: the failure was reported, and
    /// later attempts, at each release, report nothing more.
    pub(crate) refused: bool,
}

impl Segment {
    /// The mappings that lie wholly inside `[ptr, end)`, lowest first, as (address, bytes,
    /// handle): those of a free block are what can be unmapped of it.
    pub(crate) fn maps_within(&self, ptr: u64, end: u64) -> impl DoubleEndedIterator<Item = (u64, usize, u64)> + '_ {
        self.maps.range(ptr..end).filter(move |&(&at, &(n, _))| at + n as u64 <= end).map(|(&at, &(n, h))| (at, n, h))
    }
}

/// Free blocks of one kind and one stream, best fit first: key `(size, ptr)`, value block index.
pub(crate) type FreeList = BTreeMap<(usize, u64), u32>;

/// The key of the best-fitting block of `list` for `size` bytes: the smallest that is large
/// enough, if it is at most `largest` bytes ([`Arena::largest_fit`]).
pub(crate) fn best_fit(list: &FreeList, size: usize, largest: usize) -> Option<(usize, u64)> {
    let (&key, _) = list.range((size, 0)..).next()?;
    (key.0 <= largest).then_some(key)
}

impl<B: Backend> Arena<B> {
    /// Removes and returns the best-fitting free block of `size` to `largest` bytes of stream `s`.
    pub(crate) fn take_free(&mut self, s: u32, kind: Kind, size: usize, largest: usize) -> Option<u32> {
        let key = best_fit(&self.streams[s].free[kind as usize], size, largest)?;
        let blk = self.streams[s].free[kind as usize][&key];
        self.unlist(blk);
        Some(blk)
    }

    /// Marks `blk` (free, unlisted, owned by stream `s`) out for a request of `size` rounded
    /// bytes, splitting off the rest when worth it: the rest stays free with the same stream and
    /// sequence number. Returns the block's pointer and size.
    pub(crate) fn hand_out(&mut self, blk: u32, size: usize) -> (u64, usize) {
        let block = &self.blocks[blk];
        let State::Free { .. } = block.state else { unreachable!("handing out a block that is not free") };
        let rest = block.size - size;
        let min_split = match block.kind {
            Kind::Small | Kind::Tail | Kind::Reservoir | Kind::Packed => super::GRANULE,
            Kind::Medium | Kind::Large => self.config.min_large_split,
        };
        if rest >= min_split {
            // A large block's rest is the chunk's tail: no large request takes it apart from the
            // block, so no large block ever pins another's chunk. (A segment has no chunks to
            // pin: its rests stay of its kind.)
            let tail = block.kind == Kind::Large && self.chunks[block.chunk].segment.is_none();
            let rest_blk = self.split_after(blk, size);
            if tail {
                self.blocks[rest_blk].kind = Kind::Tail;
            }
            // The rest keeps the neighbours the whole block had, so it needs no merge.
            self.list(rest_blk);
        }
        let block = &mut self.blocks[blk];
        block.state = State::Out;
        block.slack = block.size - size;
        self.stats.slack += block.slack;
        let (ptr, size, chunk) = (block.ptr, block.size, block.chunk);
        self.chunks[chunk].out += 1;
        self.stats.out_bytes += size;
        (ptr, size)
    }

    /// Splits block `blk` (unlisted) after its first `keep` bytes; the upper piece, returned, has
    /// the same state and kind, and is unlisted.
    pub(crate) fn split_after(&mut self, blk: u32, keep: usize) -> u32 {
        let block = &self.blocks[blk];
        let upper = Block {
            ptr: block.ptr + keep as u64,
            size: block.size - keep,
            chunk: block.chunk,
            kind: block.kind,
            prev: blk,
            next: block.next,
            state: block.state,
            slack: 0,
        };
        let next = upper.next;
        let up = self.blocks.insert(upper);
        if next != NIL {
            self.blocks[next].prev = up;
        }
        let block = &mut self.blocks[blk];
        block.next = up;
        block.size = keep;
        up
    }

    /// Files `blk` (just given back or moved, unlisted) as free on stream `s` at `seq`, merging it
    /// with its neighbours where allowed. (Merging a host-safe neighbour of another stream hands
    /// it to `s`, and the block beyond may then be `s`'s too: hence the loops.)
    pub(crate) fn file_free(&mut self, mut blk: u32, s: u32, mut seq: u64) {
        self.stats.slack -= std::mem::take(&mut self.blocks[blk].slack);
        loop {
            let prev = self.blocks[blk].prev;
            if prev == NIL {
                break;
            }
            let Some(q) = self.merge_target(prev, s, seq) else { break };
            self.unlist(prev);
            self.absorb(prev, blk);
            (blk, seq) = (prev, q);
        }
        loop {
            let next = self.blocks[blk].next;
            if next == NIL {
                break;
            }
            let Some(q) = self.merge_target(next, s, seq) else { break };
            self.unlist(next);
            self.absorb(blk, next);
            seq = q;
        }
        self.blocks[blk].state = State::Free { stream: s, seq };
        self.list(blk);
    }

    /// Whether a block free on stream `s` at `seq` may merge with neighbour `nb`, and if so the
    /// sequence number of the merged block, which `s` owns. Allowed when `nb` is free on the same
    /// stream, or when both are host-safe (then the result is host-safe too).
    pub(crate) fn merge_target(&self, nb: u32, s: u32, seq: u64) -> Option<u64> {
        let State::Free { stream: nb_stream, seq: nb_seq } = self.blocks[nb].state else { return None };
        if nb_stream == s {
            Some(seq.max(nb_seq))
        } else if self.host_safe(s, seq) && self.host_safe(nb_stream, nb_seq) {
            Some(0)
        } else {
            None
        }
    }

    /// Merges every pair of adjacent free blocks of chunk `c` that may merge. Not for a chunk
    /// being released (its blocks are off the lists).
    pub(crate) fn coalesce_chunk(&mut self, c: u32) {
        debug_assert!(!self.chunks[c].releasing, "coalescing a chunk that is being released");
        let mut cur = self.chunks[c].first;
        while cur != NIL {
            let next = self.blocks[cur].next;
            if next == NIL {
                break;
            }
            if let State::Free { stream, seq } = self.blocks[cur].state
                && let Some(q) = self.merge_target(next, stream, seq)
            {
                self.unlist(cur);
                self.unlist(next);
                self.absorb(cur, next);
                self.blocks[cur].state = State::Free { stream, seq: q };
                self.list(cur);
                continue;
            }
            cur = next;
        }
    }

    /// Grows `lo` over its upper neighbour `hi` (both unlisted) and frees `hi`'s slot.
    pub(crate) fn absorb(&mut self, lo: u32, hi: u32) {
        let hi_block = self.blocks.remove(hi).expect("a merged block exists");
        let l = &mut self.blocks[lo];
        debug_assert_eq!(l.next, hi);
        l.size += hi_block.size;
        l.next = hi_block.next;
        if hi_block.next != NIL {
            self.blocks[hi_block.next].prev = lo;
        }
    }

    /// Adds free block `blk` to its owner's list.
    pub(crate) fn list(&mut self, blk: u32) {
        let block = &self.blocks[blk];
        let State::Free { stream, .. } = block.state else { unreachable!("listing a block that is not free") };
        let (key, kind) = ((block.size, block.ptr), block.kind);
        let old = self.streams[stream].free[kind as usize].insert(key, blk);
        debug_assert!(old.is_none());
        if kind == Kind::Tail {
            self.stats.free_tails += key.0;
        }
    }

    /// Removes free block `blk` from its owner's list.
    pub(crate) fn unlist(&mut self, blk: u32) {
        let block = &self.blocks[blk];
        let State::Free { stream, .. } = block.state else { unreachable!("unlisting a block that is not free") };
        let (key, kind) = ((block.size, block.ptr), block.kind);
        let old = self.streams[stream].free[kind as usize].remove(&key);
        debug_assert_eq!(old, Some(blk));
        if kind == Kind::Tail {
            self.stats.free_tails -= key.0;
        }
    }
}

//! Memory reserved for graphs: what a stream capture allocates from the pool.
//!
//! A graph runs its captured work later, possibly many times, on any stream, at the addresses it
//! saw during the capture. So a block allocated during a capture is taken only from memory that
//! is *host-safe* (every free in it has completed: ordered before anything issued from now on,
//! on any stream) or from a new chunk, never from a stream's cache; it belongs to the graph, not
//! to a stream. Its free during a capture only marks it: the graph still uses it at every
//! launch. It goes back to the arena when the graph is released (its last launch complete), or
//! at its free if that comes later: host-safe when it was freed in a capture, and otherwise as a
//! block freed on the freeing stream, at the point of its free in that stream's order (the user
//! may have used it there until then). Nothing here waits or frees a chunk, which a capture
//! would not allow.

use super::arena::{Arena, Grow};
use super::backend::Backend;
use super::blocks::State;
use super::error::PoolError;
use super::events::StreamState;
use super::{FastMap, Handout, Host, Live};

/// A block reserved for a graph.
#[derive(Debug, Clone, Copy)]
struct GraphBlock {
    live: Live,
    /// The capture (graph) it belongs to.
    graph: u64,
    /// Freed by its user (in the capture, or after).
    freed: bool,
    /// Freed outside a capture, before the graph was released: the stream state (slot and epoch)
    /// and the point in its order of the free.
    freed_on: Option<(u32, u64, u64)>,
    /// The graph was released: the block goes back at its free.
    released: bool,
}

/// The arena's record of blocks reserved for graphs.
#[derive(Debug, Default)]
pub(crate) struct GraphBlocks {
    blocks: FastMap<u64, GraphBlock>,
    /// Blocks per graph.
    per_graph: FastMap<u64, usize>,
    /// The stream state that files the blocks graphs give back (host-safe, of no stream), and
    /// its epoch (the slot may have been reaped and reused).
    host: Option<(u32, u64)>,
}

/// What the pool's statistics count of graph blocks: allocations, requested bytes, block bytes.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct GraphUse {
    pub(crate) allocations: usize,
    pub(crate) bytes: usize,
    pub(crate) block_bytes: usize,
}

impl<B: Backend> Arena<B> {
    /// The slot of the stream state that holds host-safe blocks of no stream.
    pub(crate) fn host_slot(&mut self) -> u32 {
        if let Some((s, epoch)) = self.graphs.host
            && self.streams.get(s).is_some_and(|st| st.epoch == epoch)
        {
            return s;
        }
        let epoch = self.new_epoch();
        let s = self.streams.insert(StreamState::new(None, epoch));
        self.graphs.host = Some((s, epoch));
        s
    }

    /// The best-fitting host-safe free block of at least `size` bytes, on any stream, handed
    /// out. No backend call.
    fn take_host_safe(&mut self, size: usize) -> Option<Handout> {
        let kind = self.kind_for(size);
        let largest = self.largest_fit(kind, size, self.config.large_fit_percent);
        let mut best: Option<((usize, u64), u32)> = None;
        for (s, st) in self.streams.iter() {
            for (&key, &blk) in st.free[kind as usize].range((size, 0)..) {
                if best.is_some_and(|(k, _)| k <= key) {
                    break;
                }
                if key.0 > largest {
                    break;
                }
                if let State::Free { seq, .. } = self.blocks[blk].state
                    && self.host_safe(s, seq)
                {
                    best = Some((key, blk));
                    break;
                }
            }
        }
        let (_, blk) = best?;
        self.unlist(blk);
        Some(self.handout(blk, size))
    }

    /// Files a block a graph no longer uses (out of the arena) as free and host-safe.
    fn give_back_host_safe(&mut self, blk: u32) {
        let s = self.host_slot();
        self.give_back_at(blk, s, 0);
    }

    /// Frees `ptr` if it is a graph's block, on stream state `slot` (`capturing`: in a capture):
    /// `None` if it is not one.
    fn free_graph_block(&mut self, ptr: u64, bytes: usize, slot: u32, capturing: bool) -> Option<Result<(), ()>> {
        let g = self.graphs.blocks.get(&ptr)?;
        if g.live.requested != bytes || g.freed {
            return Some(Err(()));
        }
        let (released, blk) = (g.released, g.live.blk);
        // Outside a capture, the free is a point in the stream's order, after the user's work
        // there: the block may be reused only after it.
        let on_stream = (!capturing).then(|| {
            self.streams[slot].seq += 1;
            (slot, self.streams[slot].epoch, self.streams[slot].seq)
        });
        match (released, on_stream) {
            (true, None) => {
                self.graphs.blocks.remove(&ptr);
                self.give_back_host_safe(blk);
            }
            (true, Some((slot, _, seq))) => {
                self.graphs.blocks.remove(&ptr);
                self.give_back_at(blk, slot, seq);
            }
            (false, freed_on) => {
                let g = self.graphs.blocks.get_mut(&ptr).expect("looked up above");
                g.freed = true;
                g.freed_on = freed_on;
                if freed_on.is_some() {
                    self.streams[slot].graph_frees += 1;
                }
            }
        }
        Some(Ok(()))
    }

    /// Whether `ptr` is a graph's block not freed yet.
    pub(crate) fn owns_graph_block(&self, ptr: u64) -> bool {
        self.graphs.blocks.get(&ptr).is_some_and(|g| !g.freed)
    }

    /// Every block graphs hold (address, block), for checks.
    #[cfg(test)]
    pub(crate) fn graph_blocks(&self) -> Vec<(u64, u32)> {
        self.graphs.blocks.iter().map(|(&p, g)| (p, g.live.blk)).collect()
    }

    /// What graphs hold.
    pub(crate) fn graph_use(&self) -> GraphUse {
        let mut u = GraphUse::default();
        // Each is used by its graph (until released) or its user (until freed).
        for g in self.graphs.blocks.values() {
            u.allocations += 1;
            u.bytes += g.live.requested;
            u.block_bytes += g.live.size;
        }
        u
    }
}

/// Allocates `bytes` for the graph that capture `graph` records: from host-safe memory, else a
/// new chunk (the headroom is not enforced: giving chunks back is not allowed during a capture).
/// Returns the address, and whether it is the graph's first block (whose owner must then arrange
/// for [`release_graph`]).
pub(crate) fn allocate_for_graph<H: Host>(
    h: &H,
    bytes: usize,
    graph: u64,
) -> Result<(u64, bool), PoolError<<H::B as Backend>::Error>> {
    let size = Arena::<H::B>::rounded(bytes).ok_or(PoolError::TooLarge { requested: bytes })?;
    let b = h.backend();
    let handout = match h.arena(|a| a.take_host_safe(size)) {
        Some(handout) => handout,
        None => {
            // A new chunk's blocks are host-safe: nothing has used them.
            let grow = || {
                h.arena(|a| {
                    let s = a.host_slot();
                    a.grow(b, s, size, false, false)
                })
            };
            let mut grown = grow()?;
            while let Grow::Busy = grown {
                // Another thread unmaps memory of the segment with no lock held: wait for it.
                h.wait_for_release();
                grown = grow()?;
            }
            if let Grow::Refused(undo) = &grown {
                super::free_chunks(h, undo).map_err(PoolError::Backend)?;
            }
            match grown {
                Grow::Block(handout) => handout,
                Grow::Release(_) | Grow::OutOfMemory | Grow::Busy | Grow::Refused(_) => {
                    let in_use = super::stats(h).in_use;
                    return Err(h.arena(|a| PoolError::OutOfMemory {
                        requested: bytes,
                        reserved: a.stats.reserved,
                        in_use,
                    }));
                }
            }
        }
    };
    Ok(h.arena(|a| {
        let live = Live { blk: handout.blk, size: handout.size, requested: bytes, kept: false };
        a.graphs.blocks.insert(handout.ptr, GraphBlock { live, graph, freed: false, freed_on: None, released: false });
        let n = a.graphs.per_graph.entry(graph).or_insert(0);
        *n += 1;
        (handout.ptr, *n == 1)
    }))
}

/// A free of a graph's block (see the module documentation): `None` when `ptr` is not one.
pub(crate) fn free_graph_block<H: Host>(
    h: &H,
    ptr: u64,
    bytes: usize,
    stream: &super::StreamOf<H>,
) -> Option<Result<(), PoolError<<H::B as Backend>::Error>>> {
    if !h.arena(|a| a.graphs.blocks.contains_key(&ptr)) {
        return None;
    }
    let slot = h.cache(stream, |c| c.slot);
    let capturing = h.backend().is_capturing(stream);
    h.arena(|a| a.free_graph_block(ptr, bytes, slot, capturing))
        .map(|r| r.map_err(|()| PoolError::InvalidFree { ptr, bytes }))
}

/// The graph of capture `graph` is gone and its last launch has completed: its freed blocks go
/// back to the arena (host-safe if freed in a capture, else on their freeing stream); the others
/// go back at their free.
pub(crate) fn release_graph<H: Host>(h: &H, graph: u64) {
    h.arena(|a| {
        a.graphs.per_graph.remove(&graph);
        let mine: Vec<u64> = a.graphs.blocks.iter().filter(|(_, g)| g.graph == graph).map(|(&p, _)| p).collect();
        for ptr in mine {
            let g = a.graphs.blocks.get_mut(&ptr).expect("listed above");
            if g.freed {
                let (blk, freed_on) = (g.live.blk, g.freed_on);
                a.graphs.blocks.remove(&ptr);
                match freed_on {
                    // Freed on a stream: its state is kept until now (`graph_frees`).
                    Some((slot, epoch, seq)) => {
                        debug_assert_eq!(a.streams[slot].epoch, epoch, "a stream state with a graph's free was reaped");
                        a.streams[slot].graph_frees -= 1;
                        a.give_back_at(blk, slot, seq);
                        a.maybe_reap(slot);
                    }
                    None => a.give_back_host_safe(blk),
                }
            } else {
                g.released = true;
            }
        }
    });
}

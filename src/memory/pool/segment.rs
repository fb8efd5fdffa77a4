//! Segments: growth by mapping memory into reserved address ranges, where the device has virtual
//! memory management ([`Backend::segments`]).
//!
//! The arena then holds one segment per kind (small requests; all others), each one address range
//! of [`RANGE_PER_BYTE`] times the device's memory, reserved once (a driver that refuses it gets
//! one of the device's size; one that refuses that too turns the pool to chunks). Growing maps
//! memory where it joins the most free memory a request can use: at the segment's top, above a
//! free top block, or into a hole between free blocks. The new bytes merge with their free
//! neighbours, so that mapping what a request lacks is enough. Blocks split and merge across
//! mappings: a freed block serves any request that fits it, whatever mapping its bytes came from.
//! This is what removes the chunked pool's waste on workloads whose sizes keep changing, where a
//! freed chunk serves only requests that fit in it, and keeps driver calls few: a warm workload
//! maps nothing.
//!
//! * *Placement.* A miss first gives the stream's own cached blocks back to the arena (so that
//!   best fit sees them merged with their neighbours), and before growing the arena asks whether
//!   the frees of other free blocks completed, so that blocks of different streams merge. Where
//!   the device has no room left, a request that its segment cannot serve takes a free block of
//!   the other segment rather than move memory between them ([`Arena::take_across`]).
//! * *Growth* maps what the request lacks, rounded up to the granularity. At the top, while memory
//!   is plentiful, it maps at least an eighth of the segment, in handles of up to a sixteenth of
//!   the most memory live at once, so that a growing workload needs few mappings (each costs an
//!   access change on the device), and the memory of a large request, freed and cut up by smaller
//!   ones, can still be unmapped between them. Once the pool holds
//!   an eighth of what it may hold (the release threshold, the device's memory), it maps in handles
//!   of 1/32 of the most memory live at once, from half of it 1/64, so that free blocks can later
//!   be unmapped nearly whole, and near the device's capacity in handles of 1/256 of it; past the headroom and near
//!   capacity it maps exactly what is missing. A growth the
//!   driver refuses part-way unmaps what it mapped.
//! * *Release* unmaps whole mappings that lie inside free blocks whose frees the host has seen
//!   complete, highest first. What they leave is a *hole* ([`State::Hole`]): addresses without
//!   memory, which a later growth maps again when that joins free blocks. So memory freed between
//!   long-lived blocks goes where it is needed, which no chunked pool can do: physical memory
//!   is not tied to its addresses. Holes at the top shrink the segment. Every bound unmaps
//!   anywhere: the release threshold, the device's capacity, out of memory, and the headroom.
//!   A growth happens only when no free block holds its request, so the free memory left
//!   between live blocks then is of no use to it; left mapped, it is what lets reserved memory
//!   run away from live memory when sizes creep up (a KV cache grown by concatenation frees a
//!   block just too small for the next layer's: reserved reached 1.53× the peak of live memory
//!   on 60 such synthetic decoders while only the segments' tops were unmapped for the
//!   headroom, and 1.27× since). A later request that needs the hole maps it again.
//! * A segment with nothing mapped gives its range back.
//!
//! Ordering across streams is the arena's: new memory is host-safe (nothing used it), and merges
//! with a neighbour free on the growing stream or host-safe.

use super::arena::{Arena, Detached, Grow};
use super::backend::{Backend, RANGE_PER_BYTE};
use super::blocks::{Block, Chunk, Kind, NIL, Segment, State};
use super::error::PoolError;
use super::release::Completion;
use super::round_up;

/// The handle size once memory is pressed: 1/64 of the most memory live at once, at least the
/// granularity and at most 64 MiB (or the granularity, if larger). A free block can be unmapped
/// but for less than a handle at each end.
fn fine_handle(peak_live: usize, granularity: usize) -> usize {
    handle_of(peak_live / 64, 64 << 20, granularity)
}

/// The handle size from an eighth of what the pool may hold to half of it: 1/32 of the most
/// memory live at once, at least the granularity and at most 64 MiB (or the granularity, if
/// larger). See [`Arena::grow_segment`].
fn middle_handle(peak_live: usize, granularity: usize) -> usize {
    handle_of(peak_live / 32, 64 << 20, granularity)
}

/// `share` of the most memory live at once as a handle size: at least the granularity and at
/// most `most` (or the granularity, if larger), in whole granules.
fn handle_of(share: usize, most: usize, granularity: usize) -> usize {
    round_up(share.clamp(granularity, most.max(granularity)), granularity).unwrap_or(granularity)
}

/// The handle size near the device's capacity: 1/256 of the most memory live at once, at least
/// the granularity and at most 16 MiB (or the granularity, if larger). What is free there is
/// often cut into pieces between live blocks, and only a piece that holds a whole mapping can
/// be unmapped for a request elsewhere. Replayed in 1.10 times their peak of live memory, 4 of
/// 60 synthetic decoders whose KV caches grow by concatenation ran out of memory with
/// [`fine_handle`]s there, none with these. They cost more mappings under such a budget (2-33%
/// more on the traces in `traces/`, 8-75% on the synthetic families of the property tests), and
/// none without one.
fn tight_handle(peak_live: usize, granularity: usize) -> usize {
    handle_of(peak_live / 256, 16 << 20, granularity)
}

/// Once the free memory that live blocks strand in a segment (free bytes that no whole mapping
/// holds, [`Arena::stranded`]) passes this part of the most memory live at once (about 2%), the
/// segment maps [`tight_handle`]s whenever memory is pressed, not only near the device's
/// capacity. A workload that places long-lived blocks between short-lived ones (optimizer state
/// made lazily between activations, caches built on the way) cuts every mapping it lands in, and
/// the free memory between those blocks can be given back only in whole mappings: with handles
/// of up to 64 MiB made before the device was nearly full, 15 of 200 replays of synthetic
/// training loops that accumulate state ran out of memory under 1.10 times their peak of live
/// memory (one with 306 MiB free, 44 MiB of it in whole mappings, for a request of 69 MiB), and
/// 13 of 384 replays of eight variants of them (long-lived blocks of 0.5 to 200 MB, in every
/// layer to every eighth, activations of 2 to 500 MB: `accumulating_variants_figures`). With this
/// rule none did (with a part of 1/32, some still did); the other synthetic families and the
/// traces in `traces/` fit as before, with 0 to 118% more mappings under such budgets (none
/// without one).
pub(crate) const STRANDED_PART: usize = 48;

/// The largest handle while memory is plentiful: 1/16 of the most memory live at once, at least
/// 16 MiB (or the granularity, if larger). A large growth maps several, so that once its request
/// is freed and the memory cut up by smaller blocks, what they leave free can still be unmapped
/// for a later request of another shape (replayed at 1.10 times their peak of live memory, 7 of
/// 60 heavy-tailed synthetic traces ran out of memory with one handle per growth, none with
/// these; the traces in `traces/` made 31 to 81 map calls cold instead of 25 to 43, and since
/// smaller handles start at an eighth of what the pool may hold, 108 to 191).
fn coarse_handle(peak_live: usize, granularity: usize) -> usize {
    round_up((peak_live / 16).max(16 << 20).max(granularity), granularity).unwrap_or(granularity)
}

/// When [`Arena::take_across`] looks in the other segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Across {
    /// Before growing, for a small request, when the device has no room to map it.
    SmallWhenFull,
    /// After a growth found no room, before the out-of-memory recovery.
    BeforeRecovery,
}

/// Where to map for a request: the address, the bytes to map there, and whether it is the top.
#[derive(Debug, Clone, Copy)]
struct Placement {
    at: u64,
    bytes: usize,
    top: bool,
}

impl<B: Backend> Arena<B> {
    /// [`Arena::grow`] in segments: maps memory into `kind`'s segment for a request of `size`
    /// rounded bytes on stream `s`, and hands out its block.
    pub(crate) fn grow_segment(
        &mut self,
        b: &B,
        s: u32,
        kind: Kind,
        size: usize,
        headroom: bool,
        may_release: bool,
    ) -> Result<Grow, PoolError<B::Error>> {
        let info = self.segments.expect("growing in segments");
        let gran = info.granularity;
        let c = self.segment_of[kind as usize];
        if c != NIL && self.chunks[c].segment.as_ref().is_some_and(|seg| seg.unmapping > 0) {
            return Ok(Grow::Busy);
        }
        // (Not for a graph's allocation, from the host-safe state of no stream: it may be made
        // during a capture, where nothing may be recorded or queried.)
        if c != NIL
            && self.streams[s].key.is_some()
            && let Some(handout) = self.merge_before_growing(b, c, s, kind, size)?
        {
            return Ok(Grow::Block(handout));
        }
        let place = match c {
            // (The range to reserve must hold it, as a segment's room must: see below.)
            NIL => round_up(size, gran).filter(|&bytes| bytes <= info.reserve).map(|bytes| Placement {
                at: 0,
                bytes,
                top: true,
            }),
            c => self.placement(c, s, size, gran),
        };
        // No room left in the range (it spans several times the device's memory, holes
        // included), nor a hole that would do.
        let Some(place) = place else { return Ok(Grow::OutOfMemory) };
        let missing = place.bytes;
        let mapped = if c == NIL { 0 } else { self.chunks[c].segment.as_ref().map_or(0, |seg| seg.mapped) };
        let peak = self.note_live(size);
        let mut step = if place.top { missing.max(round_up(mapped / 8, gran).unwrap_or(missing)) } else { missing };
        let before = self.device_free(b);
        let free = before.map(|f| self.usable(f));
        let tight = self.runs_short(free, step);
        if tight {
            step = missing;
        }
        // Two bounds: the release threshold and, near capacity, the device's memory are hard;
        // the headroom is soft (the pool grows past it when no free memory can be unmapped).
        // For both, free mappings are unmapped anywhere in the segments, between live blocks
        // too: no free block holds this request, and free memory left mapped between live
        // blocks is how reserved memory runs away from live memory (see the module's *Release*).
        let reserved = self.stats.reserved;
        let (hard, soft) = self.growth_limits(peak, headroom, tight, free);
        let exact = tight || reserved.saturating_add(step) > soft;
        if exact {
            step = missing;
        }
        // Once the pool holds an eighth of what it may hold (the release threshold, the device's
        // memory), it maps in smaller handles, so that the free blocks it makes can later be
        // unmapped nearly whole (a mapping is unmapped only whole): 1/32 of the most memory live
        // at once, from half of what it may hold 1/64. Before, in handles of up to a sixteenth
        // (each handle costs an access change on the device): one handle per growth would leave
        // the memory of a large request, once freed and cut up by smaller ones, pinned whole by
        // any of them. Handles mapped early stay for the workload's life, cut up by its
        // long-lived blocks, where the small ones are needed later: with large handles up to
        // half of what the pool may hold, 10 of 600 replays of synthetic KV-cache decoders
        // (cold, then warm, in 1.10x their peak of live memory plus 0-16 MiB) ran out of memory,
        // with the free memory in pieces that held no whole mapping. With 1/32 from an eighth,
        // none did, for 3-22% more mappings under such budgets (1/64 from an eighth: 10-59%;
        // 1/32 all the way: 8 failures). A workload that takes less than an eighth of the
        // device maps as before.
        let may_hold = self.config.release_threshold.min(free.map_or(usize::MAX, |f| reserved.saturating_add(f)));
        let grown = reserved.saturating_add(step);
        let pressed = exact || grown > may_hold / 8;
        // A workload whose live blocks already strand free memory between them (no whole
        // mapping under it to unmap) maps the handles of tight memory as soon as it is pressed:
        // its live blocks would cut larger ones too (see `STRANDED_PART`).
        let fine_grained = || c != NIL && self.stranded(c) > peak / STRANDED_PART;
        // Without release (a graph's allocation, during a capture), one handle: a refusal leaves
        // nothing mapped to undo.
        let handle = match (pressed, may_release) {
            (true, true) if tight || fine_grained() => tight_handle(peak, gran),
            (true, true) if !exact && grown <= may_hold / 2 => middle_handle(peak, gran),
            (true, true) => fine_handle(peak, gran),
            (false, true) => step.min(coarse_handle(peak, gran)),
            (_, false) => step,
        };
        // The headroom is never above the hard bounds, so unmapping to stay within it serves both.
        debug_assert!(soft <= hard);
        if may_release && reserved.saturating_add(missing) > soft {
            let target = soft.saturating_sub(missing);
            let mut detached = Vec::new();
            let left = reserved - self.releasing_bytes();
            self.detach_segment_maps(b, left, target, Completion::Poll, &mut detached);
            if !detached.is_empty() {
                return Ok(Grow::Release(detached));
            }
        }
        // What the device cannot hold even now is refused before any of it is mapped: mapped
        // handle by handle until the driver refused, then unmapped, it would take all of the
        // device's free memory for a moment, and other allocations would fail meanwhile.
        if free.is_some_and(|f| missing > f) && self.fresh_device_free(b).is_some_and(|reported| missing > reported) {
            return Ok(Grow::OutOfMemory);
        }
        let c = match c {
            NIL => {
                // The range is several times the device's memory; a driver that refuses that much
                // may give the device's memory, and one that gives none leaves chunks.
                let one = round_up(info.reserve / RANGE_PER_BYTE, gran).unwrap_or(info.reserve);
                let range = b
                    .reserve(info.reserve)
                    .map(|va| (va, info.reserve))
                    .or_else(|_| b.reserve(one).map(|va| (va, one)));
                match range {
                    Ok((va, bytes)) => self.add_segment(kind, va, bytes),
                    Err(_) if self.chunks.iter().next().is_none() => {
                        self.segments = None;
                        return self.grow(b, s, size, headroom, may_release);
                    }
                    Err(e) if b.is_out_of_memory(&e) => return Ok(Grow::OutOfMemory),
                    Err(e) => return Err(PoolError::Backend(e)),
                }
            }
            c => c,
        };
        let span = self.chunks[c].size;
        let room = self.chunks[c].segment.as_ref().map_or(0, |seg| seg.reserved - span);
        if place.top && room < missing {
            // A first growth whose range (the smaller one a driver gave) cannot hold the request:
            // refused before anything is mapped, as `placement` refuses it in a segment that has
            // grown. Mapped up to the end of the range (where the device's free memory is not
            // known, every free byte of it), then unmapped, it only kept that memory from other
            // allocations for a while.
            self.free_empty_segment(b, c);
            return Ok(Grow::OutOfMemory);
        }
        let step = if place.top { step.min(room) } else { step };
        let at = if place.top { self.chunks[c].ptr + span as u64 } else { place.at };
        // Map `step` bytes (at least `missing`) from `at`, handle by handle; on out of memory,
        // only `missing`. What is mapped before a failure stays, free.
        let (mut done, mut goal) = (0, step);
        while done < goal {
            let bytes = handle.min(goal - done);
            let hole = if place.top { NIL } else { self.block_at(c, at + done as u64) };
            match b.map(at + done as u64, bytes) {
                Ok(h) => {
                    self.add_mapping(c, s, at + done as u64, bytes, h, hole);
                    let stats = &mut self.stats;
                    stats.driver_allocs += 1;
                    stats.driver_alloc_bytes = stats.driver_alloc_bytes.saturating_add(bytes as u64);
                    stats.reserved += bytes;
                    stats.peak_reserved = stats.peak_reserved.max(stats.reserved);
                    done += bytes;
                }
                Err(e) if b.is_out_of_memory(&e) => {
                    // What was free before this growth, less what it has mapped since.
                    self.learn_spare_after_refusal(b, before.map(|f| f.saturating_sub(done)), bytes);
                    if goal == missing {
                        break;
                    }
                    goal = missing;
                }
                Err(e) => {
                    // A driver that reports virtual memory management but does not offer it
                    // for the first mapping the pool ever makes (an interposer, or a driver model
                    // that keeps `cuMemCreate` from the process) leaves chunks, as one that
                    // refuses the address range does: `cuMemAlloc` serves where the virtual
                    // memory calls do not. (A call that failed once is only an error.)
                    if self.stats.driver_allocs == 0 && b.is_unsupported(&e) {
                        self.free_empty_segments(b);
                        if self.chunks.iter().next().is_none() {
                            self.segments = None;
                            return self.grow(b, s, size, headroom, may_release);
                        }
                    } else {
                        self.free_empty_segment(b, c);
                    }
                    return Err(PoolError::Backend(e));
                }
            }
        }
        if done < missing {
            // What was mapped for the request goes back (untouched, it needs no wait), so that a
            // refused request leaves the pool as it found it.
            let undo = self.cut_mappings(c, at, done);
            if undo.is_empty() {
                self.free_empty_segment(b, c);
                return Ok(Grow::OutOfMemory);
            }
            return Ok(Grow::Refused(undo));
        }
        // `placement` follows `file_free`'s merge rule, so the block holds the request. Were it
        // not so, the memory would stay free in the arena for a later look.
        let blk = self.free_block_at(c, at);
        debug_assert!(self.blocks[blk].size >= size, "a segment grew by less than the request");
        if self.blocks[blk].size < size {
            return Ok(Grow::OutOfMemory);
        }
        self.unlist(blk);
        Ok(Grow::Block(self.handout(blk, size)))
    }

    /// In segments, a free block of the other segment for a request of `size` rounded bytes on
    /// stream `s` that its own segment cannot serve, where growing would cost more than it gains
    /// (`None` in chunks, or when no such block holds it):
    ///
    /// * [`Across::SmallWhenFull`]: a small request, when the device has no room to map a granule
    ///   for it. Its segment would grow by unmapping free memory elsewhere (the large segment's,
    ///   usually) to map it again beside the small blocks, and the next large request would move
    ///   it back: driver calls both ways for each such request, where a free block of the large
    ///   segment holds it at once. Replayed in 1.10 times their peak of live memory, training
    ///   loops of mixture-of-experts models (`tests/workloads.rs`) moved memory so for a router's
    ///   0.8 MiB tensor at every step: 368 of one replay's 602 growths, 5,000-9,100 ns per event
    ///   cold (4,500-8,800 warm) on an H100 through the TCC interposer against the driver pool's
    ///   2,000-3,300 unconstrained; 1,300-2,400 (260-520 warm) with the block taken.
    /// * [`Across::BeforeRecovery`]: any request whose growth found no room. The out-of-memory
    ///   recovery (waiting for every stream's frees, giving every cache back, unmapping what is
    ///   free and growing again) ends there whenever unmapping cannot make room for the request
    ///   either: 1,106 times in one replay of beam search per hypothesis in 1.10 times its peak,
    ///   about 200 µs each on that H100 (4,000 ns per event cold; 2,100 with the block taken
    ///   first). Alone, this rule left every fit and mapping of the simulated sweeps as it was.
    ///
    /// Together, over the workload families' sweep (16 families, 1.10 times their peak plus 0-16
    /// MiB, cold then warm), out-of-memory runs fell from 132 to 123 of 2,400 (MoE inference 10 to
    /// 2, Adam on heterogeneous tensors 49 to 44, evaluation passes 12 to 10; beam search per
    /// hypothesis rose from 25 to 31, all at peaks of 95-231 MB) and the MoE training loops'
    /// mappings from 45,576 to 19,498; the sweep of `budget_robustness_figures` and the traces in
    /// `traces/` fitted and mapped as before. A small block in the large segment pins at most the
    /// mappings it spans; large requests taken into the small segment before growing too, whenever
    /// the device was full, cut it up: 133 failures.
    pub(crate) fn take_across(
        &mut self,
        b: &B,
        s: u32,
        size: usize,
        when: Across,
    ) -> Result<Option<super::Handout>, B::Error> {
        let Some(info) = self.segments else { return Ok(None) };
        if when == Across::SmallWhenFull {
            if self.kind_for(size) != Kind::Small {
                return Ok(None);
            }
            let granule = round_up(size, info.granularity).unwrap_or(usize::MAX);
            if self.device_free(b).is_none_or(|free| self.usable(free) >= granule) {
                return Ok(None);
            }
        }
        self.take_last_resort(b, s, size)
    }

    /// Before `kind`'s segment `c` grows for a request of `size` bytes on stream `s`: asks
    /// (without blocking) whether the frees of the streams' free blocks there completed, merges
    /// what may merge then, and looks again. Free blocks of different streams merge only once
    /// both are host-safe, so a request larger than each may fit their union.
    fn merge_before_growing(
        &mut self,
        b: &B,
        c: u32,
        s: u32,
        kind: Kind,
        size: usize,
    ) -> Result<Option<super::Handout>, B::Error> {
        let pending: Vec<(u32, u64)> = self
            .streams
            .iter()
            .filter(|&(_, st)| !st.free[kind as usize].is_empty() && st.completed < st.seq)
            .map(|(i, st)| (i, st.seq))
            .collect();
        if pending.is_empty() {
            return Ok(None);
        }
        // A poll that fails leaves those frees pending (see `completed_as`): the growth goes on.
        let (mut any, mut how) = (false, Completion::Poll);
        for (i, seq) in pending {
            any |= self.completed_as(b, i, seq, &mut how);
        }
        if !any {
            return Ok(None);
        }
        self.coalesce_chunk(c);
        self.take(b, s, size)
    }

    /// The cheapest place in segment `c` to map memory for a request of `size` bytes on stream
    /// `s`: the one that maps the fewest bytes, counting the free neighbours the new memory
    /// merges with. A hole wins a tie with the top (it fills addresses already spanned). `None`
    /// when neither the range's room above the top nor a hole will do.
    fn placement(&self, c: u32, s: u32, size: usize, gran: usize) -> Option<Placement> {
        let lacking = |have: usize| round_up(size.saturating_sub(have).max(1), gran);
        let below_top = self.merged(self.top_block(c), NIL, s).0;
        let room = self.chunks[c].segment.as_ref().map_or(0, |seg| seg.reserved - self.chunks[c].size);
        let mut best =
            lacking(below_top).filter(|&bytes| bytes <= room).map(|bytes| Placement { at: 0, bytes, top: true });
        let mut cur = self.chunks[c].first;
        while cur != NIL {
            let block = &self.blocks[cur];
            if block.state == State::Hole {
                // Mapped from the hole's start, memory merges with the free blocks below; mapped
                // whole, with those above too.
                let (before, after) = self.merged(block.prev, block.next, s);
                let bytes = match lacking(before)? {
                    fits if fits <= block.size => Some(fits),
                    _ if before + block.size + after >= size => Some(block.size),
                    _ => None,
                };
                if let Some(bytes) = bytes.filter(|&n| best.is_none_or(|b| n <= b.bytes)) {
                    best = Some(Placement { at: block.ptr, bytes, top: false });
                }
            }
            cur = block.next;
        }
        best
    }

    /// The bytes that new memory of stream `s` between blocks `below` and `above` would merge
    /// with, below it and above it, as [`Arena::file_free`] merges: down from `below` while
    /// blocks may merge, then up from `above` (each merge may change the merged block's sequence
    /// number, and so what may merge next).
    fn merged(&self, below: u32, above: u32, s: u32) -> (usize, usize) {
        let mut seq = 0;
        let mut sums = [0; 2];
        for (sum, start, down) in [(0, below, true), (1, above, false)] {
            let mut cur = start;
            while cur != NIL
                && let Some(q) = self.merge_target(cur, s, seq)
            {
                sums[sum] += self.blocks[cur].size;
                seq = q;
                cur = if down { self.blocks[cur].prev } else { self.blocks[cur].next };
            }
        }
        (sums[0], sums[1])
    }

    /// The free bytes of segment `c` that no whole mapping holds: memory that its live blocks
    /// strand (a mapping is unmapped only whole), which the pool cannot give back for a request
    /// elsewhere. See [`STRANDED_PART`].
    pub(crate) fn stranded(&self, c: u32) -> usize {
        let Some(seg) = self.chunks[c].segment.as_ref() else { return 0 };
        let mut stranded = 0;
        let mut cur = self.chunks[c].first;
        while cur != NIL {
            let b = &self.blocks[cur];
            if matches!(b.state, State::Free { .. }) {
                let whole: usize = seg.maps_within(b.ptr, b.ptr + b.size as u64).map(|(_, n, _)| n).sum();
                stranded += b.size - whole;
            }
            cur = b.next;
        }
        stranded
    }

    /// The last block of chunk `c` (`NIL` when it has none).
    pub(crate) fn top_block(&self, c: u32) -> u32 {
        let mut cur = self.chunks[c].first;
        while cur != NIL && self.blocks[cur].next != NIL {
            cur = self.blocks[cur].next;
        }
        cur
    }

    /// Records a new segment of `kind` over the reserved range `[va, va + reserved)`, with nothing
    /// mapped yet.
    fn add_segment(&mut self, kind: Kind, va: u64, reserved: usize) -> u32 {
        let segment = Segment { reserved, kind, maps: Default::default(), mapped: 0, unmapping: 0, refused: false };
        let chunk = Chunk { ptr: va, size: 0, first: NIL, out: 0, releasing: false, segment: Some(segment), unit: 0 };
        let c = self.chunks.insert(chunk);
        self.segment_of[kind as usize] = c;
        self.stats.chunks += 1;
        c
    }

    /// Puts mapping `(at, bytes, handle)` into segment `c`: at its top (`hole` is `NIL`), or at the
    /// start of `hole`. The memory becomes a free, host-safe block of stream `s`, merged with its
    /// neighbours where allowed. Returns the free block that holds it (listed). The caller counts
    /// the bytes as reserved.
    fn add_mapping(&mut self, c: u32, s: u32, at: u64, bytes: usize, handle: u64, hole: u32) -> u32 {
        let seg = self.chunks[c].segment.as_mut().expect("a segment");
        seg.maps.insert(at, (bytes, handle));
        seg.mapped += bytes;
        let kind = seg.kind;
        let blk = match hole {
            NIL => {
                let top = self.top_block(c);
                let chunk = &mut self.chunks[c];
                debug_assert_eq!(chunk.ptr + chunk.size as u64, at, "a mapping at the top goes at its end");
                chunk.size += bytes;
                let blk = self.blocks.insert(Block {
                    ptr: at,
                    size: bytes,
                    chunk: c,
                    kind,
                    prev: top,
                    next: NIL,
                    state: State::Free { stream: s, seq: 0 },
                    slack: 0,
                });
                match top {
                    NIL => self.chunks[c].first = blk,
                    top => self.blocks[top].next = blk,
                }
                blk
            }
            hole => self.carve(hole, at, bytes),
        };
        self.file_free(blk, s, 0);
        self.free_block_at(c, at)
    }

    /// Cuts `[at, at + len)` out of block `blk` (a hole, or a free block taken off its list) as a
    /// block of its own, which is returned. The pieces before and after keep `blk`'s state, and go
    /// back on their lists if free.
    fn carve(&mut self, blk: u32, at: u64, len: usize) -> u32 {
        let (ptr, size) = (self.blocks[blk].ptr, self.blocks[blk].size);
        debug_assert!(ptr <= at && at + len as u64 <= ptr + size as u64, "carving outside the block");
        let mut mid = blk;
        if at > ptr {
            mid = self.split_after(blk, (at - ptr) as usize);
        }
        let after = (at + (len as u64) < ptr + size as u64).then(|| self.split_after(mid, len));
        for piece in [(mid != blk).then_some(blk), after].into_iter().flatten() {
            if matches!(self.blocks[piece].state, State::Free { .. }) {
                self.list(piece);
            }
        }
        mid
    }

    /// Makes `blk` a hole and merges it with the holes beside it.
    fn make_hole(&mut self, mut blk: u32) {
        self.blocks[blk].state = State::Hole;
        let prev = self.blocks[blk].prev;
        if prev != NIL && self.blocks[prev].state == State::Hole {
            self.absorb(prev, blk);
            blk = prev;
        }
        let next = self.blocks[blk].next;
        if next != NIL && self.blocks[next].state == State::Hole {
            self.absorb(blk, next);
        }
    }

    /// Cuts the mappings of `[at, at + len)` of segment `c` (all of them in one free block, never
    /// used) out of it, leaving a hole; returns them to be unmapped.
    fn cut_mappings(&mut self, c: u32, at: u64, len: usize) -> Vec<Detached> {
        let seg = self.chunks[c].segment.as_ref().expect("a segment");
        let maps: Vec<(u64, usize, u64)> =
            seg.maps.range(at..at + len as u64).rev().map(|(&p, &(n, h))| (p, n, h)).collect();
        maps.into_iter().map(|(p, n, handle)| self.unmap_in(self.block_at(c, p), p, n, handle).0).collect()
    }

    /// Makes mapping `(at, bytes, handle)`, which lies in free block `blk` (listed), a hole, and
    /// returns it to be unmapped, with the block cut out of `blk` for it (`blk` itself when the
    /// mapping starts it; what was below it stays `blk`, free).
    fn unmap_in(&mut self, blk: u32, at: u64, bytes: usize, handle: u64) -> (Detached, u32) {
        let c = self.blocks[blk].chunk;
        self.unlist(blk);
        let mid = self.carve(blk, at, bytes);
        self.make_hole(mid);
        let seg = self.chunks[c].segment.as_mut().expect("a segment");
        seg.maps.remove(&at);
        seg.mapped -= bytes;
        seg.unmapping += bytes;
        (Detached { chunk: c, ptr: at, size: bytes, handle: Some(handle) }, mid)
    }

    /// Unmaps free memory of the segments while more than `target` of `reserved` bytes would
    /// stay: whole mappings inside free blocks whose frees completed (`how`; a failed poll
    /// decides nothing: [`Arena::completed_as`]), highest first, in the large segment first.
    /// Each leaves a hole at once; the mappings are returned to be unmapped with no lock held,
    /// then reported with [`Arena::finish_release`].
    pub(crate) fn detach_segment_maps(
        &mut self,
        b: &B,
        mut reserved: usize,
        target: usize,
        mut how: Completion,
        out: &mut Vec<Detached>,
    ) {
        for c in self.segment_of.into_iter().rev() {
            if c == NIL || self.chunks[c].segment.as_ref().is_some_and(|seg| seg.unmapping > 0) {
                continue;
            }
            let mut cur = self.top_block(c);
            while cur != NIL && reserved > target {
                let prev = self.blocks[cur].prev;
                if let State::Free { stream, seq } = self.blocks[cur].state {
                    let (ptr, end) = (self.blocks[cur].ptr, self.blocks[cur].ptr + self.blocks[cur].size as u64);
                    let seg = self.chunks[c].segment.as_ref().expect("a segment");
                    let inside: Vec<(u64, usize, u64)> = seg.maps_within(ptr, end).rev().collect();
                    let done = !inside.is_empty() && self.completed_as(b, stream, seq, &mut how);
                    if done {
                        for (at, bytes, handle) in inside {
                            if reserved <= target {
                                break;
                            }
                            // A mapping at the block's start takes `cur` itself, and is the last
                            // inside it.
                            let (detached, mid) = self.unmap_in(cur, at, bytes, handle);
                            out.push(detached);
                            reserved -= bytes;
                            if mid == cur {
                                break;
                            }
                        }
                        self.maybe_reap(stream);
                    }
                }
                cur = prev;
            }
        }
    }

    /// Settles a segment's mappings after their unmapping: an unmapped one leaves the pool; one
    /// whose unmapping failed is mapped memory again, free and host-safe. Holes at the top then
    /// shrink the segment, and a segment left with nothing mapped gives its range back.
    pub(crate) fn finish_unmap(&mut self, b: &B, done: &[(Detached, bool)]) {
        let mut segments: Vec<u32> = Vec::new();
        for &(d, unmapped) in done {
            segments.push(d.chunk);
            let seg = self.chunks[d.chunk].segment.as_mut().expect("a segment's mapping");
            seg.unmapping -= d.size;
            if unmapped {
                self.stats.reserved -= d.size;
                self.stats.driver_frees += 1;
                continue;
            }
            // Counted as reserved all along.
            seg.maps.insert(d.ptr, (d.size, d.handle.expect("a mapping")));
            seg.mapped += d.size;
            let hole = self.block_at(d.chunk, d.ptr);
            let blk = self.carve(hole, d.ptr, d.size);
            let s = self.host_slot();
            self.file_free(blk, s, 0);
        }
        segments.sort_unstable();
        segments.dedup();
        for c in segments {
            if self.chunks[c].segment.as_ref().is_some_and(|seg| seg.unmapping == 0) {
                self.trim_top_holes(c);
            }
            self.free_empty_segment(b, c);
        }
    }

    /// Drops a hole at the top of segment `c`: the segment ends at its last mapped block.
    fn trim_top_holes(&mut self, c: u32) {
        let top = self.top_block(c);
        if top == NIL || self.blocks[top].state != State::Hole {
            return;
        }
        let block = self.blocks.remove(top).expect("the top block exists");
        self.chunks[c].size -= block.size;
        match block.prev {
            NIL => self.chunks[c].first = NIL,
            prev => self.blocks[prev].next = NIL,
        }
    }

    /// Gives back the ranges of segments left empty whose range could not be given back before.
    pub(crate) fn free_empty_segments(&mut self, b: &B) {
        for c in self.segment_of {
            if c != NIL {
                self.free_empty_segment(b, c);
            }
        }
    }

    /// Lets the next failure to give a segment's range back be reported again: at teardown,
    /// where the range then stays reserved for good.
    pub(crate) fn rearm_refusals(&mut self) {
        for c in self.segment_of {
            if let Some(seg) = self.chunks.get_mut(c).and_then(|chunk| chunk.segment.as_mut()) {
                seg.refused = false;
            }
        }
    }

    /// Gives segment `c`'s range back if nothing is mapped or being unmapped in it (an error
    /// keeps it, to be used again).
    fn free_empty_segment(&mut self, b: &B, c: u32) {
        let chunk = &mut self.chunks[c];
        let Some(seg) = chunk.segment.as_mut() else { return };
        if seg.mapped > 0 || seg.unmapping > 0 {
            return;
        }
        // `cuMemAddressFree` does not wait for the device: allowed with the lock held. On error
        // the range stays, empty, and a later release tries again; the first failure is reported
        // (a lasting one would otherwise be reported at every release).
        if let Err(e) = b.free_reserve(chunk.ptr, seg.reserved) {
            if !std::mem::replace(&mut seg.refused, true) {
                b.report(e);
            }
            return;
        }
        let kind = seg.kind;
        let chunk = self.chunks.remove(c).expect("the segment exists");
        let mut cur = chunk.first;
        while cur != NIL {
            cur = self.blocks.remove(cur).expect("a hole of the segment").next;
        }
        self.segment_of[kind as usize] = NIL;
        self.stats.chunks -= 1;
    }
}

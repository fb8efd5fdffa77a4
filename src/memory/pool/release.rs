//! Giving memory back: whole free chunks leave the arena (to be freed with no lock held), streams
//! are forgotten, and free blocks merge once the host has seen their frees complete.

use super::arena::{Arena, Detached};
use super::backend::Backend;
use super::blocks::{NIL, State};
use super::stats::Leaked;

/// How to learn that frees completed when releasing memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completion {
    /// Use only what the host already saw complete (after the caller waited for the events).
    Known,
    /// Ask without blocking (`query`), recording where a record is missing; skip a chunk whose
    /// frees are not complete yet.
    Poll,
}

impl<B: Backend> Arena<B> {
    /// Takes whole free chunks off the free lists until at most `target` bytes would stay
    /// reserved (or no releasable chunk is left): first the smallest one that alone is enough,
    /// then the largest first. A chunk is releasable when every block in it is free and host-safe.
    /// The caller frees the returned chunks with no lock held, then reports them with
    /// [`Arena::finish_release`]. A poll that fails (`Completion::Poll`) decides nothing: see
    /// [`Arena::completed_as`].
    pub(crate) fn detach_free_chunks(&mut self, b: &B, target: usize, mut how: Completion) -> Vec<Detached> {
        let mut detached = Vec::new();
        if self.segments.is_some() {
            // A segment left empty keeps its range only while giving it back fails.
            self.free_empty_segments(b);
        }
        let mut reserved = self.stats.reserved - self.releasing_bytes();
        if reserved <= target {
            return detached;
        }
        if self.segments.is_some() {
            self.detach_segment_maps(b, reserved, target, how, &mut detached);
            return detached;
        }
        let mut idle: Vec<(usize, u32)> =
            self.chunks.iter().filter(|(_, c)| c.out == 0 && !c.releasing).map(|(i, c)| (c.size, i)).collect();
        // Largest first (fewest driver calls), but a single chunk that is enough alone before them.
        idle.sort_unstable_by(|x, y| y.cmp(x));
        let need = reserved - target;
        let enough = idle.partition_point(|&(size, _)| size >= need);
        if enough > 0 {
            idle[..enough].rotate_right(1);
        }
        for (size, c) in idle {
            if reserved <= target {
                break;
            }
            if self.chunk_is_host_safe(b, c, &mut how) {
                detached.push(self.detach_chunk(c));
                reserved -= size;
            }
        }
        detached
    }

    /// Whether the frees of stream `s` up to `seq` are known complete, learnt as `how` says, for
    /// a release or a merge: with `Completion::Poll` the driver is asked without blocking
    /// ([`Arena::poll_complete`]). A poll that fails leaves them not known complete: the error
    /// goes to [`Backend::report`], and `how` turns to `Completion::Known`, so that the rest of
    /// the caller's look asks the driver nothing more. Such an error (a record on a stream
    /// where another thread began a capture since the pool looked, a failed query) is no reason
    /// to fail the allocation that made room, or to stop releasing other streams' memory.
    pub(crate) fn completed_as(&mut self, b: &B, s: u32, seq: u64, how: &mut Completion) -> bool {
        if *how == Completion::Poll {
            match self.poll_complete(b, s, seq) {
                Ok(done) => return done,
                Err(e) => {
                    b.report(e);
                    *how = Completion::Known;
                }
            }
        }
        self.host_safe(s, seq)
    }

    /// Bytes of the chunks being freed, and of the mappings being unmapped.
    pub(crate) fn releasing_bytes(&self) -> usize {
        self.chunks
            .iter()
            .map(|(_, c)| match &c.segment {
                Some(seg) => seg.unmapping,
                None if c.releasing => c.size,
                None => 0,
            })
            .sum()
    }

    /// Whether every block of free chunk `c` is host-safe (learnt as `how` says:
    /// [`Arena::completed_as`]).
    fn chunk_is_host_safe(&mut self, b: &B, c: u32, how: &mut Completion) -> bool {
        let mut cur = self.chunks[c].first;
        while cur != NIL {
            let block = &self.blocks[cur];
            let State::Free { stream, seq } = block.state else {
                unreachable!("a chunk with nothing out has only free blocks")
            };
            let next = block.next;
            if !self.completed_as(b, stream, seq, how) {
                return false;
            }
            cur = next;
        }
        true
    }

    /// Takes chunk `c` (all its blocks free and host-safe) off the free lists.
    fn detach_chunk(&mut self, c: u32) -> Detached {
        let chunk = &mut self.chunks[c];
        chunk.releasing = true;
        let (ptr, size, mut cur) = (chunk.ptr, chunk.size, chunk.first);
        while cur != NIL {
            self.unlist(cur);
            cur = self.blocks[cur].next;
        }
        Detached { chunk: c, ptr, size, handle: None }
    }

    /// Settles chunks taken off the free lists: a freed one (`true`) leaves the arena; one whose
    /// free failed goes back on the free lists, to be released later. (A segment's mappings:
    /// [`Arena::finish_unmap`].)
    pub(crate) fn finish_release(&mut self, b: &B, done: &[(Detached, bool)]) {
        // The driver has counted these as free since they were given back, and the pool counts
        // them from now on: a report of free memory taken in between would count them twice.
        self.forget_free_report();
        if self.segments.is_some() {
            self.finish_unmap(b, done);
            return;
        }
        let mut owners = Vec::new();
        for &(d, freed) in done {
            let first = self.chunks[d.chunk].first;
            if !freed {
                self.chunks[d.chunk].releasing = false;
                let mut cur = first;
                while cur != NIL {
                    self.list(cur);
                    cur = self.blocks[cur].next;
                }
                continue;
            }
            let chunk = self.chunks.remove(d.chunk).expect("a released chunk exists");
            let mut cur = chunk.first;
            while cur != NIL {
                let block = self.blocks.remove(cur).expect("a block of the chunk exists");
                if let State::Free { stream, .. } = block.state {
                    owners.push(stream);
                }
                cur = block.next;
            }
            self.stats.reserved -= chunk.size;
            self.stats.chunks -= 1;
            self.stats.driver_frees += 1;
        }
        owners.sort_unstable();
        owners.dedup();
        for s in owners {
            self.maybe_reap(s);
        }
    }

    /// Merges every pair of adjacent free blocks that may merge, in every chunk (after the host
    /// saw frees complete, blocks of different streams merge too).
    pub(crate) fn coalesce_all(&mut self) {
        for c in self.chunks.indices() {
            // A chunk being freed is off the free lists and must stay so.
            if !self.chunks[c].releasing {
                self.coalesce_chunk(c);
            }
        }
        self.reap_forgotten();
    }

    /// A cache of `stream` retired (its last user let go of it); once the stream has no cache
    /// left, forgets it: call it while the stream is still valid. Its free blocks stay in the
    /// arena: one last event is recorded on the stream to cover them, and other streams reuse
    /// them after waiting on it. Later calls with an equal stream value start afresh, so a
    /// recycled handle is safe. Unknown streams are ignored.
    ///
    /// A stream with a newer cache (made while this retirement waited for a capture to end) is
    /// not forgotten: that cache files its frees under the state's slot, which must not go to
    /// another stream. Its last retirement forgets it.
    ///
    /// Where the record fails, the arena keeps the stream (its key keeps the handle valid),
    /// flagged `retired`, and returns the error: [`Arena::retry_forgets`] forgets it later.
    pub(crate) fn retire_cache(&mut self, b: &B, stream: &B::Stream) -> Result<(), B::Error> {
        let Some(&s) = self.stream_slots.get(stream) else { return Ok(()) };
        // (0 where a teardown dropped the state its caches were counted in.)
        let caches = &mut self.streams[s].caches;
        *caches = caches.saturating_sub(1);
        if *caches > 0 {
            return Ok(());
        }
        self.forget_slot(b, s)
    }

    /// Forgets the stream in slot `s` ([`Arena::retire_cache`]).
    fn forget_slot(&mut self, b: &B, s: u32) -> Result<(), B::Error> {
        let st = &self.streams[s];
        if st.has_free_blocks()
            && st.seq > st.recorded
            && let Err(e) = self.record(b, s)
        {
            if !self.streams[s].retired {
                self.streams[s].retired = true;
                self.unforgotten += 1;
            }
            return Err(e);
        }
        self.unretire(s);
        // Frees filed on the stream after this point would be covered by no record; nothing files
        // any: its cache was given back before this call.
        if let Some(key) = self.streams[s].key.take() {
            self.stream_slots.remove(&key);
        }
        self.maybe_reap(s);
        Ok(())
    }

    /// Clears the `retired` flag of stream `s` (forgotten now, or a user came back).
    pub(crate) fn unretire(&mut self, s: u32) {
        if std::mem::take(&mut self.streams[s].retired) {
            self.unforgotten -= 1;
        }
    }

    /// Tries again to forget the streams whose last record failed when their last user went
    /// ([`Arena::retire_cache`]), except those capturing a graph (a record there would be
    /// captured). Each one's frees are then covered by a record that succeeded, its own now or
    /// one made since (a trim records on every stream with frees to wait for).
    ///
    /// The pool calls this where it already touches every stream (a trim, a teardown) and when
    /// another stream retires, so a failure that passes costs no stream for long. Errors are not
    /// reported again: the first one was, and the stream stays flagged.
    pub(crate) fn retry_forgets(&mut self, b: &B) {
        if self.unforgotten == 0 {
            return;
        }
        for s in self.streams.indices() {
            let st = &self.streams[s];
            if st.retired && !st.key.as_ref().is_some_and(|k| b.is_capturing(k)) {
                let _ = self.forget_slot(b, s);
            }
        }
    }

    /// Drops the state of every forgotten stream that holds no free block any more.
    pub(crate) fn reap_forgotten(&mut self) {
        for s in self.streams.indices() {
            self.maybe_reap(s);
        }
    }

    /// Drops the state of forgotten stream `s` once it holds no free block, listed or in a chunk
    /// being released (its event goes with it, destroyed when no wait holds it any more).
    pub(crate) fn maybe_reap(&mut self, s: u32) {
        if self.streams.get(s).is_some_and(|st| st.key.is_none() && !st.has_free_blocks())
            && !self.owns_releasing_block(s)
        {
            self.streams.remove(s);
        }
    }

    /// Whether a chunk being released holds a free block of stream `s`.
    fn owns_releasing_block(&self, s: u32) -> bool {
        self.chunks.iter().filter(|(_, c)| c.releasing).any(|(_, c)| {
            let mut cur = c.first;
            while cur != NIL {
                if matches!(self.blocks[cur].state, State::Free { stream, .. } if stream == s) {
                    return true;
                }
                cur = self.blocks[cur].next;
            }
            false
        })
    }

    /// What is still out of the arena at teardown, and the chunks that hold it.
    pub(crate) fn leaked(&self, allocations: usize, bytes: usize) -> Leaked {
        let mut leaked = Leaked { allocations, bytes, ..Leaked::default() };
        for (_, c) in self.chunks.iter() {
            leaked.chunks += 1;
            leaked.chunk_bytes += c.segment.as_ref().map_or(c.size, |seg| seg.mapped);
        }
        leaked
    }

    /// Drops every stream state that holds no free block, forgotten or not (teardown: the events
    /// go with them).
    pub(crate) fn forget_idle_streams(&mut self) {
        for s in self.streams.indices() {
            if !self.streams[s].has_free_blocks() && !self.owns_releasing_block(s) {
                self.unretire(s);
                let st = self.streams.remove(s).expect("listed above");
                if let Some(key) = st.key {
                    self.stream_slots.remove(&key);
                }
            }
        }
    }
}

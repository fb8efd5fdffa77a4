//! Stream states and events: when a block freed on one stream may be used on another.
//!
//! Each stream state counts the frees filed on it (`seq`), remembers the count when its one
//! reusable event was last recorded (`recorded`), and the count the host last saw complete
//! (`completed`). A free block with `seq <= recorded` is *covered*: a stream that waits (on the
//! GPU) for the event is ordered after the free. A block with `seq <= completed` is *host-safe*:
//! everything issued from now on, on any stream, runs after the free.

use super::arena::Arena;
use super::backend::Backend;
use super::blocks::{FreeList, KINDS};

/// What the pool knows about one stream.
pub(crate) struct StreamState<B: Backend> {
    /// The stream; `None` once forgotten (its remaining free blocks are all covered by `event`).
    pub(crate) key: Option<B::Stream>,
    /// Distinguishes this state from a later one in the same slot.
    pub(crate) epoch: u64,
    /// The one reusable event of the stream, created on first need.
    pub(crate) event: Option<B::Event>,
    /// Bumped by every batch of frees filed on this stream.
    pub(crate) seq: u64,
    /// `seq` at the last successful record of `event`.
    pub(crate) recorded: u64,
    /// `recorded` when the host last saw `event` complete. `completed <= recorded <= seq`.
    pub(crate) completed: u64,
    /// Free lists, indexed by `Kind`.
    pub(crate) free: [FreeList; KINDS],
    /// Graphs' blocks freed on this stream (outside a capture) before their graph was released:
    /// they come to this state, at the `seq` of their free, when it is. Until then the state is
    /// kept, and a forgotten stream's last record covers them.
    pub(crate) graph_frees: usize,
    /// Its last user went, but the last record that would let the arena forget it failed: the
    /// arena forgets it at a later chance ([`Arena::retry_forgets`]), unless a new user comes.
    pub(crate) retired: bool,
    /// The caches made for the stream ([`Arena::new_cache`]) and not retired yet. The state is
    /// forgotten only when the last one retires ([`Arena::retire_cache`]): a retirement may run
    /// late (a capture defers it), after the stream had a user and a cache again (a per-thread
    /// stream made again on its thread), and that cache files its frees under this state's slot.
    pub(crate) caches: u32,
}

impl<B: Backend> StreamState<B> {
    /// A state for `key`, or, with `None`, for blocks of no stream that are all host-safe (given
    /// back by graphs).
    pub(crate) fn new(key: Option<B::Stream>, epoch: u64) -> Self {
        Self {
            key,
            epoch,
            event: None,
            seq: 0,
            recorded: 0,
            completed: 0,
            free: std::array::from_fn(|_| FreeList::new()),
            graph_frees: 0,
            retired: false,
            caches: 0,
        }
    }

    /// Whether free blocks are filed on the stream, or will be (`graph_frees`).
    pub(crate) fn has_free_blocks(&self) -> bool {
        self.graph_frees > 0 || self.free.iter().any(|l| !l.is_empty())
    }
}

/// A host wait the arena asks for: run [`Backend::synchronize`] on `event` with no lock held, then
/// hand the wait back to [`Arena::complete`].
pub(crate) struct Wait<B: Backend> {
    slot: u32,
    epoch: u64,
    recorded: u64,
    pub(crate) event: B::Event,
}

impl<B: Backend> Arena<B> {
    /// Whether a block freed on stream `s` at `seq` is ordered before all work issued from now on.
    pub(crate) fn host_safe(&self, s: u32, seq: u64) -> bool {
        seq <= self.streams[s].completed
    }

    /// Records stream `s`'s event, covering every block freed on it so far.
    pub(crate) fn record(&mut self, b: &B, s: u32) -> Result<(), B::Error> {
        let st = &mut self.streams[s];
        let Some(key) = st.key.as_ref() else { unreachable!("a forgotten stream has all its free blocks covered") };
        if st.event.is_none() {
            st.event = Some(b.create_event()?);
            self.stats.events_created += 1;
        }
        b.record(st.event.as_ref().expect("created above"), key)?;
        st.recorded = st.seq;
        self.stats.event_records += 1;
        Ok(())
    }

    /// Makes stream `a` wait on the GPU for stream `src`'s last record.
    pub(crate) fn wait_on(&mut self, b: &B, a: u32, src: u32) -> Result<(), B::Error> {
        let waiter = self.streams[a].key.as_ref().expect("the allocating stream is known");
        let event = self.streams[src].event.as_ref().expect("a recorded stream has an event");
        b.wait(waiter, event)?;
        self.stats.event_waits += 1;
        Ok(())
    }

    /// Asks (without blocking) whether stream `s`'s frees up to `seq` are complete. A stream with
    /// frees not covered by a record gets one, unless a record is still pending: re-recording the
    /// one event earlier would move its completion away each time the GPU is busy.
    pub(crate) fn poll_complete(&mut self, b: &B, s: u32, seq: u64) -> Result<bool, B::Error> {
        if seq <= self.streams[s].completed {
            return Ok(true);
        }
        if self.streams[s].key.as_ref().is_some_and(|k| b.is_capturing(k)) {
            // Its events cannot be recorded or queried now; its frees stay pending.
            return Ok(false);
        }
        let st = &self.streams[s];
        if st.completed < st.recorded {
            // A record is pending: ask whether it is done.
            if self.query(b, s)? && seq <= self.streams[s].completed {
                return Ok(true);
            }
            if self.streams[s].completed < self.streams[s].recorded {
                return Ok(false);
            }
        }
        if seq > self.streams[s].recorded {
            if self.streams[s].key.is_none() {
                return Ok(false);
            }
            self.record(b, s)?;
            // An idle stream completes at once.
            self.query(b, s)?;
        }
        Ok(seq <= self.streams[s].completed)
    }

    /// Queries stream `s`'s event and, if it is complete, marks its record complete.
    fn query(&mut self, b: &B, s: u32) -> Result<bool, B::Error> {
        let st = &mut self.streams[s];
        let Some(event) = st.event.as_ref() else { return Ok(true) };
        let done = b.query(event)?;
        self.stats.event_queries += 1;
        if done {
            st.completed = st.recorded;
        }
        Ok(done)
    }

    /// The host waits needed before every free block is host-safe: each stream with free blocks
    /// not known complete gets a record if they are not covered, and its event is returned. The
    /// caller waits with no lock held, then calls [`Arena::complete`].
    ///
    /// A record that fails leaves that stream's frees since its last record pending (a wait for
    /// that record, if pending, is still returned), not the other streams': every stream is
    /// looked at, and the first error comes back beside the waits.
    pub(crate) fn waits_for_all_frees(&mut self, b: &B) -> (Vec<Wait<B>>, Result<(), B::Error>) {
        let mut waits = Vec::new();
        let mut first = Ok(());
        for s in self.streams.indices() {
            let st = &self.streams[s];
            if !st.has_free_blocks() || st.seq <= st.completed {
                continue;
            }
            if st.key.as_ref().is_some_and(|k| b.is_capturing(k)) {
                // Waiting for a capturing stream is impossible: its frees stay pending.
                continue;
            }
            if st.seq > st.recorded
                && st.key.is_some()
                && let Err(e) = self.record(b, s)
                && first.is_ok()
            {
                first = Err(e);
            }
            let st = &self.streams[s];
            if let Some(event) = &st.event
                && st.recorded > st.completed
            {
                waits.push(Wait { slot: s, epoch: st.epoch, recorded: st.recorded, event: event.clone() });
            }
        }
        (waits, first)
    }

    /// Marks the waits done (the host saw their events complete). A stream state that was
    /// replaced meanwhile is left alone.
    pub(crate) fn complete(&mut self, waits: &[Wait<B>]) {
        for w in waits {
            if let Some(st) = self.streams.get_mut(w.slot)
                && st.epoch == w.epoch
            {
                st.completed = st.completed.max(w.recorded);
            }
            self.stats.event_syncs += 1;
        }
    }
}

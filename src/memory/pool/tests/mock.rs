//! A mock device in logical time. Every operation on a stream ticks its clock; events carry the
//! clock of their record; GPU waits and host synchronisations join clocks. It checks that memory
//! is reused only when ordered after its last free, freed to the driver only when the host has
//! seen it free, and that no blocking call is made while the pool's arena is locked.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::super::backend::{Backend, Segments};
use super::IN_ARENA;

/// A mock stream: an index into the mock's streams.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct S(pub(super) usize);

/// Mock errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum MockErr {
    Oom,
    Injected,
    /// Injected, saying that the driver does not offer the call ([`State::unsupported`]).
    Unsupported,
}

impl fmt::Display for MockErr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Which backend call to fail once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    Alloc,
    Free,
    Create,
    Record,
    Wait,
    Sync,
    Query,
    /// Reserving or freeing an address range.
    Reserve,
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

/// The mock's state, shared with its events.
pub(super) struct State {
    pub(super) capacity: usize,
    /// What the emulated driver keeps back of `capacity - reserved` (refusing requests into it).
    pub(super) spare: usize,
    reserved: usize,
    next_ptr: u64,
    chunks: BTreeMap<u64, usize>,
    pub(super) chunk_allocs: u64,
    pub(super) chunk_frees: u64,
    clocks: Vec<Clock>,
    destroyed: Vec<bool>,
    /// Streams capturing a graph ([`Backend::is_capturing`]): a record or a wait on one would be
    /// captured, not run, and the mock refuses it as a bug of the pool.
    pub(super) capturing: Vec<bool>,
    /// Whether a record or a wait on a capturing stream fails (as the CUDA backend's does, under
    /// the stream's gate, for a capture begun by another thread since the pool asked) instead of
    /// panicking: for tests where threads begin captures racing the pool.
    pub(super) captures_race: bool,
    host: Clock,
    /// Per event: `None` never recorded, else the clock and `now` at its record.
    events: Vec<Option<(Clock, u64)>>,
    pub(super) live_events: usize,
    /// Host time, advanced by tests.
    pub(super) now: u64,
    /// An event completes (for `query`) this long after its record; `None`: never.
    pub(super) query_lag: Option<u64>,
    pub(super) calls: u64,
    pub(super) records: u64,
    pub(super) waits: u64,
    pub(super) syncs: u64,
    pub(super) queries: u64,
    /// Reports of free memory given.
    pub(super) free_memory_reports: u64,
    pub(super) fail: Option<Call>,
    /// Which backend call to unwind out of once, after it did its work (a free or unmap that
    /// panics once the driver gave the memory back).
    pub(super) unwind_after: Option<Call>,
    /// Whether to keep and check free records (off for trace replays, for speed).
    pub(super) check: bool,
    /// Live allocations: ptr -> (bytes, stream).
    live: BTreeMap<u64, (usize, usize)>,
    /// Past frees: (ptr, bytes, stream, time on that stream).
    frees: Vec<(u64, usize, usize, u64)>,
    /// Virtual memory management: `Some` (granularity, reservation size) makes `segments` offer it.
    pub(super) vmm: Option<(usize, usize)>,
    /// Whether every address reservation fails.
    pub(super) refuse_reserve: bool,
    /// The fault injected by `fail` says the driver does not offer the call
    /// ([`MockErr::Unsupported`]) instead of failing once.
    pub(super) unsupported: bool,
    /// Reserved address ranges: start -> bytes.
    pub(super) reservations: BTreeMap<u64, usize>,
    /// Mappings (also in `chunks`): start -> handle.
    mappings: BTreeMap<u64, u64>,
    next_handle: u64,
    /// Errors the pool reported ([`Backend::report`]) rather than returned.
    pub(super) reports: u64,
    /// Run once, with no lock of the mock held, by the next host synchronisation after it waited:
    /// a test's deterministic interleaving of another operation with a host wait of the pool.
    pub(super) on_sync: Option<Box<dyn FnOnce() + Send>>,
}

/// The mock device (a handle to its shared state).
#[derive(Clone)]
pub(super) struct Mock(Arc<Mutex<State>>);

/// An event of the mock; the last clone destroys it.
pub(super) struct MockEvent {
    id: usize,
    st: Arc<Mutex<State>>,
}

impl Drop for MockEvent {
    fn drop(&mut self) {
        let mut st = self.st.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        st.events[self.id] = None;
        st.live_events -= 1;
    }
}

impl Mock {
    pub(super) fn new(streams: usize) -> Mock {
        Mock(Arc::new(Mutex::new(State {
            capacity: usize::MAX,
            spare: 0,
            reserved: 0,
            next_ptr: 1 << 30,
            chunks: BTreeMap::new(),
            chunk_allocs: 0,
            chunk_frees: 0,
            clocks: vec![Clock::new(); streams],
            destroyed: vec![false; streams],
            capturing: vec![false; streams],
            captures_race: false,
            host: Clock::new(),
            events: Vec::new(),
            live_events: 0,
            now: 0,
            query_lag: Some(0),
            calls: 0,
            records: 0,
            waits: 0,
            syncs: 0,
            queries: 0,
            free_memory_reports: 0,
            fail: None,
            unwind_after: None,
            check: true,
            live: BTreeMap::new(),
            frees: Vec::new(),
            vmm: None,
            refuse_reserve: false,
            unsupported: false,
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            next_handle: 1,
            reports: 0,
            on_sync: None,
        })))
    }

    /// A mock with virtual memory management: 2 MiB pages, address ranges of `reserve` bytes.
    pub(super) fn with_vmm(streams: usize, reserve: usize) -> Mock {
        let m = Mock::new(streams);
        m.st().vmm = Some((2 << 20, reserve));
        m
    }

    pub(super) fn st(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// (event records, GPU waits) so far.
    pub(super) fn records_waits(&self) -> (u64, u64) {
        let st = self.st();
        (st.records, st.waits)
    }

    pub(super) fn new_stream(&self) -> usize {
        let mut st = self.st();
        st.clocks.push(Clock::new());
        st.destroyed.push(false);
        st.capturing.push(false);
        st.clocks.len() - 1
    }

    /// Checks an allocation the pool handed out on stream `s`, then queues its first use there.
    pub(super) fn allocated(&self, p: u64, bytes: usize, s: usize) {
        let mut st = self.st();
        // The first use is queued now: it runs after whatever the host has seen complete.
        st.tick(s);
        assert_eq!(p % 256, 0, "misaligned");
        let end = p + bytes.max(1) as u64;
        assert!(st.covered(p, end), "allocation {p:#x}..{end:#x} beyond the memory of its chunk or mappings");
        if let Some((&q, &(n, _))) = st.live.range(..=p).next_back() {
            assert!(q + n.max(1) as u64 <= p, "overlaps a live allocation");
        }
        if let Some((&q, _)) = st.live.range(p..).next() {
            assert!(end <= q, "overlaps a live allocation");
        }
        for &(fp, fl, fs, ft) in &st.frees {
            if fp < end && p < fp + fl as u64 {
                assert!(
                    at(&st.clocks[s], fs) >= ft,
                    "block {p:#x} reused on stream {s} before its free on stream {fs} (time {ft}) is ordered before it"
                );
            }
        }
        st.live.insert(p, (bytes, s));
    }

    /// Checks a block handed to a graph: every earlier free of its memory must be complete as the
    /// host sees it (a graph may launch on any stream, any time later).
    pub(super) fn check_host_safe(&self, p: u64, bytes: usize) {
        let st = self.st();
        let end = p + bytes.max(1) as u64;
        for &(fp, fl, fs, ft) in &st.frees {
            if fp < end && p < fp + fl as u64 {
                assert!(
                    at(&st.host, fs) >= ft,
                    "graph block {p:#x} overlaps a free on stream {fs} the host has not seen complete"
                );
            }
        }
        if let Some((&q, &(n, _))) = st.live.range(..=p).next_back() {
            assert!(q + n.max(1) as u64 <= p, "overlaps a live allocation");
        }
        if let Some((&q, _)) = st.live.range(p..).next() {
            assert!(end <= q, "overlaps a live allocation");
        }
    }

    /// Issues the free of `p` on stream `s` (after every use); returns its size. A correct user
    /// orders the freeing stream after every use on the allocating stream: modelled here.
    pub(super) fn freeing(&self, p: u64, s: usize) -> usize {
        let mut st = self.st();
        let (bytes, a) = st.live.remove(&p).expect("freeing a live allocation");
        if a != s {
            let c = st.clocks[a].clone();
            join(&mut st.clocks[s], &c);
        }
        let t = st.tick(s);
        if st.check {
            st.frees.push((p, bytes.max(1), s, t));
        }
        bytes
    }

    pub(super) fn destroy_stream(&self, s: usize) {
        self.st().destroyed[s] = true;
    }

    pub(super) fn is_destroyed(&self, s: usize) -> bool {
        self.st().destroyed[s]
    }

    pub(super) fn any_live_stream(&self) -> usize {
        self.st().destroyed.iter().rposition(|d| !d).expect("a live stream")
    }

    /// Live allocations: (pointer, bytes, stream).
    pub(super) fn live(&self) -> Vec<(u64, usize, usize)> {
        self.st().live.iter().map(|(&p, &(n, s))| (p, n, s)).collect()
    }

    /// (bytes reserved, chunks and address ranges held, chunk allocations and mappings, chunk
    /// frees and unmappings).
    pub(super) fn chunk_figures(&self) -> (usize, usize, u64, u64) {
        let st = self.st();
        let chunks = st.chunks.len() - st.mappings.len() + st.reservations.len();
        (st.reserved, chunks, st.chunk_allocs, st.chunk_frees)
    }

    pub(super) fn live_allocations(&self) -> Vec<(u64, usize)> {
        self.st().live.iter().map(|(&p, &(_, s))| (p, s)).collect()
    }

    /// Everything given back: no chunk, no event.
    pub(super) fn assert_clean(&self) {
        let st = self.st();
        assert!(st.chunks.is_empty(), "chunks left: {:?}", st.chunks);
        assert!(st.reservations.is_empty(), "address ranges left: {:?}", st.reservations);
        assert_eq!(st.reserved, 0);
        assert_eq!(st.live_events, 0, "events left");
    }

    /// Panics (with the state unlocked) if `which` is the call to unwind out of.
    fn unwind_if(mut st: MutexGuard<'_, State>, which: Call) {
        if st.unwind_after == Some(which) {
            st.unwind_after = None;
            drop(st);
            panic!("the mock unwinds out of {which:?}, as injected");
        }
    }

    fn call(&self, which: Call) -> Result<MutexGuard<'_, State>, MockErr> {
        let mut st = self.st();
        st.calls += 1;
        if st.fail == Some(which) {
            st.fail = None;
            return Err(if st.unsupported { MockErr::Unsupported } else { MockErr::Injected });
        }
        Ok(st)
    }
}

impl State {
    /// Whether `[p, end)` is device memory: inside one chunk, or inside adjacent mappings.
    fn covered(&self, p: u64, end: u64) -> bool {
        let Some((&first, _)) = self.chunks.range(..=p).next_back() else { return false };
        let mut at = first;
        loop {
            let Some(&len) = self.chunks.get(&at) else { return false };
            let next = at + len as u64;
            if end <= next {
                return true;
            }
            if !self.mappings.contains_key(&at) || !self.mappings.contains_key(&next) {
                return false;
            }
            at = next;
        }
    }

    /// The checks of giving memory `[ptr, ptr + bytes)` back: no live allocation in it, and the
    /// host has seen every free of it complete. Forgets those frees.
    fn check_released(&mut self, ptr: u64, bytes: usize) {
        let end = ptr + bytes as u64;
        // Overlap, not only a start inside: a block of a segment spans several mappings.
        if let Some((&q, &(n, _))) = self.live.range(..end).next_back() {
            assert!(q + n.max(1) as u64 <= ptr, "memory released with a live allocation");
        }
        for &(fp, fl, fs, ft) in &self.frees {
            if fp < end && ptr < fp + fl as u64 {
                assert!(at(&self.host, fs) >= ft, "memory released before the host saw its frees");
            }
        }
        self.frees.retain(|&(fp, ..)| !(ptr..end).contains(&fp));
    }

    /// (records, waits, syncs, queries, chunk frees), to check that a call made none.
    pub(super) fn clone_counts(&self) -> (u64, u64, u64, u64, u64) {
        (self.records, self.waits, self.syncs, self.queries, self.chunk_frees)
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

    fn event_clock(&self, ev: &MockEvent) -> &(Clock, u64) {
        self.events[ev.id].as_ref().expect("use of a never-recorded event")
    }
}

fn assert_no_lock(what: &str) {
    assert!(!IN_ARENA.with(|f| f.get()), "{what} called while the arena is locked");
}

impl Backend for Mock {
    type Stream = S;
    type Event = Arc<MockEvent>;
    type Error = MockErr;

    fn alloc_chunk(&self, bytes: usize) -> Result<u64, MockErr> {
        let mut st = self.call(Call::Alloc)?;
        assert!(bytes > 0);
        if (st.capacity - st.reserved).saturating_sub(st.spare) < bytes {
            return Err(MockErr::Oom);
        }
        let p = st.next_ptr;
        // Leave a gap, so that chunks are never adjacent.
        st.next_ptr += bytes.next_multiple_of(1 << 21) as u64 + (1 << 21);
        st.chunks.insert(p, bytes);
        st.reserved += bytes;
        st.chunk_allocs += 1;
        Ok(p)
    }

    fn free_chunk(&self, ptr: u64, bytes: usize) -> Result<(), MockErr> {
        assert_no_lock("free_chunk");
        let mut st = self.call(Call::Free)?;
        assert!(!st.mappings.contains_key(&ptr), "a mapping freed as a chunk");
        assert_eq!(st.chunks.remove(&ptr), Some(bytes), "bad or double chunk free");
        st.check_released(ptr, bytes);
        st.reserved -= bytes;
        st.chunk_frees += 1;
        Self::unwind_if(st, Call::Free);
        Ok(())
    }

    fn segments(&self) -> Option<Segments> {
        self.st().vmm.map(|(granularity, reserve)| Segments { granularity, reserve })
    }

    fn reserve(&self, bytes: usize) -> Result<u64, MockErr> {
        let mut st = self.call(Call::Reserve)?;
        if st.refuse_reserve {
            return Err(MockErr::Injected);
        }
        let (granularity, _) = st.vmm.expect("reserve on a mock without VMM");
        assert!(bytes > 0 && bytes.is_multiple_of(granularity));
        let p = st.next_ptr.next_multiple_of(granularity as u64);
        st.next_ptr = p + bytes as u64 + (1 << 21);
        st.reservations.insert(p, bytes);
        Ok(p)
    }

    fn free_reserve(&self, va: u64, bytes: usize) -> Result<(), MockErr> {
        let mut st = self.call(Call::Reserve)?;
        assert_eq!(st.reservations.get(&va), Some(&bytes), "bad or double address range free");
        assert!(st.chunks.range(va..va + bytes as u64).next().is_none(), "address range freed with mappings");
        st.reservations.remove(&va);
        Ok(())
    }

    fn map(&self, va: u64, bytes: usize) -> Result<u64, MockErr> {
        let mut st = self.call(Call::Alloc)?;
        let (granularity, _) = st.vmm.expect("map on a mock without VMM");
        assert!(bytes > 0 && bytes.is_multiple_of(granularity) && va.is_multiple_of(granularity as u64));
        let (&r, &rlen) = st.reservations.range(..=va).next_back().expect("a mapping outside any address range");
        assert!(va + bytes as u64 <= r + rlen as u64, "a mapping beyond its address range");
        assert!(
            st.chunks.range(..va + bytes as u64).next_back().is_none_or(|(&p, &n)| p + n as u64 <= va),
            "mapped twice"
        );
        if (st.capacity - st.reserved).saturating_sub(st.spare) < bytes {
            return Err(MockErr::Oom);
        }
        let handle = st.next_handle;
        st.next_handle += 1;
        st.chunks.insert(va, bytes);
        st.mappings.insert(va, handle);
        st.reserved += bytes;
        st.chunk_allocs += 1;
        Ok(handle)
    }

    fn unmap(&self, va: u64, bytes: usize, handle: u64) -> Result<(), MockErr> {
        assert_no_lock("unmap");
        let mut st = self.call(Call::Free)?;
        assert_eq!(st.mappings.remove(&va), Some(handle), "bad or double unmap");
        assert_eq!(st.chunks.remove(&va), Some(bytes), "an unmap of another size than the mapping");
        st.check_released(va, bytes);
        st.reserved -= bytes;
        st.chunk_frees += 1;
        Self::unwind_if(st, Call::Free);
        Ok(())
    }

    fn free_memory(&self) -> Option<usize> {
        let mut st = self.st();
        st.free_memory_reports += 1;
        (st.capacity != usize::MAX).then(|| st.capacity - st.reserved)
    }

    fn is_out_of_memory(&self, err: &MockErr) -> bool {
        *err == MockErr::Oom
    }

    fn is_unsupported(&self, err: &MockErr) -> bool {
        *err == MockErr::Unsupported
    }

    fn report(&self, _error: MockErr) {
        self.st().reports += 1;
    }

    fn is_capturing(&self, stream: &S) -> bool {
        self.st().capturing.get(stream.0).copied().unwrap_or(false)
    }

    fn create_event(&self) -> Result<Arc<MockEvent>, MockErr> {
        let mut st = self.call(Call::Create)?;
        st.events.push(None);
        st.live_events += 1;
        let id = st.events.len() - 1;
        Ok(Arc::new(MockEvent { id, st: self.0.clone() }))
    }

    fn record(&self, ev: &Arc<MockEvent>, on: &S) -> Result<(), MockErr> {
        let mut st = self.call(Call::Record)?;
        if st.capturing[on.0] {
            assert!(st.captures_race, "a record on capturing stream {} (it would be captured)", on.0);
            return Err(MockErr::Injected);
        }
        st.tick(on.0);
        let c = st.clocks[on.0].clone();
        let now = st.now;
        st.events[ev.id] = Some((c, now));
        st.records += 1;
        Ok(())
    }

    fn wait(&self, waiter: &S, ev: &Arc<MockEvent>) -> Result<(), MockErr> {
        let mut st = self.call(Call::Wait)?;
        if st.capturing[waiter.0] {
            assert!(st.captures_race, "a wait on capturing stream {} (it would be captured)", waiter.0);
            return Err(MockErr::Injected);
        }
        let c = st.event_clock(ev).0.clone();
        st.tick(waiter.0);
        join(&mut st.clocks[waiter.0], &c);
        st.waits += 1;
        Ok(())
    }

    fn synchronize(&self, ev: &Arc<MockEvent>) -> Result<(), MockErr> {
        assert_no_lock("synchronize");
        let mut st = self.call(Call::Sync)?;
        let c = st.event_clock(ev).0.clone();
        join(&mut st.host, &c);
        st.syncs += 1;
        let hook = st.on_sync.take();
        drop(st);
        if let Some(hook) = hook {
            hook();
        }
        Ok(())
    }

    fn query(&self, ev: &Arc<MockEvent>) -> Result<bool, MockErr> {
        let mut st = self.call(Call::Query)?;
        let (c, at) = st.event_clock(ev).clone();
        st.queries += 1;
        let done = st.query_lag.is_some_and(|lag| st.now >= at + lag);
        if done {
            join(&mut st.host, &c);
        }
        Ok(done)
    }
}

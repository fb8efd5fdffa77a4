//! [`Trace`]: allocation traces (`op,id,size,stream`), as recorded from frameworks, and their
//! replay on a [`SimulatedPool`].

use std::collections::HashMap;
use std::fmt;

use super::blocks::Kind;
use super::config::PoolConfig;
use super::sim::SimulatedPool;
use super::{GRANULE, round_up};

/// One event of a [`Trace`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceEvent {
    /// Allocation number `id` of `size` bytes on stream index `stream`.
    Alloc {
        /// The allocation's number, unique among live allocations.
        id: u64,
        /// Bytes.
        size: usize,
        /// Stream index, from 0.
        stream: usize,
    },
    /// Free of allocation `id` on stream index `stream`.
    Free {
        /// The allocation's number.
        id: u64,
        /// Its bytes, as allocated.
        size: usize,
        /// Stream index, from 0.
        stream: usize,
    },
}

/// An allocation trace: the events, in order, of a program's allocations and frees.
///
/// The text format is CSV with one event a line, `op,id,size,stream`: `a` allocates `size` bytes
/// as allocation `id` on stream index `stream`, `f` frees allocation `id`. Lines starting with
/// `#` are comments; one header line (`op,id,size,stream`) is allowed; empty lines are skipped.
///
/// ```
/// use cudrv::memory::Trace;
/// let trace = Trace::parse("op,id,size,stream\na,0,1024,0\na,1,4096,1\nf,0,1024,0\n")?;
/// assert_eq!((trace.events().len(), trace.streams(), trace.peak_live()), (3, 2, 5120));
/// let err = Trace::parse("a,0,1024,0\nf,7,1024,0\n").unwrap_err();
/// assert_eq!(err.to_string(), "line 2: free of allocation 7, which is not live");
/// # Ok::<(), cudrv::memory::TraceError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    events: Vec<TraceEvent>,
    /// For each allocation, its slot in a [`ReplayTable`] (the last one a free gave back, or a new
    /// one); for each free, the index of the allocation it frees.
    links: Vec<u32>,
    /// The most allocations live at once: the slots a replay needs.
    most_live: usize,
    streams: usize,
    peak_live: usize,
}

/// The live allocations of one replay of a [`Trace`] ([`Trace::replay_table`]): their addresses,
/// found by the slot each allocation of the trace was given when it was read, with no hashing
/// between the calls a timed replay makes, so that the time it measures is the allocator's.
///
/// ```
/// use cudrv::memory::{Trace, TraceEvent};
/// let trace = Trace::parse("a,7,1024,0\na,9,4096,1\nf,7,1024,0\n")?;
/// let mut table = trace.replay_table();
/// let mut next = 0x1000;
/// for (i, ev) in trace.events().iter().enumerate() {
///     match *ev {
///         TraceEvent::Alloc { .. } => {
///             table.allocated(i, next);
///             next += 0x1000;
///         }
///         TraceEvent::Free { .. } => assert_eq!(table.freed(i), Some(0x1000)),
///     }
/// }
/// // What the trace leaves live, in the order of its ids: (address, bytes, stream).
/// assert_eq!(table.live_bytes(), 4096);
/// assert_eq!(table.into_live(), [(0x2000, 4096, 1)]);
/// # Ok::<(), cudrv::memory::TraceError>(())
/// ```
#[derive(Debug)]
pub struct ReplayTable<'t> {
    trace: &'t Trace,
    /// By slot: the allocation's event and address, while it is live.
    pub(in crate::memory::pool) live: Vec<Option<(usize, u64)>>,
    /// Allocations noted whose slot a later allocation took before their free was noted (a
    /// replay that skipped a free): kept here, so that none is lost.
    displaced: Vec<(usize, u64)>,
    live_bytes: usize,
}

impl ReplayTable<'_> {
    /// Notes `ptr` as the address of the allocation that event `event` (an index into
    /// [`Trace::events`]) made (noted again, the last address counts). Ignored where that event
    /// is not an allocation.
    #[inline]
    pub fn allocated(&mut self, event: usize, ptr: u64) {
        let Some(&TraceEvent::Alloc { size, .. }) = self.trace.events.get(event) else { return };
        match self.live[self.trace.links[event] as usize].replace((event, ptr)) {
            Some((noted, _)) if noted == event => return,
            // The slot's earlier allocation, whose free was not noted, stays live.
            Some(earlier) => self.displaced.push(earlier),
            None => {}
        }
        self.live_bytes = self.live_bytes.saturating_add(size);
    }

    /// Takes out the address of the allocation that event `event` frees: `None` where that
    /// event is not a free, or the allocation it frees was not noted ([`ReplayTable::allocated`])
    /// or was taken out already.
    #[inline]
    pub fn freed(&mut self, event: usize) -> Option<u64> {
        let &TraceEvent::Free { size, .. } = self.trace.events.get(event)? else { return None };
        let alloc = self.trace.links[event] as usize;
        let entry = &mut self.live[self.trace.links[alloc] as usize];
        // The slot may hold a later allocation by now (the free was taken out before, or skipped
        // and the allocation displaced).
        let ptr = match *entry {
            Some((noted, ptr)) if noted == alloc => {
                *entry = None;
                ptr
            }
            _ => self.take_displaced(alloc)?,
        };
        self.live_bytes = self.live_bytes.saturating_sub(size);
        Some(ptr)
    }

    #[cold]
    fn take_displaced(&mut self, alloc: usize) -> Option<u64> {
        let i = self.displaced.iter().position(|&(noted, _)| noted == alloc)?;
        Some(self.displaced.swap_remove(i).1)
    }

    /// The bytes of the allocations noted and not yet freed.
    pub fn live_bytes(&self) -> usize {
        self.live_bytes
    }

    /// The allocations noted and not freed, in the order of their ids (so that a warm replay
    /// starts from the same pool every time): (address, bytes, stream index).
    pub fn into_live(self) -> Vec<(u64, usize, usize)> {
        let mut live: Vec<(u64, u64, usize, usize)> = self
            .live
            .iter()
            .flatten()
            .chain(&self.displaced)
            .filter_map(|&(event, ptr)| match self.trace.events[event] {
                TraceEvent::Alloc { id, size, stream } => Some((id, ptr, size, stream)),
                TraceEvent::Free { .. } => None,
            })
            .collect();
        live.sort_unstable_by_key(|&(id, ..)| id);
        live.into_iter().map(|(_, ptr, size, stream)| (ptr, size, stream)).collect()
    }
}

/// A line of a trace that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    /// The line's number, from 1.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

impl std::error::Error for TraceError {}

/// What a replay on a [`SimulatedPool`] measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Events replayed (all of them, unless it ran out of memory).
    pub events: usize,
    /// The index of the event that ran out of memory, if one did.
    pub out_of_memory_at: Option<usize>,
    /// The trace's peak of live bytes.
    pub peak_live: usize,
    /// The pool's peak of reserved bytes.
    pub peak_reserved: usize,
    /// Chunks allocated from the (emulated) driver.
    pub driver_allocs: u64,
    /// Their bytes, summed.
    pub driver_alloc_bytes: u64,
    /// Chunks given back to it.
    pub driver_frees: u64,
}

impl ReplayReport {
    /// Peak reserved bytes over the trace's peak live bytes.
    pub fn ratio(&self) -> f64 {
        self.peak_reserved as f64 / self.peak_live.max(1) as f64
    }

    /// An estimate of the time the driver calls of this replay would take on an H200, in
    /// nanoseconds: each `cuMemAlloc` + `cuMemFree` pair costs about 60 µs plus about 1 µs per MiB
    /// (measured there on a roomy device; see BENCHMARKS.md). Near the device's capacity the
    /// driver takes up to 28 times as long for an allocation, so under a tight budget this is
    /// a lower bound: replays in chunks under 1.10x their peak took 21 to 39 times this estimate
    /// on an H100 (run 64).
    pub fn estimated_driver_ns(&self) -> f64 {
        self.driver_allocs as f64 * 60_000.0 + self.driver_alloc_bytes as f64 / (1 << 20) as f64 * 1_000.0
    }
}

impl Trace {
    /// Reads a trace from its text.
    ///
    /// # Errors
    /// [`TraceError`] naming the first line that is malformed, allocates an id that is live, or
    /// frees an id that is not live (or with another size), or makes the trace too large: more
    /// than 2³² − 1 events, or allocations live at once.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let mut trace = Trace::default();
        // Live allocations: id -> (size, slot, event index); and the slots their frees gave back.
        let mut live: HashMap<u64, (usize, u32, u32)> = HashMap::new();
        let mut free_slots: Vec<u32> = Vec::new();
        let (mut now, mut header_seen, mut data_seen) = (0usize, false, false);
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            let n = i + 1;
            let bad = |reason: String| TraceError { line: n, reason };
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line.replace(' ', "") == "op,id,size,stream" {
                if header_seen || data_seen {
                    return Err(bad("a header after the start of the trace".into()));
                }
                header_seen = true;
                continue;
            }
            data_seen = true;
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [op, id, size, stream] = fields[..] else {
                return Err(bad(format!("expected 4 fields `op,id,size,stream`, found {}: {line:?}", fields.len())));
            };
            let number = |what: &str, v: &str| {
                v.parse::<u64>().map_err(|_| bad(format!("{what} {v:?} is not a non-negative integer")))
            };
            let id = number("id", id)?;
            let size = usize::try_from(number("size", size)?).map_err(|_| bad("size too large".into()))?;
            let stream = usize::try_from(number("stream", stream)?).map_err(|_| bad("stream too large".into()))?;
            if stream >= 1 << 16 {
                return Err(bad(format!("stream index {stream} is too large (at most 65535)")));
            }
            trace.streams = trace.streams.max(stream + 1);
            match op {
                "a" => {
                    let slot = match free_slots.pop() {
                        Some(slot) => slot,
                        None => u32::try_from(trace.most_live)
                            .map_err(|_| bad("more than 4294967295 allocations live at once".into()))?,
                    };
                    let event = u32::try_from(trace.events.len())
                        .map_err(|_| bad("more than 4294967295 events before this allocation".into()))?;
                    if live.insert(id, (size, slot, event)).is_some() {
                        return Err(bad(format!("allocation {id} is allocated again while live")));
                    }
                    now = now.checked_add(size).ok_or_else(|| bad("live bytes overflow".into()))?;
                    trace.most_live = trace.most_live.max(slot as usize + 1);
                    trace.peak_live = trace.peak_live.max(now);
                    trace.events.push(TraceEvent::Alloc { id, size, stream });
                    trace.links.push(slot);
                }
                "f" => {
                    let (slot, event) = match live.remove(&id) {
                        None => return Err(bad(format!("free of allocation {id}, which is not live"))),
                        Some((s, ..)) if s != size => {
                            return Err(bad(format!("free of allocation {id} with {size} bytes; it has {s}")));
                        }
                        Some((_, slot, event)) => (slot, event),
                    };
                    free_slots.push(slot);
                    now -= size;
                    trace.events.push(TraceEvent::Free { id, size, stream });
                    trace.links.push(event);
                }
                other => return Err(bad(format!("unknown op {other:?} (expected `a` or `f`)"))),
            }
        }
        Ok(trace)
    }

    /// The events, in order.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// A table for the live allocations of one replay of the trace ([`ReplayTable`]).
    pub fn replay_table(&self) -> ReplayTable<'_> {
        ReplayTable { trace: self, live: vec![None; self.most_live], displaced: Vec::new(), live_bytes: 0 }
    }

    /// The number of streams (the largest stream index plus one).
    pub fn streams(&self) -> usize {
        self.streams
    }

    /// The most bytes live at once.
    pub fn peak_live(&self) -> usize {
        self.peak_live
    }

    /// The least memory that any placement in chunks that keeps each kind of request apart needs
    /// for the trace: each large request (above [`PoolConfig::medium_limit`]) in a chunk of its
    /// own of whole [`PoolConfig::large_granule`] pages (the driver maps 2 MiB pages), and the
    /// medium requests and the small ones (up to [`PoolConfig::small_limit`]) each in chunks of
    /// their own kind, packed perfectly. At every event, the pages of the live large requests and
    /// of the live medium and small bytes; the largest such sum over the trace. Requests are
    /// rounded to 512 bytes, as the pool rounds them.
    ///
    /// That is how [`StreamOrderedPool`](crate::memory::StreamOrderedPool) places requests where
    /// the device has no virtual memory management (or with [`PoolConfig::expandable`] off), so
    /// that a small block never pins a large chunk, until its last resort before running out of
    /// memory: then a small or medium request may take the free tail of a large chunk (what the
    /// request left of its last page), and get below this. It gets below it too where large
    /// requests of a recurring size share packed chunks (two or three to a chunk, rounded to
    /// pages together). A budget below it (plus what the driver keeps back of its free memory:
    /// 2 MiB on an H200) is met only so, or by mapping memory into address ranges (segments,
    /// with virtual memory management).
    ///
    /// ```
    /// use cudrv::memory::{PoolConfig, Trace};
    /// // Two live 10.32 MiB tensors take two 12 MiB chunks; a 14 KB request a small chunk (2 MiB).
    /// let trace = Trace::parse("a,1,10819584,0\na,2,10819584,0\na,3,14088,0\n")?;
    /// assert_eq!(trace.least_memory_in_chunks(&PoolConfig::default()), (12 + 12 + 2) << 20);
    /// # Ok::<(), cudrv::memory::TraceError>(())
    /// ```
    pub fn least_memory_in_chunks(&self, config: &PoolConfig) -> usize {
        let config = config.clone().normalized();
        let pages = |n: usize| round_up(n, config.large_granule).unwrap_or(usize::MAX);
        let (mut large, mut medium, mut small, mut least) = (0usize, 0usize, 0usize, 0usize);
        for ev in &self.events {
            let (size, alloc) = match *ev {
                TraceEvent::Alloc { size, .. } => (size, true),
                TraceEvent::Free { size, .. } => (size, false),
            };
            let rounded = round_up(size.max(1), GRANULE).unwrap_or(usize::MAX);
            let (sum, bytes) = match config.kind_in_chunks(rounded) {
                Kind::Small => (&mut small, rounded),
                Kind::Medium => (&mut medium, rounded),
                _ => (&mut large, pages(rounded)),
            };
            *sum = if alloc { sum.saturating_add(bytes) } else { sum.saturating_sub(bytes) };
            least = least.max(large.saturating_add(pages(medium)).saturating_add(pages(small)));
        }
        least
    }

    /// Replays the trace on a new [`SimulatedPool`] with `config` on an emulated device of
    /// `memory_limit` bytes (`None`: no limit): see [`Trace::replay_on`].
    pub fn replay_simulated(&self, config: PoolConfig, memory_limit: Option<usize>) -> ReplayReport {
        self.replay_on(&SimulatedPool::new(config, memory_limit))
    }

    /// Replays the trace on `pool` (again, for a warm replay), and frees what the trace leaves
    /// live. The report's driver figures count this replay only; its peak reserved is the pool's
    /// since it was made or its peaks were reset.
    pub fn replay_on(&self, pool: &SimulatedPool) -> ReplayReport {
        self.replay_watched(pool, |_| {})
    }

    /// [`Trace::replay_on`], calling `watch` with each event's index once the pool has served
    /// it: to follow the pool's figures ([`SimulatedPool::stats`]) through a replay. (A `watch`
    /// that frees one of the replay's allocations itself makes the replay's own free of it a
    /// no-op, not a panic.)
    ///
    /// ```
    /// use cudrv::memory::{PoolConfig, SimulatedPool, Trace};
    /// let trace = Trace::parse("a,0,1048576,0\nf,0,1048576,0\n")?;
    /// let pool = SimulatedPool::new(PoolConfig::default(), None);
    /// let mut in_use = Vec::new();
    /// trace.replay_watched(&pool, |_| in_use.push(pool.stats().in_use));
    /// assert_eq!(in_use, [1 << 20, 0]);
    /// # Ok::<(), cudrv::memory::TraceError>(())
    /// ```
    pub fn replay_watched(&self, pool: &SimulatedPool, mut watch: impl FnMut(usize)) -> ReplayReport {
        let before = pool.stats();
        let mut table = self.replay_table();
        let mut report = ReplayReport {
            events: 0,
            out_of_memory_at: None,
            peak_live: self.peak_live,
            peak_reserved: 0,
            driver_allocs: 0,
            driver_alloc_bytes: 0,
            driver_frees: 0,
        };
        for (i, ev) in self.events.iter().enumerate() {
            match *ev {
                TraceEvent::Alloc { size, stream, .. } => match pool.allocate(size, stream) {
                    Ok(p) => table.allocated(i, p),
                    Err(_) => {
                        report.out_of_memory_at = Some(i);
                        break;
                    }
                },
                TraceEvent::Free { size, stream, .. } => {
                    // A free the pool refuses (a `watch` that freed the allocation itself) is
                    // skipped: the replay goes on.
                    if let Some(p) = table.freed(i) {
                        let _ = pool.deallocate(p, size, stream);
                    }
                }
            }
            watch(i);
            report.events = i + 1;
        }
        let st = pool.stats();
        for (p, size, stream) in table.into_live() {
            let _ = pool.deallocate(p, size, stream);
        }
        report.peak_reserved = st.peak_reserved;
        report.driver_allocs = st.driver_allocs - before.driver_allocs;
        report.driver_alloc_bytes = st.driver_alloc_bytes - before.driver_alloc_bytes;
        report.driver_frees = st.driver_frees - before.driver_frees;
        report
    }
}

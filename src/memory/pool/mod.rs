//! The bookkeeping of cudrv's stream-ordered pool ([`StreamOrderedPool`](crate::memory::StreamOrderedPool)).
//!
//! Plain Rust: no FFI, no `unsafe`, no dependencies. The pool decides what to do with device
//! memory; a [`Backend`] performs the few driver calls it asks for (`cuMemAlloc`, `cuMemFree`, or
//! the virtual memory calls of segments, and events). The simulator ([`SimulatedPool`](crate::memory::SimulatedPool)), property tests and Miri
//! run it against emulated devices.
//!
//! # Two layers
//!
//! * **Each stream's cache** ([`cache`]) holds the stream's live allocations and the blocks freed
//!   on it. A request on a stream first takes a cached block of exactly its rounded size: one lock
//!   of that stream's own, no shared state, no driver call, no synchronisation (stream order makes
//!   the reuse safe). Threads that allocate on different streams never meet there.
//! * **The arena** ([`arena`]), behind one shared lock, holds every chunk and every free block
//!   that no stream caches. It finds the best fit across chunks (a stream's own blocks first, then
//!   other streams', ordered by an event), splits and merges blocks, grows, and gives chunks back.
//!
//! Blocks move from a cache to the arena when the arena would otherwise grow (so that they merge,
//! and the arena sees what is really live), on out of memory, on `trim`, and when a stream goes
//! away; in segments, also those of the large segment at every miss of the stream's cache (a
//! segment's placement depends on merging). Locks are taken in one order only: a stream's cache,
//! then the arena; a thread never takes a cache while holding the arena, and never holds a lock
//! across a blocking driver call.
//!
//! # Segments or chunks
//!
//! Where the device has virtual memory management (and [`PoolConfig::expandable`](config::PoolConfig::expandable)
//! is on, the default), the arena grows in *segments* ([`segment`]): one reserved address range
//! per kind, into which memory is mapped where requests need it, and out of which free memory is
//! unmapped, leaving holes that later growth maps again. Blocks then merge across growths, and
//! physical memory goes where it is needed; the growth and release rules below for chunks do not
//! apply to them. Without it (Windows TCC devices are reported to lack it), the arena grows in
//! chunks, as follows.
//!
//! # Model
//!
//! Device memory is obtained from the backend in *chunks* (a segment is a chunk that grows). Each chunk is cut into contiguous
//! *blocks*, linked in address order. A block is *out* (a live allocation, or cached by a stream)
//! or *free* in the arena. A free block belongs to exactly one *stream state*: the stream on which
//! it was freed (or to which it was moved later), with a sequence number `seq` that says when, in
//! that stream's order, it became free ([`events`]). It may be handed out on that stream at once;
//! on another stream only when it is *host-safe* (the host saw its free complete), or after that
//! stream waited on the GPU for the owner's event recorded after the free. When such a wait is
//! paid, *every* block the event covers moves to the waiting stream, as RMM does, so that one wait
//! pays for many blocks. Adjacent free blocks merge when they belong to the same stream, or when
//! both are host-safe.
//!
//! Requests are rounded to [`GRANULE`] bytes. Small requests (up to 1 MiB) are served from small
//! chunks only, so that small blocks never pin the large chunks.
//!
//! # Growth and release
//!
//! * Small requests (up to 1 MiB) share 2 MiB chunks, medium ones (up to 8 MiB) share 32 MiB
//!   chunks: blocks there are split and merged. A large request gets a chunk of its own, rounded
//!   up to a size class (8 to a doubling, about 9% apart), and a large chunk holds one large
//!   block at a time: when it is freed (and its tail, below, is free) the whole chunk is free, to
//!   serve a later request of 75% of its size or more, or to go back to the driver whole. Each class has chunks of its own, so
//!   that while memory is plentiful a small block never pins a large chunk. What the rounding
//!   leaves unused beside the blocks that are out is bounded: past 0.25% of the device's memory,
//!   large chunks are exact (packed chunks' room, below, aside).
//! * *Tails.* The rest of a large chunk beside its block (at least what the driver's 2 MiB pages
//!   add) is its tail ([`blocks::Kind::Tail`]). Small and medium requests take tails as the last
//!   resort before out of memory (below), and large ones past the headroom (below): those bytes
//!   are spent on the device anyway, but a block in a tail keeps the whole chunk from going back.
//!   A tail merges back into its large block when both are free.
//! * *Packed chunks.* A large request whose size was grown for recently (one of the last eight
//!   large growths: a model's weights, a layer's tensors) gets a chunk for two or three requests
//!   of its size, where that at least halves what the last page leaves unused per request
//!   (three 12.5 MiB weights in 38 MiB, against 14 MiB each), within the headroom, where memory
//!   does not run short, and where what the chunk keeps beyond the request is at most a quarter of
//!   the device's free memory ([`blocks::Kind::Packed`]). Requests of that size take its room first
//!   (what was freed on their own stream); other requests only as their last resort. Growths for
//!   graphs, and those past the headroom, never pack.
//! * Before growing, the streams' caches are given back to the arena, which looks again.
//! * *Headroom*: the arena grows freely while reserved memory stays within
//!   [`PoolConfig::headroom_percent`](config::PoolConfig::headroom_percent) (20%) of the most
//!   memory live at once. A large chunk whose size class would pass it takes what the headroom
//!   leaves where the request's pages still fit, so that the same buffer a step later, a little
//!   larger, still fits it. Past it, a large request first takes cached memory it passes over
//!   otherwise: a free tail that holds it, else any free large block that holds it, while what
//!   blocks leave unused stays within the headroom's share of the most memory live at once and
//!   within 1% of the device's memory (so a workload whose sizes change from step to step
//!   reuses what the last step cached, instead of trading chunks with the driver: on the H200,
//!   `mixed_images` replays warm with 24 `cuMemAlloc` calls instead of 402). Otherwise the arena
//!   takes out whole free chunks whose frees the GPU has completed (asked with `cuEventQuery`:
//!   the host does not wait), frees them, and grows by exactly the request.
//! * *Near capacity* (`cuMemGetInfo` says the device would be left with less than a tenth of what
//!   the pool holds), growth is exact, and the device's memory takes the headroom's place as the
//!   bound: before asking for more than the device has free (less what `cuMemAlloc` keeps back:
//!   [`backend::DRIVER_SPARE`] at first, more once the driver refused a request that left more),
//!   the pool releases whole free chunks whose frees the GPU has completed, the smallest that
//!   makes up for what is missing first, and keeps the others cached. So memory is cached while
//!   it is plentiful, placed tightly as it runs out, and what is cached still serves as long as it
//!   fits.
//! * *Out of memory*: the pool waits on the host for every free (with no lock held), merges,
//!   looks again, gives back the free chunks that make up for what the request lacks, then
//!   everything free, and retries the driver at exactly the request each time, so that what it
//!   can reach matches what `cuMemAlloc` can; a request then takes a free tail that holds it,
//!   and a large one any free large block that holds it (memory live blocks pin anyway).
//! * *Pacing* ([`pacing`]): trading chunks near capacity means a `cuMemAlloc` right after a
//!   `cuMemFree`. Driver 580 finishes a free in the background and makes an allocation that comes
//!   before that is done wait 5-7.5 ms, where a pause of 0.5 ms after a 200 MiB free avoids the
//!   wait. Once the driver was seen to make an allocation wait so, the real backend paces chunk
//!   allocations: each first waits out an estimate of the work the pool's frees left (2.5 µs a
//!   MiB, at most 10 ms), and pacing stops for good where even its longest estimate does not
//!   avoid the wait. A driver that never makes an allocation wait is never paced.
#![forbid(unsafe_code)]

pub(crate) mod arena;
pub(crate) mod backend;
pub(crate) mod blocks;
pub(crate) mod cache;
pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod events;
pub(crate) mod graph;
pub(crate) mod pacing;
pub(crate) mod release;
pub(crate) mod segment;
pub(crate) mod sim;
pub(crate) mod slots;
pub(crate) mod stats;
#[cfg(test)]
mod tests;
pub(crate) mod trace;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use arena::{Arena, Detached, Grow};
use backend::Backend;
use cache::{Cache, CacheStats, Found};
use error::PoolError;
use release::Completion;
use segment::Across;
use stats::{Leaked, PoolStats};

/// The alignment and rounding unit of every block, in bytes. Every block offset inside a chunk is
/// a multiple of it, so a block is as aligned as its chunk up to this value (`cuMemAlloc` aligns
/// to at least 256 bytes).
pub(crate) const GRANULE: usize = 512;

/// The largest request accepted; anything above is [`PoolError::TooLarge`].
pub(crate) const MAX_REQUEST: usize = (isize::MAX as usize) / 2;

pub(crate) fn round_up(v: usize, to: usize) -> Option<usize> {
    Some(v.checked_add(to - 1)? / to * to)
}

/// A block the arena handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handout {
    pub(crate) ptr: u64,
    pub(crate) blk: u32,
    pub(crate) size: usize,
}

/// A live allocation: its arena block, the block's size, and the bytes asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Live {
    pub(crate) blk: u32,
    pub(crate) size: usize,
    pub(crate) requested: usize,
    /// Made for a buffer that refers to the allocation's stream through the pool (see
    /// [`Cache::kept`]).
    pub(crate) kept: bool,
}

/// A fast hasher for device pointers, sizes and stream identities (the keys are not
/// attacker-controlled). It folds a 128-bit product, so both the low and the high bits of the hash
/// depend on every bit of the key (pointers have their low bits all zero).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FoldHasher {
    state: u64,
}

impl FoldHasher {
    #[inline]
    fn mix(&mut self, v: u64) {
        let p = u128::from(self.state ^ v) * 0x9E37_79B9_7F4A_7C15_u128;
        self.state = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl Hasher for FoldHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
    fn write(&mut self, bytes: &[u8]) {
        for piece in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..piece.len()].copy_from_slice(piece);
            self.mix(u64::from_le_bytes(buf));
        }
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.mix(u64::from(v));
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.mix(v);
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.mix(v as u64);
    }
}

pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

/// Where a pool's state lives: behind locks in `StreamOrderedPool`, in cells in the simulator, in
/// a test harness with threads. The pool's operations below are written once against it.
///
/// Lock order: [`cache`](Self::cache) may take the arena (to register a new stream, and to give
/// blocks back); [`arena`](Self::arena) must never be held while a cache is taken.
pub(crate) trait Host {
    type B: Backend;

    fn backend(&self) -> &Self::B;

    /// Runs `f` with the arena locked.
    fn arena<R>(&self, f: impl FnOnce(&mut Arena<Self::B>) -> R) -> R;

    /// Runs `f` with `stream`'s cache locked, making it (and registering the stream with the
    /// arena) if the stream has none.
    fn cache<R>(&self, stream: &StreamOf<Self>, f: impl FnOnce(&mut Cache) -> R) -> R;

    /// Runs `f` with `stream`'s cache locked, if it has one.
    fn existing_cache<R>(&self, stream: &StreamOf<Self>, f: impl FnOnce(&mut Cache) -> R) -> Option<R>;

    /// Waits (with no lock held on return) until a release in flight, which another thread makes
    /// with no lock held, is settled, or a short while has passed: the way out of
    /// [`Grow::Busy`]. A host with one thread has none in flight.
    fn wait_for_release(&self) {
        std::thread::yield_now();
    }

    /// Wakes the threads in [`Host::wait_for_release`]: releases were settled.
    fn released(&self) {}

    /// Reports an error of the pool's housekeeping (a free, an unmapping, a wait, or a poll of
    /// frees, made to make room) that does not decide the request it was made for: the request
    /// goes on without that room. See [`Backend::report`].
    fn report(&self, error: ErrorOf<Self>) {
        self.backend().report(error);
    }
}

pub(crate) type StreamOf<H> = <<H as Host>::B as Backend>::Stream;
pub(crate) type ErrorOf<H> = <<H as Host>::B as Backend>::Error;

/// Allocates `bytes` for use on `stream`, in stream order: the memory may be used by work queued
/// on `stream` after this call. `allocate(0)` hands out a distinct minimal block. `kept`: the
/// allocation is a buffer's that refers to its stream through the pool ([`Cache::kept`]).
#[inline]
pub(crate) fn allocate<H: Host>(
    h: &H,
    bytes: usize,
    stream: &StreamOf<H>,
    kept: bool,
) -> Result<u64, PoolError<ErrorOf<H>>> {
    let size = Arena::<H::B>::rounded(bytes).ok_or(PoolError::TooLarge { requested: bytes })?;
    let (hit, slot) = h.cache(stream, |c| (c.take(size, bytes, kept), c.slot));
    match hit {
        Some(ptr) => Ok(ptr),
        None => allocate_slow(h, stream, slot, size, bytes, kept),
    }
}

/// The arena's path: its best fit (this stream's blocks, then other streams' after an event), then
/// the same after the caches are given back, then growth, then out-of-memory recovery.
#[inline(never)]
pub(crate) fn allocate_slow<H: Host>(
    h: &H,
    stream: &StreamOf<H>,
    slot: u32,
    size: usize,
    requested: usize,
    kept: bool,
) -> Result<u64, PoolError<ErrorOf<H>>> {
    let b = h.backend();
    let adopt = |handout| h.cache(stream, |c| c.adopt(handout, requested, kept));
    if h.arena(|a| a.segments.is_some()) {
        // In segments, the arena places best with every free block of the large segment in
        // view: the stream's own cached blocks there go back first, to merge with their
        // neighbours. Small blocks (in a segment of their own, but for a last resort) stay cached
        // for a later request of their size on the stream (they go back before the arena grows,
        // below). Given back too, they made only 7-26% of a warm replay's allocations on the
        // traces cache hits (33-91% kept), for the same memory.
        h.existing_cache(stream, |c| {
            let blocks = c.take_free_large();
            h.arena(|a| a.give_back(c.slot, &blocks));
        });
    }
    if let Some(handout) = h.arena(|a| a.take(b, slot, size))? {
        return Ok(adopt(handout));
    }
    if flush_caches(h) > 0
        && let Some(handout) = h.arena(|a| a.take(b, slot, size))?
    {
        return Ok(adopt(handout));
    }
    // In segments, a free block of the other segment where growing would only move memory from
    // one segment to the other, or end in the recovery below (see `Arena::take_across`).
    if let Some(handout) = h.arena(|a| a.take_across(b, slot, size, Across::SmallWhenFull))? {
        return Ok(adopt(handout));
    }
    if let Some(handout) = grow(h, slot, size)? {
        return Ok(adopt(handout));
    }
    if let Some(handout) = h.arena(|a| a.take_across(b, slot, size, Across::BeforeRecovery))? {
        return Ok(adopt(handout));
    }
    // Out of memory: wait for every free (with no lock held) so that all free blocks merge, look
    // again; then give every whole free chunk back and retry the driver at exactly the request.
    h.arena(|a| a.stats.oom_recoveries += 1);
    // A failed wait or free here leaves less room, not the request failed: it goes on, and ends in
    // out of memory if nothing serves (an error of the driver's own, such as its shutdown, comes
    // back from the growth).
    if let Err(e) = settle(h) {
        h.report(e);
    }
    if let Some(handout) = h.arena(|a| a.take(b, slot, size))? {
        return Ok(adopt(handout));
    }
    // First only what the request lacks (free chunks the request cannot use are a cache worth
    // keeping), then everything.
    let keep = h.arena(|a| a.reserved_after_making_room(b, size));
    for keep in [keep, 0] {
        if let Err(e) = release_settled(h, keep) {
            h.report(e);
        }
        if let Some(handout) = grow(h, slot, size)? {
            return Ok(adopt(handout));
        }
    }
    // Last, memory that live blocks pin in their chunks: a large chunk's free tail, or for a large
    // request a free large block it fills less than usual.
    if let Some(handout) = h.arena(|a| a.take_last_resort(b, slot, size))? {
        return Ok(adopt(handout));
    }
    let in_use = stats(h).in_use;
    Err(h.arena(|a| PoolError::OutOfMemory { requested, reserved: a.stats.reserved, in_use }))
}

/// Grows the arena (freeing, with no lock held, the chunks it takes out to stay within its
/// headroom). `None` when the driver is out of memory.
fn grow<H: Host>(h: &H, slot: u32, size: usize) -> Result<Option<Handout>, PoolError<ErrorOf<H>>> {
    let b = h.backend();
    // Each round frees what the previous one took out; the headroom check then passes, or nothing
    // more can be taken out. Past a few rounds the arena grows beyond its headroom.
    let mut round = 0;
    while round < 5 {
        match h.arena(|a| a.grow(b, slot, size, round < 4, true))? {
            Grow::Block(handout) => return Ok(Some(handout)),
            Grow::Release(chunks) => {
                if let Err(e) = free_chunks(h, &chunks) {
                    // The chunks went back to the arena, and would be taken out again: the next
                    // round grows past the headroom instead.
                    h.report(e);
                    round = round.max(3);
                } else if round == 4 {
                    // The last round (past the headroom, within the release threshold) made room:
                    // it grows now. Ending here read as the driver's refusal, and the request went
                    // through the out-of-memory recovery (host waits on every stream). Each such
                    // release gives chunks back for good, so the round ends.
                    continue;
                }
            }
            Grow::OutOfMemory => return Ok(None),
            Grow::Refused(undo) => {
                if let Err(e) = free_chunks(h, &undo) {
                    h.report(e);
                }
                return Ok(None);
            }
            // Another thread unmaps memory of the segment, with no lock held: wait for it.
            Grow::Busy => {
                h.wait_for_release();
                continue;
            }
        }
        round += 1;
    }
    Ok(None)
}

/// Frees chunks taken off the arena's free lists (or unmaps a segment's mappings), with no lock
/// held, and reports them back. A chunk whose free fails goes back to the arena (a later release
/// retries it), as does a mapping whose unmapping fails; the first error is returned.
pub(crate) fn free_chunks<H: Host>(h: &H, chunks: &[Detached]) -> Result<(), ErrorOf<H>> {
    if chunks.is_empty() {
        return Ok(());
    }
    let b = h.backend();
    let mut first = Ok(());
    let mut settle = Settle { h, chunks, done: Vec::with_capacity(chunks.len()) };
    for &c in chunks {
        let r = match c.handle {
            None => b.free_chunk(c.ptr, c.size),
            Some(handle) => b.unmap(c.ptr, c.size, handle),
        };
        settle.done.push((c, r.is_ok()));
        if let Err(e) = r
            && first.is_ok()
        {
            first = Err(e);
        }
    }
    drop(settle);
    first
}

/// Reports the outcome of [`free_chunks`] to the arena and wakes the threads waiting for it, also
/// when a backend call unwinds. Without it, chunks taken off the free lists would stay in
/// flight for good, and a growth into their segment would wait for them forever
/// ([`Grow::Busy`]). On unwinding, the call that unwound counts as done: its memory may be lost
/// to the pool, but is never freed twice, nor handed out unmapped. The calls not made yet go
/// back to the arena, as failed ones do.
struct Settle<'a, H: Host> {
    h: &'a H,
    chunks: &'a [Detached],
    done: Vec<(Detached, bool)>,
}

impl<H: Host> Drop for Settle<'_, H> {
    fn drop(&mut self) {
        let mut rest = self.chunks[self.done.len()..].iter();
        if let Some(&in_flight) = rest.next() {
            self.done.push((in_flight, true));
            self.done.extend(rest.map(|&c| (c, false)));
        }
        let (h, done) = (self.h, &self.done);
        h.arena(|a| a.finish_release(h.backend(), done));
        h.released();
    }
}

/// Returns an allocation to the pool, in stream order: the memory becomes reusable by work queued
/// on `stream` after this call, and by other streams only once they are ordered after it.
/// `bytes` must be the size passed to `allocate`. Makes no backend call.
#[inline]
pub(crate) fn deallocate<H: Host>(
    h: &H,
    ptr: u64,
    bytes: usize,
    stream: &StreamOf<H>,
) -> Result<(), PoolError<ErrorOf<H>>> {
    match h.existing_cache(stream, |c| c.free_here(ptr, bytes)).unwrap_or(Found::Missing) {
        Found::Here(_) => Ok(()),
        Found::WrongSize => Err(PoolError::InvalidFree { ptr, bytes }),
        Found::Missing => deallocate_elsewhere(h, ptr, bytes, stream),
    }
}

/// A free on another stream than the allocation's: find it among the blocks reserved for graphs,
/// in the other caches, or among the orphans of forgotten streams, and cache its block on
/// `stream`.
#[inline(never)]
fn deallocate_elsewhere<H: Host>(
    h: &H,
    ptr: u64,
    bytes: usize,
    stream: &StreamOf<H>,
) -> Result<(), PoolError<ErrorOf<H>>> {
    if let Some(freed) = graph::free_graph_block(h, ptr, bytes, stream) {
        return freed;
    }
    let invalid = PoolError::InvalidFree { ptr, bytes };
    for key in h.arena(|a| a.stream_keys()) {
        if key == *stream {
            continue;
        }
        match h.existing_cache(&key, |c| c.remove_live(ptr, bytes)) {
            Some(Found::Here(live)) => {
                h.cache(stream, |c| c.put_free(ptr, live));
                return Ok(());
            }
            Some(Found::WrongSize) => return Err(invalid),
            _ => {}
        }
    }
    let orphan = h.arena(|a| match a.orphans.get(&ptr) {
        Some(l) if l.requested == bytes => a.orphans.remove(&ptr),
        _ => None,
    });
    match orphan {
        Some(live) => {
            h.cache(stream, |c| c.put_free(ptr, live));
            Ok(())
        }
        None => Err(invalid),
    }
}

/// Gives every stream's cached free blocks back to the arena. Returns how many.
pub(crate) fn flush_caches<H: Host>(h: &H) -> usize {
    let mut flushed = 0;
    let mut in_use = 0;
    for key in h.arena(|a| a.stream_keys()) {
        // The blocks go back with the cache still held, so that the stream cannot be forgotten in
        // between (its retirement takes the cache first).
        flushed += h
            .existing_cache(&key, |c| {
                in_use += c.stats.live_bytes;
                let blocks = c.take_free();
                h.arena(|a| a.give_back(c.slot, &blocks));
                blocks.len()
            })
            .unwrap_or(0);
    }
    h.arena(|a| {
        a.note_in_use(in_use);
        if flushed > 0 {
            a.stats.cache_flushes += 1;
        }
    });
    flushed
}

/// Gives memory back to the driver until at most `keep_bytes` stay reserved: the caches are given
/// back to the arena, the host waits (with no lock held) for every free to complete, blocks merge,
/// and whole free chunks are freed, smallest sufficient first, then largest first.
pub(crate) fn trim_to<H: Host>(h: &H, keep_bytes: usize) -> Result<(), ErrorOf<H>> {
    let waited = settle(h);
    let released = release_settled(h, keep_bytes);
    h.arena(|a| a.retry_forgets(h.backend()));
    released?;
    waited
}

/// Gives the caches back to the arena, waits on the host (with no lock held) for every free in
/// the arena to complete, and merges the free blocks, which are all host-safe then. On a failed
/// record or wait the others are still done, and the first error is returned.
fn settle<H: Host>(h: &H) -> Result<(), ErrorOf<H>> {
    let b = h.backend();
    flush_caches(h);
    let (waits, mut first) = h.arena(|a| a.waits_for_all_frees(b));
    let mut done = Vec::with_capacity(waits.len());
    for w in waits {
        match b.synchronize(&w.event) {
            Ok(()) => done.push(w),
            Err(e) if first.is_ok() => first = Err(e),
            Err(_) => {}
        }
    }
    h.arena(|a| {
        a.complete(&done);
        a.coalesce_all();
    });
    first
}

/// Frees whole free chunks whose frees the host has seen complete, until at most `keep_bytes`
/// stay reserved.
fn release_settled<H: Host>(h: &H, keep_bytes: usize) -> Result<(), ErrorOf<H>> {
    let detached = h.arena(|a| a.detach_free_chunks(h.backend(), keep_bytes, Completion::Known));
    free_chunks(h, &detached)
}

/// Moves the live allocations of `cache` (taken off its stream) to the arena's orphans, which any
/// stream may free.
pub(crate) fn orphan_live<H: Host>(h: &H, cache: &mut Cache) {
    let live = cache.take_live();
    if !live.is_empty() {
        h.arena(|a| a.orphans.extend(live));
    }
}

/// Retires `cache`, taken off `stream`, whose last user let go of it, and forgets the stream unless
/// it has a newer cache ([`Arena::retire_cache`]). The cache's free blocks go to the arena with a
/// last event recorded on the stream, and its live allocations become orphans that any stream may
/// free. Where the record fails, the arena keeps the stream and the error is returned; the next
/// trim, or the next stream to retire, forgets it ([`Arena::retry_forgets`]). (Waiting for the
/// stream on the host instead would not be sound for a per-thread stream retired off its thread:
/// its handle there is the legacy stream, whose wait does not cover the owner's work. It would
/// also block under the stream's attachments lock.)
///
/// The blocks go back under the stream's state as the arena knows it now (a fresh one if it has
/// none), not the cache's slot: the retirement may run late (a capture defers it), after a
/// teardown dropped the stream's state ([`Arena::forget_idle_streams`]; the cached blocks were out
/// of the arena, so it held none), and the slot may hold another stream's state since.
pub(crate) fn retire<H: Host>(h: &H, stream: &StreamOf<H>, mut cache: Cache) -> Result<(), ErrorOf<H>> {
    orphan_live(h, &mut cache);
    let blocks = cache.take_free();
    let stats = cache.stats;
    h.arena(|a| {
        if !blocks.is_empty() {
            let slot = a.register(stream);
            a.give_back(slot, &blocks);
        }
        a.stats.retired_allocations += stats.allocations;
        a.stats.retired_hits += stats.hits;
        // The most in use at once stays a high-water mark when the stream whose cache saw it goes.
        a.note_in_use(stats.peak_live_bytes);
        a.retry_forgets(h.backend());
        a.retire_cache(h.backend(), stream)
    })
}

/// Tears the pool down: gives everything free back to the driver and forgets every stream left
/// with nothing cached. What is still live is reported, and its chunks are kept.
pub(crate) fn teardown<H: Host>(h: &H) -> Result<Leaked, ErrorOf<H>> {
    let mut allocations = 0;
    let mut bytes = 0;
    for key in h.arena(|a| a.stream_keys()) {
        h.existing_cache(&key, |c| {
            allocations += c.stats.live;
            bytes += c.stats.live_bytes;
        });
    }
    h.arena(|a| {
        allocations += a.orphans.len();
        bytes += a.orphans.values().map(|l| l.requested).sum::<usize>();
    });
    // A range that could not be given back is reported again: it stays reserved for good now.
    h.arena(|a| a.rearm_refusals());
    trim_to(h, 0)?;
    Ok(h.arena(|a| {
        a.forget_idle_streams();
        a.leaked(allocations, bytes)
    }))
}

/// Whether `ptr` is a live allocation of the pool (looking first in `stream`'s cache).
pub(crate) fn owns<H: Host>(h: &H, ptr: u64, stream: &StreamOf<H>) -> bool {
    let live = |c: &mut Cache| c.contains(ptr);
    if h.existing_cache(stream, live) == Some(true) {
        return true;
    }
    h.arena(|a| a.stream_keys()).iter().any(|k| h.existing_cache(k, live) == Some(true))
        || h.arena(|a| a.orphans.contains_key(&ptr) || a.owns_graph_block(ptr))
}

/// The pool's figures: the arena's, plus every stream's summed.
pub(crate) fn stats<H: Host>(h: &H) -> PoolStats {
    let mut sum = CacheStats::default();
    let mut peak_one = 0;
    for key in h.arena(|a| a.stream_keys()) {
        h.existing_cache(&key, |c| {
            let s = c.stats;
            sum.live += s.live;
            sum.live_bytes += s.live_bytes;
            sum.live_block_bytes += s.live_block_bytes;
            sum.free_bytes += s.free_bytes;
            sum.allocations += s.allocations;
            sum.hits += s.hits;
            peak_one = peak_one.max(s.peak_live_bytes);
        });
    }
    let paced = h.backend().pacing();
    h.arena(|a| {
        let graphs = a.graph_use();
        let orphan_bytes: usize = a.orphans.values().map(|l| l.requested).sum::<usize>() + graphs.bytes;
        let orphan_blocks: usize = a.orphans.values().map(|l| l.size).sum::<usize>() + graphs.block_bytes;
        let in_use = sum.live_bytes + orphan_bytes;
        a.note_in_use(in_use);
        let s = &a.stats;
        PoolStats {
            reserved: s.reserved,
            peak_reserved: s.peak_reserved,
            in_use,
            peak_in_use: s.peak_in_use.max(peak_one),
            in_use_blocks: sum.live_block_bytes + orphan_blocks,
            live_allocations: sum.live + a.orphans.len() + graphs.allocations,
            cached: sum.free_bytes,
            chunks: s.chunks,
            streams: a.streams.len(),
            driver_allocs: s.driver_allocs,
            driver_alloc_bytes: s.driver_alloc_bytes,
            driver_frees: s.driver_frees,
            allocations: sum.allocations + s.retired_allocations,
            cache_hits: sum.hits + s.retired_hits,
            cross_stream_reuses: s.cross_stream_reuses,
            cache_flushes: s.cache_flushes,
            events_created: s.events_created,
            event_records: s.event_records,
            event_waits: s.event_waits,
            event_syncs: s.event_syncs,
            event_queries: s.event_queries,
            oom_recoveries: s.oom_recoveries,
            reservoirs: s.reservoirs,
            driver_spare: a.driver_spare,
            paced_allocations: paced.pauses,
            pacing_time: paced.paused,
            driver_waits_after_free: paced.driver_waits,
        }
    })
}

/// Resets the high-water marks that [`stats()`] reports to the current values. The most memory
/// live at once that the arena's placement follows ([`ArenaStats::peak_live`](arena::ArenaStats),
/// its headroom and whether it has settled) is not one of them: a user resetting the figures
/// between epochs would otherwise change what the pool keeps cached, as the driver's own pools do
/// not.
pub(crate) fn reset_peaks<H: Host>(h: &H) {
    for key in h.arena(|a| a.stream_keys()) {
        h.existing_cache(&key, |c| c.stats.peak_live_bytes = c.stats.live_bytes);
    }
    let in_use = stats(h).in_use;
    h.arena(|a| {
        let s = &mut a.stats;
        s.peak_reserved = s.reserved;
        s.peak_in_use = in_use;
    });
}

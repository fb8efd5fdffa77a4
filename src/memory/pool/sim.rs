//! [`SimulatedPool`]: the pool's bookkeeping on an emulated device, with no GPU and no driver. It
//! makes the same decisions as [`StreamOrderedPool`](crate::memory::StreamOrderedPool) (same code),
//! so that allocation traces can be replayed anywhere: their memory use checked in CI, and
//! configurations compared.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};

use super::arena::Arena;
use super::backend::{Backend, DRIVER_SPARE, RANGE_PER_BYTE, Segments};
use super::cache::Cache;
use super::config::PoolConfig;
use super::error::PoolError;
use super::stats::PoolStats;
use super::{Host, round_up};
use crate::error::{Error, Result};

/// The emulated device: memory up to a limit, with virtual memory management (2 MiB pages), and
/// streams with no work queued, so that every event is complete as soon as it is recorded.
#[derive(Debug)]
pub(crate) struct SimDevice {
    limit: usize,
    reserved: Cell<usize>,
    /// Where the next range of addresses starts, above every range given so far.
    next: Cell<u64>,
    /// The ranges of addresses in use: start -> end (a page past the range's last byte).
    in_use: RefCell<BTreeMap<u64, u64>>,
}

/// The emulated page size.
const PAGE: usize = 2 << 20;

/// The lowest address the emulated device gives.
const FIRST_ADDRESS: u64 = 1 << 40;

impl SimDevice {
    /// Takes `bytes` of the emulated memory, keeping back what the driver needs for itself, as
    /// the driver does.
    fn take_memory(&self, bytes: usize) -> Result<(), SimOom> {
        if (self.limit - self.reserved.get()).saturating_sub(DRIVER_SPARE) < bytes {
            return Err(SimOom);
        }
        self.reserved.set(self.reserved.get() + bytes);
        Ok(())
    }

    /// A new range of `bytes` addresses, aligned as the driver's and never adjacent to another in
    /// use: above every range given so far, or, once those reach the end of the address space,
    /// in the lowest gap between the ranges in use that holds it (`None` where none does).
    /// Without the gaps, an unlimited device that gave and took back chunks of `MAX_REQUEST`
    /// bytes handed out a range past the end of the address space at the fourth, which wrapped
    /// to address 0: the pool's bookkeeping then found no block at a block's own address (a
    /// panic), and overflowed in debug builds.
    fn addresses(&self, bytes: usize) -> Option<u64> {
        let span = u64::try_from(round_up(bytes, PAGE)?).ok()?.checked_add(PAGE as u64)?;
        let mut in_use = self.in_use.borrow_mut();
        let next = self.next.get();
        let start = match next.checked_add(span) {
            Some(end) => {
                self.next.set(end);
                next
            }
            None => {
                let mut at = FIRST_ADDRESS;
                let mut gap = None;
                for (&start, &end) in in_use.iter() {
                    if start - at >= span {
                        gap = Some(at);
                        break;
                    }
                    at = end;
                }
                gap.or_else(|| (u64::MAX - at >= span).then_some(at))?
            }
        };
        in_use.insert(start, start + span);
        Some(start)
    }
}

/// Out of emulated memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SimOom;

impl Backend for SimDevice {
    type Stream = usize;
    type Event = ();
    type Error = SimOom;

    fn alloc_chunk(&self, bytes: usize) -> Result<u64, SimOom> {
        self.take_memory(bytes)?;
        self.addresses(bytes).ok_or_else(|| {
            self.reserved.set(self.reserved.get() - bytes);
            SimOom
        })
    }

    fn free_chunk(&self, ptr: u64, bytes: usize) -> Result<(), SimOom> {
        self.in_use.borrow_mut().remove(&ptr);
        self.reserved.set(self.reserved.get() - bytes);
        Ok(())
    }

    fn segments(&self) -> Option<Segments> {
        let reserve = match self.limit {
            usize::MAX => 1 << 44,
            limit => round_up(limit.saturating_mul(RANGE_PER_BYTE), PAGE).unwrap_or(1 << 44),
        };
        Some(Segments { granularity: PAGE, reserve })
    }

    fn reserve(&self, bytes: usize) -> Result<u64, SimOom> {
        self.addresses(bytes).ok_or(SimOom)
    }

    fn free_reserve(&self, va: u64, _bytes: usize) -> Result<(), SimOom> {
        self.in_use.borrow_mut().remove(&va);
        Ok(())
    }

    fn map(&self, _va: u64, bytes: usize) -> Result<u64, SimOom> {
        self.take_memory(bytes)?;
        Ok(0)
    }

    fn unmap(&self, _va: u64, bytes: usize, _handle: u64) -> Result<(), SimOom> {
        // A mapping takes memory, not addresses: its range's stay in use.
        self.reserved.set(self.reserved.get() - bytes);
        Ok(())
    }

    fn free_memory(&self) -> Option<usize> {
        (self.limit != usize::MAX).then(|| self.limit - self.reserved.get())
    }

    fn is_out_of_memory(&self, _err: &SimOom) -> bool {
        true
    }

    fn create_event(&self) -> Result<(), SimOom> {
        Ok(())
    }

    fn record(&self, _event: &(), _stream: &usize) -> Result<(), SimOom> {
        Ok(())
    }

    fn wait(&self, _waiter: &usize, _event: &()) -> Result<(), SimOom> {
        Ok(())
    }

    fn synchronize(&self, _event: &()) -> Result<(), SimOom> {
        Ok(())
    }

    fn query(&self, _event: &()) -> Result<bool, SimOom> {
        Ok(true)
    }
}

/// The pool's state on the emulated device.
struct SimHost {
    device: SimDevice,
    arena: RefCell<Arena<SimDevice>>,
    caches: RefCell<HashMap<usize, Cache>>,
}

impl Host for SimHost {
    type B = SimDevice;

    fn backend(&self) -> &SimDevice {
        &self.device
    }

    fn arena<R>(&self, f: impl FnOnce(&mut Arena<SimDevice>) -> R) -> R {
        f(&mut self.arena.borrow_mut())
    }

    fn cache<R>(&self, stream: &usize, f: impl FnOnce(&mut Cache) -> R) -> R {
        let mut caches = self.caches.borrow_mut();
        let cache = caches.entry(*stream).or_insert_with(|| self.arena(|a| a.new_cache(stream)));
        f(cache)
    }

    fn existing_cache<R>(&self, stream: &usize, f: impl FnOnce(&mut Cache) -> R) -> Option<R> {
        self.caches.borrow_mut().get_mut(stream).map(f)
    }
}

/// A stream-ordered pool on an emulated device: the bookkeeping of
/// [`StreamOrderedPool`](crate::memory::StreamOrderedPool), with no GPU and no driver. Streams are
/// numbers; the device's memory may be limited; the emulated GPU has no work queued, so frees
/// complete at once.
///
/// It answers what the real pool would reserve for a sequence of allocations and frees (for
/// example a trace recorded from a framework), and whether it fits in a given amount of memory.
///
/// The emulated device has virtual memory management, so with
/// [`PoolConfig::expandable`] (the default) the pool grows in segments, as `StreamOrderedPool`
/// does on such a device. With `expandable: false` it grows in chunks, as on a device without
/// (Windows in TCC mode, as reported).
///
/// ```
/// use cudrv::memory::{PoolConfig, SimulatedPool};
/// let pool = SimulatedPool::new(PoolConfig::default(), Some(1 << 30));
/// let a = pool.allocate(300 << 20, 0)?;
/// let b = pool.allocate(300 << 20, 1)?;
/// pool.deallocate(a, 300 << 20, 0)?;
/// let c = pool.allocate(200 << 20, 1)?; // reuses a's memory, after an (emulated) event wait
/// let stats = pool.stats();
/// assert_eq!(stats.in_use, 500 << 20);
/// assert!(stats.reserved <= 600 << 20);
/// assert!(pool.allocate(800 << 20, 0).is_err()); // beyond the 1 GiB of the emulated device
/// # let _ = (b, c);
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct SimulatedPool {
    host: SimHost,
}

impl std::fmt::Debug for SimulatedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimulatedPool").field("stats", &self.stats()).finish()
    }
}

impl SimulatedPool {
    /// An empty pool with `config` on an emulated device with `memory_limit` bytes (`None`: no
    /// limit).
    pub fn new(config: PoolConfig, memory_limit: Option<usize>) -> SimulatedPool {
        let device = SimDevice {
            limit: memory_limit.unwrap_or(usize::MAX),
            reserved: Cell::new(0),
            next: Cell::new(FIRST_ADDRESS),
            in_use: RefCell::new(BTreeMap::new()),
        };
        let mut arena = Arena::new(config);
        arena.use_segments(device.segments());
        SimulatedPool { host: SimHost { device, arena: RefCell::new(arena), caches: RefCell::new(HashMap::new()) } }
    }

    /// Allocates `bytes` on stream `stream`.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the emulated device cannot hold it, also after the pool
    /// released what it caches; [`Error::InvalidArgument`] for a request above the largest the
    /// pool accepts.
    pub fn allocate(&self, bytes: usize, stream: usize) -> Result<u64> {
        super::allocate(&self.host, bytes, &stream, false).map_err(|e| self.error(e))
    }

    /// Frees `ptr` (of `bytes` bytes) on stream `stream`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a pointer that is not a live allocation of this size.
    pub fn deallocate(&self, ptr: u64, bytes: usize, stream: usize) -> Result<()> {
        super::deallocate(&self.host, ptr, bytes, &stream).map_err(|e| self.error(e))
    }

    /// Gives cached memory back until at most `keep_bytes` are reserved.
    pub fn trim(&self, keep_bytes: usize) {
        let _ = super::trim_to(&self.host, keep_bytes);
    }

    /// The pool's figures.
    pub fn stats(&self) -> PoolStats {
        super::stats(&self.host)
    }

    /// Resets the high-water marks to the current values.
    pub fn reset_peaks(&self) {
        super::reset_peaks(&self.host);
    }

    /// The chunks and their free blocks, for tests that explain a decision.
    #[cfg(test)]
    pub(crate) fn describe(&self) -> String {
        self.host.arena(|a| a.describe())
    }

    fn error(&self, e: PoolError<SimOom>) -> Error {
        match e {
            PoolError::OutOfMemory { requested, reserved, in_use } => {
                Error::OutOfMemory { requested, device: 0, resource: "SimulatedPool", reserved, in_use }
            }
            PoolError::TooLarge { requested } => {
                Error::InvalidArgument(format!("an allocation of {requested} bytes is too large"))
            }
            PoolError::InvalidFree { ptr, bytes } => Error::InvalidArgument(format!(
                "{ptr:#x} with {bytes} bytes is not a live allocation of this SimulatedPool"
            )),
            PoolError::Backend(SimOom) => {
                Error::OutOfMemory { requested: 0, device: 0, resource: "SimulatedPool", reserved: 0, in_use: 0 }
            }
        }
    }
}

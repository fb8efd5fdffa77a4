//! [`Pacing`]: a chunk allocation waits a little after the pool's frees, where the driver was
//! seen to finish frees in the background and to make an allocation that comes too soon wait far
//! longer.
//!
//! Measured on an H100 with driver 580 (BENCHMARKS.md, run 81): with the device full, a
//! `cuMemAlloc` of 200 MiB right after a `cuMemFree` of 200 MiB took 7.4-7.6 ms; 0.05-0.25 ms
//! after it, still 7.4 ms; 0.5 ms after it, 0.24 ms. Synchronising the context or asking
//! `cuMemGetInfo` in between changed nothing. In a pool trading chunks under a budget, the
//! allocations that followed a free of 32 MiB or more were slow in about half the cases and more
//! often the larger the free, with memory to spare or not; after frees under 16 MiB, almost never.
//! So the driver seems to finish a free in the background (about 1.3-2.5 µs per MiB there), and
//! an allocation that comes before it is done waits about 5-7.5 ms.
//!
//! The pool cannot ask the driver whether that work is done. It estimates it instead: each free
//! of `bytes` adds `bytes` at [`DEFAULT_NS_PER_MIB`] to a backlog that starts when the free
//! returns. A chunk allocation that starts before the backlog is done (or within
//! [`NOTICE_WINDOW`] of it) and takes [`SLOW_ALLOCATION`] or longer shows that this driver makes
//! allocations wait for its frees: from then on, an allocation first waits out what is left of
//! the backlog, at most [`MAX_PAUSE`]. A paced allocation that still waits doubles the estimate
//! (up to [`MAX_NS_PER_MIB`]); one that still waits at that estimate shows that pausing does not
//! help with this driver, and the pool stops pacing for good. A driver that never makes an
//! allocation wait is never paced.
//! (Where the driver does make it wait, pausing 0.5 ms saves about 7 ms a trade. Run 81's
//! mixed_images in chunks under 1.10x its peak made 1,117 slow allocations of its 2,652, and
//! spent 8.5 s in `cuMemAlloc`; paced in run 82, one allocation was slow, `cuMemAlloc` took
//! 0.36 s and the pauses 0.29 s.)
//!
//! Plain data behind a mutex, taken only around the driver's own allocations and frees (tens of
//! microseconds at least); the clock is passed in, so that tests can drive it.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The first estimate of how long the driver takes to finish a free in the background: 2.5 µs a
/// MiB (runs 81-82: the work of 200 MiB freed took 0.25-0.5 ms, of 600 MiB 1-1.5 ms, of 1,000
/// MiB 1.5-2 ms).
pub(crate) const DEFAULT_NS_PER_MIB: u64 = 2_500;

/// The most the estimate grows to, after paced allocations that still waited: 8 times the first
/// (a device whose frees take longer, one with slower memory, say).
pub(crate) const MAX_NS_PER_MIB: u64 = 8 * DEFAULT_NS_PER_MIB;

/// How long an allocation takes, at least, when the driver made it wait for a free (run 81: 5 to
/// 7.5 ms; allocations that did not wait took 0.05-0.6 ms).
pub(crate) const SLOW_ALLOCATION: Duration = Duration::from_millis(2);

/// How long after the estimated backlog an allocation still counts as coming soon after a free
/// (the estimate may be short on a slower device).
pub(crate) const NOTICE_WINDOW: Duration = Duration::from_millis(2);

/// The longest an allocation waits for the backlog: the work of 4 GiB freed at the first
/// estimate. The driver's own wait comes in steps of 5-7.5 ms (7.4 ms after 200 MiB freed, 14.8 ms
/// after 4 GiB in run 28), while the work grows by about 2 µs a MiB (run 82: 0.5 ms sufficed
/// after 200 MiB freed, 1.5 ms after 600 MiB, 2 ms after 1,000 MiB), so a pause this long still
/// costs less than the wait it avoids.
pub(crate) const MAX_PAUSE: Duration = Duration::from_millis(10);

/// The most background work one free adds to the backlog (far beyond [`MAX_PAUSE`]), so that the
/// backlog's instant cannot overflow.
const MAX_WORK: Duration = Duration::from_secs(1);

/// What [`Pacing`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PacingStats {
    /// Allocations that waited for the backlog of frees before asking the driver.
    pub(crate) pauses: u64,
    /// Their waits, summed.
    pub(crate) paused: Duration,
    /// Allocations soon after a free that the driver made wait ([`SLOW_ALLOCATION`] or longer).
    pub(crate) driver_waits: u64,
}

#[derive(Debug)]
struct State {
    /// When the frees made so far are estimated done; `None` before the first free.
    backlog_until: Option<Instant>,
    /// The estimate per MiB freed, in nanoseconds.
    ns_per_mib: u64,
    /// Whether the driver was seen to make an allocation wait for a free: allocations pause only
    /// then.
    pacing: bool,
    /// Set where pauses at the longest estimate did not avoid the driver's wait: its waits are not
    /// the frees' doing, and the pool never paces again.
    given_up: bool,
    stats: PacingStats,
}

/// Paces chunk allocations after frees. See the module documentation.
#[derive(Debug)]
pub(crate) struct Pacing {
    state: Mutex<State>,
}

/// What [`Pacing::before_alloc`] decided for an allocation: how long to wait first, and whether
/// it comes soon after a free (then [`Pacing::after_alloc`] learns from how long it took).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    pub(crate) pause: Duration,
    soon_after_free: bool,
}

impl Default for Pacing {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                backlog_until: None,
                ns_per_mib: DEFAULT_NS_PER_MIB,
                pacing: false,
                given_up: false,
                stats: PacingStats::default(),
            }),
        }
    }
}

impl Pacing {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Plain counters and instants: a panic elsewhere leaves them usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A free of `bytes` returned at `now`: its background work joins the backlog.
    pub(crate) fn freed(&self, bytes: usize, now: Instant) {
        let mut st = self.state();
        let work = Self::work(bytes, st.ns_per_mib);
        let start = st.backlog_until.map_or(now, |until| until.max(now));
        st.backlog_until = Some(start.checked_add(work).unwrap_or(start));
    }

    /// What an allocation about to start at `now` does first.
    pub(crate) fn before_alloc(&self, now: Instant) -> Ticket {
        let st = self.state();
        let Some(until) = st.backlog_until else { return Ticket { pause: Duration::ZERO, soon_after_free: false } };
        let soon_after_free = now < until.checked_add(NOTICE_WINDOW).unwrap_or(until);
        let pause = if st.pacing { until.saturating_duration_since(now).min(MAX_PAUSE) } else { Duration::ZERO };
        Ticket { pause, soon_after_free }
    }

    /// The allocation of `ticket` was made: granted after `took` in the driver (its pause not
    /// counted), or refused (`None`, which says nothing about frees). Learns whether (and how
    /// much longer) the driver makes allocations wait for frees.
    pub(crate) fn after_alloc(&self, ticket: Ticket, took: Option<Duration>) {
        let mut st = self.state();
        if ticket.pause > Duration::ZERO {
            st.stats.pauses += 1;
            st.stats.paused = st.stats.paused.saturating_add(ticket.pause);
        }
        if !ticket.soon_after_free || took.is_none_or(|took| took < SLOW_ALLOCATION) {
            return;
        }
        st.stats.driver_waits += 1;
        if !st.pacing {
            st.pacing = !st.given_up;
        } else if st.ns_per_mib < MAX_NS_PER_MIB {
            // Paced (or the estimate ran out before the allocation) and the driver still waited:
            // its frees take longer than estimated.
            st.ns_per_mib = st.ns_per_mib.saturating_mul(2).min(MAX_NS_PER_MIB);
        } else {
            // Even the longest estimate did not avoid the wait (a driver whose allocations are
            // slow for another reason, or another allocator's frees): pausing only adds to it.
            st.pacing = false;
            st.given_up = true;
        }
    }

    /// Waits out the backlog where the driver was seen to need it, calls `alloc` (the driver's
    /// allocation), and learns from how long it took.
    pub(crate) fn alloc<T, E>(&self, alloc: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let ticket = self.before_alloc(Instant::now());
        if ticket.pause > Duration::ZERO {
            wait(ticket.pause);
        }
        let start = Instant::now();
        let r = alloc();
        self.after_alloc(ticket, r.is_ok().then(|| start.elapsed()));
        r
    }

    /// What pacing has counted.
    pub(crate) fn stats(&self) -> PacingStats {
        self.state().stats
    }

    /// The background work of a free of `bytes`, at most [`MAX_WORK`].
    fn work(bytes: usize, ns_per_mib: u64) -> Duration {
        let mib = (bytes as u64).div_ceil(1 << 20);
        Duration::from_nanos(mib.saturating_mul(ns_per_mib)).min(MAX_WORK)
    }
}

/// Waits `d` (at most [`MAX_PAUSE`]), yielding the processor: a sleep may oversleep by a timer
/// tick, on Windows by a millisecond or more, where the pauses are a fraction of a millisecond.
fn wait(d: Duration) {
    let start = Instant::now();
    while start.elapsed() < d {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_driver_that_never_waits_is_never_paced() {
        let p = Pacing::default();
        let t0 = Instant::now();
        for i in 0..100 {
            let at = t0 + MS * i;
            p.freed(200 * MIB, at);
            let ticket = p.before_alloc(at);
            assert_eq!(ticket.pause, Duration::ZERO);
            assert!(ticket.soon_after_free);
            p.after_alloc(ticket, Some(Duration::from_micros(300)));
        }
        assert_eq!(p.stats(), PacingStats::default());
    }

    #[test]
    fn one_wait_of_the_driver_turns_pacing_on_for_what_is_left_of_the_backlog() {
        let p = Pacing::default();
        let t0 = Instant::now();
        p.freed(200 * MIB, t0);
        let first = p.before_alloc(t0);
        assert_eq!(first.pause, Duration::ZERO, "not paced before the driver was seen to wait");
        p.after_alloc(first, Some(7 * MS));
        assert_eq!(p.stats().driver_waits, 1);
        // 200 MiB at 2.5 µs a MiB: 0.5 ms of backlog, of which 0.1 ms has passed.
        let t1 = t0 + Duration::from_micros(100);
        p.freed(200 * MIB, t1);
        // The first free's backlog ran to t0 + 0.5 ms; the second's follows it, to t0 + 1 ms.
        let ticket = p.before_alloc(t1);
        assert_eq!(ticket.pause, Duration::from_micros(900));
        p.after_alloc(ticket, Some(Duration::from_micros(240)));
        let st = p.stats();
        assert_eq!((st.pauses, st.paused, st.driver_waits), (1, Duration::from_micros(900), 1));
        // Once the backlog is done, no pause.
        assert_eq!(p.before_alloc(t0 + 2 * MS).pause, Duration::ZERO);
    }

    #[test]
    fn a_slow_allocation_long_after_the_last_free_teaches_nothing() {
        let p = Pacing::default();
        let t0 = Instant::now();
        p.freed(MIB, t0);
        // A large first allocation may take long by itself: 10 ms after the free, it is not the
        // free's doing.
        let ticket = p.before_alloc(t0 + 10 * MS);
        assert!(!ticket.soon_after_free);
        p.after_alloc(ticket, Some(5 * MS));
        p.freed(200 * MIB, t0 + 20 * MS);
        assert_eq!(p.before_alloc(t0 + 20 * MS).pause, Duration::ZERO);
        assert_eq!(p.stats().driver_waits, 0);
        // Nor does an allocation before any free.
        let q = Pacing::default();
        let ticket = q.before_alloc(t0);
        q.after_alloc(ticket, Some(9 * MS));
        assert_eq!(q.stats().driver_waits, 0);
    }

    #[test]
    fn a_paced_allocation_that_still_waits_lengthens_the_estimate_and_past_its_bound_pacing_stops() {
        let p = Pacing::default();
        let t0 = Instant::now();
        let mut at = t0;
        let mut pauses = Vec::new();
        for _ in 0..8 {
            at += 100 * MS;
            p.freed(100 * MIB, at);
            let ticket = p.before_alloc(at);
            pauses.push(ticket.pause);
            p.after_alloc(ticket, Some(6 * MS));
        }
        let us = |n| Duration::from_micros(n);
        // Not paced at first; then 100 MiB at 2.5, 5, 10 and 20 µs a MiB (the bound); the driver
        // still waits at the bound: no more pauses, however often it waits after that.
        let zero = Duration::ZERO;
        assert_eq!(pauses, [zero, us(250), us(500), us(1000), us(2000), zero, zero, zero]);
        let st = p.stats();
        assert_eq!((st.pauses, st.driver_waits), (4, 8), "{st:?}");
        assert!(p.state().given_up);
    }

    #[test]
    fn a_pause_is_waited_out_and_a_refused_allocation_teaches_nothing() {
        let p = Pacing::default();
        let t0 = Instant::now();
        p.freed(64 * MIB, t0);
        p.after_alloc(p.before_alloc(t0), Some(3 * MS));
        // A real allocation while a free's work is left (the free is dated a second ahead, so
        // that however slowly this runs, under Miri say, the whole bound is left): it waits
        // `MAX_PAUSE` before calling the driver.
        p.freed(64 * MIB, Instant::now() + Duration::from_secs(1));
        let called = std::cell::Cell::new(None);
        let start = Instant::now();
        let r: Result<u32, ()> = p.alloc(|| {
            called.set(Some(start.elapsed()));
            Err(())
        });
        assert_eq!(r, Err(()));
        assert!(called.get().is_some_and(|waited| waited >= MAX_PAUSE), "{called:?}");
        let st = p.stats();
        assert_eq!((st.pauses, st.driver_waits), (1, 1), "the pause counts, the refusal teaches nothing: {st:?}");
        assert_eq!(p.state().ns_per_mib, DEFAULT_NS_PER_MIB);
    }

    #[test]
    fn huge_frees_saturate_instead_of_overflowing() {
        let p = Pacing::default();
        let t0 = Instant::now();
        p.freed(usize::MAX, t0);
        p.freed(usize::MAX, t0);
        p.after_alloc(p.before_alloc(t0), Some(3 * MS));
        assert_eq!(p.before_alloc(t0).pause, MAX_PAUSE);
    }
}

//! What cudrv does inside a host function ([`Stream::launch_host_fn`](crate::Stream::launch_host_fn)).
//!
//! The driver runs host functions on one of its own threads and forbids every CUDA call there: a
//! call may fail with `CUDA_ERROR_NOT_PERMITTED`, or deadlock, since the driver may wait for the
//! host function to finish before it can serve the call. Yet the usual way to keep memory alive
//! until queued work is done is exactly to move it into a host function and drop it there.
//!
//! So cudrv knows when it runs inside a host function (a thread-local flag that the trampoline
//! sets), and then:
//!
//! * every cudrv `Drop` that would call the driver (buffers, pinned memory, streams, events,
//!   modules, pools, contexts) hands that work to a cudrv thread ([`defer`]), which performs it at
//!   once, outside the driver's callback. A buffer's stream-ordered free is then queued a little
//!   later than the drop, which is still after every use of the buffer;
//! * every other cudrv call that would reach the driver returns
//!   [`Error::InHostFunction`](crate::Error::InHostFunction) before doing anything.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

thread_local! {
    static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
    /// Set on cudrv's deferred-work thread.
    static ON_DEFERRED_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread works for cudrv or the driver rather than for the user: a host
/// function's, or cudrv's deferred-work thread. Such a thread does not become the owner of a
/// stream's gate (see `StreamKey::enter`), which should go to the thread that queues its work.
pub(crate) fn on_helper_thread() -> bool {
    in_host_fn() || ON_DEFERRED_THREAD.with(Cell::get)
}

/// Whether the calling thread is running a host function queued by cudrv.
#[inline]
pub(crate) fn in_host_fn() -> bool {
    IN_HOST_FN.with(Cell::get)
}

/// [`crate::Error::InHostFunction`] for `call` inside a host function, where the driver may not be
/// called (it may fail or deadlock); `Ok` elsewhere.
pub(crate) fn refuse_in_host_fn(call: &'static str) -> crate::Result<()> {
    if in_host_fn() { Err(crate::Error::InHostFunction { call }) } else { Ok(()) }
}

/// Marks the calling thread as running a host function until dropped.
pub(crate) struct HostFnScope {
    was: bool,
}

impl HostFnScope {
    pub(crate) fn enter() -> HostFnScope {
        HostFnScope { was: IN_HOST_FN.with(|f| f.replace(true)) }
    }
}

impl Drop for HostFnScope {
    fn drop(&mut self) {
        IN_HOST_FN.with(|f| f.set(self.was));
    }
}

/// Work for cudrv's deferred-work thread: once, or until it reports that it is done.
enum Job {
    Once(Box<dyn FnOnce() + Send + 'static>),
    Until(Retry),
}

type Retry = Box<dyn FnMut() -> bool + Send + 'static>;

/// How often the thread tries again the work that was not done ([`defer_until`]) while no other
/// work comes.
const RETRY_EVERY: Duration = Duration::from_millis(1);

struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    ready: Condvar,
}

/// The queue, with its thread started on first use; `None` if the thread could not be started.
fn queue() -> Option<&'static Queue> {
    static QUEUE: OnceLock<Option<&'static Queue>> = OnceLock::new();
    *QUEUE.get_or_init(|| {
        let q: &'static Queue = Box::leak(Box::new(Queue { jobs: Mutex::new(VecDeque::new()), ready: Condvar::new() }));
        match std::thread::Builder::new().name("cudrv-deferred".into()).spawn(move || run(q)) {
            Ok(_) => Some(q),
            Err(e) => {
                warn_line!(
                    "cudrv: cannot start the thread for work deferred out of host functions ({e}); \
                     what host functions drop is leaked"
                );
                None
            }
        }
    })
}

fn run(q: &'static Queue) {
    ON_DEFERRED_THREAD.with(|f| f.set(true));
    // This thread never captures, and its waits and frees are never part of a capture: the
    // driver must not refuse them while another thread captures in global mode.
    let _relaxed = crate::capture::RelaxedCaptureMode::always();
    loop {
        // Work that deferred work deferred comes first: it belongs to the job that came before.
        run_next();
        let queued = {
            let mut jobs = q.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            loop {
                if let Some(job) = jobs.pop_front() {
                    break Some(job);
                }
                if !retries_pending() {
                    jobs = q.ready.wait(jobs).unwrap_or_else(std::sync::PoisonError::into_inner);
                } else {
                    let (j, wait) =
                        q.ready.wait_timeout(jobs, RETRY_EVERY).unwrap_or_else(std::sync::PoisonError::into_inner);
                    jobs = j;
                    if wait.timed_out() {
                        break None;
                    }
                }
            }
        };
        // What was not done is tried again before each job queued later, and every
        // `RETRY_EVERY`; what that defers runs before the job, and what that defers in turn. So
        // `flush_deferred_drops`'s job runs after one more try of the work queued before it, and
        // after everything that try led to.
        try_retries();
        run_next();
        if let Some(job) = queued {
            run_job(job);
        }
    }
}

/// Runs the work deferred by deferred work ([`NEXT`]) until there is none, with what it defers in
/// turn.
fn run_next() {
    while let Some(job) = NEXT.with(|n| n.borrow_mut().pop_front()) {
        run_job(job);
    }
}

/// Runs one job on the deferred-work thread.
fn run_job(job: Job) {
    match job {
        Job::Once(job) => {
            // A panic in a drop must not end the thread that serves every later one (nor may its
            // payload, as it is dropped).
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)) {
                warn_line!("cudrv: work deferred out of a host function panicked");
                drop_panic_payload(payload);
            }
        }
        Job::Until(mut retry) => {
            if !done(&mut retry) {
                RETRIES.with(|r| r.borrow_mut().push(retry));
            }
        }
    }
}

thread_local! {
    /// On cudrv's deferred-work thread: the work that is not done yet ([`defer_until`]).
    static RETRIES: RefCell<Vec<Retry>> = const { RefCell::new(Vec::new()) };
    /// On cudrv's deferred-work thread: work deferred by deferred work, run before the jobs
    /// queued meanwhile (a flush's among them).
    static NEXT: RefCell<VecDeque<Job>> = const { RefCell::new(VecDeque::new()) };
}

/// Whether work waits to be tried again, on the deferred-work thread.
fn retries_pending() -> bool {
    RETRIES.with(|r| !r.borrow().is_empty())
}

/// Tries again the work that was not done, on the deferred-work thread. What a retry defers goes
/// to the work deferred by deferred work ([`push`]), which runs next.
fn try_retries() {
    let mut pending = RETRIES.with(|r| std::mem::take(&mut *r.borrow_mut()));
    pending.retain_mut(|retry| !done(retry));
    RETRIES.with(|r| r.borrow_mut().append(&mut pending));
}

/// Tries `retry` once: whether it is done (a panic counts as done, and is reported).
fn done(retry: &mut Retry) -> bool {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(retry)).unwrap_or_else(|payload| {
        warn_line!("cudrv: deferred work panicked");
        drop_panic_payload(payload);
        true
    })
}

/// Drops the payload of a caught panic, which may panic again as it goes (a payload of
/// `std::panic::panic_any` whose `Drop` panics): that panic is caught too, and its own payload
/// forgotten (leaked), so that nothing unwinds out of the caller, a callback of the driver's
/// (where unwinding into C aborts the process) or cudrv's deferred-work thread (which serves every
/// later deferred drop).
pub(crate) fn drop_panic_payload(payload: Box<dyn std::any::Any + Send>) {
    if let Err(again) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

/// Runs `job` on cudrv's deferred-work thread, as soon as possible: for work that must not run
/// inside a host function. Deferred by deferred work, it runs before the jobs queued meanwhile
/// (so that [`flush_deferred_drops`] waits for it too). If that thread could not be started the
/// job is forgotten: what it would free leaks, which is sound.
pub(crate) fn defer(job: impl FnOnce() + Send + 'static) {
    push(Job::Once(Box::new(job)));
}

/// Runs `job` now, or on cudrv's deferred-work thread ([`defer`]) inside a host function, where
/// it must not run: for drops that call the driver or wait.
pub(crate) fn now_or_deferred(job: impl FnOnce() + Send + 'static) {
    if in_host_fn() { defer(job) } else { job() }
}

/// Runs `job` on cudrv's deferred-work thread until it returns true (it is done): first as
/// [`defer`] does, then again before each job queued later and every millisecond. For work that
/// must wait for another thread but must not block that thread, which may itself wait for the
/// deferred work ([`flush_deferred_drops`] runs after one more try of it). Forgotten, as with
/// [`defer`], if the thread could not be started.
pub(crate) fn defer_until(job: impl FnMut() -> bool + Send + 'static) {
    push(Job::Until(Box::new(job)));
}

/// Runs `attempt` on `state` now; where it hands the state back (the work cannot be done yet),
/// runs it again on cudrv's deferred-work thread until it does not ([`defer_attempts`]).
pub(crate) fn attempt_until_done<T: Send + 'static>(
    state: T,
    mut attempt: impl FnMut(T) -> Option<T> + Send + 'static,
) {
    if let Some(state) = attempt(state) {
        defer_attempts(state, attempt);
    }
}

/// Runs `attempt` on `state` on cudrv's deferred-work thread, again and again while it hands the
/// state back ([`defer_until`]): so a later [`flush_deferred_drops`] finds it tried once more
/// after what was deferred before it, such as the end of a capture it waits for.
pub(crate) fn defer_attempts<T: Send + 'static>(state: T, mut attempt: impl FnMut(T) -> Option<T> + Send + 'static) {
    let mut pending = Some(state);
    defer_until(move || {
        pending = pending.take().and_then(&mut attempt);
        pending.is_none()
    });
}

/// Queues `job` for the deferred-work thread; from that thread itself, ahead of the jobs queued
/// meanwhile (see [`run`]).
fn push(job: Job) {
    if ON_DEFERRED_THREAD.with(Cell::get) {
        NEXT.with(|n| n.borrow_mut().push_back(job));
        return;
    }
    match queue() {
        Some(q) => {
            q.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push_back(job);
            q.ready.notify_one();
        }
        None => std::mem::forget(job),
    }
}

/// Waits until every drop that cudrv deferred out of a host function so far has been carried out
/// (see [`Stream::launch_host_fn`](crate::Stream::launch_host_fn)): for example before reading a
/// resource's statistics, or trimming it, after work whose host functions dropped buffers. A
/// stream whose last user went while another thread was queueing work on it is destroyed by the
/// same thread: this waits for one more try at that, which succeeds unless work is being queued
/// on the stream still (or by the caller, from a custom resource's `allocate` or `deallocate`).
/// Work that waits for a capture to end (the release of a graph, or of its executable graph,
/// dropped while the stream of its last launch captured; a pool's retirement of a stream that
/// went during a capture) is likewise tried once more, with what it leads to: after
/// `end_capture`, a flush finds it done.
///
/// ```no_run
/// # fn main() -> cudrv::Result<()> {
/// use cudrv::memory::DeviceBuffer;
/// use cudrv::{Device, Stream};
///
/// let dev = Device::get(0)?;
/// let stream = Stream::new(&dev)?;
/// let buf = DeviceBuffer::<f32>::zeroed(1 << 20, &stream)?;
/// // Dropped in the host function: its free is deferred to cudrv's thread.
/// stream.launch_host_fn(move || drop(buf))?;
/// stream.synchronize()?;
/// cudrv::flush_deferred_drops()?;
/// // The resource's statistics now count the buffer as freed.
/// let in_use = dev.memory_resource()?.stats().map(|s| s.in_use);
/// # let _ = in_use;
/// # Ok(())
/// # }
/// ```
///
/// Called on cudrv's own thread (a custom resource's `deallocate`, for a buffer dropped in a
/// host function, runs there), it returns at once: what was deferred before is done.
///
/// The deferred work may wait for GPU work it must follow (the last launch of a dropped graph,
/// a freed buffer's uses on other streams), so a flush may wait for it too: as with
/// [`Stream::synchronize`](crate::Stream::synchronize), do not flush while a host function that
/// such work waits behind waits for the flushing thread.
///
/// # Errors
/// [`Error::InHostFunction`](crate::Error::InHostFunction) inside a host function (waiting
/// there could deadlock: the deferred work may itself wait for the host function).
pub fn flush_deferred_drops() -> crate::Result<()> {
    if in_host_fn() {
        return Err(crate::Error::InHostFunction { call: "flush_deferred_drops" });
    }
    if ON_DEFERRED_THREAD.with(Cell::get) {
        // Called by deferred work (a custom resource's `deallocate`, for a drop deferred out of
        // a host function): what was deferred before it is done, and waiting for what came
        // after would wait for this thread itself.
        return Ok(());
    }
    if queue().is_some() {
        let (tx, rx) = std::sync::mpsc::channel();
        defer(move || {
            let _ = tx.send(());
        });
        let _ = rx.recv();
    }
    Ok(())
}

/// A raw driver handle moved to the deferred-work thread. Driver handles may be used from any
/// thread; only the Rust type system needs telling.
pub(crate) struct SendHandle<T>(pub(crate) T);

impl<T: Copy> SendHandle<T> {
    /// The handle. (A method, so that closures capture the whole wrapper, not its field.)
    #[inline]
    pub(crate) fn get(&self) -> T {
        self.0
    }
}

// SAFETY: the wrapped values are CUDA driver handles (pointers the driver owns), which the driver
// API lets any thread use; the wrapper only carries one to the deferred-work thread.
unsafe impl<T> Send for SendHandle<T> {}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{defer_until, flush_deferred_drops};

    #[test]
    fn work_deferred_until_done_is_tried_again_before_later_work_and_no_more_once_done() {
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        defer_until(move || counted.fetch_add(1, Ordering::SeqCst) + 1 == 3);
        // Its first try, then one more before the flush's own job.
        flush_deferred_drops().unwrap();
        assert!(tries.load(Ordering::SeqCst) >= 2);
        // Done at the third try, at the latest before this flush's job.
        flush_deferred_drops().unwrap();
        assert_eq!(tries.load(Ordering::SeqCst), 3);
        std::thread::sleep(super::RETRY_EVERY * 5);
        flush_deferred_drops().unwrap();
        assert_eq!(tries.load(Ordering::SeqCst), 3, "tried again once done");
    }

    #[test]
    fn work_deferred_until_done_by_deferred_work_is_tried_before_the_next_job() {
        let tries = Arc::new(AtomicUsize::new(0));
        let (counted, seen) = (tries.clone(), tries.clone());
        let (queued_tx, queued_rx) = std::sync::mpsc::channel::<()>();
        // The first job defers work once the second job is queued behind it.
        super::defer(move || {
            queued_rx.recv().unwrap();
            defer_until(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                true
            })
        });
        let (saw_tx, saw_rx) = std::sync::mpsc::channel();
        super::defer(move || saw_tx.send(seen.load(Ordering::SeqCst)).unwrap());
        queued_tx.send(()).unwrap();
        assert_eq!(saw_rx.recv().unwrap(), 1, "the work was not tried before the job queued before it");
    }

    /// A flush queued while deferred work runs waits for what that work defers in turn: jobs,
    /// and retries (tried once at least), also where a retry that just got done deferred them.
    #[test]
    fn a_flush_waits_for_what_deferred_work_defers() {
        let (runs, retried, chained) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (queued_tx, queued_rx) = std::sync::mpsc::channel::<()>();
        let late = Arc::new(AtomicUsize::new(0));
        let (r, t, c, late2) = (runs.clone(), retried.clone(), chained.clone(), late.clone());
        super::defer(move || {
            // The flush is queued behind this job before it defers anything.
            queued_rx.recv().unwrap();
            let (r2, l) = (r.clone(), late2);
            super::defer(move || {
                // Slow: a flush that did not wait for it would return first.
                std::thread::sleep(std::time::Duration::from_millis(20));
                r2.fetch_add(1, Ordering::SeqCst);
                // Not done at its first try, which comes before the flush returns.
                defer_until(move || {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    l.fetch_add(1, Ordering::SeqCst) + 1 >= 3
                });
            });
            let mut first = true;
            defer_until(move || {
                t.fetch_add(1, Ordering::SeqCst);
                // Done at its first try: what it defers then comes before the flush as well.
                if std::mem::take(&mut first) {
                    let (r3, c2) = (r.clone(), c.clone());
                    super::defer(move || {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        r3.fetch_add(1, Ordering::SeqCst);
                    });
                    defer_until(move || {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        c2.fetch_add(1, Ordering::SeqCst);
                        true
                    });
                }
                true
            });
        });
        let flushed = std::thread::spawn(flush_deferred_drops);
        // The flush's job is queued once the flush waits; give it the time to get there.
        std::thread::sleep(std::time::Duration::from_millis(50));
        queued_tx.send(()).unwrap();
        flushed.join().unwrap().unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 2, "the deferred jobs ran before the flush returned");
        assert_eq!(retried.load(Ordering::SeqCst), 1, "the retry was tried before the flush returned");
        assert_eq!(chained.load(Ordering::SeqCst), 1, "the retry's retry was tried before the flush returned");
        assert!(late.load(Ordering::SeqCst) >= 1, "the deferred job's retry was tried before the flush returned");
    }

    /// A retry done at the try that comes just before a flush's job defers work, which defers
    /// work, which defers work: the flush returns after all of it. (The flush's job was queued
    /// behind the first level only, and returned before the second had run: review 27b.)
    #[test]
    fn a_flush_waits_for_a_chain_that_a_retry_just_done_defers() {
        use std::sync::atomic::AtomicBool;
        let (ready, ran) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let (r, depth) = (ready.clone(), ran.clone());
        defer_until(move || {
            if !r.load(Ordering::SeqCst) {
                return false;
            }
            let d = depth.clone();
            super::defer(move || {
                super::defer(move || {
                    super::defer(move || {
                        // Slow: a flush that did not wait for it would return first.
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        d.fetch_add(1, Ordering::SeqCst);
                    })
                })
            });
            true
        });
        // Tried once: not done, so it waits among the retries.
        flush_deferred_drops().unwrap();
        // Hold cudrv's thread, so that the retry is tried next just before the flush's job.
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        super::defer(move || {
            started_tx.send(()).unwrap();
            let _ = go_rx.recv();
        });
        started_rx.recv().unwrap();
        ready.store(true, Ordering::SeqCst);
        let flushed = std::thread::spawn(flush_deferred_drops);
        let queue = super::queue().expect("the thread runs");
        while queue.jobs.lock().unwrap().is_empty() {
            std::thread::yield_now();
        }
        go_tx.send(()).unwrap();
        flushed.join().unwrap().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1, "the flush returned before the end of the chain");
    }

    #[test]
    fn flushing_on_the_deferred_thread_returns_at_once() {
        let (tx, rx) = std::sync::mpsc::channel();
        super::defer(move || tx.send(flush_deferred_drops().is_ok()).unwrap());
        let flushed = rx.recv_timeout(std::time::Duration::from_secs(10));
        assert_eq!(flushed, Ok(true), "a flush on cudrv's thread waited for that thread");
    }

    #[test]
    fn work_deferred_until_done_that_panics_is_dropped_and_the_thread_goes_on() {
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        defer_until(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            panic!("a deferred retry panicked (expected by the test)")
        });
        flush_deferred_drops().unwrap();
        flush_deferred_drops().unwrap();
        assert_eq!(tries.load(Ordering::SeqCst), 1, "a panic counts as done");
    }
}

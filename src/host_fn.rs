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

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, OnceLock};

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

type Job = Box<dyn FnOnce() + Send + 'static>;

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
        let job = {
            let mut jobs = q.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            loop {
                if let Some(job) = jobs.pop_front() {
                    break job;
                }
                jobs = q.ready.wait(jobs).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        // A panic in a drop must not end the thread that serves every later one.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
            warn_line!("cudrv: work deferred out of a host function panicked");
        }
    }
}

/// Runs `job` on cudrv's deferred-work thread, as soon as possible: for work that must not run
/// inside a host function. If that thread could not be started the job is forgotten: what it
/// would free leaks, which is sound.
pub(crate) fn defer(job: impl FnOnce() + Send + 'static) {
    match queue() {
        Some(q) => {
            q.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push_back(Box::new(job));
            q.ready.notify_one();
        }
        None => std::mem::forget(job),
    }
}

/// Waits until every drop that cudrv deferred out of a host function so far has been carried out
/// (see [`Stream::launch_host_fn`](crate::Stream::launch_host_fn)): for example before reading a
/// resource's statistics, or trimming it, after work whose host functions dropped buffers.
///
/// # Errors
/// [`Error::InHostFunction`](crate::Error::InHostFunction) inside a host function (waiting
/// there could deadlock: the deferred work may itself wait for the host function).
pub fn flush_deferred_drops() -> crate::Result<()> {
    if in_host_fn() {
        return Err(crate::Error::InHostFunction { call: "flush_deferred_drops" });
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

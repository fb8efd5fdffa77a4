//! What the lower layers know of the stream captures cudrv started: their ids, with what the graph
//! layer keeps for each (type-erased, for `crate::graph` sits above streams), and the calling
//! thread's capture mode for cudrv's own driver calls. See [`crate::graph`].

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use crate::result::drv;

/// A capture cudrv tracks: its session, and the contexts of the streams that take part in it
/// (by address: the session keeps the streams, which keep their contexts).
struct Tracked {
    session: Arc<dyn Any + Send + Sync>,
    contexts: Vec<usize>,
}

/// Each capture cudrv tracks, by the driver's capture id.
type Sessions = HashMap<u64, Tracked>;

fn sessions() -> MutexGuard<'static, Sessions> {
    static SESSIONS: OnceLock<Mutex<Sessions>> = OnceLock::new();
    SESSIONS.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner)
}

/// How many captures are registered, so that the common case (none) costs one load.
static ACTIVE_CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// Whether a capture started by cudrv may be active.
#[inline]
pub(crate) fn any_active() -> bool {
    ACTIVE_CAPTURES.load(Ordering::Relaxed) != 0
}

/// Starts tracking capture `id` with `session`, begun on a stream of context `context` (its
/// address).
pub(crate) fn register(id: u64, session: Arc<dyn Any + Send + Sync>, context: usize) {
    if sessions().insert(id, Tracked { session, contexts: vec![context] }).is_none() {
        ACTIVE_CAPTURES.fetch_add(1, Ordering::Relaxed);
    }
}

/// Notes that a stream of context `context` (its address) joined capture `id`, if the capture is
/// still tracked; whether it is.
pub(crate) fn join(id: u64, context: usize) -> bool {
    match sessions().get_mut(&id) {
        Some(tracked) => {
            if !tracked.contexts.contains(&context) {
                tracked.contexts.push(context);
            }
            true
        }
        None => false,
    }
}

/// Whether a stream of context `context` (its address) takes part in a capture cudrv tracks.
pub(crate) fn captures_on(context: usize) -> bool {
    any_active() && sessions().values().any(|t| t.contexts.contains(&context))
}

/// Stops tracking capture `id`; whether it was tracked.
pub(crate) fn unregister(id: u64) -> bool {
    let removed = sessions().remove(&id).is_some();
    if removed {
        ACTIVE_CAPTURES.fetch_sub(1, Ordering::Relaxed);
    }
    removed
}

/// Whether capture `id` is tracked. Unlike [`session`], takes no reference to the session: the
/// caller may hold a lock that dropping the last one would take (a memory pool's).
pub(crate) fn is_tracked(id: u64) -> bool {
    id != 0 && any_active() && sessions().contains_key(&id)
}

/// The session of capture `id`, if it is tracked.
pub(crate) fn session(id: u64) -> Option<Arc<dyn Any + Send + Sync>> {
    if id == 0 || !any_active() {
        return None;
    }
    sessions().get(&id).map(|t| t.session.clone())
}

/// While it lives, the calling thread may make "potentially unsafe" driver calls (`cuMemAlloc`,
/// `cuMemFree`, `cuEventSynchronize`) even if a capture is active (its capture mode is relaxed,
/// then restored): for cudrv's pool, whose calls are never part of a capture. Nothing is done when
/// no capture cudrv started is active.
pub(crate) struct RelaxedCaptureMode(Option<cudrv_sys::CUstreamCaptureMode>);

impl RelaxedCaptureMode {
    #[inline]
    pub(crate) fn enter() -> RelaxedCaptureMode {
        if !any_active() {
            return RelaxedCaptureMode(None);
        }
        Self::always()
    }

    /// Relaxes the calling thread's capture mode whether or not a capture is active (for
    /// cudrv's own threads, which never capture). Nothing is done without a loaded driver.
    pub(crate) fn always() -> RelaxedCaptureMode {
        if crate::result::loaded_driver().is_none() {
            return RelaxedCaptureMode(None);
        }
        let mut mode = cudrv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        let swapped = (|| {
            // SAFETY: a valid in/out pointer; the call only swaps the calling thread's mode.
            unsafe { drv!(cuThreadExchangeStreamCaptureMode(&mut mode)) }
        })();
        RelaxedCaptureMode(swapped.ok().map(|()| mode))
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0.take()
            && let Some(d) = crate::result::loaded_driver()
        {
            // SAFETY: as above; restores the mode the thread had.
            let _ = unsafe { d.cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

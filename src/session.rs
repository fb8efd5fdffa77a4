//! Stream captures that cudrv tracks, and what their graphs keep: the layer between streams and
//! the buffers and pools that take part in captures (below them), and the graph API of
//! [`crate::graph`] (above them). See [`crate::graph`] for the rules it implements.

use std::any::Any;
use std::fmt;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cudrv_sys::{CUgraph, CUgraphNode};

use crate::capture;
use crate::context::report_drop_error;
use crate::error::{Result, check};
use crate::event::Event;
use crate::host_fn;
use crate::result::{driver, drv};
use crate::stream::{JoinHooks, ParkedStream, Stream, StreamKey, mark_capture_ending};

/// Whether a stream is capturing (`CUstreamCaptureStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Not capturing.
    None,
    /// Capturing.
    Active,
    /// Capturing, but a prohibited operation invalidated the capture: end it
    /// ([`Stream::end_capture`] reports the error and makes the stream usable again).
    Invalidated,
}

/// What [`Stream::capture_info`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CaptureInfo {
    /// The capture's status.
    pub status: CaptureStatus,
    /// The driver's id of the capture (unique in the process), 0 when not capturing.
    pub id: u64,
    /// How many nodes the next captured operation will depend on.
    pub dependencies: usize,
}

fn status_of(raw: cudrv_sys::CUstreamCaptureStatus) -> CaptureStatus {
    use cudrv_sys::CUstreamCaptureStatus as S;
    match raw {
        S::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active,
        S::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated,
        _ => CaptureStatus::None,
    }
}

impl Stream {
    /// The capture status (`cuStreamIsCapturing`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn capture_status(&self) -> Result<CaptureStatus> {
        self.key().capture_status()
    }

    /// The capture's status, id and number of dependencies (`cuStreamGetCaptureInfo`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn capture_info(&self) -> Result<CaptureInfo> {
        let _b = self.context().bind()?;
        let mut status = cudrv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id = 0;
        let mut deps: *const CUgraphNode = std::ptr::null();
        let mut edges: *const cudrv_sys::CUgraphEdgeData = std::ptr::null();
        let mut n = 0usize;
        let d = driver()?;
        let stream = self.as_raw();
        // SAFETY: a valid stream of the current context; valid out-pointers; the returned arrays
        // are owned by the driver and not read here.
        let v3 = unsafe {
            d.cuStreamGetCaptureInfo_v3(stream, &mut status, &mut id, null_mut(), &mut deps, &mut edges, &mut n)
        };
        let rc = match v3 {
            // SAFETY: as above, with the ABI of CUDA 11.3 to 12.2.
            Err(_) => match unsafe {
                d.cuStreamGetCaptureInfo_v2(stream, &mut status, &mut id, null_mut(), &mut deps, &mut n)
            } {
                // SAFETY: as above, with the ABI of CUDA 10 to 11.2, which does not report the
                // dependencies (left at 0).
                Err(_) => unsafe { d.cuStreamGetCaptureInfo(stream, &mut status, &mut id) },
                rc => rc,
            },
            rc => rc,
        };
        check("cuStreamGetCaptureInfo", rc)?;
        Ok(CaptureInfo { status: status_of(status), id, dependencies: n })
    }

    /// (status, capture id).
    pub(crate) fn capture_state(&self) -> Result<(CaptureStatus, u64)> {
        let info = self.capture_info()?;
        Ok((info.status, info.id))
    }
}

impl StreamKey {
    /// As [`Stream::capture_status`].
    pub(crate) fn capture_status(&self) -> Result<CaptureStatus> {
        let _b = self.context().bind()?;
        let mut status = cudrv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a valid stream of the current context; a valid out-pointer.
        unsafe { drv!(cuStreamIsCapturing(self.as_raw(), &mut status)) }?;
        Ok(status_of(status))
    }

    /// Ends the capture on this stream (`cuStreamEndCapture`): the driver's verdict, and the
    /// graph it made (null if none, which the driver may also hand back with an error).
    pub(crate) fn end_capture_raw(&self) -> (Result<()>, CUgraph) {
        let mut graph = null_mut();
        let ended = self.context().bind().and_then(|_b| {
            // SAFETY: a valid stream of the current context; a valid out-pointer.
            unsafe { drv!(cuStreamEndCapture(self.as_raw(), &mut graph)) }
        });
        (ended, graph)
    }

    /// The capture session the stream takes part in, if cudrv started one that is still active.
    #[inline]
    pub(crate) fn capture(&self) -> Option<Arc<CaptureSession>> {
        match self.capture_id() {
            0 => None,
            id => CaptureSession::active(id),
        }
    }
}

impl Stream {
    /// The capture session the stream takes part in, if cudrv started one that is still active.
    #[inline]
    pub(crate) fn capture(&self) -> Option<Arc<CaptureSession>> {
        self.key().capture()
    }
}

/// What streams' waits do about captures (see [`JoinHooks`]).
const JOIN_HOOKS: JoinHooks = JoinHooks {
    before: |stream| mark_before_join(stream).map(|e| Box::new(e) as Box<dyn Any + Send>),
    joined: |stream, id, before| {
        if let (Some(session), Ok(before)) = (CaptureSession::active(id), before.downcast::<Arc<Event>>()) {
            session.join(stream.key(), *before);
        }
    },
    waited: |stream, before| {
        if let Ok(before) = before.downcast::<Arc<Event>>() {
            note_join(stream, *before);
        }
    },
    abandoned: |key| {
        if let Some(session) = key.capture() {
            session.abandon(key);
        }
    },
};

/// How many times cudrv's thread tries to end an abandoned capture that the driver refused to
/// end (about a millisecond apart; see `CaptureSession::abandon`).
const ABANDON_TRIES: u32 = 1000;

/// How long cudrv's thread waits, at each try, for work under way on an abandoned capture's
/// streams (see `CaptureSession::abandon`): not for ever, for the holder of a gate may wait for
/// cudrv's thread ([`crate::flush_deferred_drops`] from a custom resource's `allocate`).
const ABANDON_PATIENCE: Duration = Duration::from_millis(1);

/// Whether `e` is the driver's refusal to end a capture begun on another thread (global and
/// thread-local modes), which no later try on this thread changes.
fn is_wrong_thread(e: &crate::Error) -> bool {
    e.code() == Some(cudrv_sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
}

/// Destroys `graph` (null: none), made by a capture that is discarded: never instantiated. Failing,
/// it leaks.
pub(crate) fn discard_graph(graph: CUgraph) {
    if graph.is_null() {
        return;
    }
    let destroy = || -> Result<()> {
        // SAFETY: a graph a capture made, never instantiated, destroyed once, here.
        unsafe { drv!(cuGraphDestroy(graph)) }
    };
    let _ = destroy();
}

/// An event recorded on `stream` now, before it joins (or begins) a capture: the graph's first
/// launch waits for it, so that the graph's work runs after what the stream did before (the
/// allocation of the buffers it uses, in particular).
pub(crate) fn mark_before_join(stream: &Stream) -> Result<Arc<Event>> {
    let event = Event::new(&stream.device())?;
    event.record(stream)?;
    Ok(Arc::new(event))
}

/// After `stream` waited on an event: if that made it join a capture cudrv tracks, track it too.
pub(crate) fn note_join(stream: &Stream, before: Arc<Event>) {
    if let Ok((CaptureStatus::Active, id)) = stream.capture_state()
        && let Some(session) = CaptureSession::active(id)
    {
        session.join(stream.key(), before);
    }
}

/// Work that waits for the end of a capture (see [`CaptureSession::after_end`]).
pub(crate) type AfterEnd = Box<dyn FnOnce() + Send>;

/// What cudrv knows of a stream capture it started ([`Stream::begin_capture`]): the streams that
/// take part in it, the buffers allocated during it, and what the graph it makes will keep.
pub(crate) struct CaptureSession {
    /// The driver's capture id.
    pub(crate) id: u64,
    /// Buffers allocated during the capture and not dropped yet.
    pub(crate) live_buffers: AtomicUsize,
    /// The streams that take part (the origin first).
    streams: Mutex<Vec<StreamKey>>,
    /// Whether a thread ending the capture holds its streams marked ([`CaptureSession::mark_ending`]):
    /// a stream that joins meanwhile waits to know whether it ended (see `track`). Written under
    /// the lock of `streams`.
    ending: AtomicBool,
    /// Frees that must wait for the end of the capture (of buffers that the capture does not
    /// use, dropped while their stream was capturing).
    /// `None` once the capture has ended (they ran then; later ones run at once).
    after_end: Mutex<Option<Vec<AfterEnd>>>,
    /// Frees of buffers allocated during the capture that belong in it, but that could not be
    /// queued where they were dropped: the buffer's stream is another thread's per-thread stream
    /// (see [`CaptureSession::free_at_end`]). Queued on the origin by [`Stream::end_capture`].
    at_end: Mutex<Vec<AtEnd>>,
    /// What the graph keeps.
    pub(crate) res: Arc<GraphResources>,
}

/// A free that belongs in a capture, queued on its origin at its end (see
/// [`CaptureSession::free_at_end`]).
pub(crate) type AtEnd = Box<dyn FnOnce(&Stream) + Send>;

impl fmt::Debug for CaptureSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaptureSession").field("id", &self.id).field("res", &self.res).finish_non_exhaustive()
    }
}

impl CaptureSession {
    /// The session of capture `id`, if it is still active (none for 0, no capture).
    pub(crate) fn active(id: u64) -> Option<Arc<CaptureSession>> {
        capture::session(id)?.downcast::<CaptureSession>().ok()
    }

    /// Starts tracking capture `id`, begun on `origin`, which stood at `before` then.
    pub(crate) fn start(id: u64, origin: &Stream, before: Arc<Event>) {
        let res = GraphResources::new();
        res.lock().prelude.push(before);
        let session = Arc::new(CaptureSession {
            id,
            live_buffers: AtomicUsize::new(0),
            streams: Mutex::new(vec![origin.key().clone()]),
            ending: AtomicBool::new(false),
            after_end: Mutex::new(Some(Vec::new())),
            at_end: Mutex::new(Vec::new()),
            res,
        });
        crate::stream::set_join_hooks(JOIN_HOOKS);
        capture::register(id, session, Arc::as_ptr(origin.context()) as usize);
        origin.key().set_capture_id(id);
    }

    /// Marks `stream` as taking part in this capture (it joined by waiting on an event of it);
    /// the graph's first launch waits for `before`, where the stream stood then.
    ///
    /// The caller saw the session active, but it may have ended since (on another thread): then
    /// the stream is not marked, for nothing would take the mark back (`finish` has taken the
    /// streams it unmarks), and the stream would read as capturing for good. `finish` stops
    /// tracking the capture before it takes the streams' lock, so under that lock either the
    /// capture is still tracked (and notes the stream's context) and `finish` will unmark the
    /// stream, or it is not and the stream is left alone.
    pub(crate) fn join(&self, stream: &StreamKey, before: Arc<Event>) {
        // First, and even when the capture has ended: a graph made from it may wait for `before`
        // (extra waits on a recorded event are harmless).
        self.res.lock().prelude.push(before);
        self.track(stream);
    }

    /// [`CaptureSession::join`] without the prelude: marks `stream` if the capture is still
    /// tracked.
    ///
    /// While another thread ends the capture, its streams marked ([`CaptureSession::mark_ending`]),
    /// this waits until the end is done (then the capture is not tracked, and the stream is left
    /// alone) or refused (then the stream is marked): marked at once, the stream's work would race
    /// the end, as work on the streams that thread marked cannot. The caller holds the stream
    /// marked as joining, so that its work waits meanwhile (or, in `Stream::wait_stream_in_gate`,
    /// its gate). That thread waits for nothing of this one's until it clears `ending`: not for
    /// this stream, which is not one of those it marked, and for no gate of those, which none can
    /// hold while they are marked (see [`mark_capture_ending`]).
    fn track(&self, stream: &StreamKey) {
        loop {
            let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
            if !self.ending.load(Ordering::Relaxed) {
                if capture::join(self.id, Arc::as_ptr(stream.context()) as usize) {
                    streams.push(stream.clone());
                    stream.set_capture_id(self.id);
                }
                return;
            }
            drop(streams);
            std::thread::yield_now();
        }
    }

    /// Marks every stream that takes part in the capture as changing, for its end (see
    /// [`mark_capture_ending`]), and holds off streams that join meanwhile until the end is done
    /// or refused (see `track`): streams that joined while the others were marked are marked too.
    /// Then no cudrv work on any of the capture's streams is between its look at the stream's
    /// capture and the queueing of its work until the [`Ending`] is finished or dropped. `None`
    /// once `patience` has run out, with nothing marked.
    pub(crate) fn mark_ending(self: &Arc<Self>, patience: Option<Duration>) -> Option<Ending> {
        loop {
            let keys = self.streams.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let marked = mark_capture_ending(&keys, self.id, patience)?;
            let streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
            if *streams == keys {
                if !marked.is_empty() {
                    self.ending.store(true, Ordering::Relaxed);
                }
                return Some(Ending { session: self.clone(), marked });
            }
            drop(streams);
            // A stream joined while they were marked: mark it with them.
            for key in &marked {
                key.set_capture_id(self.id);
            }
        }
    }

    /// Ends the session: its streams read as not capturing from now on, and the frees that
    /// waited for the end run.
    pub(crate) fn finish(&self) {
        capture::unregister(self.id);
        let streams = {
            let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
            // Joins that waited for the end (`track`) find it over, before any free below runs
            // (one may enter the gate of a stream that such a join holds marked).
            self.ending.store(false, Ordering::Relaxed);
            std::mem::take(&mut *streams)
        };
        for key in streams {
            if key.capture_id() == self.id {
                key.set_capture_id(0);
            }
        }
        let frees = self.after_end.lock().unwrap_or_else(PoisonError::into_inner).take().unwrap_or_default();
        for free in frees {
            free();
        }
        // Frees that belonged in the capture and never reached it (it ended without
        // `Stream::end_capture` on its origin: abandoned, or invalidated): outside the graph they
        // would free its memory (a memory node's, with the driver's pool), so they are dropped.
        // What cudrv's pool reserved for them stays reserved: a leak, which is sound.
        drop(std::mem::take(&mut *self.at_end.lock().unwrap_or_else(PoisonError::into_inner)));
    }

    /// Keeps `free`, a free that belongs in the capture but cannot be queued where its buffer went
    /// (its stream is a per-thread stream of another thread, which is not reachable there: the
    /// legacy stream would stand in, outside the capture), until [`Stream::end_capture`] queues it
    /// on the origin, after all of the capture's joined work. `Err` with `free` back once the
    /// capture has ended.
    pub(crate) fn free_at_end(&self, free: AtEnd) -> std::result::Result<(), AtEnd> {
        if !capture::is_tracked(self.id) {
            return Err(free);
        }
        self.at_end.lock().unwrap_or_else(PoisonError::into_inner).push(free);
        Ok(())
    }

    /// Queues on `origin` (the capture's origin, which its end is called on, on a thread where it
    /// names it) the frees kept by [`CaptureSession::free_at_end`].
    pub(crate) fn queue_frees_at_end(&self, origin: &Stream) {
        let is_origin = self.streams.lock().unwrap_or_else(PoisonError::into_inner).first() == Some(origin.key());
        if !is_origin || !origin.key().named_here() {
            return;
        }
        let frees = std::mem::take(&mut *self.at_end.lock().unwrap_or_else(PoisonError::into_inner));
        for free in frees {
            free(origin);
        }
    }

    /// The last user of `origin` let go of it during the capture: ends the capture and destroys
    /// its graph, then the session, which gives back what the capture reserved (nothing of it
    /// ever ran). Only from the origin, and only when no buffer allocated during the capture is
    /// alive (its memory would be the graph's): the last one's going calls this again
    /// ([`CaptureSession::buffer_gone`]). As [`Stream::end_capture`]: when the driver
    /// refuses to end it (another thread began it in global or thread-local mode) and the stream
    /// still captures, the capture goes on, as before; when it refuses but the capture is over
    /// all the same (an invalidated capture, or work left unjoined), the session ends too.
    ///
    /// Where the driver refuses for another reason than the thread (a passing fault), nothing
    /// else would end the capture (its origin has no user left): cudrv's thread tries again, for
    /// a while, as long as the stream has no user and no buffer allocated during the capture
    /// lives (a capture in the relaxed mode may be ended on any thread; in the others the retry
    /// meets the thread's refusal, and stops). Not for a per-thread stream.
    fn abandon(self: &Arc<Self>, origin: &StreamKey) {
        {
            // Under the streams' lock, as in `buffer_gone`: either this sees the last buffer gone,
            // or that sees the origin's user gone, or both (then the second finds the session
            // finished, or meets the driver's refusal to end it twice).
            let streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
            if streams.first() != Some(origin) || self.live_buffers.load(Ordering::Acquire) != 0 {
                return;
            }
        }
        // Work under way on the capture's streams is waited for as `end_capture` waits for it,
        // but for a while only on cudrv's thread (and where this thread holds a gate): then
        // cudrv's thread tries again.
        let patience = host_fn::on_helper_thread().then_some(ABANDON_PATIENCE);
        // Not a per-thread stream: on cudrv's thread its handle would mean the legacy stream.
        if self.try_end(origin, patience).is_some_and(|e| !is_wrong_thread(&e)) && origin.carries_context() {
            let (id, origin) = (self.id, origin.clone());
            let mut tries = 0u32;
            host_fn::defer_until(move || {
                tries += 1;
                let Some(session) = CaptureSession::active(id) else { return true };
                if origin.handle_lives() || session.live_buffers.load(Ordering::Acquire) != 0 {
                    // A user again (its going abandons the capture again), or memory of the graph.
                    return true;
                }
                session.try_end(&origin, Some(ABANDON_PATIENCE)).is_none_or(|e| is_wrong_thread(&e))
                    || tries >= ABANDON_TRIES
            });
        }
    }

    /// A buffer allocated during the capture went, and its free was queued (into the capture,
    /// where it belongs). If it was the last one and the origin's last user went meanwhile, the
    /// capture is abandoned now: `abandon` left it on while the buffer lived (its memory was the
    /// graph's), and nothing else would end it.
    pub(crate) fn buffer_gone(self: &Arc<Self>) {
        if self.live_buffers.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let orphan = {
            // The origin's `Handle` lets go of the stream before its drop takes this lock (in
            // `abandon`), and the count above fell before this takes it: whichever takes it
            // second sees what the other did.
            let streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
            streams.first().filter(|origin| !origin.handle_lives()).cloned()
        };
        if let Some(origin) = orphan {
            self.abandon(&origin);
        }
    }

    /// Ends the capture of `origin` and discards its graph, finishing the session where the
    /// capture is over: the driver's refusal where it goes on, or `Error::Capturing` where work
    /// on its streams stayed under way for `patience` (see [`CaptureSession::mark_ending`]).
    fn try_end(self: &Arc<Self>, origin: &StreamKey, patience: Option<Duration>) -> Option<crate::Error> {
        let Some(ending) = self.mark_ending(patience) else {
            return Some(crate::Error::Capturing {
                what: "ending an abandoned capture while work is queued on its streams",
            });
        };
        let (ended, graph) = origin.end_capture_raw();
        discard_graph(graph);
        if ended.is_ok() || origin.capture_status().is_ok_and(|s| s == CaptureStatus::None) {
            ending.finish();
            return None;
        }
        ended.err()
    }

    /// Runs `free` once the capture has ended: at once if it has (the caller saw the session
    /// active, and it may have ended since).
    pub(crate) fn after_end(&self, free: AfterEnd) {
        let mut waiting = self.after_end.lock().unwrap_or_else(PoisonError::into_inner);
        match waiting.as_mut() {
            Some(frees) => frees.push(free),
            None => {
                drop(waiting);
                free();
            }
        }
    }
}

/// The streams of a capture marked for its end ([`CaptureSession::mark_ending`]). Dropped, the
/// capture goes on: they take part in it again, and streams that waited to join it are tracked.
/// Where it marked any, it set the session's `ending`.
pub(crate) struct Ending {
    session: Arc<CaptureSession>,
    marked: Vec<StreamKey>,
}

impl Ending {
    /// The capture is over at the driver: its streams take part in none from now on (their work
    /// may go on), and the session finishes.
    pub(crate) fn finish(mut self) {
        // Taken: the session's `finish` clears `ending`, which the drop then leaves alone.
        for key in std::mem::take(&mut self.marked) {
            key.set_capture_id(0);
        }
        self.session.finish();
    }
}

impl Drop for Ending {
    fn drop(&mut self) {
        for key in &self.marked {
            key.set_capture_id(self.session.id);
        }
        if !self.marked.is_empty() {
            let _streams = self.session.streams.lock().unwrap_or_else(PoisonError::into_inner);
            self.session.ending.store(false, Ordering::Relaxed);
        }
    }
}

/// Something a graph owns for its whole life, given back once the graph, every executable graph
/// made from it and every buffer its capture used are gone, and their launches have completed.
pub(crate) trait GraphOwned: Send {
    /// Gives it back; the host has seen every launch of the graph complete.
    fn release(self: Box<Self>);
}

/// What the launches of a graph may touch that Rust owns: memory of cudrv's pool reserved during
/// the capture, frees of buffers the capture used (dropped meanwhile), host nodes' closures, the
/// resources of child graphs; and the events its first launch waits for. Shared by the graph and
/// its executable graphs (and referenced by buffers its capture used); released after the last of
/// them goes, once every launch has completed.
pub(crate) struct GraphResources {
    inner: Mutex<Kept>,
    /// Told when everything is released (after the last launch), for buffers whose free comes
    /// later than the graph's end.
    done: Arc<Completion>,
    /// Whether launches must be tracked: something above is kept.
    pub(crate) fenced: AtomicBool,
    /// Whether it holds memory of cudrv's pool (then one executable graph at a time).
    pool_memory: AtomicBool,
    /// Whether an executable graph of a graph with pool memory exists.
    pub(crate) exec_alive: AtomicBool,
}

#[derive(Default)]
pub(crate) struct Kept {
    owned: Vec<Box<dyn GraphOwned>>,
    keep: Vec<Arc<dyn Send + Sync>>,
    /// Events the first launch of each executable graph waits for (where the capture's streams,
    /// and the buffers it used, stood before it).
    pub(crate) prelude: Vec<Arc<Event>>,
    /// The streams of the last launches of dropped executable graphs.
    pub(crate) fences: Fences,
}

/// The streams of the last launches of dropped executable graphs, which the graph's resources
/// wait for before they are given back: held parked ([`ParkedStream`]), so that a capture on one
/// of them still ends when its origin's last user goes, while the graph lives or its release
/// waits for that capture's end.
#[derive(Default)]
pub(crate) struct Fences(Vec<ParkedStream>);

impl Fences {
    /// Adds `stream`, unless it is there already: the release waits for each stream's work as it
    /// stands then, which covers what it held when it was added. (A graph instantiated again and
    /// again, each executable launched on the same streams, keeps one fence per stream.)
    pub(crate) fn push(&mut self, stream: ParkedStream) {
        if !self.0.iter().any(|s| s.key() == stream.key()) {
            self.0.push(stream);
        }
    }
}

impl fmt::Debug for GraphResources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let k = self.lock();
        f.debug_struct("GraphResources")
            .field("owned", &k.owned.len())
            .field("kept", &k.keep.len())
            .field("prelude", &k.prelude.len())
            .field("pool_memory", &self.pool_memory.load(Ordering::Relaxed))
            .finish()
    }
}

impl GraphResources {
    pub(crate) fn new() -> Arc<GraphResources> {
        Arc::new(GraphResources {
            inner: Mutex::new(Kept::default()),
            done: Arc::new(Completion::default()),
            fenced: AtomicBool::new(false),
            pool_memory: AtomicBool::new(false),
            exec_alive: AtomicBool::new(false),
        })
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks the graph as one that uses memory of cudrv's pool at every launch, before the pool
    /// reserves a block for it. Another thread's allocation in the same capture may take a block
    /// of the graph, the capture end and an executable be instantiated before the thread that
    /// reserved the first block hands its release over ([`GraphResources::own`]): that executable
    /// must fence its launches too. (Where the allocation then fails, the graph is fenced for
    /// nothing: its launches are tracked, and its executables follow one another.)
    pub(crate) fn expect_pool_memory(&self) {
        self.fenced.store(true, Ordering::Release);
        self.pool_memory.store(true, Ordering::Release);
    }

    /// Keeps `owned` until the graph's last launch completed, then releases it. `pool_memory`:
    /// it is memory of cudrv's pool that the graph uses at every launch.
    pub(crate) fn own(&self, owned: Box<dyn GraphOwned>, pool_memory: bool) {
        self.fenced.store(true, Ordering::Release);
        if pool_memory {
            self.pool_memory.store(true, Ordering::Release);
        }
        self.lock().owned.push(owned);
    }

    /// Keeps `value` alive until the graph's last launch completed.
    pub(crate) fn keep(&self, value: Arc<dyn Send + Sync>) {
        self.fenced.store(true, Ordering::Release);
        self.lock().keep.push(value);
    }

    /// [`GraphResources::keep`], unless `value` is kept already.
    pub(crate) fn keep_once(&self, value: Arc<dyn Send + Sync>) {
        self.fenced.store(true, Ordering::Release);
        let mut k = self.lock();
        if !k.keep.iter().any(|kept| std::ptr::addr_eq(Arc::as_ptr(kept), Arc::as_ptr(&value))) {
            k.keep.push(value);
        }
    }

    /// Notes that a buffer allocated before the capture is used by it: the graph's first launch
    /// waits for `allocated` (recorded on the buffer's stream), and the buffer's free, if it comes
    /// first, waits for the graph (the buffer holds this and hands its free over).
    pub(crate) fn use_buffer(self: &Arc<Self>, allocated: Option<Arc<Event>>) -> GraphUse {
        self.fenced.store(true, Ordering::Release);
        if let Some(e) = allocated {
            self.lock().prelude.push(e);
        }
        GraphUse { res: Arc::downgrade(self), done: self.done.clone() }
    }

    pub(crate) fn has_pool_memory(&self) -> bool {
        self.pool_memory.load(Ordering::Acquire)
    }
}

impl Drop for GraphResources {
    fn drop(&mut self) {
        let kept = std::mem::take(self.inner.get_mut().unwrap_or_else(PoisonError::into_inner));
        let done = self.done.clone();
        if kept.fences.0.is_empty() && !host_fn::in_host_fn() {
            // Never launched: nothing on the GPU uses any of it.
            release_kept(kept, &done);
        } else {
            // Waiting for the last launches may take long: do it on cudrv's thread.
            host_fn::defer_attempts((kept, done), release_after_launches);
        }
    }
}

fn release_kept(kept: Kept, done: &Completion) {
    for o in kept.owned {
        o.release();
    }
    drop(kept.keep);
    done.complete();
}

/// A buffer's link to a graph whose capture used it: its free goes to the graph while the graph
/// lives, else waits for the graph's release (after its last launch).
pub(crate) struct GraphUse {
    res: std::sync::Weak<GraphResources>,
    done: Arc<Completion>,
}

impl GraphUse {
    /// Whether this links to `res`.
    pub(crate) fn is(&self, res: &Arc<GraphResources>) -> bool {
        std::ptr::eq(self.res.as_ptr(), Arc::as_ptr(res))
    }

    /// Whether the graph is gone and every launch of it has completed (its resources were
    /// released): the buffer owes it nothing.
    pub(crate) fn is_done(&self) -> bool {
        self.res.strong_count() == 0 && self.done.state.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// Runs `job` once the graph's launches can no longer touch the buffer.
    pub(crate) fn after_launches(self, job: Box<dyn GraphOwned>) {
        match self.res.upgrade() {
            // The graph lives (and cannot go while `res` is held): it keeps the job.
            Some(res) => res.lock().owned.push(job),
            None => self.done.after(job),
        }
    }
}

/// Whether a graph's resources were released, and what waits for it.
#[derive(Default)]
struct Completion {
    state: Mutex<(bool, Vec<Box<dyn GraphOwned>>)>,
}

impl Completion {
    fn after(&self, job: Box<dyn GraphOwned>) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.0 {
            drop(st);
            job.release();
        } else {
            st.1.push(job);
        }
    }

    fn complete(&self) {
        let jobs = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.0 = true;
            std::mem::take(&mut st.1)
        };
        for job in jobs {
            job.release();
        }
    }
}

/// Runs `job` on cudrv's deferred-work thread once the work queued on `stream` so far has
/// completed (seen on the host). A stream that is capturing cannot be waited on: the job comes
/// back later. If the wait fails, `job` never runs (what it would release stays, which is sound).
/// The stream waits parked ([`ParkedStream`]), so that a capture on it still ends when its
/// origin's last user goes.
pub(crate) fn after_stream_work(stream: Stream, job: impl FnOnce() + Send + 'static) {
    after_parked_stream_work(stream.park(), job);
}

/// [`after_stream_work`], with the stream parked.
pub(crate) fn after_parked_stream_work(stream: ParkedStream, job: impl FnOnce() + Send + 'static) {
    host_fn::defer_attempts((stream, job), |(stream, job)| {
        let Some(fence) = fence_parked(&stream) else { return Some((stream, job)) };
        match wait_for_fence(&stream, fence) {
            Ok(()) => job(),
            Err(e) => report_drop_error(Some(stream.key().context()), e),
        }
        None
    });
}

/// [`fence_unless_capturing`] for a parked stream: `None` also where a user of it cannot be made
/// just then ([`ParkedStream::revive`]). A capture that cudrv tracks is seen before a user is made,
/// and the user goes before the caller waits: the last user of a capture's origin is never
/// cudrv's, which the driver may not let end the capture (another thread began it).
pub(crate) fn fence_parked(stream: &ParkedStream) -> Option<Result<Event>> {
    if stream.key().capture_id() != 0 {
        return None;
    }
    fence_unless_capturing(&stream.revive()?)
}

/// Waits for `fence`, made by [`fence_parked`]; where that fails, for the stream itself
/// ([`Stream::wait_for_memory`]), as a user revived for the wait (the failed wait's error where
/// none can be made just then).
fn wait_for_fence(stream: &ParkedStream, fence: Result<Event>) -> Result<()> {
    fence.and_then(|e| e.wait()).or_else(|e| stream.revive().map_or(Err(e), |s| s.wait_for_memory()))
}

/// An event recorded on `stream` now, which completes after the work queued there so far; `None`
/// while the stream captures (the record would be captured: it would order nothing, and waiting
/// for it would invalidate the capture). The stream's gate is held from the look to the record,
/// so that a capture another thread begins meanwhile cannot take the record.
pub(crate) fn fence_unless_capturing(stream: &Stream) -> Option<Result<Event>> {
    let _gate = stream.key().enter();
    // The driver's answer covers captures begun through the raw API too. The legacy stream (a
    // per-thread stream seen from another thread) answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`
    // while a blocking stream of its context captures, without invalidating it: a record there
    // would join that capture (the driver invalidates it), and so waits as for a capture.
    let capturing = stream.key().capture_id() != 0
        || match stream.capture_status() {
            Ok(status) => status != CaptureStatus::None,
            Err(e) => e.is_implicit_capture(),
        };
    if capturing {
        return None;
    }
    Some(Event::new(&stream.device()).and_then(|e| e.record(stream).map(|()| e)))
}

/// Waits (on cudrv's deferred-work thread) for the last launch of each executable graph, then
/// releases what the graph kept. A stream that is capturing now cannot be waited on: the state
/// comes back, to be tried later ([`host_fn::defer_attempts`]).
fn release_after_launches((mut kept, done): (Kept, Arc<Completion>)) -> Option<(Kept, Arc<Completion>)> {
    while let Some(stream) = kept.fences.0.last() {
        // An event recorded now, on the stream of the last launch, completes after it; on the
        // legacy stream (a per-thread stream seen from this thread) after every blocking stream.
        let Some(fence) = fence_parked(stream) else { return Some((kept, done)) };
        if let Err(e) = wait_for_fence(stream, fence) {
            // The launch may still run: what it uses stays (leaked), which is sound.
            report_drop_error(Some(stream.key().context()), e);
            std::mem::forget(kept.owned);
            std::mem::forget(kept.keep);
            return None;
        }
        kept.fences.0.pop();
    }
    release_kept(kept, &done);
    None
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::{Arc, Mutex};

    use super::{CaptureSession, GraphResources};
    use crate::capture;
    use crate::stream::Stream;

    /// A thread that saw a capture active and tracks a stream's join of it (a `wait_stream` or
    /// `wait_event` hook) may get there after another thread ended the capture: the join must
    /// not mark the stream, which would then read as capturing for good (`begin_capture` refused
    /// it and graph fences waited for ever). The late join is made here in the order a race would
    /// make it, on streams that call no driver. It failed before (the stream kept the id).
    #[test]
    fn a_join_after_the_capture_ended_marks_nothing() {
        let (origin, joined, late) = (Stream::detached(), Stream::detached(), Stream::detached());
        // An id no other test registers (the registry is the process's).
        let id = u64::MAX - 24;
        let session = Arc::new(CaptureSession {
            id,
            live_buffers: AtomicUsize::new(0),
            streams: Mutex::new(vec![origin.key().clone()]),
            ending: AtomicBool::new(false),
            after_end: Mutex::new(Some(Vec::new())),
            at_end: Mutex::new(Vec::new()),
            res: GraphResources::new(),
        });
        capture::register(id, session.clone(), Arc::as_ptr(origin.context()) as usize);
        origin.key().set_capture_id(id);
        // A join while the capture is tracked is marked, and the end takes the mark back.
        session.track(joined.key());
        assert_eq!(joined.key().capture_id(), id);
        assert!(capture::captures_on(Arc::as_ptr(joined.context()) as usize));
        session.finish();
        assert_eq!((origin.key().capture_id(), joined.key().capture_id()), (0, 0));
        // The late join.
        session.track(late.key());
        assert_eq!(late.key().capture_id(), 0, "a stream marked by a join of a capture that had ended");
        assert!(!capture::is_tracked(id));
    }
}

//! Streams: queues of device work that run in order.

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cudrv_sys::CUstream;

use crate::barrier;
use crate::capture;
use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::error::{check, check_done};
use crate::host_fn;
use crate::memory::MemoryResource;
use crate::result::{driver, drv};

/// `CU_STREAM_LEGACY`, a macro in cuda.h that bindgen cannot translate.
const CU_STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`, likewise.
const CU_STREAM_PER_THREAD: usize = 0x2;

/// A CUDA stream: work queued on it runs in order, asynchronously to the host.
///
/// `Stream` is a cheap handle (`Clone` shares it); the stream is destroyed when the last clone
/// and the last buffer allocated on it are gone (by cudrv's own thread, a moment later, if another
/// thread was queueing work on it just then: [`crate::flush_deferred_drops`] waits for that), and
/// work still queued on it completes anyway (the driver's semantics). Streams made by
/// [`Stream::new`] are non-blocking: they do not synchronise with the legacy default stream.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream};
/// let stream = Stream::new(&Device::get(0)?)?;
/// stream.launch_host_fn(|| println!("everything queued before this has run"))?;
/// stream.synchronize()?;
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct Stream {
    handle: Arc<Handle>,
}

/// The users' share of a stream: every [`Stream`] value, and every [`StreamPin`] (of a memory
/// pool that keeps the stream for its buffers, or of a buffer). When it goes, memory pools that
/// cached blocks freed on the stream are told to forget it (while it is still valid), and release
/// their own references; the stream is destroyed once those are gone too. Work that waits with
/// the stream parked ([`ParkedStream`]) may make a new one later, which does the same as it goes.
struct Handle {
    key: StreamKey,
    /// How many `Stream` values exist. `Arc`'s count holds them and the pins; when this reaches
    /// 0, the pins that no allocation needs any more are let go (see [`StreamPin`]).
    users: AtomicUsize,
}

impl Handle {
    /// Takes the bank (see `Inner::banked`). Called by the stream's owner under its gate, when
    /// it is not held.
    #[cold]
    fn bank(self: &Arc<Handle>) {
        std::mem::forget(Arc::clone(self));
        // SeqCst: with the users' count (see `retire`).
        self.key.0.banked.store(true, Ordering::SeqCst);
    }

    /// Lets go of the bank if no owner pin lives and the stream's users are gone: called when
    /// the last user goes, and when an owner pin is let go after that.
    ///
    /// Owner pins are counted and let go under the stream's gate, the owner's without a
    /// read-modify-write, so the count is read with the gate empty and held off
    /// ([`StreamKey::mark_ungated`]): then no pin is between its count and its look at the
    /// users. Either this sees a pin let go, or that pin's look sees the users gone and settles
    /// the bank itself (the users' count and the bank are SeqCst, and a gate that waited for
    /// this mark sees what it did). The bank is never let go while a gate is held, so a pin
    /// being let go under its gate may still take a counted reference.
    ///
    /// Where a gate stays held, this does not wait long for it on the calling thread (which may
    /// hold it, or be a host function that it waits for): cudrv's thread settles the bank
    /// instead, once the gate is empty (it tries again, and never waits for it either), and the
    /// stream goes a little later.
    fn retire(self: &Arc<Handle>) {
        if !self.key.0.banked.load(Ordering::SeqCst) {
            return;
        }
        if !host_fn::in_host_fn() && self.settle_bank(MARK_HOLD_BACK) {
            return;
        }
        // Without keeping the stream: if another thread lets go of the bank meanwhile, the
        // stream goes with its last reference there, not later here. Never waiting for the gate
        // there: its holder may wait for cudrv's thread (`flush_deferred_drops` in a resource's
        // `deallocate`).
        let handle = Arc::downgrade(self);
        host_fn::defer_until(move || handle.upgrade().is_none_or(|handle| handle.settle_bank(Duration::ZERO)));
    }

    /// [`Handle::retire`], with the gate empty: false when it stayed held for longer than
    /// `patience` (see [`StreamKey::mark_ungated`]).
    fn settle_bank(self: &Arc<Handle>, patience: Duration) -> bool {
        let inner = &*self.key.0;
        let retiring = &inner.retiring;
        let mark = || {
            retiring.fetch_add(1, Ordering::SeqCst);
            true
        };
        if !self.key.mark_ungated(
            Some(patience),
            || true,
            mark,
            || {
                retiring.fetch_sub(1, Ordering::SeqCst);
            },
        ) {
            return false;
        }
        // The gate is empty: every pin counted or let go under a gate is seen (its gate's exit
        // was a release, the look at the gate an acquire).
        let live =
            inner.owner_pins.load(Ordering::Relaxed).wrapping_sub(inner.pins_let_go_elsewhere.load(Ordering::Relaxed));
        let quiet = live == 0 && self.users.load(Ordering::SeqCst) == 0;
        #[cfg(test)]
        if quiet {
            inner.run_settle_hook();
        }
        // A user revived meanwhile (a clone of a counted pin's view) pins under a gate that waits
        // for this mark, and takes the bank again after it.
        let release = quiet && inner.banked.swap(false, Ordering::SeqCst);
        retiring.fetch_sub(1, Ordering::Release);
        if release {
            // SAFETY: the bank, a counted reference that `bank` forgot; the caller holds another,
            // so the handle is not freed here.
            unsafe { Arc::decrement_strong_count(Arc::as_ptr(self)) };
        }
        true
    }
}

impl Clone for Stream {
    #[inline]
    fn clone(&self) -> Stream {
        // Relaxed, as `Arc::clone`: a new user is made from an existing one (or from a view that
        // a pin keeps valid), so the stream cannot be let go meanwhile.
        self.handle.users.fetch_add(1, Ordering::Relaxed);
        Stream { handle: self.handle.clone() }
    }
}

impl Drop for Stream {
    #[inline]
    fn drop(&mut self) {
        // SeqCst: an owner pin taken meanwhile sees the users gone when it is let go, or the
        // retirement below sees it taken (see [`Handle::retire`]).
        if self.handle.users.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.key().users_gone();
            self.handle.retire();
        }
        // `self.handle` goes after this: while the pins were let go above, it kept the handle.
    }
}

/// A counted reference to a stream that is not one of its users. A buffer of a resource other than
/// the device's `StreamOrderedPool` holds a pin of its own ([`StreamPin::for_buffer`]: one of these,
/// or on the stream's owner thread a share of the bank, one such reference for all the owner's
/// pins, which [`Handle::retire`] lets go). That pool
/// holds one while buffers of its own live on the stream, so that they can refer to the stream
/// without a count of their own ([`StreamPin::view`]); it lets go of it when the stream has no
/// users and the pool no such buffer there, whichever comes last: the pool checks
/// [`StreamPin::users_gone`] when its last such buffer there is freed, and the last user's drop
/// asks each attachment ([`Attachment::users_gone`]). Both look under the stream's attachment
/// lock, so one of them sees the other's change.
pub(crate) struct StreamPin(Arc<Handle>);

impl StreamPin {
    /// Pins `stream`.
    pub(crate) fn new(stream: &Stream) -> StreamPin {
        StreamPin(stream.handle.clone())
    }

    /// Whether the stream has no users left (only pins keep it). Read under the stream's
    /// attachment lock (see [`StreamPin`]).
    #[inline]
    pub(crate) fn users_gone(&self) -> bool {
        self.0.users.load(Ordering::Acquire) == 0
    }

    /// `stream` as a [`Stream`] that is not counted: it must never be dropped (`ManuallyDrop`),
    /// and is valid while a pin of the stream is held. Cloning it makes a counted user.
    ///
    /// # Safety
    /// The caller must not use the view (nor anything borrowed from it) after the last pin of the
    /// stream that keeps it valid is let go.
    #[inline]
    pub(crate) unsafe fn view(stream: &Stream) -> ManuallyDrop<Stream> {
        // SAFETY: `Arc::from_raw` of `Arc::as_ptr` makes a second `Arc` of the same allocation
        // without counting it; `ManuallyDrop` keeps it from ever being uncounted, and the caller
        // keeps it from being used after the allocation is freed.
        ManuallyDrop::new(Stream { handle: unsafe { Arc::from_raw(Arc::as_ptr(&stream.handle)) } })
    }

    /// The pin as a [`Stream`] to borrow from, which it keeps valid itself: it must never be
    /// dropped as a `Stream` (it is no user), only let go with [`StreamPin::let_go`].
    #[inline]
    pub(crate) fn into_view(self) -> ManuallyDrop<Stream> {
        let StreamPin(handle) = self;
        ManuallyDrop::new(Stream { handle })
    }

    /// The counted pin that [`StreamPin::into_view`] made `view` of.
    ///
    /// # Safety
    /// `view` must come from [`StreamPin::into_view`], and is taken: it must not be used after.
    #[inline]
    pub(crate) unsafe fn from_view(view: &ManuallyDrop<Stream>) -> StreamPin {
        // SAFETY: the view holds the pin's counted reference, which this takes once; the view is
        // never dropped (`ManuallyDrop`) nor used after.
        StreamPin(unsafe { Arc::from_raw(Arc::as_ptr(&view.handle)) })
    }

    /// A buffer's pin of `stream`, taken in the stream's gate `gate` (held by the caller), as a
    /// view to borrow from, and whether it is an owner pin.
    ///
    /// On the thread that owns the gate (usually the one thread that queues work on the stream)
    /// the pin costs no atomic read-modify-write: the owner counts its pins in a slot of its own
    /// (`Inner::owner_pins`), and the stream holds one counted reference for all of them, the
    /// bank, until none is left and its users are gone ([`Handle::retire`]). On any other thread
    /// it is a counted reference ([`StreamPin::new`]). Let go with [`StreamPin::let_go`].
    #[inline]
    pub(crate) fn for_buffer(stream: &Stream, gate: &Gate<'_>) -> (ManuallyDrop<Stream>, bool) {
        // Where the users are gone (a buffer made on another's view), a counted pin: an owner pin
        // let go then settles the bank (a heavy barrier) each time.
        if !gate.owned || stream.handle.users.load(Ordering::Relaxed) == 0 {
            return (StreamPin::new(stream).into_view(), false);
        }
        let inner = gate.inner;
        debug_assert!(std::ptr::eq(inner, &*stream.key().0), "the gate of another stream");
        // The owner's slot, written by the owner only, under its gate: a retirement reads it
        // only while no gate is held ([`Handle::retire`]).
        inner.owner_pins.store(inner.owner_pins.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        if !inner.banked.load(Ordering::Acquire) {
            stream.handle.bank();
        }
        // SAFETY: the bank is held while an owner pin is counted (it is let go only when none is,
        // under the gate's exclusion), and it keeps the stream; the pin is let go, and the view
        // not used after, in `let_go`.
        (unsafe { StreamPin::view(stream) }, true)
    }

    /// Lets go of a buffer's pin that [`StreamPin::for_buffer`] took, in the gate `gate` of its
    /// stream, which this drops. What it returns must be dropped after the call: where the pin was
    /// the stream's last reference, the stream goes there (its destruction may be handed to
    /// cudrv's thread, see [`Handle::retire`]). Not in here, where the gate's reference to the
    /// stream is an argument, which must stay valid until the call returns.
    ///
    /// # Safety
    /// `view` and `owner` must be what [`StreamPin::for_buffer`] returned, `gate` a gate of the
    /// same stream; the pin is let go once, and the view (nor anything borrowed from it) is not
    /// used after.
    #[inline]
    pub(crate) unsafe fn let_go(view: &ManuallyDrop<Stream>, owner: bool, gate: Gate<'_>) -> LetGo {
        if !owner {
            drop(gate);
            // SAFETY: forwarded: a view of a counted pin, let go once.
            return LetGo { handle: Some(unsafe { StreamPin::from_view(view) }.0), retire: false };
        }
        let inner = gate.inner;
        if gate.owned {
            inner.owner_pins.store(inner.owner_pins.load(Ordering::Relaxed).wrapping_sub(1), Ordering::Relaxed);
        } else {
            inner.pins_let_go_elsewhere.fetch_add(1, Ordering::SeqCst);
        }
        // SeqCst: with the users' count, see [`Handle::retire`].
        if view.handle.users.load(Ordering::SeqCst) != 0 {
            return LetGo { handle: None, retire: false };
        }
        // SAFETY: forwarded.
        unsafe { Self::retire_after(view, gate) }
    }

    /// The users of the stream of an owner pin that was let go under `gate` are gone: a counted
    /// reference with which to settle the stream's bank after the gate.
    ///
    /// # Safety
    /// As [`StreamPin::let_go`], whose pin is let go.
    #[cold]
    unsafe fn retire_after(view: &ManuallyDrop<Stream>, gate: Gate<'_>) -> LetGo {
        let handle = Arc::as_ptr(&view.handle);
        // SAFETY: while the gate is held the bank cannot be let go, so the handle is valid; a
        // counted reference that outlives the gate.
        let handle = unsafe {
            Arc::increment_strong_count(handle);
            Arc::from_raw(handle)
        };
        drop(gate);
        LetGo { handle: Some(handle), retire: true }
    }
}

/// What [`StreamPin::let_go`] leaves to do after its gate: a counted reference to let go of,
/// and whether to settle the stream's bank first ([`Handle::retire`]). Dropped by the caller,
/// which holds no reference into the stream as an argument of its own.
#[must_use = "the stream's reference is let go when this is dropped"]
pub(crate) struct LetGo {
    handle: Option<Arc<Handle>>,
    retire: bool,
}

impl Drop for LetGo {
    #[inline]
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            if self.retire {
                handle.retire();
            }
            drop(handle);
        }
    }
}

/// A stream's identity for memory pools: keeps the stream alive, compares by [`Stream::id`].
#[derive(Clone)]
pub(crate) struct StreamKey(Arc<Inner>);

impl StreamKey {
    /// The stream's context.
    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.0.ctx
    }

    /// The raw handle that means this stream on the calling thread (see [`Stream::as_raw`]).
    #[inline]
    pub(crate) fn as_raw(&self) -> CUstream {
        self.0.raw_here()
    }
}

impl PartialEq for StreamKey {
    fn eq(&self, other: &StreamKey) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for StreamKey {}

impl std::hash::Hash for StreamKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.id.hash(state);
    }
}

impl fmt::Debug for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StreamKey({})", self.0.id)
    }
}

impl StreamKey {
    /// The id of the capture cudrv last saw the stream take part in; 0 for none. A capture that
    /// ended may still show here for joined streams until
    /// [`CaptureSession`](crate::session::CaptureSession) clears it: use [`StreamKey::capture`] to
    /// know for sure.
    #[inline]
    pub(crate) fn capture_id(&self) -> u64 {
        match self.0.capture.load(Ordering::Acquire) {
            CAPTURE_STARTING => self.settled_capture_id(),
            id => id,
        }
    }

    /// [`StreamKey::capture_id`] without waiting: 0 while a capture is beginning on the stream.
    #[inline]
    pub(crate) fn capture_id_unsettled(&self) -> u64 {
        match self.0.capture.load(Ordering::Acquire) {
            CAPTURE_STARTING => 0,
            id => id,
        }
    }

    /// While another thread begins a capture on the stream (`CAPTURE_STARTING`), waits until it
    /// knows the capture's id (or that it failed): work queued meanwhile would be captured unseen.
    #[cold]
    fn settled_capture_id(&self) -> u64 {
        loop {
            std::thread::yield_now();
            match self.0.capture.load(Ordering::Acquire) {
                CAPTURE_STARTING => {}
                id => return id,
            }
        }
    }

    /// Notes that the stream takes part in capture `id` (0: none).
    pub(crate) fn set_capture_id(&self, id: u64) {
        self.0.capture.store(id, Ordering::Release);
    }

    /// Marks the stream as beginning a capture, if it takes part in none: see
    /// [`StreamKey::mark_capture_changing`]. `false` when it takes part in one already, or another
    /// thread is beginning one.
    pub(crate) fn mark_capture_starting(&self) -> bool {
        self.mark_capture_changing(0)
    }

    /// Runs `wait`, a wait that may make the stream join a capture, with the stream marked as
    /// beginning one (see [`StreamKey::mark_capture_changing`]): other threads' cudrv work on the
    /// stream is queued before the wait, or waits until `wait` has returned, having tracked the
    /// join if any (its hook sets the stream's capture id). Unmarked where the stream takes part
    /// in a capture already, or another thread is beginning one.
    ///
    /// `own_gates` is how many [`Gate`]s the caller took for this wait itself (of other streams).
    /// Where the calling thread holds more (user code run under a gate: a custom resource's
    /// `allocate` or `deallocate`, a kernel argument's `kernel_value`), the stream is marked only
    /// if its gate is empty now, else the wait goes unmarked, as cudrv's own waits under a gate
    /// do ([`Stream::wait_stream_in_gate`]): waiting for the gate there would wait for this
    /// thread itself, or for a thread that waits for a gate this one holds.
    pub(crate) fn joining<R>(&self, own_gates: usize, wait: impl FnOnce() -> R) -> R {
        /// Takes the mark back if `wait` set no capture id (it joined none, failed, or panicked).
        struct Unmark<'a>(&'a Inner);
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                let _ = self.0.capture.compare_exchange(CAPTURE_STARTING, 0, Ordering::SeqCst, Ordering::Relaxed);
            }
        }
        let patience = (GATES_HELD.with(Cell::get) > own_gates).then_some(Duration::ZERO);
        let _unmark = self.mark_capture_changing_within(0, patience).then(|| Unmark(&self.0));
        wait()
    }

    /// Marks the stream's capture as changing, if it is `from` (0: none; else the id of the
    /// capture about to end), once no cudrv work on it is between its look at the stream's
    /// capture and the queueing of its work (a [`Gate`]): until [`StreamKey::set_capture_id`],
    /// other threads' cudrv work on it waits (see [`StreamKey::capture_id`]). `false` when the
    /// stream's capture is not `from`.
    ///
    /// The caller must not hold a [`Gate`] of the stream (it would wait for itself).
    pub(crate) fn mark_capture_changing(&self, from: u64) -> bool {
        self.mark_capture_changing_within(from, None)
    }

    /// [`StreamKey::mark_capture_changing`], giving up (`false`) once the gate has stayed held
    /// for `patience` (see [`StreamKey::mark_ungated`]).
    fn mark_capture_changing_within(&self, from: u64, patience: Option<Duration>) -> bool {
        let capture = &self.0.capture;
        self.mark_ungated(
            patience,
            // Not waiting for the gate to be told no: two threads each holding the gate of a
            // stream the other marks would wait for each other (two streams of two captures
            // made to wait on each other, `Stream::wait_stream`).
            || capture.load(Ordering::Acquire) == from,
            // SeqCst here and in `enter`: either the work sees the mark, or the mark sees the work.
            || capture.compare_exchange(from, CAPTURE_STARTING, Ordering::SeqCst, Ordering::Acquire).is_ok(),
            || capture.store(from, Ordering::SeqCst),
        )
    }

    /// Sets a mark that [`StreamKey::enter`] looks at after counting its gate (`mark`: false when
    /// it cannot be set, and then this returns false) and waits until no gate of the stream is
    /// held: returns true with the mark set and the gate empty. Gates entered before the mark
    /// are seen after a [`barrier::heavy`]; later ones see the mark and wait for it to go. While
    /// gates are held the mark is taken back (`unmark`) so that they finish, and set again once
    /// they have; after `patience` of that (`None`: for ever) this gives up and returns false
    /// (with no patience, after one try, and at once, with no barrier, if a gate is seen held).
    /// While it waits for the gate, it gives up (false) once `can_mark` says that the mark could
    /// not be set.
    ///
    /// The caller must not hold a [`Gate`] of the stream when it waits for ever (it would wait
    /// for itself).
    fn mark_ungated(
        &self,
        patience: Option<Duration>,
        can_mark: impl Fn() -> bool,
        mut mark: impl FnMut() -> bool,
        mut unmark: impl FnMut(),
    ) -> bool {
        let _marking = Marking::new(std::slice::from_ref(self));
        let mut patience = Patience::new(patience);
        loop {
            // A gate seen held without the barrier is held: wait for it before the mark (which
            // costs a barrier).
            if !self.wait_ungated(&mut patience, || !can_mark()) {
                return false;
            }
            if !mark() {
                return false;
            }
            // The owner counts its gates with a publish: this makes them seen.
            barrier::heavy();
            if !self.gated() {
                return true;
            }
            // Work is under way: take the mark back (the work may look again meanwhile, and waits
            // only this long), let it finish, and try again.
            unmark();
            if patience.run_out() {
                return false;
            }
        }
    }

    /// Waits until no gate of the stream is held: false, at once, when `give_up` says so, or once
    /// `patience` has run out (both asked every 1,024 spins). Spins first: new work holds back
    /// while a thread waits to mark the stream (see `enter`), so the gate empties once the work
    /// under way is queued.
    fn wait_ungated(&self, patience: &mut Patience, give_up: impl Fn() -> bool) -> bool {
        let mut spins = 0u32;
        while self.gated() {
            if spins.is_multiple_of(1024) && (give_up() || patience.run_out()) {
                return false;
            }
            pause(&mut spins, 4096);
        }
        true
    }

    /// Whether the handle names a stream of its own (see [`Stream::carries_context`]), the same
    /// on every thread.
    pub(crate) fn carries_context(&self) -> bool {
        self.0.raw as usize > CU_STREAM_PER_THREAD
    }

    /// Whether the stream's handle names it on the calling thread: not a per-thread stream used
    /// on another thread than its own (where the legacy stream stands in, see `Inner::raw_here`).
    #[inline]
    pub(crate) fn named_here(&self) -> bool {
        self.0.raw_here() == self.0.raw
    }

    /// Whether a handle of the stream lives: it has a user, or a pin (see `Inner::handle`).
    pub(crate) fn handle_lives(&self) -> bool {
        self.0.handle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).strong_count() != 0
    }

    /// Whether the stream takes part in a capture cudrv tracks (without taking a reference to its
    /// session: see [`capture::is_tracked`]).
    #[inline]
    pub(crate) fn is_capturing(&self) -> bool {
        capture::is_tracked(self.capture_id())
    }

    /// Whether work queued on the stream from the calling thread would go to the legacy default
    /// stream (the legacy or null handle, or a per-thread stream seen from another thread; see
    /// [`Stream::as_raw`]) while a blocking stream of its context captures: the driver refuses
    /// such work and invalidates that capture (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`), as it
    /// answers `cuStreamIsCapturing` of the legacy stream (without invalidating it). Asks the
    /// driver only while a capture that cudrv began is active.
    #[inline]
    pub(crate) fn legacy_held_by_capture(&self) -> bool {
        capture::any_active() && self.legacy_held_by_active_capture()
    }

    /// [`StreamKey::legacy_held_by_capture`] once a capture that cudrv began may be active.
    #[cold]
    fn legacy_held_by_active_capture(&self) -> bool {
        self.as_raw() as usize <= CU_STREAM_LEGACY && self.capture_status().is_err_and(|e| e.is_implicit_capture())
    }

    /// [`Stream::refuse_in_capture`], for a key.
    #[inline]
    pub(crate) fn refuse_in_capture(&self, what: &'static str) -> Result<Gate<'_>> {
        let gate = self.enter();
        if self.is_capturing() {
            return Err(Error::Capturing { what });
        }
        Ok(gate)
    }

    /// Enters the stream's gate: until the [`Gate`] is dropped, no capture begins on the stream,
    /// nor ends while the stream takes part in it (see [`mark_capture_ending`]), so that what the
    /// caller sees of the stream's capture (with [`StreamKey::capture_id`])
    /// stays true while it queues work there, and no wait of another thread makes it join a
    /// capture (see [`StreamKey::joining`]; cudrv's own waits under a gate do not wait for it).
    /// Held from the look to the queueing (and for
    /// host copies, to the record of the event their wait is for: see
    /// [`Stream::wait_for_access`]). The one user code run under it is a custom
    /// [`MemoryResource`]'s `allocate` or `deallocate` for a
    /// `DeviceBuffer`: beginning a capture on the same stream there would wait for ever.
    ///
    /// The stream's owner counts its gates in a slot of its own, with [`barrier::publish`] (a
    /// plain store where the system has an asymmetric barrier), and a thread that marks the
    /// stream pays a [`barrier::heavy`] instead: an allocation and a free on the stream then cost
    /// no atomic read-modify-write, which was most of what `DeviceBuffer` added to a driver pool's
    /// pair. The owner is the first thread to enter the gate (but for cudrv's and the driver's
    /// helper threads), for good: usually the one thread that queues work on the stream. Other
    /// threads count their gates in a shared counter.
    ///
    /// The owner's entry with no mark in the way is inlined into the caller (a `DeviceBuffer`'s
    /// allocation and drop, a launch); anything else is a call.
    #[inline(always)]
    pub(crate) fn enter(&self) -> Gate<'_> {
        if self.0.marking.load(Ordering::Relaxed) == 0 && self.0.owner.load(Ordering::Relaxed) == thread_token() {
            return match self.try_enter(true) {
                Some(gate) => gate,
                None => self.enter_after_marks(),
            };
        }
        self.enter_slow()
    }

    /// The owner's [`StreamKey::enter`] that saw a mark after counting its gate: once the mark
    /// is gone, as [`StreamKey::enter_counted`].
    #[cold]
    #[inline(never)]
    fn enter_after_marks(&self) -> Gate<'_> {
        self.wait_for_marks();
        self.enter_counted(true)
    }

    /// [`StreamKey::enter`] for a thread that does not own the gate (or has not claimed it
    /// yet), or while a thread waits to mark the stream.
    #[inline(never)]
    fn enter_slow(&self) -> Gate<'_> {
        if self.0.marking.load(Ordering::Relaxed) != 0 {
            self.hold_back_for_marking();
        }
        self.enter_counted(self.is_owner())
    }

    /// [`StreamKey::enter`] once held back for a marking thread: counted in the owner's slot
    /// where `owned`.
    #[inline]
    fn enter_counted(&self, owned: bool) -> Gate<'_> {
        loop {
            if let Some(gate) = self.try_enter(owned) {
                return gate;
            }
            // A capture is being begun, or the stream's bank settled: let it (it waits for this
            // gate to empty, and is quick once it is).
            self.wait_for_marks();
        }
    }

    /// Counts a gate (in the owner's slot where `owned`) and keeps it unless the stream is being
    /// marked as beginning a capture or settling its bank: then the count is taken back.
    #[inline(always)]
    fn try_enter(&self, owned: bool) -> Option<Gate<'_>> {
        if owned {
            // Ordered before the looks at the marks below; `mark_ungated` pairs it with a heavy
            // barrier between its mark and its look at this slot.
            barrier::publish(&self.0.owner_gated, self.0.owner_gated.load(Ordering::Relaxed) + 1);
        } else {
            self.0.gated.fetch_add(1, Ordering::SeqCst);
        }
        let gate = Gate::counted(&self.0, owned);
        (self.0.capture.load(Ordering::SeqCst) != CAPTURE_STARTING && self.0.retiring.load(Ordering::SeqCst) == 0)
            .then_some(gate)
    }

    /// Waits until the stream is marked neither as beginning a capture nor as settling its bank.
    #[cold]
    fn wait_for_marks(&self) {
        if self.0.capture.load(Ordering::Acquire) == CAPTURE_STARTING {
            self.settled_capture_id();
        }
        let mut spins = 0u32;
        while self.0.retiring.load(Ordering::SeqCst) != 0 {
            pause(&mut spins, 64);
        }
    }

    /// Whether the calling thread owns the stream's gate, claiming it if no thread does yet.
    #[inline]
    fn is_owner(&self) -> bool {
        let me = thread_token();
        match self.0.owner.load(Ordering::Relaxed) {
            owner if owner == me => true,
            0 => self.claim_owner(me),
            _ => false,
        }
    }

    /// Makes thread `me` the owner of the stream's gate if none is yet: whether it is now. A host
    /// function's thread and cudrv's deferred-work thread never claim it (a stream's first gate
    /// may be taken there, by a drop, while another thread queues its work).
    #[cold]
    fn claim_owner(&self, me: u64) -> bool {
        if host_fn::on_helper_thread() {
            return false;
        }
        // Gates are light once the process is registered for the system's barrier (on a thread
        // of its own: until then they swap).
        barrier::init();
        match self.0.owner.compare_exchange(0, me, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => true,
            Err(owner) => owner == me,
        }
    }

    /// Whether a gate of the stream is held, by its owner or another thread. After a
    /// [`barrier::heavy`] that follows a mark, this sees every gate entered before the mark was
    /// seen.
    fn gated(&self) -> bool {
        self.0.gated.load(Ordering::SeqCst) != 0 || self.0.owner_gated.load(Ordering::SeqCst) != 0
    }

    /// Holds back a new gate while another thread waits to mark the stream (a capture begins
    /// or ends): work queued in a loop on the stream would otherwise leave the gate empty only
    /// for moments between two calls, and the mark could wait for ever. For at most about a
    /// millisecond, so that a gate taken under another gate of the same stream (which the mark
    /// waits for) is never held back for long.
    #[cold]
    fn hold_back_for_marking(&self) {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.0.marking.load(Ordering::Acquire) != 0 && start.elapsed() < MARK_HOLD_BACK {
            pause(&mut spins, 64);
        }
    }

    /// Runs `f` on the attachment of `owner`, made with `make` if the stream has none. The
    /// stream's attachments are behind one lock of its own, held while `f` runs.
    #[inline]
    pub(crate) fn with_attachment<T: Attachment, R>(
        &self,
        owner: u64,
        make: impl FnOnce() -> T,
        f: impl FnOnce(&mut T) -> R,
    ) -> R {
        // Errors met under the lock reach the drop-error hook after it (see `HoldHook`).
        let _hook = crate::context::HoldHook::enter();
        let mut list = self.0.attachments.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = match list.iter().position(|(o, _)| *o == owner) {
            Some(i) => i,
            None => {
                list.push((owner, Box::new(make())));
                list.len() - 1
            }
        };
        let any: &mut dyn Any = &mut *list[i].1;
        f(any.downcast_mut::<T>().expect("an owner attaches one type"))
    }

    /// Runs `f` on the attachment of `owner`, if the stream has one.
    pub(crate) fn with_existing_attachment<T: Attachment, R>(
        &self,
        owner: u64,
        f: impl FnOnce(&mut T) -> R,
    ) -> Option<R> {
        let _hook = crate::context::HoldHook::enter();
        let mut list = self.0.attachments.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (_, a) = list.iter_mut().find(|(o, _)| *o == owner)?;
        let any: &mut dyn Any = &mut **a;
        any.downcast_mut::<T>().map(f)
    }

    /// The stream's last user let go of it: each attachment lets go of its pin if it needs it no
    /// more (see [`StreamPin`]). The pins are dropped after the lock.
    #[cold]
    fn users_gone(&self) {
        let pins: Vec<StreamPin> = {
            let mut list = self.0.attachments.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            list.iter_mut().filter_map(|(_, a)| a.users_gone()).collect()
        };
        drop(pins);
    }

    /// Takes the attachment of `owner` off the stream.
    pub(crate) fn remove_attachment(&self, owner: u64) -> Option<Box<dyn Attachment>> {
        let mut list = self.0.attachments.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = list.iter().position(|(o, _)| *o == owner)?;
        Some(list.swap_remove(i).1)
    }
}

/// Marks every stream of capture `id` that ends (`keys`: those that take part in it, the origin
/// first) as changing, as [`StreamKey::mark_capture_changing`] marks one, all at once: returns the
/// streams marked, once each of `keys` that still takes part in the capture is marked and no gate
/// of any of them is held. Not only the origin: a launch on a joined stream holds that stream's
/// gate alone, from its look at the stream's capture (its arguments' uses) to the queueing of the
/// kernel and the keep of its module (see `Function::enqueue`); so the end comes wholly before
/// such work or wholly after it, never in between. Until the streams' ids are set again
/// ([`StreamKey::set_capture_id`]), other threads' cudrv work on them waits.
///
/// Deadlock-free: no mark is held while this waits, for a gate to empty or for another thread's
/// mark to go. The marks are set only when every gate was seen empty, and all taken back as soon
/// as one is seen held after the barrier (a thread may hold a gate of one of the streams while it
/// enters another's, which the mark would hold back). Holding them, the caller waits for no gate
/// and no other thread until it sets the ids again. The marks are taken in the order of `keys`,
/// the same for every thread that ends the same capture (it is the session's list): two such
/// threads (`end_capture` on the origin and on a joined stream, or an abandoned origin's cudrv
/// thread) meet at the first stream, where the second sees the first's mark before holding any,
/// and waits for it to go, holding none (streams of two captures are never shared: marking two
/// captures at once never conflicts). A thread that holds a gate (user code run under one) waits
/// at most [`HELD_GATES_PATIENCE`]: the gate may be its own, or held by a thread that waits for
/// one this thread holds.
///
/// `None` once `patience` (`None`: for ever) has run out since a gate or a mark was first seen in
/// the way; then nothing is marked.
pub(crate) fn mark_capture_ending(keys: &[StreamKey], id: u64, patience: Option<Duration>) -> Option<Vec<StreamKey>> {
    let mut patience = Patience::new(match GATES_HELD.with(Cell::get) {
        0 => patience,
        _ => Some(patience.map_or(HELD_GATES_PATIENCE, |p| p.min(HELD_GATES_PATIENCE))),
    });
    // A stream that ended its part meanwhile (set to 0 by whoever ended the capture, maybe since
    // in another capture) is left alone.
    let takes_part = |key: &&StreamKey| key.0.capture.load(Ordering::Acquire) == id;
    // As `mark_capture_changing_within`'s.
    let unmark = |marked: &[StreamKey]| {
        for key in marked {
            key.0.capture.store(id, Ordering::SeqCst);
        }
    };
    let _marking = Marking::new(keys);
    loop {
        // Holding no mark: wait until the gates seen held have emptied (as `mark_ungated`).
        for key in keys.iter().filter(takes_part) {
            if !key.wait_ungated(&mut patience, || false) {
                return None;
            }
        }
        let mut marked: Vec<StreamKey> = Vec::with_capacity(keys.len());
        let mut in_the_way = None;
        for key in keys {
            if marked.contains(key) {
                continue;
            }
            // SeqCst here and in `enter`: either the work sees the mark, or the mark sees the work.
            match key.0.capture.compare_exchange(id, CAPTURE_STARTING, Ordering::SeqCst, Ordering::Acquire) {
                Ok(_) => marked.push(key.clone()),
                // Another thread ending the capture marks it: wait, holding none, for its mark to go.
                Err(CAPTURE_STARTING) => {
                    in_the_way = Some(key);
                    break;
                }
                Err(_) => {}
            }
        }
        if let Some(key) = in_the_way {
            unmark(&marked);
            let mut spins = 0u32;
            while key.0.capture.load(Ordering::Acquire) == CAPTURE_STARTING {
                if spins.is_multiple_of(1024) && patience.run_out() {
                    return None;
                }
                pause(&mut spins, 64);
            }
            continue;
        }
        if marked.is_empty() {
            return Some(marked);
        }
        // The owners count their gates with a publish: this makes them seen.
        barrier::heavy();
        if !marked.iter().any(StreamKey::gated) {
            return Some(marked);
        }
        // Work is under way on one of them: take every mark back and let it finish.
        unmark(&marked);
        if patience.run_out() {
            return None;
        }
    }
}

/// Counts the calling thread among those waiting to mark `keys` until it is dropped: meanwhile new
/// gates of theirs hold back ([`StreamKey::hold_back_for_marking`]).
struct Marking<'a>(&'a [StreamKey]);

impl<'a> Marking<'a> {
    fn new(keys: &'a [StreamKey]) -> Marking<'a> {
        for key in keys {
            key.0.marking.fetch_add(1, Ordering::SeqCst);
        }
        Marking(keys)
    }
}

impl Drop for Marking<'_> {
    fn drop(&mut self) {
        for key in self.0 {
            key.0.marking.fetch_sub(1, Ordering::Release);
        }
    }
}

/// How long a thread that marks streams waits for what is in its way (`None`: for ever), from
/// the first time it asks.
struct Patience {
    limit: Option<Duration>,
    since: Option<Instant>,
}

impl Patience {
    fn new(limit: Option<Duration>) -> Patience {
        Patience { limit, since: None }
    }

    /// Whether the patience has run out (the first call starts it).
    fn run_out(&mut self) -> bool {
        let since = *self.since.get_or_insert_with(Instant::now);
        self.limit.is_some_and(|p| since.elapsed() >= p)
    }
}

/// A stream's gate, entered with [`StreamKey::enter`]: while it is held, the stream's capture
/// does not change.
#[must_use = "the gate holds off captures only while it lives"]
pub(crate) struct Gate<'a> {
    inner: &'a Inner,
    /// Entered by the stream's owner, in its own slot.
    owned: bool,
    /// The owner's slot is written by the owner thread only: its gates stay on it.
    _not_send: PhantomData<*const ()>,
}

thread_local! {
    /// How many [`Gate`]s (of any stream) the calling thread holds: a thread that holds one must
    /// not wait for a stream's gates to empty (see [`StreamKey::joining`]).
    static GATES_HELD: Cell<usize> = const { Cell::new(0) };
}

impl<'a> Gate<'a> {
    /// A gate of `inner` whose count (in the owner's slot or the shared counter) the caller has
    /// just taken; counted among the calling thread's gates until it is dropped.
    #[inline]
    fn counted(inner: &'a Inner, owned: bool) -> Gate<'a> {
        GATES_HELD.with(|held| held.set(held.get() + 1));
        Gate { inner, owned, _not_send: PhantomData }
    }
}

impl Drop for Gate<'_> {
    #[inline]
    fn drop(&mut self) {
        self.uncount();
    }
}

impl Gate<'_> {
    /// Takes the gate's count back (what dropping it does); the value must not be dropped after
    /// unless the count is taken again ([`LentGates`]).
    #[inline]
    fn uncount(&self) {
        GATES_HELD.with(|held| held.set(held.get().saturating_sub(1)));
        if self.owned {
            let held = self.inner.owner_gated.load(Ordering::Relaxed);
            // Release: a thread that sees the slot empty sees the work queued under the gate.
            self.inner.owner_gated.store(held - 1, Ordering::Release);
        } else {
            self.inner.gated.fetch_sub(1, Ordering::Release);
        }
    }
}

thread_local! {
    /// What the calling thread lends to a wait before a synchronous free ([`lend_gates`]): the
    /// lender's [`Lent`], on its stack; null while nothing is lent, or while a wait has it.
    static LENT_GATES: Cell<*const Lent<'static>> = const { Cell::new(std::ptr::null()) };
}

/// A gate with the key of the stream it was entered on: what [`lend_gates`] lends.
pub(crate) type KeyedGate<'a> = (&'a StreamKey, Gate<'a>);

/// The memory resource whose free may borrow lent gates ([`lend_gates`]), or `None` for cudrv's
/// own free of memory that no resource holds (a `ManagedBuffer`'s, a `DeviceBuffer2D`'s).
pub(crate) type Lender<'a> = Option<&'a (dyn MemoryResource + 'static)>;

/// What waits to free ([`Stream::wait_to_free`]), as lent gates know their [`Lender`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Borrower {
    /// cudrv's own free of memory that no resource holds (a `ManagedBuffer`'s, a
    /// `DeviceBuffer2D`'s).
    Cudrv,
    /// A resource, by its address and its type: a resource that wraps another may share its
    /// address, but not its type.
    Resource(*const (), TypeId),
}

/// The borrower identity of `resource` (for [`Stream::wait_to_free`]).
pub(crate) fn borrower<R: MemoryResource>(resource: &R) -> Borrower {
    Borrower::Resource(std::ptr::from_ref(resource).cast(), TypeId::of::<R>())
}

/// Gates lent by a thread ([`lend_gates`]): the lender's [`KeyedGate`]s, and the resource they
/// are lent to.
struct Lent<'a> {
    gates: &'a [KeyedGate<'a>],
    to: Lender<'a>,
}

impl Lent<'_> {
    /// Whether `by`, waiting on `stream`, is what the gates were lent to, and `stream` one of
    /// theirs.
    fn lent_to(&self, by: Borrower, stream: &StreamKey) -> bool {
        let to_by = match (self.to, by) {
            (None, Borrower::Cudrv) => true,
            (Some(to), Borrower::Resource(addr, ty)) => {
                let to: &dyn Any = to;
                // The type of the resource itself (not of the reference).
                std::ptr::from_ref(to).cast::<()>() == addr && Any::type_id(to) == ty
            }
            _ => false,
        };
        to_by && self.gates.iter().any(|(key, _)| Arc::ptr_eq(&key.0, &stream.0))
    }
}

/// Runs `f`, a memory resource's free and the last thing the calling thread does under `gates`
/// that depends on their streams' captures, with the gates lent to the wait that `to` makes
/// before its synchronous free ([`Stream::wait_to_free`], which cudrv's `SyncResource`,
/// `ManagedResource` and `PinnedHostResource` make; `None`: cudrv's own free of memory no
/// resource holds). That wait lets the gates go once its event's record is queued and takes them
/// again before it returns, so that a buffer's drop does not keep a capture from beginning on its
/// stream for as long as the stream's work runs (a host function queued there may be waiting for
/// the thread that begins it). What `f` sees of the streams' captures after such a wait may have
/// changed: the free after it queues nothing. Only `to` itself borrows them, for a wait on one of
/// their streams: a resource written outside cudrv that wraps one of cudrv's (and may queue work
/// after the inner free) keeps the gates held. On the buffers' hot path: one pointer of the
/// thread's is set and put back.
#[inline]
pub(crate) fn lend_gates<R>(gates: &[KeyedGate<'_>], to: Lender<'_>, f: impl FnOnce() -> R) -> R {
    /// Puts back what was lent before (nothing, or an outer lender's gates), also if `f` unwinds.
    struct Restore(*const Lent<'static>);
    impl Drop for Restore {
        #[inline]
        fn drop(&mut self) {
            LENT_GATES.with(|lent| lent.set(self.0));
        }
    }
    let lent = Lent { gates, to };
    // Only the lifetime changes: the pointer is used within this call (see `LentGates::lent`).
    // Dropped before `lent`: the thread's pointer to it goes first.
    let _restore = Restore(LENT_GATES.with(|l| l.replace((&raw const lent).cast())));
    f()
}

/// The gates lent to the calling thread ([`lend_gates`]), let go for a wait until this is
/// dropped, which takes them again (waiting, as [`StreamKey::enter`] does, while a capture is
/// being begun on one of their streams). Null where none were let go.
struct LentGates(*const Lent<'static>);

impl LentGates {
    /// Lets the gates go where they were lent to `by` and `stream` is one of theirs (none where
    /// nothing is lent, or another wait has them).
    fn let_go(by: Borrower, stream: &StreamKey) -> LentGates {
        let lent = LentGates(LENT_GATES.with(Cell::get));
        if !lent.lent().is_some_and(|l| l.lent_to(by, stream)) {
            // Not lent to this wait: left as it is (`lent` puts nothing back).
            std::mem::forget(lent);
            return LentGates(std::ptr::null());
        }
        LENT_GATES.with(|l| l.set(std::ptr::null()));
        for (_, gate) in lent.gates() {
            gate.uncount();
        }
        lent
    }

    /// What was lent, if anything.
    fn lent(&self) -> Option<&Lent<'_>> {
        // SAFETY: null, or what `lend_gates` stored for this thread: a `Lent` on the stack of
        // that call, which borrows the gates and the resource until it returns; this value is
        // made and dropped on this thread within the `f` of that call (a wait that `f` makes),
        // and lends out nothing longer than itself.
        unsafe { self.0.as_ref() }
    }

    fn gates(&self) -> &[KeyedGate<'_>] {
        self.lent().map_or(&[], |l| l.gates)
    }
}

impl Drop for LentGates {
    fn drop(&mut self) {
        if self.0.is_null() {
            return;
        }
        for (key, gate) in self.gates() {
            // Counted again in the slot it was counted in: the lender's value stands for it once
            // more, and drops it.
            std::mem::forget(key.enter_counted(gate.owned));
        }
        LENT_GATES.with(|lent| lent.set(self.0));
    }
}

impl fmt::Debug for Gate<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gate({})", self.inner.id)
    }
}

/// One pause of a wait that looks again and again: a spin for the first `spin_first` looks
/// (`spins` counts them), then a yield of the thread.
#[inline]
fn pause(spins: &mut u32, spin_first: u32) {
    // Wrapping: a gate may stay held for an hour (a host copy waiting for a long kernel), past
    // 2^32 looks; after the wrap the wait spins a while again, which is harmless.
    *spins = spins.wrapping_add(1);
    if *spins < spin_first { std::hint::spin_loop() } else { std::thread::yield_now() }
}

/// How long a new gate holds back for a thread waiting to mark the stream
/// ([`StreamKey::hold_back_for_marking`]).
const MARK_HOLD_BACK: Duration = Duration::from_millis(1);

/// How long a thread that holds a gate itself (user code run under one: a custom resource's
/// `allocate` or `deallocate`, a kernel argument's `kernel_value`) waits for the gates of a
/// capture's streams to empty, to end the capture ([`mark_capture_ending`]).
const HELD_GATES_PATIENCE: Duration = Duration::from_millis(10);

/// The capture id of a stream on which a capture is being begun (the driver's ids count up from
/// 1 and never reach it).
const CAPTURE_STARTING: u64 = u64::MAX;

/// What a stream's waits do about captures: set by [`crate::graph`] when it begins its first
/// capture (streams sit below graphs, which keep the capture sessions).
#[derive(Clone, Copy)]
pub(crate) struct JoinHooks {
    /// Before `stream` may join a capture: notes where it stands (an event recorded on it).
    pub(crate) before: fn(&Stream) -> Result<Box<dyn Any + Send>>,
    /// `stream` joined capture `id` (it waited on a stream of the capture).
    pub(crate) joined: fn(&Stream, u64, Box<dyn Any + Send>),
    /// `stream` waited on an event: if that made it join a capture cudrv tracks, it is tracked.
    pub(crate) waited: fn(&Stream, Box<dyn Any + Send>),
    /// The last user of `stream` let go of it while it was capturing (a panic between
    /// `begin_capture` and `end_capture`): the capture is ended and its graph dropped, so that
    /// the driver does not go on refusing other threads' work for it (global mode).
    pub(crate) abandoned: fn(&StreamKey),
}

static JOIN_HOOKS: std::sync::OnceLock<JoinHooks> = std::sync::OnceLock::new();

/// Sets the join hooks (the first call wins: there is one graph layer).
pub(crate) fn set_join_hooks(hooks: JoinHooks) {
    let _ = JOIN_HOOKS.set(hooks);
}

/// The join hooks, once a capture has begun.
pub(crate) fn join_hooks() -> Option<&'static JoinHooks> {
    JOIN_HOOKS.get()
}

/// State another layer keeps on a stream, found by its owner's number: a memory pool's cache of
/// the stream. When the stream's last user lets go of it (while it is still valid), each
/// attachment is told, so that it can give back what it holds.
pub(crate) trait Attachment: Any + Send {
    /// The stream's last user and pin let go of it; `stream` is still valid. Called with the
    /// stream's attachment lock held: what the attachment holds must be findable elsewhere when
    /// this returns.
    fn retire(self: Box<Self>, stream: &StreamKey);

    /// The stream's last user let go of it: the attachment's pin, if it holds one that it needs
    /// no more (see [`StreamPin`]).
    fn users_gone(&mut self) -> Option<StreamPin> {
        None
    }
}

/// A number for an attachment's owner, unique for the life of the process.
pub(crate) fn attachment_owner_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Drop for Handle {
    fn drop(&mut self) {
        let key = self.key.clone();
        let retire = move || {
            // A newer handle lives (work that waited with the stream parked revived it): the
            // stream is retired when that one goes.
            if key.handle_lives() {
                return;
            }
            if key.capture_id() != 0
                && let Some(hooks) = join_hooks()
            {
                (hooks.abandoned)(&key);
            }
            // Under the handle's lock, so that no newer handle is made while the attachments go
            // (it would find them gone, or retired under it); where one was made meanwhile (by a
            // free that the abandoned capture let run), it retires them when it goes.
            let current = key.0.handle.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if current.strong_count() != 0 {
                return;
            }
            // Under the lock: another thread looking for what an attachment holds (a pool freeing,
            // on another stream, an allocation made on this one) waits until it is where that
            // thread looks next. (A stream's handle, its attachments, then a pool's arena: the
            // lock order.) The retirements' errors reach the drop-error hook after the lock.
            let _hook = crate::context::HoldHook::enter();
            let mut list = key.0.attachments.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (_, a) in std::mem::take(&mut *list) {
                a.retire(&key);
            }
            drop(list);
            drop(current);
        };
        host_fn::now_or_deferred(retire)
    }
}

/// A stream held by work that waits for something the stream's users may have to end first: the
/// end of a capture, or a graph's last launch (a buffer's free, dropped during a capture). It
/// keeps the stream valid, but not its users' [`Handle`], so that the last user's going still
/// ends a capture that it began and abandoned (see [`JoinHooks::abandoned`]), which the waiting
/// work would otherwise keep from ending for ever. [`ParkedStream::revive`] makes a user of the
/// stream again, to do the work with.
#[derive(Clone)]
pub(crate) struct ParkedStream(StreamKey);

impl Stream {
    /// Lets go of this user, keeping the stream parked (see [`ParkedStream`]). Where this was the
    /// stream's last reference, the stream's handle goes here, as in a drop.
    pub(crate) fn park(self) -> ParkedStream {
        ParkedStream::from(&self)
    }
}

impl From<&Stream> for ParkedStream {
    /// The stream parked, without making a user of it (`stream` may be a view that a pin keeps).
    fn from(stream: &Stream) -> ParkedStream {
        ParkedStream(stream.key().clone())
    }
}

impl ParkedStream {
    /// A user of the stream: of its live handle, or of a new one where the last went meanwhile
    /// (what that one kept, such as memory pools' caches of the stream, it gave back as it went;
    /// the new one keeps its own and gives them back in turn, as any handle). `None` while a
    /// handle that went is being retired just then (on this thread, or another): try again later.
    pub(crate) fn revive(&self) -> Option<Stream> {
        let mut current = match self.0.0.handle.try_lock() {
            Ok(current) => current,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(self.0.user_under(&mut current))
    }

    /// The stream.
    pub(crate) fn key(&self) -> &StreamKey {
        &self.0
    }
}

impl StreamKey {
    /// A user of the stream, made under its handle's lock (`current`, see `Inner::handle`): of
    /// its live handle, else of a new one.
    fn user_under(&self, current: &mut Weak<Handle>) -> Stream {
        if let Some(handle) = current.upgrade() {
            // A new user, as a clone of a pin's view makes one (the stream may have had none left).
            handle.users.fetch_add(1, Ordering::Relaxed);
            return Stream { handle };
        }
        let handle = Arc::new(Handle { key: self.clone(), users: AtomicUsize::new(1) });
        *current = Arc::downgrade(&handle);
        Stream { handle }
    }
}

struct Inner {
    raw: CUstream,
    ctx: Arc<Context>,
    /// `ctx`'s device, kept here: buffers ask for it on every allocation and free, and one load
    /// less in their chain of dependent loads shows (see [`Stream::device`]).
    device: Device,
    owned: bool,
    id: u64,
    /// For the per-thread default stream: the [`thread_token`] of the thread whose stream this
    /// is. 0 for every other stream.
    per_thread_owner: u64,
    /// The driver's id of the capture this stream takes part in (see
    /// [`CaptureSession`](crate::session::CaptureSession)); 0 when none is known to cudrv.
    capture: AtomicU64,
    /// How many [`Gate`]s of the stream are held by threads other than its owner.
    gated: AtomicUsize,
    /// The [`thread_token`] of the stream's owner: the first thread that entered its gate (0
    /// until then). The owner enters with no read-modify-write (see [`StreamKey::enter`]).
    owner: AtomicU64,
    /// How many [`Gate`]s of the stream its owner holds. Written by the owner only (a load and a
    /// store), read by a thread that marks the stream's capture as changing.
    owner_gated: AtomicUsize,
    /// How many threads wait to mark the stream ([`StreamKey::mark_ungated`]): new gates hold
    /// back for them a while.
    marking: AtomicUsize,
    /// How many threads settle the stream's bank ([`Handle::retire`]): a mark that new gates wait
    /// for.
    retiring: AtomicUsize,
    /// The owner's pins taken and let go on its thread ([`StreamPin::for_buffer`]), counted by
    /// the owner alone (wrapping), under its gate. Those it took that live are this less
    /// `pins_let_go_elsewhere`.
    owner_pins: AtomicUsize,
    /// The owner's pins let go on other threads, under their gates.
    pins_let_go_elsewhere: AtomicUsize,
    /// Whether the bank is held: one counted reference to the stream's [`Handle`] for all the
    /// owner's pins. Taken by the owner's first pin under its gate, let go by
    /// [`Handle::retire`] once no owner pin lives and the users are gone.
    banked: AtomicBool,
    /// What other layers keep on the stream (see [`Attachment`]), on cache lines of their own:
    /// threads that allocate on different streams must not share one.
    attachments: CachePadded<Mutex<Attachments>>,
    /// The stream's [`Handle`] (its users' share) while one lives. Work that waits with the stream
    /// parked ([`ParkedStream`]), and [`Stream::per_thread`] for its thread's stream, make a user
    /// of it, or a new handle where the last one went meanwhile; a handle that goes retires the
    /// stream only while none newer lives, under this lock (see [`Handle`]'s drop).
    handle: Mutex<Weak<Handle>>,
    /// Run once by the next settling of the bank that finds no pin and no user, between that look
    /// and its decision ([`Handle::settle_bank`]), so that a test can act there.
    #[cfg(test)]
    settle_hook: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// Asks `done` (whether some work is done), with a growing pause, until it says so or fails with
/// an error that ends all work ([`Error::ends_all_work`]); errors that end nothing are passing, or
/// say nothing of the work, and it asks again. Returns `failed`, the error of the wait that this
/// stands in for.
fn poll_until_done(failed: Error, mut done: impl FnMut() -> Result<bool>) -> Error {
    let mut pause = Duration::from_micros(10);
    loop {
        match done() {
            Ok(true) => return failed,
            Err(q) if q.ends_all_work() => return failed,
            Ok(false) | Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(10));
            }
        }
    }
}

#[cfg(test)]
impl Inner {
    fn run_settle_hook(&self) {
        let hook = self.settle_hook.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(hook) = hook {
            hook();
        }
    }
}

/// A stream's attachments, each with its owner's number.
type Attachments = Vec<(u64, Box<dyn Attachment>)>;

/// A value alone on its cache lines (128 bytes: two 64-byte lines, as adjacent-line prefetching
/// pairs them).
#[repr(align(128))]
struct CachePadded<T>(T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl Inner {
    /// The raw handle that means this stream on the calling thread. `CU_STREAM_PER_THREAD` means
    /// the *calling* thread's per-thread stream, so on any other thread than the owner's, the
    /// legacy default stream stands in: the driver orders it after all earlier work on every
    /// blocking stream of the context (per-thread streams are blocking) and all later work there
    /// after it, so it is ordered with the owner's stream both ways.
    #[inline]
    fn raw_here(&self) -> CUstream {
        if self.per_thread_owner != 0 && self.per_thread_owner != thread_token() {
            CU_STREAM_LEGACY as CUstream
        } else {
            self.raw
        }
    }
}

// SAFETY: a CUstream may be used from any thread (the driver API is thread-safe for streams);
// cudrv makes the stream's context current before each use, and uses the per-thread stream
// handle only on its own thread (`raw_here`).
unsafe impl Send for Inner {}
// SAFETY: as above; all uses go through `&self` and thread-safe driver calls.
unsafe impl Sync for Inner {}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A number for the calling thread, never 0, unique for the life of the process.
#[inline]
fn thread_token() -> u64 {
    // Initialised by hand: a `const` thread-local is a plain load, where a lazy one checks its
    // state first (every gate asks).
    thread_local! {
        static TOKEN: Cell<u64> = const { Cell::new(0) };
    }
    #[cold]
    fn first(token: &Cell<u64>) -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let t = NEXT.fetch_add(1, Ordering::Relaxed);
        token.set(t);
        t
    }
    TOKEN.with(|token| match token.get() {
        0 => first(token),
        t => t,
    })
}

thread_local! {
    /// This thread's per-thread stream of each context (by the context's address), so that every
    /// `Stream::per_thread` on a thread shares one identity: the stream itself, not its handle,
    /// which may go while work waits with the stream parked and revives it later
    /// ([`ParkedStream`]).
    static PER_THREAD: RefCell<Vec<(usize, Weak<Inner>)>> = const { RefCell::new(Vec::new()) };
}

impl Stream {
    /// A new non-blocking stream on `device` (`CU_STREAM_NON_BLOCKING`), at default priority.
    ///
    /// # Errors
    /// The driver's error.
    pub fn new(device: &Device) -> Result<Stream> {
        Self::create(device, None)
    }

    /// A new non-blocking stream with `priority`, which must lie in the device's range
    /// ([`crate::Capabilities::stream_priority_range`]; lower numbers run first).
    ///
    /// # Errors
    /// [`Error::InvalidPriority`] outside the range; the driver's error.
    pub fn with_priority(device: &Device, priority: i32) -> Result<Stream> {
        let (least, greatest) = device.capabilities()?.stream_priority_range;
        if priority < greatest || priority > least {
            return Err(Error::InvalidPriority { requested: priority, device: device.ordinal_i32(), least, greatest });
        }
        Self::create(device, Some(priority))
    }

    fn create(device: &Device, priority: Option<i32>) -> Result<Stream> {
        let ctx = device.primary_context()?;
        let _bound = ctx.bind()?;
        let flags = cudrv_sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and the context is current.
        unsafe {
            match priority {
                Some(p) => drv!(cuStreamCreateWithPriority(&mut raw, flags, p)),
                None => drv!(cuStreamCreate(&mut raw, flags)),
            }
        }?;
        Ok(Self::wrap(raw, ctx.clone(), true, 0))
    }

    fn wrap(raw: CUstream, ctx: Arc<Context>, owned: bool, per_thread_owner: u64) -> Stream {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(Inner {
            raw,
            device: ctx.device(),
            ctx,
            owned,
            id,
            per_thread_owner,
            capture: AtomicU64::new(0),
            gated: AtomicUsize::new(0),
            owner: AtomicU64::new(0),
            owner_gated: AtomicUsize::new(0),
            marking: AtomicUsize::new(0),
            retiring: AtomicUsize::new(0),
            owner_pins: AtomicUsize::new(0),
            pins_let_go_elsewhere: AtomicUsize::new(0),
            banked: AtomicBool::new(false),
            attachments: CachePadded(Mutex::new(Vec::new())),
            handle: Mutex::new(Weak::new()),
            #[cfg(test)]
            settle_hook: Mutex::new(None),
        });
        let handle = Arc::new(Handle { key: StreamKey(inner), users: AtomicUsize::new(1) });
        *handle.key.0.handle.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::downgrade(&handle);
        Stream { handle }
    }

    /// A stream that makes no driver call (a null handle in a detached context, never destroyed),
    /// for tests of the layers above streams.
    #[cfg(test)]
    pub(crate) fn detached() -> Stream {
        Self::wrap(std::ptr::null_mut(), Context::detached(), false, 0)
    }

    /// The legacy default stream of `device` (`CU_STREAM_LEGACY`), which synchronises with every
    /// blocking stream of the context.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub fn legacy(device: &Device) -> Result<Stream> {
        Ok(Self::wrap(CU_STREAM_LEGACY as CUstream, device.primary_context()?, false, 0))
    }

    /// The calling thread's per-thread default stream of `device` (`CU_STREAM_PER_THREAD`). Every
    /// host thread has its own, and every call on one thread returns the same stream (equal
    /// [`Stream::id`]).
    ///
    /// The value may be sent to and used from other threads, but what it names is the stream of
    /// the thread that made it. There, cudrv queues work on it directly. On any other thread
    /// (including a drop there, which frees buffers on it) cudrv queues the work on the legacy
    /// default stream instead, which the driver orders after all earlier work on every thread's
    /// per-thread stream and before all later work on them. So ordering and memory safety hold,
    /// at the price of the legacy stream's synchronisation. Host waits for the stream
    /// ([`Stream::synchronize`], and those of buffers and copies) wait for both, on any thread.
    ///
    /// # Errors
    /// The driver's error when retaining the context. [`Error::Unsupported`] once the calling
    /// thread has begun to destroy its thread-locals (a call from a thread-local destructor, at
    /// thread exit): cudrv can no longer find the stream it gave the thread, and another would
    /// name the same driver stream unaware of the first's captures.
    pub fn per_thread(device: &Device) -> Result<Stream> {
        let ctx = device.primary_context()?;
        let key = Arc::as_ptr(&ctx) as usize;
        // `try_with`: `with` panics once the thread's thread-locals are being destroyed, and a
        // panic in a thread-local destructor aborts the process.
        let found = PER_THREAD.try_with(|cache| {
            let mut cache = cache.borrow_mut();
            cache.retain(|(_, w)| w.strong_count() > 0);
            if let Some(inner) = cache.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
                // A user of its live handle, else of a new one (its last went while work waiting
                // with it parked keeps it; that work revives the same handle). The lock is held
                // briefly: while a handle is made, or a handle that went retires the stream.
                let key = StreamKey(inner);
                let mut current = key.0.handle.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                return key.user_under(&mut current);
            }
            let stream = Self::wrap(CU_STREAM_PER_THREAD as CUstream, ctx, false, thread_token());
            cache.push((key, Arc::downgrade(&stream.key().0)));
            stream
        });
        found.map_err(|_| {
            device.unsupported(
                "the per-thread default stream during thread exit",
                "Stream::per_thread was called after the calling thread's thread-local storage was destroyed \
                 (from a thread-local destructor): the stream cudrv gave this thread can no longer be found",
                Some("Stream::new, or a Stream::per_thread value kept from before the thread began to exit"),
            )
        })
    }

    /// Borrows a stream made elsewhere (by another library) without owning it: dropping the
    /// returned `Stream` does not destroy it. `CU_STREAM_PER_THREAD` is taken as the calling
    /// thread's per-thread stream, as [`Stream::per_thread`] returns it.
    ///
    /// # Safety
    /// `raw` must be a valid stream of `device`'s primary context (or a special stream value),
    /// and must stay valid for as long as the returned `Stream`, its clones, and any work or
    /// buffer that refers to them exist.
    ///
    /// # Errors
    /// The driver's error when retaining the context.
    pub unsafe fn from_raw(device: &Device, raw: CUstream) -> Result<Stream> {
        if raw as usize == CU_STREAM_PER_THREAD {
            return Self::per_thread(device);
        }
        Ok(Self::wrap(raw, device.primary_context()?, false, 0))
    }

    #[inline]
    fn inner(&self) -> &Inner {
        &self.handle.key.0
    }

    pub(crate) fn key(&self) -> &StreamKey {
        &self.handle.key
    }

    /// Refuses `what` on a stream that takes part in a capture cudrv started (see
    /// [`crate::graph`]); otherwise the stream's [`Gate`], to hold until `what` is queued (and
    /// waited for), so that no capture begins on the stream in between.
    #[inline]
    pub(crate) fn refuse_in_capture(&self, what: &'static str) -> Result<Gate<'_>> {
        self.key().refuse_in_capture(what)
    }

    /// [`Stream::refuse_in_capture`] for host access (a host copy or memset, or a wait for the
    /// stream): refused too where the stream stands for the legacy default stream while a
    /// blocking stream of its context captures (the driver would refuse the work and invalidate
    /// that capture, and a wait for the stream could not end before the capture does). The caller
    /// holds the gate until its work is queued, and lets it go in [`Stream::wait_for_access`].
    pub(crate) fn refuse_host_access(&self, what: &'static str) -> Result<Gate<'_>> {
        let gate = self.refuse_in_capture(what)?;
        if self.key().legacy_held_by_capture() {
            return Err(Error::Capturing { what });
        }
        Ok(gate)
    }

    /// [`Stream::refuse_host_access`] for a host copy: see [`Stream::after_earlier_work`].
    pub(crate) fn refuse_host_copy(&self, what: &'static str) -> Result<Gate<'_>> {
        self.after_earlier_work(self.refuse_host_access(what)?, what)
    }

    /// Before a host copy is queued under `gate` (the caller's, from
    /// [`Stream::refuse_host_access`]): waits for the stream's earlier work without the gate, then
    /// takes it again, refused where a capture began on the stream meanwhile. A copy between the
    /// device and pageable host memory waits in the driver's call for the stream's earlier work
    /// (`cuMemcpyDtoHAsync` returns once the copy is done, and `cuMemcpyHtoDAsync` may): held
    /// through that wait, the gate would keep a capture from beginning on the stream until a host
    /// function queued before the copy returns, which may be waiting for the thread that begins
    /// the capture. Costs one question to the driver where the stream is idle.
    pub(crate) fn after_earlier_work<'a>(&'a self, gate: Gate<'a>, what: &'static str) -> Result<Gate<'a>> {
        let idle = self.inner().ctx.bind().and_then(|_b| {
            // As `synchronize`'s.
            let _relaxed = capture::RelaxedCaptureMode::enter();
            self.host_done()
        });
        if !matches!(idle, Ok(false)) {
            // Idle, or the question failed: the copy's own call and wait report what is wrong.
            return Ok(gate);
        }
        // Whatever this wait says, the copy's own never returns while the copy may run.
        let _ = self.wait_for_access(gate);
        self.refuse_host_access(what)
    }

    /// The raw `CUstream` that means this stream on the calling thread: the stream's handle,
    /// except for the per-thread default stream used on another thread than its own, where it is
    /// `CU_STREAM_LEGACY` (see [`Stream::per_thread`]).
    #[inline]
    pub fn as_raw(&self) -> CUstream {
        self.inner().raw_here()
    }

    /// Whether the handle names a stream of its own, which carries its context (not the null,
    /// legacy or per-thread handle, which mean "the current context's").
    #[inline]
    pub(crate) fn carries_context(&self) -> bool {
        self.key().carries_context()
    }

    /// The stream's device.
    pub fn device(&self) -> Device {
        self.inner().device
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner().ctx
    }

    /// A number unique to this stream for the life of the process (raw handles can be reused
    /// after a stream is destroyed; this cannot).
    pub fn id(&self) -> u64 {
        self.inner().id
    }

    /// Waits until all work queued on the stream is done, then returns an error kept from a
    /// `Drop` on the stream's context, if any (see [`crate::context`]).
    ///
    /// # Errors
    /// The driver's error (an asynchronous error of earlier work shows up here), else
    /// [`Error::Deferred`]; [`Error::Capturing`] while the stream captures a graph.
    ///
    /// The wait is for an event recorded on the stream, and holds nothing of the stream: another
    /// thread may begin a capture on it meanwhile. A per-thread stream's work includes what other
    /// threads queued on the legacy stream in its stead ([`Stream::per_thread`]), which
    /// `cuStreamSynchronize` of `CU_STREAM_PER_THREAD` does not wait for (nor does that of the
    /// legacy stream wait for the owner's later work); the record is ordered after both (the
    /// driver orders the one blocking stream after the other).
    pub fn synchronize(&self) -> Result<()> {
        // The driver would refuse it too, and invalidate the capture.
        let gate = self.refuse_in_capture("Stream::synchronize")?;
        {
            let _b = self.inner().ctx.bind()?;
            // The stream takes no part in a capture (refused above): the wait may not invalidate
            // another thread's capture in the global mode (a "potentially unsafe" call there).
            let _relaxed = capture::RelaxedCaptureMode::enter();
            // The gate goes once the record is queued: a capture beginning on the stream then
            // does not wait for the work (which a host function may make wait for it).
            self.inner().ctx.wait_for_stream(self.as_raw(), || drop(gate))?;
        }
        self.inner().ctx.take_deferred()
    }

    /// Waits on the host for all work queued on the stream so far, its context current, as
    /// [`Stream::synchronize`] does (an event), where the stream is a per-thread one; else with
    /// `cuStreamSynchronize`.
    fn host_wait(&self) -> Result<()> {
        if self.inner().per_thread_owner != 0 {
            return self.inner().ctx.wait_for_stream(self.as_raw(), || {});
        }
        // SAFETY: the stream is valid while `self` lives; its context is current (the caller's).
        unsafe { drv!(cuStreamSynchronize(self.as_raw())) }
    }

    /// Whether all work queued on the stream so far is done, as [`Stream::host_wait`] sees it,
    /// its context current.
    fn host_done(&self) -> Result<bool> {
        if self.inner().per_thread_owner != 0 {
            return self.inner().ctx.stream_done(self.as_raw());
        }
        self.query_raw(driver()?)
    }

    /// Waits until all work queued on the stream is done, for memory that the work touches (see
    /// [`Stream::wait_for_access`]). Reports no kept `Drop` error.
    pub(crate) fn wait_for_memory(&self) -> Result<()> {
        // A capturing stream cannot be waited for (the driver would refuse, and invalidate the
        // capture): the caller keeps the memory (leaks it), which is sound.
        self.wait_for_access(self.refuse_in_capture("waiting for a capturing stream")?)
    }

    /// Waits until all work queued on the stream so far is done, for memory that the work
    /// touches (a host copy's slice, a buffer to free), where `gate` (the caller's, taken before
    /// it queued the work, with the stream taking part in no capture) orders the work before any
    /// capture on the stream. It never returns while the work may still run, and reports no kept
    /// `Drop` error.
    ///
    /// The wait is for an event recorded on the stream, and `gate` goes once the record is
    /// queued: a capture may then begin on the stream while this waits (as with
    /// [`Stream::synchronize`]), so that a host function queued before it, which waits for the
    /// thread beginning that capture, cannot hang both. If the wait fails, the event is asked
    /// until the work is done or an error says that the context runs nothing more
    /// ([`Error::ends_all_work`]), and the wait's error comes back. Where no event can be
    /// recorded, the wait is for the stream, under `gate`: `cuStreamSynchronize`, then the stream
    /// asked (and, where that fails too, an event recorded on it) in the same way. Under a driver
    /// that fails every question with a passing error, it waits as long as that lasts.
    pub(crate) fn wait_for_access(&self, gate: Gate<'_>) -> Result<()> {
        self.wait_for_access_lent(gate, None)
    }

    /// [`Stream::wait_for_memory`] before a synchronous free of the memory by `by` (a resource's
    /// `deallocate`, or cudrv's own free where `None`), which queues nothing on the stream after
    /// the wait: where the caller's gates are lent to `by` and include this stream's
    /// ([`lend_gates`]: a buffer's drop), they go with the wait's own once its event is recorded,
    /// so that the drop does not keep a capture from beginning on the stream meanwhile. Where no
    /// event can be recorded they stay held through the wait; where the event's wait and its
    /// questions fail, the stream is asked instead only while it captures nothing (see
    /// [`Stream::wait_for_access`]), so the wait may then last until a capture begun meanwhile
    /// ends.
    pub(crate) fn wait_to_free(&self, by: Borrower) -> Result<()> {
        self.wait_for_access_lent(self.refuse_in_capture("waiting for a capturing stream")?, Some(by))
    }

    /// [`Stream::wait_for_access`], letting the gates lent to `lent_to` go with `gate` (see
    /// [`Stream::wait_to_free`]).
    fn wait_for_access_lent(&self, gate: Gate<'_>, lent_to: Option<Borrower>) -> Result<()> {
        let ctx = &self.inner().ctx;
        let mut gate = Some(gate);
        let waited = ctx.with_spare_event(|event| {
            // As `synchronize`'s.
            let _relaxed = capture::RelaxedCaptureMode::enter();
            // SAFETY: the event is of this context and not in use; the stream is valid while
            // `self` lives; the context is current (`with_spare_event`).
            unsafe { drv!(cuEventRecord(event, self.as_raw())) }?;
            // The record is queued after the work (see `synchronize` for a per-thread stream's).
            drop(gate.take());
            // Taken again once the wait (or the questions after it) is over.
            let _lent = lent_to.map(|by| LentGates::let_go(by, self.key()));
            // SAFETY: as above.
            let Err(e) = (unsafe { drv!(cuEventSynchronize(event)) }) else { return Ok(()) };
            if e.ends_all_work() {
                return Err(e);
            }
            let d = driver()?;
            Err(poll_until_done(e, || {
                // SAFETY: as above; the event stays this call's until it returns.
                match check_done("cuEventQuery", unsafe { d.cuEventQuery(event) }) {
                    // Where the event cannot be asked, the stream can, while it captures nothing
                    // (under a gate again): its work includes the event's. The context is current
                    // and the capture mode relaxed, as for the wait.
                    Err(q) if !q.ends_all_work() && self.inner().per_thread_owner == 0 => {
                        self.refuse_in_capture("waiting for a capturing stream").map_or(Err(q), |_g| self.query_raw(d))
                    }
                    other => other,
                }
            }))
        });
        match (waited, gate) {
            (Ok(()), _) => Ok(()),
            // The record was queued (its wait failed and was asked until done), or nothing can
            // wait here (a host function), or the context runs nothing more.
            (Err(e), None) => Err(e),
            (Err(e), Some(_)) if matches!(e, Error::InHostFunction { .. }) || e.ends_all_work() => Err(e),
            // No event could be made or recorded: the stream is waited for under the gate.
            (Err(_), Some(_gate)) => self.wait_for_stream_gated(),
        }
    }

    /// [`Stream::wait_for_access`] without an event: `cuStreamSynchronize` (or, for a per-thread
    /// stream, its event; see `host_wait`), under the caller's gate.
    fn wait_for_stream_gated(&self) -> Result<()> {
        let synced = self.inner().ctx.bind().and_then(|_b| {
            // As `synchronize`'s.
            let _relaxed = capture::RelaxedCaptureMode::enter();
            self.host_wait()
        });
        let Err(e) = synced else { return Ok(()) };
        if matches!(e, Error::InHostFunction { .. }) || e.ends_all_work() {
            return Err(e);
        }
        let Some(d) = crate::result::loaded_driver() else { return Err(e) };
        // Until the work is seen done (or the context dead), the memory is not the caller's: the
        // stream is asked, and where that fails too, an event recorded on it.
        let new_event = || crate::Event::new(&self.device()).ok().filter(|ev| ev.record(self).is_ok());
        // A per-thread stream is asked through an event from the first (see `host_wait`).
        let per_thread = self.inner().per_thread_owner != 0;
        let mut event = if per_thread { new_event() } else { None };
        Err(poll_until_done(e, || {
            let asked = if let (true, Some(ev)) = (per_thread, &event) {
                ev.query()
            } else {
                let _b = self.inner().ctx.bind();
                // As `synchronize`'s.
                let _relaxed = capture::RelaxedCaptureMode::enter();
                self.query_raw(d)
            };
            match asked {
                Err(q) if !q.ends_all_work() => {
                    if event.is_none() {
                        event = new_event();
                    }
                    event.as_ref().map_or(Err(q), crate::Event::query)
                }
                other => other,
            }
        }))
    }

    /// `cuStreamQuery` of the stream's handle (not for a per-thread stream's waits: see
    /// `host_wait`), for a caller that holds a gate of the stream, which captures nothing, with
    /// the stream's context current.
    fn query_raw(&self, d: &cudrv_sys::Driver) -> Result<bool> {
        // SAFETY: the stream is valid while `self` lives; its context is current (the caller's).
        check_done("cuStreamQuery", unsafe { d.cuStreamQuery(self.as_raw()) })
    }

    /// Whether all work queued on the stream is done, without waiting.
    ///
    /// # Errors
    /// The driver's error (other than "not ready"); [`Error::Capturing`] while the stream
    /// captures a graph.
    pub fn query(&self) -> Result<bool> {
        // The driver would refuse it too, and invalidate the capture.
        let _gate = self.refuse_in_capture("Stream::query")?;
        let _b = self.inner().ctx.bind()?;
        // As `synchronize`'s.
        let _relaxed = capture::RelaxedCaptureMode::enter();
        self.host_done()
    }

    /// Makes work queued on this stream after this call wait for all work queued on `other` so
    /// far (of any device). Returns at once. If `other` is capturing a graph, this stream joins
    /// the capture (as the driver does); other threads' cudrv work on this stream waits until the
    /// join is done, so that it is either queued before the join or part of the capture, as it
    /// sees.
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        if other.id() == self.id() {
            return Ok(());
        }
        // Before the gates and the mark: a host function must not wait for a gate (its holder
        // may wait for the host function).
        crate::host_fn::refuse_in_host_fn("Stream::wait_stream")?;
        // Under `other`'s gate no capture begins on it between the look at its capture and the
        // record this stream waits for.
        let _gate = other.key().enter();
        let joins = self.capture_to_join(other);
        let (Some(id), Some(hooks)) = (joins, join_hooks()) else {
            // The event must be of `other`'s context (the waiter may be of another device).
            return other.context().order_after(self.context(), self.as_raw(), other.as_raw());
        };
        // Other threads' cudrv work on this stream waits until the join is tracked (`other`'s gate
        // is this wait's own). Where the stream stands is noted under the mark: work queued on it
        // before the mark (while the mark waited for a gate) is before the join, and the graph's
        // first launch must wait for it too.
        self.key().joining(1, || {
            let before = (hooks.before)(self)?;
            other.context().order_after(self.context(), self.as_raw(), other.as_raw())?;
            (hooks.joined)(self, id, before);
            Ok(())
        })
    }

    /// The capture, tracked by cudrv, that waiting on `other` would make this stream join (see
    /// `crate::graph`): the one `other` takes part in, unless this stream takes part in it already.
    fn capture_to_join(&self, other: &Stream) -> Option<u64> {
        match other.key().capture_id() {
            id if id != 0 && id != self.key().capture_id() && capture::session(id).is_some() => Some(id),
            _ => None,
        }
    }

    /// [`Stream::wait_stream`] for cudrv's own waits, made under a [`Gate`] of this stream or
    /// knowing that `other` takes part in no capture this stream could join: the join, if any,
    /// is tracked, but other threads' work on this stream is not held back meanwhile (this
    /// thread's gate would hold the mark back for ever).
    pub(crate) fn wait_stream_in_gate(&self, other: &Stream) -> Result<()> {
        if other.id() == self.id() {
            return Ok(());
        }
        let joins = self.capture_to_join(other);
        let before = match (joins, join_hooks()) {
            (Some(_), Some(hooks)) => Some((hooks.before)(self)?),
            _ => None,
        };
        // The event must be of `other`'s context (the waiter may be of another device).
        other.context().order_after(self.context(), self.as_raw(), other.as_raw())?;
        if let (Some(id), Some(before), Some(hooks)) = (joins, before, join_hooks()) {
            (hooks.joined)(self, id, before);
        }
        Ok(())
    }

    /// Queues `f` to run on a driver thread once all work queued before it is done; later work
    /// waits for it to return.
    ///
    /// # What `f` may do with cudrv
    ///
    /// The driver forbids CUDA calls inside a host function (they may fail or deadlock). Inside
    /// `f`:
    /// * dropping cudrv objects is allowed, and is the usual way to keep memory alive until queued
    ///   work is done: `stream.launch_host_fn(move || drop(buffer))`. What such a drop would ask
    ///   of the driver (a stream-ordered free, destroying a stream or event, unloading a module)
    ///   is handed to a cudrv thread that does it at once, outside the host function; a buffer's
    ///   free is then queued on its stream after the host function, still after every use.
    ///   [`crate::flush_deferred_drops`] waits until those have been carried out;
    /// * every other cudrv call that needs the driver fails with [`Error::InHostFunction`] and
    ///   does nothing; host memory (a `Vec`, a channel) may be used freely;
    /// * a panic in `f` is caught and printed; it does not cross into the driver.
    ///
    /// # Errors
    /// The driver's error (then `f` is dropped without running).
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, f: F) -> Result<()> {
        type Boxed = Box<dyn FnOnce() + Send + 'static>;
        unsafe extern "C" fn trampoline(data: *mut c_void) {
            // SAFETY: `data` is the pointer made by Box::into_raw below, handed to the driver
            // exactly once, and the driver calls this exactly once with it.
            let f = unsafe { Box::from_raw(data.cast::<Boxed>()) };
            let _scope = host_fn::HostFnScope::enter();
            if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
                warn_line!("cudrv: a host function queued with Stream::launch_host_fn panicked");
                // Not dropped here: a payload whose drop panics would unwind into the driver.
                host_fn::drop_panic_payload(payload);
            }
        }
        let _gate = self.refuse_in_capture("Stream::launch_host_fn (in a graph, use Graph::add_host_node)")?;
        let _b = self.inner().ctx.bind()?;
        let data = Box::into_raw(Box::new(Box::new(f) as Boxed));
        let rc = driver().and_then(|d| {
            // SAFETY: the stream is valid, the trampoline has the driver's CUhostFn signature and
            // `data` stays valid until the trampoline takes it back.
            let rc = unsafe { d.cuLaunchHostFunc(self.as_raw(), Some(trampoline), data.cast()) };
            check("cuLaunchHostFunc", rc)
        });
        if rc.is_err() {
            // SAFETY: the driver did not take `data`, so it is still ours to free.
            drop(unsafe { Box::from_raw(data) });
        }
        rc
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (raw, ctx) = (host_fn::SendHandle(self.raw), self.ctx.clone());
        let destroy = move || {
            let Ok(driver) = crate::result::driver() else { return };
            // Destroying a stream needs no current context. Work still queued completes.
            // SAFETY: the stream was created by cudrv and is destroyed once, here.
            let rc = unsafe { driver.cuStreamDestroy_v2(raw.get()) };
            if let Err(e) = check("cuStreamDestroy", rc) {
                report_drop_error(Some(&ctx), e);
            }
        };
        host_fn::now_or_deferred(destroy)
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        self.inner().id == other.inner().id
    }
}

impl Eq for Stream {}

impl std::hash::Hash for Stream {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.inner().id.hash(state);
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("raw", &self.inner().raw)
            .field("per_thread", &(self.inner().per_thread_owner != 0))
            .field("device", &self.device().ordinal())
            .field("id", &self.inner().id)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::mem::ManuallyDrop;
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, mpsc};
    use std::time::Duration;

    use super::{
        Attachment, Borrower, GATES_HELD, LentGates, Stream, StreamKey, StreamPin, attachment_owner_id, borrower,
        lend_gates,
    };
    use crate::context::Context;
    use crate::memory::{DevicePtr, MemoryResource, ResourceKind};

    /// A stream that makes no driver call (a null handle in a detached context, never destroyed).
    fn stream() -> Stream {
        Stream::wrap(std::ptr::null_mut(), Context::detached(), false, 0)
    }

    /// A buffer's pin of `stream`, taken as a buffer takes it, under the stream's gate.
    fn pin(stream: &Stream) -> (ManuallyDrop<Stream>, bool) {
        let gate = stream.key().enter();
        StreamPin::for_buffer(stream, &gate)
    }

    /// Lets go of a pin from [`pin`], as a buffer does.
    fn let_go((view, owner): (ManuallyDrop<Stream>, bool)) {
        // SAFETY: the pin and its view, as `pin` made them, let go once; the view is not used
        // after.
        drop(unsafe { StreamPin::let_go(&view, owner, view.key().enter()) });
    }

    /// Gates lent to a wait go while the wait has them and come back after, each in the slot it
    /// was counted in (the owner's, the shared counter); a wait inside that wait, or one outside
    /// a lend, lets nothing go.
    #[test]
    fn lent_gates_go_for_a_wait_and_come_back() {
        let held = || GATES_HELD.with(std::cell::Cell::get);
        let (a, b) = (stream(), stream());
        // Another thread owns `b`'s gate: this thread's gates of it count in the shared counter.
        std::thread::scope(|s| {
            s.spawn(|| drop(b.key().enter()));
        });
        drop(LentGates::let_go(Borrower::Cudrv, a.key()));
        let gates = [(a.key(), a.key().enter()), (b.key(), b.key().enter())];
        assert!(gates[0].1.owned && !gates[1].1.owned);
        let counts = || (a.key().0.owner_gated.load(Ordering::SeqCst), b.key().0.gated.load(Ordering::SeqCst));
        assert_eq!((counts(), held()), ((1, 1), 2));
        lend_gates(&gates, None, || {
            let lent = LentGates::let_go(Borrower::Cudrv, a.key());
            assert!(!a.key().gated() && !b.key().gated());
            assert_eq!(held(), 0);
            drop(LentGates::let_go(Borrower::Cudrv, a.key()));
            assert_eq!((counts(), held()), ((0, 0), 0));
            drop(lent);
            assert_eq!((counts(), held()), ((1, 1), 2));
        });
        drop(LentGates::let_go(Borrower::Cudrv, a.key()));
        assert_eq!((counts(), held()), ((1, 1), 2));
        drop(gates);
        assert_eq!((counts(), held()), ((0, 0), 0));
    }

    /// A resource that nothing calls, to lend gates to.
    #[derive(Debug)]
    struct Plain(#[allow(dead_code)] u8);

    /// A resource that wraps a [`Plain`] at its own address.
    #[derive(Debug)]
    #[repr(transparent)]
    struct Wrapper(Plain);

    macro_rules! never_called {
        ($t:ty) => {
            // SAFETY: it hands out no memory.
            unsafe impl MemoryResource for $t {
                fn allocate(&self, _: usize, _: &Stream) -> crate::Result<DevicePtr> {
                    Err(crate::Error::InvalidArgument("never called".into()))
                }
                unsafe fn deallocate(&self, _: DevicePtr, _: usize, _: &Stream) -> crate::Result<()> {
                    Err(crate::Error::InvalidArgument("never called".into()))
                }
                fn device(&self) -> crate::Device {
                    unreachable!("never called")
                }
                fn kind(&self) -> ResourceKind {
                    ResourceKind::Custom
                }
            }
        };
    }
    never_called!(Plain);
    never_called!(Wrapper);

    /// Lent gates go only to the resource they were lent to (not to one it wraps, at the same
    /// address, whose free a wrapper may follow with work of its own; not to cudrv's own free),
    /// and only for a wait on one of their streams.
    #[test]
    fn lent_gates_go_only_to_their_resource_and_streams() {
        let (a, b) = (stream(), stream());
        let wrapper = Wrapper(Plain(1));
        let gates = [(a.key(), a.key().enter())];
        let (outer, inner) = (borrower(&wrapper), borrower(&wrapper.0));
        let (Borrower::Resource(at, _), Borrower::Resource(inner_at, _)) = (outer, inner) else {
            panic!("resources borrow as resources")
        };
        assert_eq!(at, inner_at);
        lend_gates(&gates, Some(&wrapper), || {
            for (by, key) in [(inner, a.key()), (Borrower::Cudrv, a.key()), (outer, b.key())] {
                let lent = LentGates::let_go(by, key);
                assert!(a.key().gated());
                drop(lent);
            }
            let lent = LentGates::let_go(outer, a.key());
            assert!(!a.key().gated());
            drop(lent);
            assert!(a.key().gated());
        });
        lend_gates(&gates, None, || {
            let lent = LentGates::let_go(Borrower::Cudrv, a.key());
            assert!(!a.key().gated());
            drop(lent);
        });
        drop(gates);
        assert!(!a.key().gated());
    }

    /// The owner thread takes pins on a view and lets them go, on its thread and on another,
    /// while the main thread lets go of the last user: the stream lives while a pin does (Miri
    /// reports a use after free otherwise), and goes with the last one.
    #[test]
    fn owner_pins_keep_the_stream_until_the_last_is_let_go() {
        let (rounds, pins) = if cfg!(miri) { (4, 6) } else { (300, 60) };
        for round in 0..rounds {
            let s = stream();
            let handle = Arc::downgrade(&s.handle);
            let user = s.clone();
            let (tx, rx) = mpsc::channel::<(ManuallyDrop<Stream>, bool)>();
            let owner = std::thread::spawn(move || {
                let keep = pin(&user);
                assert!(keep.1, "the first thread in the stream's gate owns it");
                drop(user);
                for i in 0..pins {
                    let p = pin(&keep.0);
                    if i % 3 == 0 { tx.send(p).unwrap() } else { let_go(p) }
                }
                drop(tx);
                let_go(keep);
            });
            let elsewhere = std::thread::spawn(move || rx.into_iter().for_each(let_go));
            drop(s);
            owner.join().unwrap();
            elsewhere.join().unwrap();
            crate::flush_deferred_drops().unwrap();
            assert!(handle.upgrade().is_none(), "round {round}: the stream outlived its pins");
        }
    }

    /// The owner thread pins on the view of another thread's counted pin, so that no owner pin
    /// lives between its pins, while the main thread lets go of the last user; then it lets go
    /// of that counted pin and goes on with its own. A retirement that let go of the bank while
    /// an owner pin was being taken (new gates must wait for its mark) would free the stream
    /// under that pin.
    #[test]
    fn owner_pins_on_a_counted_pins_view_race_the_last_user() {
        let (rounds, pins) = if cfg!(miri) { (4, 8) } else { (300, 60) };
        for round in 0..rounds {
            let s = stream();
            let handle = Arc::downgrade(&s.handle);
            let (owner_user, other_user) = (s.clone(), s.clone());
            let (tx, rx) = mpsc::channel::<(ManuallyDrop<Stream>, bool)>();
            let (claimed_tx, claimed_rx) = mpsc::channel::<()>();
            let owner = std::thread::spawn(move || {
                let first = pin(&owner_user);
                assert!(first.1, "the first thread in the stream's gate owns it");
                let_go(first);
                claimed_tx.send(()).unwrap();
                drop(owner_user);
                let anchor = rx.recv().unwrap();
                assert!(!anchor.1, "another thread's pin is counted");
                for _ in 0..pins {
                    let_go(pin(&anchor.0));
                }
                let mine = pin(&anchor.0);
                let_go(anchor);
                for _ in 0..pins {
                    let_go(pin(&mine.0));
                }
                let_go(mine);
            });
            claimed_rx.recv().unwrap();
            let other = std::thread::spawn(move || {
                tx.send(pin(&other_user)).unwrap();
                drop(other_user);
            });
            drop(s);
            owner.join().unwrap();
            other.join().unwrap();
            crate::flush_deferred_drops().unwrap();
            assert!(handle.upgrade().is_none(), "round {round}: the stream outlived its pins");
        }
    }

    /// A user revived from a counted pin's view while the last user's drop settles the bank,
    /// after the settling found no pin and no user and before it lets go of the bank, and an
    /// owner pin taken on that user: the pin's gate waits for the settling's mark, and takes the
    /// bank again after it. Counted during the settling, the pin would find the bank still held,
    /// which the settling then lets go: the stream would be freed under the pin once the counted
    /// pin goes.
    #[test]
    fn an_owner_pin_waits_for_the_bank_being_settled() {
        let s = stream();
        let handle = Arc::downgrade(&s.handle);
        let owner_user = s.clone();
        let (claimed_tx, claimed_rx) = mpsc::channel::<()>();
        let (anchor_tx, anchor_rx) = mpsc::channel::<(ManuallyDrop<Stream>, bool)>();
        let (looked_tx, looked_rx) = mpsc::channel::<()>();
        let (pinned_tx, pinned_rx) = mpsc::channel::<()>();
        let (settled_tx, settled_rx) = mpsc::channel::<()>();
        let owner = std::thread::spawn(move || {
            let first = pin(&owner_user);
            assert!(first.1, "the first thread in the stream's gate owns it");
            let_go(first);
            drop(owner_user);
            claimed_tx.send(()).unwrap();
            let anchor = anchor_rx.recv().unwrap();
            looked_rx.recv().unwrap();
            let revived: Stream = (*anchor.0).clone();
            let mine = pin(&revived);
            assert!(mine.1, "a pin on the owner's thread with a user is an owner pin");
            let _ = pinned_tx.send(());
            settled_rx.recv().unwrap();
            let banked = revived.key().0.banked.load(Ordering::SeqCst);
            let_go(mine);
            drop(revived);
            let_go(anchor);
            banked
        });
        claimed_rx.recv().unwrap();
        let anchor = pin(&s);
        assert!(!anchor.1, "a pin off the owner's thread is counted");
        anchor_tx.send(anchor).unwrap();
        *s.key().0.settle_hook.lock().unwrap() = Some(Box::new(move || {
            looked_tx.send(()).unwrap();
            // Time for the owner's pin, were its gate not to wait for this settling.
            let _ = pinned_rx.recv_timeout(Duration::from_millis(200));
        }));
        drop(s);
        settled_tx.send(()).unwrap();
        assert!(owner.join().unwrap(), "an owner pin lived without the bank");
        crate::flush_deferred_drops().unwrap();
        assert!(handle.upgrade().is_none(), "the stream outlived its pins");
    }

    /// An attachment that counts its retirements.
    struct Counted(Arc<std::sync::atomic::AtomicUsize>);

    impl Attachment for Counted {
        fn retire(self: Box<Self>, _stream: &StreamKey) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Attaches a [`Counted`] to `stream`, returning its count.
    fn attach(stream: &Stream) -> Arc<std::sync::atomic::AtomicUsize> {
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let made = count.clone();
        stream.key().with_attachment(attachment_owner_id(), move || Counted(made), |_| ());
        count
    }

    /// A parked stream revives the live handle while one lives (no second handle, so the stream
    /// is retired once), and a new handle over the same stream once the last went, which retires
    /// it in turn when it goes.
    #[test]
    fn a_parked_stream_revives_the_live_handle_else_a_new_one() {
        let s = stream();
        let retired = attach(&s);
        let first = Arc::downgrade(&s.handle);
        let parked = s.clone().park();
        let revived = parked.revive().unwrap();
        assert!(Arc::ptr_eq(&revived.handle, &s.handle), "the live handle");
        assert_eq!(revived, s);
        drop(s);
        assert_eq!(retired.load(Ordering::SeqCst), 0, "a user lives");
        drop(revived);
        assert!(first.upgrade().is_none(), "the parked stream keeps no handle");
        assert_eq!(retired.load(Ordering::SeqCst), 1, "retired as its handle went");

        let again = parked.revive().unwrap();
        let retired_again = attach(&again);
        let also = parked.revive().unwrap();
        assert!(Arc::ptr_eq(&again.handle, &also.handle), "one handle at a time");
        drop((again, also));
        assert_eq!(retired_again.load(Ordering::SeqCst), 1, "the new handle retires the stream as it goes");
        assert_eq!(retired.load(Ordering::SeqCst), 1);
    }

    /// A handle whose retirement is deferred (it went inside a host function), with a newer one
    /// revived before the retirement runs: the old one leaves the stream's attachments to the
    /// newer one, which uses them still, and that one retires them when it goes.
    #[test]
    fn a_handle_that_goes_leaves_the_stream_to_a_newer_one() {
        let s = stream();
        let parked = s.clone().park();
        // cudrv's thread waits, so that the old handle's retirement is queued behind this.
        let (go, wait) = mpsc::channel::<()>();
        crate::host_fn::defer(move || {
            let _ = wait.recv();
        });
        {
            let _host_fn = crate::host_fn::HostFnScope::enter();
            drop(s);
        }
        let newer = parked.revive().unwrap();
        let retired = attach(&newer);
        go.send(()).unwrap();
        crate::flush_deferred_drops().unwrap();
        assert_eq!(retired.load(Ordering::SeqCst), 0, "the old handle's retirement left the newer one's attachment");
        drop(newer);
        crate::flush_deferred_drops().unwrap();
        assert_eq!(retired.load(Ordering::SeqCst), 1, "retired once, as the newer handle went");
    }

    /// Checked and sound: work that cannot revive its parked stream while the stream's handle lock
    /// is held (a handle that went retires the stream) is tried again on cudrv's thread, which
    /// goes on serving meanwhile (a flush returns), and it is done once the lock is let go.
    #[test]
    fn a_contended_revival_is_retried_without_blocking_cudrvs_thread() {
        let s = stream();
        let parked = s.clone().park();
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let held = s.key().0.handle.lock().unwrap();
        let counted = done.clone();
        crate::host_fn::attempt_until_done(parked, move |parked| match parked.revive() {
            None => Some(parked),
            Some(user) => {
                drop(user);
                counted.fetch_add(1, Ordering::SeqCst);
                None
            }
        });
        crate::flush_deferred_drops().unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 0, "revived under the lock");
        drop(held);
        std::thread::sleep(Duration::from_millis(20));
        crate::flush_deferred_drops().unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 1, "done once the lock went");
        drop(s);
    }
}

//! Primary contexts, binding them to threads, and errors met in `Drop`.
//!
//! # Threading model
//!
//! cudrv uses each device's *primary context*, the one the CUDA runtime uses too, so that cudrv
//! interoperates with runtime-based libraries. A [`Context`] is shared through an `Arc`: all of
//! cudrv's objects of a device hold the same one, and the context is released when the last of
//! them is dropped. Driver calls act on the calling thread's *current* context; every cudrv
//! operation makes its device's context current first ([`Context::bind`]), which costs one
//! `cuCtxGetCurrent` when it already is. So cudrv objects can be used from any thread: `Context`,
//! `Stream`, `Event` and buffers are `Send + Sync` where the driver allows their use from several
//! threads (it does for all of these handles), and cudrv never relies on a thread having a
//! particular context current.
//!
//! When another context was current (another device's, or one another library made current),
//! cudrv makes it current again when the operation is done, so that code mixing cudrv with the
//! CUDA runtime keeps the runtime's current device. When no context was current, cudrv leaves its
//! own current: restoring "none" would cost two more driver calls on every operation of a thread
//! that uses only cudrv, and a thread with no current context has no device choice to preserve
//! (the runtime would pick device 0 by default; call `cudaSetDevice` first if that matters).
//!
//! # Errors met in `Drop`
//!
//! A `Drop` cannot return an error. cudrv passes every error it meets there to the hook set with
//! [`set_drop_error_hook`], and keeps it on the device's context: the next
//! [`Context::synchronize`], [`Stream::synchronize`](crate::Stream::synchronize) or
//! [`Event::synchronize`](crate::Event::synchronize) on that context returns it as
//! [`Error::Deferred`] *after* it has waited, as asynchronous errors of queued work show up at the
//! next synchronisation. A kept error never stops another operation, and never makes a wait that
//! protects memory return early. [`Context::take_deferred`] reads them on demand.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudrv_sys::CUcontext;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::result::drv;

/// A device's primary context, retained while this value lives. cudrv makes it current around
/// each driver call and restores the caller's context after; [`Context::bind`] does the same for
/// raw calls of your own.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::Device;
/// let device = Device::get(0)?;
/// let ctx = device.primary_context()?;
/// assert_eq!(ctx.device(), device);
/// {
///     let _current = ctx.bind()?; // current on this thread until dropped
///     // ... raw cudrv::sys calls that need a current context ...
/// }
/// ctx.synchronize()?; // waits for the device's work; reports errors kept from drops
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: CUcontext,
    deferred: Mutex<Vec<Error>>,
    /// Events (without timing) for ordering one stream after another, reused: cudrv records one,
    /// makes a stream wait on it, and puts it back at once (a wait captures the record it was
    /// made on, so recording the event again later changes nothing for it).
    spare_events: Mutex<Vec<SpareEvent>>,
    /// Whether `deferred` may hold something: lets `bind` skip the lock on the hot path.
    has_deferred: AtomicBool,
}

// SAFETY: a CUcontext is a handle the driver lets any thread use (make current, query,
// synchronise); the only Rust state, `deferred`, is behind a Mutex.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes `&self` and the driver calls are thread-safe.
unsafe impl Sync for Context {}

fn primaries() -> &'static Mutex<HashMap<i32, Weak<Context>>> {
    static PRIMARIES: OnceLock<Mutex<HashMap<i32, Weak<Context>>>> = OnceLock::new();
    PRIMARIES.get_or_init(Default::default)
}

/// A hook that sees every error met in a `Drop`. Set with [`set_drop_error_hook`].
pub type DropErrorHook = fn(&Error);

static DROP_HOOK: OnceLock<DropErrorHook> = OnceLock::new();

/// Sets a function that is called with every error a cudrv `Drop` meets (once per process; a
/// second call returns `false` and changes nothing). Without a hook, an error with no context to
/// keep it is printed to stderr. Errors that come from the driver having shut down
/// (`CUDA_ERROR_DEINITIALIZED`, at process exit) are not errors for a drop and are never reported.
pub fn set_drop_error_hook(hook: DropErrorHook) -> bool {
    DROP_HOOK.set(hook).is_ok()
}

thread_local! {
    /// How many cudrv locks this thread holds that the drop-error hook could need (a pool's
    /// arena, a stream's attachments: the hook may ask a pool for its figures), and the errors
    /// whose hook calls wait until it holds none.
    static HOOK_HELD: std::cell::RefCell<(u32, Vec<Error>)> = const { std::cell::RefCell::new((0, Vec::new())) };
}

/// While it lives, errors reported on this thread reach the drop-error hook only once the
/// thread holds no cudrv lock: taken before such a lock, and dropped after it. Costs nothing
/// when no hook is set.
#[must_use]
pub(crate) struct HoldHook(bool);

impl HoldHook {
    #[inline]
    pub(crate) fn enter() -> HoldHook {
        if DROP_HOOK.get().is_none() {
            return HoldHook(false);
        }
        // (At thread exit the counter may be gone: then the hook is called at once.)
        HoldHook(HOOK_HELD.try_with(|h| h.borrow_mut().0 += 1).is_ok())
    }
}

impl Drop for HoldHook {
    #[inline]
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        let pending = HOOK_HELD
            .try_with(|h| {
                let (depth, pending) = &mut *h.borrow_mut();
                *depth -= 1;
                if *depth == 0 { std::mem::take(pending) } else { Vec::new() }
            })
            .unwrap_or_default();
        if let Some(hook) = DROP_HOOK.get() {
            pending.iter().for_each(hook);
        }
    }
}

/// Calls the drop-error hook with `error`, now or (under a [`HoldHook`]) once this thread holds
/// no cudrv lock.
fn call_hook(hook: DropErrorHook, error: &Error) {
    let held = HOOK_HELD
        .try_with(|h| {
            let mut h = h.borrow_mut();
            if h.0 > 0 {
                h.1.push(error.clone());
                true
            } else {
                false
            }
        })
        .unwrap_or(false);
    if !held {
        hook(error);
    }
}

/// The most errors kept per context; later ones reach only the hook (none is counted).
const MAX_DEFERRED: usize = 64;

/// Runs `call`, a drop's driver call, with `ctx` current, here and once; its error, or the
/// bind's, goes to the drop-error hook. For callers outside host functions (or deferred from
/// them); [`drop_call`] also defers, and tries again after a failed bind.
pub(crate) fn bound_drop_call(ctx: &Context, call: impl FnOnce() -> Result<()>) {
    if let Err(e) = ctx.bind().and_then(|_b| call()) {
        report_drop_error(Some(ctx), e);
    }
}

/// Runs `call`, a drop's driver call, with `ctx` current: now, or on cudrv's deferred-work thread
/// inside a host function (where the driver may not be called). Where the context cannot be made
/// current for a passing reason (an error that does not end its work), `call` is tried once more
/// on the deferred-work thread: one failed bind must not leak the handle for good. The last
/// error goes to the drop-error hook.
pub(crate) fn drop_call(ctx: Arc<Context>, call: impl FnOnce() -> Result<()> + Send + 'static) {
    fn attempt(ctx: Arc<Context>, call: impl FnOnce() -> Result<()> + Send + 'static, retry: bool) {
        let failed = match ctx.bind() {
            Ok(_bound) => {
                if let Err(e) = call() {
                    report_drop_error(Some(&ctx), e);
                }
                return;
            }
            Err(e) => e,
        };
        if retry && !failed.ends_all_work() {
            crate::host_fn::defer(move || attempt(ctx, call, false));
        } else {
            report_drop_error(Some(&ctx), failed);
        }
    }
    crate::host_fn::now_or_deferred(move || attempt(ctx, call, true));
}

/// Reports an error met in a `Drop`: kept on `ctx` for its next synchronisation, and passed to the
/// hook. An [`Error::Deferred`] is unwrapped first, so kept errors never nest. Never panics.
pub(crate) fn report_drop_error(ctx: Option<&Context>, mut error: Error) {
    while let Error::Deferred(inner) = error {
        error = *inner;
    }
    if error.is_deinitialized() {
        return;
    }
    if let Some(hook) = DROP_HOOK.get() {
        call_hook(*hook, &error);
    }
    match ctx {
        Some(ctx) => {
            let mut list = ctx.deferred.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if list.len() < MAX_DEFERRED {
                list.push(error);
            }
            ctx.has_deferred.store(true, Ordering::Release);
        }
        None if DROP_HOOK.get().is_none() => warn_line!("cudrv: error in drop: {error}"),
        None => {}
    }
}

impl Device {
    /// The device's primary context, retained and shared: every caller for this device gets the
    /// same [`Context`] until the last one is dropped, which releases it.
    ///
    /// # Errors
    /// The driver's error.
    pub fn primary_context(&self) -> Result<Arc<Context>> {
        Context::primary(*self)
    }
}

#[cfg(test)]
impl Context {
    /// A context that holds no driver context, for the streams of unit tests that make no driver
    /// call. It lives for the rest of the process: its drop would ask for the driver.
    pub(crate) fn detached() -> Arc<Context> {
        static DETACHED: std::sync::OnceLock<Arc<Context>> = std::sync::OnceLock::new();
        DETACHED
            .get_or_init(|| {
                Arc::new(Context {
                    device: Device::detached(),
                    raw: std::ptr::null_mut(),
                    deferred: Mutex::new(Vec::new()),
                    spare_events: Mutex::new(Vec::new()),
                    has_deferred: AtomicBool::new(false),
                })
            })
            .clone()
    }
}

impl Context {
    pub(crate) fn primary(device: Device) -> Result<Arc<Context>> {
        let mut map = primaries().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(ctx) = map.get(&device.ordinal_i32()).and_then(Weak::upgrade) {
            return Ok(ctx);
        }
        let mut raw = std::ptr::null_mut();
        crate::host_fn::refuse_in_host_fn("Device::primary_context")?;
        // SAFETY: `raw` is a valid out-pointer; the device handle came from cuDeviceGet.
        unsafe { drv!(cuDevicePrimaryCtxRetain(&mut raw, device.as_raw())) }?;
        let ctx = Arc::new(Context {
            device,
            raw,
            deferred: Mutex::new(Vec::new()),
            spare_events: Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
        });
        map.insert(device.ordinal_i32(), Arc::downgrade(&ctx));
        Ok(ctx)
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw `CUcontext`.
    pub fn as_raw(&self) -> CUcontext {
        self.raw
    }

    /// Makes this context current on the calling thread, unless it already is. The returned
    /// guard makes the previously current context current again when dropped, if there was one
    /// and it was another (see the [module documentation](self)).
    ///
    /// # Errors
    /// [`Error::InHostFunction`] inside a host function; the driver's error.
    #[inline]
    pub fn bind(&self) -> Result<Bound<'_>> {
        if crate::host_fn::in_host_fn() {
            return Err(Error::InHostFunction { call: "Context::bind" });
        }
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        unsafe { drv!(cuCtxGetCurrent(&mut current)) }?;
        if current == self.raw {
            return Ok(Bound { restore: std::ptr::null_mut(), _ctx: PhantomData });
        }
        // SAFETY: `raw` is a retained primary context, alive while `self` is.
        unsafe { drv!(cuCtxSetCurrent(self.raw)) }?;
        Ok(Bound { restore: current, _ctx: PhantomData })
    }

    /// Returns (and forgets) the first error a `Drop` met on this context, if any.
    ///
    /// # Errors
    /// [`Error::Deferred`] with that error.
    pub fn take_deferred(&self) -> Result<()> {
        if !self.has_deferred.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut list = self.deferred.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if list.len() <= 1 {
            self.has_deferred.store(false, Ordering::Release);
        }
        if list.is_empty() { Ok(()) } else { Err(Error::Deferred(Box::new(list.remove(0)))) }
    }

    /// Makes work queued on `waiter` (of context `waiter_ctx`) after this call wait, on the GPU,
    /// for all work queued on `stream` (of this context) so far, with a reused event. Returns at
    /// once.
    pub(crate) fn order_after(
        &self,
        waiter_ctx: &Context,
        waiter: cudrv_sys::CUstream,
        stream: cudrv_sys::CUstream,
    ) -> Result<()> {
        self.with_spare_event(|event| {
            // SAFETY: the event is of this context and not in use; both streams are valid (the
            // caller holds them); the context is current.
            unsafe { drv!(cuEventRecord(event, stream)) }?;
            // The waiter's handle may be the legacy or the per-thread default stream, which name
            // the *current* context's: the waiter's own context is current for the wait.
            let _w = if std::ptr::eq(waiter_ctx, self) { None } else { Some(waiter_ctx.bind()?) };
            // SAFETY: as above (an event may be waited on from another context's stream); the
            // wait captures this record.
            unsafe { drv!(cuStreamWaitEvent(waiter, event, 0)) }
        })
    }

    /// Waits on the host for all work queued on `stream` (of this context, taking part in no
    /// capture) so far, through a reused event recorded on it, and runs `recorded` between the
    /// record and the wait. Unlike `cuStreamSynchronize` of the handle, the record is ordered
    /// after everything the driver orders later work on `stream` after (see
    /// `Stream::synchronize`), and the wait needs nothing of the stream: the caller may let go
    /// of the stream's gate in `recorded`. Not for a host function (the bind refuses).
    pub(crate) fn wait_for_stream(&self, stream: cudrv_sys::CUstream, recorded: impl FnOnce()) -> Result<()> {
        self.with_spare_event(|event| {
            // SAFETY: the event is of this context and not in use; the stream is valid (the
            // caller holds it); the context is current.
            let rc = unsafe { drv!(cuEventRecord(event, stream)) };
            recorded();
            rc?;
            // SAFETY: as above.
            unsafe { drv!(cuEventSynchronize(event)) }
        })
    }

    /// Whether all work queued on `stream` so far is done, as `Context::wait_for_stream` would
    /// see it, without waiting.
    pub(crate) fn stream_done(&self, stream: cudrv_sys::CUstream) -> Result<bool> {
        self.with_spare_event(|event| {
            // SAFETY: as in `wait_for_stream`.
            unsafe { drv!(cuEventRecord(event, stream)) }?;
            // SAFETY: as above.
            crate::error::check_done("cuEventQuery", unsafe { crate::result::driver()?.cuEventQuery(event) })
        })
    }

    /// Runs `f` with this context current and one of its reused events, which `f` leaves free
    /// for reuse when it returns (the driver's waits on it have taken their record).
    pub(crate) fn with_spare_event<R>(&self, f: impl FnOnce(cudrv_sys::CUevent) -> Result<R>) -> Result<R> {
        let event = match self.spare_events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop() {
            Some(e) => e,
            None => {
                let _b = self.bind()?;
                let mut raw = std::ptr::null_mut();
                let flags = cudrv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
                // SAFETY: a valid out-pointer; the context is current.
                unsafe { drv!(cuEventCreate(&mut raw, flags)) }?;
                SpareEvent(raw)
            }
        };
        let done = self.bind().and_then(|_b| f(event.0));
        self.spare_events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(event);
        done
    }

    /// Destroys the events cudrv keeps to order one stream after another (it makes them again
    /// when needed). Everything else cudrv caches is released with its owner (a memory
    /// resource's `trim`, a stream's or buffer's drop). Inside a host function, where the driver
    /// may not be called, they are destroyed on cudrv's deferred-work thread
    /// ([`flush_deferred_drops`](crate::flush_deferred_drops) waits for it).
    pub fn release_cached_events(&self) {
        let spare = std::mem::take(&mut *self.spare_events.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        if spare.is_empty() {
            return;
        }
        // Deferred, the job holds the context (every `Context` is in an `Arc`, found through the
        // map of primaries), so that it is released after its events are destroyed; one that
        // cannot be held keeps its events for its drop.
        let keep = if crate::host_fn::in_host_fn() {
            let Some(ctx) = self.shared() else {
                self.spare_events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(spare);
                return;
            };
            Some(ctx)
        } else {
            None
        };
        crate::host_fn::now_or_deferred(move || {
            let Some(d) = crate::result::loaded_driver() else { return };
            for e in spare {
                // SAFETY: the context's own events, not in use, destroyed once, while the context
                // is retained (by `self` now, by `keep` when deferred).
                let _ = unsafe { d.cuEventDestroy_v2(e.0) };
            }
            drop(keep);
        });
    }

    /// The `Arc` that holds this context, when the map of primaries has it.
    fn shared(&self) -> Option<Arc<Context>> {
        let map = primaries().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(&self.device.ordinal_i32()).and_then(Weak::upgrade).filter(|c| std::ptr::eq(&**c, self))
    }

    /// Waits until all work on the device's context is done (`cuCtxSynchronize`), then returns an
    /// error kept from a `Drop`, if any (see the [module documentation](self)).
    ///
    /// Refused while a stream of the context takes part in a capture that cudrv started: the
    /// driver refuses `cuCtxSynchronize` then, and invalidates the capture, which may be another
    /// thread's. Synchronise the streams that do not capture instead. Captures on other contexts
    /// are left alone: the call is made with the thread's capture mode relaxed (in the global
    /// mode, the driver would refuse it during any global-mode capture, and invalidate that).
    ///
    /// # Errors
    /// [`Error::Capturing`] during a capture on this context; the driver's error (an asynchronous
    /// error of earlier work shows up here), else [`Error::Deferred`].
    pub fn synchronize(&self) -> Result<()> {
        if crate::capture::captures_on(std::ptr::from_ref(self) as usize) {
            return Err(Error::Capturing { what: "Context::synchronize" });
        }
        {
            // After the bind, which refuses in host functions (relaxing is a driver call).
            let _b = self.bind()?;
            let _relaxed = crate::capture::RelaxedCaptureMode::enter();
            // SAFETY: the context is current.
            unsafe { drv!(cuCtxSynchronize()) }?;
        }
        self.take_deferred()
    }
}

/// Proof that a context is current on this thread (returned by [`Context::bind`]). It borrows
/// the context, so the context outlives the calls made under it; it is tied to its thread.
/// Dropping it makes the context that was current before current again, if it was another one.
#[derive(Debug)]
pub struct Bound<'a> {
    /// The context to make current again, or null.
    restore: CUcontext,
    _ctx: PhantomData<&'a Context>,
}

impl Drop for Bound<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.restore.is_null() {
            return;
        }
        if let Some(d) = crate::result::loaded_driver() {
            // SAFETY: `restore` was the thread's current context when the guard was made; making
            // it current again is what its owner expects. A failure leaves ours current, which is
            // what cudrv did before restoring existed.
            let _ = unsafe { d.cuCtxSetCurrent(self.restore) };
        }
    }
}

/// A reusable event of a context (see `Context::spare_events`), destroyed with the context.
#[derive(Debug)]
struct SpareEvent(cudrv_sys::CUevent);

// SAFETY: an event handle may be used from any thread.
unsafe impl Send for SpareEvent {}

impl Drop for Context {
    fn drop(&mut self) {
        let spare = std::mem::take(self.spare_events.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner));
        let mut map = primaries().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another thread may have raced in and created a new Context for this device after our
        // last Arc went away; only remove the entry if it is ours (dead).
        if map.get(&self.device.ordinal_i32()).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&self.device.ordinal_i32());
        }
        drop(map);
        let device = self.device;
        let release = move || {
            let Ok(driver) = crate::result::driver() else { return };
            for e in spare {
                // SAFETY: the context's own events, not in use, destroyed once, before the
                // context is released.
                let _ = unsafe { driver.cuEventDestroy_v2(e.0) };
            }
            // SAFETY: this Context retained the primary context once; this releases it once.
            let rc = unsafe { driver.cuDevicePrimaryCtxRelease_v2(device.as_raw()) };
            if let Err(e) = crate::error::check("cuDevicePrimaryCtxRelease", rc) {
                report_drop_error(None, e);
            }
        };
        crate::host_fn::now_or_deferred(release);
        // Errors kept for a next call that will never come: the hook saw them already.
        if DROP_HOOK.get().is_none() {
            for e in self.deferred.get_mut().map(std::mem::take).unwrap_or_default() {
                warn_line!("cudrv: error in drop: {e}");
            }
        }
    }
}

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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudrv_sys::CUcontext;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::result::drv;

/// A device's primary context, retained while this value lives.
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: CUcontext,
    deferred: Mutex<Vec<Error>>,
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

/// Reports an error met in a `Drop`: kept on `ctx` for its next checked call, and passed to the
/// hook. Never panics.
pub(crate) fn report_drop_error(ctx: Option<&Context>, error: Error) {
    if error.is_deinitialized() {
        return;
    }
    if let Some(hook) = DROP_HOOK.get() {
        hook(&error);
    }
    match ctx {
        Some(ctx) => {
            ctx.deferred.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(error);
            ctx.has_deferred.store(true, Ordering::Release);
        }
        None if DROP_HOOK.get().is_none() => eprintln!("cudrv: error in drop: {error}"),
        None => {}
    }
}

impl Context {
    pub(crate) fn primary(device: Device) -> Result<Arc<Context>> {
        let mut map = primaries().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(ctx) = map.get(&device.ordinal_i32()).and_then(Weak::upgrade) {
            return Ok(ctx);
        }
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the device handle came from cuDeviceGet.
        unsafe { drv!(cuDevicePrimaryCtxRetain(&mut raw, device.as_raw())) }?;
        let ctx =
            Arc::new(Context { device, raw, deferred: Mutex::new(Vec::new()), has_deferred: AtomicBool::new(false) });
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

    /// Makes this context current on the calling thread, unless it already is, and returns an
    /// error that an earlier `Drop` met on it, if any ([`Error::Deferred`]).
    ///
    /// # Errors
    /// The driver's error, or the deferred one.
    pub fn bind(&self) -> Result<Bound<'_>> {
        self.take_deferred()?;
        self.make_current()
    }

    /// Makes this context current without looking at deferred errors (for `Drop`s).
    pub(crate) fn make_current(&self) -> Result<Bound<'_>> {
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer.
        unsafe { drv!(cuCtxGetCurrent(&mut current)) }?;
        if current != self.raw {
            // SAFETY: `raw` is a retained primary context, alive while `self` is.
            unsafe { drv!(cuCtxSetCurrent(self.raw)) }?;
        }
        Ok(Bound { _ctx: self })
    }

    /// Returns (and forgets) the first error a `Drop` met on this context.
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

    /// Waits until all work on the device's context is done (`cuCtxSynchronize`).
    ///
    /// # Errors
    /// The driver's error (an asynchronous error of earlier work shows up here).
    pub fn synchronize(&self) -> Result<()> {
        let _b = self.bind()?;
        // SAFETY: the context is current.
        unsafe { drv!(cuCtxSynchronize()) }
    }
}

/// Proof that a context is current on this thread (returned by [`Context::bind`]). It borrows
/// the context, so the context outlives the calls made under it.
#[derive(Debug)]
pub struct Bound<'a> {
    _ctx: &'a Context,
}

impl Drop for Context {
    fn drop(&mut self) {
        let mut map = primaries().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Another thread may have raced in and created a new Context for this device after our
        // last Arc went away; only remove the entry if it is ours (dead).
        if map.get(&self.device.ordinal_i32()).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&self.device.ordinal_i32());
        }
        drop(map);
        let Ok(driver) = crate::result::driver() else { return };
        // SAFETY: this Context retained the primary context once; this releases it once.
        let rc = unsafe { driver.cuDevicePrimaryCtxRelease_v2(self.device.as_raw()) };
        if let Err(e) = crate::result::check("cuDevicePrimaryCtxRelease", rc) {
            report_drop_error(None, e);
        }
        // Errors kept for a next call that will never come: the hook saw them already.
        if DROP_HOOK.get().is_none() {
            for e in self.deferred.get_mut().map(std::mem::take).unwrap_or_default() {
                eprintln!("cudrv: error in drop: {e}");
            }
        }
    }
}

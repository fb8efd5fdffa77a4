//! The thin layer between the raw table and the safe types: the initialised driver, and turning
//! return codes into [`Error`]s. Every driver call in cudrv goes through [`drv!`].

use std::sync::OnceLock;

use cudrv_sys::{CUresult, Driver, MissingSymbol};

use crate::error::{Error, Result};

static INIT: OnceLock<Result<&'static Driver>> = OnceLock::new();

/// The process-wide driver, loaded and initialised (`cuInit(0)`) on first use. A failure is kept:
/// every later call returns it again.
pub(crate) fn driver() -> Result<&'static Driver> {
    INIT.get_or_init(|| {
        let driver = Driver::global()?;
        // SAFETY: cuInit takes a flags word that must be 0.
        check("cuInit", unsafe { driver.cuInit(0) })?;
        Ok(driver)
    })
    .clone()
}

/// The driver, only if it is already loaded and initialised (never loads it).
pub(crate) fn loaded_driver() -> Option<&'static Driver> {
    INIT.get().and_then(|r| r.as_ref().ok().copied())
}

/// Turns the result of a raw call into a `Result`.
#[inline]
pub(crate) fn check(call: &'static str, rc: Result<CUresult, MissingSymbol>) -> Result<()> {
    match rc {
        Ok(CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(Error::driver(call, code)),
        Err(missing) => Err(missing.into()),
    }
}

/// `cuMemAlloc_v2` → `cuMemAlloc`: the name a person knows.
pub(crate) fn base_name(call: &'static str) -> &'static str {
    if let Some(pos) = call.rfind("_v") {
        let digits = &call[pos + 2..];
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            return &call[..pos];
        }
    }
    call
}

/// The driver's own name and description of `code`, when the driver is loaded and answers.
pub(crate) fn driver_describe(code: CUresult) -> Option<(String, String)> {
    let driver = loaded_driver()?;
    let mut name = std::ptr::null();
    let mut desc = std::ptr::null();
    // SAFETY: both out-pointers are valid; the driver writes pointers to static strings.
    let ok = unsafe {
        driver.cuGetErrorName(code, &mut name) == Ok(CUresult::CUDA_SUCCESS)
            && driver.cuGetErrorString(code, &mut desc) == Ok(CUresult::CUDA_SUCCESS)
    };
    if !ok || name.is_null() || desc.is_null() {
        return None;
    }
    // SAFETY: on success both are NUL-terminated static strings owned by the driver.
    let (name, desc) = unsafe { (std::ffi::CStr::from_ptr(name), std::ffi::CStr::from_ptr(desc)) };
    Some((name.to_string_lossy().into_owned(), desc.to_string_lossy().into_owned()))
}

/// Calls a driver function and checks its result: `drv!(cuMemAlloc_v2(&mut p, n))` is a
/// `Result<()>`. It must be used inside `unsafe`, with a `// SAFETY:` comment for the arguments.
macro_rules! drv {
    ($f:ident ( $($arg:expr),* $(,)? )) => {
        $crate::result::check(stringify!($f), $crate::result::driver()?.$f($($arg),*))
    };
}
pub(crate) use drv;

/// Calls the newer variant of a driver function, or, where the driver lacks it, the older variant
/// with the same signature: `drv_compat!(cuEventElapsedTime_v2 | cuEventElapsedTime(&mut ms, a, b))`
/// is a `Result<()>`. The arguments are evaluated again for the second call, so they must be
/// plain values or borrows. Used inside `unsafe`, as [`drv!`].
macro_rules! drv_compat {
    ($new:ident | $old:ident ( $($arg:expr),* $(,)? )) => {{
        let d = $crate::result::driver()?;
        match d.$new($($arg),*) {
            Err(_) => $crate::result::check(stringify!($old), d.$old($($arg),*)),
            rc => $crate::result::check(stringify!($new), rc),
        }
    }};
}
pub(crate) use drv_compat;

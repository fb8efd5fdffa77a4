//! The thin layer between the raw table and the safe types: the initialised driver, and turning
//! return codes into [`Error`](crate::Error)s (with [`crate::error`]). Every driver call in cudrv goes through [`drv!`].

use std::sync::OnceLock;

use cudrv_sys::Driver;

use crate::error::{Result, check};

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

/// Calls a driver function and checks its result: `drv!(cuMemAlloc_v2(&mut p, n))` is a
/// `Result<()>`. It must be used inside `unsafe`, with a `// SAFETY:` comment for the arguments.
macro_rules! drv {
    ($f:ident ( $($arg:expr),* $(,)? )) => {
        $crate::error::check(stringify!($f), $crate::result::driver()?.$f($($arg),*))
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
            Err(_) => $crate::error::check(stringify!($old), d.$old($($arg),*)),
            rc => $crate::error::check(stringify!($new), rc),
        }
    }};
}
pub(crate) use drv_compat;

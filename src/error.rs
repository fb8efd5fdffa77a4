//! The one error type of cudrv.

use std::fmt;

use cudrv_sys::{CUresult, LoadAttempt};

/// The result type of cudrv.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in cudrv.
///
/// ```
/// use cudrv::{Error, sys::CUresult};
/// let e = Error::driver("cuMemAllocAsync", CUresult::CUDA_ERROR_NOT_SUPPORTED);
/// assert_eq!(
///     e.to_string(),
///     "cuMemAllocAsync failed: CUDA_ERROR_NOT_SUPPORTED (801): operation not supported"
/// );
/// assert_eq!(e.code(), Some(CUresult::CUDA_ERROR_NOT_SUPPORTED));
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A driver call returned an error code.
    #[error("{call} failed: {name} ({}): {description}", .code.0)]
    Driver {
        /// The code the driver returned.
        code: CUresult,
        /// Its name (`CUDA_ERROR_OUT_OF_MEMORY`), from `cuGetErrorName` or cudrv's table.
        name: String,
        /// Its description, from `cuGetErrorString` or cudrv's table.
        description: String,
        /// The driver function that returned it (`cuMemAlloc`).
        call: &'static str,
    },
    /// No CUDA driver library could be loaded.
    #[error("{}", DriverNotFoundDisplay(.attempts))]
    DriverNotFound {
        /// Every library tried, with the operating system's reason.
        attempts: Vec<LoadAttempt>,
    },
    /// The driver lacks a function that the operation needs (an older driver).
    #[error("the CUDA driver (version {}) does not provide {name}", crate::version_string(*.driver_version))]
    MissingSymbol {
        /// The function (`cuMemAllocAsync`).
        name: &'static str,
        /// The driver's version (`cuDriverGetVersion`).
        driver_version: i32,
    },
    /// The device does not support what was asked. Raised before the driver is called.
    #[error("not supported on device {device}: {feature}: {reason}{}", Alternative(.alternative))]
    Unsupported {
        /// The feature (`memory pools`).
        feature: &'static str,
        /// The device's ordinal.
        device: i32,
        /// Why (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0 (Windows TCC driver model)`).
        reason: String,
        /// What to use instead, if anything.
        alternative: Option<&'static str>,
    },
    /// Device memory is exhausted, also after cached memory was given back.
    #[error(
        "out of device memory on device {device}: {requested} bytes requested from {resource}, which holds {reserved} bytes, {in_use} of them in use"
    )]
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// The device's ordinal.
        device: i32,
        /// The memory resource that was asked (`StreamOrderedPool`, `DriverPool`, ...).
        resource: &'static str,
        /// Bytes the memory resource holds from the driver.
        reserved: usize,
        /// Bytes of those handed out and not yet freed.
        in_use: usize,
    },
    /// A cudrv call that needs the driver was made inside a host function
    /// ([`Stream::launch_host_fn`](crate::Stream::launch_host_fn)), where the driver forbids CUDA
    /// calls. Nothing was done. Dropping cudrv objects there is allowed (see
    /// [`Stream::launch_host_fn`](crate::Stream::launch_host_fn)).
    #[error("{call} was called inside a host function, where CUDA calls are not permitted")]
    InHostFunction {
        /// The operation.
        call: &'static str,
    },
    /// The operation is refused on a stream that is capturing a graph (or on memory that a
    /// capture gave to its graph): the graph would run it later, possibly many times, pointing at
    /// memory Rust may free meanwhile. See [`crate::graph`]. Nothing was done.
    #[error("{what} is refused during a stream capture (see cudrv::graph)")]
    Capturing {
        /// The operation.
        what: &'static str,
    },
    /// Two lengths that must match do not: a copy between a buffer and host memory or another
    /// buffer. Nothing was done.
    #[error("length mismatch: {what} has {expected} elements, the other side {found}")]
    LengthMismatch {
        /// The side whose length counts (the buffer).
        what: &'static str,
        /// Its length, in elements.
        expected: usize,
        /// The other side's length, in elements.
        found: usize,
    },
    /// A launch the kernel or device cannot run: a grid, block, shared-memory, cluster or
    /// attribute value beyond its limits (cudrv checks before the driver). Nothing was launched.
    #[error("invalid launch of `{kernel}`: {reason}")]
    InvalidLaunch {
        /// The kernel's name.
        kernel: String,
        /// Which limit, and the values.
        reason: String,
    },
    /// A pointer (with its size) that the resource did not hand out, or freed already. Nothing
    /// changed.
    #[error("{ptr:#x} with {bytes} bytes is not a live allocation of this {resource}")]
    NotFromResource {
        /// The resource.
        resource: &'static str,
        /// The pointer.
        ptr: u64,
        /// The size given with it.
        bytes: usize,
    },
    /// A resource was dropped while allocations of it were live: their memory is leaked (kept
    /// mapped, as they may still be used), which is sound. Reported through the drop-error hook.
    #[error("{resource} dropped with {allocations} live allocations ({bytes} bytes); {chunks} chunks are leaked")]
    LeakedAtDrop {
        /// The resource.
        resource: &'static str,
        /// Live allocations.
        allocations: usize,
        /// Their bytes.
        bytes: usize,
        /// Chunks kept because of them.
        chunks: usize,
    },
    /// An argument is invalid. Nothing was done.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An environment variable has a value cudrv does not understand.
    #[error("{var}={value:?} is not valid: expected {expected}")]
    InvalidEnvironment {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it may be.
        expected: &'static str,
    },
    /// Objects of different devices were used together where they must share one.
    #[error("{what}: device {expected} was expected, but device {found} was given")]
    DeviceMismatch {
        /// The operation.
        what: &'static str,
        /// The device of the operation.
        expected: i32,
        /// The device of the offending object.
        found: i32,
    },
    /// `Event::elapsed` on events created without timing.
    #[error("event timing was not enabled: create both events with `EventFlags::timing()`")]
    TimingDisabled,
    /// A stream priority outside the device's range.
    #[error(
        "stream priority {requested} is outside device {device}'s range {greatest}..={least} (lower is higher priority)"
    )]
    InvalidPriority {
        /// The priority asked for.
        requested: i32,
        /// The device's ordinal.
        device: i32,
        /// The lowest priority (largest number).
        least: i32,
        /// The highest priority (smallest number).
        greatest: i32,
    },
    /// An error that a `Drop` met earlier on this device's context, returned by the next checked
    /// call there so that it is not lost.
    #[error("an earlier drop failed: {0}")]
    Deferred(Box<Error>),
    /// Loading a module failed; `log` is the JIT compiler's error log.
    #[error("{source}\nJIT error log:\n{log}")]
    Jit {
        /// The driver error.
        source: Box<Error>,
        /// The JIT error log (`CU_JIT_ERROR_LOG_BUFFER`).
        log: String,
    },
}

struct DriverNotFoundDisplay<'a>(&'a [LoadAttempt]);

impl fmt::Display for DriverNotFoundDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no CUDA driver could be loaded; tried:")?;
        for a in self.0 {
            write!(f, "\n  - {}: {}", a.path, a.reason)?;
        }
        let var = cudrv_sys::DRIVER_PATH_VAR;
        match std::env::var_os(var).filter(|v| !v.to_string_lossy().trim().is_empty()) {
            Some(v) => write!(
                f,
                "\nhint: {var} is set to {:?}: make it name the CUDA driver library (libcuda.so.1 or nvcuda.dll), \
                 or unset it to search the usual places",
                v.to_string_lossy()
            ),
            None => write!(
                f,
                "\nhint: install the NVIDIA driver, or set {var} to the driver library (libcuda.so.1 or nvcuda.dll)"
            ),
        }
    }
}

struct Alternative<'a>(&'a Option<&'static str>);

impl fmt::Display for Alternative<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(alt) => write!(f, "; use {alt} instead"),
            None => Ok(()),
        }
    }
}

impl Error {
    /// A driver error for `code` returned by `call`, named and described by the driver when it is
    /// loaded (`cuGetErrorName`, `cuGetErrorString`) and by cudrv's table otherwise.
    pub fn driver(call: &'static str, code: CUresult) -> Error {
        let (name, description) = describe(code);
        Error::Driver { code, name, description, call: base_name(call) }
    }

    /// The driver's code, for [`Error::Driver`] (also inside [`Error::Deferred`] and [`Error::Jit`]).
    pub fn code(&self) -> Option<CUresult> {
        match self {
            Error::Driver { code, .. } => Some(*code),
            Error::Deferred(inner) | Error::Jit { source: inner, .. } => inner.code(),
            _ => None,
        }
    }

    /// Whether this is the driver saying it has been shut down (`CUDA_ERROR_DEINITIALIZED`),
    /// as at process exit.
    pub fn is_deinitialized(&self) -> bool {
        self.code() == Some(CUresult::CUDA_ERROR_DEINITIALIZED)
    }

    /// Whether the driver can run no more work of the context: a sticky error (a kernel's fault,
    /// which the driver reports from then on), or a driver or context that is gone. Work queued
    /// before it will not run (on), so memory it used may be let go.
    pub(crate) fn ends_all_work(&self) -> bool {
        use CUresult as R;
        matches!(
            self.code(),
            Some(
                R::CUDA_ERROR_DEINITIALIZED
                    | R::CUDA_ERROR_NOT_INITIALIZED
                    | R::CUDA_ERROR_CONTEXT_IS_DESTROYED
                    | R::CUDA_ERROR_INVALID_CONTEXT
                    | R::CUDA_ERROR_ECC_UNCORRECTABLE
                    | R::CUDA_ERROR_ILLEGAL_ADDRESS
                    | R::CUDA_ERROR_LAUNCH_TIMEOUT
                    | R::CUDA_ERROR_ASSERT
                    | R::CUDA_ERROR_HARDWARE_STACK_ERROR
                    | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
                    | R::CUDA_ERROR_MISALIGNED_ADDRESS
                    | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
                    | R::CUDA_ERROR_INVALID_PC
                    | R::CUDA_ERROR_LAUNCH_FAILED
            )
        )
    }

    /// Whether the driver refused work on (or a question about) the legacy default stream
    /// because a blocking stream of its context captures (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`):
    /// the question leaves that capture intact, work there would invalidate it.
    pub(crate) fn is_implicit_capture(&self) -> bool {
        self.code() == Some(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    }

    /// Whether this is an out-of-memory error, from cudrv or from the driver.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. }) || self.code() == Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Whether the driver said the operation is not supported (`CUDA_ERROR_NOT_SUPPORTED`, 801) or
    /// cudrv did ([`Error::Unsupported`]).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported { .. }) || self.code() == Some(CUresult::CUDA_ERROR_NOT_SUPPORTED)
    }
}

impl From<cudrv_sys::LoadError> for Error {
    fn from(e: cudrv_sys::LoadError) -> Error {
        Error::DriverNotFound { attempts: e.attempts }
    }
}

impl From<cudrv_sys::MissingSymbol> for Error {
    fn from(e: cudrv_sys::MissingSymbol) -> Error {
        Error::MissingSymbol { name: e.name, driver_version: e.driver_version }
    }
}

/// The name and description of `code`: from the driver when it is loaded and knows the code,
/// else from cudrv-sys's tables ([`cudrv_sys::result_name`], [`cudrv_sys::result_description`]).
fn describe(code: CUresult) -> (String, String) {
    if let Some(pair) = cudrv_sys::Driver::loaded().and_then(|d| d.describe(code)) {
        return pair;
    }
    let name = cudrv_sys::result_name(code).unwrap_or("unknown CUresult");
    let description =
        cudrv_sys::result_description(code).unwrap_or("no description available (the driver could not be asked)");
    (name.to_string(), description.to_string())
}

/// Turns the result of a raw call into a `Result`.
#[inline]
pub(crate) fn check(call: &'static str, rc: std::result::Result<CUresult, cudrv_sys::MissingSymbol>) -> Result<()> {
    match rc {
        Ok(CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(Error::driver(call, code)),
        Err(missing) => Err(missing.into()),
    }
}

/// Turns the result of a query (`cuStreamQuery`, `cuEventQuery`) into whether the work is done:
/// `CUDA_ERROR_NOT_READY` is no error there, only "not yet".
#[inline]
pub(crate) fn check_done(
    call: &'static str,
    rc: std::result::Result<CUresult, cudrv_sys::MissingSymbol>,
) -> Result<bool> {
    match rc {
        Ok(CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
        other => check(call, other).map(|()| true),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_names_drop_only_a_version_suffix() {
        assert_eq!(base_name("cuMemAlloc_v2"), "cuMemAlloc");
        assert_eq!(base_name("cuGraphInstantiateWithFlags"), "cuGraphInstantiateWithFlags");
        assert_eq!(base_name("cuStreamGetCaptureInfo_v3"), "cuStreamGetCaptureInfo");
        assert_eq!(base_name("cuMemAlloc_v"), "cuMemAlloc_v");
        assert_eq!(base_name("cuMemAlloc_vx2"), "cuMemAlloc_vx2");
        assert_eq!(base_name("cu_v2_thing"), "cu_v2_thing");
        assert_eq!(base_name("_v10"), "");
    }

    #[test]
    fn check_maps_success_codes_and_missing_symbols() {
        assert!(check("cuInit", Ok(CUresult::CUDA_SUCCESS)).is_ok());
        let e = check("cuMemAlloc_v2", Ok(CUresult::CUDA_ERROR_OUT_OF_MEMORY)).unwrap_err();
        assert_eq!(e.code(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(e.is_out_of_memory());
        assert!(e.to_string().contains("cuMemAlloc"), "{e}");
        assert!(!e.to_string().contains("cuMemAlloc_v2"), "{e}");
        let missing = cudrv_sys::MissingSymbol { name: "cuGraphCreate", driver_version: 11010 };
        match check("cuGraphCreate", Err(missing)).unwrap_err() {
            Error::MissingSymbol { name, driver_version } => {
                assert_eq!((name, driver_version), ("cuGraphCreate", 11010))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn codes_are_named_without_a_driver() {
        let e = Error::driver("cuStreamSynchronize", CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        let text = e.to_string();
        assert!(text.contains("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"), "{text}");
        assert!(text.contains("operation not permitted when stream is capturing"), "{text}");
        let unknown = Error::driver("cuInit", CUresult(987_654));
        assert!(unknown.to_string().contains("unknown CUresult"), "{unknown}");
    }
}

//! Loading the driver library and resolving its functions lazily.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, Ordering};

use libloading::Library;

use crate::CUDA_HEADER_VERSION;
#[allow(clippy::wildcard_imports)]
use crate::types::*;

/// The environment variable that names the driver library to load, in place of the usual
/// candidates.
pub const DRIVER_PATH_VAR: &str = "CUDRV_DRIVER_PATH";

/// A slot that was looked up and not found. Function pointers are never 1.
const MISSING: usize = 1;

/// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`: the bindings name the default-stream (non-`_ptds`) forms,
/// so ask for those whatever the driver's default is.
const LEGACY_STREAM: cuuint64_t = 1;

/// One place the loader tried, and why it failed there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadAttempt {
    /// The file name or path handed to the OS loader.
    pub path: String,
    /// The OS loader's reason, or why the library is not a CUDA driver.
    pub reason: String,
}

/// No CUDA driver could be loaded. Lists every place that was tried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// Every attempt, in order.
    pub attempts: Vec<LoadAttempt>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no CUDA driver could be loaded; tried:")?;
        for a in &self.attempts {
            write!(f, "\n  - {}: {}", a.path, a.reason)?;
        }
        Ok(())
    }
}

impl std::error::Error for LoadError {}

/// A driver function that the loaded driver does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MissingSymbol {
    /// The function, as the bindings name it (`cuMemAllocAsync`, `cuMemAlloc_v2`).
    pub name: &'static str,
    /// The driver's version (`cuDriverGetVersion`), e.g. 12080.
    pub driver_version: i32,
}

impl fmt::Display for MissingSymbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the CUDA driver (version {}) does not provide {}", format_version(self.driver_version), self.name)
    }
}

impl std::error::Error for MissingSymbol {}

/// An error and its sources, as one line (libloading puts the OS's reason in the source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// `12080` → `12.8`.
fn format_version(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

/// What the table knows of one driver function.
#[derive(Debug)]
pub struct FunctionInfo {
    /// The declared name (`cuMemAlloc_v2`): also its exported symbol.
    pub name: &'static str,
    /// `name`, NUL-terminated.
    pub cname: &'static CStr,
    /// The name without the version suffix (`cuMemAlloc`): what `cuGetProcAddress` takes.
    pub base: &'static CStr,
    /// Whether `name` carries a `_vN` suffix.
    pub versioned: bool,
    /// Whether the declaration is the newest of its base name, so that `cuGetProcAddress` with the
    /// header's `CUDA_VERSION` returns exactly its ABI.
    pub by_proc_address: bool,
}

type GetProcV2 = unsafe extern "system" fn(
    *const c_char,
    *mut *mut c_void,
    c_int,
    cuuint64_t,
    *mut CUdriverProcAddressQueryResult,
) -> CUresult;
type GetProcV1 = unsafe extern "system" fn(*const c_char, *mut *mut c_void, c_int, cuuint64_t) -> CUresult;
type GetVersion = unsafe extern "system" fn(*mut c_int) -> CUresult;

#[derive(Clone, Copy)]
enum ProcAddress {
    V2(GetProcV2),
    V1(GetProcV1),
    Absent,
}

/// A loaded CUDA driver library and its lazily resolved function table.
///
/// Every driver function is a method named as in `cuda.h` after its version macro
/// (`cuMemAlloc_v2`, `cuStreamDestroy_v2`, `cuInit`, ...), returning
/// `Result<CUresult, MissingSymbol>`. The first call of a function resolves it; later calls cost
/// one atomic load. `Driver` is `Send + Sync`: the driver API is thread-safe and the table is
/// atomics.
///
/// The library stays loaded for the rest of the process, even after its `Driver` is dropped: a
/// CUDA driver runs threads of its own (started by `cuInit`, a stream, a host function) that go
/// on running its code after the calls that started them returned, so unloading it could pull
/// the code from under them.
pub struct Driver {
    // Never unloaded (see above); keeps the pointers in `slots` valid for the process's life.
    library: ManuallyDrop<Library>,
    library_path: String,
    version: i32,
    proc_address: ProcAddress,
    slots: Box<[AtomicPtr<c_void>; FUNCTION_COUNT]>,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("library_path", &self.library_path)
            .field("version", &self.version)
            .field("has_cuGetProcAddress", &!matches!(self.proc_address, ProcAddress::Absent))
            .finish()
    }
}

static GLOBAL: OnceLock<Result<Driver, LoadError>> = OnceLock::new();

impl Driver {
    /// The process-wide driver, loaded on first use with [`Driver::load`] and shared afterwards.
    /// A failure is kept too: every later call returns the same error.
    ///
    /// # Errors
    /// [`LoadError`], listing each path tried, when no driver could be loaded.
    pub fn global() -> Result<&'static Driver, LoadError> {
        GLOBAL.get_or_init(Driver::load).as_ref().map_err(Clone::clone)
    }

    /// Every function the bindings declare, as the loader resolves them (generated at build time
    /// from the bindings).
    pub fn functions() -> &'static [FunctionInfo] {
        &FUNCTIONS
    }

    /// The process-wide driver if [`Driver::global`] has loaded it; never loads it.
    pub fn loaded() -> Option<&'static Driver> {
        GLOBAL.get().and_then(|r| r.as_ref().ok())
    }

    /// The driver's own name and description of `code` (`cuGetErrorName`, `cuGetErrorString`),
    /// when it knows the code (both answer before `cuInit`).
    pub fn describe(&self, code: CUresult) -> Option<(String, String)> {
        let mut name = std::ptr::null();
        let mut desc = std::ptr::null();
        // SAFETY: both out-pointers are valid; the driver writes pointers to static strings.
        let ok = unsafe {
            self.cuGetErrorName(code, &mut name) == Ok(CUresult::CUDA_SUCCESS)
                && self.cuGetErrorString(code, &mut desc) == Ok(CUresult::CUDA_SUCCESS)
        };
        if !ok || name.is_null() || desc.is_null() {
            return None;
        }
        // SAFETY: on success both are NUL-terminated static strings owned by the driver.
        let (name, desc) = unsafe { (std::ffi::CStr::from_ptr(name), std::ffi::CStr::from_ptr(desc)) };
        Some((name.to_string_lossy().into_owned(), desc.to_string_lossy().into_owned()))
    }

    /// The candidate libraries, in order: the value of `CUDRV_DRIVER_PATH` alone when it is set;
    /// otherwise `libcuda.so.1`, `libcuda.so` and the WSL folder `/usr/lib/wsl/lib` on Linux, and
    /// `nvcuda.dll` (from the system folder) on Windows.
    pub fn candidates() -> Vec<PathBuf> {
        // Unset, empty and blank are the same: no override.
        if let Some(path) = std::env::var_os(DRIVER_PATH_VAR).filter(|p| !p.to_string_lossy().trim().is_empty()) {
            return vec![PathBuf::from(path)];
        }
        if cfg!(windows) {
            vec![PathBuf::from("nvcuda.dll")]
        } else if cfg!(target_os = "macos") {
            vec![PathBuf::from("libcuda.dylib")]
        } else {
            ["libcuda.so.1", "libcuda.so", "/usr/lib/wsl/lib/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so"]
                .into_iter()
                .map(PathBuf::from)
                .collect()
        }
    }

    /// Loads the first of [`Driver::candidates`] that opens and is a CUDA driver.
    ///
    /// # Errors
    /// [`LoadError`] with every candidate and the reason it failed.
    pub fn load() -> Result<Driver, LoadError> {
        let mut attempts = Vec::new();
        for candidate in Self::candidates() {
            match Self::open(&candidate) {
                Ok(driver) => return Ok(driver),
                Err(attempt) => attempts.push(attempt),
            }
        }
        Err(LoadError { attempts })
    }

    /// Loads the driver library at `path`.
    ///
    /// # Safety
    /// Opening a library runs its initialisers, and cudrv-sys then calls its `cuDriverGetVersion`
    /// and, later, any function the caller asks for, trusting each to have the signature and
    /// behaviour that `cuda.h` declares. `path` must name a CUDA driver library (or a faithful
    /// stand-in, such as an emulated driver for tests); anything else may do anything.
    /// ([`Driver::global`] and [`Driver::load`] load only the system's driver, or what the user
    /// named in `CUDRV_DRIVER_PATH`, and are safe for that reason.)
    ///
    /// # Errors
    /// [`LoadError`] with the one attempt when it cannot be opened or is not a CUDA driver.
    pub unsafe fn load_from(path: impl AsRef<Path>) -> Result<Driver, LoadError> {
        Self::open(path.as_ref()).map_err(|a| LoadError { attempts: vec![a] })
    }

    fn open(path: &Path) -> Result<Driver, LoadAttempt> {
        let shown = path.display().to_string();
        let fail = |reason: String| LoadAttempt { path: shown.clone(), reason };
        // SAFETY: opening a shared library runs its initialisers. A CUDA driver's initialisers are
        // sound to run in any process; a library named by CUDRV_DRIVER_PATH is the user's choice.
        let library = unsafe { open_library(path) }.map_err(|e| fail(error_chain(&e)))?;
        // SAFETY: the symbol is looked up with the type of cuDriverGetVersion from cuda.h.
        let get_version: GetVersion = unsafe { library.get::<GetVersion>(c"cuDriverGetVersion") }
            .map(|s| *s)
            .map_err(|e| fail(format!("not a CUDA driver: {}", error_chain(&e))))?;
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer; cuDriverGetVersion needs no cuInit.
        let rc = unsafe { get_version(&mut version) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(fail(format!("cuDriverGetVersion failed: {}", describe_with(&library, rc))));
        }
        // SAFETY: the two symbols are looked up with their cuda.h types (v2 adds symbolStatus).
        let proc_address = unsafe {
            if let Ok(s) = library.get::<GetProcV2>(c"cuGetProcAddress_v2") {
                ProcAddress::V2(*s)
            } else if let Ok(s) = library.get::<GetProcV1>(c"cuGetProcAddress") {
                ProcAddress::V1(*s)
            } else {
                ProcAddress::Absent
            }
        };
        Ok(Driver {
            library: ManuallyDrop::new(library),
            library_path: shown,
            version,
            proc_address,
            slots: Box::new(std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut()))),
        })
    }

    /// The driver's version as `cuDriverGetVersion` reports it (`13000` for 13.0).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The path or file name the library was loaded from.
    pub fn library_path(&self) -> &str {
        &self.library_path
    }

    /// Whether the driver has `cuGetProcAddress` (CUDA 11.3 and later).
    pub fn has_get_proc_address(&self) -> bool {
        !matches!(self.proc_address, ProcAddress::Absent)
    }

    /// Whether the driver has the function named `name` as the bindings declare it (for example
    /// `cuMemAllocAsync` or `cuMemAlloc_v2`). Resolves it if it was not yet. `false` for names
    /// the bindings do not know.
    pub fn has(&self, name: &str) -> bool {
        FUNCTIONS.iter().position(|f| f.name == name).is_some_and(|i| self.resolve(i).is_ok())
    }

    #[inline]
    fn resolve(&self, index: usize) -> Result<*mut c_void, MissingSymbol> {
        let p = self.slots[index].load(Ordering::Acquire);
        if p as usize > MISSING { Ok(p) } else { self.resolve_slow(index) }
    }

    #[cold]
    fn resolve_slow(&self, index: usize) -> Result<*mut c_void, MissingSymbol> {
        let info = &FUNCTIONS[index];
        let p = self.slots[index].load(Ordering::Acquire);
        let p = if p.is_null() {
            let found = self.lookup(info);
            let stored = if found.is_null() { MISSING as *mut c_void } else { found };
            // Two threads may race here; both store the same answer.
            self.slots[index].store(stored, Ordering::Release);
            stored
        } else {
            p
        };
        if p as usize == MISSING { Err(MissingSymbol { name: info.name, driver_version: self.version }) } else { Ok(p) }
    }

    /// Finds the function. `cuGetProcAddress` (with the header's version) is used for the newest
    /// declared variant of a name, when the driver is at least as new as the header or the name
    /// carries no version suffix: an older driver would hand back an older ABI for a suffixed
    /// name, so there only the exact exported symbol will do.
    fn lookup(&self, info: &FunctionInfo) -> *mut c_void {
        let trust_proc = info.by_proc_address && (!info.versioned || self.version >= CUDA_HEADER_VERSION);
        if trust_proc {
            let p = self.proc_address(info.base);
            if !p.is_null() {
                return p;
            }
        }
        // SAFETY: the pointer is only read out as an untyped address here.
        unsafe { self.library.get::<*mut c_void>(info.cname) }.map_or(ptr::null_mut(), |s| *s)
    }

    fn proc_address(&self, base: &CStr) -> *mut c_void {
        let mut p: *mut c_void = ptr::null_mut();
        let rc = match self.proc_address {
            ProcAddress::V2(get) => {
                let mut status = CUdriverProcAddressQueryResult(0);
                // SAFETY: valid NUL-terminated name and out-pointers, as cuGetProcAddress_v2 takes.
                let rc = unsafe { get(base.as_ptr(), &mut p, CUDA_HEADER_VERSION, LEGACY_STREAM, &mut status) };
                if status.0 != 0 {
                    return ptr::null_mut();
                }
                rc
            }
            // SAFETY: valid NUL-terminated name and out-pointer, as cuGetProcAddress takes.
            ProcAddress::V1(get) => unsafe { get(base.as_ptr(), &mut p, CUDA_HEADER_VERSION, LEGACY_STREAM) },
            ProcAddress::Absent => return ptr::null_mut(),
        };
        if rc == CUresult::CUDA_SUCCESS { p } else { ptr::null_mut() }
    }
}

/// `code` as the library itself describes it (`cuGetErrorName`, `cuGetErrorString`, which work
/// before `cuInit`), for a library that failed before cudrv could use it; else its number.
fn describe_with(library: &Library, code: CUresult) -> String {
    type Describe = unsafe extern "system" fn(CUresult, *mut *const c_char) -> CUresult;
    let ask = |symbol: &CStr| -> Option<String> {
        // SAFETY: looked up with the type cuda.h gives both functions.
        let f: Describe = unsafe { library.get::<Describe>(symbol.to_bytes_with_nul()) }.ok().map(|s| *s)?;
        let mut text: *const c_char = ptr::null();
        // SAFETY: a valid out-pointer; on success the driver writes a static NUL-terminated string.
        let rc = unsafe { f(code, &mut text) };
        // SAFETY: as above.
        (rc == CUresult::CUDA_SUCCESS && !text.is_null())
            .then(|| unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
    };
    match (ask(c"cuGetErrorName"), ask(c"cuGetErrorString")) {
        (Some(name), Some(text)) => format!("{name} ({}): {text}", code.0),
        _ => format!("code {}", code.0),
    }
}

/// Opens the library. On Windows the search is restricted to the system folder (where the driver
/// installs `nvcuda.dll`) for a bare name, and to the named file's folder plus the system folder
/// for a path: never the current directory, so a planted DLL there is not picked up.
///
/// # Safety
/// Runs the library's initialisers.
#[cfg(windows)]
unsafe fn open_library(path: &Path) -> Result<Library, libloading::Error> {
    use libloading::os::windows as w;
    let flags = if path.components().count() > 1 || path.is_absolute() {
        w::LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR | w::LOAD_LIBRARY_SEARCH_SYSTEM32
    } else {
        w::LOAD_LIBRARY_SEARCH_SYSTEM32
    };
    let path = if flags & w::LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR != 0 {
        std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
    } else {
        path.to_path_buf()
    };
    // SAFETY: forwarded to the caller.
    unsafe { w::Library::load_with_flags(path, flags) }.map(Library::from)
}

/// Opens the library with the platform's default search (`dlopen`).
///
/// # Safety
/// Runs the library's initialisers.
#[cfg(not(windows))]
unsafe fn open_library(path: &Path) -> Result<Library, libloading::Error> {
    // SAFETY: forwarded to the caller.
    unsafe { Library::new(path) }
}

include!(concat!(env!("OUT_DIR"), "/functions.rs"));

/// The driver's description of the codes a caller meets most (`cuGetErrorString`'s text), for when
/// the driver cannot be asked (it is not loaded, or has shut down); `None` for the others.
pub fn result_description(code: CUresult) -> Option<&'static str> {
    DESCRIPTIONS.iter().find(|(c, _)| *c == code).map(|(_, d)| *d)
}

const DESCRIPTIONS: &[(CUresult, &str)] = &[
    (CUresult::CUDA_SUCCESS, "no error"),
    (CUresult::CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    (CUresult::CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    (CUresult::CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    (CUresult::CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    (CUresult::CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    (CUresult::CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    (CUresult::CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
    (CUresult::CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    (CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU, "no kernel image is available for execution on the device"),
    (CUresult::CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed"),
    (CUresult::CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    (CUresult::CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    (CUresult::CUDA_ERROR_NOT_READY, "device not ready"),
    (CUresult::CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    (CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch"),
    (CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"),
    (CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"),
    (CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices"),
    (CUresult::CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    (CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"),
    (CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture"),
    (CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "system has unsupported display driver / cuda driver combination"),
    (CUresult::CUDA_ERROR_UNKNOWN, "unknown error"),
];

//! Modules (loaded PTX, cubin or fatbin images), the kernels in them, the driver's JIT options
//! and linker, and context-independent libraries.
//!
//! ```
//! # if !cudrv::__doctest_driver() { return Ok(()); }
//! use cudrv::{Device, Stream, launch::LaunchConfig, memory::DeviceBuffer, module::Module};
//! let device = Device::get(0)?;
//! let module = Module::from_ptx(&device, include_str!("../examples/kernels/vector_add.ptx"))?;
//! let fill = module.function("fill_u32")?;
//! let stream = Stream::new(&device)?;
//! let mut out = DeviceBuffer::<u32>::zeroed(1000, &stream)?;
//! // SAFETY: fill_u32 takes (u32* out, u32 value, u64 n) and writes out[0..n].
//! unsafe { fill.launch(LaunchConfig::for_num_elems(1000), &stream, (&mut out, 7u32, 1000u64))? };
//! assert_eq!(out.to_vec()?, vec![7; 1000]);
//! # Ok::<(), cudrv::Error>(())
//! ```
//!
//! # Loading
//!
//! Every image is loaded with `cuModuleLoadDataEx` and JIT options that collect the compiler's
//! error and information logs (`CU_JIT_ERROR_LOG_BUFFER`, `CU_JIT_INFO_LOG_BUFFER`). A failure that
//! left something in the error log is [`Error::Jit`], whose `log` says where and why (ptxas's
//! messages for PTX); a failure with an empty log is the plain [`Error::Driver`].
//!
//! The `*_with` constructors ([`Module::from_ptx_with`], ...) take [`JitConfig`]: the most
//! registers per thread, the optimisation level, the target architecture, whether the driver
//! prefers PTX or a binary from a fatbin, line information for profilers, the cache mode of global
//! loads, and the size of the logs.
//!
//! # Linking
//!
//! [`Linker`] drives the driver's linker (`cuLinkCreate`, `cuLinkAddData`, `cuLinkAddFile`,
//! `cuLinkComplete`): it compiles and links several PTX, cubin, fatbin, object or library inputs
//! (separate compilation, `nvcc -rdc=true`) into one image, and loads it as a [`Module`] or hands
//! the cubin back.
//!
//! # Context-independent libraries
//!
//! CUDA 12.0 added *context-independent* loading (`cuLibraryLoadData`, `CUlibrary`, `CUkernel`):
//! one [`Library`] serves every device, and is loaded into a device's context when a [`Kernel`]
//! of it is first asked for there ([`Kernel::function`], which gives a [`Function`] that launches
//! as any other). [`Module`] loads into one device's context with `cuModuleLoadDataEx`, which works
//! on every driver cudrv supports (CUDA 11.x included); a [`Library`] needs a driver of CUDA 12.0 or
//! newer (older ones give [`Error::MissingSymbol`]) and headers of 12.0 or newer.
//!
//! # Lifetimes
//!
//! A [`Module`] holds its device's [`Context`]; a [`Function`] holds its module (or library), so a
//! function stays usable after the `Module` value is dropped, and the module is unloaded when the
//! last of them goes (`cuModuleUnload`; an error there goes to the context's deferred errors, see
//! [`crate::set_drop_error_hook`]). Likewise a [`Library`] is unloaded (`cuLibraryUnload`) when
//! the last [`Library`], [`Kernel`] and [`Function`] of it are gone.
//!
//! A launch queued on a stream does not keep its module (a graph does keep the modules of its
//! kernels): `cuModuleUnload` itself waits until the module's kernels, running or still queued,
//! are done. The driver's documentation does not say so; `scripts/module-unload-wait.py` measured
//! it on the H200 with driver 580 (BENCHMARKS.md, runs 52 and 53), and `cuLibraryUnload` the same
//! way for a library's kernels (run 69, on an H100). So dropping the last [`Function`] of a
//! module or library right after a launch blocks until that launch has run.

use std::ffi::{CStr, CString, c_void};
use std::fmt;
use std::path::Path;
use std::sync::Arc;
#[cfg(cuda_12000)]
use std::sync::Mutex;
use std::time::Duration;

use cudrv_sys::{
    CUdevice_attribute as DA, CUfunction, CUfunction_attribute as FA, CUjit_option, CUjitInputType, CUlinkState,
    CUmodule,
};

use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::check;
use crate::error::{Error, Result};
use crate::result::{driver, drv};
use crate::stream::Stream;

/// Bytes reserved for each JIT log.
const LOG_SIZE: usize = 16 * 1024;

/// The ELF magic of a cubin.
const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
/// The magic of a fatbin (`fatBinaryHeader::magic`), little-endian.
const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// A target architecture for the JIT compiler (`CU_JIT_TARGET`): a compute capability, or its
/// architecture-specific variant (`compute_90a`, whose code runs only on that architecture).
///
/// ```
/// use cudrv::module::JitTarget;
/// assert_eq!(JitTarget::compute(9, 0).to_string(), "compute_90");
/// assert_eq!(JitTarget::arch_specific(9, 0).to_string(), "compute_90a");
/// assert_eq!(JitTarget::compute(8, 6).as_raw(), 86);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct JitTarget {
    // As given: `major * 10 + minor` could overflow, or (with a minor above 9) name another
    // target; `check` refuses what is not a compute capability before the driver sees it.
    major: u32,
    minor: u32,
    arch_specific: bool,
}

/// The bit that marks an architecture-specific target (`CU_TARGET_COMPUTE_90A` is 90 plus this).
const ARCH_SPECIFIC: u32 = 1 << 16;

impl JitTarget {
    /// Compute capability `major.minor` (`CU_TARGET_COMPUTE_<major><minor>`).
    pub const fn compute(major: u32, minor: u32) -> JitTarget {
        JitTarget { major, minor, arch_specific: false }
    }

    /// The architecture-specific variant of `major.minor` (`CU_TARGET_COMPUTE_<major><minor>A`),
    /// which allows architecture-specific instructions (`wgmma` on 9.0).
    pub const fn arch_specific(major: u32, minor: u32) -> JitTarget {
        JitTarget { major, minor, arch_specific: true }
    }

    /// The target of a device's compute capability.
    ///
    /// # Errors
    /// The driver's error.
    pub fn of_device(device: &Device) -> Result<JitTarget> {
        let (major, minor) = device.compute_capability()?;
        Ok(JitTarget::compute(u32::try_from(major).unwrap_or(0), u32::try_from(minor).unwrap_or(0)))
    }

    /// The `CUjit_target` value. Meaningful for a compute capability (a major of 3 to 99, a minor
    /// of 0 to 9), the only targets cudrv hands the driver; for others it is only a number.
    pub const fn as_raw(&self) -> u32 {
        let arch = if self.arch_specific { ARCH_SPECIFIC } else { 0 };
        arch.wrapping_add(self.major.wrapping_mul(10)).wrapping_add(self.minor)
    }

    /// The compute capability as (major, minor), as given.
    pub const fn compute_capability(&self) -> (u32, u32) {
        (self.major, self.minor)
    }

    fn check(&self) -> Result<()> {
        if (3..=99).contains(&self.major) && self.minor <= 9 {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "JIT target {self} is not a compute capability (major {}, minor {}: a major of 3 to 99 and a minor \
                 of 0 to 9)",
                self.major, self.minor
            )))
        }
    }
}

impl fmt::Display for JitTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let suffix = if self.arch_specific { "a" } else { "" };
        write!(f, "compute_{}{}{suffix}", self.major, self.minor)
    }
}

/// What the driver loads from a fatbin that holds both PTX and a matching binary
/// (`CU_JIT_FALLBACK_STRATEGY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JitFallback {
    /// Compile the PTX (`CU_PREFER_PTX`).
    PreferPtx,
    /// Use the binary when one matches the device (`CU_PREFER_BINARY`).
    PreferBinary,
}

/// How global loads of the compiled code use the caches (`CU_JIT_CACHE_MODE`, ptxas `-dlcm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JitCacheMode {
    /// The compiler's default (`CU_JIT_CACHE_OPTION_NONE`).
    Default,
    /// Cache in L2 only, not in L1 (`CU_JIT_CACHE_OPTION_CG`, `-dlcm=cg`).
    L2Only,
    /// Cache in L1 and L2 (`CU_JIT_CACHE_OPTION_CA`, `-dlcm=ca`).
    L1AndL2,
}

/// Options of the driver's JIT compiler and linker, for [`Module::from_ptx_with`] and the other
/// `*_with` constructors, [`Linker::new`] and [`Library::from_ptx_with`].
///
/// Every option left at its default is not passed, so the driver's own default applies. The
/// information and error logs are always collected (up to [`JitConfig::log_size`] bytes each):
/// [`Module::info_log`], and the `log` of [`Error::Jit`].
///
/// ```
/// use cudrv::module::{JitCacheMode, JitConfig, JitTarget};
/// let options = JitConfig::new()
///     .max_registers(64)
///     .optimization_level(3)
///     .target(JitTarget::compute(9, 0))
///     .line_info(true)
///     .cache_mode(JitCacheMode::L2Only);
/// assert_eq!(options.max_registers, Some(64));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct JitConfig {
    /// The most registers a thread may use (`CU_JIT_MAX_REGISTERS`, ptxas `--maxrregcount`).
    pub max_registers: Option<u32>,
    /// The optimisation level, 0 to 4 (`CU_JIT_OPTIMIZATION_LEVEL`; the driver's default is 4).
    pub optimization_level: Option<u32>,
    /// The architecture to compile for (`CU_JIT_TARGET`); by default the context's device's.
    pub target: Option<JitTarget>,
    /// PTX or binary, when a fatbin has both (`CU_JIT_FALLBACK_STRATEGY`).
    pub fallback: Option<JitFallback>,
    /// Line information for profilers and debuggers (`CU_JIT_GENERATE_LINE_INFO`, `-lineinfo`).
    pub line_info: bool,
    /// Full debug information (`CU_JIT_GENERATE_DEBUG_INFO`, `-G`): slow code, for debuggers.
    pub debug_info: bool,
    /// The cache mode of global loads (`CU_JIT_CACHE_MODE`).
    pub cache_mode: Option<JitCacheMode>,
    /// Ask for a verbose information log (`CU_JIT_LOG_VERBOSE`; registers and memory per
    /// kernel). On by default.
    pub log_verbose: bool,
    /// Bytes reserved for each log (16 KiB by default). Longer logs are cut.
    pub log_size: usize,
}

impl Default for JitConfig {
    fn default() -> Self {
        JitConfig {
            max_registers: None,
            optimization_level: None,
            target: None,
            fallback: None,
            line_info: false,
            debug_info: false,
            cache_mode: None,
            log_verbose: true,
            log_size: LOG_SIZE,
        }
    }
}

impl JitConfig {
    /// The defaults: nothing but the logs (verbose, 16 KiB each).
    pub fn new() -> JitConfig {
        JitConfig::default()
    }

    /// With at most `registers` registers per thread (at least 1).
    pub fn max_registers(self, registers: u32) -> JitConfig {
        JitConfig { max_registers: Some(registers), ..self }
    }

    /// With optimisation level `level` (0 to 4).
    pub fn optimization_level(self, level: u32) -> JitConfig {
        JitConfig { optimization_level: Some(level), ..self }
    }

    /// Compiling for `target` instead of the context's device.
    pub fn target(self, target: JitTarget) -> JitConfig {
        JitConfig { target: Some(target), ..self }
    }

    /// With a fallback strategy for fatbins.
    pub fn fallback(self, fallback: JitFallback) -> JitConfig {
        JitConfig { fallback: Some(fallback), ..self }
    }

    /// With or without line information.
    pub fn line_info(self, on: bool) -> JitConfig {
        JitConfig { line_info: on, ..self }
    }

    /// With or without full debug information.
    pub fn debug_info(self, on: bool) -> JitConfig {
        JitConfig { debug_info: on, ..self }
    }

    /// With a cache mode for global loads.
    pub fn cache_mode(self, mode: JitCacheMode) -> JitConfig {
        JitConfig { cache_mode: Some(mode), ..self }
    }

    /// With a verbose information log, or a terse one.
    pub fn log_verbose(self, on: bool) -> JitConfig {
        JitConfig { log_verbose: on, ..self }
    }

    /// With `bytes` reserved for each log (at least 1).
    pub fn log_size(self, bytes: usize) -> JitConfig {
        JitConfig { log_size: bytes, ..self }
    }

    /// Checks every value before the driver sees it.
    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("JIT options: {why}")));
        if let Some(r) = self.max_registers
            && !(1..=255).contains(&r)
        {
            return bad(format!("max_registers is {r}; a thread may have 1 to 255 registers"));
        }
        if let Some(level) = self.optimization_level
            && level > 4
        {
            return bad(format!("optimization_level is {level}; the levels are 0 to 4"));
        }
        if let Some(t) = self.target {
            t.check()?;
        }
        if self.log_size == 0 || self.log_size > u32::MAX as usize {
            return bad(format!("log_size is {}; it must be 1 to 2^32 - 1 bytes", self.log_size));
        }
        Ok(())
    }
}

/// The option and value arrays of one JIT call, and the log buffers they point into. All of it is
/// on the heap, so moving this value keeps valid every pointer the driver was given (the linker
/// keeps them until `cuLinkDestroy`).
#[derive(Default)]
struct JitCall {
    options: Vec<CUjit_option>,
    values: Vec<*mut c_void>,
    error_log: Vec<u8>,
    info_log: Vec<u8>,
}

// SAFETY: the raw pointers point into the buffers this value owns; nothing else aliases them
// once the driver call that wrote them has returned.
unsafe impl Send for JitCall {}
// SAFETY: as above; `&JitCall` only reads.
unsafe impl Sync for JitCall {}

/// Where the log sizes and the wall time are, in every [`JitCall`]'s arrays.
const ERROR_SIZE_AT: usize = 1;
const INFO_SIZE_AT: usize = 3;
const WALL_TIME_AT: usize = 4;

impl JitCall {
    /// The arrays for `opts` (checked first).
    fn new(opts: &JitConfig) -> Result<JitCall> {
        opts.check()?;
        let mut call = JitCall {
            options: Vec::with_capacity(12),
            values: Vec::with_capacity(12),
            error_log: vec![0u8; opts.log_size],
            info_log: vec![0u8; opts.log_size],
        };
        let error_ptr = call.error_log.as_mut_ptr().cast();
        let info_ptr = call.info_log.as_mut_ptr().cast();
        // Sizes, numbers and flags travel in the pointer-sized slots themselves, as the driver
        // API wants.
        let word = std::ptr::without_provenance_mut::<c_void>;
        call.push(CUjit_option::CU_JIT_ERROR_LOG_BUFFER, error_ptr);
        call.push(CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, word(opts.log_size));
        call.push(CUjit_option::CU_JIT_INFO_LOG_BUFFER, info_ptr);
        call.push(CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, word(opts.log_size));
        call.push(CUjit_option::CU_JIT_WALL_TIME, std::ptr::null_mut());
        call.push(CUjit_option::CU_JIT_LOG_VERBOSE, word(usize::from(opts.log_verbose)));
        if let Some(r) = opts.max_registers {
            call.push(CUjit_option::CU_JIT_MAX_REGISTERS, word(r as usize));
        }
        if let Some(level) = opts.optimization_level {
            call.push(CUjit_option::CU_JIT_OPTIMIZATION_LEVEL, word(level as usize));
        }
        if let Some(t) = opts.target {
            call.push(CUjit_option::CU_JIT_TARGET, word(t.as_raw() as usize));
        }
        if let Some(f) = opts.fallback {
            let v = match f {
                JitFallback::PreferPtx => cudrv_sys::CUjit_fallback::CU_PREFER_PTX.0,
                JitFallback::PreferBinary => cudrv_sys::CUjit_fallback::CU_PREFER_BINARY.0,
            };
            call.push(CUjit_option::CU_JIT_FALLBACK_STRATEGY, word(v as usize));
        }
        if opts.line_info {
            call.push(CUjit_option::CU_JIT_GENERATE_LINE_INFO, word(1));
        }
        if opts.debug_info {
            call.push(CUjit_option::CU_JIT_GENERATE_DEBUG_INFO, word(1));
        }
        if let Some(m) = opts.cache_mode {
            let v = match m {
                JitCacheMode::Default => cudrv_sys::CUjit_cacheMode::CU_JIT_CACHE_OPTION_NONE.0,
                JitCacheMode::L2Only => cudrv_sys::CUjit_cacheMode::CU_JIT_CACHE_OPTION_CG.0,
                JitCacheMode::L1AndL2 => cudrv_sys::CUjit_cacheMode::CU_JIT_CACHE_OPTION_CA.0,
            };
            call.push(CUjit_option::CU_JIT_CACHE_MODE, word(v as usize));
        }
        Ok(call)
    }

    fn push(&mut self, option: CUjit_option, value: *mut c_void) {
        self.options.push(option);
        self.values.push(value);
    }

    fn len(&self) -> u32 {
        self.options.len() as u32
    }

    /// Gives the log size slots the buffers' sizes again: a driver writes the used sizes there,
    /// and the linker's later calls write the logs through the same arrays.
    fn reset_log_sizes(&mut self) {
        let word = std::ptr::without_provenance_mut::<c_void>;
        self.values[ERROR_SIZE_AT] = word(self.error_log.len());
        self.values[INFO_SIZE_AT] = word(self.info_log.len());
    }

    /// The error log, as far as the driver wrote it.
    fn error_text(&self) -> String {
        log_text(&self.error_log, self.values[ERROR_SIZE_AT] as usize)
    }

    /// The information log, as far as the driver wrote it.
    fn info_text(&self) -> String {
        log_text(&self.info_log, self.values[INFO_SIZE_AT] as usize)
    }

    /// The compiler's and linker's wall time, which the driver writes as a `float` of milliseconds
    /// into the first bytes of the option's slot (`None` when it wrote nothing).
    fn wall_time(&self) -> Option<Duration> {
        // SAFETY: the slot is a pointer-sized, pointer-aligned value, at least as large and as
        // aligned as an f32; every bit pattern is a valid f32.
        let ms = unsafe { self.values.as_ptr().add(WALL_TIME_AT).cast::<f32>().read() };
        // A huge answer is no compile time either (`from_secs_f64` would panic).
        (ms.is_finite() && ms > 0.0).then(|| Duration::try_from_secs_f64(f64::from(ms) / 1e3).ok()).flatten()
    }

    /// `e` as an [`Error::Jit`] when the error log says something.
    fn error(&self, e: Error) -> Error {
        let log = self.error_text();
        match e {
            e @ Error::Driver { .. } if !log.is_empty() => Error::Jit { source: Box::new(e), log },
            e => e,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Something that names the context a module is loaded into: a [`Device`] (its primary context),
/// a [`Context`], an `Arc<Context>` or a [`Stream`] (its context).
pub trait ModuleTarget: sealed::Sealed {
    /// The context.
    ///
    /// # Errors
    /// The driver's error when the primary context must be retained.
    fn module_context(&self) -> Result<Arc<Context>>;
}

impl sealed::Sealed for Device {}
impl ModuleTarget for Device {
    fn module_context(&self) -> Result<Arc<Context>> {
        self.primary_context()
    }
}

impl sealed::Sealed for Context {}
impl ModuleTarget for Context {
    fn module_context(&self) -> Result<Arc<Context>> {
        // The primary context is shared: while `self` lives this returns the same `Arc`.
        self.device().primary_context()
    }
}

impl sealed::Sealed for Arc<Context> {}
impl ModuleTarget for Arc<Context> {
    fn module_context(&self) -> Result<Arc<Context>> {
        Ok(self.clone())
    }
}

impl sealed::Sealed for Stream {}
impl ModuleTarget for Stream {
    fn module_context(&self) -> Result<Arc<Context>> {
        Ok(self.context().clone())
    }
}

/// The limits of a device that a launch is checked against, read once per module.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceLimits {
    pub(crate) max_threads_per_block: u32,
    pub(crate) max_block: [u32; 3],
    pub(crate) max_grid: [u32; 3],
    /// Shared memory a block gets without opting in (48 KiB).
    pub(crate) shared_per_block: u32,
    /// Shared memory a block may opt in to (0 read as `shared_per_block`).
    pub(crate) shared_per_block_optin: u32,
    pub(crate) multiprocessors: u32,
}

impl DeviceLimits {
    fn read(device: &Device) -> Result<DeviceLimits> {
        let u = |v: i32| u32::try_from(v).unwrap_or(0);
        let block = device.max_block_dim()?;
        let grid = device.max_grid_dim()?;
        let shared = u(device.attribute(DA::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?);
        let optin = u(device.max_shared_memory_per_block_optin()?);
        Ok(DeviceLimits {
            max_threads_per_block: u(device.max_threads_per_block()?),
            max_block: block.map(u),
            max_grid: grid.map(u),
            shared_per_block: shared,
            shared_per_block_optin: optin.max(shared),
            multiprocessors: u(device.multiprocessor_count()?),
        })
    }
}

pub(crate) struct ModuleInner {
    raw: CUmodule,
    ctx: Arc<Context>,
    pub(crate) limits: DeviceLimits,
    info_log: String,
    compile_time: Option<Duration>,
    /// What unloads the code: the module itself, or (for a library's kernels) the library.
    owner: Owner,
}

/// Who owns the code behind a [`ModuleInner`].
enum Owner {
    /// A module cudrv loaded: unloaded with the last reference.
    Module,
    /// A library's code in this context, unloaded with the library.
    #[cfg(cuda_12000)]
    Library(#[allow(dead_code)] Arc<LibraryInner>),
}

// SAFETY: a CUmodule is a driver handle that any thread may use (the driver API is thread-safe);
// cudrv makes the module's context current before each use. The Rust fields are immutable.
unsafe impl Send for ModuleInner {}
// SAFETY: as above; all access is through `&self` and thread-safe driver calls.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if !matches!(self.owner, Owner::Module) {
            // A library's: its `Arc` goes with this value, and the library unloads itself.
            return;
        }
        let raw = crate::host_fn::SendHandle(self.raw);
        crate::context::drop_call(self.ctx.clone(), move || {
            // SAFETY: the module was loaded by cudrv into this context (current) and is unloaded
            // once, here; no Function refers to it any more (each holds this value).
            unsafe { drv!(cuModuleUnload(raw.get())) }
        });
    }
}

/// A loaded module: PTX compiled by the driver's JIT, or a cubin or fatbin.
///
/// `Module` is `Send + Sync` and cheap to clone (clones share the module). See the
/// [module documentation](self) for how loading reports errors.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Module};
/// let module = Module::from_ptx(&Device::get(0)?, include_str!("../examples/kernels/vector_add.ptx"))?;
/// let fill = module.function("fill_u32")?;
/// assert_eq!(fill.name(), "fill_u32");
/// assert!(module.function("no_such_kernel").is_err());
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

impl Module {
    /// Loads PTX text, compiled for the device by the driver's JIT.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the text contains a NUL byte (nothing is loaded);
    /// [`Error::Jit`] with the JIT's error log when compilation fails; the driver's error.
    pub fn from_ptx(target: &impl ModuleTarget, ptx: &str) -> Result<Module> {
        Self::from_ptx_with(target, ptx, &JitConfig::default())
    }

    /// Loads PTX text with JIT `options`.
    ///
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
    /// use cudrv::{Device, module::{JitConfig, Module}};
    /// let device = Device::get(0)?;
    /// let ptx = include_str!("../examples/kernels/vector_add.ptx");
    /// let module = Module::from_ptx_with(&device, ptx, &JitConfig::new().max_registers(32).line_info(true))?;
    /// assert!(module.function("add_f32")?.attributes()?.num_registers <= 32);
    /// println!("compiled in {:?}:\n{}", module.compile_time(), module.info_log());
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Module::from_ptx`], and [`Error::InvalidArgument`] for an option out of range.
    pub fn from_ptx_with(target: &impl ModuleTarget, ptx: &str, options: &JitConfig) -> Result<Module> {
        let text = ptx_cstring(ptx)?;
        // SAFETY: a NUL-terminated string, alive during the call.
        unsafe { Self::load(target.module_context()?, text.as_ptr().cast(), options) }
    }

    /// Loads a cubin (an ELF image built for the device's architecture, as `nvcc -cubin` makes).
    ///
    /// cudrv checks that the image is a 64-bit little-endian ELF file whose headers, sections and
    /// segments lie within `image` (the driver takes no length and trusts the offsets in the image).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for something that is not such an ELF image; [`Error::Jit`] or the
    /// driver's error when the driver refuses it (`CUDA_ERROR_NO_BINARY_FOR_GPU` for another
    /// architecture).
    pub fn from_cubin(target: &impl ModuleTarget, image: &[u8]) -> Result<Module> {
        Self::from_cubin_with(target, image, &JitConfig::default())
    }

    /// Loads a cubin with JIT `options` (which matter for the logs only: a cubin is not compiled).
    ///
    /// # Errors
    /// As [`Module::from_cubin`].
    pub fn from_cubin_with(target: &impl ModuleTarget, image: &[u8], options: &JitConfig) -> Result<Module> {
        elf_extent(image)?;
        let copy = aligned_copy(image);
        // SAFETY: a complete ELF image (checked above) in an 8-byte-aligned buffer alive during
        // the call.
        unsafe { Self::load(target.module_context()?, copy.as_ptr().cast(), options) }
    }

    /// Loads a fatbin (`nvcc -fatbin`): the driver picks the cubin for the device, or JIT-compiles
    /// the PTX in it.
    ///
    /// cudrv checks the fatbin header (magic `0xBA55ED50`) and that the size it declares lies within
    /// `image`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for something that is not a fatbin; [`Error::Jit`] or the driver's
    /// error when the driver refuses it.
    pub fn from_fatbin(target: &impl ModuleTarget, image: &[u8]) -> Result<Module> {
        Self::from_fatbin_with(target, image, &JitConfig::default())
    }

    /// Loads a fatbin with JIT `options` ([`JitConfig::fallback`] chooses between its PTX and its
    /// binaries).
    ///
    /// # Errors
    /// As [`Module::from_fatbin`].
    pub fn from_fatbin_with(target: &impl ModuleTarget, image: &[u8], options: &JitConfig) -> Result<Module> {
        fatbin_extent(image)?;
        let copy = aligned_copy(image);
        // SAFETY: a complete fatbin (checked above) in an 8-byte-aligned buffer alive during the
        // call.
        unsafe { Self::load(target.module_context()?, copy.as_ptr().cast(), options) }
    }

    /// Loads a file: a cubin when it starts with the ELF magic, a fatbin when it starts with the
    /// fatbin magic, PTX text otherwise.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the file cannot be read (with the path and the OS's reason)
    /// or is none of the three; as the `from_*` function for its kind.
    pub fn from_file(target: &impl ModuleTarget, path: impl AsRef<Path>) -> Result<Module> {
        Self::from_file_with(target, path, &JitConfig::default())
    }

    /// Loads a file with JIT `options`.
    ///
    /// # Errors
    /// As [`Module::from_file`].
    pub fn from_file_with(target: &impl ModuleTarget, path: impl AsRef<Path>, options: &JitConfig) -> Result<Module> {
        match read_image(path.as_ref())? {
            Image::Cubin(bytes) => Self::from_cubin_with(target, &bytes, options),
            Image::Fatbin(bytes) => Self::from_fatbin_with(target, &bytes, options),
            Image::Ptx(text) => Self::from_ptx_with(target, &text, options),
        }
    }

    /// Loads `image` into `ctx` with `options` and the JIT log options.
    ///
    /// # Safety
    /// `image` must point to a complete PTX (NUL-terminated), cubin or fatbin image that stays
    /// valid during the call.
    unsafe fn load(ctx: Arc<Context>, image: *const c_void, options: &JitConfig) -> Result<Module> {
        let mut jit = JitCall::new(options)?;
        let limits = DeviceLimits::read(&ctx.device())?;
        let _b = ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; `image` is valid (the caller's promise); the option
        // arrays have `jit.len()` entries each; the log buffers outlive the call; the context is
        // current.
        let rc = unsafe {
            driver()?.cuModuleLoadDataEx(&mut raw, image, jit.len(), jit.options.as_mut_ptr(), jit.values.as_mut_ptr())
        };
        drop(_b);
        check("cuModuleLoadDataEx", rc).map_err(|e| jit.error(e))?;
        let inner = ModuleInner {
            raw,
            ctx,
            limits,
            info_log: jit.info_text(),
            compile_time: jit.wall_time(),
            owner: Owner::Module,
        };
        Ok(Module { inner: Arc::new(inner) })
    }

    /// The kernel (`.entry`) named `name`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the function when the module has no such kernel (the
    /// driver's `CUDA_ERROR_NOT_FOUND`) or when the name contains a NUL byte; the driver's error.
    pub fn function(&self, name: &str) -> Result<Function> {
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("function name {name:?} contains a NUL byte")))?;
        let _b = self.inner.ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer, a live module, a NUL-terminated name; the context is current.
        match unsafe { drv!(cuModuleGetFunction(&mut raw, self.inner.raw, cname.as_ptr())) } {
            Ok(()) => {}
            Err(e) if e.code() == Some(cudrv_sys::CUresult::CUDA_ERROR_NOT_FOUND) => {
                return Err(Error::InvalidArgument(format!(
                    "the module has no kernel named {name:?} (cuModuleGetFunction: CUDA_ERROR_NOT_FOUND); \
                     kernels are `.entry` functions (extern \"C\" __global__ in CUDA C++, else the name is mangled)"
                )));
            }
            Err(e) => return Err(e),
        }
        Function::from_raw(raw, self.inner.clone(), name)
    }

    /// The JIT's information log of the load (`CU_JIT_INFO_LOG_BUFFER`, asked for with
    /// `CU_JIT_LOG_VERBOSE`). Often empty: drivers write little there, and nothing for images that
    /// needed no compilation. [`Function::attributes`] has the registers and memory per kernel.
    pub fn info_log(&self) -> &str {
        &self.inner.info_log
    }

    /// How long the driver's JIT compiler (and linker, for [`Linker::complete`]) took, as the
    /// driver reports it (`CU_JIT_WALL_TIME`); `None` when it reported nothing (images that needed
    /// no compilation).
    pub fn compile_time(&self) -> Option<Duration> {
        self.inner.compile_time
    }

    /// The context the module is loaded into.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.inner.ctx.device()
    }

    /// The raw `CUmodule` (valid while this value or a [`Function`] of it lives).
    pub fn as_raw(&self) -> CUmodule {
        self.inner.raw
    }
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module").field("raw", &self.inner.raw).field("device", &self.device().ordinal()).finish()
    }
}

/// PTX text as a C string.
fn ptx_cstring(ptx: &str) -> Result<CString> {
    CString::new(ptx)
        .map_err(|e| Error::InvalidArgument(format!("PTX text contains a NUL byte at offset {}", e.nul_position())))
}

/// A module file's contents, by kind.
enum Image {
    Cubin(Vec<u8>),
    Fatbin(Vec<u8>),
    Ptx(String),
}

/// Reads a module file and tells its kind by its magic.
fn read_image(path: &Path) -> Result<Image> {
    let bytes = std::fs::read(path)
        .map_err(|e| Error::InvalidArgument(format!("cannot read module file {}: {e}", path.display())))?;
    if bytes.starts_with(ELF_MAGIC) {
        Ok(Image::Cubin(bytes))
    } else if bytes.len() >= 4 && u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) == FATBIN_MAGIC {
        Ok(Image::Fatbin(bytes))
    } else {
        String::from_utf8(bytes).map(Image::Ptx).map_err(|e| {
            Error::InvalidArgument(format!(
                "module file {} is neither a cubin, a fatbin nor PTX text (not UTF-8 at byte {})",
                path.display(),
                e.utf8_error().valid_up_to()
            ))
        })
    }
}

/// The text of a JIT log buffer: up to the size the driver wrote back, up to the first NUL.
fn log_text(buf: &[u8], written: usize) -> String {
    let bytes = &buf[..written.min(buf.len())];
    let bytes = CStr::from_bytes_until_nul(bytes).map_or(bytes, CStr::to_bytes);
    String::from_utf8_lossy(bytes).trim_end().to_string()
}

/// `bytes` in a buffer aligned to 8 bytes (the driver parses the image's headers in place).
fn aligned_copy(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    // SAFETY: `v` has at least `bytes.len()` bytes; the two buffers do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes.len()) };
    v
}

fn read_u16(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?)))
}

fn read_u32(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?)))
}

fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Checks that `image` is a 64-bit little-endian ELF file whose header tables, sections and
/// segments lie within it.
fn elf_extent(image: &[u8]) -> Result<()> {
    let bad = |why: &str| Error::InvalidArgument(format!("not a usable cubin ({} bytes): {why}", image.len()));
    if !image.starts_with(ELF_MAGIC) {
        return Err(bad("no ELF magic (\\x7fELF) at the start"));
    }
    if image.len() < 64 {
        return Err(bad("shorter than a 64-bit ELF header"));
    }
    if image[4] != 2 || image[5] != 1 {
        return Err(bad("not a 64-bit little-endian ELF file"));
    }
    let len = image.len() as u64;
    let within = |offset: u64, size: u64| offset.checked_add(size).is_some_and(|end| end <= len);
    let table = |off_at, entsize_at, num_at| -> Result<(u64, u64, u64)> {
        let (off, entsize, num) = (
            read_u64(image, off_at).unwrap_or(u64::MAX),
            read_u16(image, entsize_at).unwrap_or(0),
            read_u16(image, num_at).unwrap_or(0),
        );
        if num > 0 && !(entsize.checked_mul(num).is_some_and(|size| within(off, size))) {
            return Err(bad("a header table lies beyond the end of the image"));
        }
        Ok((off, entsize, num))
    };
    let (phoff, phentsize, phnum) = table(0x20, 0x36, 0x38)?;
    let (shoff, shentsize, shnum) = table(0x28, 0x3A, 0x3C)?;
    if (phnum > 0 && phentsize < 0x38) || (shnum > 0 && shentsize < 0x40) {
        return Err(bad("header table entries are too small"));
    }
    for i in 0..shnum {
        let at = (shoff + i * shentsize) as usize;
        let kind = read_u32(image, at + 4).unwrap_or(0);
        let (offset, size) = (read_u64(image, at + 0x18).unwrap_or(0), read_u64(image, at + 0x20).unwrap_or(0));
        // SHT_NOBITS (8) sections occupy no bytes of the file.
        if kind != 8 && !within(offset, size) {
            return Err(bad(&format!("section {i} lies beyond the end of the image")));
        }
    }
    for i in 0..phnum {
        let at = (phoff + i * phentsize) as usize;
        let (offset, size) = (read_u64(image, at + 0x08).unwrap_or(0), read_u64(image, at + 0x20).unwrap_or(0));
        if !within(offset, size) {
            return Err(bad(&format!("segment {i} lies beyond the end of the image")));
        }
    }
    Ok(())
}

/// Checks that `image` starts with a fatbin header whose declared size lies within it.
fn fatbin_extent(image: &[u8]) -> Result<()> {
    let bad = |why: &str| Error::InvalidArgument(format!("not a usable fatbin ({} bytes): {why}", image.len()));
    if read_u32(image, 0) != Some(u64::from(FATBIN_MAGIC)) {
        return Err(bad("no fatbin magic (0xBA55ED50) at the start"));
    }
    let (Some(header), Some(size)) = (read_u16(image, 6), read_u64(image, 8)) else {
        return Err(bad("shorter than a fatbin header"));
    };
    if header < 16 || header.checked_add(size).is_none_or(|end| end > image.len() as u64) {
        return Err(bad(&format!("the header declares {header} + {size} bytes")));
    }
    Ok(())
}

/// A kernel of a [`Module`]. It keeps its module loaded. Launch it with [`Function::launch`] (and
/// the other `launch_*` methods in [`crate::launch`]).
///
/// `Function` is `Send + Sync` and cheap to clone.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, LaunchConfig, Module, Stream, memory::DeviceBuffer};
/// let device = Device::get(0)?;
/// let stream = Stream::new(&device)?;
/// let fill = Module::from_ptx(&device, include_str!("../examples/kernels/vector_add.ptx"))?.function("fill_u32")?;
/// println!("{:?}", fill.attributes()?);
/// let mut out = DeviceBuffer::<u32>::zeroed(1000, &stream)?;
/// // SAFETY: fill_u32(u32*, u32, u64) writes out[0..1000].
/// unsafe { fill.launch(LaunchConfig::for_num_elems(1000), &stream, (&mut out, 7u32, 1000u64))? };
/// assert_eq!(out.to_vec()?, vec![7; 1000]);
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Clone)]
pub struct Function {
    pub(crate) raw: CUfunction,
    pub(crate) module: Arc<ModuleInner>,
    name: Arc<str>,
    /// `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK` (fixed once loaded).
    pub(crate) max_threads: u32,
    /// `CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES` (fixed once loaded).
    pub(crate) static_shared: u32,
}

// SAFETY: a CUfunction is a driver handle usable from any thread; it stays valid while the module
// (held through `module`) is loaded.
unsafe impl Send for Function {}
// SAFETY: as above; the Rust fields are immutable.
unsafe impl Sync for Function {}

/// A kernel's attributes (`cuFuncGetAttribute`), as [`Function::attributes`] reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FunctionAttributes {
    /// The most threads a block of this kernel may have (registers may make it less than the
    /// device's limit).
    pub max_threads_per_block: u32,
    /// Registers per thread.
    pub num_registers: u32,
    /// Statically allocated shared memory per block, in bytes.
    pub static_shared_memory: u32,
    /// Constant memory the kernel uses, in bytes.
    pub const_memory: u32,
    /// Local memory per thread, in bytes (spills and local arrays).
    pub local_memory: u32,
    /// The current limit on dynamic shared memory per block, in bytes
    /// ([`Function::set_max_dynamic_shared_memory`]).
    pub max_dynamic_shared_memory: u32,
    /// The PTX virtual architecture the kernel was compiled from (`52` for `sm_52`).
    pub ptx_version: u32,
    /// The binary architecture it was compiled for (`90` for an H200).
    pub binary_version: u32,
}

/// What [`Function::suggested_block_size`] suggests (`cuOccupancyMaxPotentialBlockSize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSizeSuggestion {
    /// The block size that reaches the highest occupancy.
    pub block_size: u32,
    /// The smallest grid that fills the device at that occupancy.
    pub min_grid_size: u32,
}

impl Function {
    /// A function of `module`'s context, with the attributes a launch checks read once.
    fn from_raw(raw: CUfunction, module: Arc<ModuleInner>, name: &str) -> Result<Function> {
        let attr = |a| -> Result<u32> {
            let mut v = 0;
            // SAFETY: valid out-pointer and a function of live code.
            unsafe { drv!(cuFuncGetAttribute(&mut v, a, raw)) }?;
            Ok(u32::try_from(v).unwrap_or(0))
        };
        let max_threads = attr(FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
        let static_shared = attr(FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
        Ok(Function { raw, module, name: name.into(), max_threads, static_shared })
    }

    /// The kernel's name, as passed to [`Module::function`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw `CUfunction` (valid while this value lives).
    pub fn as_raw(&self) -> CUfunction {
        self.raw
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.module.ctx.device()
    }

    /// The context of its module.
    pub fn context(&self) -> &Arc<Context> {
        &self.module.ctx
    }

    /// One raw attribute (`cuFuncGetAttribute`).
    ///
    /// # Errors
    /// The driver's error (`CUDA_ERROR_INVALID_VALUE` for an attribute it does not know).
    pub fn attribute(&self, attribute: FA) -> Result<i32> {
        let _b = self.module.ctx.bind()?;
        let mut v = 0;
        // SAFETY: valid out-pointer; the function's module is loaded; the context is current.
        unsafe { drv!(cuFuncGetAttribute(&mut v, attribute, self.raw)) }?;
        Ok(v)
    }

    /// The kernel's attributes.
    ///
    /// # Errors
    /// The driver's error.
    pub fn attributes(&self) -> Result<FunctionAttributes> {
        let a = |attribute| self.attribute(attribute).map(|v| u32::try_from(v).unwrap_or(0));
        Ok(FunctionAttributes {
            max_threads_per_block: a(FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            num_registers: a(FA::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            static_shared_memory: a(FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
            const_memory: a(FA::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES)?,
            local_memory: a(FA::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            max_dynamic_shared_memory: a(FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)?,
            ptx_version: a(FA::CU_FUNC_ATTRIBUTE_PTX_VERSION)?,
            binary_version: a(FA::CU_FUNC_ATTRIBUTE_BINARY_VERSION)?,
        })
    }

    /// Lets launches of this kernel use up to `bytes` of dynamic shared memory per block
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`; the default is 48 KiB). Going above
    /// 48 KiB needs a device with opt-in shared memory (compute capability 7.0 or newer).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when `bytes` is above the default and the device cannot opt in;
    /// [`Error::InvalidArgument`] when `bytes` plus the kernel's static shared memory exceeds
    /// [`Device::max_shared_memory_per_block_optin`]; the driver's error.
    pub fn set_max_dynamic_shared_memory(&self, bytes: u32) -> Result<()> {
        let limits = &self.module.limits;
        if bytes > limits.shared_per_block && limits.shared_per_block_optin <= limits.shared_per_block {
            return Err(self.device().unsupported(
                "dynamic shared memory above the default",
                format!(
                    "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN does not exceed the default of {} bytes",
                    limits.shared_per_block
                ),
                None,
            ));
        }
        let available = limits.shared_per_block_optin.saturating_sub(self.static_shared);
        if bytes > available {
            return Err(Error::InvalidArgument(format!(
                "{bytes} bytes of dynamic shared memory for `{}`: device {} allows {} bytes per block \
                 (opt-in), of which the kernel's static shared memory takes {}",
                self.name,
                self.device().ordinal(),
                limits.shared_per_block_optin,
                self.static_shared
            )));
        }
        let _b = self.module.ctx.bind()?;
        // SAFETY: a function of a loaded module; the value was checked; the context is current.
        unsafe { drv!(cuFuncSetAttribute(self.raw, FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)) }
    }

    /// How many blocks of `block_size` threads, each with `dynamic_shared_memory` bytes, fit on one
    /// multiprocessor at once (`cuOccupancyMaxActiveBlocksPerMultiprocessor`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a block size of 0 or above the kernel's maximum; the driver's
    /// error.
    pub fn max_active_blocks_per_multiprocessor(&self, block_size: u32, dynamic_shared_memory: usize) -> Result<u32> {
        if block_size == 0 || block_size > self.max_threads {
            return Err(Error::InvalidArgument(format!(
                "block size {block_size} for `{}`: it must be 1..={} (the kernel's maximum threads per block)",
                self.name, self.max_threads
            )));
        }
        let _b = self.module.ctx.bind()?;
        let mut blocks = 0;
        // SAFETY: valid out-pointer; a function of a loaded module; the context is current.
        unsafe {
            drv!(cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut blocks,
                self.raw,
                block_size as i32,
                dynamic_shared_memory
            ))
        }?;
        Ok(u32::try_from(blocks).unwrap_or(0))
    }

    /// The block size that gives the highest occupancy with `dynamic_shared_memory` bytes per
    /// block, and the smallest grid that fills the device with it
    /// (`cuOccupancyMaxPotentialBlockSize`, without a per-block-size callback).
    ///
    /// # Errors
    /// The driver's error.
    pub fn suggested_block_size(&self, dynamic_shared_memory: usize) -> Result<BlockSizeSuggestion> {
        let _b = self.module.ctx.bind()?;
        let (mut grid, mut block) = (0, 0);
        // SAFETY: valid out-pointers; no callback; a function of a loaded module; the context is
        // current.
        unsafe {
            drv!(cuOccupancyMaxPotentialBlockSize(&mut grid, &mut block, self.raw, None, dynamic_shared_memory, 0))
        }?;
        Ok(BlockSizeSuggestion {
            block_size: u32::try_from(block).unwrap_or(0),
            min_grid_size: u32::try_from(grid).unwrap_or(0),
        })
    }
}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Function")
            .field("name", &self.name)
            .field("raw", &self.raw)
            .field("device", &self.device().ordinal())
            .finish()
    }
}

/// What an input of the [`Linker`] is (`CUjitInputType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkInput {
    /// PTX text (`CU_JIT_INPUT_PTX`), compiled before linking.
    Ptx,
    /// A cubin (`CU_JIT_INPUT_CUBIN`), compiled with relocatable device code (`nvcc -rdc=true -cubin`).
    Cubin,
    /// A fatbin (`CU_JIT_INPUT_FATBINARY`).
    Fatbin,
    /// A host object file holding device code (`CU_JIT_INPUT_OBJECT`, `nvcc -rdc=true -c`).
    Object,
    /// An archive of such objects (`CU_JIT_INPUT_LIBRARY`, `libfoo.a` / `foo.lib`, as `nvcc -lib`
    /// makes).
    Library,
}

impl LinkInput {
    /// The kind a file name's extension says: `.ptx`, `.cubin`, `.fatbin` (or `.fatbin.c`'s
    /// binary `.fatbin`), `.o` / `.obj`, `.a` / `.lib`.
    ///
    /// ```
    /// use cudrv::module::LinkInput;
    /// assert_eq!(LinkInput::from_path("kernels/add.ptx"), Some(LinkInput::Ptx));
    /// assert_eq!(LinkInput::from_path("libmath.a"), Some(LinkInput::Library));
    /// assert_eq!(LinkInput::from_path("README"), None);
    /// ```
    pub fn from_path(path: impl AsRef<Path>) -> Option<LinkInput> {
        let ext = path.as_ref().extension()?.to_str()?.to_ascii_lowercase();
        Some(match ext.as_str() {
            "ptx" => LinkInput::Ptx,
            "cubin" => LinkInput::Cubin,
            "fatbin" => LinkInput::Fatbin,
            "o" | "obj" => LinkInput::Object,
            "a" | "lib" => LinkInput::Library,
            _ => return None,
        })
    }

    fn raw(self) -> CUjitInputType {
        match self {
            LinkInput::Ptx => CUjitInputType::CU_JIT_INPUT_PTX,
            LinkInput::Cubin => CUjitInputType::CU_JIT_INPUT_CUBIN,
            LinkInput::Fatbin => CUjitInputType::CU_JIT_INPUT_FATBINARY,
            LinkInput::Object => CUjitInputType::CU_JIT_INPUT_OBJECT,
            LinkInput::Library => CUjitInputType::CU_JIT_INPUT_LIBRARY,
        }
    }
}

/// The driver's linker (`cuLinkCreate`, `cuLinkAddData`, `cuLinkAddFile`, `cuLinkComplete`): it
/// compiles PTX and links it with cubins, fatbins, objects and libraries of relocatable device
/// code into one image, for a device's context.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, module::{JitConfig, Linker}};
/// let device = Device::get(0)?;
/// let mut linker = Linker::new(&device, &JitConfig::new().optimization_level(3))?;
/// linker.add_ptx("main.ptx", include_str!("../examples/kernels/vector_add.ptx"))?;
/// // ... and the code it calls: .add_file("libhelpers.a")? (a device-code archive, nvcc -lib),
/// // .add_cubin(...), .add_ptx(...)
/// let module = linker.complete()?; // links and loads; the link state is destroyed
/// let add = module.function("add_f32")?;
/// # Ok::<(), cudrv::Error>(())
/// ```
///
/// Failures of the compiler or the linker are [`Error::Jit`] with the linker's error log.
/// Dropping a `Linker` without completing it destroys the link state (`cuLinkDestroy`).
pub struct Linker {
    raw: CUlinkState,
    ctx: Arc<Context>,
    /// The option arrays and log buffers: the driver writes the logs until `cuLinkDestroy`.
    jit: JitCall,
    /// Copies of the inputs given as data, kept until the link state is destroyed.
    inputs: Vec<Vec<u64>>,
    log_size: usize,
    count: usize,
}

// SAFETY: a link state is a driver handle usable from any thread; `&mut self` methods serialise
// its use, and cudrv makes its context current before each call.
unsafe impl Send for Linker {}
// SAFETY: `&self` methods only read the log buffers, which the driver writes during `&mut self`
// calls alone.
unsafe impl Sync for Linker {}

impl Linker {
    /// A link state for `target`'s context, with `options` for the compiler and the linker.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an option out of range; the driver's error.
    pub fn new(target: &impl ModuleTarget, options: &JitConfig) -> Result<Linker> {
        let ctx = target.module_context()?;
        let mut jit = JitCall::new(options)?;
        let mut raw = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: valid out-pointer; the option arrays have `jit.len()` entries, and they and
            // the log buffers they point into live (on the heap) until the state is destroyed in
            // `Drop`.
            unsafe { drv!(cuLinkCreate_v2(jit.len(), jit.options.as_mut_ptr(), jit.values.as_mut_ptr(), &mut raw)) }
                .map_err(|e| jit.error(e))?;
        }
        Ok(Linker { raw, ctx, jit, inputs: Vec::new(), log_size: options.log_size, count: 0 })
    }

    /// Adds PTX text, compiled at once with the linker's options.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the text contains a NUL byte; [`Error::Jit`] with the
    /// compiler's log; the driver's error.
    pub fn add_ptx(&mut self, name: &str, ptx: &str) -> Result<&mut Linker> {
        let text = ptx_cstring(ptx)?;
        self.add_data(LinkInput::Ptx, name, text.as_bytes_with_nul())
    }

    /// Adds a cubin of relocatable device code (checked as [`Module::from_cubin`] checks it).
    ///
    /// # Errors
    /// As [`Linker::add_data`].
    pub fn add_cubin(&mut self, name: &str, image: &[u8]) -> Result<&mut Linker> {
        self.add_data(LinkInput::Cubin, name, image)
    }

    /// Adds a fatbin (checked as [`Module::from_fatbin`] checks it).
    ///
    /// # Errors
    /// As [`Linker::add_data`].
    pub fn add_fatbin(&mut self, name: &str, image: &[u8]) -> Result<&mut Linker> {
        self.add_data(LinkInput::Fatbin, name, image)
    }

    /// Adds a host object file holding relocatable device code.
    ///
    /// # Errors
    /// As [`Linker::add_data`].
    pub fn add_object(&mut self, name: &str, image: &[u8]) -> Result<&mut Linker> {
        self.add_data(LinkInput::Object, name, image)
    }

    /// Adds a library (an archive of objects).
    ///
    /// # Errors
    /// As [`Linker::add_data`].
    pub fn add_library(&mut self, name: &str, image: &[u8]) -> Result<&mut Linker> {
        self.add_data(LinkInput::Library, name, image)
    }

    /// Adds an input of kind `kind` (`cuLinkAddData`). `name` appears in the logs. PTX must be
    /// NUL-terminated or have no NUL at all (cudrv adds one); cubins and fatbins are checked
    /// first. The bytes are copied, so `data` may go at once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty input, a name with a NUL byte, or an image that
    /// fails cudrv's checks; [`Error::Jit`] with the log when the driver refuses the input; the
    /// driver's error.
    pub fn add_data(&mut self, kind: LinkInput, name: &str, data: &[u8]) -> Result<&mut Linker> {
        let cname = link_name(name)?;
        if data.is_empty() {
            return Err(Error::InvalidArgument(format!("link input {name:?} is empty")));
        }
        let mut bytes = data.to_vec();
        match kind {
            LinkInput::Ptx => match bytes.iter().position(|&b| b == 0) {
                None => bytes.push(0),
                Some(at) if at + 1 == bytes.len() => {}
                Some(at) => {
                    return Err(Error::InvalidArgument(format!("PTX {name:?} contains a NUL byte at offset {at}")));
                }
            },
            LinkInput::Cubin => elf_extent(data)?,
            LinkInput::Fatbin => fatbin_extent(data)?,
            LinkInput::Object | LinkInput::Library => {}
        }
        let mut copy = aligned_copy(&bytes);
        self.jit.reset_log_sizes();
        let bound = self.ctx.bind()?;
        // SAFETY: a live link state of the current context; `copy` holds `bytes.len()` bytes and
        // is kept until the state is destroyed; a NUL-terminated name; no per-input options.
        let added = unsafe {
            drv!(cuLinkAddData_v2(
                self.raw,
                kind.raw(),
                copy.as_mut_ptr().cast(),
                bytes.len(),
                cname.as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ))
        };
        drop(bound);
        added.map_err(|e| self.jit.error(e))?;
        self.inputs.push(copy);
        self.count += 1;
        Ok(self)
    }

    /// Adds a file, whose kind its extension tells ([`LinkInput::from_path`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an extension that names no kind; as
    /// [`Linker::add_file_as`].
    pub fn add_file(&mut self, path: impl AsRef<Path>) -> Result<&mut Linker> {
        let path = path.as_ref();
        let kind = LinkInput::from_path(path).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "cannot tell the kind of link input {} from its extension (.ptx, .cubin, .fatbin, .o, .obj, .a, .lib); \
                 use Linker::add_file_as",
                path.display()
            ))
        })?;
        self.add_file_as(kind, path)
    }

    /// Adds a file of kind `kind` (`cuLinkAddFile`): the driver reads it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the file does not exist or its path is not valid UTF-8 or
    /// contains a NUL byte; [`Error::Jit`] with the log when the driver refuses it; the driver's
    /// error.
    pub fn add_file_as(&mut self, kind: LinkInput, path: impl AsRef<Path>) -> Result<&mut Linker> {
        let path = path.as_ref();
        if let Err(e) = std::fs::metadata(path) {
            return Err(Error::InvalidArgument(format!("cannot read link input {}: {e}", path.display())));
        }
        let text = path
            .to_str()
            .ok_or_else(|| Error::InvalidArgument(format!("link input path {} is not UTF-8", path.display())))?;
        let cpath = link_name(text)?;
        self.jit.reset_log_sizes();
        let bound = self.ctx.bind()?;
        // SAFETY: a live link state of the current context; a NUL-terminated path; no per-input
        // options.
        let added = unsafe {
            drv!(cuLinkAddFile_v2(self.raw, kind.raw(), cpath.as_ptr(), 0, std::ptr::null_mut(), std::ptr::null_mut()))
        };
        drop(bound);
        added.map_err(|e| self.jit.error(e))?;
        self.count += 1;
        Ok(self)
    }

    /// The number of inputs added so far.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether nothing was added yet.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The linker's information log so far.
    pub fn info_log(&self) -> String {
        self.jit.info_text()
    }

    /// The linker's error log so far.
    pub fn error_log(&self) -> String {
        self.jit.error_text()
    }

    /// Links (`cuLinkComplete`). The image stays the link state's until it is destroyed.
    fn complete_raw(&mut self) -> Result<&[u8]> {
        if self.count == 0 {
            return Err(Error::InvalidArgument("the linker has no inputs".into()));
        }
        self.jit.reset_log_sizes();
        let _b = self.ctx.bind()?;
        let (mut image, mut size) = (std::ptr::null_mut(), 0usize);
        // SAFETY: a live link state of the current context; valid out-pointers.
        unsafe { drv!(cuLinkComplete(self.raw, &mut image, &mut size)) }.map_err(|e| self.jit.error(e))?;
        if image.is_null() || size == 0 {
            return Err(Error::InvalidArgument("cuLinkComplete returned an empty image".into()));
        }
        // SAFETY: the driver owns `size` bytes at `image` until the state is destroyed, which
        // needs `&mut self`: the borrow returned here prevents it.
        Ok(unsafe { std::slice::from_raw_parts(image.cast::<u8>(), size) })
    }

    /// Links the inputs and loads the result as a module of the linker's context; then destroys
    /// the link state. The module's [`Module::info_log`] is the linker's, and its
    /// [`Module::compile_time`] the linker's wall time.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] without inputs; [`Error::Jit`] with the linker's log when
    /// linking fails (an undefined or duplicate symbol); the driver's error.
    pub fn complete(mut self) -> Result<Module> {
        let log_size = self.log_size;
        let ctx = self.ctx.clone();
        let image = self.complete_raw()?;
        let copy = aligned_copy(image);
        // SAFETY: a complete cubin (the linker's output), in an 8-byte-aligned buffer alive during
        // the call.
        let mut module = unsafe { Module::load(ctx, copy.as_ptr().cast(), &JitConfig::new().log_size(log_size)) }?;
        let (info, time) = (self.jit.info_text(), self.jit.wall_time());
        if let Some(inner) = Arc::get_mut(&mut module.inner) {
            if !info.is_empty() {
                inner.info_log = if inner.info_log.is_empty() { info } else { format!("{info}\n{}", inner.info_log) };
            }
            inner.compile_time = time.or(inner.compile_time);
        }
        Ok(module)
    }

    /// Links the inputs and returns the linked cubin (to save, or to load later with
    /// [`Module::from_cubin`] or [`Library::from_cubin`]); then destroys the link state.
    ///
    /// # Errors
    /// As [`Linker::complete`].
    pub fn complete_cubin(mut self) -> Result<Vec<u8>> {
        self.complete_raw().map(<[u8]>::to_vec)
    }

    /// The raw `CUlinkState` (valid while this value lives).
    pub fn as_raw(&self) -> CUlinkState {
        self.raw
    }
}

/// A name or path as a C string, for the linker.
fn link_name(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| Error::InvalidArgument(format!("link input name {name:?} contains a NUL byte")))
}

impl Drop for Linker {
    fn drop(&mut self) {
        let raw = crate::host_fn::SendHandle(self.raw);
        // The driver may write the logs until the state is destroyed: they go with the closure
        // (and stay, leaked, if it never runs).
        let kept = (std::mem::take(&mut self.jit), std::mem::take(&mut self.inputs));
        crate::context::drop_call(self.ctx.clone(), move || {
            // SAFETY: the state was created by this Linker (its context is current) and is
            // destroyed once, here.
            let result = unsafe { drv!(cuLinkDestroy(raw.get())) };
            if result.is_ok() {
                drop(kept);
            } else {
                // The state may live on: what the driver may write stays allocated.
                std::mem::forget(kept);
            }
            result
        });
    }
}

impl fmt::Debug for Linker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Linker")
            .field("raw", &self.raw)
            .field("device", &self.ctx.device().ordinal())
            .field("inputs", &self.count)
            .finish()
    }
}

/// A context-independent library (`cuLibraryLoadData`, CUDA 12.0 and newer): loaded once for the
/// process, and into each device's context when a [`Kernel`] of it is first asked for there.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, launch::LaunchConfig, memory::DeviceBuffer, module::Library};
/// let library = Library::from_ptx(include_str!("../examples/kernels/vector_add.ptx"))?;
/// let fill = library.kernel("fill_u32")?;
/// for device in Device::all()? {
///     let stream = Stream::new(&device)?;
///     let mut out = DeviceBuffer::<u32>::zeroed(256, &stream)?;
///     // SAFETY: fill_u32 takes (u32* out, u32 value, u64 n) and writes out[0..n].
///     unsafe { fill.launch(LaunchConfig::for_num_elems(256), &stream, (&mut out, 1u32, 256u64))? };
///     assert_eq!(out.to_vec()?, vec![1; 256]);
/// }
/// # Ok::<(), cudrv::Error>(())
/// ```
///
/// `Library` is `Send + Sync` and cheap to clone; the library is unloaded (`cuLibraryUnload`) when
/// the last `Library`, [`Kernel`] and [`Function`] of it is gone.
#[cfg(cuda_12000)]
#[derive(Clone)]
pub struct Library {
    inner: Arc<LibraryInner>,
}

#[cfg(cuda_12000)]
struct LibraryInner {
    raw: cudrv_sys::CUlibrary,
    info_log: String,
    compile_time: Option<Duration>,
}

// SAFETY: a CUlibrary is a context-independent driver handle that any thread may use; the Rust
// fields are immutable.
#[cfg(cuda_12000)]
unsafe impl Send for LibraryInner {}
// SAFETY: as above.
#[cfg(cuda_12000)]
unsafe impl Sync for LibraryInner {}

#[cfg(cuda_12000)]
impl Drop for LibraryInner {
    fn drop(&mut self) {
        let raw = crate::host_fn::SendHandle(self.raw);
        let unload = move || {
            let Ok(d) = driver() else { return };
            // SAFETY: the library was loaded by cudrv and is unloaded once, here; no Function of it
            // is left (each holds this value), and the driver waits for its kernels still queued
            // or running (see the module documentation; graphs keep their kernels' libraries).
            if let Err(e) = check("cuLibraryUnload", unsafe { d.cuLibraryUnload(raw.get()) }) {
                report_drop_error(None, e);
            }
        };
        crate::host_fn::now_or_deferred(unload)
    }
}

#[cfg(cuda_12000)]
impl Library {
    /// Loads PTX text (compiled by the driver's JIT when it is loaded into a context).
    ///
    /// # Errors
    /// [`Error::MissingSymbol`] with a driver older than CUDA 12.0; as [`Module::from_ptx`].
    pub fn from_ptx(ptx: &str) -> Result<Library> {
        Self::from_ptx_with(ptx, &JitConfig::default())
    }

    /// Loads PTX text with JIT `options`.
    ///
    /// # Errors
    /// As [`Library::from_ptx`], and [`Error::InvalidArgument`] for an option out of range.
    pub fn from_ptx_with(ptx: &str, options: &JitConfig) -> Result<Library> {
        let text = ptx_cstring(ptx)?;
        // SAFETY: a NUL-terminated string, alive during the call.
        unsafe { Self::load(text.as_ptr().cast(), options) }
    }

    /// Loads a cubin (checked as [`Module::from_cubin`] checks it).
    ///
    /// # Errors
    /// As [`Library::from_ptx`] and [`Module::from_cubin`].
    pub fn from_cubin(image: &[u8]) -> Result<Library> {
        elf_extent(image)?;
        let copy = aligned_copy(image);
        // SAFETY: a complete ELF image in an 8-byte-aligned buffer alive during the call.
        unsafe { Self::load(copy.as_ptr().cast(), &JitConfig::default()) }
    }

    /// Loads a fatbin (checked as [`Module::from_fatbin`] checks it) with JIT `options`.
    ///
    /// # Errors
    /// As [`Library::from_ptx`] and [`Module::from_fatbin`].
    pub fn from_fatbin_with(image: &[u8], options: &JitConfig) -> Result<Library> {
        fatbin_extent(image)?;
        let copy = aligned_copy(image);
        // SAFETY: a complete fatbin in an 8-byte-aligned buffer alive during the call.
        unsafe { Self::load(copy.as_ptr().cast(), options) }
    }

    /// Loads a fatbin.
    ///
    /// # Errors
    /// As [`Library::from_fatbin_with`].
    pub fn from_fatbin(image: &[u8]) -> Result<Library> {
        Self::from_fatbin_with(image, &JitConfig::default())
    }

    /// Loads a file: a cubin, a fatbin or PTX text, as [`Module::from_file`] tells them apart.
    ///
    /// # Errors
    /// As [`Module::from_file`] and [`Library::from_ptx`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Library> {
        Self::from_file_with(path, &JitConfig::default())
    }

    /// Loads a file with JIT `options`.
    ///
    /// # Errors
    /// As [`Library::from_file`].
    pub fn from_file_with(path: impl AsRef<Path>, options: &JitConfig) -> Result<Library> {
        match read_image(path.as_ref())? {
            Image::Cubin(bytes) => {
                elf_extent(&bytes)?;
                let copy = aligned_copy(&bytes);
                // SAFETY: as in from_cubin.
                unsafe { Self::load(copy.as_ptr().cast(), options) }
            }
            Image::Fatbin(bytes) => Self::from_fatbin_with(&bytes, options),
            Image::Ptx(text) => Self::from_ptx_with(&text, options),
        }
    }

    /// # Safety
    /// `image` must point to a complete image (PTX NUL-terminated) valid during the call.
    unsafe fn load(image: *const c_void, options: &JitConfig) -> Result<Library> {
        if crate::host_fn::in_host_fn() {
            return Err(Error::InHostFunction { call: "Library::load" });
        }
        let mut jit = JitCall::new(options)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `image` is valid (the caller's promise); the JIT arrays have
        // `jit.len()` entries and their buffers outlive the call; no library options.
        let rc = unsafe {
            driver()?.cuLibraryLoadData(
                &mut raw,
                image,
                jit.options.as_mut_ptr(),
                jit.values.as_mut_ptr(),
                jit.len(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        check("cuLibraryLoadData", rc).map_err(|e| jit.error(e))?;
        let inner = LibraryInner { raw, info_log: jit.info_text(), compile_time: jit.wall_time() };
        Ok(Library { inner: Arc::new(inner) })
    }

    /// The kernel named `name` (`cuLibraryGetKernel`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the kernel when the library has none of that name (or
    /// the name contains a NUL byte); the driver's error.
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        if crate::host_fn::in_host_fn() {
            return Err(Error::InHostFunction { call: "Library::kernel" });
        }
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("kernel name {name:?} contains a NUL byte")))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer, a loaded library, a NUL-terminated name.
        match unsafe { drv!(cuLibraryGetKernel(&mut raw, self.inner.raw, cname.as_ptr())) } {
            Err(e) if e.code() == Some(cudrv_sys::CUresult::CUDA_ERROR_NOT_FOUND) => {
                Err(Error::InvalidArgument(format!(
                    "the library has no kernel named {name:?} (cuLibraryGetKernel: CUDA_ERROR_NOT_FOUND); \
                     kernels are `.entry` functions (extern \"C\" __global__ in CUDA C++, else the name is mangled)"
                )))
            }
            Err(e) => Err(e),
            Ok(()) => Ok(Kernel {
                raw,
                library: self.inner.clone(),
                name: name.into(),
                functions: Arc::new(Mutex::new(Vec::new())),
            }),
        }
    }

    /// The names of the library's kernels (`cuLibraryGetKernelCount`, `cuLibraryEnumerateKernels`
    /// and `cuKernelGetName`: CUDA 12.4 and newer; offered with headers of 12.5 and newer).
    ///
    /// # Errors
    /// [`Error::MissingSymbol`] with an older driver; the driver's error.
    #[cfg(cuda_12050)]
    pub fn kernel_names(&self) -> Result<Vec<String>> {
        if crate::host_fn::in_host_fn() {
            return Err(Error::InHostFunction { call: "Library::kernel_names" });
        }
        let mut count = 0;
        // SAFETY: valid out-pointer and a loaded library.
        unsafe { drv!(cuLibraryGetKernelCount(&mut count, self.inner.raw)) }?;
        let mut kernels = vec![std::ptr::null_mut(); count as usize];
        // SAFETY: the array has `count` entries.
        unsafe { drv!(cuLibraryEnumerateKernels(kernels.as_mut_ptr(), count, self.inner.raw)) }?;
        kernels
            .into_iter()
            .map(|k| {
                let mut name = std::ptr::null();
                // SAFETY: a kernel of a loaded library; valid out-pointer.
                unsafe { drv!(cuKernelGetName(&mut name, k)) }?;
                if name.is_null() {
                    return Ok(String::new());
                }
                // SAFETY: the driver returns a NUL-terminated name that lives with the library.
                Ok(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned())
            })
            .collect()
    }

    /// The JIT's information log of the load (often empty: the driver may compile lazily, when a
    /// kernel is first used in a context).
    pub fn info_log(&self) -> &str {
        &self.inner.info_log
    }

    /// How long the JIT compiler took at load, as the driver reports it (`None` when it did not
    /// compile then).
    pub fn compile_time(&self) -> Option<Duration> {
        self.inner.compile_time
    }

    /// The raw `CUlibrary` (valid while this value or a [`Kernel`] of it lives).
    pub fn as_raw(&self) -> cudrv_sys::CUlibrary {
        self.inner.raw
    }
}

#[cfg(cuda_12000)]
impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library").field("raw", &self.inner.raw).finish()
    }
}

/// A kernel of a [`Library`], independent of any context (`CUkernel`). [`Kernel::function`] gives
/// the [`Function`] of a device's context (loading the library there the first time), which
/// launches with every `launch*` method of [`crate::launch`]; [`Kernel::launch`] does both.
///
/// `Kernel` is `Send + Sync` and cheap to clone (clones share the per-device functions).
#[cfg(cuda_12000)]
#[derive(Clone)]
pub struct Kernel {
    raw: cudrv_sys::CUkernel,
    library: Arc<LibraryInner>,
    name: Arc<str>,
    /// The functions made so far, one per device.
    functions: Arc<Mutex<Vec<Function>>>,
}

// SAFETY: a CUkernel is a context-independent driver handle usable from any thread; the
// functions are behind a Mutex.
#[cfg(cuda_12000)]
unsafe impl Send for Kernel {}
// SAFETY: as above.
#[cfg(cuda_12000)]
unsafe impl Sync for Kernel {}

#[cfg(cuda_12000)]
impl Kernel {
    /// The kernel's name, as passed to [`Library::kernel`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw `CUkernel` (valid while this value lives).
    pub fn as_raw(&self) -> cudrv_sys::CUkernel {
        self.raw
    }

    /// The library.
    pub fn library(&self) -> Library {
        Library { inner: self.library.clone() }
    }

    /// The kernel as a [`Function`] of `device`'s primary context (`cuKernelGetFunction`), which
    /// loads the library into that context the first time. Made once per device and shared.
    ///
    /// # Errors
    /// [`Error::Jit`] or the driver's error when loading into the context fails (PTX that does not
    /// compile for the device, `CUDA_ERROR_NO_BINARY_FOR_GPU`).
    pub fn function(&self, device: &Device) -> Result<Function> {
        let mut functions = self.functions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = functions.iter().find(|f| f.device() == *device) {
            return Ok(f.clone());
        }
        let ctx = device.primary_context()?;
        let limits = DeviceLimits::read(device)?;
        let _b = ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer, a kernel of a loaded library; the device's context is current.
        unsafe { drv!(cuKernelGetFunction(&mut raw, self.raw)) }?;
        let inner = ModuleInner {
            raw: std::ptr::null_mut(),
            ctx: ctx.clone(),
            limits,
            info_log: self.library.info_log.clone(),
            compile_time: self.library.compile_time,
            owner: Owner::Library(self.library.clone()),
        };
        let f = Function::from_raw(raw, Arc::new(inner), &self.name)?;
        functions.push(f.clone());
        Ok(f)
    }
}

#[cfg(cuda_12000)]
impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernel").field("name", &self.name).field("raw", &self.raw).finish()
    }
}

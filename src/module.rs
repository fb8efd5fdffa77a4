//! Modules (loaded PTX, cubin or fatbin images) and the kernels in them.
//!
//! ```no_run
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
//! # Why `cuModuleLoadData` and not `cuLibraryLoadData`
//!
//! CUDA 12.0 added *context-independent* loading (`cuLibraryLoadData`, `CUlibrary`, `CUkernel`):
//! one library serves every context and device, and is loaded into a context lazily. cudrv uses
//! only each device's primary context, so a module per device costs nothing that a library
//! would save, and `cuModuleLoadDataEx` works on every driver cudrv supports (CUDA 11.x included)
//! with one code path. Context-independent libraries are a possible later step, for drivers that
//! have `cuLibraryLoadData` (it would let one [`Module`] launch on several devices).
//!
//! # Lifetimes
//!
//! A [`Module`] holds its device's [`Context`]; a [`Function`] holds its module, so a function stays
//! usable after the `Module` value is dropped, and the module is unloaded when the last of them goes
//! (`cuModuleUnload`; an error there goes to the context's deferred errors, see
//! [`crate::set_drop_error_hook`]).

use std::ffi::{CStr, CString, c_void};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use cudrv_sys::{CUdevice_attribute as DA, CUfunction, CUfunction_attribute as FA, CUjit_option, CUmodule};

use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::result::{check, driver, drv};
use crate::stream::Stream;

/// Bytes reserved for each JIT log.
const LOG_SIZE: usize = 16 * 1024;

/// The ELF magic of a cubin.
const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
/// The magic of a fatbin (`fatBinaryHeader::magic`), little-endian.
const FATBIN_MAGIC: u32 = 0xBA55_ED50;

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
}

// SAFETY: a CUmodule is a driver handle that any thread may use (the driver API is thread-safe);
// cudrv makes the module's context current before each use. The Rust fields are immutable.
unsafe impl Send for ModuleInner {}
// SAFETY: as above; all access is through `&self` and thread-safe driver calls.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let (raw, ctx) = (crate::host_fn::SendHandle(self.raw), self.ctx.clone());
        let unload = move || {
            let result = ctx.bind().and_then(|_b| {
                // SAFETY: the module was loaded by cudrv into this context and is unloaded once,
                // here; no Function refers to it any more (each holds this value).
                unsafe { drv!(cuModuleUnload(raw.get())) }
            });
            if let Err(e) = result {
                report_drop_error(Some(&ctx), e);
            }
        };
        if crate::host_fn::in_host_fn() { crate::host_fn::defer(unload) } else { unload() }
    }
}

/// A loaded module: PTX compiled by the driver's JIT, or a cubin or fatbin.
///
/// `Module` is `Send + Sync` and cheap to clone (clones share the module). See the
/// [module documentation](self) for an example and for how loading reports errors.
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
        let text = CString::new(ptx).map_err(|e| {
            Error::InvalidArgument(format!("PTX text contains a NUL byte at offset {}", e.nul_position()))
        })?;
        // SAFETY: a NUL-terminated string, alive during the call.
        unsafe { Self::load(target.module_context()?, text.as_ptr().cast()) }
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
        elf_extent(image)?;
        let copy = aligned_copy(image);
        // SAFETY: a complete ELF image (checked above) in an 8-byte-aligned buffer alive during
        // the call.
        unsafe { Self::load(target.module_context()?, copy.as_ptr().cast()) }
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
        fatbin_extent(image)?;
        let copy = aligned_copy(image);
        // SAFETY: a complete fatbin (checked above) in an 8-byte-aligned buffer alive during the
        // call.
        unsafe { Self::load(target.module_context()?, copy.as_ptr().cast()) }
    }

    /// Loads a file: a cubin when it starts with the ELF magic, a fatbin when it starts with the
    /// fatbin magic, PTX text otherwise.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the file cannot be read (with the path and the OS's reason)
    /// or is none of the three; as the `from_*` function for its kind.
    pub fn from_file(target: &impl ModuleTarget, path: impl AsRef<Path>) -> Result<Module> {
        let path = path.as_ref();
        let bytes = std::fs::read(path)
            .map_err(|e| Error::InvalidArgument(format!("cannot read module file {}: {e}", path.display())))?;
        if bytes.starts_with(ELF_MAGIC) {
            Self::from_cubin(target, &bytes)
        } else if bytes.len() >= 4 && u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) == FATBIN_MAGIC {
            Self::from_fatbin(target, &bytes)
        } else {
            let text = String::from_utf8(bytes).map_err(|e| {
                Error::InvalidArgument(format!(
                    "module file {} is neither a cubin, a fatbin nor PTX text (not UTF-8 at byte {})",
                    path.display(),
                    e.utf8_error().valid_up_to()
                ))
            })?;
            Self::from_ptx(target, &text)
        }
    }

    /// Loads `image` into `ctx` with the JIT log options.
    ///
    /// # Safety
    /// `image` must point to a complete PTX (NUL-terminated), cubin or fatbin image that stays
    /// valid during the call.
    unsafe fn load(ctx: Arc<Context>, image: *const c_void) -> Result<Module> {
        let limits = DeviceLimits::read(&ctx.device())?;
        let _b = ctx.bind()?;
        let mut error_log = vec![0u8; LOG_SIZE];
        let mut info_log = vec![0u8; LOG_SIZE];
        let mut options: [CUjit_option; 5] = [
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            CUjit_option::CU_JIT_INFO_LOG_BUFFER,
            CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
            CUjit_option::CU_JIT_LOG_VERBOSE,
        ];
        // Sizes and flags travel in the pointer-sized slots themselves, as the driver API wants.
        let mut values: [*mut c_void; 5] = [
            error_log.as_mut_ptr().cast(),
            std::ptr::without_provenance_mut(LOG_SIZE),
            info_log.as_mut_ptr().cast(),
            std::ptr::without_provenance_mut(LOG_SIZE),
            std::ptr::without_provenance_mut(1),
        ];
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; `image` is valid (the caller's promise); the option
        // arrays have 5 entries each; the log buffers are LOG_SIZE bytes and outlive the call; the
        // context is current.
        let rc = unsafe { driver()?.cuModuleLoadDataEx(&mut raw, image, 5, options.as_mut_ptr(), values.as_mut_ptr()) };
        drop(_b);
        let error_text = log_text(&error_log, values[1] as usize);
        let info_text = log_text(&info_log, values[3] as usize);
        match check("cuModuleLoadDataEx", rc) {
            Ok(()) => Ok(Module { inner: Arc::new(ModuleInner { raw, ctx, limits, info_log: info_text }) }),
            Err(e @ Error::Driver { .. }) if !error_text.is_empty() => {
                Err(Error::Jit { source: Box::new(e), log: error_text })
            }
            Err(e) => Err(e),
        }
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
        let attr = |a| -> Result<u32> {
            let mut v = 0;
            // SAFETY: valid out-pointer and a function of a live module.
            unsafe { drv!(cuFuncGetAttribute(&mut v, a, raw)) }?;
            Ok(u32::try_from(v).unwrap_or(0))
        };
        let max_threads = attr(FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
        let static_shared = attr(FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
        Ok(Function { raw, module: self.inner.clone(), name: name.into(), max_threads, static_shared })
    }

    /// The JIT's information log of the load (`CU_JIT_INFO_LOG_BUFFER`, asked for with
    /// `CU_JIT_LOG_VERBOSE`). Often empty: drivers write little there, and nothing for images that
    /// needed no compilation. [`Function::attributes`] has the registers and memory per kernel.
    pub fn info_log(&self) -> &str {
        &self.inner.info_log
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

//! cudrv: a small, correct binding to the CUDA driver API.
//!
//! * [`Device`]: devices, their attributes, driver model ([`DriverModel`]) and
//!   [`Capabilities`], read per device and cached.
//! * [`Context`]: each device's primary context, shared.
//! * [`Stream`], [`Event`]: ordering and timing.
//! * [`memory`]: stream-ordered [`memory::MemoryResource`]s chosen per device (the driver's pool,
//!   or cudrv's [`memory::StreamOrderedPool`] where pools are missing), [`memory::DeviceBuffer`],
//!   [`memory::PinnedBuffer`] and copies.
//! * [`Module`], [`Function`], [`LaunchConfig`]: loading PTX/cubin/fatbin and launching kernels;
//!   [`JitConfig`], the driver's [`Linker`], context-independent [`module::Library`] (CUDA 12.0),
//!   and launch attributes ([`LaunchAttributes`]: programmatic dependent launch, priority, L2
//!   access-policy window, clusters, memory synchronisation domain).
//! * [`memory::DeviceBuffer2D`] and [`memory::DeviceBuffer3D`] (pitched memory, 2D/3D copies and
//!   memsets), [`memory::ManagedBuffer`] (prefetch and advice), [`Device::memory_info`].
//! * [`ipc`]: events and device memory shared with other processes.
//!
//! Everything a device may lack is checked first, and reported as [`Error::Unsupported`] with
//! the reason and an alternative, never as a bare driver code.
//!
//! The raw bindings and the loader are in [`sys`] (the `cudrv-sys` crate).
//!
//! ```
//! # if !cudrv::__doctest_driver() { return Ok(()); }
//! use cudrv::{Device, LaunchConfig, Module, Stream, memory::DeviceBuffer};
//! let device = Device::get(0)?;
//! println!("{} ({:?}), allocating with {:?}", device.name()?, device.driver_model()?,
//!          device.memory_resource()?.kind());
//! let stream = Stream::new(&device)?;
//! let module = Module::from_ptx(&device, include_str!("../examples/kernels/vector_add.ptx"))?;
//! let add = module.function("add_f32")?;
//! let a = DeviceBuffer::from_slice(&[1.0f32, 2.0, 3.0], &stream)?;
//! let b = DeviceBuffer::from_slice(&[10.0f32, 20.0, 30.0], &stream)?;
//! let mut sum = DeviceBuffer::<f32>::zeroed(3, &stream)?;
//! // SAFETY: add_f32(const float*, const float*, float*, u64) touches [0..3] of each buffer.
//! unsafe { add.launch(LaunchConfig::for_num_elems(3), &stream, (&a, &b, &mut sum, 3u64))? };
//! assert_eq!(sum.to_vec()?, [11.0, 22.0, 33.0]);
//! # Ok::<(), cudrv::Error>(())
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub use cudrv_sys as sys;

/// Prints a line to standard error, as `eprintln!` does, but ignores a failure to write:
/// `eprintln!` panics when stderr is a pipe whose reader has gone, and cudrv's warnings come from
/// drops, host functions and the driver's callbacks, which must not panic.
macro_rules! warn_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

mod barrier;
mod host_fn;
mod result;

mod capture;
pub mod context;
pub mod device;
pub mod error;
pub mod event;
pub mod graph;
pub mod ipc;
pub mod launch;
pub mod memory;
pub mod module;
mod session;
mod stream;

pub use context::{Context, set_drop_error_hook};
pub use device::{Capabilities, Device, DriverModel, MemoryInfo};
pub use error::{Error, Result};
pub use event::{Event, EventFlags};
pub use graph::{Graph, GraphExec};
pub use host_fn::flush_deferred_drops;
pub use launch::{KernelArg, KernelArgs, LaunchAttributes, LaunchConfig};
pub use module::{Function, JitConfig, Linker, Module};
#[cfg(cuda_12000)]
pub use module::{Kernel, Library};
pub use stream::Stream;

/// The version of the loaded driver (`cuDriverGetVersion`: `13000` for 13.0), loading it if
/// needed.
///
/// # Errors
/// [`Error::DriverNotFound`] without a driver.
pub fn driver_version() -> Result<i32> {
    Ok(sys::Driver::global()?.version())
}

/// For cudrv's doctests (their hidden first line): whether a driver with a device is there to run
/// them on. Without `CUDRV_DRIVER_PATH`, a `CUDRV_TEST_LIB_DIR` that holds the emulated driver of
/// `cudrv-test-support` is used (CI sets it); with `CUDRV_DOCTEST_REQUIRE=1`, having no driver
/// panics instead of skipping the example. Each doctest is a process of its own, and this is its
/// first statement.
#[doc(hidden)]
pub fn __doctest_driver() -> bool {
    let set = |var: &str| std::env::var_os(var).filter(|v| !v.is_empty());
    if set(sys::DRIVER_PATH_VAR).is_none()
        && let Some(dir) = set("CUDRV_TEST_LIB_DIR")
    {
        let fake = std::path::Path::new(&dir).join(if cfg!(windows) { "nvcuda.dll" } else { "libcuda.so" });
        if fake.is_file() {
            // SAFETY: the first statement of a doctest's process: no other thread exists yet.
            unsafe { std::env::set_var(sys::DRIVER_PATH_VAR, fake) };
        }
    }
    let usable = Device::count().is_ok_and(|n| n > 0);
    if !usable && set("CUDRV_DOCTEST_REQUIRE").is_some_and(|v| v == "1") {
        panic!("CUDRV_DOCTEST_REQUIRE=1 but no CUDA driver with a device: set CUDRV_TEST_LIB_DIR or CUDRV_DRIVER_PATH");
    }
    usable
}

/// The CUDA version of the headers cudrv was built against (`13000` for 13.0).
pub const HEADER_VERSION: i32 = sys::CUDA_HEADER_VERSION;

/// `12080` → `"12.8"`.
pub(crate) fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

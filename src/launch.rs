//! Launching kernels: [`LaunchConfig`], argument marshalling ([`KernelArg`], [`KernelArgs`]),
//! launch attributes ([`LaunchAttributes`]), and the `launch*` methods of [`Function`].
//!
//! | method | driver call | what |
//! |---|---|---|
//! | [`Function::launch`] | `cuLaunchKernel` | a plain launch |
//! | [`Function::launch_cooperative`] | `cuLaunchCooperativeKernel` | all blocks resident at once |
//! | [`Function::launch_cluster`] | `cuLaunchKernelEx` | thread-block clusters |
//! | [`Function::launch_with`] | `cuLaunchKernelEx` | any [`LaunchAttributes`]: programmatic dependent launch, priority, access-policy window, clusters and preferred clusters, memory synchronisation domain, cooperative |
//! | [`Function::launch_raw`] | `cuLaunchKernel` | a prepared `kernelParams` array |
//!
//! Cluster occupancy: [`Function::max_active_clusters`] and
//! [`Function::max_potential_cluster_size`].
//!
//! # Arguments
//!
//! Arguments are a tuple of up to 12 values, each a [`KernelArg`]:
//!
//! | Rust value | the kernel parameter |
//! |---|---|
//! | a [`DeviceRepr`] value (`u32`, `f32`, `u64`, arrays, your `#[repr(C)]` structs) | the value, bit for bit |
//! | `&DeviceBuffer<T>`, `&mut DeviceBuffer<T>` | a `T*` (the device address, 64 bits) |
//! | `DeviceView<T>`, `&DeviceView<T>` | a `T*` to the view's first element |
//! | `&DeviceBuffer2D<T>`, `&mut DeviceBuffer2D<T>`, `DeviceView2D<T>` (and 3D) | a `T*` to the first element (pass the pitch, [`DeviceBuffer2D::pitch`](crate::memory::DeviceBuffer2D::pitch), as another argument) |
//! | `&ManagedBuffer<T>`, `&mut ManagedBuffer<T>` | a `T*` (managed memory) |
//! | `&IpcBuffer<T>`, `&mut IpcBuffer<T>` | a `T*` into memory of another process ([`crate::ipc`]) |
//!
//! Use `()` for a kernel without parameters and `(x,)` for one parameter. Marshalling allocates
//! nothing: the values live in a stack array whose addresses go to `cuLaunchKernel` as
//! `kernelParams`, and they stay alive until the call returns (the driver copies them).
//!
//! A buffer passed to a launch on a stream other than its own has that use recorded
//! ([`DeviceBuffer::record_use`]), so its stream-ordered free waits for the kernel.
//!
//! # Why launching is `unsafe`
//!
//! A kernel's parameter list is not visible to the driver or to cudrv, so nothing can check that
//! the arguments match it, nor what the kernel does with the memory it is given. See
//! [`Function::launch`] for exactly what the caller promises.

use std::ffi::c_void;

use cudrv_sys::{CUfunction_attribute as FA, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig, CUresult};

use crate::device::Device;
use crate::error::check;
use crate::error::{Error, Result};
use crate::ipc::IpcBuffer;
use crate::memory::{
    DeviceBuffer, DeviceBuffer2D, DeviceBuffer3D, DevicePtr, DeviceRepr, DeviceView, DeviceView2D, ManagedBuffer,
};
use crate::module::Function;
use crate::result::driver;
use crate::stream::{Gate, Stream};

/// The shape of a launch: grid and block dimensions, and dynamic shared memory per block.
///
/// ```
/// use cudrv::launch::LaunchConfig;
/// let cfg = LaunchConfig::for_num_elems(1000);
/// assert_eq!((cfg.grid, cfg.block), ((4, 1, 1), (256, 1, 1)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks in the grid, per dimension (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads in a block, per dimension (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// Threads per block that [`LaunchConfig::for_num_elems`] uses.
    pub const DEFAULT_BLOCK: u32 = 256;

    /// A one-dimensional launch of blocks of [`LaunchConfig::DEFAULT_BLOCK`] threads with one
    /// thread per element: `ceil(n / 256)` blocks (at least 1, at most 2^31 - 1, the grid limit of
    /// every device; a kernel given more elements than that covers must loop over them with a
    /// grid stride, which is good practice anyway).
    pub fn for_num_elems(n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(Self::DEFAULT_BLOCK as usize).clamp(1, i32::MAX as usize) as u32;
        LaunchConfig { grid: (blocks, 1, 1), block: (Self::DEFAULT_BLOCK, 1, 1), shared_mem_bytes: 0 }
    }

    /// A one-dimensional launch of `grid` blocks of `block` threads, without shared memory.
    pub fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig { grid: (grid, 1, 1), block: (block, 1, 1), shared_mem_bytes: 0 }
    }

    /// This configuration with `bytes` of dynamic shared memory per block.
    pub fn with_shared_mem(self, bytes: u32) -> LaunchConfig {
        LaunchConfig { shared_mem_bytes: bytes, ..self }
    }

    /// Threads per block, saturating at `u64::MAX` (three `u32` factors can exceed it; no
    /// device allows anywhere near that many).
    pub fn threads_per_block(&self) -> u64 {
        u64::from(self.block.0).saturating_mul(u64::from(self.block.1)).saturating_mul(u64::from(self.block.2))
    }

    /// Blocks in the grid, saturating at `u64::MAX` (as [`LaunchConfig::threads_per_block`]).
    pub fn blocks(&self) -> u64 {
        u64::from(self.grid.0).saturating_mul(u64::from(self.grid.1)).saturating_mul(u64::from(self.grid.2))
    }
}

/// How a launch's accesses to an [`AccessPolicyWindow`] use the L2 cache (`CUaccessProperty`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccessProperty {
    /// Normal caching (`CU_ACCESS_PROPERTY_NORMAL`).
    Normal,
    /// Likely to be used once: evicted first (`CU_ACCESS_PROPERTY_STREAMING`).
    Streaming,
    /// Kept in the L2 set-aside for persisting accesses (`CU_ACCESS_PROPERTY_PERSISTING`; the
    /// set-aside is `cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)`, at most
    /// [`crate::Capabilities::max_persisting_l2_cache_size`]).
    Persisting,
}

impl AccessProperty {
    fn raw(self) -> cudrv_sys::CUaccessProperty {
        match self {
            AccessProperty::Normal => cudrv_sys::CUaccessProperty::CU_ACCESS_PROPERTY_NORMAL,
            AccessProperty::Streaming => cudrv_sys::CUaccessProperty::CU_ACCESS_PROPERTY_STREAMING,
            AccessProperty::Persisting => cudrv_sys::CUaccessProperty::CU_ACCESS_PROPERTY_PERSISTING,
        }
    }
}

/// An L2 access-policy window of a launch (`CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW`): a fraction
/// `hit_ratio` of the accesses to `[base, base + num_bytes)` get the `hit` property, the rest the
/// `miss` property. A hint to the cache only: it changes no result, and touches no memory.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, launch::{AccessPolicyWindow, LaunchAttributes}, memory::DeviceBuffer};
/// let stream = Stream::new(&Device::get(0)?)?;
/// let table = DeviceBuffer::<f32>::zeroed(1 << 20, &stream)?;
/// let attrs = LaunchAttributes::new().access_policy_window(AccessPolicyWindow::persisting(&table, 0.6));
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AccessPolicyWindow {
    /// The window's first byte.
    pub base: DevicePtr,
    /// Its size: at most [`crate::Capabilities::max_access_policy_window_size`].
    pub num_bytes: usize,
    /// The fraction of accesses that get `hit`, 0.0 to 1.0.
    pub hit_ratio: f32,
    /// The property of that fraction.
    pub hit: AccessProperty,
    /// The property of the others.
    pub miss: AccessProperty,
}

impl AccessPolicyWindow {
    /// `[base, base + num_bytes)`: every access persisting, none streaming.
    pub fn new(base: DevicePtr, num_bytes: usize) -> AccessPolicyWindow {
        AccessPolicyWindow {
            base,
            num_bytes,
            hit_ratio: 1.0,
            hit: AccessProperty::Persisting,
            miss: AccessProperty::Streaming,
        }
    }

    /// The whole of `buffer`: `hit_ratio` of the accesses persisting, the rest streaming.
    pub fn persisting<T: DeviceRepr>(buffer: &DeviceBuffer<T>, hit_ratio: f32) -> AccessPolicyWindow {
        AccessPolicyWindow { hit_ratio, ..AccessPolicyWindow::new(buffer.as_raw(), buffer.byte_len()) }
    }
}

/// The memory synchronisation domain of a launch (`CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN`): memory
/// fences of kernels in one domain do not wait for the writes of kernels in another, so that a
/// communication kernel (NCCL's) does not slow compute kernels' fences down. Needs
/// [`crate::Capabilities::mem_sync_domain_count`] of 2 or more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemSyncDomain {
    /// The default domain (`CU_LAUNCH_MEM_SYNC_DOMAIN_DEFAULT`).
    Default,
    /// The remote domain (`CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE`), meant for kernels that communicate
    /// with other devices.
    Remote,
}

/// Launch attributes for [`Function::launch_with`] (`cuLaunchKernelEx`). Each one left at its
/// default is not passed. Each is checked against the device and the driver before the launch,
/// and refused with [`Error::Unsupported`] (or [`Error::MissingSymbol`] without
/// `cuLaunchKernelEx`) where they lack it.
///
/// ```
/// use cudrv::launch::{LaunchAttributes, MemSyncDomain};
/// let attrs = LaunchAttributes::new()
///     .programmatic_stream_serialization(true)
///     .priority(-1)
///     .cluster_dim((2, 1, 1))
///     .mem_sync_domain(MemSyncDomain::Remote);
/// assert_eq!(attrs.priority, Some(-1));
/// assert!(!attrs.is_empty());
/// assert!(LaunchAttributes::new().is_empty());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct LaunchAttributes {
    /// Programmatic dependent launch (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`):
    /// the kernel may start before the previous kernel on the stream has finished, once every
    /// block of that kernel has called `griddepcontrol.launch_dependents`
    /// (`cudaTriggerProgrammaticLaunchCompletion`) or exited. The kernel must call
    /// `griddepcontrol.wait` (`cudaGridDependencySynchronize`) before it touches anything the
    /// previous kernel may still use; see [`Function::launch_with`]. Needs
    /// [`crate::Capabilities::programmatic_dependent_launch`].
    pub programmatic_stream_serialization: bool,
    /// The launch's priority (`CU_LAUNCH_ATTRIBUTE_PRIORITY`), within the device's
    /// [`crate::Capabilities::stream_priority_range`] (lower is higher), instead of the stream's.
    /// Needs a driver of CUDA 12.0 or newer.
    pub priority: Option<i32>,
    /// An L2 access-policy window (`CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW`). Needs
    /// [`crate::Capabilities::max_access_policy_window_size`] above 0.
    pub access_policy_window: Option<AccessPolicyWindow>,
    /// Thread-block clusters of this shape (`CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`), as
    /// [`Function::launch_cluster`].
    pub cluster_dim: Option<(u32, u32, u32)>,
    /// A preferred, larger cluster shape (`CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION`): the
    /// device groups blocks into clusters of this shape where it can, and of `cluster_dim`
    /// otherwise. Each dimension must be a multiple of `cluster_dim`'s (which must be set) and
    /// divide the grid's. Needs [`crate::Capabilities::preferred_cluster_dimension`].
    pub preferred_cluster_dim: Option<(u32, u32, u32)>,
    /// The memory synchronisation domain (`CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN`). Needs
    /// [`crate::Capabilities::mem_sync_domain_count`] of 2 or more and a driver of CUDA 12.0.
    pub mem_sync_domain: Option<MemSyncDomain>,
    /// A cooperative launch (`CU_LAUNCH_ATTRIBUTE_COOPERATIVE`), as
    /// [`Function::launch_cooperative`].
    pub cooperative: bool,
}

impl LaunchAttributes {
    /// No attributes: a launch with these is a plain launch through `cuLaunchKernelEx`.
    pub fn new() -> LaunchAttributes {
        LaunchAttributes::default()
    }

    /// With or without programmatic stream serialization.
    pub fn programmatic_stream_serialization(self, allowed: bool) -> LaunchAttributes {
        LaunchAttributes { programmatic_stream_serialization: allowed, ..self }
    }

    /// With a priority.
    pub fn priority(self, priority: i32) -> LaunchAttributes {
        LaunchAttributes { priority: Some(priority), ..self }
    }

    /// With an access-policy window.
    pub fn access_policy_window(self, window: AccessPolicyWindow) -> LaunchAttributes {
        LaunchAttributes { access_policy_window: Some(window), ..self }
    }

    /// With clusters of this shape.
    pub fn cluster_dim(self, dim: (u32, u32, u32)) -> LaunchAttributes {
        LaunchAttributes { cluster_dim: Some(dim), ..self }
    }

    /// With a preferred cluster shape.
    pub fn preferred_cluster_dim(self, dim: (u32, u32, u32)) -> LaunchAttributes {
        LaunchAttributes { preferred_cluster_dim: Some(dim), ..self }
    }

    /// In a memory synchronisation domain.
    pub fn mem_sync_domain(self, domain: MemSyncDomain) -> LaunchAttributes {
        LaunchAttributes { mem_sync_domain: Some(domain), ..self }
    }

    /// Cooperative, or not.
    pub fn cooperative(self, cooperative: bool) -> LaunchAttributes {
        LaunchAttributes { cooperative, ..self }
    }

    /// Whether no attribute is set.
    pub fn is_empty(&self) -> bool {
        *self == LaunchAttributes::default()
    }

    /// The driver's attribute array: up to [`MAX_ATTRS`] entries, and how many are used. The
    /// values were checked (and refused where the headers lack them) before.
    fn to_raw(self) -> ([CUlaunchAttribute; MAX_ATTRS], usize) {
        let mut out: [CUlaunchAttribute; MAX_ATTRS] = Default::default();
        let mut n = 0;
        let mut put = |a: CUlaunchAttribute| {
            out[n] = a;
            n += 1;
        };
        let new = |id: CUlaunchAttributeID| CUlaunchAttribute { id, ..Default::default() };
        if self.programmatic_stream_serialization {
            let mut a = new(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
            a.value.programmaticStreamSerializationAllowed = 1;
            put(a);
        }
        #[cfg(cuda_12000)]
        if let Some(p) = self.priority {
            let mut a = new(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY);
            a.value.priority = p;
            put(a);
        }
        if let Some(w) = self.access_policy_window {
            let mut a = new(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW);
            a.value.accessPolicyWindow = cudrv_sys::CUaccessPolicyWindow {
                base_ptr: std::ptr::without_provenance_mut(w.base as usize),
                num_bytes: w.num_bytes,
                hitRatio: w.hit_ratio,
                hitProp: w.hit.raw(),
                missProp: w.miss.raw(),
            };
            put(a);
        }
        if let Some((x, y, z)) = self.cluster_dim {
            let mut a = new(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);
            a.value.clusterDim.x = x;
            a.value.clusterDim.y = y;
            a.value.clusterDim.z = z;
            put(a);
        }
        #[cfg(cuda_12080)]
        if let Some((x, y, z)) = self.preferred_cluster_dim {
            let mut a = new(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION);
            a.value.preferredClusterDim.x = x;
            a.value.preferredClusterDim.y = y;
            a.value.preferredClusterDim.z = z;
            put(a);
        }
        #[cfg(cuda_12000)]
        if let Some(d) = self.mem_sync_domain {
            let mut a = new(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN);
            a.value.memSyncDomain = match d {
                MemSyncDomain::Default => cudrv_sys::CUlaunchMemSyncDomain::CU_LAUNCH_MEM_SYNC_DOMAIN_DEFAULT,
                MemSyncDomain::Remote => cudrv_sys::CUlaunchMemSyncDomain::CU_LAUNCH_MEM_SYNC_DOMAIN_REMOTE,
            };
            put(a);
        }
        if self.cooperative {
            let mut a = new(CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE);
            a.value.cooperative = 1;
            put(a);
        }
        (out, n)
    }
}

/// The most attributes a launch passes.
const MAX_ATTRS: usize = 8;

/// A value that can be passed to a kernel parameter. See the [module documentation](self) for the
/// implementations.
///
/// # Safety
/// [`KernelArg::Value`] is copied bit for bit into the kernel's parameter: it must have no padding
/// bytes and be plain data the device may read. An implementation that hands the kernel device
/// memory must make that memory's free wait for work on `stream` (as [`DeviceBuffer::record_use`]
/// does) and must fail with [`Error::DeviceMismatch`] for memory the stream's device cannot use.
pub unsafe trait KernelArg {
    /// The parameter's value as the kernel sees it.
    type Value: Copy;

    /// The value to pass, for a launch on `stream`. Called once per launch, before it, with the
    /// stream's gate held: no capture begins or ends on `stream` until the launch is queued, so
    /// the implementation must not wait for another thread to begin one there, or to end one that
    /// `stream` takes part in (it would wait for ever).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for memory of another device; any error the implementation
    /// reports.
    fn kernel_value(&self, stream: &Stream) -> Result<Self::Value>;
}

// SAFETY: DeviceRepr values are padding-free plain data (DeviceRepr's contract); they refer to no
// memory cudrv manages.
unsafe impl<T: DeviceRepr> KernelArg for T {
    type Value = T;
    #[inline]
    fn kernel_value(&self, _stream: &Stream) -> Result<T> {
        Ok(*self)
    }
}

/// Buffers passed to kernels by device address: each records its use on the launch's stream
/// first (`record_use`), then passes its address.
macro_rules! by_address {
    ($($ty:ty;)*) => {$(
        // SAFETY: a device address (a `u64`, the kernel's pointer parameter). `record_use` first
        // orders the memory's free (and host access) after the launch's work, rejects streams of
        // other devices, and, during a capture, keeps the memory for the graph or refuses.
        unsafe impl<T: DeviceRepr> KernelArg for $ty {
            type Value = DevicePtr;
            #[inline]
            fn kernel_value(&self, stream: &Stream) -> Result<DevicePtr> {
                self.record_use(stream)?;
                Ok(self.as_raw())
            }
        }
    )*};
}

by_address! {
    &DeviceBuffer<T>;
    &mut DeviceBuffer<T>;
    DeviceView<'_, T>;
    &DeviceView<'_, T>;
    &DeviceBuffer2D<T>;
    &mut DeviceBuffer2D<T>;
    DeviceView2D<'_, T>;
    &DeviceBuffer3D<T>;
    &mut DeviceBuffer3D<T>;
    &ManagedBuffer<T>;
    &mut ManagedBuffer<T>;
    &IpcBuffer<T>;
    &mut IpcBuffer<T>;
}

mod sealed {
    pub trait Sealed {}
}

/// A kernel's whole argument list: a tuple of up to 12 [`KernelArg`]s (`()` for none).
///
/// # Safety
/// Implemented by cudrv only (the trait is sealed).
pub unsafe trait KernelArgs: sealed::Sealed {
    /// The number of parameters.
    const COUNT: usize;

    /// Computes every value (recording buffer uses on `stream`), lays out their addresses as a
    /// `kernelParams` array, and calls `f` with it; the values live until `f` returns.
    ///
    /// # Errors
    /// The first error of a [`KernelArg::kernel_value`] (then `f` is not called).
    #[doc(hidden)]
    fn with_params<R>(self, stream: &Stream, f: impl FnOnce(*mut *mut c_void) -> R) -> Result<R>;
}

macro_rules! kernel_args {
    ($n:literal; $($t:ident $v:ident $i:tt),*) => {
        impl<$($t: KernelArg),*> sealed::Sealed for ($($t,)*) {}

        // SAFETY: every pointer in the array points at a value that lives on this stack frame until
        // `f` returns.
        unsafe impl<$($t: KernelArg),*> KernelArgs for ($($t,)*) {
            const COUNT: usize = $n;

            #[inline]
            #[allow(unused_variables)]
            fn with_params<R>(self, stream: &Stream, f: impl FnOnce(*mut *mut c_void) -> R) -> Result<R> {
                $( let $v = self.$i.kernel_value(stream)?; )*
                let mut params: [*mut c_void; $n] = [$( (&raw const $v).cast_mut().cast::<c_void>() ),*];
                Ok(f(params.as_mut_ptr()))
            }
        }
    };
}

kernel_args!(0;);
kernel_args!(1; A a 0);
kernel_args!(2; A a 0, B b 1);
kernel_args!(3; A a 0, B b 1, C c 2);
kernel_args!(4; A a 0, B b 1, C c 2, D d 3);
kernel_args!(5; A a 0, B b 1, C c 2, D d 3, E e 4);
kernel_args!(6; A a 0, B b 1, C c 2, D d 3, E e 4, F f_ 5);
kernel_args!(7; A a 0, B b 1, C c 2, D d 3, E e 4, F f_ 5, G g 6);
kernel_args!(8; A a 0, B b 1, C c 2, D d 3, E e 4, F f_ 5, G g 6, H h 7);
kernel_args!(9; A a 0, B b 1, C c 2, D d 3, E e 4, F f_ 5, G g 6, H h 7, I i_ 8);
kernel_args!(10; A a 0, B b 1, C c 2, D d 3, E e 4, F f_ 5, G g 6, H h 7, I i_ 8, J j 9);
kernel_args!(11; A a 0, B b 1, C c 2, D d 3, E e 4, F f_ 5, G g 6, H h 7, I i_ 8, J j 9, K k 10);
kernel_args!(12; A a 0, B b 1, C c 2, D d 3, E e 4, F f_ 5, G g 6, H h 7, I i_ 8, J j 9, K k 10, L l 11);

/// Which driver entry point a launch goes through.
#[derive(Clone, Copy)]
enum Kind<'a> {
    Plain,
    Cooperative,
    /// `cuLaunchKernelEx` with these (checked) attributes.
    Ex(&'a LaunchAttributes),
}

impl Function {
    /// Checks `cfg` against the device's and the kernel's limits: every dimension at least 1, the
    /// block within the device's per-dimension maximum and within the kernel's (and the device's)
    /// maximum threads per block, the grid within the device's per-dimension maximum, and the
    /// dynamic plus static shared memory within what a block may opt in to. [`Function::launch`]
    /// does this first.
    ///
    /// # Errors
    /// [`Error::InvalidLaunch`] saying which limit is exceeded.
    pub fn validate(&self, cfg: &LaunchConfig) -> Result<()> {
        let limits = &self.module.limits;
        let block = [cfg.block.0, cfg.block.1, cfg.block.2];
        let grid = [cfg.grid.0, cfg.grid.1, cfg.grid.2];
        let max_threads = self.max_threads.min(limits.max_threads_per_block);
        let ok = block.iter().zip(limits.max_block).all(|(&b, m)| b >= 1 && b <= m)
            && grid.iter().zip(limits.max_grid).all(|(&g, m)| g >= 1 && g <= m)
            && cfg.threads_per_block() <= u64::from(max_threads)
            && u64::from(cfg.shared_mem_bytes) + u64::from(self.static_shared)
                <= u64::from(limits.shared_per_block_optin);
        if ok { Ok(()) } else { Err(self.config_error(cfg)) }
    }

    #[cold]
    fn config_error(&self, cfg: &LaunchConfig) -> Error {
        let limits = &self.module.limits;
        let block = [cfg.block.0, cfg.block.1, cfg.block.2];
        let grid = [cfg.grid.0, cfg.grid.1, cfg.grid.2];
        let dev = self.device().ordinal();
        let why = if block.contains(&0) || grid.contains(&0) {
            format!(
                "every grid and block dimension must be at least 1, got grid {:?} and block {:?}",
                cfg.grid, cfg.block
            )
        } else if let Some(axis) = (0..3).find(|&i| block[i] > limits.max_block[i]) {
            format!(
                "block {:?}: dimension {} is {}, device {dev} allows at most {}",
                cfg.block,
                ["x", "y", "z"][axis],
                block[axis],
                limits.max_block[axis]
            )
        } else if cfg.threads_per_block() > u64::from(limits.max_threads_per_block) {
            format!(
                "block {:?} has {} threads, device {dev} allows at most {} per block",
                cfg.block,
                cfg.threads_per_block(),
                limits.max_threads_per_block
            )
        } else if cfg.threads_per_block() > u64::from(self.max_threads) {
            format!(
                "block {:?} has {} threads, the kernel allows at most {} per block (its register use; \
                 see Function::attributes)",
                cfg.block,
                cfg.threads_per_block(),
                self.max_threads
            )
        } else if let Some(axis) = (0..3).find(|&i| grid[i] > limits.max_grid[i]) {
            format!(
                "grid {:?}: dimension {} is {}, device {dev} allows at most {}",
                cfg.grid,
                ["x", "y", "z"][axis],
                grid[axis],
                limits.max_grid[axis]
            )
        } else {
            format!(
                "{} bytes of dynamic shared memory plus the kernel's {} static bytes exceed the {} bytes \
                 device {dev} allows per block",
                cfg.shared_mem_bytes, self.static_shared, limits.shared_per_block_optin
            )
        };
        self.invalid_launch(why)
    }

    /// [`Error::InvalidLaunch`] of this kernel.
    fn invalid_launch(&self, reason: String) -> Error {
        Error::InvalidLaunch { kernel: self.name().to_string(), reason }
    }

    /// Launches the kernel on `stream` with `args` (`cuLaunchKernel`). Returns once the launch is
    /// queued.
    ///
    /// `cfg` is checked first ([`Function::validate`]), and the stream must belong to the kernel's
    /// device. Buffers in `args` have their use on `stream` recorded. Nothing is allocated.
    ///
    /// # Safety
    /// The caller promises that:
    /// * `args` match the kernel's parameters in number, order, size and meaning (a `&DeviceBuffer<T>`
    ///   for a `T*`, a `u64` for a `size_t`, ...);
    /// * every memory access the kernel makes with these arguments and this configuration stays
    ///   within the buffers passed (e.g. the element count passed is at most the buffer's length);
    /// * memory the kernel writes is not read or written concurrently by other work (host code,
    ///   or other streams not ordered with `stream`), and memory it reads is not written
    ///   concurrently: as everywhere in CUDA, the order between streams is the caller's;
    /// * the kernel terminates, and leaves the device in a state the rest of the program
    ///   expects (a kernel fault makes the context unusable).
    ///
    /// # Errors
    /// [`Error::InvalidLaunch`] for a configuration beyond the limits (nothing is launched);
    /// [`Error::DeviceMismatch`] when `stream`, or a buffer, belongs to another device; the driver's
    /// error.
    #[inline]
    pub unsafe fn launch<A: KernelArgs>(&self, cfg: LaunchConfig, stream: &Stream, args: A) -> Result<()> {
        self.validate(&cfg)?;
        self.check_stream(stream)?;
        // SAFETY: forwarded to the caller.
        unsafe { self.queue(&cfg, stream, args, Kind::Plain) }
    }

    /// Launches the kernel as a cooperative kernel (`cuLaunchCooperativeKernel`): all blocks are
    /// resident at once, so they may synchronise with each other (a grid-wide sync).
    ///
    /// Gated on [`crate::Capabilities::cooperative_launch`]. The grid must fit on the device at
    /// once: at most [`Function::max_active_blocks_per_multiprocessor`] × multiprocessors blocks,
    /// which is checked first.
    ///
    /// # Safety
    /// As [`Function::launch`].
    ///
    /// # Errors
    /// [`Error::Unsupported`] without cooperative launch; [`Error::InvalidLaunch`] for a
    /// configuration beyond the limits or a grid that does not fit at once; as [`Function::launch`].
    pub unsafe fn launch_cooperative<A: KernelArgs>(&self, cfg: LaunchConfig, stream: &Stream, args: A) -> Result<()> {
        self.validate(&cfg)?;
        self.check_stream(stream)?;
        self.check_cooperative(&cfg)?;
        // SAFETY: forwarded to the caller.
        unsafe { self.queue(&cfg, stream, args, Kind::Cooperative) }
    }

    /// Checks that the device can launch cooperatively and that the grid fits on it at once.
    fn check_cooperative(&self, cfg: &LaunchConfig) -> Result<()> {
        let device = self.device();
        if !device.capabilities()?.cooperative_launch {
            return Err(device.unsupported(
                "cooperative launch",
                "CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH is 0",
                Some("Function::launch, with the grid-wide synchronisation split into separate launches"),
            ));
        }
        let per_sm =
            self.max_active_blocks_per_multiprocessor(cfg.threads_per_block() as u32, cfg.shared_mem_bytes as usize)?;
        let fits = u64::from(per_sm) * u64::from(self.module.limits.multiprocessors);
        if cfg.blocks() > fits {
            return Err(self.invalid_launch(format!(
                "cooperative launch: grid {:?} has {} blocks, but only {fits} blocks of {} threads \
                 ({per_sm} per multiprocessor × {} multiprocessors) can be resident at once on device {}",
                cfg.grid,
                cfg.blocks(),
                cfg.threads_per_block(),
                self.module.limits.multiprocessors,
                device.ordinal()
            )));
        }
        Ok(())
    }

    /// Launches the kernel with thread-block clusters of `cluster` blocks
    /// (`cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`): the blocks of a cluster
    /// run together on one GPU processing cluster and can share distributed shared memory.
    ///
    /// Needs a driver with `cuLaunchKernelEx` (CUDA 11.8 and later) and
    /// [`crate::Capabilities::cluster_launch`] (compute capability 9.0 and later). Each cluster
    /// dimension must be at least 1 and divide the grid's; a cluster has at most 8 blocks (the
    /// portable size), or 16 when the kernel allows non-portable sizes
    /// ([`Function::set_non_portable_cluster_size_allowed`]).
    ///
    /// # Safety
    /// As [`Function::launch`].
    ///
    /// # Errors
    /// [`Error::MissingSymbol`] without `cuLaunchKernelEx`; [`Error::Unsupported`] without cluster
    /// support; [`Error::InvalidLaunch`] for a cluster that does not divide the grid or is too
    /// large; as [`Function::launch`].
    pub unsafe fn launch_cluster<A: KernelArgs>(
        &self,
        cfg: LaunchConfig,
        cluster: (u32, u32, u32),
        stream: &Stream,
        args: A,
    ) -> Result<()> {
        self.validate(&cfg)?;
        self.check_stream(stream)?;
        self.check_cluster(&cfg, cluster)?;
        let attrs = LaunchAttributes::new().cluster_dim(cluster);
        // SAFETY: forwarded to the caller.
        unsafe { self.queue(&cfg, stream, args, Kind::Ex(&attrs)) }
    }

    /// Checks cluster support, and that `cluster` fits the grid and the kernel.
    fn check_cluster(&self, cfg: &LaunchConfig, cluster: (u32, u32, u32)) -> Result<()> {
        self.check_cluster_support()?;
        let dims = [cluster.0, cluster.1, cluster.2];
        let grid = [cfg.grid.0, cfg.grid.1, cfg.grid.2];
        let bad = |why: String| self.invalid_launch(format!("cluster {cluster:?}: {why}"));
        if dims.contains(&0) {
            return Err(bad("every cluster dimension must be at least 1".into()));
        }
        if let Some(axis) = (0..3).find(|&i| !grid[i].is_multiple_of(dims[i])) {
            return Err(bad(format!(
                "the grid {:?} is not a multiple of the cluster in dimension {}",
                cfg.grid,
                ["x", "y", "z"][axis]
            )));
        }
        // Saturating: each dimension divides the grid's, within the device's limits, which a driver may
        // report beyond any real device's (the product of three could wrap to a small size).
        let size = u64::from(dims[0]).saturating_mul(u64::from(dims[1])).saturating_mul(u64::from(dims[2]));
        if size > 16 {
            return Err(bad(format!("{size} blocks per cluster; the most any device allows is 16")));
        }
        if size > 8 && self.attribute(FA::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED)? == 0 {
            return Err(bad(format!(
                "{size} blocks per cluster exceed the portable size of 8; allow more with \
                 Function::set_non_portable_cluster_size_allowed(true)"
            )));
        }
        Ok(())
    }

    /// Launches the kernel with launch `attrs` (`cuLaunchKernelEx`). Returns once the launch is
    /// queued.
    ///
    /// `cfg` is checked as in [`Function::launch`]; every attribute is checked against the device
    /// and the driver first ([`LaunchAttributes`] says what each needs), and a cluster shape or
    /// cooperative grid as in [`Function::launch_cluster`] and [`Function::launch_cooperative`].
    ///
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
    /// use cudrv::{Device, Stream, launch::{LaunchAttributes, LaunchConfig}, memory::DeviceBuffer, module::Module};
    /// let device = Device::get(0)?;
    /// let module = Module::from_ptx(&device, include_str!("../examples/kernels/vector_add.ptx"))?;
    /// let fill = module.function("fill_u32")?;
    /// let stream = Stream::new(&device)?;
    /// let mut out = DeviceBuffer::<u32>::zeroed(4096, &stream)?;
    /// let (_, highest) = device.capabilities()?.stream_priority_range;
    /// let attrs = LaunchAttributes::new().priority(highest);
    /// // SAFETY: fill_u32 takes (u32* out, u32 value, u64 n) and writes out[0..n].
    /// unsafe { fill.launch_with(LaunchConfig::for_num_elems(4096), &attrs, &stream, (&mut out, 7u32, 4096u64))? };
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Safety
    /// As [`Function::launch`], and, with
    /// [`programmatic_stream_serialization`](LaunchAttributes::programmatic_stream_serialization):
    /// the kernel may run while the kernel queued before it on `stream` still runs, so before it
    /// touches memory that kernel may read or write it must wait for it (`griddepcontrol.wait`,
    /// `cudaGridDependencySynchronize()`). That includes memory freed on `stream` after that
    /// kernel and allocated again for this one: cudrv's memory resources reuse memory in stream
    /// order, which the overlap relaxes.
    ///
    /// # Errors
    /// [`Error::MissingSymbol`] without `cuLaunchKernelEx`; [`Error::Unsupported`] for an attribute
    /// the device or the driver lacks; [`Error::InvalidPriority`] for a priority outside the
    /// device's range; [`Error::InvalidLaunch`] for a value out of range (nothing is launched);
    /// as [`Function::launch`].
    pub unsafe fn launch_with<A: KernelArgs>(
        &self,
        cfg: LaunchConfig,
        attrs: &LaunchAttributes,
        stream: &Stream,
        args: A,
    ) -> Result<()> {
        self.validate(&cfg)?;
        self.check_stream(stream)?;
        self.check_attributes(&cfg, attrs)?;
        // SAFETY: forwarded to the caller.
        unsafe { self.queue(&cfg, stream, args, Kind::Ex(attrs)) }
    }

    /// Checks every attribute against the device, the driver and the headers.
    fn check_attributes(&self, cfg: &LaunchConfig, attrs: &LaunchAttributes) -> Result<()> {
        let d = driver()?;
        if !d.has("cuLaunchKernelEx") {
            return Err(Error::MissingSymbol { name: "cuLaunchKernelEx", driver_version: d.version() });
        }
        let device = self.device();
        let caps = device.capabilities()?;
        let (major, minor) = caps.compute_capability;
        let bad = |why: String| self.invalid_launch(why);
        if attrs.programmatic_stream_serialization && !caps.programmatic_dependent_launch {
            return Err(device.unsupported(
                "programmatic dependent launch",
                format!("it needs compute capability 9.0 or newer; the device has {major}.{minor}"),
                Some("a launch without it (the kernel then starts once the previous one is done)"),
            ));
        }
        if let Some(p) = attrs.priority {
            needs_cuda_12(&device, "launch priority", d.version(), Some("Stream::with_priority"))?;
            let (least, greatest) = caps.stream_priority_range;
            if p < greatest || p > least {
                return Err(Error::InvalidPriority { requested: p, device: device.ordinal_i32(), least, greatest });
            }
        }
        if let Some(w) = attrs.access_policy_window {
            let max = caps.max_access_policy_window_size;
            if max == 0 {
                return Err(device.unsupported(
                    "L2 access-policy windows",
                    format!(
                        "CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE is 0 (they need compute capability 8.0; \
                         the device has {major}.{minor})"
                    ),
                    Some("a launch without one (it is only a cache hint)"),
                ));
            }
            if w.base == 0 || w.num_bytes == 0 || w.num_bytes > max {
                return Err(bad(format!(
                    "the access-policy window {:#x} + {} bytes must be non-empty, start at a device address, \
                     and span at most {max} bytes on device {}",
                    w.base,
                    w.num_bytes,
                    device.ordinal()
                )));
            }
            if !(0.0..=1.0).contains(&w.hit_ratio) {
                return Err(bad(format!("the access-policy hit ratio {} is not within 0.0..=1.0", w.hit_ratio)));
            }
        }
        if let Some(c) = attrs.cluster_dim {
            self.check_cluster(cfg, c)?;
        }
        if let Some(p) = attrs.preferred_cluster_dim {
            if !caps.preferred_cluster_dimension {
                let reason = if !cfg!(cuda_12080) {
                    "cudrv was built against headers older than CUDA 12.8, which lack it".to_string()
                } else if !caps.cluster_launch {
                    "the device has no thread-block clusters".to_string()
                } else {
                    format!("the driver ({}) predates CUDA 12.8", crate::version_string(d.version()))
                };
                return Err(device.unsupported(
                    "a preferred cluster dimension",
                    reason,
                    Some("LaunchAttributes::cluster_dim alone"),
                ));
            }
            let Some(c) = attrs.cluster_dim else {
                return Err(bad("a preferred cluster dimension needs a cluster dimension (cluster_dim) too".into()));
            };
            let (pd, cd, grid) = ([p.0, p.1, p.2], [c.0, c.1, c.2], [cfg.grid.0, cfg.grid.1, cfg.grid.2]);
            if (0..3).any(|i| pd[i] == 0 || !pd[i].is_multiple_of(cd[i]) || !grid[i].is_multiple_of(pd[i])) {
                return Err(bad(format!(
                    "the preferred cluster {p:?} must be a multiple of the cluster {c:?} and divide the grid {:?}",
                    cfg.grid
                )));
            }
        }
        if attrs.mem_sync_domain.is_some() {
            needs_cuda_12(&device, "memory synchronisation domains", d.version(), None)?;
            if caps.mem_sync_domain_count < 2 {
                return Err(device.unsupported(
                    "memory synchronisation domains",
                    format!(
                        "CU_DEVICE_ATTRIBUTE_MEM_SYNC_DOMAIN_COUNT is {} (they need compute capability 9.0; \
                         the device has {major}.{minor})",
                        caps.mem_sync_domain_count
                    ),
                    Some("a launch in the default domain"),
                ));
            }
        }
        if attrs.cooperative {
            self.check_cooperative(cfg)?;
        }
        Ok(())
    }

    /// The most clusters of `cluster` blocks (each block as `cfg` says) that can be resident on
    /// the device at once (`cuOccupancyMaxActiveClusters`).
    ///
    /// # Errors
    /// As [`Function::launch_cluster`] for the configuration and the cluster (without a stream);
    /// [`Error::MissingSymbol`] with a driver older than CUDA 12.0; the driver's error.
    pub fn max_active_clusters(&self, cfg: LaunchConfig, cluster: (u32, u32, u32)) -> Result<u32> {
        self.validate(&cfg)?;
        self.check_cluster(&cfg, cluster)?;
        let (mut attrs, n) = LaunchAttributes::new().cluster_dim(cluster).to_raw();
        let config = raw_config(&cfg, std::ptr::null_mut(), &mut attrs, n);
        let _b = self.context().bind()?;
        let mut clusters = 0;
        // SAFETY: valid out-pointer; a function of live code; a configuration whose attribute
        // array lives during the call; the context is current.
        unsafe { crate::result::drv!(cuOccupancyMaxActiveClusters(&mut clusters, self.raw, &config)) }?;
        Ok(u32::try_from(clusters).unwrap_or(0))
    }

    /// The largest cluster (in blocks) that a launch of `cfg` could use, given the kernel's
    /// resources and the device (`cuOccupancyMaxPotentialClusterSize`): 8 on most devices, up to
    /// 16 where the kernel allows non-portable sizes.
    ///
    /// # Errors
    /// As [`Function::max_active_clusters`].
    pub fn max_potential_cluster_size(&self, cfg: LaunchConfig) -> Result<u32> {
        self.check_cluster_support()?;
        self.validate(&cfg)?;
        let mut attrs: [CUlaunchAttribute; MAX_ATTRS] = Default::default();
        let config = raw_config(&cfg, std::ptr::null_mut(), &mut attrs, 0);
        let _b = self.context().bind()?;
        let mut size = 0;
        // SAFETY: valid out-pointer; a function of live code; a configuration without
        // attributes; the context is current.
        unsafe { crate::result::drv!(cuOccupancyMaxPotentialClusterSize(&mut size, self.raw, &config)) }?;
        Ok(u32::try_from(size).unwrap_or(0))
    }

    /// Lets launches of this kernel use clusters of more than 8 blocks (up to 16, on devices that
    /// support it: `CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED`).
    ///
    /// # Errors
    /// As [`Function::launch_cluster`] without cluster support; the driver's error.
    pub fn set_non_portable_cluster_size_allowed(&self, allowed: bool) -> Result<()> {
        self.check_cluster_support()?;
        let _b = self.context().bind()?;
        // SAFETY: a function of a loaded module; a 0/1 value; the context is current.
        let rc = unsafe {
            driver()?.cuFuncSetAttribute(
                self.raw,
                FA::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                i32::from(allowed),
            )
        };
        check("cuFuncSetAttribute", rc)
    }

    /// Launches the kernel with a prepared `kernelParams` array (`cuLaunchKernel`), for argument
    /// lists known only at run time. The configuration and the stream's device are checked as in
    /// [`Function::launch`], but no buffer use is recorded: call [`DeviceBuffer::record_use`] for
    /// buffers of other streams.
    ///
    /// # Safety
    /// As [`Function::launch`], and: `params` has one entry per kernel parameter, each pointing at
    /// a value of the parameter's size and layout, valid during the call.
    ///
    /// # Errors
    /// As [`Function::launch`].
    pub unsafe fn launch_raw(&self, cfg: LaunchConfig, stream: &Stream, params: &mut [*mut c_void]) -> Result<()> {
        self.validate(&cfg)?;
        self.check_stream(stream)?;
        let gate = stream.key().enter();
        // SAFETY: forwarded to the caller.
        unsafe { self.enqueue(&cfg, stream, params.as_mut_ptr(), Kind::Plain, &gate) }
    }

    #[inline]
    fn check_stream(&self, stream: &Stream) -> Result<()> {
        if std::sync::Arc::ptr_eq(stream.context(), self.context()) {
            return Ok(());
        }
        Err(Error::DeviceMismatch {
            what: "Function::launch (the stream must belong to the kernel's device)",
            expected: self.device().ordinal_i32(),
            found: stream.device().ordinal_i32(),
        })
    }

    fn check_cluster_support(&self) -> Result<()> {
        let d = driver()?;
        if !d.has("cuLaunchKernelEx") {
            return Err(Error::MissingSymbol { name: "cuLaunchKernelEx", driver_version: d.version() });
        }
        let device = self.device();
        let caps = device.capabilities()?;
        if !caps.cluster_launch {
            let (major, minor) = caps.compute_capability;
            let reason = if major < 9 {
                format!("thread-block clusters need compute capability 9.0 or newer; the device has {major}.{minor}")
            } else {
                "CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH is 0".to_string()
            };
            return Err(device.unsupported("thread-block clusters", reason, Some("Function::launch without clusters")));
        }
        Ok(())
    }

    /// Lays out `args` (recording the buffers' uses on `stream`) and queues the launch.
    ///
    /// # Safety
    /// `args` match the kernel's parameters; the launch satisfies [`Function::launch`]'s
    /// promises; `cfg` was validated and the stream belongs to the kernel's context.
    #[inline]
    unsafe fn queue<A: KernelArgs>(&self, cfg: &LaunchConfig, stream: &Stream, args: A, kind: Kind<'_>) -> Result<()> {
        // Held from the arguments' looks at the stream's capture (their `record_use`) to the
        // launch: a capture begun in between would take the launch, and its graph would not keep
        // buffers that saw no capture.
        let gate = stream.key().enter();
        // SAFETY: forwarded to the caller; `with_params` lays out a `kernelParams` array valid
        // during the call.
        args.with_params(stream, |params| unsafe { self.enqueue(cfg, stream, params, kind, &gate) })?
    }

    /// Queues the launch, with its arguments laid out. `_gate` is `stream`'s, held by the caller:
    /// no capture begins or ends between the launch and the look at the stream's capture after it
    /// (`keep_for_capture`), so no launch is captured unseen, to run at the graph's launches with
    /// its module perhaps unloaded.
    ///
    /// # Safety
    /// `params` is a valid `kernelParams` array for the kernel (or unused by it), valid during
    /// the call; the launch satisfies [`Function::launch`]'s promises; `cfg` was validated and the
    /// stream belongs to the kernel's context.
    #[inline]
    unsafe fn enqueue(
        &self,
        cfg: &LaunchConfig,
        stream: &Stream,
        params: *mut *mut c_void,
        kind: Kind<'_>,
        _gate: &Gate<'_>,
    ) -> Result<()> {
        let _b = self.context().bind()?;
        let d = driver()?;
        let (g, b, s) = (cfg.grid, cfg.block, stream.as_raw());
        let (call, rc) = match kind {
            // SAFETY: a function of a loaded module of the current context, a stream of that
            // context, a validated configuration, and a parameter array valid during the call
            // (the caller's promise).
            Kind::Plain => ("cuLaunchKernel", unsafe {
                d.cuLaunchKernel(
                    self.raw,
                    g.0,
                    g.1,
                    g.2,
                    b.0,
                    b.1,
                    b.2,
                    cfg.shared_mem_bytes,
                    s,
                    params,
                    std::ptr::null_mut(),
                )
            }),
            // SAFETY: as above.
            Kind::Cooperative => ("cuLaunchCooperativeKernel", unsafe {
                d.cuLaunchCooperativeKernel(self.raw, g.0, g.1, g.2, b.0, b.1, b.2, cfg.shared_mem_bytes, s, params)
            }),
            Kind::Ex(attrs) => {
                let (mut raw, n) = attrs.to_raw();
                let config = raw_config(cfg, s, &mut raw, n);
                // SAFETY: as above; `config` and the attributes it points at live during the call.
                ("cuLaunchKernelEx", unsafe { d.cuLaunchKernelEx(&config, self.raw, params, std::ptr::null_mut()) })
            }
        };
        match rc {
            Ok(CUresult::CUDA_SUCCESS) => {
                self.keep_for_capture(stream);
                Ok(())
            }
            _ => Err(self.launch_error(call, rc, cfg)),
        }
    }

    /// A launch captured into a graph runs at each of the graph's launches: the graph keeps the
    /// kernel's module loaded until they are done, whenever the `Function` and `Module` go.
    #[inline]
    fn keep_for_capture(&self, stream: &Stream) {
        if stream.key().capture_id() != 0
            && let Some(session) = stream.capture()
        {
            session.res.keep(self.module.clone());
        }
    }

    /// Turns a failed launch into an error, explaining the usual cause of an `INVALID_VALUE`:
    /// dynamic shared memory above the kernel's limit.
    #[cold]
    fn launch_error(
        &self,
        call: &'static str,
        rc: std::result::Result<CUresult, cudrv_sys::MissingSymbol>,
        cfg: &LaunchConfig,
    ) -> Error {
        let err = match check(call, rc) {
            Err(e) => e,
            Ok(()) => return self.invalid_launch("the driver failed without a code".into()),
        };
        if err.code() == Some(CUresult::CUDA_ERROR_INVALID_VALUE)
            && cfg.shared_mem_bytes > 0
            && let Ok(limit) = self.attribute(FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            && i64::from(cfg.shared_mem_bytes) > i64::from(limit)
        {
            return self.invalid_launch(format!(
                "{} bytes of dynamic shared memory exceed the kernel's limit of {limit} bytes; raise it with \
                 Function::set_max_dynamic_shared_memory ({err})",
                cfg.shared_mem_bytes
            ));
        }
        err
    }
}

/// A `CUlaunchConfig` for `cfg` on `stream` with the first `n` of `attrs`.
fn raw_config(
    cfg: &LaunchConfig,
    stream: cudrv_sys::CUstream,
    attrs: &mut [CUlaunchAttribute; MAX_ATTRS],
    n: usize,
) -> CUlaunchConfig {
    CUlaunchConfig {
        gridDimX: cfg.grid.0,
        gridDimY: cfg.grid.1,
        gridDimZ: cfg.grid.2,
        blockDimX: cfg.block.0,
        blockDimY: cfg.block.1,
        blockDimZ: cfg.block.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream,
        attrs: if n == 0 { std::ptr::null_mut() } else { attrs.as_mut_ptr() },
        numAttrs: n as u32,
    }
}

/// Refuses `feature` where the headers or the driver predate CUDA 12.0.
fn needs_cuda_12(
    device: &Device,
    feature: &'static str,
    version: i32,
    alternative: Option<&'static str>,
) -> Result<()> {
    if !cfg!(cuda_12000) {
        return Err(device.unsupported(feature, "cudrv was built against headers older than CUDA 12.0", alternative));
    }
    if version < 12000 {
        return Err(device.unsupported(
            feature,
            format!("the driver ({}) predates CUDA 12.0", crate::version_string(version)),
            alternative,
        ));
    }
    Ok(())
}

#[cfg(cuda_12000)]
impl crate::module::Kernel {
    /// Launches the kernel on `stream`'s device: [`Kernel::function`](crate::module::Kernel::function)
    /// of that device, then [`Function::launch`].
    ///
    /// # Safety
    /// As [`Function::launch`].
    ///
    /// # Errors
    /// As [`Kernel::function`](crate::module::Kernel::function) and [`Function::launch`].
    pub unsafe fn launch<A: KernelArgs>(&self, cfg: LaunchConfig, stream: &Stream, args: A) -> Result<()> {
        let f = self.function(&stream.device())?;
        // SAFETY: forwarded to the caller.
        unsafe { f.launch(cfg, stream, args) }
    }
}

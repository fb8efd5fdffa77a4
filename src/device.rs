//! Devices, their attributes, their driver model and their capabilities.

use std::ffi::{CStr, c_char};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudrv_sys::{CUdevice, CUdevice_attribute as A};

use crate::error::{Error, Result};
use crate::result::{driver, drv, drv_compat};

/// A CUDA device (a GPU), by ordinal.
///
/// Getting one initialises the driver on first use, so no driver call can come before `cuInit`.
/// `Device` is a plain value: `Copy`, `Send` and `Sync`.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// for device in cudrv::Device::all()? {
///     println!("{}: {} ({:?})", device.ordinal(), device.name()?, device.driver_model()?);
/// }
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Device {
    ordinal: i32,
    raw: CUdevice,
}

#[cfg(test)]
impl Device {
    /// Device 0 without asking the driver, for unit tests that make no driver call.
    pub(crate) fn detached() -> Device {
        Device { ordinal: 0, raw: 0 }
    }
}

/// How the operating system drives a device.
///
/// On Windows a device runs under WDDM (display and compute), TCC (compute only, the default on
/// data-centre GPUs) or MCDM (Microsoft's compute-only model, which NVIDIA now prefers to TCC).
/// The driver API tells only TCC apart (`CU_DEVICE_ATTRIBUTE_TCC_DRIVER`); MCDM can be told from
/// WDDM only through NVML (`nvmlDeviceGetDriverModel_v2`), which cudrv does not load. An MCDM
/// device therefore reports [`DriverModel::Wddm`]. Nothing in cudrv depends on the model itself:
/// every feature is gated on the device's own attributes (memory pools above all).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DriverModel {
    /// Linux (and other non-Windows systems, and WSL).
    Linux,
    /// Windows Display Driver Model (also MCDM; see above).
    Wddm,
    /// Windows Tesla Compute Cluster: no memory pools, no concurrent managed access.
    Tcc,
}

impl fmt::Display for DriverModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DriverModel::Linux => "Linux",
            DriverModel::Wddm => "WDDM",
            DriverModel::Tcc => "TCC",
        })
    }
}

impl Device {
    /// The number of devices.
    ///
    /// # Errors
    /// [`Error::DriverNotFound`] without a driver; the driver's error when `cuInit` fails.
    pub fn count() -> Result<usize> {
        let mut n = 0;
        crate::host_fn::refuse_in_host_fn("Device::count")?;
        // SAFETY: `n` is a valid out-pointer.
        unsafe { drv!(cuDeviceGetCount(&mut n)) }?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The device with this ordinal.
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_DEVICE` for an ordinal past [`Device::count`].
    pub fn get(ordinal: usize) -> Result<Device> {
        let ordinal = i32::try_from(ordinal)
            .map_err(|_| Error::InvalidArgument(format!("device ordinal {ordinal} is too large")))?;
        let mut raw = 0;
        crate::host_fn::refuse_in_host_fn("Device::get")?;
        // SAFETY: `raw` is a valid out-pointer; the driver validates the ordinal.
        unsafe { drv!(cuDeviceGet(&mut raw, ordinal)) }?;
        Ok(Device { ordinal, raw })
    }

    /// Every device, in ordinal order.
    ///
    /// # Errors
    /// As [`Device::count`].
    pub fn all() -> Result<Vec<Device>> {
        (0..Self::count()?).map(Self::get).collect()
    }

    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal as usize
    }

    pub(crate) fn ordinal_i32(&self) -> i32 {
        self.ordinal
    }

    /// The raw `CUdevice`.
    pub fn as_raw(&self) -> CUdevice {
        self.raw
    }

    /// The device's name (`NVIDIA H200`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        crate::host_fn::refuse_in_host_fn("Device::name")?;
        // SAFETY: the buffer is valid for its length, which is passed.
        unsafe { drv!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.raw)) }?;
        // The driver wrote a NUL-terminated string; the last byte is forced to NUL in case not.
        buf[255] = 0;
        // SAFETY: the buffer holds a NUL-terminated string (its last byte at least is NUL).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// The device's UUID (16 bytes).
    ///
    /// # Errors
    /// The driver's error.
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let mut uuid = cudrv_sys::CUuuid::default();
        crate::host_fn::refuse_in_host_fn("Device::uuid")?;
        // SAFETY: `uuid` is a valid out-pointer. Both variants take the same arguments; drivers
        // before 11.4 have only the first (the second reports MIG instances' own UUIDs).
        unsafe { drv_compat!(cuDeviceGetUuid_v2 | cuDeviceGetUuid(&mut uuid, self.raw)) }?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// The UUID as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi` prints it.
    ///
    /// # Errors
    /// The driver's error.
    pub fn uuid_string(&self) -> Result<String> {
        let u = self.uuid()?;
        let hex: String = u.iter().map(|b| format!("{b:02x}")).collect();
        Ok(format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32]))
    }

    /// The PCI bus id (`0000:3b:00.0`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as c_char; 64];
        crate::host_fn::refuse_in_host_fn("Device::pci_bus_id")?;
        // SAFETY: the buffer is valid for its length, which is passed.
        unsafe { drv!(cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.raw)) }?;
        buf[63] = 0;
        // SAFETY: NUL-terminated (see above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// Total device memory in bytes.
    ///
    /// # Errors
    /// The driver's error.
    pub fn total_memory(&self) -> Result<usize> {
        let mut bytes = 0;
        crate::host_fn::refuse_in_host_fn("Device::total_memory")?;
        // SAFETY: `bytes` is a valid out-pointer.
        unsafe { drv!(cuDeviceTotalMem_v2(&mut bytes, self.raw)) }?;
        Ok(bytes)
    }

    /// Free and total device memory, in bytes, as the driver sees them now (`cuMemGetInfo`).
    ///
    /// `free` counts what no allocation holds, in this process or any other: memory that a pool
    /// ([`crate::memory::DriverPool`], [`crate::memory::StreamOrderedPool`]) keeps cached for
    /// reuse is not free here. `total` is what the device offers (slightly less than
    /// [`Device::total_memory`] on some systems).
    ///
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
    /// let info = cudrv::Device::get(0)?.memory_info()?;
    /// println!("{info}"); // "1.3 GiB free of 139.8 GiB"
    /// assert!(info.free <= info.total);
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        let ctx = self.primary_context()?;
        let _b = ctx.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers; the device's context is current.
        unsafe { drv!(cuMemGetInfo_v2(&mut free, &mut total)) }?;
        Ok(MemoryInfo { free, total })
    }

    /// A raw attribute (`cuDeviceGetAttribute`).
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_VALUE` for an attribute this driver does not know.
    pub fn attribute(&self, attribute: A) -> Result<i32> {
        let mut v = 0;
        crate::host_fn::refuse_in_host_fn("Device::attribute")?;
        // SAFETY: `v` is a valid out-pointer; the driver validates the attribute.
        unsafe { drv!(cuDeviceGetAttribute(&mut v, attribute, self.raw)) }?;
        Ok(v)
    }

    /// An attribute that older drivers may not know: `CUDA_ERROR_INVALID_VALUE` reads as 0.
    fn attribute_or_zero(&self, attribute: A) -> Result<i32> {
        match self.attribute(attribute) {
            Err(e) if e.code() == Some(cudrv_sys::CUresult::CUDA_ERROR_INVALID_VALUE) => Ok(0),
            other => other,
        }
    }

    fn flag(&self, attribute: A) -> Result<bool> {
        Ok(self.attribute_or_zero(attribute)? != 0)
    }

    /// The compute capability as (major, minor): (9, 0) on an H100 or H200.
    ///
    /// # Errors
    /// The driver's error.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// The number of streaming multiprocessors.
    ///
    /// # Errors
    /// The driver's error.
    pub fn multiprocessor_count(&self) -> Result<i32> {
        self.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    }

    /// The most threads a block may have.
    ///
    /// # Errors
    /// The driver's error.
    pub fn max_threads_per_block(&self) -> Result<i32> {
        self.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
    }

    /// The largest block, per dimension.
    ///
    /// # Errors
    /// The driver's error.
    pub fn max_block_dim(&self) -> Result<[i32; 3]> {
        Ok([
            self.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
        ])
    }

    /// The largest grid, per dimension.
    ///
    /// # Errors
    /// The driver's error.
    pub fn max_grid_dim(&self) -> Result<[i32; 3]> {
        Ok([
            self.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
        ])
    }

    /// The most shared memory a block may opt in to, in bytes.
    ///
    /// # Errors
    /// The driver's error.
    pub fn max_shared_memory_per_block_optin(&self) -> Result<i32> {
        self.attribute_or_zero(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    }

    /// The driver model: [`DriverModel::Tcc`] when `CU_DEVICE_ATTRIBUTE_TCC_DRIVER` is 1,
    /// otherwise WDDM on Windows and Linux elsewhere.
    ///
    /// # Errors
    /// The driver's error.
    pub fn driver_model(&self) -> Result<DriverModel> {
        Ok(if self.flag(A::CU_DEVICE_ATTRIBUTE_TCC_DRIVER)? {
            DriverModel::Tcc
        } else if cfg!(windows) {
            DriverModel::Wddm
        } else {
            DriverModel::Linux
        })
    }

    /// What this device supports, read once and cached for the life of the process.
    ///
    /// # Errors
    /// The driver's error on the first read.
    pub fn capabilities(&self) -> Result<&'static Capabilities> {
        static CACHE: OnceLock<Vec<OnceLock<Capabilities>>> = OnceLock::new();
        let cache = match CACHE.get() {
            Some(cache) => cache,
            None => {
                let count = Self::count()?;
                CACHE.get_or_init(|| (0..count).map(|_| OnceLock::new()).collect())
            }
        };
        let slot = cache
            .get(self.ordinal())
            .ok_or_else(|| Error::InvalidArgument(format!("device {} is not in the device list", self.ordinal)))?;
        if let Some(caps) = slot.get() {
            return Ok(caps);
        }
        let caps = Capabilities::read(self)?;
        Ok(slot.get_or_init(|| caps))
    }

    /// Whether this device can access memory of `peer` directly (`cuDeviceCanAccessPeer`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer == self {
            return Ok(true);
        }
        let mut v = 0;
        crate::host_fn::refuse_in_host_fn("Device::can_access_peer")?;
        // SAFETY: `v` is a valid out-pointer.
        unsafe { drv!(cuDeviceCanAccessPeer(&mut v, self.raw, peer.raw)) }?;
        Ok(v != 0)
    }

    /// Lets this device's context access memory of `peer` directly (`cuCtxEnablePeerAccess`).
    /// Idempotent: enabling it again, or for the device itself, is `Ok`.
    ///
    /// Peer access belongs to the device's primary context and ends when that context is
    /// destroyed, which happens when the last cudrv object holding it goes. So that access
    /// enabled here lasts, cudrv keeps both devices' primary contexts from here on, for the life
    /// of the process.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when [`Device::can_access_peer`] says no; the driver's error.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer == self {
            return Ok(());
        }
        if !self.can_access_peer(peer)? {
            return Err(self.unsupported(
                "peer access",
                format!("cuDeviceCanAccessPeer says device {} cannot access device {}", self.ordinal, peer.ordinal),
                Some("DeviceBuffer::copy_to_peer, which copies through the driver without peer access"),
            ));
        }
        let own = self.primary_context()?;
        let other = peer.primary_context()?;
        {
            let _b = own.bind()?;
            // SAFETY: `other` is a retained primary context; flags must be 0.
            match unsafe { drv!(cuCtxEnablePeerAccess(other.as_raw(), 0)) } {
                Err(e) if e.code() == Some(cudrv_sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) => {}
                other => other?,
            }
        }
        keep_for_peer_access([own, other]);
        Ok(())
    }

    /// An [`Error::Unsupported`] for this device.
    pub(crate) fn unsupported(
        &self,
        feature: &'static str,
        reason: impl Into<String>,
        alternative: Option<&'static str>,
    ) -> Error {
        Error::Unsupported { feature, device: self.ordinal, reason: reason.into(), alternative }
    }
}

/// Keeps primary contexts for the life of the process: peer access enabled in one lasts only
/// while it exists ([`Device::enable_peer_access`]). One per device at most.
fn keep_for_peer_access(contexts: [Arc<crate::Context>; 2]) {
    static KEPT: Mutex<Vec<Arc<crate::Context>>> = Mutex::new(Vec::new());
    let mut kept = KEPT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for ctx in contexts {
        if !kept.iter().any(|k| Arc::ptr_eq(k, &ctx)) {
            kept.push(ctx);
        }
    }
}

/// Free and total device memory, as [`Device::memory_info`] reads them.
///
/// ```
/// let info = cudrv::device::MemoryInfo { free: 3 << 29, total: 4 << 30 };
/// assert_eq!(info.used(), 2_684_354_560);
/// assert_eq!(info.to_string(), "1.5 GiB free of 4.0 GiB");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemoryInfo {
    /// Bytes no allocation holds.
    pub free: usize,
    /// Bytes the device offers.
    pub total: usize,
}

impl MemoryInfo {
    /// Bytes in use: `total - free`.
    pub fn used(&self) -> usize {
        self.total.saturating_sub(self.free)
    }
}

impl fmt::Display for MemoryInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |n: usize| n as f64 / f64::from(1u32 << 30);
        write!(f, "{:.1} GiB free of {:.1} GiB", gib(self.free), gib(self.total))
    }
}

/// What a device supports, as [`Device::capabilities`] reads it. Every cudrv API that needs one
/// of these checks it first and returns [`Error::Unsupported`] when it is missing.
///
/// Its `Display` prints a readable report.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The device's ordinal.
    pub device: usize,
    /// The driver model.
    pub driver_model: DriverModel,
    /// The driver version (`13000` for 13.0).
    pub driver_version: i32,
    /// The compute capability.
    pub compute_capability: (i32, i32),
    /// Stream-ordered memory pools (`cuMemAllocAsync`): the attribute is 1 and the driver has
    /// the functions.
    pub memory_pools: bool,
    /// The handle types pools can export (`CUmemAllocationHandleType` bits; 0 on TCC).
    pub memory_pool_handle_types: u32,
    /// Virtual memory management (`cuMemCreate`, `cuMemMap`).
    pub virtual_memory_management: bool,
    /// Managed memory (`cuMemAllocManaged`).
    pub managed_memory: bool,
    /// The host and device may touch managed memory at the same time (0 on Windows).
    pub concurrent_managed_access: bool,
    /// The device can read pageable host memory directly (HMM or ATS).
    pub pageable_memory_access: bool,
    /// Page-locking existing host memory (`cuMemHostRegister`).
    pub host_register: bool,
    /// Stream priorities as (least, greatest); lower numbers are higher priority. (0, 0) when the
    /// device has no priorities.
    pub stream_priority_range: (i32, i32),
    /// Cooperative launch (`cuLaunchCooperativeKernel`).
    pub cooperative_launch: bool,
    /// Thread-block clusters (`cuLaunchKernelEx` with a cluster dimension): compute capability
    /// 9.0 or newer, the attribute set, and a driver with `cuLaunchKernelEx`.
    pub cluster_launch: bool,
    /// Unified virtual addressing.
    pub unified_addressing: bool,
    /// An integrated GPU, sharing memory with the host.
    pub integrated: bool,
    /// Prefetching managed memory (`cuMemPrefetchAsync`, [`crate::memory::ManagedBuffer::prefetch_to`]):
    /// managed memory with concurrent managed access (the driver refuses prefetches without it:
    /// on Windows, and on TCC devices). A driver without the function gives
    /// [`crate::Error::MissingSymbol`] when it is called.
    pub managed_prefetch: bool,
    /// Programmatic dependent launch (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`,
    /// [`crate::launch::LaunchAttributes::programmatic_stream_serialization`]): compute capability
    /// 9.0 or newer and a driver with `cuLaunchKernelEx`.
    pub programmatic_dependent_launch: bool,
    /// Memory synchronisation domains (`CU_DEVICE_ATTRIBUTE_MEM_SYNC_DOMAIN_COUNT`; 4 on an H200,
    /// 1 or 0 where a launch cannot choose one).
    pub mem_sync_domain_count: u32,
    /// The largest access-policy window in bytes (`CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE`;
    /// 0 where L2 access policies are not supported, before compute capability 8.0).
    pub max_access_policy_window_size: usize,
    /// The most L2 cache that can be set aside for persisting accesses, in bytes
    /// (`CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE`).
    pub max_persisting_l2_cache_size: usize,
    /// A preferred cluster dimension for launches (`CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION`):
    /// thread-block clusters, a driver of CUDA 12.8 or newer, and cudrv built against headers that
    /// have it.
    pub preferred_cluster_dimension: bool,
    /// Interprocess events (`cuIpcGetEventHandle`): `CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED`, the
    /// driver's documented test for IPC (0 under WSL; on drivers before 12.0, which lack the
    /// attribute: Linux with unified addressing).
    pub ipc_events: bool,
    /// Legacy IPC of device memory (`cuIpcGetMemHandle` on `cuMemAlloc` memory, see
    /// [`crate::ipc`]): as [`Capabilities::ipc_events`], and unified addressing.
    pub legacy_ipc: bool,
}

impl Capabilities {
    fn read(device: &Device) -> Result<Capabilities> {
        let d = driver()?;
        let f = |a| device.flag(a);
        let cc = device.compute_capability()?;
        let (mut least, mut greatest) = (0, 0);
        {
            let ctx = device.primary_context()?;
            let _bound = ctx.bind()?;
            // SAFETY: valid out-pointers; the device's context is current.
            unsafe { drv!(cuCtxGetStreamPriorityRange(&mut least, &mut greatest)) }?;
        }
        let unified_addressing = f(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)?;
        let managed_memory = f(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)?;
        let concurrent_managed_access = f(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)?;
        let cluster_launch = cc.0 >= 9 && f(A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH)? && d.has(LAUNCH_EX);
        let usize_attr = |a| device.attribute_or_zero(a).map(|v| usize::try_from(v).unwrap_or(0));
        // The attribute is of CUDA 12.0 (drivers and headers); before, IPC was Linux's.
        #[cfg(cuda_12000)]
        let ipc_events = if d.version() >= 12000 {
            f(A::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED)?
        } else {
            cfg!(target_os = "linux") && unified_addressing
        };
        #[cfg(not(cuda_12000))]
        let ipc_events = cfg!(target_os = "linux") && unified_addressing;
        #[cfg(cuda_12000)]
        let mem_sync_domain_count = device.attribute_or_zero(A::CU_DEVICE_ATTRIBUTE_MEM_SYNC_DOMAIN_COUNT)?;
        #[cfg(not(cuda_12000))]
        let mem_sync_domain_count = 0;
        Ok(Capabilities {
            device: device.ordinal(),
            driver_model: device.driver_model()?,
            driver_version: d.version(),
            compute_capability: cc,
            memory_pools: f(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?
                && d.has("cuMemAllocAsync")
                && d.has("cuMemFreeAsync"),
            memory_pool_handle_types: device.attribute_or_zero(A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?
                as u32,
            virtual_memory_management: f(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?,
            managed_memory,
            concurrent_managed_access,
            pageable_memory_access: f(A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS)?,
            host_register: f(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED)?,
            stream_priority_range: (least, greatest),
            cooperative_launch: f(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)?,
            cluster_launch,
            unified_addressing,
            integrated: f(A::CU_DEVICE_ATTRIBUTE_INTEGRATED)?,
            managed_prefetch: managed_memory && concurrent_managed_access,
            programmatic_dependent_launch: cc.0 >= 9 && d.has(LAUNCH_EX),
            mem_sync_domain_count: u32::try_from(mem_sync_domain_count).unwrap_or(0),
            max_access_policy_window_size: usize_attr(A::CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)?,
            max_persisting_l2_cache_size: usize_attr(A::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)?,
            preferred_cluster_dimension: cfg!(cuda_12080) && cluster_launch && d.version() >= 12080,
            ipc_events,
            legacy_ipc: ipc_events && unified_addressing,
        })
    }
}

/// The name of `cuLaunchKernelEx` in the bindings.
const LAUNCH_EX: &str = "cuLaunchKernelEx";

impl fmt::Display for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes = |b: bool| if b { "yes" } else { "no" };
        writeln!(f, "driver model                {}", self.driver_model)?;
        writeln!(f, "driver version              {}", crate::version_string(self.driver_version))?;
        writeln!(f, "compute capability          {}.{}", self.compute_capability.0, self.compute_capability.1)?;
        writeln!(f, "memory pools                {}", yes(self.memory_pools))?;
        writeln!(f, "pool handle types           {}", handle_types(self.memory_pool_handle_types))?;
        writeln!(f, "virtual memory management   {}", yes(self.virtual_memory_management))?;
        writeln!(f, "managed memory              {}", yes(self.managed_memory))?;
        writeln!(f, "concurrent managed access   {}", yes(self.concurrent_managed_access))?;
        writeln!(f, "pageable memory access      {}", yes(self.pageable_memory_access))?;
        writeln!(f, "host memory registration    {}", yes(self.host_register))?;
        writeln!(
            f,
            "stream priorities           {}..={} (greatest..=least)",
            self.stream_priority_range.1, self.stream_priority_range.0
        )?;
        writeln!(f, "cooperative launch          {}", yes(self.cooperative_launch))?;
        writeln!(f, "thread-block clusters       {}", yes(self.cluster_launch))?;
        writeln!(f, "unified addressing          {}", yes(self.unified_addressing))?;
        writeln!(f, "integrated                  {}", yes(self.integrated))?;
        writeln!(f, "managed prefetch            {}", yes(self.managed_prefetch))?;
        writeln!(f, "dependent launch (PDL)      {}", yes(self.programmatic_dependent_launch))?;
        writeln!(f, "memory sync domains         {}", self.mem_sync_domain_count)?;
        writeln!(f, "access-policy window        {}", bytes(self.max_access_policy_window_size))?;
        writeln!(f, "persisting L2 cache         {}", bytes(self.max_persisting_l2_cache_size))?;
        writeln!(f, "preferred cluster dimension {}", yes(self.preferred_cluster_dimension))?;
        writeln!(f, "IPC events                  {}", yes(self.ipc_events))?;
        write!(f, "legacy IPC memory           {}", yes(self.legacy_ipc))
    }
}

/// A byte count for the report: `0` as "none", else in KiB or MiB.
fn bytes(n: usize) -> String {
    match n {
        0 => "none".into(),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        n => format!("{:.1} KiB", n as f64 / 1024.0),
    }
}

/// `CUmemAllocationHandleType` bits as words.
pub(crate) fn handle_types(bits: u32) -> String {
    let names: Vec<&str> = [(1, "posix-fd"), (2, "win32"), (4, "win32-kmt"), (8, "fabric")]
        .into_iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| n)
        .collect();
    if names.is_empty() { "none".into() } else { names.join(", ") }
}

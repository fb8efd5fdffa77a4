//! Memory: stream-ordered resources, the choice of resource per device, buffers and copies.
//!
//! | resource | what it uses | when |
//! |---|---|---|
//! | [`DriverPool`] | the device's default pool (or an owned one), release threshold raised | the device supports pools |
//! | [`StreamOrderedPool`] | plain Rust over `cuMemAlloc` | pools missing (Windows TCC), or chosen |
//! | [`SyncResource`] | `cuMemAlloc` / `cuMemFree`, syncing the stream before a free | reference point, minimal memory |
//! | [`ManagedResource`] | `cuMemAllocManaged` | managed memory supported |
//! | [`PinnedHostResource`] | `cuMemHostAlloc` (portable, not write-combined unless asked) | host memory |
//!
//! Beside [`DeviceBuffer`] (stream-ordered, from a resource): [`DeviceBuffer2D`] and
//! [`DeviceBuffer3D`] (pitched, `cuMemAllocPitch`, with 2D and 3D copies and memsets),
//! [`ManagedBuffer`] (`cuMemAllocManaged`, with prefetches and advice), [`PinnedBuffer`] (pinned
//! host memory), and, for memory of other processes, [`crate::ipc`].
//!
//! [`Device::memory_resource`] picks one per device ([`choose`] says which and why); the choice
//! can be overridden with [`Device::set_memory_resource`] or with
//! `CUDRV_MEMORY_RESOURCE=driver-pool|pool|sync`.

mod buffer;
mod driver_pool;
mod host;
mod managed;
mod pitched;
mod pool;
mod stream_ordered;
mod sync;

use std::fmt;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

pub use buffer::{DeviceBuffer, DeviceRepr, DeviceView};
pub use driver_pool::{DriverPool, DriverPoolOptions};
pub use host::{HostRegistration, PinnedBuffer, PinnedHostResource, register_host};
pub use managed::{Advice, Location, ManagedBuffer, ManagedResource};
pub use pitched::{DeviceBuffer2D, DeviceBuffer3D, DeviceView2D};
pub use pool::config::PoolConfig;
pub use pool::sim::SimulatedPool;
pub use pool::stats::{Leaked, PoolStats};
pub use pool::trace::{ReplayReport, Trace, TraceError, TraceEvent};
pub use stream_ordered::StreamOrderedPool;
pub use sync::SyncResource;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::stream::Stream;

/// A raw device address (`CUdeviceptr`).
pub type DevicePtr = cudrv_sys::CUdeviceptr;

/// A stream-ordered memory resource: memory is allocated for use on a stream and freed in that
/// stream's order, like `cuMemAllocAsync` / `cuMemFreeAsync`.
///
/// # Safety
/// Implementations must return from [`allocate`](MemoryResource::allocate) memory of at least
/// `bytes` bytes, aligned to at least 256 bytes, that is not in use by anything else on the GPU or
/// host once work queued on `stream` after the call runs; and must not hand the same memory out
/// again before work queued on the freeing stream before [`deallocate`](MemoryResource::deallocate)
/// has completed (or is ordered before the new user).
pub unsafe trait MemoryResource: Send + Sync + fmt::Debug {
    /// Allocates `bytes` bytes for use on `stream`. The memory is usable by work queued on
    /// `stream` after this call (other streams must be ordered after it).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`], [`Error::DeviceMismatch`] for a stream of another device, or the
    /// driver's error.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr>;

    /// Frees `ptr` in `stream`'s order: it may be reused once work queued on `stream` before this
    /// call has run.
    ///
    /// # Safety
    /// `ptr` must come from `allocate` of this resource with the same `bytes`, not be freed
    /// already, and every use of it must be queued on `stream` before this call or be ordered
    /// before it (completed, or waited on by `stream`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a pointer this resource did not hand out (nothing changes);
    /// the driver's error.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()>;

    /// The device the memory belongs to.
    fn device(&self) -> Device;

    /// Which resource this is.
    fn kind(&self) -> ResourceKind;

    /// Whether kernels on the device can access the memory.
    fn is_device_accessible(&self) -> bool {
        true
    }

    /// Whether the resource can allocate on a stream that is capturing a graph (see
    /// [`crate::graph`]): its allocation and free must then become part of the graph, or the
    /// memory must stay reserved for the graph's life. `false` unless a resource says so: cudrv
    /// then refuses such allocations with [`Error::Capturing`].
    fn supports_capture(&self) -> bool {
        false
    }

    /// Whether the host can access the memory directly.
    fn is_host_accessible(&self) -> bool {
        false
    }

    /// Byte counts, where the resource keeps them.
    fn stats(&self) -> Option<MemoryStats> {
        None
    }

    /// Gives cached memory back to the driver until at most `keep_bytes` stay reserved. Resources
    /// that cache nothing do nothing.
    ///
    /// # Errors
    /// The driver's error.
    fn trim(&self, keep_bytes: usize) -> Result<()> {
        let _ = keep_bytes;
        Ok(())
    }

    /// Resets the high-water marks of [`MemoryResource::stats`] to the current values.
    ///
    /// # Errors
    /// The driver's error.
    fn reset_peaks(&self) -> Result<()> {
        Ok(())
    }
}

/// Byte counts of a resource, current and highest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held from the driver.
    pub reserved: usize,
    /// Highest `reserved`.
    pub peak_reserved: usize,
    /// Bytes handed out and not freed.
    pub in_use: usize,
    /// Highest `in_use`.
    pub peak_in_use: usize,
    /// Allocations made from the driver (`cuMemAlloc` calls), where known.
    pub driver_allocations: u64,
}

/// The kinds of memory resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResourceKind {
    /// [`DriverPool`].
    DriverPool,
    /// [`StreamOrderedPool`].
    StreamOrderedPool,
    /// [`SyncResource`].
    Sync,
    /// [`ManagedResource`].
    Managed,
    /// [`PinnedHostResource`].
    PinnedHost,
    /// A resource written outside cudrv.
    Custom,
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ResourceKind::DriverPool => "DriverPool",
            ResourceKind::StreamOrderedPool => "StreamOrderedPool",
            ResourceKind::Sync => "SyncResource",
            ResourceKind::Managed => "ManagedResource",
            ResourceKind::PinnedHost => "PinnedHostResource",
            ResourceKind::Custom => "custom",
        })
    }
}

/// The environment variable that overrides the choice of resource for every device. Unset, empty
/// or blank means no override.
pub const RESOURCE_VAR: &str = "CUDRV_MEMORY_RESOURCE";

/// Which resource a device uses, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The resource.
    pub kind: ResourceKind,
    /// Why, in words.
    pub reason: String,
}

/// Decides which resource `device` gets by default: the `CUDRV_MEMORY_RESOURCE` override, else
/// [`DriverPool`] where the device supports memory pools (and the driver hands out its pool),
/// else [`StreamOrderedPool`].
///
/// # Errors
/// [`Error::InvalidEnvironment`] for an unknown `CUDRV_MEMORY_RESOURCE`; [`Error::Unsupported`]
/// when it asks for `driver-pool` on a device without pools; the driver's error.
pub fn choose(device: &Device) -> Result<Choice> {
    let caps = device.capabilities()?;
    // Unset, empty and blank are the same: no override (as for CUDRV_DRIVER_PATH).
    if let Some(value) = std::env::var_os(RESOURCE_VAR).filter(|v| !v.to_string_lossy().trim().is_empty()) {
        let value = value.to_string_lossy().into_owned();
        let kind = match value.trim() {
            "driver-pool" => ResourceKind::DriverPool,
            "pool" => ResourceKind::StreamOrderedPool,
            "sync" => ResourceKind::Sync,
            _ => {
                return Err(Error::InvalidEnvironment {
                    var: RESOURCE_VAR,
                    value,
                    expected: "driver-pool, pool or sync",
                });
            }
        };
        if kind == ResourceKind::DriverPool && !caps.memory_pools {
            return Err(device.unsupported(
                "memory pools",
                format!("{RESOURCE_VAR}=driver-pool, but {}", pools_missing_reason(caps)),
                Some("CUDRV_MEMORY_RESOURCE=pool (cudrv's StreamOrderedPool)"),
            ));
        }
        return Ok(Choice { kind, reason: format!("{RESOURCE_VAR}={value}") });
    }
    if !caps.memory_pools {
        return Ok(Choice {
            kind: ResourceKind::StreamOrderedPool,
            reason: format!("{}; cudrv's stream-ordered pool takes their place", pools_missing_reason(caps)),
        });
    }
    match DriverPool::probe(device) {
        Ok(()) => Ok(Choice {
            kind: ResourceKind::DriverPool,
            reason: "the device supports stream-ordered memory pools".into(),
        }),
        Err(e) if e.is_unsupported() => Ok(Choice {
            kind: ResourceKind::StreamOrderedPool,
            reason: format!(
                "the device reports memory pools, but the driver refused its pool ({e}); cudrv's stream-ordered pool takes their place"
            ),
        }),
        Err(e) => Err(e),
    }
}

fn pools_missing_reason(caps: &crate::Capabilities) -> String {
    if caps.driver_model == crate::DriverModel::Tcc {
        "the device has no memory pools (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0: TCC driver model)".into()
    } else if caps.driver_version < 11020 {
        format!("the driver ({}) predates memory pools (CUDA 11.2)", crate::version_string(caps.driver_version))
    } else {
        "the device has no memory pools (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0)".into()
    }
}

/// A device's resource, as the registry publishes it. Entries are never freed: a buffer may keep
/// a `&'static` to its resource without touching a shared reference count, and a replaced entry
/// stays valid for the buffers that came from it.
struct Entry {
    resource: Arc<dyn MemoryResource>,
    /// `resource.is_device_accessible()`, asked once.
    device_accessible: bool,
    choice: Choice,
}

/// Per device, the current [`Entry`] (null until first use). Read with one atomic load, which no
/// thread ever contends on: the hot path of `DeviceBuffer::uninit` reads it.
#[inline]
fn slots() -> Result<&'static [AtomicPtr<Entry>]> {
    static SLOTS: OnceLock<Box<[AtomicPtr<Entry>]>> = OnceLock::new();
    if let Some(s) = SLOTS.get() {
        return Ok(s);
    }
    let count = Device::count()?;
    Ok(SLOTS.get_or_init(|| (0..count).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect()))
}

/// Serialises making and replacing entries (never taken on the hot path).
static INSTALL: Mutex<()> = Mutex::new(());

#[inline]
fn slot(device: &Device) -> Result<&'static AtomicPtr<Entry>> {
    slots()?
        .get(device.ordinal())
        .ok_or_else(|| Error::InvalidArgument(format!("device {} is not in the device list", device.ordinal())))
}

/// Publishes `entry` for `device` (leaked: see [`Entry`]).
fn install(slot: &AtomicPtr<Entry>, entry: Entry) -> &'static Entry {
    let entry: &'static Entry = Box::leak(Box::new(entry));
    slot.store(std::ptr::from_ref(entry).cast_mut(), Ordering::Release);
    entry
}

/// The device's current entry, made as [`choose`] decides on first use.
#[inline]
fn entry(device: &Device) -> Result<&'static Entry> {
    let slot = slot(device)?;
    let p = slot.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: non-null entries are leaked boxes, valid for the rest of the process.
        return Ok(unsafe { &*p });
    }
    let _guard = INSTALL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let p = slot.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: as above.
        return Ok(unsafe { &*p });
    }
    let choice = choose(device)?;
    let resource = make(device, choice.kind)?;
    Ok(install(slot, Entry { device_accessible: resource.is_device_accessible(), resource, choice }))
}

/// The device's resource, for buffers: no reference count is touched. Refused when it is not
/// device-accessible (a pinned-host resource set with `Device::set_memory_resource`).
#[inline]
pub(crate) fn device_resource_for_buffers(device: &Device) -> Result<&'static dyn MemoryResource> {
    let e = entry(device)?;
    if !e.device_accessible {
        return Err(Error::InvalidArgument(format!("{} is not device-accessible memory", e.resource.kind())));
    }
    Ok(&*e.resource)
}

/// Makes the resource for a choice.
fn make(device: &Device, kind: ResourceKind) -> Result<Arc<dyn MemoryResource>> {
    Ok(match kind {
        ResourceKind::DriverPool => Arc::new(DriverPool::default_pool(device)?),
        ResourceKind::StreamOrderedPool => Arc::new(StreamOrderedPool::new(device)?),
        ResourceKind::Sync => Arc::new(SyncResource::new(device)?),
        ResourceKind::Managed => Arc::new(ManagedResource::new(device)?),
        ResourceKind::PinnedHost => Arc::new(PinnedHostResource::new(device)?),
        ResourceKind::Custom => {
            return Err(Error::InvalidArgument("a custom resource is set with Device::set_memory_resource".into()));
        }
    })
}

impl Device {
    /// The device's memory resource, made on first use as [`choose`] decides, and shared.
    ///
    /// ```no_run
    /// let device = cudrv::Device::get(0)?;
    /// let (_resource, choice) = device.memory_resource_choice()?;
    /// println!("device 0 allocates with {}: {}", choice.kind, choice.reason);
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`choose`].
    pub fn memory_resource(&self) -> Result<Arc<dyn MemoryResource>> {
        self.memory_resource_choice().map(|(r, _)| r)
    }

    /// The device's memory resource and why it was chosen.
    ///
    /// # Errors
    /// As [`choose`].
    pub fn memory_resource_choice(&self) -> Result<(Arc<dyn MemoryResource>, Choice)> {
        let e = entry(self)?;
        Ok((e.resource.clone(), e.choice.clone()))
    }

    /// Sets the resource that [`Device::memory_resource`] returns from now on. Buffers allocated
    /// before keep the resource they came from; the resource they came from gives back the memory
    /// it caches (a `trim(0)`) and stays alive for them.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] when `resource` belongs to another device.
    pub fn set_memory_resource(&self, resource: Arc<dyn MemoryResource>, reason: impl Into<String>) -> Result<()> {
        if resource.device() != *self {
            return Err(Error::DeviceMismatch {
                what: "Device::set_memory_resource",
                expected: self.ordinal_i32(),
                found: resource.device().ordinal_i32(),
            });
        }
        let slot = slot(self)?;
        let choice = Choice { kind: resource.kind(), reason: reason.into() };
        let _guard = INSTALL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let old = slot.load(Ordering::Acquire);
        install(slot, Entry { device_accessible: resource.is_device_accessible(), resource, choice });
        if !old.is_null() {
            // SAFETY: as in `entry`.
            let _ = unsafe { &*old }.resource.trim(0);
        }
        Ok(())
    }
}

/// Checks that `stream` belongs to `device`.
pub(crate) fn check_stream(what: &'static str, device: Device, stream: &Stream) -> Result<()> {
    if stream.device() == device {
        Ok(())
    } else {
        Err(Error::DeviceMismatch { what, expected: device.ordinal_i32(), found: stream.device().ordinal_i32() })
    }
}

/// The streams other than its own that a piece of memory was used on, so that its free and host
/// access wait for them. Shared by the buffer types that free synchronously
/// ([`DeviceBuffer2D`], [`ManagedBuffer`], [`crate::ipc::IpcBuffer`]); [`DeviceBuffer`] keeps its
/// list beside its graphs and uses [`note_use`].
#[derive(Debug, Default)]
pub(crate) struct StreamUses(Mutex<Vec<Stream>>);

impl StreamUses {
    /// [`note_use`] on this list.
    pub(crate) fn record(&self, owner: &Stream, stream: &Stream) -> Result<()> {
        note_use(&mut self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner), owner, stream)
    }

    /// The streams recorded so far.
    pub(crate) fn snapshot(&self) -> Vec<Stream> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Takes the list (the memory is being freed).
    pub(crate) fn take(&mut self) -> Vec<Stream> {
        std::mem::take(self.0.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// Notes a use on `stream` of memory that belongs to `owner`'s order: the first time, `stream`
/// waits (on the GPU) for `owner`'s work so far, so that nothing it runs touches the memory before
/// it is allocated, and `stream` joins `used` so that the free waits for it.
///
/// # Errors
/// The driver's error (then nothing was recorded).
pub(crate) fn note_use(used: &mut Vec<Stream>, owner: &Stream, stream: &Stream) -> Result<()> {
    if stream.id() != owner.id() && !used.contains(stream) {
        stream.wait_stream(owner)?;
        used.push(stream.clone());
    }
    Ok(())
}

/// Waits on the host for `owner` and every stream of `used` (never returning while their work
/// may still run; see `Stream::wait_for_memory`).
///
/// # Errors
/// The first failed wait's error.
pub(crate) fn wait_for_uses(owner: &Stream, used: &[Stream]) -> Result<()> {
    used.iter().chain(std::iter::once(owner)).try_for_each(Stream::wait_for_memory)
}

/// A synchronous free (`cuMemFree` does not wait for queued work) of memory used on `owner` and
/// `used`: waits for them, then runs `free`. Outside host functions (deferred from inside one).
/// A failed wait leaks the memory (its work may still run), which is sound, and reports the
/// error.
pub(crate) fn free_after_waiting(owner: Stream, used: Vec<Stream>, free: impl FnOnce() -> Result<()> + Send + 'static) {
    let run = move || {
        if let Err(e) = wait_for_uses(&owner, &used).and_then(|()| free()) {
            crate::context::report_drop_error(Some(owner.context()), e);
        }
    };
    if crate::host_fn::in_host_fn() { crate::host_fn::defer(run) } else { run() }
}

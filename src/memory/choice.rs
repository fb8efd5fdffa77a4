//! Which resource each device uses: the choice, and the registry of the devices' resources.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::{
    DriverPool, ManagedResource, MemoryResource, PinnedHostResource, ResourceKind, StreamOrderedPool, SyncResource,
};
use crate::device::Device;
use crate::error::{Error, Result};

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

/// Why `caps` has no memory pools.
pub(crate) fn pools_missing_reason(caps: &crate::Capabilities) -> String {
    let mut why = Vec::new();
    if caps.driver_version < 11020 {
        why.push(format!(
            "the driver ({}) predates memory pools (CUDA 11.2)",
            crate::version_string(caps.driver_version)
        ));
    }
    if caps.driver_model == crate::DriverModel::Tcc {
        why.push(
            "the device has no memory pools (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0: TCC driver model)".into(),
        );
    }
    if why.is_empty() {
        why.push(
            if crate::result::loaded_driver().is_some_and(|d| !d.has("cuMemAllocAsync") || !d.has("cuMemFreeAsync")) {
                "the driver does not provide cuMemAllocAsync and cuMemFreeAsync".into()
            } else {
                "the device has no memory pools (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0)".into()
            },
        );
    }
    why.join("; ")
}

/// A device's resource, as the registry publishes it. Entries are never freed: a buffer may keep
/// a `&'static` to its resource without touching a shared reference count, and a replaced entry
/// stays valid for the buffers that came from it.
struct Entry {
    resource: Arc<dyn MemoryResource>,
    /// The resource as buffers call it, made once (`None` when it is not device-accessible): a
    /// reference held for the rest of the process, so that `DeviceBuffer::uninit` reads it with
    /// one load, without the reference count's indirection.
    for_buffers: Option<DeviceResource>,
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

impl Entry {
    fn new(resource: Arc<dyn MemoryResource>, choice: Choice) -> Entry {
        // Held for the rest of the process, as entries are (see `Entry`).
        let held: &'static dyn MemoryResource = &**Box::leak(Box::new(resource.clone()));
        let for_buffers = held.is_device_accessible().then(|| {
            match (held as &dyn std::any::Any).downcast_ref::<StreamOrderedPool>() {
                Some(pool) => DeviceResource::StreamOrdered(pool),
                None => DeviceResource::Other(held),
            }
        });
        Entry { resource, for_buffers, choice }
    }
}

/// A device's resource as buffers use it: the registry's entries live for the rest of the
/// process, so no reference count is touched.
#[derive(Clone, Copy)]
pub(crate) enum DeviceResource {
    /// A [`StreamOrderedPool`], called directly.
    StreamOrdered(&'static StreamOrderedPool),
    /// Any other resource.
    Other(&'static dyn MemoryResource),
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
    Ok(install(slot, Entry::new(resource, choice)))
}

/// The device's resource, for buffers: no reference count is touched. Refused when it is not
/// device-accessible (a pinned-host resource set with `Device::set_memory_resource`).
#[inline]
pub(crate) fn device_resource_for_buffers(device: &Device) -> Result<DeviceResource> {
    let e = entry(device)?;
    e.for_buffers
        .ok_or_else(|| Error::InvalidArgument(format!("{} is not device-accessible memory", e.resource.kind())))
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
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
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
        let old = {
            let _guard = INSTALL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let old = slot.load(Ordering::Acquire);
            install(slot, Entry::new(resource, choice));
            old
        };
        // With the lock let go: the trim may be user code (a custom resource, the drop-error hook)
        // that asks for a device's resource, which may take the lock.
        if !old.is_null() {
            // SAFETY: as in `entry`.
            let _ = unsafe { &*old }.resource.trim(0);
        }
        Ok(())
    }
}

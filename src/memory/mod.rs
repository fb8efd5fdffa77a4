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
//! [`Device::memory_resource`](crate::Device::memory_resource) picks one per device ([`choose`] says which and why); the choice
//! can be overridden with [`Device::set_memory_resource`](crate::Device::set_memory_resource) or with
//! `CUDRV_MEMORY_RESOURCE=driver-pool|pool|sync`.

mod buffer;
mod choice;
mod driver_pool;
mod host;
mod managed;
mod pitched;
mod pool;
mod resource;
mod stream_ordered;
mod sync;
mod uses;

pub use buffer::{DeviceBuffer, DeviceRepr, DeviceView};
pub(crate) use buffer::{as_uninit, vec_written};
pub use choice::{Choice, RESOURCE_VAR, choose};
pub(crate) use choice::{DeviceResource, device_resource_for_buffers, pools_missing_reason};
pub use driver_pool::{DriverPool, DriverPoolConfig};
pub use host::{HostRegistration, PinnedBuffer, PinnedFlags, PinnedHostResource, register_host};
pub use managed::{Advice, Location, ManagedBuffer, ManagedResource};
pub use pitched::{DeviceBuffer2D, DeviceBuffer3D, DeviceView2D};
pub use pool::config::PoolConfig;
pub use pool::sim::SimulatedPool;
pub use pool::stats::{Leaked, PoolStats};
pub use pool::trace::{ReplayReport, ReplayTable, Trace, TraceError, TraceEvent};
pub use resource::{DevicePtr, MemoryResource, MemoryStats, ResourceKind};
pub use stream_ordered::StreamOrderedPool;
pub use sync::SyncResource;
pub(crate) use uses::{
    StreamUses, UseGates, check_len, check_stream, free_after_waiting, free_when_done, note_use, uncaptured,
    unless_capturing, wait_for_uses,
};

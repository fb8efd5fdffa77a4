//! Interprocess communication: events and device memory shared with other processes.
//!
//! | what | exporter | importer | needs |
//! |---|---|---|---|
//! | an event | [`IpcEvent::new`], [`IpcEvent::handle`] (`cuIpcGetEventHandle`) | [`IpcEvent::open`] (`cuIpcOpenEventHandle`) | [`Capabilities::ipc_events`] |
//! | memory of `cuMemAlloc` ([`SyncResource`], [`StreamOrderedPool`]) | [`DeviceBuffer::ipc_handle`] (`cuIpcGetMemHandle`, legacy IPC) | [`IpcBuffer::open`] (`cuIpcOpenMemHandle`) | [`Capabilities::legacy_ipc`] |
//! | memory of a pool with shareable handle types ([`SharedPool`]) | [`SharedPool::export`] once, then [`DeviceBuffer::ipc_handle`] per buffer (`cuMemPoolExportPointer`) | [`ImportedPool::import`], then [`ImportedPool::open`] (`cuMemPoolImportPointer`) | [`Capabilities::memory_pool_handle_types`] |
//!
//! Handles are plain bytes ([`IpcEventHandle::to_bytes`], [`IpcMemHandle::to_bytes`], or their
//! hexadecimal `Display` and `FromStr`): send them to the other process any way you like. A pool's
//! shareable handle is different: it is an operating-system handle of the exporting process (a
//! file descriptor, an NT handle), which must cross with the operating system's help.
//!
//! # Legacy IPC and memory pools (cudarc #521)
//!
//! `cuIpcGetMemHandle` works only on memory from `cuMemAlloc`. Memory from the driver's pools
//! (`cuMemAllocAsync`, [`DriverPool`]) cannot be shared that way: the driver refuses it, or hands
//! out a handle of the pool's whole reservation. cudrv does not try. [`DeviceBuffer::ipc_handle`]
//! looks at where the memory came from (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`):
//!
//! * memory of a pool created with shareable handle types ([`SharedPool`]) is exported with
//!   `cuMemPoolExportPointer`;
//! * memory of a pool without them (every device's default pool, and
//!   [`DriverPool::with_config`]) is refused with [`Error::Unsupported`], saying so;
//! * other memory is exported with legacy IPC where the driver says it can
//!   (`CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`); managed, pinned and virtual memory are
//!   refused.
//!
//! Legacy IPC shares a whole `cuMemAlloc` allocation: for a [`StreamOrderedPool`] buffer, that is
//! the pool's whole chunk (2 MiB or 32 MiB for small and medium buffers), so the other process can
//! reach the chunk's other buffers too. Give the buffers you share a pool of their own, or use a
//! [`SyncResource`]. The handle records the buffer's offset in the chunk and its size; the
//! importer sees only the buffer. Where the device has virtual memory management, a
//! `StreamOrderedPool` grows in segments of virtual memory by default
//! ([`PoolConfig::expandable`](crate::memory::PoolConfig::expandable)), which legacy IPC cannot
//! share: a pool for buffers to share that way sets `expandable: false`.
//!
//! # Lifetimes across processes
//!
//! No process can keep another's memory alive. The exporting process must keep the buffer (and,
//! for legacy IPC, so its allocation) alive until every importer has dropped its [`IpcBuffer`]; a
//! pool's memory must be freed by every importer before the exporter frees it (the driver's rule).
//! Order the work of the processes with [`IpcEvent`]s, as streams of one process are ordered with
//! events.
//!
//! # Windows
//!
//! * Legacy IPC (events and `cuMemAlloc` memory) is what `CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED`
//!   says: NVIDIA documents IPC on Windows as supported for compatibility, with a performance cost,
//!   and WSL does not support it. cudrv follows the attribute ([`Capabilities::ipc_events`],
//!   [`Capabilities::legacy_ipc`]) and refuses where it reads 0.
//! * Pools export NT handles (`CU_MEM_HANDLE_TYPE_WIN32`, which another process receives with
//!   `DuplicateHandle`) or KMT handles (`CU_MEM_HANDLE_TYPE_WIN32_KMT`, plain numbers valid in any
//!   process of the session). [`SharedPool::new`] picks `WIN32` on Windows.
//! * TCC devices have no memory pools at all, so only legacy IPC is available there, if the
//!   attribute allows it.
//!
//! [`Capabilities::ipc_events`]: crate::Capabilities::ipc_events
//! [`Capabilities::legacy_ipc`]: crate::Capabilities::legacy_ipc
//! [`Capabilities::memory_pool_handle_types`]: crate::Capabilities::memory_pool_handle_types
//! [`SyncResource`]: crate::memory::SyncResource
//! [`StreamOrderedPool`]: crate::memory::StreamOrderedPool

use std::fmt;
use std::marker::PhantomData;
use std::mem::{MaybeUninit, size_of};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

use cudrv_sys::{CUevent, CUmemAllocationHandleType, CUmemoryPool, CUpointer_attribute as PA, CUresult};

use crate::capture::RelaxedCaptureMode;
use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::error::{check, check_done};
use crate::memory::{
    DeviceBuffer, DevicePtr, DeviceRepr, DriverPool, MemoryResource, MemoryStats, ResourceKind, StreamUses, as_uninit,
    check_len, vec_written,
};
use crate::result::{driver, drv};
use crate::stream::Stream;

/// The size of the driver's IPC handles (`CU_IPC_HANDLE_SIZE`).
const RAW: usize = 64;

fn hex(bytes: &[u8], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
}

fn unhex(s: &str, what: &str) -> Result<Vec<u8>> {
    let s = s.trim();
    let bad = || Error::InvalidArgument(format!("{what}: {s:?} is not hexadecimal bytes"));
    if !s.len().is_multiple_of(2) {
        return Err(bad());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|p| u8::from_str_radix(p, 16).ok()).ok_or_else(bad))
        .collect()
}

/// Why [`Capabilities::ipc_events`](crate::Capabilities::ipc_events) is false: the attribute says
/// so, or there is none to ask (a driver or headers older than CUDA 12.0) and the host is not Linux
/// (or the device has no unified addressing).
fn no_ipc_reason(caps: &crate::Capabilities) -> String {
    if cfg!(cuda_12000) && caps.driver_version >= 12000 {
        "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED is 0 (Windows without IPC support, WSL, or a driver that does not allow it)"
            .into()
    } else {
        let lacking = if cfg!(cuda_12000) {
            format!("the driver ({}) predates", crate::version_string(caps.driver_version))
        } else {
            "cudrv was built against headers older than CUDA 12.0, which lack".into()
        };
        format!(
            "{lacking} CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED (CUDA 12.0); without it cudrv allows IPC on Linux \
             with unified addressing only"
        )
    }
}

fn require_ipc_events(device: &Device) -> Result<()> {
    let caps = device.capabilities()?;
    if caps.ipc_events {
        return Ok(());
    }
    Err(device.unsupported(
        "interprocess events",
        no_ipc_reason(caps),
        Some("another way to signal the other process (a pipe), after Stream::synchronize"),
    ))
}

fn require_legacy_ipc(device: &Device) -> Result<()> {
    let caps = device.capabilities()?;
    if caps.legacy_ipc {
        return Ok(());
    }
    let reason =
        if !caps.unified_addressing { "the device has no unified addressing".into() } else { no_ipc_reason(caps) };
    Err(device.unsupported("legacy IPC of device memory", reason, Some("ipc::SharedPool where pools export handles")))
}

/// An event handle that another process can open (`CUipcEventHandle`, 64 opaque bytes). `Display`
/// and `FromStr` write and read it as hexadecimal.
///
/// ```
/// use cudrv::ipc::IpcEventHandle;
/// let h = IpcEventHandle::from_bytes([7; 64]);
/// assert_eq!(h.to_string().parse::<IpcEventHandle>().unwrap(), h);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle([u8; RAW]);

impl IpcEventHandle {
    /// The handle's bytes.
    pub fn to_bytes(&self) -> [u8; RAW] {
        self.0
    }

    /// A handle from its bytes (as [`IpcEventHandle::to_bytes`] gave them).
    pub fn from_bytes(bytes: [u8; RAW]) -> IpcEventHandle {
        IpcEventHandle(bytes)
    }
}

impl fmt::Display for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        hex(&self.0, f)
    }
}

impl fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcEventHandle({self})")
    }
}

impl FromStr for IpcEventHandle {
    type Err = Error;

    fn from_str(s: &str) -> Result<IpcEventHandle> {
        let bytes = unhex(s, "an IPC event handle")?;
        let raw: [u8; RAW] = bytes.try_into().map_err(|v: Vec<u8>| {
            Error::InvalidArgument(format!("an IPC event handle has {RAW} bytes, not {}", v.len()))
        })?;
        Ok(IpcEventHandle(raw))
    }
}

/// An event shared between processes: created with `CU_EVENT_INTERPROCESS` (and without timing,
/// which the driver requires) by [`IpcEvent::new`], or opened from another process's handle by
/// [`IpcEvent::open`]. Records in one process order waits in the other.
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, ipc::{IpcEvent, IpcEventHandle}};
/// // Process A:
/// let device = Device::get(0)?;
/// let stream = Stream::new(&device)?;
/// let done = IpcEvent::new(&device)?;
/// let handle = done.handle()?.to_string(); // send it to process B
/// // ... queue work that writes a shared buffer, then:
/// done.record(&stream)?;
///
/// // Process B (another process: the driver refuses to open a handle in its own process):
/// fn process_b(device: &Device, stream: &Stream, handle: &str) -> cudrv::Result<()> {
///     let done = IpcEvent::open(device, &handle.parse::<IpcEventHandle>()?)?;
///     done.wait_in(stream) // B's later work on `stream` runs after A's work before the record
/// }
/// # let _ = process_b;
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct IpcEvent {
    raw: CUevent,
    ctx: Arc<Context>,
    opened: bool,
}

// SAFETY: CUevent handles may be used from any thread; cudrv binds the context before each use.
unsafe impl Send for IpcEvent {}
// SAFETY: as above; every method takes `&self` and calls thread-safe driver functions.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    /// A new interprocess event on `device` (`CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] without [`Capabilities::ipc_events`](crate::Capabilities::ipc_events);
    /// the driver's error.
    pub fn new(device: &Device) -> Result<IpcEvent> {
        require_ipc_events(device)?;
        let ctx = device.primary_context()?;
        let flags =
            cudrv_sys::CUevent_flags::CU_EVENT_INTERPROCESS.0 | cudrv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        let mut raw = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: valid out-pointer; the context is current.
            unsafe { drv!(cuEventCreate(&mut raw, flags)) }?;
        }
        Ok(IpcEvent { raw, ctx, opened: false })
    }

    /// The handle that another process opens with [`IpcEvent::open`] (`cuIpcGetEventHandle`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn handle(&self) -> Result<IpcEventHandle> {
        let mut h = cudrv_sys::CUipcEventHandle::default();
        let _b = self.ctx.bind()?;
        // SAFETY: valid out-pointer and an interprocess event; the context is current.
        unsafe { drv!(cuIpcGetEventHandle(&mut h, self.raw)) }?;
        Ok(IpcEventHandle(h.reserved.map(|b| b as u8)))
    }

    /// Opens an event of another process on `device` (`cuIpcOpenEventHandle`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] without interprocess events; the driver's error (a handle of this
    /// process, or of an event already destroyed).
    pub fn open(device: &Device, handle: &IpcEventHandle) -> Result<IpcEvent> {
        require_ipc_events(device)?;
        let ctx = device.primary_context()?;
        let raw_handle = cudrv_sys::CUipcEventHandle { reserved: handle.0.map(|b| b as _) };
        let mut raw = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: valid out-pointer; the handle is plain bytes the driver validates; the
            // context is current.
            unsafe { drv!(cuIpcOpenEventHandle(&mut raw, raw_handle)) }?;
        }
        Ok(IpcEvent { raw, ctx, opened: true })
    }

    /// Whether this event was opened from another process's handle.
    pub fn is_opened(&self) -> bool {
        self.opened
    }

    /// Records the event at this point of `stream` (of the event's device).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device; the driver's error.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.check_stream("IpcEvent::record", stream)?;
        let _b = self.ctx.bind()?;
        // SAFETY: both handles are valid while their owners live; the context is current.
        unsafe { drv!(cuEventRecord(self.raw, stream.as_raw())) }
    }

    /// Makes work queued on `stream` after this call wait until the event's last record (in
    /// either process) completes; the GPU waits, not the host.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device; the driver's error.
    pub fn wait_in(&self, stream: &Stream) -> Result<()> {
        self.check_stream("IpcEvent::wait_in", stream)?;
        // As Stream::wait_event: a wait on an event recorded in a capture joins it, tracked.
        stream.wait_raw_event(self.raw)
    }

    /// Waits on the host until the event completes.
    ///
    /// # Errors
    /// The driver's error.
    pub fn synchronize(&self) -> Result<()> {
        let _b = self.ctx.bind()?;
        // SAFETY: a valid event; the context is current.
        unsafe { drv!(cuEventSynchronize(self.raw)) }
    }

    /// Whether the event has completed, without waiting.
    ///
    /// # Errors
    /// The driver's error (other than "not ready").
    pub fn query(&self) -> Result<bool> {
        let _b = self.ctx.bind()?;
        // SAFETY: a valid event; the context is current.
        check_done("cuEventQuery", unsafe { driver()?.cuEventQuery(self.raw) })
    }

    /// The raw `CUevent` (valid while this value lives).
    pub fn as_raw(&self) -> CUevent {
        self.raw
    }

    /// The event's device.
    pub fn device(&self) -> Device {
        self.ctx.device()
    }

    fn check_stream(&self, what: &'static str, stream: &Stream) -> Result<()> {
        if stream.device() == self.device() {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                what,
                expected: self.device().ordinal_i32(),
                found: stream.device().ordinal_i32(),
            })
        }
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        let (raw, ctx) = (crate::host_fn::SendHandle(self.raw), self.ctx.clone());
        let destroy = move || {
            let Ok(d) = driver() else { return };
            // SAFETY: the event was created or opened by this value and is destroyed once.
            if let Err(e) = check("cuEventDestroy", unsafe { d.cuEventDestroy_v2(raw.get()) }) {
                report_drop_error(Some(&ctx), e);
            }
        };
        crate::host_fn::now_or_deferred(destroy)
    }
}

impl fmt::Debug for IpcEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcEvent")
            .field("raw", &self.raw)
            .field("device", &self.device().ordinal())
            .field("opened", &self.opened)
            .finish()
    }
}

/// How an [`IpcMemHandle`] was made, and so how it is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IpcMemKind {
    /// Legacy IPC of a `cuMemAlloc` allocation (`CUipcMemHandle`): [`IpcBuffer::open`].
    Legacy,
    /// A pool allocation's export data (`CUmemPoolPtrExportData`): [`ImportedPool::open`].
    Pool,
}

/// A handle to a [`DeviceBuffer`] that another process can open: the driver's 64 bytes, the
/// buffer's offset in the shared allocation and its size, and the device's UUID. `to_bytes` /
/// `from_bytes` and the hexadecimal `Display` / `FromStr` carry it across.
///
/// ```
/// use cudrv::ipc::IpcMemHandle;
/// let bytes = [0u8; IpcMemHandle::BYTES];
/// assert!(IpcMemHandle::from_bytes(&bytes).is_err()); // not a handle cudrv wrote
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle {
    kind: IpcMemKind,
    raw: [u8; RAW],
    offset: u64,
    bytes: u64,
    uuid: [u8; 16],
}

/// The first bytes of a serialised [`IpcMemHandle`].
const MEM_MAGIC: &[u8; 8] = b"cudrvIPC";

impl IpcMemHandle {
    /// The length of [`IpcMemHandle::to_bytes`].
    pub const BYTES: usize = 8 + 8 + RAW + 8 + 8 + 16;

    /// How it is opened.
    pub fn kind(&self) -> IpcMemKind {
        self.kind
    }

    /// The buffer's size in bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes as usize
    }

    /// The buffer's offset in the shared allocation (a [`StreamOrderedPool`](crate::memory::StreamOrderedPool)
    /// chunk), in bytes.
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// The UUID of the exporter's device ([`Device::uuid`]), which names the same GPU in every
    /// process (ordinals need not: `CUDA_VISIBLE_DEVICES`).
    pub fn device_uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// The handle as bytes: a magic, the kind, the driver's handle, the offset, the size and the
    /// device's UUID.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..8].copy_from_slice(MEM_MAGIC);
        out[8] = match self.kind {
            IpcMemKind::Legacy => 1,
            IpcMemKind::Pool => 2,
        };
        out[16..16 + RAW].copy_from_slice(&self.raw);
        out[80..88].copy_from_slice(&self.offset.to_le_bytes());
        out[88..96].copy_from_slice(&self.bytes.to_le_bytes());
        out[96..112].copy_from_slice(&self.uuid);
        out
    }

    /// A handle from [`IpcMemHandle::to_bytes`]'s bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for bytes that are not such a handle.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcMemHandle> {
        let bad = |why: &str| Error::InvalidArgument(format!("not a cudrv IPC memory handle: {why}"));
        if bytes.len() != Self::BYTES {
            return Err(bad(&format!("{} bytes instead of {}", bytes.len(), Self::BYTES)));
        }
        if &bytes[..8] != MEM_MAGIC {
            return Err(bad("no cudrvIPC magic"));
        }
        let kind = match bytes[8] {
            1 => IpcMemKind::Legacy,
            2 => IpcMemKind::Pool,
            k => return Err(bad(&format!("unknown kind {k}"))),
        };
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        Ok(IpcMemHandle {
            kind,
            raw: bytes[16..16 + RAW].try_into().expect("64 bytes"),
            offset: word(80),
            bytes: word(88),
            uuid: bytes[96..112].try_into().expect("16 bytes"),
        })
    }

    /// The number of `T` the buffer holds.
    fn elements<T>(&self) -> Result<usize> {
        let t = size_of::<T>().max(1) as u64;
        if !self.bytes.is_multiple_of(t) {
            return Err(Error::InvalidArgument(format!(
                "the shared buffer has {} bytes, not a whole number of {}-byte {}",
                self.bytes,
                t,
                std::any::type_name::<T>()
            )));
        }
        Ok((self.bytes / t) as usize)
    }
}

impl fmt::Display for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        hex(&self.to_bytes(), f)
    }
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMemHandle")
            .field("kind", &self.kind)
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl FromStr for IpcMemHandle {
    type Err = Error;

    fn from_str(s: &str) -> Result<IpcMemHandle> {
        IpcMemHandle::from_bytes(&unhex(s, "an IPC memory handle")?)
    }
}

/// One pointer attribute of `ptr` (`cuPointerGetAttribute`), as a `T` the attribute is.
///
/// # Safety
/// `T` must be the attribute's type (an `int`, a pointer, a `CUdeviceptr`, ...).
unsafe fn pointer_attribute<T: Default>(ptr: DevicePtr, attribute: PA) -> Result<T> {
    let mut v = T::default();
    // SAFETY: `v` is a writable T, the attribute's type (the caller's promise).
    unsafe { drv!(cuPointerGetAttribute((&raw mut v).cast(), attribute, ptr)) }?;
    Ok(v)
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// A handle another process can open to reach this buffer (see the
    /// [module documentation](crate::ipc) for which memory can be shared, and how):
    /// `cuMemPoolExportPointer` for memory of a pool with shareable handle types, legacy IPC
    /// (`cuIpcGetMemHandle` of the allocation, with the buffer's offset) for `cuMemAlloc` memory.
    ///
    /// ```
    /// # if !cudrv::__doctest_driver() { return Ok(()); }
    /// use std::sync::Arc;
    /// use cudrv::{Device, Stream, memory::{DeviceBuffer, SyncResource}};
    /// let device = Device::get(0)?;
    /// let stream = Stream::new(&device)?;
    /// let shared = Arc::new(SyncResource::new(&device)?);
    /// let buf = DeviceBuffer::from_slice_in(&[1u32, 2, 3], &stream, shared)?;
    /// let handle = buf.ipc_handle()?.to_string(); // send it; keep `buf` alive meanwhile
    /// # Ok::<(), cudrv::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Unsupported`] for memory of a pool without shareable handle types (the driver's
    /// pools: cudarc #521), for managed, pinned or virtual memory, and where the device lacks
    /// legacy IPC; [`Error::InvalidArgument`] for an empty buffer; the driver's error.
    pub fn ipc_handle(&self) -> Result<IpcMemHandle> {
        let device = self.device();
        let bytes = self.byte_len() as u64;
        if bytes == 0 {
            return Err(Error::InvalidArgument("an empty buffer cannot be shared".into()));
        }
        match self.resource().kind() {
            ResourceKind::Managed | ResourceKind::PinnedHost => {
                return Err(device.unsupported(
                    "IPC of this memory",
                    format!(
                        "{} memory is not device memory of cuMemAlloc or of an exportable pool",
                        self.resource().kind()
                    ),
                    Some("a buffer of a SyncResource or StreamOrderedPool (legacy IPC), or of an ipc::SharedPool"),
                ));
            }
            _ => {}
        }
        let uuid = device.uuid()?;
        let ctx = self.stream().context();
        let _b = ctx.bind()?;
        let ptr = self.as_raw();
        // SAFETY: the attribute is a CUmemoryPool. Drivers before 11.3 do not know it: then the
        // memory is no pool's.
        let pool: CUmemoryPool =
            unsafe { pointer_attribute(ptr, PA::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE) }.unwrap_or(std::ptr::null_mut());
        if !pool.is_null() {
            // SAFETY: the attribute is an unsigned long long of CUmemAllocationHandleType bits.
            let types: u64 =
                unsafe { pointer_attribute(ptr, PA::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES) }.unwrap_or(0);
            if types == 0 {
                return Err(device.unsupported(
                    "IPC of memory-pool allocations",
                    "the buffer comes from a memory pool created without shareable handle types (the device's default \
                     pool, DriverPool::with_config), which cannot export its memory; legacy IPC (cuIpcGetMemHandle) \
                     does not work on pool memory either (cudarc #521)",
                    Some("an ipc::SharedPool for the buffers to share, or a SyncResource or StreamOrderedPool (legacy IPC)"),
                ));
            }
            let mut data = cudrv_sys::CUmemPoolPtrExportData::default();
            // SAFETY: valid out-pointer; `ptr` is the start of a live allocation of an exportable
            // pool; the context is current.
            unsafe { drv!(cuMemPoolExportPointer(&mut data, ptr)) }?;
            return Ok(IpcMemHandle { kind: IpcMemKind::Pool, raw: data.reserved, offset: 0, bytes, uuid });
        }
        // SAFETY: the attribute is a boolean int.
        let legacy: i32 = unsafe { pointer_attribute(ptr, PA::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) }?;
        if legacy == 0 {
            if self.resource().kind() == ResourceKind::StreamOrderedPool {
                return Err(device.unsupported(
                    "legacy IPC of this memory",
                    "the StreamOrderedPool grows in segments of virtual memory (PoolConfig::expandable, on by default \
                     where the device has virtual memory management), which cuIpcGetMemHandle cannot share",
                    Some(
                        "a StreamOrderedPool made with PoolConfig { expandable: false, .. }, a SyncResource, or an \
                          ipc::SharedPool",
                    ),
                ));
            }
            return Err(device.unsupported(
                "legacy IPC of this memory",
                "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0: the memory is not from cuMemAlloc",
                Some("a buffer of a SyncResource or StreamOrderedPool, or of an ipc::SharedPool"),
            ));
        }
        require_legacy_ipc(&device)?;
        let (mut base, mut size) = (0, 0);
        // SAFETY: valid out-pointers and a live device pointer; the context is current.
        unsafe { drv!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr)) }?;
        let mut h = cudrv_sys::CUipcMemHandle::default();
        // SAFETY: valid out-pointer; `base` starts a live cuMemAlloc allocation.
        unsafe { drv!(cuIpcGetMemHandle(&mut h, base)) }?;
        Ok(IpcMemHandle { kind: IpcMemKind::Legacy, raw: h.reserved.map(|b| b as u8), offset: ptr - base, bytes, uuid })
    }
}

/// The address `offset` bytes into the allocation that starts at `base`, if `bytes` from there lie
/// inside it and the address is aligned for `T` (`cuMemGetAddressRange`; the allocation's context
/// must be current).
///
/// # Errors
/// [`Error::InvalidArgument`] for a range past the allocation or a misaligned address; the
/// driver's error.
fn within_allocation<T>(base: DevicePtr, offset: u64, bytes: u64) -> Result<DevicePtr> {
    let (mut start, mut size) = (0, 0);
    // SAFETY: valid out-pointers; `base` was mapped or imported by the caller; the context is
    // current.
    unsafe { drv!(cuMemGetAddressRange_v2(&mut start, &mut size, base)) }?;
    let end = start.checked_add(size as u64);
    match base.checked_add(offset) {
        Some(ptr) if ptr.checked_add(bytes).zip(end).is_some_and(|(last, end)| last <= end) => {
            // The handle's offset is another process's word: a buffer of `T` must be aligned for
            // it, as every `DeviceBuffer` is (kernels take its address as a `T*`).
            let align = std::mem::align_of::<T>() as u64;
            if !ptr.is_multiple_of(align) {
                return Err(Error::InvalidArgument(format!(
                    "the IPC handle's buffer, at offset {offset} of the allocation, is not aligned for {} ({align} bytes)",
                    std::any::type_name::<T>()
                )));
            }
            Ok(ptr)
        }
        _ => Err(Error::InvalidArgument(format!(
            "the IPC handle claims {bytes} bytes at offset {offset}, past the end of the {size}-byte allocation it opens"
        ))),
    }
}

/// What an [`IpcBuffer`] maps, and how it is let go.
enum Mapping {
    /// A legacy mapping, shared by every buffer of this process opened from handles of the same
    /// allocation (the driver maps an allocation once per context).
    Legacy(Arc<LegacyMapping>),
    /// An imported pool pointer, freed with `cuMemFree`; keeps its pool alive.
    Pool { ptr: DevicePtr, _pool: Arc<PoolInner> },
}

/// A legacy mapping (`cuIpcOpenMemHandle`), closed (`cuIpcCloseMemHandle`) with its last user.
struct LegacyMapping {
    base: DevicePtr,
    key: ([u8; RAW], i32),
    ctx: Arc<Context>,
}

/// The legacy mappings of this process: one per (handle, device).
fn legacy_mappings() -> &'static Mutex<Vec<std::sync::Weak<LegacyMapping>>> {
    static MAPPINGS: OnceLock<Mutex<Vec<std::sync::Weak<LegacyMapping>>>> = OnceLock::new();
    MAPPINGS.get_or_init(Default::default)
}

impl Drop for LegacyMapping {
    fn drop(&mut self) {
        let base = self.base;
        crate::context::drop_call(self.ctx.clone(), move || {
            let _relaxed = RelaxedCaptureMode::enter();
            // SAFETY: the mapping was opened once in this context (current) and is closed once, by
            // its last user, after every use of it completed (IpcBuffer's drop waits).
            unsafe { drv!(cuIpcCloseMemHandle(base)) }
        });
    }
}

/// What a capture refuses of IPC buffers: their unmapping does not wait for graphs.
const CAPTURE: &str = "IpcBuffer during a capture (capture work on DeviceBuffers, which graphs keep alive)";

/// Device memory of another process, opened from an [`IpcMemHandle`]: the buffer the handle names
/// (`len` elements of `T`), in this process's address space.
///
/// It copies, fills and launches as a [`DeviceBuffer`] does, on its stream; uses on other streams
/// are recorded, and `Drop` orders its stream after them and waits on the host for that stream
/// before it lets the mapping go (legacy: `cuIpcCloseMemHandle` with the last buffer of the
/// allocation; pool: `cuMemFree`). The exporter
/// must keep the memory alive until then (see [the module documentation](crate::ipc)).
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use cudrv::{Device, Stream, ipc::{IpcBuffer, IpcMemHandle}};
/// // In the process that opens a buffer another process exported (`DeviceBuffer::ipc_handle`),
/// // its handle received as text:
/// fn read_shared(handle: &str) -> cudrv::Result<Vec<u32>> {
///     let handle: IpcMemHandle = handle.parse()?;
///     let stream = Stream::new(&Device::get(0)?)?;
///     let shared = IpcBuffer::<u32>::open(&handle, &stream)?;
///     shared.to_vec()
/// }
/// // A handle that names nothing is refused with an error, never a crash.
/// assert!(read_shared("not a handle").is_err());
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct IpcBuffer<T: DeviceRepr> {
    ptr: DevicePtr,
    len: usize,
    stream: Stream,
    used_on: StreamUses,
    mapping: Option<Mapping>,
    _t: PhantomData<T>,
}

// SAFETY: the buffer owns its mapping (driver handles usable from any thread); the use list is
// behind a Mutex; T is Send + Sync (DeviceRepr).
unsafe impl<T: DeviceRepr> Send for IpcBuffer<T> {}
// SAFETY: as above.
unsafe impl<T: DeviceRepr> Sync for IpcBuffer<T> {}

impl<T: DeviceRepr> IpcBuffer<T> {
    /// Opens a legacy handle ([`IpcMemKind::Legacy`]) on `stream`'s device (`cuIpcOpenMemHandle`
    /// with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, so another device than the exporter's can open
    /// it where peer access is possible). Handles of the same allocation share one mapping.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a pool handle (open it with [`ImportedPool::open`]) or a size
    /// that is not a whole number of `T`; [`Error::Unsupported`] without legacy IPC; the driver's
    /// error (a handle of this very process, of memory already freed).
    pub fn open(handle: &IpcMemHandle, stream: &Stream) -> Result<IpcBuffer<T>> {
        if handle.kind != IpcMemKind::Legacy {
            return Err(Error::InvalidArgument(
                "a handle of a pool allocation: open it with ImportedPool::open, from the pool's imported handle"
                    .into(),
            ));
        }
        let len = handle.elements::<T>()?;
        let device = stream.device();
        require_legacy_ipc(&device)?;
        let key = (handle.raw, device.ordinal_i32());
        let mapping = {
            let mut all = legacy_mappings().lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            all.retain(|w| w.strong_count() > 0);
            match all.iter().filter_map(std::sync::Weak::upgrade).find(|m| m.key == key) {
                Some(m) => m,
                None => {
                    let ctx = stream.context().clone();
                    let mut base = 0;
                    {
                        let _b = ctx.bind()?;
                        let _relaxed = RelaxedCaptureMode::enter();
                        let raw = cudrv_sys::CUipcMemHandle { reserved: handle.raw.map(|b| b as _) };
                        let flags = cudrv_sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.0;
                        // SAFETY: valid out-pointer; the handle is bytes the driver validates; the
                        // context is current.
                        unsafe { drv!(cuIpcOpenMemHandle_v2(&mut base, raw, flags)) }?;
                    }
                    let m = Arc::new(LegacyMapping { base, key, ctx });
                    all.push(Arc::downgrade(&m));
                    m
                }
            }
        };
        // The handle is bytes from another process: its offset and size are checked against the
        // allocation mapped (a buffer past it would reach other memory of this process).
        let ptr = {
            let _b = stream.context().bind()?;
            within_allocation::<T>(mapping.base, handle.offset, handle.bytes)?
        };
        Ok(IpcBuffer {
            ptr,
            len,
            stream: stream.clone(),
            used_on: StreamUses::default(),
            mapping: Some(Mapping::Legacy(mapping)),
            _t: PhantomData,
        })
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address in this process.
    pub fn as_raw(&self) -> DevicePtr {
        self.ptr
    }

    /// The stream the buffer's copies and fills are queued on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device it was opened on.
    pub fn device(&self) -> Device {
        self.stream.device()
    }

    /// Records that work on `stream` (of the buffer's device) uses the buffer, as
    /// [`DeviceBuffer::record_use`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device; the driver's error.
    pub fn record_use(&self, stream: &Stream) -> Result<()> {
        if stream.id() != self.stream.id() {
            crate::memory::check_stream("IpcBuffer::record_use", self.device(), stream)?;
        }
        // A graph could not keep the mapping alive: refused in a capture (see crate::graph), on
        // the use's stream and on the buffer's (ordering the one after the other would join it).
        self.used_on.use_on(&self.stream, stream, CAPTURE).map(drop)
    }

    /// Copies `src` into the buffer (on its stream) and waits.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; the driver's error.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        check_len("the IpcBuffer", self.len, src.len())?;
        // Captured, the copy would touch `src` at every launch, long after this call.
        let gate = self.stream.refuse_host_copy("IpcBuffer::copy_from_host during a capture")?;
        if self.len == 0 {
            return Ok(());
        }
        {
            let _b = self.stream.context().bind()?;
            // SAFETY: the destination is the mapped buffer, held mutably; `src` stays borrowed
            // until the stream is synchronised below.
            unsafe {
                drv!(cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), self.byte_len(), self.stream.as_raw()))
            }?;
        }
        self.stream.wait_for_access(gate)
    }

    /// Copies the buffer into `dst` (on its stream) and waits.
    ///
    /// # Errors
    /// As [`IpcBuffer::copy_from_host`].
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.copy_to_host_uninit(as_uninit(dst))
    }

    /// [`IpcBuffer::copy_to_host`] into memory that may not be initialised yet; it is, once this
    /// returns `Ok`.
    fn copy_to_host_uninit(&self, dst: &mut [MaybeUninit<T>]) -> Result<()> {
        check_len("the IpcBuffer", self.len, dst.len())?;
        // Captured, the copy would touch `dst` at every launch, long after this call.
        let gate = self.stream.refuse_host_copy("IpcBuffer::copy_to_host during a capture")?;
        if self.len == 0 {
            return Ok(());
        }
        {
            let _b = self.stream.context().bind()?;
            // SAFETY: `dst` is valid for the copy and stays borrowed until the stream is
            // synchronised below.
            unsafe {
                drv!(cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, self.byte_len(), self.stream.as_raw()))
            }?;
        }
        self.stream.wait_for_access(gate)
    }

    /// The contents in a `Vec`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // SAFETY: the copy writes every element when it returns `Ok`, having waited for it.
        unsafe { vec_written(self.len, |dst| self.copy_to_host_uninit(dst)) }
    }

    /// Copies `src` (a buffer of the same device) into this buffer, queued on this buffer's
    /// stream; `src`'s use there is recorded.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the lengths differ; [`Error::DeviceMismatch`] across
    /// devices; the driver's error.
    pub fn copy_from(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        check_len("the IpcBuffer", self.len, src.len())?;
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch {
                what: "IpcBuffer::copy_from",
                expected: self.device().ordinal_i32(),
                found: src.device().ordinal_i32(),
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        // Both held until the copy is queued: a capture begun meanwhile would take it unseen.
        let _gate = self.stream.refuse_in_capture(CAPTURE)?;
        let _src = src.use_on(&self.stream)?;
        let _b = self.stream.context().bind()?;
        // SAFETY: both ranges are live device memory of `byte_len` bytes, ordered on the stream.
        unsafe { drv!(cuMemcpyDtoDAsync_v2(self.ptr, src.as_raw(), self.byte_len(), self.stream.as_raw())) }
    }

    /// Sets every byte to `byte` (queued on the buffer's stream).
    ///
    /// # Errors
    /// The driver's error.
    pub fn memset(&mut self, byte: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        // Held until the memset is queued: a capture begun meanwhile would take it unseen.
        let _gate = self.stream.refuse_in_capture(CAPTURE)?;
        let _b = self.stream.context().bind()?;
        // SAFETY: the mapped buffer, held mutably; ordered on its stream.
        unsafe { drv!(cuMemsetD8Async(self.ptr, byte, self.byte_len(), self.stream.as_raw())) }
    }
}

impl<T: DeviceRepr> Drop for IpcBuffer<T> {
    fn drop(&mut self) {
        let (ctx, mapping) = (self.stream.context().clone(), self.mapping.take());
        crate::memory::free_after_waiting(self.stream.clone(), self.used_on.take(), move || {
            match mapping {
                // The last user closes the mapping (LegacyMapping's drop).
                Some(Mapping::Legacy(m)) => drop(m),
                Some(Mapping::Pool { ptr, _pool }) => {
                    // SAFETY: the pointer was imported once by this buffer and is freed once,
                    // after every use completed (waited for).
                    crate::memory::uncaptured(&ctx, || unsafe { drv!(cuMemFree_v2(ptr)) })?;
                }
                None => {}
            }
            Ok(())
        });
    }
}

impl<T: DeviceRepr> fmt::Debug for IpcBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device().ordinal())
            .finish()
    }
}

/// The kind of operating-system handle a pool exports (`CUmemAllocationHandleType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShareableHandleType {
    /// A file descriptor (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, Linux): pass it with
    /// `SCM_RIGHTS` over a Unix socket, or take it with `pidfd_getfd`.
    PosixFd,
    /// An NT handle (`CU_MEM_HANDLE_TYPE_WIN32`, Windows): pass it with `DuplicateHandle`.
    Win32,
    /// A KMT handle (`CU_MEM_HANDLE_TYPE_WIN32_KMT`, Windows): a number valid in every process.
    Win32Kmt,
}

impl ShareableHandleType {
    /// The type this platform's pools use: [`ShareableHandleType::Win32`] on Windows,
    /// [`ShareableHandleType::PosixFd`] elsewhere.
    pub fn native() -> ShareableHandleType {
        if cfg!(windows) { ShareableHandleType::Win32 } else { ShareableHandleType::PosixFd }
    }

    fn raw(self) -> CUmemAllocationHandleType {
        match self {
            ShareableHandleType::PosixFd => CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            ShareableHandleType::Win32 => CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32,
            ShareableHandleType::Win32Kmt => CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32_KMT,
        }
    }

    fn bit(self) -> u32 {
        self.raw().0
    }
}

/// A pool's shareable handle ([`SharedPool::export`], [`DriverPool::export`]): an
/// operating-system handle of the exporting process, which the caller owns (close it when it is no
/// longer needed: `OwnedFd::from_raw_fd`, `CloseHandle`) and passes to the other process by the
/// operating system's means (see [`ShareableHandleType`]). Plain data: copying it does not
/// duplicate the OS handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolShareableHandle {
    /// Its kind.
    pub handle_type: ShareableHandleType,
    /// The file descriptor, or the handle's value.
    pub raw: u64,
}

/// Exports the pool `pool` (`cuMemPoolExportToShareableHandle`) for a pool of `device`.
fn export_pool(
    device: &Device,
    pool: CUmemoryPool,
    ctx: &Context,
    handle_type: ShareableHandleType,
) -> Result<PoolShareableHandle> {
    let caps = device.capabilities()?;
    if caps.memory_pool_handle_types & handle_type.bit() == 0 {
        return Err(device.unsupported(
            "exporting a memory pool",
            format!(
                "the device's pools export {} handles, not {handle_type:?} (CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)",
                crate::device::handle_types(caps.memory_pool_handle_types)
            ),
            Some("legacy IPC of SyncResource or StreamOrderedPool memory, where the device has it"),
        ));
    }
    let _b = ctx.bind()?;
    // Wide enough for every kind: an int (fd), a HANDLE (pointer) or a 32-bit KMT handle.
    let mut out: u64 = 0;
    // SAFETY: `out` is 8 writable bytes, enough for each handle type; a live pool.
    let rc = unsafe { driver()?.cuMemPoolExportToShareableHandle((&raw mut out).cast(), pool, handle_type.raw(), 0) };
    match check("cuMemPoolExportToShareableHandle", rc) {
        Ok(()) => {}
        Err(e) if matches!(e.code(), Some(CUresult::CUDA_ERROR_INVALID_VALUE | CUresult::CUDA_ERROR_NOT_SUPPORTED)) => {
            return Err(device.unsupported(
                "exporting a memory pool",
                format!(
                    "the pool was created without the {handle_type:?} handle type (CUmemPoolProps::handleTypes; the \
                     device's default pool and DriverPool::with_config pools have none): {e}"
                ),
                Some("ipc::SharedPool, created with a shareable handle type"),
            ));
        }
        Err(e) => return Err(e),
    }
    let raw = match handle_type {
        ShareableHandleType::PosixFd => u64::from(out as u32 as i32 as u32),
        ShareableHandleType::Win32 => out,
        ShareableHandleType::Win32Kmt => u64::from(out as u32),
    };
    Ok(PoolShareableHandle { handle_type, raw })
}

impl DriverPool {
    /// Exports the pool for other processes (`cuMemPoolExportToShareableHandle`), where its handle
    /// types allow: pools made by cudrv's [`DriverPool`] constructors have none (the driver's
    /// default), so they are refused with [`Error::Unsupported`]; use a [`SharedPool`].
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the device or the pool cannot export `handle_type`; the
    /// driver's error.
    pub fn export(&self, handle_type: ShareableHandleType) -> Result<PoolShareableHandle> {
        let device = self.device();
        let ctx = device.primary_context()?;
        export_pool(&device, self.as_raw(), &ctx, handle_type)
    }
}

/// The pool behind a [`SharedPool`] or an [`ImportedPool`], destroyed with its last user.
struct PoolInner {
    raw: CUmemoryPool,
    ctx: Arc<Context>,
}

// SAFETY: a CUmemoryPool handle may be used from any thread; the driver serialises pool access.
unsafe impl Send for PoolInner {}
// SAFETY: as above.
unsafe impl Sync for PoolInner {}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let (raw, ctx) = (crate::host_fn::SendHandle(self.raw), self.ctx.clone());
        let destroy = move || {
            let Ok(d) = driver() else { return };
            // SAFETY: the pool was created or imported by cudrv and is destroyed once; the driver
            // defers the release while allocations are outstanding.
            if let Err(e) = check("cuMemPoolDestroy", unsafe { d.cuMemPoolDestroy(raw.get()) }) {
                report_drop_error(Some(&ctx), e);
            }
        };
        crate::host_fn::now_or_deferred(destroy)
    }
}

/// A driver memory pool whose allocations other processes can import (`cuMemPoolCreate` with a
/// shareable handle type): a stream-ordered [`MemoryResource`] like [`DriverPool`] (release
/// threshold raised to `u64::MAX`), whose buffers give [`IpcMemHandle`]s of kind
/// [`IpcMemKind::Pool`] ([`DeviceBuffer::ipc_handle`]).
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use std::sync::Arc;
/// use cudrv::{Device, Stream, ipc::SharedPool, memory::DeviceBuffer};
/// let device = Device::get(0)?;
/// let pool = Arc::new(SharedPool::new(&device)?);
/// let pool_handle = pool.export()?; // an fd: pass it to the other process (SCM_RIGHTS, pidfd_getfd)
/// let stream = Stream::new(&device)?;
/// let buf = DeviceBuffer::from_slice_in(&[1.0f32; 1024], &stream, pool.clone())?;
/// let handle = buf.ipc_handle()?; // bytes: send them too
/// # Ok::<(), cudrv::Error>(())
/// ```
#[derive(Debug)]
pub struct SharedPool {
    inner: Arc<PoolInner>,
    handle_type: ShareableHandleType,
}

impl fmt::Debug for PoolInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool").field("raw", &self.raw).field("device", &self.ctx.device().ordinal()).finish()
    }
}

impl SharedPool {
    /// A pool on `device` that exports this platform's handles ([`ShareableHandleType::native`]).
    ///
    /// # Errors
    /// As [`SharedPool::with_handle_type`].
    pub fn new(device: &Device) -> Result<SharedPool> {
        Self::with_handle_type(device, ShareableHandleType::native())
    }

    /// A pool on `device` that exports `handle_type` handles.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without memory pools, or when the device's pools cannot export that
    /// type ([`crate::Capabilities::memory_pool_handle_types`]; none on TCC); the driver's error.
    pub fn with_handle_type(device: &Device, handle_type: ShareableHandleType) -> Result<SharedPool> {
        let caps = device.capabilities()?;
        if !caps.memory_pools {
            return Err(device.unsupported(
                "memory pools",
                crate::memory::pools_missing_reason(caps),
                Some("legacy IPC of SyncResource or StreamOrderedPool memory (DeviceBuffer::ipc_handle)"),
            ));
        }
        if caps.memory_pool_handle_types & handle_type.bit() == 0 {
            return Err(device.unsupported(
                "a shareable memory pool",
                format!(
                    "the device's pools export {} handles, not {handle_type:?}",
                    crate::device::handle_types(caps.memory_pool_handle_types)
                ),
                Some("legacy IPC of SyncResource or StreamOrderedPool memory (DeviceBuffer::ipc_handle)"),
            ));
        }
        let ctx = device.primary_context()?;
        let props = cudrv_sys::CUmemPoolProps {
            allocType: cudrv_sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: handle_type.raw(),
            location: cudrv_sys::CUmemLocation {
                type_: cudrv_sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device.ordinal_i32(),
            },
            ..Default::default()
        };
        let mut raw = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: valid out-pointer and fully initialised properties.
            unsafe { drv!(cuMemPoolCreate(&mut raw, &props)) }?;
        }
        let pool = SharedPool { inner: Arc::new(PoolInner { raw, ctx }), handle_type };
        let mut threshold: cudrv_sys::cuuint64_t = u64::MAX;
        let _b = pool.inner.ctx.bind()?;
        // SAFETY: the attribute takes a cuuint64_t, passed by pointer; a live pool.
        unsafe {
            drv!(cuMemPoolSetAttribute(
                raw,
                cudrv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut threshold).cast()
            ))
        }?;
        drop(_b);
        Ok(pool)
    }

    /// The pool's shareable handle, for [`ImportedPool::import`] in another process
    /// (`cuMemPoolExportToShareableHandle`). Each call makes a new OS handle, which the caller
    /// owns.
    ///
    /// # Errors
    /// The driver's error.
    pub fn export(&self) -> Result<PoolShareableHandle> {
        export_pool(&self.device(), self.inner.raw, &self.inner.ctx, self.handle_type)
    }

    /// The handle type it exports.
    pub fn handle_type(&self) -> ShareableHandleType {
        self.handle_type
    }

    /// The raw `CUmemoryPool`.
    pub fn as_raw(&self) -> CUmemoryPool {
        self.inner.raw
    }

    fn attribute(&self, attr: cudrv_sys::CUmemPool_attribute) -> Result<u64> {
        let _b = self.inner.ctx.bind()?;
        let mut v: cudrv_sys::cuuint64_t = 0;
        // SAFETY: the attribute is a cuuint64_t, written through the pointer.
        unsafe { drv!(cuMemPoolGetAttribute(self.inner.raw, attr, (&raw mut v).cast())) }?;
        Ok(v)
    }
}

// SAFETY: the driver's pool gives stream-ordered memory with exactly these semantics.
unsafe impl MemoryResource for SharedPool {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        crate::memory::check_stream("SharedPool::allocate", self.device(), stream)?;
        let _b = self.inner.ctx.bind()?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer, pool and stream; the context is current. Zero bytes is an
        // error for the driver, so a zero-sized request takes one byte.
        unsafe { drv!(cuMemAllocFromPoolAsync(&mut ptr, bytes.max(1), self.inner.raw, stream.as_raw())) }?;
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, _bytes: usize, stream: &Stream) -> Result<()> {
        let _b = self.inner.ctx.bind()?;
        // SAFETY: the caller passes a live pointer of this pool; the free is ordered on `stream`.
        unsafe { drv!(cuMemFreeAsync(ptr, stream.as_raw())) }
    }

    fn device(&self) -> Device {
        self.inner.ctx.device()
    }

    fn kind(&self) -> ResourceKind {
        ResourceKind::DriverPool
    }

    fn stats(&self) -> Option<MemoryStats> {
        use cudrv_sys::CUmemPool_attribute as A;
        let a = |x| self.attribute(x).ok().map(|v| v as usize);
        Some(MemoryStats {
            reserved: a(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            peak_reserved: a(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            in_use: a(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            peak_in_use: a(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            driver_allocations: 0,
        })
    }

    fn trim(&self, keep_bytes: usize) -> Result<()> {
        let _b = self.inner.ctx.bind()?;
        // SAFETY: a live pool.
        unsafe { drv!(cuMemPoolTrimTo(self.inner.raw, keep_bytes)) }
    }

    fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        let _b = self.inner.ctx.bind()?;
        let mut v = bytes as cudrv_sys::cuuint64_t;
        // SAFETY: a live pool; the attribute is a cuuint64_t read through the pointer.
        unsafe {
            drv!(cuMemPoolSetAttribute(
                self.inner.raw,
                cudrv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut v).cast()
            ))
        }
    }
}

/// Another process's pool, imported from its shareable handle
/// (`cuMemPoolImportFromShareableHandle`): it cannot allocate, only open the exporter's
/// allocations ([`ImportedPool::open`], `cuMemPoolImportPointer`).
#[derive(Clone, Debug)]
pub struct ImportedPool {
    inner: Arc<PoolInner>,
}

impl ImportedPool {
    /// Imports a pool on `device` from `handle`, an OS handle of *this* process (received from
    /// the exporter by the operating system's means; see [`ShareableHandleType`]).
    ///
    /// # Errors
    /// [`Error::Unsupported`] without memory pools or that handle type; the driver's error (a
    /// handle that is not a pool's).
    pub fn import(device: &Device, handle: PoolShareableHandle) -> Result<ImportedPool> {
        let caps = device.capabilities()?;
        if !caps.memory_pools || caps.memory_pool_handle_types & handle.handle_type.bit() == 0 {
            return Err(device.unsupported(
                "importing a memory pool",
                format!(
                    "the device's pools import {} handles{}",
                    crate::device::handle_types(caps.memory_pool_handle_types),
                    if caps.memory_pools { "" } else { " (it has no memory pools)" }
                ),
                Some("legacy IPC (IpcBuffer::open)"),
            ));
        }
        let ctx = device.primary_context()?;
        let mut raw = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // For a file descriptor the driver takes the int by value, cast to a pointer; for
            // Windows handles, the handle itself.
            let os: *mut std::ffi::c_void = std::ptr::without_provenance_mut(handle.raw as usize);
            // SAFETY: valid out-pointer; the handle is a value the driver validates; the context
            // is current.
            unsafe { drv!(cuMemPoolImportFromShareableHandle(&mut raw, os, handle.handle_type.raw(), 0)) }?;
        }
        Ok(ImportedPool { inner: Arc::new(PoolInner { raw, ctx }) })
    }

    /// Opens an allocation of the exporter's pool ([`IpcMemKind::Pool`] handle) on `stream`
    /// (`cuMemPoolImportPointer`). The memory must not be used before the exporter's allocation
    /// has completed (order it with an [`IpcEvent`]); it is freed (`cuMemFree`) when the buffer
    /// is dropped, which must happen before the exporter frees it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a legacy handle or a size that is not a whole number of
    /// `T`; [`Error::DeviceMismatch`] for a stream of another device than the pool's; the
    /// driver's error.
    pub fn open<T: DeviceRepr>(&self, handle: &IpcMemHandle, stream: &Stream) -> Result<IpcBuffer<T>> {
        if handle.kind != IpcMemKind::Pool {
            return Err(Error::InvalidArgument("a legacy IPC handle: open it with IpcBuffer::open".into()));
        }
        crate::memory::check_stream("ImportedPool::open", self.inner.ctx.device(), stream)?;
        let len = handle.elements::<T>()?;
        let mut data = cudrv_sys::CUmemPoolPtrExportData { reserved: handle.raw };
        let mut ptr = 0;
        {
            let _b = self.inner.ctx.bind()?;
            // SAFETY: valid out-pointer; an imported pool; export data the driver validates.
            unsafe { drv!(cuMemPoolImportPointer(&mut ptr, self.inner.raw, &mut data)) }?;
            // The size is the handle's claim: checked against the allocation imported.
            if let Err(e) = within_allocation::<T>(ptr, 0, handle.bytes) {
                let _relaxed = RelaxedCaptureMode::enter();
                // SAFETY: imported just above, unused, freed once.
                if let Err(free) = unsafe { drv!(cuMemFree_v2(ptr)) } {
                    report_drop_error(Some(&self.inner.ctx), free);
                }
                return Err(e);
            }
        }
        Ok(IpcBuffer {
            ptr,
            len,
            stream: stream.clone(),
            used_on: StreamUses::default(),
            mapping: Some(Mapping::Pool { ptr, _pool: self.inner.clone() }),
            _t: PhantomData,
        })
    }

    /// The raw `CUmemoryPool`.
    pub fn as_raw(&self) -> CUmemoryPool {
        self.inner.raw
    }
}

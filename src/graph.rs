//! CUDA graphs: work recorded once and launched many times, with one launch call.
//!
//! A [`Graph`] is made by capturing a stream ([`Stream::begin_capture`] ... [`Stream::end_capture`]:
//! the work queued on the stream is recorded instead of run), or built node by node. It is
//! instantiated into a [`GraphExec`], which is launched on a stream as often as wanted, uploaded
//! ahead of its first launch, and updated in place from a changed graph.
//!
//! ```
//! # if !cudrv::__doctest_driver() { return Ok(()); }
//! use cudrv::{Device, Module, Stream, graph::CaptureMode, launch::LaunchConfig, memory::DeviceBuffer};
//! let device = Device::get(0)?;
//! let stream = Stream::new(&device)?;
//! let module = Module::from_ptx(&device, include_str!("../examples/kernels/vector_add.ptx"))?;
//! let fill = module.function("fill_u32")?;
//! let mut out = DeviceBuffer::<u32>::zeroed(1024, &stream)?;
//! stream.begin_capture(CaptureMode::ThreadLocal)?;
//! // SAFETY: fill_u32(u32*, u32, u64) writes out[0..1024], and `out` outlives every launch below.
//! unsafe { fill.launch(LaunchConfig::for_num_elems(1024), &stream, (&mut out, 7u32, 1024u64))? };
//! let graph = stream.end_capture()?;
//! let exec = graph.instantiate()?;
//! for _ in 0..100 {
//!     exec.launch(&stream)?;
//! }
//! assert_eq!(out.to_vec()?, vec![7; 1024]);
//! # Ok::<(), cudrv::Error>(())
//! ```
//!
//! # Safety during capture
//!
//! A captured graph runs later, possibly many times, on any stream, and refers to memory by
//! address. cudrv keeps that sound without asking for `unsafe`:
//!
//! * **Buffers allocated before the capture** and used by it (copies, memsets, kernel arguments)
//!   stay allocated while the graph, or an executable graph made from it, exists: a buffer
//!   dropped meanwhile hands its free to the graph, which frees it after its last launch has
//!   completed. The first launch of each executable graph waits (on the GPU) for the buffers'
//!   allocations and for where the capturing streams stood when the capture began.
//! * **Memory allocated during the capture** belongs to the graph. From a `DriverPool` the driver
//!   records memory nodes: allocated and freed inside each launch. From cudrv's
//!   `StreamOrderedPool` (where the driver has no pools, as on Windows TCC) the block is reserved
//!   for the graph's life, taken only from memory no earlier work can still touch: the same
//!   address at every launch, never handed to anyone else, and given back to the pool once the
//!   graph and its executable graph are gone and their last launch has completed. Such a graph
//!   has one executable graph at a time (as the driver requires of graphs with memory nodes),
//!   whose launches the driver runs one after another. A buffer allocated during the capture can
//!   be used only by the capture's work, and must be dropped before [`Stream::end_capture`] (its
//!   free is part of the graph); `end_capture` refuses the capture otherwise.
//! * **Refused** with [`Error::Capturing`], because a graph cannot keep them sound or the driver
//!   would invalidate the capture: copies to and from host memory (pageable or pinned),
//!   synchronous memsets, [`Stream::synchronize`], host functions (a graph calls them at every
//!   launch; use [`Graph::add_host_node`]), allocation from resources that cannot allocate inside
//!   a graph (`SyncResource`, `ManagedResource`), `DeviceBuffer2D`/`3D`, `ManagedBuffer` and
//!   `IpcBuffer` (their frees cannot wait for graphs), launching or uploading an executable
//!   graph into a capture, and using a buffer whose stream captures on a stream outside the
//!   capture: ordering that stream after the buffer's would make it join the capture unseen.
//!   Join it first, with [`Stream::wait_stream`]; the driver's own joins (through events) are
//!   tracked.
//! * Kernel launches stay `unsafe`, as outside a capture; their contract covers every launch of
//!   the graph.
//! * A buffer dropped during a capture that does not use it, while its stream takes part in the
//!   capture, is freed when the capture ends (a free queued then would become part of the graph).
//!
//! cudrv's pool never lets a capture see its own driver calls: its growth and waits run with the
//! thread's capture mode relaxed, as PyTorch's allocator does, and it records, waits on and
//! queries no event of a capturing stream (its blocks stay unavailable to other streams until the
//! capture ends). A stream on which another thread is beginning a capture makes cudrv's work on
//! it wait until the capture's id is known. Graphs made by raw driver calls are unknown to cudrv
//! and get none of this.
//!
//! A capture may begin on a stream while another thread's host copy, synchronous memset or
//! [`Stream::synchronize`] waits for the stream's earlier work (a host function there may be
//! waiting for the thread that begins the capture): the wait is for an event recorded before the
//! capture began. A copy with pageable host memory waits for the stream's earlier work before
//! it is queued (the driver's call would wait for it anyway), and is refused with
//! [`Error::Capturing`] if a capture began on the stream meanwhile.
//!
//! [`Graph`] and [`GraphExec`] are `Send` but not `Sync`: the driver does not synchronise calls on
//! one graph or executable graph (not even `cuGraphInstantiate` or `cuGraphLaunch`); share them
//! behind a `Mutex`. Once an executable graph of a graph that owns pool memory is dropped, the next
//! one's first launch waits for its last launch: they never run at once on that memory.
//!
//! Device-side launch (`CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`) and conditional nodes are not
//! offered yet.

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudrv_sys::{CUdeviceptr, CUgraph, CUgraphExec, CUgraphNode, CUresult};

use crate::context::{Context, report_drop_error};
use crate::device::Device;
use crate::error::check;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::host_fn::{self, SendHandle};
use crate::launch::LaunchConfig;
use crate::module::Function;
use crate::result::{driver, drv, drv_compat};
pub use crate::session::{CaptureInfo, CaptureStatus};
use crate::session::{CaptureSession, GraphResources, discard_graph, mark_before_join};
use crate::stream::{ParkedStream, Stream};

/// How a capture treats "potentially unsafe" calls (`cuMemAlloc`, synchronous copies...) made
/// meanwhile (`CUstreamCaptureMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Such calls fail on every thread while the capture is active (the driver's default).
    Global,
    /// Such calls fail on the capturing thread only.
    ThreadLocal,
    /// Such calls are allowed everywhere (they must then not touch the capture's work).
    Relaxed,
}

fn mode_raw(mode: CaptureMode) -> cudrv_sys::CUstreamCaptureMode {
    use cudrv_sys::CUstreamCaptureMode as M;
    match mode {
        CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

impl Stream {
    /// Begins capturing: work queued on the stream from now on is recorded into a graph instead
    /// of running, until [`Stream::end_capture`]. Streams that wait on an event recorded on a
    /// capturing stream join the capture (and must be joined back before it ends). See the
    /// [module documentation](crate::graph) for what cudrv refuses during a capture.
    ///
    /// If the stream's last handle is dropped before the capture ends (a panic in between), cudrv
    /// ends the capture and drops its graph, so that the driver stops refusing other threads' work
    /// (`CaptureMode::Global`). In global and thread-local modes only the thread that began the
    /// capture may end it: dropped on another thread (or in a host function), the capture goes
    /// on. While a buffer allocated during it lives, it is not ended (the buffer's memory is the
    /// graph's) until the last such buffer is dropped, which then ends it as the handle would
    /// have (on the thread of that drop).
    ///
    /// # Errors
    /// The driver's error (`CUDA_ERROR_ILLEGAL_STATE` when the stream is capturing already, or
    /// another thread is beginning a capture on it; the legacy stream cannot be captured).
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        // Other threads' cudrv work on this stream waits until the capture's id is known. The
        // stream takes part in a capture already, or another thread is beginning one: the
        // driver's answer to a second begin, without asking it (asked while the other thread's
        // begin is under way, it could let this one win, and that thread's failure would then
        // clear this capture's id).
        if !self.key().mark_capture_starting() {
            return Err(Error::driver("cuStreamBeginCapture", CUresult::CUDA_ERROR_ILLEGAL_STATE));
        }
        // Where the stream stands before the capture: the graph's first launch waits for it.
        // Recorded once marked, after the work that other threads queued while the mark waited
        // for their gates (a buffer's allocation there, used by the capture, is covered).
        let before = match mark_before_join(self) {
            Ok(before) => before,
            Err(e) => {
                self.key().set_capture_id(0);
                return Err(e);
            }
        };
        let begun = self.context().bind().and_then(|_b| {
            // SAFETY: a valid stream of the current context; a valid mode.
            unsafe { drv!(cuStreamBeginCapture_v2(self.as_raw(), mode_raw(mode))) }
        });
        if let Err(e) = begun {
            self.key().set_capture_id(0);
            return Err(e);
        }
        let id = match self.capture_state() {
            Ok((_, id)) => id,
            Err(e) => {
                self.key().set_capture_id(0);
                // Cannot track the capture: end it, so that nothing is captured unseen.
                discard_graph(self.key().end_capture_raw().1);
                return Err(e);
            }
        };
        CaptureSession::start(id, self, before);
        Ok(())
    }

    /// Ends the capture begun on this stream and returns the graph.
    ///
    /// Work that other threads queue meanwhile on the capture's streams, the origin or a stream
    /// that joined, is wholly part of the capture or wholly after it: the end waits for what is
    /// under way, and what comes later waits for the end.
    ///
    /// # Errors
    /// [`Error::Capturing`] while a buffer allocated during the capture is alive: its free
    /// belongs in the graph, so drop it first; the capture goes on. [`Error::Capturing`] too when
    /// called from code that cudrv runs while it queues work (a custom `MemoryResource`'s
    /// `allocate` or `deallocate`, a [`KernelArg::kernel_value`](crate::KernelArg::kernel_value))
    /// while work on a stream of the capture stays under way (it may be the caller's own); the
    /// capture goes on. The driver's error: `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` when a
    /// prohibited operation invalidated the capture, `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` when a
    /// stream that joined it was not joined back, `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD` for a
    /// thread-local or global capture ended on another thread, `CUDA_ERROR_ILLEGAL_STATE` when
    /// the stream is not capturing. The driver ends the capture on most errors (then the stream is
    /// usable again and the graph is discarded).
    pub fn end_capture(&self) -> Result<Graph> {
        let session = self.capture();
        if let Some(s) = &session {
            // Frees of the capture's buffers that were dropped where their stream could not be
            // reached, now on the origin: after all of the capture's joined work, in the graph.
            s.queue_frees_at_end(self);
        }
        // Other threads' cudrv work on the capture's streams waits from the look at the capture's
        // buffers to its end: a buffer allocated in between would be the graph's, and outlive the
        // capture. On every stream of it, not only this one: a launch on a joined stream looks at
        // the stream's capture (its arguments' uses), then queues the kernel and keeps its module
        // for the graph, under that stream's gate only; were the capture to end in between, the
        // kernel would be captured with its module not kept, or the uses noted as the graph's
        // while the kernel runs outside it.
        let ending = match &session {
            None => None,
            Some(s) => Some(s.mark_ending(None).ok_or(Error::Capturing {
                what: "Stream::end_capture from code that cudrv runs while it queues work (a custom \
                       MemoryResource's allocate or deallocate, a kernel argument's kernel_value), while work \
                       on a stream of the capture is under way",
            })?),
        };
        if let Some(s) = &session
            && s.live_buffers.load(Ordering::Acquire) > 0
        {
            // The capture goes on: its streams are unmarked.
            drop(ending);
            return Err(Error::Capturing {
                what: "Stream::end_capture while buffers allocated during the capture are alive (drop them \
                       first: their free belongs in the graph)",
            });
        }
        let (ended, raw) = self.key().end_capture_raw();
        if ended.is_err() && self.capture_status().is_ok_and(|s| s != CaptureStatus::None) {
            // Not ended (called on another stream than the origin, or on the wrong thread): the
            // capture goes on.
            drop(ending);
            return Err(ended.expect_err("checked above"));
        }
        let Some(session) = session else {
            // A capture cudrv did not start (raw driver calls): nothing of it is tracked.
            ended?;
            return Ok(Graph { raw, id: next_graph_id(), ctx: self.context().clone(), res: GraphResources::new() });
        };
        // Over at the driver: work on its streams may go on, and the session ends.
        if let Some(ending) = ending {
            ending.finish();
        }
        // On error, what the capture reserved is released with the session (nothing ran).
        ended?;
        Ok(Graph { raw, id: next_graph_id(), ctx: self.context().clone(), res: session.res.clone() })
    }
}

/// A node of a [`Graph`], to name as a dependency of later nodes of the same graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphNode {
    raw: CUgraphNode,
    /// The [`Graph::id`] of its graph: a node of another graph (maybe destroyed: its handle would
    /// dangle) is refused as a dependency.
    graph: u64,
}

// SAFETY: a node handle is plain data to Rust; the driver calls that use it take the graph too.
unsafe impl Send for GraphNode {}
// SAFETY: as above.
unsafe impl Sync for GraphNode {}

impl GraphNode {
    /// The raw `CUgraphNode`.
    pub fn as_raw(&self) -> CUgraphNode {
        self.raw
    }
}

/// A CUDA graph (`CUgraph`): nodes of work with dependencies between them. Made by
/// [`Stream::end_capture`] or [`Graph::new`] and the `add_*` methods; run by instantiating it
/// ([`Graph::instantiate`]). Dropping it destroys it (executable graphs made from it stay valid).
///
/// ```
/// # if !cudrv::__doctest_driver() { return Ok(()); }
/// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
/// use cudrv::{Device, Graph, Stream};
/// let device = Device::get(0)?;
/// let mut graph = Graph::new(&device)?;
/// let calls = Arc::new(AtomicUsize::new(0));
/// let c = calls.clone();
/// let first = graph.add_host_node(&[], move || { c.fetch_add(1, Ordering::SeqCst); })?;
/// graph.add_empty_node(&[first])?;
/// let exec = graph.instantiate()?;
/// let stream = Stream::new(&device)?;
/// exec.launch(&stream)?;
/// exec.launch(&stream)?;
/// stream.synchronize()?;
/// assert_eq!(calls.load(Ordering::SeqCst), 2);
/// # Ok::<(), cudrv::Error>(())
/// ```
pub struct Graph {
    raw: CUgraph,
    /// A number no other graph of the process has (the driver's handles may be reused).
    id: u64,
    ctx: Arc<Context>,
    /// What the graph's launches use that Rust owns.
    res: Arc<GraphResources>,
}

// SAFETY: a CUgraph handle may be used from any thread, one at a time: the driver does not
// synchronise calls on one graph (not even `cuGraphInstantiate`), so `Graph` is `Send` but not
// `Sync`, and every call on it goes through `&self` or `&mut self` of one thread. What it keeps is
// `Send + Sync`.
unsafe impl Send for Graph {}

/// The context and closure of a host node.
type HostFn = Box<dyn Fn() + Send + Sync + 'static>;

/// A new [`Graph::id`].
fn next_graph_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Graph {
    /// An empty graph on `device`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn new(device: &Device) -> Result<Graph> {
        let ctx = device.primary_context()?;
        let mut raw = std::ptr::null_mut();
        {
            let _b = ctx.bind()?;
            // SAFETY: a valid out-pointer; flags must be 0; the context is current.
            unsafe { drv!(cuGraphCreate(&mut raw, 0)) }?;
        }
        Ok(Graph { raw, id: next_graph_id(), ctx, res: GraphResources::new() })
    }

    /// The raw `CUgraph`.
    pub fn as_raw(&self) -> CUgraph {
        self.raw
    }

    /// The graph's device.
    pub fn device(&self) -> Device {
        self.ctx.device()
    }

    /// Every node of the graph (`cuGraphGetNodes`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn nodes(&self) -> Result<Vec<GraphNode>> {
        let _b = self.ctx.bind()?;
        let mut n = 0usize;
        // SAFETY: a valid graph; a null array asks for the count.
        unsafe { drv!(cuGraphGetNodes(self.raw, std::ptr::null_mut(), &mut n)) }?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        // SAFETY: the array has room for `n` nodes, which is passed.
        unsafe { drv!(cuGraphGetNodes(self.raw, nodes.as_mut_ptr(), &mut n)) }?;
        nodes.truncate(n);
        Ok(nodes.into_iter().map(|raw| GraphNode { raw, graph: self.id }).collect())
    }

    /// The raw handles of `deps`, which must be nodes of this graph.
    fn deps(&self, deps: &[GraphNode]) -> Result<Vec<CUgraphNode>> {
        deps.iter()
            .map(|node| match node.graph == self.id {
                true => Ok(node.raw),
                false => Err(Error::InvalidArgument("a dependency is a node of another graph".into())),
            })
            .collect()
    }

    /// Adds a node that does nothing (to join or fork dependencies).
    ///
    /// # Errors
    /// The driver's error.
    pub fn add_empty_node(&mut self, deps: &[GraphNode]) -> Result<GraphNode> {
        let _b = self.ctx.bind()?;
        let deps = self.deps(deps)?;
        let (d, n) = (if deps.is_empty() { std::ptr::null() } else { deps.as_ptr() }, deps.len());
        let mut node = std::ptr::null_mut();
        // SAFETY: a valid graph, `n` valid nodes of it, a valid out-pointer.
        unsafe { drv!(cuGraphAddEmptyNode(&mut node, self.raw, d, n)) }?;
        Ok(GraphNode { raw: node, graph: self.id })
    }

    /// Adds a kernel launch of `function` with a prepared `kernelParams` array (copied by the
    /// driver now).
    ///
    /// # Safety
    /// As [`Function::launch_raw`], for every launch of every executable graph made from this
    /// graph: the memory the arguments refer to must stay valid until the last of those launches
    /// has run.
    ///
    /// # Errors
    /// [`Error::InvalidLaunch`] for a configuration beyond the limits, [`Error::DeviceMismatch`]
    /// for a function of another device; the driver's error.
    pub unsafe fn add_kernel_node(
        &mut self,
        deps: &[GraphNode],
        function: &Function,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<GraphNode> {
        function.validate(&cfg)?;
        if function.device() != self.device() {
            return Err(Error::DeviceMismatch {
                what: "Graph::add_kernel_node",
                expected: self.device().ordinal_i32(),
                found: function.device().ordinal_i32(),
            });
        }
        let p = kernel_node_params(function, &cfg, params);
        let _b = self.ctx.bind()?;
        let deps = self.deps(deps)?;
        let (d, n) = (if deps.is_empty() { std::ptr::null() } else { deps.as_ptr() }, deps.len());
        let mut node = std::ptr::null_mut();
        // SAFETY: a valid graph and nodes; the parameters are complete and valid during the call
        // (the driver copies the arguments); the caller vouches for what they refer to.
        unsafe { drv_compat!(cuGraphAddKernelNode_v2 | cuGraphAddKernelNode(&mut node, self.raw, d, n, &p)) }?;
        // The node runs the kernel at each launch: the graph keeps its module loaded.
        self.res.keep(function.module.clone());
        Ok(GraphNode { raw: node, graph: self.id })
    }

    /// Adds a copy of `bytes` bytes from device address `src` to device address `dst` (of this
    /// graph's device or a peer).
    ///
    /// # Safety
    /// Both ranges must be valid device memory for every launch of every executable graph made
    /// from this graph, and nothing else may use `dst` while a launch runs.
    ///
    /// # Errors
    /// The driver's error.
    pub unsafe fn add_memcpy_node(
        &mut self,
        deps: &[GraphNode],
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
    ) -> Result<GraphNode> {
        let p = cudrv_sys::CUDA_MEMCPY3D {
            srcMemoryType: cudrv_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcDevice: src,
            dstMemoryType: cudrv_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstDevice: dst,
            WidthInBytes: bytes,
            Height: 1,
            Depth: 1,
            ..Default::default()
        };
        let _b = self.ctx.bind()?;
        let deps = self.deps(deps)?;
        let (d, n) = (if deps.is_empty() { std::ptr::null() } else { deps.as_ptr() }, deps.len());
        let mut node = std::ptr::null_mut();
        // SAFETY: a valid graph and nodes; complete copy parameters; the caller vouches for the
        // memory.
        unsafe { drv!(cuGraphAddMemcpyNode(&mut node, self.raw, d, n, &p, self.ctx.as_raw())) }?;
        Ok(GraphNode { raw: node, graph: self.id })
    }

    /// Adds a memset of `count` elements of `element_size` bytes (1, 2 or 4) at device address
    /// `dst`, each set to the low `element_size` bytes of `value`.
    ///
    /// # Safety
    /// The range must be valid device memory for every launch of every executable graph made from
    /// this graph, and nothing else may use it while a launch runs.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another element size; the driver's error.
    pub unsafe fn add_memset_node(
        &mut self,
        deps: &[GraphNode],
        dst: CUdeviceptr,
        value: u32,
        element_size: u32,
        count: usize,
    ) -> Result<GraphNode> {
        if ![1, 2, 4].contains(&element_size) {
            return Err(Error::InvalidArgument(format!("memset element size {element_size}: expected 1, 2 or 4")));
        }
        let p = cudrv_sys::CUDA_MEMSET_NODE_PARAMS {
            dst,
            pitch: 0,
            value,
            elementSize: element_size,
            width: count,
            height: 1,
        };
        let _b = self.ctx.bind()?;
        let deps = self.deps(deps)?;
        let (d, n) = (if deps.is_empty() { std::ptr::null() } else { deps.as_ptr() }, deps.len());
        let mut node = std::ptr::null_mut();
        // SAFETY: a valid graph and nodes; complete parameters; the caller vouches for the memory.
        unsafe { drv!(cuGraphAddMemsetNode(&mut node, self.raw, d, n, &p, self.ctx.as_raw())) }?;
        Ok(GraphNode { raw: node, graph: self.id })
    }

    /// Adds a host node: `f` runs on a driver thread at that point of every launch. The graph
    /// keeps `f` alive; inside it, the rules of [`Stream::launch_host_fn`] apply.
    ///
    /// # Errors
    /// The driver's error.
    pub fn add_host_node(&mut self, deps: &[GraphNode], f: impl Fn() + Send + Sync + 'static) -> Result<GraphNode> {
        unsafe extern "C" fn trampoline(data: *mut c_void) {
            // SAFETY: `data` points at the boxed closure the graph keeps alive while any launch
            // of it may run (the graph and its executable graphs hold the Arc).
            let f = unsafe { &*data.cast::<HostFn>() };
            let _scope = host_fn::HostFnScope::enter();
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                warn_line!("cudrv: a graph host node panicked");
                // Not dropped here: a payload whose drop panics would unwind into the driver.
                host_fn::drop_panic_payload(payload);
            }
        }
        let boxed: Arc<HostFn> = Arc::new(Box::new(f));
        let p =
            cudrv_sys::CUDA_HOST_NODE_PARAMS { fn_: Some(trampoline), userData: Arc::as_ptr(&boxed).cast_mut().cast() };
        let _b = self.ctx.bind()?;
        let deps = self.deps(deps)?;
        let (d, n) = (if deps.is_empty() { std::ptr::null() } else { deps.as_ptr() }, deps.len());
        let mut node = std::ptr::null_mut();
        // SAFETY: a valid graph and nodes; the trampoline has the CUhostFn signature; its data
        // stays valid while the graph or an executable graph of it lives (`keep`).
        unsafe { drv!(cuGraphAddHostNode(&mut node, self.raw, d, n, &p)) }?;
        self.res.keep(boxed);
        Ok(GraphNode { raw: node, graph: self.id })
    }

    /// Adds a node that records `event` (of this graph's device).
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`]; the driver's error.
    pub fn add_event_record_node(&mut self, deps: &[GraphNode], event: &Arc<Event>) -> Result<GraphNode> {
        self.add_event_node(deps, event, true)
    }

    /// Adds a node that waits for `event` (of this graph's device) on the GPU.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`]; the driver's error.
    pub fn add_event_wait_node(&mut self, deps: &[GraphNode], event: &Arc<Event>) -> Result<GraphNode> {
        self.add_event_node(deps, event, false)
    }

    fn add_event_node(&mut self, deps: &[GraphNode], event: &Arc<Event>, record: bool) -> Result<GraphNode> {
        if event.device() != self.device() {
            return Err(Error::DeviceMismatch {
                what: "Graph event node",
                expected: self.device().ordinal_i32(),
                found: event.device().ordinal_i32(),
            });
        }
        let _b = self.ctx.bind()?;
        let deps = self.deps(deps)?;
        let (d, n) = (if deps.is_empty() { std::ptr::null() } else { deps.as_ptr() }, deps.len());
        let mut node = std::ptr::null_mut();
        // SAFETY: a valid graph, nodes and event; the graph keeps the event alive (`keep`).
        unsafe {
            if record {
                drv!(cuGraphAddEventRecordNode(&mut node, self.raw, d, n, event.as_raw()))
            } else {
                drv!(cuGraphAddEventWaitNode(&mut node, self.raw, d, n, event.as_raw()))
            }
        }?;
        self.res.keep(event.clone());
        Ok(GraphNode { raw: node, graph: self.id })
    }

    /// Adds `child` as a node (the driver copies it; `child` stays usable). What `child` keeps
    /// alive for its launches is kept for this graph's too.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a child graph that owns memory of cudrv's pool (a copy would
    /// share it); the driver's error.
    pub fn add_child_graph_node(&mut self, deps: &[GraphNode], child: &Graph) -> Result<GraphNode> {
        if child.res.has_pool_memory() {
            return Err(self.device().unsupported(
                "a child graph that owns pool memory",
                "the child owns memory reserved by StreamOrderedPool during its capture; a copy would share it",
                Some("capture the work into this graph directly"),
            ));
        }
        let _b = self.ctx.bind()?;
        let deps = self.deps(deps)?;
        let (d, n) = (if deps.is_empty() { std::ptr::null() } else { deps.as_ptr() }, deps.len());
        let mut node = std::ptr::null_mut();
        // SAFETY: valid graphs and nodes; the driver clones the child.
        unsafe { drv!(cuGraphAddChildGraphNode(&mut node, self.raw, d, n, child.raw)) }?;
        // The child's resources are released after both graphs' launches: the child's own after
        // its launches, and this reference after this graph's.
        self.res.keep(child.res.clone());
        // The child's work runs in this graph's launches: their first waits for what the child's
        // first launch waits for (where its capture's streams, and the buffers it used, stood
        // before it). Complete now: after its capture, a prelude grows only for a graph that owns
        // pool memory, refused above.
        let prelude = child.res.lock().prelude.clone();
        self.res.lock().prelude.extend(prelude);
        Ok(GraphNode { raw: node, graph: self.id })
    }

    /// Instantiates the graph with no flags.
    ///
    /// # Errors
    /// As [`Graph::instantiate_with`].
    pub fn instantiate(&self) -> Result<GraphExec> {
        self.instantiate_with(InstantiateFlags::default())
    }

    /// Instantiates the graph into an executable graph (`cuGraphInstantiateWithFlags`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a second executable graph of a graph that owns pool memory
    /// while the first lives; the driver's error.
    pub fn instantiate_with(&self, flags: InstantiateFlags) -> Result<GraphExec> {
        let pool_memory = self.res.has_pool_memory();
        if pool_memory && self.res.exec_alive.swap(true, Ordering::AcqRel) {
            return Err(self.device().unsupported(
                "a second executable graph of a graph that owns pool memory",
                "its memory was reserved once, during the capture; two executable graphs could run on it at once",
                Some("drop the first GraphExec, or capture the work again"),
            ));
        }
        let mut raw = std::ptr::null_mut();
        let made = self.ctx.bind().and_then(|_b| {
            let d = driver()?;
            // SAFETY: a valid graph of the current context; a valid out-pointer and flags.
            match unsafe { d.cuGraphInstantiateWithFlags(&mut raw, self.raw, flags.bits()) } {
                Err(_) if flags == InstantiateFlags::default() => {
                    // SAFETY: as above; the error node and log are optional (null, 0).
                    let rc = unsafe {
                        d.cuGraphInstantiate_v2(&mut raw, self.raw, std::ptr::null_mut(), std::ptr::null_mut(), 0)
                    };
                    check("cuGraphInstantiate_v2", rc)
                }
                Err(_) => Err(self.device().unsupported(
                    "instantiation flags",
                    "the driver predates cuGraphInstantiateWithFlags (CUDA 11.4)",
                    Some("instantiate with the default flags, or update the driver"),
                )),
                rc => check("cuGraphInstantiateWithFlags", rc),
            }
        });
        if let Err(e) = made {
            if pool_memory {
                self.res.exec_alive.store(false, Ordering::Release);
            }
            return Err(e);
        }
        Ok(GraphExec {
            raw,
            ctx: self.ctx.clone(),
            fenced: AtomicBool::new(self.res.fenced.load(Ordering::Acquire)),
            res: Mutex::new(vec![self.res.clone()]),
            pool_memory,
            last_launch: Mutex::new(None),
            started: AtomicBool::new(false),
            own: Mutex::new(None),
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let (raw, ctx) = (SendHandle(self.raw), self.ctx.clone());
        let destroy = move || {
            let Ok(d) = driver() else { return };
            // SAFETY: the graph was made by cudrv and is destroyed once; executable graphs made
            // from it do not depend on it.
            if let Err(e) = check("cuGraphDestroy", unsafe { d.cuGraphDestroy(raw.get()) }) {
                report_drop_error(Some(&ctx), e);
            }
        };
        host_fn::now_or_deferred(destroy)
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").field("raw", &self.raw).field("owns_pool_memory", &self.res.has_pool_memory()).finish()
    }
}

/// The parameters of a kernel node launching `function` with `cfg` and `params`.
fn kernel_node_params(
    function: &Function,
    cfg: &LaunchConfig,
    params: &mut [*mut c_void],
) -> cudrv_sys::CUDA_KERNEL_NODE_PARAMS {
    cudrv_sys::CUDA_KERNEL_NODE_PARAMS {
        func: function.as_raw(),
        gridDimX: cfg.grid.0,
        gridDimY: cfg.grid.1,
        gridDimZ: cfg.grid.2,
        blockDimX: cfg.block.0,
        blockDimY: cfg.block.1,
        blockDimZ: cfg.block.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        kernelParams: params.as_mut_ptr(),
        ..Default::default()
    }
}

/// Flags of [`Graph::instantiate_with`] (`CUgraphInstantiate_flags`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InstantiateFlags {
    /// Memory allocated by the graph's memory nodes and not freed in it is freed when the graph
    /// is launched again (`CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`).
    pub auto_free_on_launch: bool,
    /// Launches use the priority of each kernel node (`..._USE_NODE_PRIORITY`) instead of the
    /// stream's.
    pub use_node_priority: bool,
}

impl InstantiateFlags {
    fn bits(self) -> u64 {
        use cudrv_sys::CUgraphInstantiate_flags as F;
        let mut bits = 0u64;
        if self.auto_free_on_launch {
            bits |= u64::from(F::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0);
        }
        if self.use_node_priority {
            bits |= u64::from(F::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0);
        }
        bits
    }
}

/// An executable graph (`CUgraphExec`): launched on a stream with one call. Launches of one
/// executable graph run in order (the driver orders each after the previous one, on any stream).
/// See the [module documentation](self) for an example.
pub struct GraphExec {
    raw: CUgraphExec,
    ctx: Arc<Context>,
    /// What its launches use that Rust owns: the graph's resources, and those of graphs it was
    /// updated from.
    res: Mutex<Vec<Arc<GraphResources>>>,
    /// Whether `res` keeps anything, so that launches must be tracked.
    fenced: AtomicBool,
    /// Whether the graph holds memory of cudrv's pool (one executable graph at a time).
    pool_memory: bool,
    /// The stream of the last launch, when `fenced`, held parked (see [`ParkedStream`]): a live
    /// executable graph does not keep a capture on it from being abandoned.
    last_launch: Mutex<Option<ParkedStream>>,
    /// Whether the first launch happened (it waits for the capture's prelude events).
    started: AtomicBool,
    /// What [`GraphExec::set_kernel_node_params`] gave the launches to run: the modules of the
    /// functions it set, released as `res` is. Made at its first call.
    own: Mutex<Option<Arc<GraphResources>>>,
}

// SAFETY: a CUgraphExec may be launched and updated from any thread, one at a time: the driver
// does not synchronise calls on one executable graph (`cuGraphLaunch` is documented not
// thread-safe), so `GraphExec` is `Send` but not `Sync` (share it behind a `Mutex`). What it keeps
// is `Send + Sync`.
unsafe impl Send for GraphExec {}

/// Why [`GraphExec::update`] refused a graph (`CUgraphExecUpdateResult`), and the node.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UpdateError {
    /// The driver's verdict, in words.
    pub reason: &'static str,
    /// The driver's result code (`CUgraphExecUpdateResult`).
    pub result: u32,
    /// The node that could not be updated, if the driver named one.
    pub node: Option<GraphNode>,
}

impl fmt::Display for UpdateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the executable graph cannot be updated: {}", self.reason)
    }
}

fn update_reason(r: cudrv_sys::CUgraphExecUpdateResult) -> &'static str {
    use cudrv_sys::CUgraphExecUpdateResult as R;
    match r {
        R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED => {
            "the graph's topology changed (nodes or edges added or removed)"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED => "a node's type changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED => "a kernel node's function changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE => {
            "a kernel node's function changed in a way the driver cannot update"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED => {
            "a node's parameters changed in a way that cannot be updated (for example a memset's size)"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED => "something about the node is not supported by update",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED => "a node's attributes changed",
        _ => "the driver refused the update",
    }
}

impl GraphExec {
    /// The raw `CUgraphExec`.
    pub fn as_raw(&self) -> CUgraphExec {
        self.raw
    }

    /// Launches the graph on `stream` (`cuGraphLaunch`): it runs after the work queued there
    /// before, and work queued after waits for it. Launches of one executable graph run one after
    /// another, whatever their streams.
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] for a stream of another device, [`Error::Capturing`] on a
    /// capturing stream; the driver's error.
    #[inline]
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        self.check_stream("GraphExec::launch", stream)?;
        let _gate = stream.refuse_in_capture("GraphExec::launch")?;
        if !self.started.load(Ordering::Acquire) {
            self.first_launch(stream)?;
        }
        let _b = self.ctx.bind()?;
        // SAFETY: a valid executable graph and stream of the current context. What the graph's
        // nodes refer to is valid for this launch: kept by the graph's resources until its launches
        // complete, or vouched for by the `unsafe` calls that added it; the first launch waited for
        // the allocations of the buffers the capture used.
        unsafe { drv!(cuGraphLaunch(self.raw, stream.as_raw())) }?;
        // Noted only once queued: the release waits for the stream of the last launch that is.
        if self.fenced.load(Ordering::Acquire) {
            let mut last = self.last_launch.lock().unwrap_or_else(PoisonError::into_inner);
            if last.as_ref().is_none_or(|s| s.key() != stream.key()) {
                *last = Some(ParkedStream::from(stream));
            }
        }
        Ok(())
    }

    /// Before the first launch: makes `stream` wait for where the capture's streams, and the
    /// buffers it used, stood before the capture (their allocations). Later launches are ordered
    /// after the first by the driver.
    #[cold]
    fn first_launch(&self, stream: &Stream) -> Result<()> {
        let res = self.res.lock().unwrap_or_else(PoisonError::into_inner);
        if self.started.load(Ordering::Acquire) {
            return Ok(());
        }
        for r in res.iter() {
            let prelude = r.lock().prelude.clone();
            for event in prelude {
                stream.wait_event_untracked(&event)?;
            }
        }
        self.started.store(true, Ordering::Release);
        Ok(())
    }

    /// Uploads the graph to the device ahead of its first launch, in `stream`'s order.
    ///
    /// # Errors
    /// As [`GraphExec::launch`]: [`Error::Capturing`] on a stream that takes part in a capture
    /// cudrv started (an upload is not part of a graph; asked during a capture, the driver could
    /// invalidate it).
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        self.check_stream("GraphExec::upload", stream)?;
        // Held to the upload's queueing, so that no capture begins on the stream in between.
        let _gate = stream.refuse_in_capture("GraphExec::upload")?;
        let _b = self.ctx.bind()?;
        // SAFETY: a valid executable graph and stream of the current context.
        unsafe { drv!(cuGraphUpload(self.raw, stream.as_raw())) }
    }

    /// Updates the executable graph in place from `graph`, a graph of the same shape whose nodes'
    /// parameters changed (`cuGraphExecUpdate`).
    ///
    /// # Errors
    /// `Ok(Err(UpdateError))` when the driver refuses the update (the executable graph is
    /// unchanged and may be launched as before), with its reason and the node; `Err` for a driver
    /// error or a graph that owns pool memory (updating could point the graph at other memory).
    pub fn update(&self, graph: &Graph) -> Result<std::result::Result<(), UpdateError>> {
        if graph.res.has_pool_memory() || self.pool_memory {
            return Err(graph.device().unsupported(
                "updating from a graph that owns pool memory",
                "its memory belongs to the executable graph it was instantiated into",
                Some("instantiate it"),
            ));
        }
        let _b = self.ctx.bind()?;
        let mut info = cudrv_sys::CUgraphExecUpdateResultInfo::default();
        // The new parameters may use what `graph` keeps: keep it too, from before the update
        // (a launch may follow at once).
        {
            let mut res = self.res.lock().unwrap_or_else(PoisonError::into_inner);
            if !res.iter().any(|r| Arc::ptr_eq(r, &graph.res)) {
                res.push(graph.res.clone());
                // The prelude of `graph` is complete: it was recorded before its capture, which
                // ended before this call, and this executable graph's next launch runs after it
                // only if waited for.
                self.started.store(false, Ordering::Release);
            }
            if graph.res.fenced.load(Ordering::Acquire) {
                self.fenced.store(true, Ordering::Release);
            }
        }
        let d = driver()?;
        // SAFETY: a valid executable graph and graph; a valid out-pointer.
        let rc = match unsafe { d.cuGraphExecUpdate_v2(self.raw, graph.raw, &mut info) } {
            // SAFETY: as above, with the older ABI's out-pointers (CUDA 11.x).
            Err(_) => unsafe { d.cuGraphExecUpdate(self.raw, graph.raw, &mut info.errorNode, &mut info.result) },
            rc => rc,
        };
        match rc {
            Ok(CUresult::CUDA_SUCCESS) => Ok(Ok(())),
            Ok(CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE) => Ok(Err(UpdateError {
                reason: update_reason(info.result),
                result: info.result.0,
                node: (!info.errorNode.is_null()).then_some(GraphNode { raw: info.errorNode, graph: graph.id }),
            })),
            other => check("cuGraphExecUpdate", other).map(Ok),
        }
    }

    /// Changes the function and arguments of kernel node `node` (of the graph this was
    /// instantiated from) for later launches (`cuGraphExecKernelNodeSetParams`). The executable
    /// graph keeps `function`'s module loaded until its last launch has completed, as
    /// [`Graph::add_kernel_node`] makes the graph keep it.
    ///
    /// # Safety
    /// As [`Graph::add_kernel_node`] for the new arguments.
    ///
    /// # Errors
    /// [`Error::InvalidLaunch`] for a configuration beyond the limits, [`Error::DeviceMismatch`]
    /// for a function of another context; the driver's error.
    pub unsafe fn set_kernel_node_params(
        &self,
        node: GraphNode,
        function: &Function,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        function.validate(&cfg)?;
        // The driver lets the node change its function within the context only.
        if !Arc::ptr_eq(function.context(), &self.ctx) {
            return Err(Error::DeviceMismatch {
                what: "GraphExec::set_kernel_node_params (the function must belong to the executable graph's context)",
                expected: self.ctx.device().ordinal_i32(),
                found: function.device().ordinal_i32(),
            });
        }
        // The node runs `function` at each later launch: its module stays loaded until they have
        // completed, and they are tracked for that. Kept from before the change (a launch may
        // follow at once); kept once however often it is set (a loop that changes the arguments
        // at each launch keeps one reference).
        {
            let mut own = self.own.lock().unwrap_or_else(PoisonError::into_inner);
            own.get_or_insert_with(GraphResources::new).keep_once(function.module.clone());
            self.fenced.store(true, Ordering::Release);
        }
        let p = kernel_node_params(function, &cfg, params);
        let _b = self.ctx.bind()?;
        // SAFETY: a valid executable graph and kernel node; complete parameters valid during the
        // call; the caller vouches for what they refer to.
        unsafe {
            drv_compat!(cuGraphExecKernelNodeSetParams_v2 | cuGraphExecKernelNodeSetParams(self.raw, node.raw, &p))
        }
    }

    fn check_stream(&self, what: &'static str, stream: &Stream) -> Result<()> {
        if stream.device() == self.ctx.device() {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                what,
                expected: self.ctx.device().ordinal_i32(),
                found: stream.device().ordinal_i32(),
            })
        }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let (raw, ctx) = (SendHandle(self.raw), self.ctx.clone());
        let res = std::mem::take(self.res.get_mut().unwrap_or_else(PoisonError::into_inner));
        let last = self.last_launch.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        let own = self.own.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        let pool_memory = self.pool_memory;
        let destroy = move || {
            if let Ok(d) = driver() {
                // SAFETY: made by cudrv, destroyed once. Launches already queued still run (the
                // driver frees the executable graph when they are done).
                if let Err(e) = check("cuGraphExecDestroy", unsafe { d.cuGraphExecDestroy(raw.get()) }) {
                    report_drop_error(Some(&ctx), e);
                }
            }
            // Its own resources are released after its last launch (they are nobody else's).
            if let (Some(own), Some(stream)) = (&own, &last) {
                own.lock().fences.push(stream.clone());
            }
            drop(own);
            for r in res {
                if let Some(stream) = &last {
                    // What the launches use is released after the last one completed.
                    r.lock().fences.push(stream.clone());
                }
                if pool_memory {
                    // The next executable graph runs on the same reserved memory: its first launch
                    // waits for this one's last (or, where that cannot be recorded now, it may be
                    // made once the host has seen that launch complete).
                    match last.as_ref() {
                        None => r.exec_alive.store(false, Ordering::Release),
                        Some(stream) => {
                            // A record on a capturing stream would be captured.
                            let done = crate::session::fence_parked(stream).and_then(Result::ok).map(Arc::new);
                            match done {
                                Some(done) => {
                                    let mut k = r.lock();
                                    // What has completed needs no wait: without this, a graph
                                    // instantiated again and again would keep an event for each
                                    // executable it had.
                                    k.prelude.retain(|e| !matches!(e.query(), Ok(true)));
                                    k.prelude.push(done);
                                    drop(k);
                                    r.exec_alive.store(false, Ordering::Release);
                                }
                                None => {
                                    let r = r.clone();
                                    crate::session::after_parked_stream_work(stream.clone(), move || {
                                        r.exec_alive.store(false, Ordering::Release)
                                    });
                                }
                            }
                        }
                    }
                }
            }
        };
        host_fn::now_or_deferred(destroy)
    }
}

impl fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphExec").field("raw", &self.raw).finish()
    }
}

/// How much memory the driver's graph memory nodes use on a device
/// ([`Device::graph_memory`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphMemoryInfo {
    /// Bytes in use by graph allocations now.
    pub used: u64,
    /// Highest `used`.
    pub used_high: u64,
    /// Bytes the driver holds for graph allocations.
    pub reserved: u64,
    /// Highest `reserved`.
    pub reserved_high: u64,
}

impl Device {
    /// What the driver's graph memory nodes use on this device (`cuDeviceGetGraphMemAttribute`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] without memory pools (TCC, or a driver older than CUDA 11.4): graph
    /// memory nodes come from them. The driver's error.
    pub fn graph_memory(&self) -> Result<GraphMemoryInfo> {
        use cudrv_sys::CUgraphMem_attribute as A;
        self.require_graph_memory()?;
        let ctx = self.primary_context()?;
        let _b = ctx.bind()?;
        let get = |attr: A| -> Result<u64> {
            let mut v: u64 = 0;
            // SAFETY: the attribute is a cuuint64_t, written through the pointer.
            unsafe { drv!(cuDeviceGetGraphMemAttribute(self.as_raw(), attr, (&raw mut v).cast())) }?;
            Ok(v)
        };
        Ok(GraphMemoryInfo {
            used: get(A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
            used_high: get(A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
            reserved: get(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: get(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
        })
    }

    /// Gives back to the OS the memory the driver holds for graph allocations of graphs that are
    /// not running (`cuDeviceGraphMemTrim`).
    ///
    /// # Errors
    /// As [`Device::graph_memory`].
    pub fn trim_graph_memory(&self) -> Result<()> {
        self.require_graph_memory()?;
        let ctx = self.primary_context()?;
        let _b = ctx.bind()?;
        // SAFETY: a valid device.
        unsafe { drv!(cuDeviceGraphMemTrim(self.as_raw())) }
    }

    /// Graph memory nodes need memory pools, and the driver's graph memory entry points (11.4).
    fn require_graph_memory(&self) -> Result<()> {
        let caps = self.capabilities()?;
        let reason = if !caps.memory_pools {
            crate::memory::pools_missing_reason(caps)
        } else if !driver()?.has("cuDeviceGraphMemTrim") {
            format!(
                "the driver ({}) predates graph memory nodes (CUDA 11.4)",
                crate::version_string(caps.driver_version)
            )
        } else {
            return Ok(());
        };
        Err(self.unsupported(
            "graph memory",
            reason,
            Some("allocate in captures from StreamOrderedPool, whose memory the graph owns and reports"),
        ))
    }
}

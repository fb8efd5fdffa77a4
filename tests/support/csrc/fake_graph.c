/*
 * fake_graph.c -- CUDA graphs and stream capture for the emulated driver (fake_cuda.c).
 *
 * Not compiled on its own: fake_cuda.c #includes it (one translation unit) after its stream and op
 * machinery, and calls the hooks marked "fake_graph.c" there. The summary is in fake_cuda.c's
 * header ("Graphs and stream capture"); this comment has the details. Everything here runs under
 * G.lock (the exported functions take it). Portable C11, like fake_cuda.c. ABI types whose names
 * other parts of the fake might also define one day get private names here (fkg_*): only their
 * layout matters, and it is copied from the CUDA 13.0 cuda.h.
 *
 * GRAPHS
 *  - A graph is a list of nodes in creation order, each with its dependencies (nodes of the same
 *    graph that existed when it was added), so creation order is a topological order. Node kinds:
 *    kernel (the arguments are copied at add time, by the built-in kernel's parameter layout, as
 *    cuLaunchKernel copies them), memset (elementSize 1/2/4, 2D rows with a pitch), memcpy (1D:
 *    Height == Depth == 1, no Y/Z offsets, host<->device or device<->device; arrays, 2D/3D and
 *    host-to-host copies are CUDA_ERROR_NOT_SUPPORTED), host function, event record, event wait,
 *    child graph (the graph keeps its own copy), empty, memory allocation and memory free.
 *  - Handles: an unknown graph, executable graph, event or function handle is
 *    CUDA_ERROR_INVALID_HANDLE; a dependency that is not a node of the graph, or a duplicate, is
 *    CUDA_ERROR_INVALID_VALUE.
 *  - cuGraphInstantiate* copies the graph into the executable graph (later changes to the graph
 *    do not affect it). Flags: AUTO_FREE_ON_LAUNCH (1) and USE_NODE_PRIORITY (8) are accepted,
 *    UPLOAD (2) is ignored, DEVICE_LAUNCH (4) is CUDA_ERROR_NOT_SUPPORTED, other bits
 *    CUDA_ERROR_INVALID_VALUE. A graph with memory nodes has at most one executable graph at a time
 *    (a second is CUDA_ERROR_INVALID_VALUE), cannot be cloned nor be a child graph
 *    (CUDA_ERROR_INVALID_VALUE), as cuda.h documents.
 *  - cuGraphLaunch queues the executable graph's nodes on the stream's worker in creation order
 *    (a sequential schedule satisfies every dependency): kernel, memset and memcpy nodes become
 *    the same ops as their stream APIs (checked for access violations when they run), host nodes
 *    OP_HOSTFN calling fn(userData) at every launch (userData is never freed), event record nodes
 *    an OP_RECORD exactly as cuEventRecord, event wait nodes an OP_WAIT on the event's latest
 *    record at launch time, child graphs their nodes, empty and memory nodes nothing. Launches of
 *    one executable graph are ordered, as in the real driver: a launch on another stream first
 *    waits for the previous launch. Legacy-stream implicit synchronisation applies to a launch as
 *    to any op. cuGraphUpload only validates.
 *  - cuGraphExecUpdate(_v2): the graph's nodes are paired with the executable graph's in creation
 *    order. A different node count, or different dependencies (as creation indices):
 *    CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE (910) with TOPOLOGY_CHANGED (errorNode, errorFromNode:
 *    the node and the unmatched dependency); a different node type: NODE_TYPE_CHANGED; a memset
 *    whose element size, width, height or pitch changed, or a memcpy whose direction changed:
 *    PARAMETERS_CHANGED; a memory node of another allocation: NOT_SUPPORTED; child graphs are
 *    compared recursively (errorNode: the child graph node). Kernel functions may change (as since
 *    CUDA 11.2), so FUNCTION_CHANGED is never reported. On failure nothing changes; on success
 *    every node's parameters are copied, and the graph's nodes also name the executable graph's
 *    nodes for cuGraphExecKernelNodeSetParams (besides the nodes it was instantiated from).
 *  - Graph memory (cuGraphAddMemAllocNode, cuMemAllocAsync/cuMemAllocFromPoolAsync while
 *    capturing; CUDA_ERROR_NOT_SUPPORTED on tcc devices, like every pool entry point): the address
 *    is reserved when the node is made and stays reserved, at the same address, for as long as a
 *    graph or executable graph holding the node lives and until the last launch of those has run
 *    (the real driver also gives the same address at every launch). It is an ordinary live
 *    allocation for the access checker and in the leak report meanwhile. Alloc and free nodes do
 *    nothing at launch. Freeing a graph allocation outside graphs (cuMemFree, cuMemFreeAsync) is a
 *    no-op success when no graph frees it, CUDA_ERROR_INVALID_VALUE when its own graph does (as
 *    documented). AUTO_FREE_ON_LAUNCH needs nothing more: relaunching is always allowed. A free
 *    node (cuGraphAddMemFreeNode, or cuMemFreeAsync while capturing) needs a graph allocation not
 *    freed in its own graph yet. Attributes (cuDeviceGetGraphMemAttribute): USED_MEM_CURRENT is
 *    the bytes of live graph allocations, RESERVED_MEM_CURRENT the most of it since the last
 *    cuDeviceGraphMemTrim (which lowers it to USED), the HIGH ones their peaks, which
 *    cuDeviceSetGraphMemAttribute resets (value 0 only) to the current value.
 *
 * STREAM CAPTURE
 *  - cuStreamBeginCapture(_v2) on the legacy stream: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900);
 *    on a stream taking part in a capture: CUDA_ERROR_ILLEGAL_STATE (401). Per-thread streams can
 *    capture. Capture ids count from 1.
 *  - Each stream of a capture has a dependency set: what the next captured op depends on (empty at
 *    the start). While a stream captures, kernel launches, async memsets and copies (1D copies from
 *    pageable host memory are read when the node runs, not staged; pitched 2D/3D copies keep the
 *    source staged at capture) and host functions become nodes that depend on the set, which
 *    becomes {that node}; cuMemAllocAsync / cuMemAllocFromPoolAsync make a memory allocation node,
 *    cuMemFreeAsync a memory free node; cuGraphLaunch a child graph node (CUDA_ERROR_NOT_SUPPORTED
 *    for a graph with memory nodes). Nothing of it runs. Any other op queued on a capturing stream
 *    (prefetches, waits on events of another process) is not capturable here: it is recorded as a
 *    violation and invalidates the capture. The generic hook is enqueue_locked, so every entry
 *    point that queues these ops is captured; the capture errors at call time (901, 906, 900) are
 *    checked by the entry points listed in fake_cuda.c's header.
 *  - Events, as in the real driver: cuEventRecord on a capturing stream makes no node; the event
 *    remembers the stream's dependency set (it is "recorded in the capture"). cuStreamWaitEvent on
 *    a stream that does not capture, with such an event, makes the stream join the capture (same
 *    id) with the event's set as its dependencies; on a stream of the same capture, it adds the
 *    event's set to the stream's (a join). With CU_EVENT_WAIT_EXTERNAL (1), a capturing stream
 *    gets an event wait node instead. Waiting, in a capturing stream, on an event recorded outside
 *    any capture (or opened from another process): CUDA_ERROR_STREAM_CAPTURE_ISOLATION (905);
 *    recorded in another capture:
 *    CUDA_ERROR_STREAM_CAPTURE_MERGE (902); never recorded: nothing. cuEventQuery and
 *    cuEventSynchronize of an event recorded in a capture: CUDA_ERROR_CAPTURED_EVENT (907) (the
 *    real driver's code). After the capture ends, such an event is as it was before the capture.
 *  - cuStreamEndCapture: not capturing: CUDA_ERROR_ILLEGAL_STATE; a stream that joined but did not
 *    begin the capture: CUDA_ERROR_STREAM_CAPTURE_UNMATCHED (903); a GLOBAL or THREAD_LOCAL capture
 *    ended on another thread: CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD (908), and the capture goes
 *    on (the right thread may still end it). Otherwise the capture ends for every stream of it,
 *    and: invalidated: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901); a captured node that the
 *    origin stream's final dependency set does not reach (work of a joined stream not joined
 *    back): CUDA_ERROR_STREAM_CAPTURE_UNJOINED (904); the graph is then destroyed and *phGraph is
 *    NULL. Nodes added to the capture's graph directly (its handle from cuStreamGetCaptureInfo)
 *    are not checked.
 *  - Invalidation (the capture stays active until it is ended on its origin stream; further work
 *    queued on its streams returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and is dropped):
 *      cuStreamSynchronize / cuStreamQuery of a capturing stream: 900;
 *      an unsafe call (below) that the thread's mode prohibits: 900 (every capture that prohibits
 *        it is invalidated);
 *      cuCtxSynchronize while a stream of that context captures (any mode): 900;
 *      any work on the legacy stream (synchronous APIs included) while a blocking stream of its
 *        context captures: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (906) (the legacy stream would depend
 *        on it); cuStreamIsCapturing / cuStreamGetCaptureInfo of the legacy stream then return 906
 *        without invalidating, as documented;
 *      waits that would merge captures or cross the capture boundary (above); a captured event
 *        queried (907); cuStreamEndCapture on a stream that is not the origin (903); an op the
 *        fake cannot capture (also recorded as a violation).
 *  - Capture modes, as cuThreadExchangeStreamCaptureMode documents. A thread (mode GLOBAL by
 *    default) is prohibited from unsafe calls if it began a non-RELAXED capture that is not ended,
 *    or, in GLOBAL mode, if any other thread began a GLOBAL one; RELAXED threads never are. The
 *    unsafe calls emulated: the synchronous copies and memsets (cuMemcpyHtoD/DtoH/DtoD/Peer,
 *    cuMemsetD8/D16/D32), cuCtxSynchronize, cuEventQuery and cuEventSynchronize (of any event).
 *    Not treated as unsafe: cuMemAlloc, cuMemFree (both allowed during capture, as cudrv's pool
 *    needs), cuStreamSynchronize / cuStreamQuery of streams that do not capture.
 *  - cuStreamGetCaptureInfo(_v2/_v3): status required; id 0, graph NULL and no dependencies when
 *    not capturing; for an invalidated capture the id, no graph. The dependency array (and the
 *    all-zero edge data of _v3) belong to the driver, valid until the stream's next capture call.
 *  - Not emulated: cuStreamBeginCaptureToGraph, cuStreamUpdateCaptureDependencies, event record
 *    nodes from capture (cuEventRecordWithFlags), destroying a stream while it captures (its capture
 *    can then never end).
 *
 * NOT EXPORTED (cuGetProcAddress does not find them): the rest of the graph API (cuGraphAddNode,
 * edges and dependency queries, node parameter getters, conditional nodes, user objects, batch mem
 * op and external semaphore nodes, cuGraphExec*NodeSetParams other than for kernels, debug print,
 * node enable/disable, ...).
 */

#if FK_EXPORT_LIMIT >= 11010
#define FKG_API_11010 FK_API
#else
#define FKG_API_11010 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 12030
#define FKG_API_12030 FK_API
#else
#define FKG_API_12030 FK_HIDDEN
#endif

/* ---- ABI (cuda.h, CUDA 13.0) ---- */
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901
#define CUDA_ERROR_STREAM_CAPTURE_MERGE 902
#define CUDA_ERROR_STREAM_CAPTURE_UNMATCHED 903
#define CUDA_ERROR_STREAM_CAPTURE_UNJOINED 904
#define CUDA_ERROR_STREAM_CAPTURE_ISOLATION 905
#define CUDA_ERROR_STREAM_CAPTURE_IMPLICIT 906
#define CUDA_ERROR_CAPTURED_EVENT 907
#define CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD 908
#define CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE 910

/* Entries of fake_cuda.c's ERRORS table (cuGetErrorName / cuGetErrorString). */
#define FK_GRAPH_ERRORS                                                                                       \
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},              \
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},       \
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"}, \
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would result in a merge of separate capture sequences"}, \
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream as it began"},     \
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capturing stream has unjoined work"},                        \
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "dependency created on uncaptured work in another stream"},  \
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",                                                               \
     "operation would make the legacy stream depend on a capturing blocking stream"},                         \
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"}, \
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",                                                           \
     "attempt to terminate a thread-local capture sequence from another thread"},                             \
    {910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",                                                             \
     "the graph update was not performed because it included changes which violated constraints specific "  \
     "to instantiated graph update"},

enum { FKG_CAPTURE_MODE_GLOBAL = 0, FKG_CAPTURE_MODE_THREAD_LOCAL = 1, FKG_CAPTURE_MODE_RELAXED = 2 };
enum { FKG_CAPTURE_STATUS_NONE = 0, FKG_CAPTURE_STATUS_ACTIVE = 1, FKG_CAPTURE_STATUS_INVALIDATED = 2 };
enum {
    FKG_NODE_KERNEL = 0,
    FKG_NODE_MEMCPY = 1,
    FKG_NODE_MEMSET = 2,
    FKG_NODE_HOST = 3,
    FKG_NODE_GRAPH = 4,
    FKG_NODE_EMPTY = 5,
    FKG_NODE_WAIT_EVENT = 6,
    FKG_NODE_EVENT_RECORD = 7,
    FKG_NODE_MEM_ALLOC = 10,
    FKG_NODE_MEM_FREE = 11
};
enum {
    FKG_UPDATE_SUCCESS = 0,
    FKG_UPDATE_ERROR_TOPOLOGY_CHANGED = 2,
    FKG_UPDATE_ERROR_NODE_TYPE_CHANGED = 3,
    FKG_UPDATE_ERROR_PARAMETERS_CHANGED = 5,
    FKG_UPDATE_ERROR_NOT_SUPPORTED = 6
};
enum { FKG_MEMORYTYPE_HOST = 1, FKG_MEMORYTYPE_DEVICE = 2, FKG_MEMORYTYPE_ARRAY = 3, FKG_MEMORYTYPE_UNIFIED = 4 };
#define FKG_INSTANTIATE_AUTO_FREE_ON_LAUNCH 1ULL
#define FKG_INSTANTIATE_UPLOAD 2ULL
#define FKG_INSTANTIATE_DEVICE_LAUNCH 4ULL
#define FKG_INSTANTIATE_USE_NODE_PRIORITY 8ULL
#define FKG_EVENT_WAIT_EXTERNAL 0x1u
enum { FKG_GRAPH_MEM_USED_CURRENT = 0, FKG_GRAPH_MEM_USED_HIGH, FKG_GRAPH_MEM_RESERVED_CURRENT, FKG_GRAPH_MEM_RESERVED_HIGH };

typedef struct fk_graph *CUgraph;
typedef struct fk_gnode *CUgraphNode;
typedef struct fk_gexec *CUgraphExec;

/* CUDA_KERNEL_NODE_PARAMS_v1 */
typedef struct {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
} fkg_kernel_params_v1;
/* CUDA_KERNEL_NODE_PARAMS_v2 (CUDA_KERNEL_NODE_PARAMS) */
typedef struct {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
    void *kern; /* CUkernel */
    CUcontext ctx;
} fkg_kernel_params;
/* CUDA_MEMCPY3D (_v2) */
typedef struct {
    size_t srcXInBytes, srcY, srcZ, srcLOD;
    int srcMemoryType; /* CUmemorytype */
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    void *reserved0;
    size_t srcPitch, srcHeight;
    size_t dstXInBytes, dstY, dstZ, dstLOD;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    void *reserved1;
    size_t dstPitch, dstHeight;
    size_t WidthInBytes, Height, Depth;
} fkg_memcpy3d;
/* CUDA_MEMSET_NODE_PARAMS (_v1) */
typedef struct {
    CUdeviceptr dst;
    size_t pitch;
    unsigned int value;
    unsigned int elementSize;
    size_t width;
    size_t height;
} fkg_memset_params;
/* CUDA_HOST_NODE_PARAMS (_v1) */
typedef struct {
    CUhostFn fn;
    void *userData;
} fkg_host_params;
/* CUDA_MEM_ALLOC_NODE_PARAMS (_v1) */
typedef struct {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} fkg_mem_alloc_params;
/* CUgraphExecUpdateResultInfo (_v1) */
typedef struct {
    int result; /* CUgraphExecUpdateResult */
    CUgraphNode errorNode;
    CUgraphNode errorFromNode;
} fkg_update_info;
/* CUgraphEdgeData */
typedef struct {
    unsigned char from_port, to_port, type, reserved[5];
} fkg_edge;
/* CUDA_GRAPH_INSTANTIATE_PARAMS */
typedef struct {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out; /* CUgraphInstantiateResult */
} fkg_instantiate_params;

_Static_assert(sizeof(fkg_kernel_params_v1) == 56, "CUDA_KERNEL_NODE_PARAMS_v1 layout");
_Static_assert(sizeof(fkg_kernel_params) == 72, "CUDA_KERNEL_NODE_PARAMS_v2 layout");
_Static_assert(offsetof(fkg_kernel_params, kernelParams) == 40, "CUDA_KERNEL_NODE_PARAMS_v2 layout");
_Static_assert(sizeof(fkg_memcpy3d) == 200, "CUDA_MEMCPY3D layout");
_Static_assert(offsetof(fkg_memcpy3d, dstXInBytes) == 88, "CUDA_MEMCPY3D layout");
_Static_assert(sizeof(fkg_memset_params) == 40, "CUDA_MEMSET_NODE_PARAMS layout");
_Static_assert(sizeof(fkg_mem_alloc_params) == 120, "CUDA_MEM_ALLOC_NODE_PARAMS layout");
_Static_assert(sizeof(fkg_update_info) == 24, "CUgraphExecUpdateResultInfo layout");
_Static_assert(sizeof(fkg_edge) == 8, "CUgraphEdgeData layout");
_Static_assert(sizeof(fkg_instantiate_params) == 32, "CUDA_GRAPH_INSTANTIATE_PARAMS layout");

/* Defined further down in fake_cuda.c. */
static int valid_dev(CUdevice d);
static int valid_event(const fk_event *e);
static int valid_func(const fk_func *f);

/* ---- state ---- */

/* A graph allocation: reserved while a node (of a graph or an executable graph) holds it, or a
   launch that may use it is queued. */
typedef struct fk_gmem {
    fk_alloc *a; /* AK_DEVICE, in G.dtab */
    int dev;
    uint64_t bytes;
    int refs;
    int freed_in_graph;          /* a free node of its own graph frees it */
    const struct fk_graph *owner; /* the graph whose alloc node made it (compared only) */
} fk_gmem;

typedef struct fk_gnode {
    struct fk_graph *g;
    int type;
    int captured; /* made by stream capture: checked for UNJOINED */
    int mark;     /* scratch */
    size_t index; /* position in g->nodes */
    fk_vec deps;  /* fk_gnode* of g */
    /* Executable graphs' copies: the node instantiated from, and the node of the last graph it was
       updated from (compared only, never dereferenced). */
    const struct fk_gnode *from, *alias;
    fk_op op;          /* KERNEL, MEMCPY, HOST, MEMSET (one row): the op a launch queues */
    size_t rows, pitch; /* MEMSET */
    fk_func *func;     /* KERNEL, when known (NULL when captured) */
    fk_event *ev;      /* EVENT_RECORD, WAIT_EVENT: a reference */
    struct fk_graph *child; /* GRAPH: owned copy */
    fk_gmem *gm;       /* MEM_ALLOC, MEM_FREE: a reference */
} fk_gnode;

typedef struct fk_graph {
    fk_ctx *ctx;
    fk_vec nodes; /* fk_gnode*, creation order */
    int mem_nodes;
    int execs; /* live executable graphs instantiated from it */
    struct fk_capture *capture;
} fk_graph;

typedef struct fk_gexec {
    fk_ctx *ctx;
    fk_graph *g;   /* private copy */
    fk_graph *src; /* the graph instantiated, NULL once destroyed */
    unsigned long long flags;
    fk_vec gms;    /* fk_gmem* of its memory nodes */
    fk_stream *last_s; /* the last launch: stream (a reference) and the sequence number it ends at */
    uint64_t last_seq;
} fk_gexec;

/* A stream taking part in a capture. */
typedef struct {
    fk_stream *s; /* a reference */
    fk_vec deps;  /* fk_gnode*: what its next captured op depends on */
    fkg_edge *edges;
    size_t edges_cap;
} fk_cmember;

/* An event recorded in a capture: the dependency set it stands for. */
typedef struct {
    fk_event *e; /* a reference */
    fk_vec deps;
} fk_ctag;

typedef struct fk_capture {
    uint64_t id;
    int mode;
    int invalidated;
    const void *thread; /* &tl_capture_token of the thread that began it */
    fk_graph *g;
    fk_vec members; /* fk_cmember*, [0] the origin stream */
    fk_vec tags;    /* fk_ctag* */
} fk_capture;

static struct {
    fk_vec captures; /* active fk_capture* */
    fk_vec graphs;   /* graphs with a live handle (captures' graphs included) */
    fk_vec execs;    /* live fk_gexec* */
    fk_vec gmems;    /* live fk_gmem* */
    uint64_t next_capture;
    struct {
        uint64_t used, used_high, reserved, reserved_high;
    } mem[FK_MAX_DEVICES];
} GG;

/* The calling thread's capture mode (cuThreadExchangeStreamCaptureMode), GLOBAL by default. */
static _Thread_local int tl_capture_mode;
/* Its address identifies the calling thread. */
static _Thread_local char tl_capture_token;

static const char API_KERNEL_NODE[] = "cuGraphLaunch (kernel node)";
static const char API_MEMSET_NODE[] = "cuGraphLaunch (memset node)";
static const char API_MEMCPY_NODE[] = "cuGraphLaunch (memcpy node)";
static const char API_HOST_NODE[] = "cuGraphLaunch (host node)";
static const char API_RECORD_NODE[] = "cuGraphLaunch (event record node)";

/* ---- graph memory ---- */

static CUresult gmem_new_locked(int dev, uint64_t bytes, fk_gmem **out) {
    fk_block *b;
    fk_gmem *m;
    CUresult r = reserve_block_locked(dev, bytes, &b);
    if (r) return r;
    m = (fk_gmem *)calloc(1, sizeof *m);
    if (!m) abort();
    m->a = new_alloc(b->base, bytes, AK_DEVICE, dev, b);
    tab_insert(&G.dtab, m->a);
    m->dev = dev;
    m->bytes = bytes;
    m->refs = 1;
    vec_push(&GG.gmems, m);
    GG.mem[dev].used += bytes;
    if (GG.mem[dev].used > GG.mem[dev].used_high) GG.mem[dev].used_high = GG.mem[dev].used;
    if (GG.mem[dev].used > GG.mem[dev].reserved) GG.mem[dev].reserved = GG.mem[dev].used;
    if (GG.mem[dev].reserved > GG.mem[dev].reserved_high) GG.mem[dev].reserved_high = GG.mem[dev].reserved;
    *out = m;
    return CUDA_SUCCESS;
}

static void gmem_unref_locked(fk_gmem *m) {
    if (--m->refs > 0) return;
    vec_remove(&GG.gmems, m);
    GG.mem[m->dev].used -= m->bytes;
    free_alloc_locked(m->a);
    free(m);
}

static fk_gmem *gmem_find_locked(CUdeviceptr p) {
    size_t i;
    for (i = 0; i < GG.gmems.n; i++) {
        fk_gmem *m = (fk_gmem *)GG.gmems.v[i];
        if (m->a->base == p) return m;
    }
    return NULL;
}

/* Runs on a stream worker after a launch that may use graph memory: drops the launch's references. */
static void CUDA_CB gmem_launch_done(void *ud) {
    fk_vec *list = (fk_vec *)ud;
    size_t i;
    fk_lock(&G.lock);
    for (i = 0; i < list->n; i++) gmem_unref_locked((fk_gmem *)list->v[i]);
    fk_unlock(&G.lock);
    free(list->v);
    free(list);
}

/* ---- graphs and nodes ---- */

static fk_gnode *gnode_new(int type) {
    fk_gnode *n = (fk_gnode *)calloc(1, sizeof *n);
    if (!n) abort();
    n->type = type;
    n->rows = 1;
    return n;
}

static fk_graph *graph_new(fk_ctx *ctx) {
    fk_graph *g = (fk_graph *)calloc(1, sizeof *g);
    if (!g) abort();
    g->ctx = ctx;
    return g;
}

static void graph_free_locked(fk_graph *g);

static void gnode_free_locked(fk_gnode *n) {
    if (n->op.src_snapshot) free((void *)(uintptr_t)n->op.src);
    if (n->ev) event_unref_locked(n->ev);
    if (n->child) graph_free_locked(n->child);
    if (n->gm) gmem_unref_locked(n->gm);
    free(n->deps.v);
    free(n);
}

static void graph_free_locked(fk_graph *g) {
    size_t i;
    for (i = 0; i < g->nodes.n; i++) gnode_free_locked((fk_gnode *)g->nodes.v[i]);
    free(g->nodes.v);
    free(g);
}

static int valid_graph_locked(const fk_graph *g) { return g && vec_find(&GG.graphs, g) >= 0; }
static int valid_exec_locked(const fk_gexec *x) { return x && vec_find(&GG.execs, x) >= 0; }

/* The node behind a handle, if it is a node of a graph with a live handle. */
static fk_gnode *find_node_locked(const void *h) {
    size_t i;
    if (!h) return NULL;
    for (i = 0; i < GG.graphs.n; i++) {
        const fk_graph *g = (const fk_graph *)GG.graphs.v[i];
        if (vec_find(&g->nodes, h) >= 0) return (fk_gnode *)(uintptr_t)h;
    }
    return NULL;
}

static CUresult check_deps_locked(const fk_graph *g, const CUgraphNode *deps, size_t n) {
    size_t i, j;
    if (n && !deps) return CUDA_ERROR_INVALID_VALUE;
    for (i = 0; i < n; i++) {
        if (vec_find(&g->nodes, deps[i]) < 0) return CUDA_ERROR_INVALID_VALUE;
        for (j = 0; j < i; j++)
            if (deps[j] == deps[i]) return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

static void graph_append_locked(fk_graph *g, fk_gnode *n, const CUgraphNode *deps, size_t nd) {
    size_t i;
    n->g = g;
    n->index = g->nodes.n;
    for (i = 0; i < nd; i++) vec_push(&n->deps, deps[i]);
    vec_push(&g->nodes, n);
    if (n->type == FKG_NODE_MEM_ALLOC || n->type == FKG_NODE_MEM_FREE) g->mem_nodes++;
}

/* A copy of an op's staged host source, for another op. */
static void dup_snapshot(fk_op *o) {
    size_t len = o->kind == OP_REGION ? o->wbytes * o->rows * o->depth /* staged packed */
                                      : o->count * (size_t)o->elem;
    void *p = malloc(len ? len : 1);
    if (!p) abort();
    memcpy(p, (const void *)(uintptr_t)o->src, len);
    o->src = (uint64_t)(uintptr_t)p;
}

/* A deep copy. for_exec: the copy's nodes remember the nodes they were made from. */
static fk_graph *graph_clone_locked(const fk_graph *src, int for_exec) {
    fk_graph *g = graph_new(src->ctx);
    size_t i, j;
    for (i = 0; i < src->nodes.n; i++) {
        const fk_gnode *s = (const fk_gnode *)src->nodes.v[i];
        fk_gnode *n = (fk_gnode *)malloc(sizeof *n);
        if (!n) abort();
        *n = *s;
        memset(&n->deps, 0, sizeof n->deps);
        for (j = 0; j < s->deps.n; j++) vec_push(&n->deps, g->nodes.v[((const fk_gnode *)s->deps.v[j])->index]);
        n->g = g;
        n->mark = 0;
        n->from = for_exec ? s : NULL;
        n->alias = NULL;
        if (n->op.src_snapshot) dup_snapshot(&n->op);
        if (n->ev) n->ev->refs++;
        if (n->child) n->child = graph_clone_locked(s->child, for_exec);
        if (n->gm) n->gm->refs++;
        vec_push(&g->nodes, n);
    }
    g->mem_nodes = src->mem_nodes;
    return g;
}

/* ---- capture bookkeeping ---- */

static fk_cmember *capture_member_locked(const fk_stream *s, fk_capture **out) {
    size_t i, j;
    for (i = 0; i < GG.captures.n; i++) {
        fk_capture *c = (fk_capture *)GG.captures.v[i];
        for (j = 0; j < c->members.n; j++) {
            fk_cmember *m = (fk_cmember *)c->members.v[j];
            if (m->s == s) {
                if (out) *out = c;
                return m;
            }
        }
    }
    return NULL;
}

static fk_ctag *capture_tag_locked(const fk_event *e, fk_capture **out) {
    size_t i, j;
    for (i = 0; i < GG.captures.n; i++) {
        fk_capture *c = (fk_capture *)GG.captures.v[i];
        for (j = 0; j < c->tags.n; j++) {
            fk_ctag *t = (fk_ctag *)c->tags.v[j];
            if (t->e == e) {
                if (out) *out = c;
                return t;
            }
        }
    }
    return NULL;
}

/* Forgets that `e` was recorded in a capture (it is recorded anew). */
static void capture_untag_locked(const fk_event *e) {
    fk_capture *c;
    fk_ctag *t = GG.captures.n ? capture_tag_locked(e, &c) : NULL;
    if (!t) return;
    vec_remove(&c->tags, t);
    event_unref_locked(t->e);
    free(t->deps.v);
    free(t);
}

static void vec_copy(fk_vec *dst, const fk_vec *src) {
    size_t i;
    dst->n = 0;
    for (i = 0; i < src->n; i++) vec_push(dst, src->v[i]);
}

static void vec_union(fk_vec *dst, const fk_vec *src) {
    size_t i;
    for (i = 0; i < src->n; i++)
        if (vec_find(dst, src->v[i]) < 0) vec_push(dst, src->v[i]);
}

static fk_cmember *capture_add_member_locked(fk_capture *c, fk_stream *s, const fk_vec *deps) {
    fk_cmember *m = (fk_cmember *)calloc(1, sizeof *m);
    if (!m) abort();
    m->s = s;
    s->refs++;
    if (deps) vec_copy(&m->deps, deps);
    vec_push(&c->members, m);
    return m;
}

/* Adds `n` to the capture's graph after the member's dependency set, which becomes {n}. */
static void capture_add_node_locked(fk_capture *c, fk_cmember *m, fk_gnode *n) {
    n->captured = 1;
    graph_append_locked(c->g, n, (const CUgraphNode *)m->deps.v, m->deps.n);
    m->deps.n = 0;
    vec_push(&m->deps, n);
}

/* Ends the capture for all its streams; its graph is left to the caller. */
static void capture_end_locked(fk_capture *c) {
    size_t i;
    vec_remove(&GG.captures, c);
    for (i = 0; i < c->members.n; i++) {
        fk_cmember *m = (fk_cmember *)c->members.v[i];
        stream_unref_locked(m->s);
        free(m->deps.v);
        free(m->edges);
        free(m);
    }
    for (i = 0; i < c->tags.n; i++) {
        fk_ctag *t = (fk_ctag *)c->tags.v[i];
        event_unref_locked(t->e);
        free(t->deps.v);
        free(t);
    }
    free(c->members.v);
    free(c->tags.v);
    c->g->capture = NULL;
    free(c);
}

/* Whether some captured node is not reached from the origin stream's dependency set. */
static int capture_unjoined_locked(const fk_capture *c) {
    const fk_cmember *o = (const fk_cmember *)c->members.v[0];
    fk_vec stack;
    size_t i;
    int unjoined = 0;
    memset(&stack, 0, sizeof stack);
    for (i = 0; i < c->g->nodes.n; i++) ((fk_gnode *)c->g->nodes.v[i])->mark = 0;
    for (i = 0; i < o->deps.n; i++) vec_push(&stack, o->deps.v[i]);
    while (stack.n) {
        fk_gnode *n = (fk_gnode *)stack.v[--stack.n];
        if (n->mark) continue;
        n->mark = 1;
        for (i = 0; i < n->deps.n; i++) vec_push(&stack, n->deps.v[i]);
    }
    for (i = 0; i < c->g->nodes.n; i++) {
        const fk_gnode *n = (const fk_gnode *)c->g->nodes.v[i];
        if (n->captured && !n->mark) unjoined = 1;
    }
    free(stack.v);
    return unjoined;
}

/* Captures with a blocking stream of context `ctx` (which the legacy stream would depend on); with
   `invalidate`, invalidates them. */
static int blocking_captures_locked(const fk_ctx *ctx, int invalidate) {
    size_t i, j;
    int hit = 0;
    for (i = 0; i < GG.captures.n; i++) {
        fk_capture *c = (fk_capture *)GG.captures.v[i];
        for (j = 0; j < c->members.n; j++) {
            const fk_stream *s = ((const fk_cmember *)c->members.v[j])->s;
            if (s->ctx == ctx && s->kind != SK_LEGACY && !(s->flags & CU_STREAM_NON_BLOCKING)) {
                hit = 1;
                if (invalidate) c->invalidated = 1;
                break;
            }
        }
    }
    return hit;
}

/* A potentially unsafe call: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED if the calling thread's mode
   prohibits it now (the prohibiting captures are invalidated). */
static CUresult capture_unsafe_call_locked(void) {
    size_t i;
    int hit = 0;
    if (tl_capture_mode == FKG_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
    for (i = 0; i < GG.captures.n; i++) {
        fk_capture *c = (fk_capture *)GG.captures.v[i];
        if (c->mode == FKG_CAPTURE_MODE_RELAXED) continue;
        if (c->thread == &tl_capture_token ||
            (tl_capture_mode == FKG_CAPTURE_MODE_GLOBAL && c->mode == FKG_CAPTURE_MODE_GLOBAL)) {
            c->invalidated = 1;
            hit = 1;
        }
    }
    return hit ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* ---- hooks called by fake_cuda.c ---- */

/* Whether `s` takes part in a capture (then no host source is staged: a node reads it at launch). */
static int capture_stream_locked(const fk_stream *s) { return GG.captures.n && capture_member_locked(s, NULL); }

/* Before queuing work on `s` (sync: a synchronous API, on the legacy stream): 901 on a stream of an
   invalidated capture; 900 for a synchronous call that the thread's capture mode prohibits; 906 for
   work on the legacy stream while a blocking stream of its context captures. */
static CUresult capture_check_locked(fk_stream *s, int sync) {
    fk_capture *c;
    CUresult r;
    if (!GG.captures.n) return CUDA_SUCCESS;
    if (capture_member_locked(s, &c)) return c->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
    if (sync && (r = capture_unsafe_call_locked()) != CUDA_SUCCESS) return r;
    if (s->kind == SK_LEGACY && blocking_captures_locked(s->ctx, 1)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    return CUDA_SUCCESS;
}

/* enqueue_locked: an op queued on a capturing stream becomes a node instead (returns 1: the op is
   consumed). */
static int capture_divert_locked(fk_stream *s, fk_op *op) {
    fk_capture *c;
    fk_cmember *m;
    fk_gnode *n;
    int type;
    if (!GG.captures.n || !(m = capture_member_locked(s, &c))) return 0;
    switch (op->kind) {
    case OP_KERNEL: type = FKG_NODE_KERNEL; break;
    case OP_MEMSET:
    case OP_MEMSET2D: type = FKG_NODE_MEMSET; break;
    case OP_COPY:
    case OP_REGION: type = FKG_NODE_MEMCPY; break;
    case OP_HOSTFN: type = FKG_NODE_HOST; break;
    default: type = -1; break;
    }
    if (type < 0 && !c->invalidated) {
        add_violation_locked("%s: the fake driver cannot capture this operation (op kind %d) into a graph; the capture "
                             "%" PRIu64 " is invalidated",
                             op->api, op->kind, c->id);
        c->invalidated = 1;
    }
    if (c->invalidated) {
        finish_op_locked(op);
        return 1;
    }
    n = gnode_new(type);
    n->op = *op;
    n->op.next = NULL;
    n->op.api = type == FKG_NODE_KERNEL   ? API_KERNEL_NODE
                : type == FKG_NODE_MEMSET ? API_MEMSET_NODE
                : type == FKG_NODE_MEMCPY ? API_MEMCPY_NODE
                                          : API_HOST_NODE;
    free(op); /* a staged source, if any, now belongs to the node */
    capture_add_node_locked(c, m, n);
    return 1;
}

/* cuStreamSynchronize / cuStreamQuery. */
static CUresult capture_sync_check_locked(fk_stream *s) {
    fk_capture *c;
    if (!GG.captures.n) return CUDA_SUCCESS;
    if (capture_member_locked(s, &c)) {
        c->invalidated = 1;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (s->kind == SK_LEGACY && blocking_captures_locked(s->ctx, 1)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    /* A potentially unsafe call otherwise: the H200's driver answers 900 to another thread's
       cuStreamSynchronize of an unrelated stream during a global capture (review 25). */
    return capture_unsafe_call_locked();
}

/* cuEventQuery / cuEventSynchronize. */
static CUresult capture_event_check_locked(const fk_event *e) {
    fk_capture *c;
    if (!GG.captures.n) return CUDA_SUCCESS;
    if (capture_tag_locked(e, &c)) {
        c->invalidated = 1;
        return CUDA_ERROR_CAPTURED_EVENT;
    }
    return capture_unsafe_call_locked();
}

/* cuCtxSynchronize. */
static CUresult capture_ctx_sync_check_locked(const fk_ctx *ctx) {
    size_t i, j;
    int hit = 0;
    CUresult r;
    if (!GG.captures.n) return CUDA_SUCCESS;
    if ((r = capture_unsafe_call_locked()) != CUDA_SUCCESS) return r;
    for (i = 0; i < GG.captures.n; i++) {
        fk_capture *c = (fk_capture *)GG.captures.v[i];
        for (j = 0; j < c->members.n; j++)
            if (((const fk_cmember *)c->members.v[j])->s->ctx == ctx) {
                c->invalidated = 1;
                hit = 1;
            }
    }
    return hit ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

/* cuEventRecord: returns 1 when handled here (*r set): recorded in a capture, or refused. */
static int capture_event_record_locked(fk_stream *s, fk_event *e, CUresult *r) {
    fk_capture *c;
    fk_cmember *m;
    fk_ctag *t;
    if (!GG.captures.n) return 0;
    if ((*r = capture_check_locked(s, 0)) != CUDA_SUCCESS) return 1;
    capture_untag_locked(e);
    if (!(m = capture_member_locked(s, &c))) return 0; /* an ordinary record */
    t = (fk_ctag *)calloc(1, sizeof *t);
    if (!t) abort();
    t->e = e;
    e->refs++;
    vec_copy(&t->deps, &m->deps);
    vec_push(&c->tags, t);
    return 1;
}

/* cuStreamWaitEvent: returns 1 when handled here (*r set): a join, an event wait node, a refusal. */
static int capture_wait_event_locked(fk_stream *s, fk_event *e, unsigned flags, CUresult *r) {
    fk_capture *c = NULL, *tc = NULL;
    fk_cmember *m;
    fk_ctag *t;
    if (!GG.captures.n) return 0;
    if ((*r = capture_check_locked(s, 0)) != CUDA_SUCCESS) return 1;
    m = capture_member_locked(s, &c);
    t = capture_tag_locked(e, &tc);
    if (m) {
        if (flags & FKG_EVENT_WAIT_EXTERNAL) {
            fk_gnode *n = gnode_new(FKG_NODE_WAIT_EVENT);
            n->ev = e;
            e->refs++;
            capture_add_node_locked(c, m, n);
        } else if (t && tc == c) {
            vec_union(&m->deps, &t->deps);
        } else if (t) {
            c->invalidated = tc->invalidated = 1;
            *r = CUDA_ERROR_STREAM_CAPTURE_MERGE;
        } else if (e->recorded || (e->ipc && e->ipc->imported)) { /* work outside the capture */
            c->invalidated = 1;
            *r = CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
        }
        return 1;
    }
    if (!t) return 0;
    if (tc->invalidated) {
        *r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else if (s->kind == SK_LEGACY) {
        tc->invalidated = 1;
        *r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else {
        capture_add_member_locked(tc, s, &t->deps); /* joins the capture */
    }
    return 1;
}

/* cuMemAllocAsync / cuMemAllocFromPoolAsync (arguments checked): returns 1 when handled here (*r
   set; on success *out is the graph allocation). */
static int capture_alloc_async_locked(fk_stream *s, size_t bytesize, fk_alloc **out, CUresult *r) {
    fk_capture *c;
    fk_cmember *m;
    fk_gmem *gm;
    fk_gnode *n;
    if (!GG.captures.n) return 0;
    if ((*r = capture_check_locked(s, 0)) != CUDA_SUCCESS) return 1;
    if (!(m = capture_member_locked(s, &c))) return 0;
    if ((*r = gmem_new_locked(s->ctx->dev, bytesize, &gm)) != CUDA_SUCCESS) return 1;
    gm->owner = c->g;
    n = gnode_new(FKG_NODE_MEM_ALLOC);
    n->gm = gm;
    capture_add_node_locked(c, m, n);
    *out = gm->a;
    return 1;
}

/* cuMemFreeAsync: returns 1 when handled here (*r set): a free node while capturing, or a graph
   allocation freed outside graphs. */
static int capture_free_async_locked(fk_stream *s, CUdeviceptr dptr, CUresult *r) {
    fk_capture *c;
    fk_cmember *m;
    fk_gmem *gm;
    if (!GG.captures.n && !GG.gmems.n) return 0;
    if ((*r = capture_check_locked(s, 0)) != CUDA_SUCCESS) return 1;
    gm = gmem_find_locked(dptr);
    m = GG.captures.n ? capture_member_locked(s, &c) : NULL;
    if (m) {
        fk_gnode *n;
        if (!gm || gm->freed_in_graph) {
            c->invalidated = 1;
            *r = CUDA_ERROR_INVALID_VALUE;
            return 1;
        }
        if (gm->owner == c->g) gm->freed_in_graph = 1;
        n = gnode_new(FKG_NODE_MEM_FREE);
        n->gm = gm;
        gm->refs++;
        capture_add_node_locked(c, m, n);
        return 1;
    }
    if (!gm) return 0;
    *r = gm->freed_in_graph ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    return 1;
}

/* cuMemFree_v2: returns 1 for a graph allocation (*r set; the memory stays the graph's). */
static int graph_mem_free_locked(CUdeviceptr dptr, CUresult *r) {
    fk_gmem *gm;
    if (!GG.gmems.n || !(gm = gmem_find_locked(dptr))) return 0;
    *r = gm->freed_in_graph ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    return 1;
}

/* The leak report at unload (CUDRV_FAKE_REPORT_ON_EXIT=1), lock held. */
static void graph_report_at_exit_locked(void) {
    fprintf(stderr, "cudrv fake driver report: live_graphs=%" PRIu64 " live_graph_execs=%" PRIu64 "\n",
            (uint64_t)GG.graphs.n, (uint64_t)GG.execs.n);
}

/* ---- stream capture API ---- */

static CUresult begin_capture(const char *api, CUstream hStream, int mode) {
    fk_stream *s;
    CUresult r;
    ENTER(api);
    if (mode < FKG_CAPTURE_MODE_GLOBAL || mode > FKG_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r && s->kind == SK_LEGACY) r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (!r && GG.captures.n && capture_member_locked(s, NULL)) r = CUDA_ERROR_ILLEGAL_STATE;
    if (!r) {
        fk_capture *c = (fk_capture *)calloc(1, sizeof *c);
        if (!c) abort();
        c->id = ++GG.next_capture;
        c->mode = mode;
        c->thread = &tl_capture_token;
        c->g = graph_new(s->ctx);
        c->g->capture = c;
        vec_push(&GG.graphs, c->g);
        capture_add_member_locked(c, s, NULL);
        vec_push(&GG.captures, c);
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuStreamBeginCapture(CUstream hStream) {
    return begin_capture("cuStreamBeginCapture", hStream, FKG_CAPTURE_MODE_GLOBAL);
}
API_OLD cuStreamBeginCapture_v2(CUstream hStream, int mode) {
    return begin_capture("cuStreamBeginCapture_v2", hStream, mode);
}

API_OLD cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    fk_stream *s;
    fk_capture *c = NULL;
    CUresult r;
    ENTER("cuStreamEndCapture");
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    *phGraph = NULL;
    r = get_stream_locked(hStream, &s);
    if (!r) {
        fk_cmember *m = GG.captures.n ? capture_member_locked(s, &c) : NULL;
        if (!m) r = CUDA_ERROR_ILLEGAL_STATE;
        else if (m != c->members.v[0]) {
            c->invalidated = 1;
            r = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
        } else if (c->mode != FKG_CAPTURE_MODE_RELAXED && c->thread != &tl_capture_token)
            r = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    }
    if (!r) {
        fk_graph *g = c->g;
        r = c->invalidated             ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            : capture_unjoined_locked(c) ? CUDA_ERROR_STREAM_CAPTURE_UNJOINED
                                         : CUDA_SUCCESS;
        capture_end_locked(c);
        if (r) {
            vec_remove(&GG.graphs, g);
            graph_free_locked(g);
        } else {
            *phGraph = g;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuStreamIsCapturing(CUstream hStream, int *captureStatus) {
    fk_stream *s;
    fk_capture *c = NULL;
    CUresult r;
    ENTER("cuStreamIsCapturing");
    if (!captureStatus) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) {
        fk_cmember *m = GG.captures.n ? capture_member_locked(s, &c) : NULL;
        if (m) *captureStatus = c->invalidated ? FKG_CAPTURE_STATUS_INVALIDATED : FKG_CAPTURE_STATUS_ACTIVE;
        else if (s->kind == SK_LEGACY && GG.captures.n && blocking_captures_locked(s->ctx, 0))
            r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
        else *captureStatus = FKG_CAPTURE_STATUS_NONE;
    }
    fk_unlock(&G.lock);
    return r;
}

static CUresult capture_info(const char *api, CUstream hStream, int *status, cuuint64_t *id, CUgraph *graph,
                             const CUgraphNode **deps, const fkg_edge **edges, size_t *ndeps) {
    fk_stream *s;
    fk_capture *c = NULL;
    fk_cmember *m = NULL;
    CUresult r;
    ENTER(api);
    if (!status || (edges && !deps)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) {
        m = GG.captures.n ? capture_member_locked(s, &c) : NULL;
        if (!m && s->kind == SK_LEGACY && GG.captures.n && blocking_captures_locked(s->ctx, 0))
            r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    if (!r) {
        *status = !m ? FKG_CAPTURE_STATUS_NONE
                  : c->invalidated ? FKG_CAPTURE_STATUS_INVALIDATED
                                   : FKG_CAPTURE_STATUS_ACTIVE;
        if (id) *id = m ? c->id : 0;
        if (graph) *graph = m && !c->invalidated ? c->g : NULL;
        if (deps) *deps = m && m->deps.n ? (const CUgraphNode *)m->deps.v : NULL;
        if (ndeps) *ndeps = m ? m->deps.n : 0;
        if (edges) {
            *edges = NULL;
            if (m && m->deps.n) {
                if (m->edges_cap < m->deps.n) {
                    free(m->edges);
                    m->edges = (fkg_edge *)malloc(m->deps.n * sizeof *m->edges);
                    if (!m->edges) abort();
                    m->edges_cap = m->deps.n;
                }
                memset(m->edges, 0, m->deps.n * sizeof *m->edges);
                *edges = m->edges;
            }
        }
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuStreamGetCaptureInfo(CUstream hStream, int *captureStatus_out, cuuint64_t *id_out) {
    return capture_info("cuStreamGetCaptureInfo", hStream, captureStatus_out, id_out, NULL, NULL, NULL, NULL);
}
API_11030 cuStreamGetCaptureInfo_v2(CUstream hStream, int *captureStatus_out, cuuint64_t *id_out, CUgraph *graph_out,
                                    const CUgraphNode **dependencies_out, size_t *numDependencies_out) {
    return capture_info("cuStreamGetCaptureInfo_v2", hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        NULL, numDependencies_out);
}
FKG_API_12030 cuStreamGetCaptureInfo_v3(CUstream hStream, int *captureStatus_out, cuuint64_t *id_out,
                                        CUgraph *graph_out, const CUgraphNode **dependencies_out,
                                        const fkg_edge **edgeData_out, size_t *numDependencies_out) {
    return capture_info("cuStreamGetCaptureInfo_v3", hStream, captureStatus_out, id_out, graph_out, dependencies_out,
                        edgeData_out, numDependencies_out);
}

API_OLD cuThreadExchangeStreamCaptureMode(int *mode) {
    int old;
    ENTER("cuThreadExchangeStreamCaptureMode");
    if (!mode || *mode < FKG_CAPTURE_MODE_GLOBAL || *mode > FKG_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    old = tl_capture_mode;
    tl_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* ---- graph construction ---- */

API_OLD cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuGraphCreate");
    if (!phGraph || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) {
        fk_graph *g = graph_new(c);
        vec_push(&GG.graphs, g);
        *phGraph = g;
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuGraphDestroy(CUgraph hGraph) {
    CUresult r = CUDA_SUCCESS;
    size_t i;
    ENTER("cuGraphDestroy");
    fk_lock(&G.lock);
    if (!valid_graph_locked(hGraph)) r = CUDA_ERROR_INVALID_HANDLE;
    else if (hGraph->capture) r = CUDA_ERROR_ILLEGAL_STATE; /* end the capture first */
    else {
        vec_remove(&GG.graphs, hGraph);
        for (i = 0; i < GG.execs.n; i++)
            if (((fk_gexec *)GG.execs.v[i])->src == hGraph) ((fk_gexec *)GG.execs.v[i])->src = NULL;
        graph_free_locked(hGraph);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuGraphClone(CUgraph *phGraphClone, CUgraph originalGraph) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuGraphClone");
    if (!phGraphClone) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_graph_locked(originalGraph)) r = CUDA_ERROR_INVALID_HANDLE;
    else if (originalGraph->mem_nodes) r = CUDA_ERROR_INVALID_VALUE; /* cannot be cloned (cuda.h) */
    else {
        fk_graph *g = graph_clone_locked(originalGraph, 0);
        vec_push(&GG.graphs, g);
        *phGraphClone = g;
    }
    fk_unlock(&G.lock);
    return r;
}

static CUresult list_nodes(const char *api, CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes, int roots) {
    CUresult r = CUDA_SUCCESS;
    size_t i, k = 0;
    ENTER(api);
    if (!numNodes) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_graph_locked(hGraph)) r = CUDA_ERROR_INVALID_HANDLE;
    else {
        for (i = 0; i < hGraph->nodes.n; i++) {
            fk_gnode *n = (fk_gnode *)hGraph->nodes.v[i];
            if (roots && n->deps.n) continue;
            if (nodes && k < *numNodes) nodes[k] = n;
            k++;
        }
        if (nodes)
            for (i = k; i < *numNodes; i++) nodes[i] = NULL;
        if (!nodes || k < *numNodes) *numNodes = k;
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    return list_nodes("cuGraphGetNodes", hGraph, nodes, numNodes, 0);
}
API_OLD cuGraphGetRootNodes(CUgraph hGraph, CUgraphNode *rootNodes, size_t *numRootNodes) {
    return list_nodes("cuGraphGetRootNodes", hGraph, rootNodes, numRootNodes, 1);
}

API_OLD cuGraphNodeGetType(CUgraphNode hNode, int *type) {
    CUresult r = CUDA_SUCCESS;
    fk_gnode *n;
    ENTER("cuGraphNodeGetType");
    if (!type) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    n = find_node_locked(hNode);
    if (!n) r = CUDA_ERROR_INVALID_VALUE;
    else *type = n->type;
    fk_unlock(&G.lock);
    return r;
}

/* Common tail of the cuGraphAdd*Node functions: validates the graph and dependencies (lock held),
   then appends `n` (or frees it on error). */
static CUresult add_node_locked(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t nd, fk_gnode *n) {
    CUresult r = CUDA_SUCCESS;
    if (!valid_graph_locked(g)) r = CUDA_ERROR_INVALID_HANDLE;
    else r = check_deps_locked(g, deps, nd);
    if (r) {
        gnode_free_locked(n);
        return r;
    }
    graph_append_locked(g, n, deps, nd);
    *ph = n;
    return CUDA_SUCCESS;
}

API_OLD cuGraphAddEmptyNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                            size_t numDependencies) {
    CUresult r;
    ENTER("cuGraphAddEmptyNode");
    if (!phGraphNode) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = add_node_locked(phGraphNode, hGraph, dependencies, numDependencies, gnode_new(FKG_NODE_EMPTY));
    fk_unlock(&G.lock);
    return r;
}

/* Fills kernel node `n` from `p` (lock held): the launch checks of cuLaunchKernel, and the arguments
   copied now by the built-in kernel's parameter layout. */
static CUresult kernel_node_set_locked(fk_gnode *n, const fkg_kernel_params *p) {
    fk_func *f = p->func;
    unsigned char pbuf[64];
    int k, i;
    if (!f) return p->kern ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE; /* CUkernel: not emulated */
    if (!valid_func(f)) return CUDA_ERROR_INVALID_HANDLE;
    k = f->kernel;
    if (p->gridDimX == 0 || p->gridDimY == 0 || p->gridDimZ == 0 || p->blockDimX == 0 || p->blockDimY == 0 ||
        p->blockDimZ == 0 || p->gridDimX > 2147483647u || p->gridDimY > 65535 || p->gridDimZ > 65535 ||
        p->blockDimX > 1024 || p->blockDimY > 1024 || p->blockDimZ > 64 ||
        (uint64_t)p->blockDimX * p->blockDimY * p->blockDimZ > 1024 || p->sharedMemBytes > (unsigned)f->max_dyn_smem ||
        (p->kernelParams && p->extra))
        return CUDA_ERROR_INVALID_VALUE;
    if (KERNELS[k].total > (int)sizeof pbuf || KERNELS[k].nparams > 4) return CUDA_ERROR_NOT_SUPPORTED;
    memset(pbuf, 0, sizeof pbuf);
    if (KERNELS[k].nparams) {
        if (p->kernelParams) {
            for (i = 0; i < KERNELS[k].nparams; i++) {
                if (!p->kernelParams[i]) return CUDA_ERROR_INVALID_VALUE;
                memcpy(pbuf + KERNELS[k].off[i], p->kernelParams[i], (size_t)KERNELS[k].size[i]);
            }
        } else if (p->extra) {
            void *buf = NULL;
            size_t *sz = NULL;
            for (i = 0; p->extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
                if (p->extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = p->extra[i + 1];
                else if (p->extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE) sz = (size_t *)p->extra[i + 1];
                else return CUDA_ERROR_INVALID_VALUE;
            }
            if (!buf || !sz || *sz < (size_t)KERNELS[k].total) return CUDA_ERROR_INVALID_VALUE;
            memcpy(pbuf, buf, (size_t)KERNELS[k].total);
        } else {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    memset(&n->op, 0, sizeof n->op);
    n->op.kind = OP_KERNEL;
    n->op.api = API_KERNEL_NODE;
    n->op.kernel = k;
    for (i = 0; i < KERNELS[k].nparams; i++) {
        if (KERNELS[k].size[i] == 4) memcpy(&n->op.kval, pbuf + KERNELS[k].off[i], 4);
        else memcpy(&n->op.kp[i], pbuf + KERNELS[k].off[i], 8);
    }
    n->func = f;
    return CUDA_SUCCESS;
}

static void kernel_params_from_v1(const fkg_kernel_params_v1 *v1, fkg_kernel_params *p) {
    memset(p, 0, sizeof *p);
    memcpy(p, v1, sizeof *v1); /* v2 extends v1 */
}

static CUresult add_kernel_node(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t nd,
                                const fkg_kernel_params *p) {
    fk_gnode *n;
    CUresult r;
    if (!ph || !p) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    n = gnode_new(FKG_NODE_KERNEL);
    r = kernel_node_set_locked(n, p);
    if (r) gnode_free_locked(n);
    else r = add_node_locked(ph, g, deps, nd, n);
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                             size_t numDependencies, const fkg_kernel_params_v1 *nodeParams) {
    fkg_kernel_params p;
    ENTER("cuGraphAddKernelNode");
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    kernel_params_from_v1(nodeParams, &p);
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, &p);
}
API_12000 cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                  size_t numDependencies, const fkg_kernel_params *nodeParams) {
    ENTER("cuGraphAddKernelNode_v2");
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

static CUresult kernel_node_set_params(CUgraphNode hNode, const fkg_kernel_params *p) {
    fk_gnode *n, tmp;
    CUresult r;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    n = find_node_locked(hNode);
    if (!n || n->type != FKG_NODE_KERNEL) r = CUDA_ERROR_INVALID_VALUE;
    else {
        memset(&tmp, 0, sizeof tmp);
        r = kernel_node_set_locked(&tmp, p);
        if (!r) {
            n->op = tmp.op;
            n->func = tmp.func;
        }
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuGraphKernelNodeSetParams(CUgraphNode hNode, const fkg_kernel_params_v1 *nodeParams) {
    fkg_kernel_params p;
    ENTER("cuGraphKernelNodeSetParams");
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    kernel_params_from_v1(nodeParams, &p);
    return kernel_node_set_params(hNode, &p);
}
API_12000 cuGraphKernelNodeSetParams_v2(CUgraphNode hNode, const fkg_kernel_params *nodeParams) {
    ENTER("cuGraphKernelNodeSetParams_v2");
    return kernel_node_set_params(hNode, nodeParams);
}

static CUresult check_ctx_arg_locked(CUcontext ctx) {
    if (!ctx || !valid_ctx(ctx) || !ctx->active) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

API_OLD cuGraphAddMemcpyNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                             size_t numDependencies, const fkg_memcpy3d *p, CUcontext ctx) {
    fk_gnode *n;
    CUresult r;
    int sh, dh;
    ENTER("cuGraphAddMemcpyNode");
    if (!phGraphNode || !p || p->reserved0 || p->reserved1 || p->Height == 0 || p->Depth == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (p->srcMemoryType < FKG_MEMORYTYPE_HOST || p->srcMemoryType > FKG_MEMORYTYPE_UNIFIED ||
        p->dstMemoryType < FKG_MEMORYTYPE_HOST || p->dstMemoryType > FKG_MEMORYTYPE_UNIFIED)
        return CUDA_ERROR_INVALID_VALUE;
    sh = p->srcMemoryType == FKG_MEMORYTYPE_HOST;
    dh = p->dstMemoryType == FKG_MEMORYTYPE_HOST;
    /* 1D copies between host and device memory, or device and device memory, only */
    if (p->srcMemoryType == FKG_MEMORYTYPE_ARRAY || p->dstMemoryType == FKG_MEMORYTYPE_ARRAY || (sh && dh) ||
        p->Height != 1 || p->Depth != 1 || p->srcY || p->srcZ || p->srcLOD || p->dstY || p->dstZ || p->dstLOD)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (p->WidthInBytes && ((sh && !p->srcHost) || (dh && !p->dstHost))) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = check_ctx_arg_locked(ctx);
    if (!r) {
        n = gnode_new(FKG_NODE_MEMCPY);
        n->op.kind = OP_COPY;
        n->op.api = API_MEMCPY_NODE;
        n->op.cpkind = sh ? CP_HTOD : dh ? CP_DTOH : CP_DTOD;
        n->op.src = (sh ? (uint64_t)(uintptr_t)p->srcHost : p->srcDevice) + p->srcXInBytes;
        n->op.dst = (dh ? (uint64_t)(uintptr_t)p->dstHost : p->dstDevice) + p->dstXInBytes;
        n->op.count = p->WidthInBytes;
        n->op.elem = 1;
        r = add_node_locked(phGraphNode, hGraph, dependencies, numDependencies, n);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuGraphAddMemsetNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                             size_t numDependencies, const fkg_memset_params *p, CUcontext ctx) {
    fk_gnode *n;
    CUresult r;
    ENTER("cuGraphAddMemsetNode");
    if (!phGraphNode || !p || (p->elementSize != 1 && p->elementSize != 2 && p->elementSize != 4) ||
        p->dst % p->elementSize || p->height == 0 ||
        (p->height > 1 && (p->pitch < p->width * p->elementSize || p->pitch % p->elementSize)))
        return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = check_ctx_arg_locked(ctx);
    if (!r) {
        n = gnode_new(FKG_NODE_MEMSET);
        n->op.kind = OP_MEMSET;
        n->op.api = API_MEMSET_NODE;
        n->op.dst = p->dst;
        n->op.value = p->value;
        n->op.count = p->width;
        n->op.elem = (int)p->elementSize;
        n->rows = p->height;
        n->pitch = p->height > 1 ? p->pitch : 0;
        r = add_node_locked(phGraphNode, hGraph, dependencies, numDependencies, n);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuGraphAddHostNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                           size_t numDependencies, const fkg_host_params *p) {
    fk_gnode *n;
    CUresult r;
    ENTER("cuGraphAddHostNode");
    if (!phGraphNode || !p || !p->fn) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    n = gnode_new(FKG_NODE_HOST);
    n->op.kind = OP_HOSTFN;
    n->op.api = API_HOST_NODE;
    n->op.fn = p->fn;
    n->op.ud = p->userData;
    r = add_node_locked(phGraphNode, hGraph, dependencies, numDependencies, n);
    fk_unlock(&G.lock);
    return r;
}

static CUresult add_event_node(const char *api, int type, CUgraphNode *ph, CUgraph g, const CUgraphNode *deps,
                               size_t nd, CUevent e) {
    CUresult r;
    ENTER(api);
    if (!ph) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_event(e)) r = CUDA_ERROR_INVALID_HANDLE;
    else {
        fk_gnode *n = gnode_new(type);
        n->ev = e;
        e->refs++;
        r = add_node_locked(ph, g, deps, nd, n);
    }
    fk_unlock(&G.lock);
    return r;
}
FKG_API_11010 cuGraphAddEventRecordNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                        size_t numDependencies, CUevent event) {
    return add_event_node("cuGraphAddEventRecordNode", FKG_NODE_EVENT_RECORD, phGraphNode, hGraph, dependencies,
                          numDependencies, event);
}
FKG_API_11010 cuGraphAddEventWaitNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                      size_t numDependencies, CUevent event) {
    return add_event_node("cuGraphAddEventWaitNode", FKG_NODE_WAIT_EVENT, phGraphNode, hGraph, dependencies,
                          numDependencies, event);
}

API_OLD cuGraphAddChildGraphNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                 size_t numDependencies, CUgraph childGraph) {
    CUresult r;
    ENTER("cuGraphAddChildGraphNode");
    if (!phGraphNode) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_graph_locked(childGraph)) r = CUDA_ERROR_INVALID_HANDLE;
    else if (childGraph == hGraph || childGraph->mem_nodes) r = CUDA_ERROR_INVALID_VALUE;
    else {
        fk_gnode *n = gnode_new(FKG_NODE_GRAPH);
        n->child = graph_clone_locked(childGraph, 0);
        r = add_node_locked(phGraphNode, hGraph, dependencies, numDependencies, n);
    }
    fk_unlock(&G.lock);
    return r;
}

API_11040 cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                 size_t numDependencies, fkg_mem_alloc_params *p) {
    CUresult r;
    int dev;
    fk_gmem *gm;
    ENTER("cuGraphAddMemAllocNode");
    if (!phGraphNode || !p) return CUDA_ERROR_INVALID_VALUE;
    if (p->poolProps.allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    dev = p->poolProps.location.id;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[dev].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    if (p->poolProps.handleTypes != 0 || p->bytesize == 0 || (p->accessDescCount && !p->accessDescs) ||
        p->accessDescCount > (size_t)G.ndev)
        return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_graph_locked(hGraph)) r = CUDA_ERROR_INVALID_HANDLE;
    else r = check_deps_locked(hGraph, dependencies, numDependencies);
    if (!r) r = gmem_new_locked(dev, p->bytesize, &gm);
    if (!r) {
        fk_gnode *n = gnode_new(FKG_NODE_MEM_ALLOC);
        gm->owner = hGraph;
        n->gm = gm;
        graph_append_locked(hGraph, n, dependencies, numDependencies);
        *phGraphNode = n;
        p->dptr = gm->a->base;
    }
    fk_unlock(&G.lock);
    return r;
}

API_11040 cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                size_t numDependencies, CUdeviceptr dptr) {
    CUresult r;
    fk_gmem *gm;
    ENTER("cuGraphAddMemFreeNode");
    if (!phGraphNode) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_graph_locked(hGraph)) r = CUDA_ERROR_INVALID_HANDLE;
    else r = check_deps_locked(hGraph, dependencies, numDependencies);
    gm = r ? NULL : gmem_find_locked(dptr);
    if (!r && (!gm || gm->freed_in_graph)) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) {
        fk_gnode *n = gnode_new(FKG_NODE_MEM_FREE);
        if (gm->owner == hGraph) gm->freed_in_graph = 1;
        n->gm = gm;
        gm->refs++;
        graph_append_locked(hGraph, n, dependencies, numDependencies);
        *phGraphNode = n;
    }
    fk_unlock(&G.lock);
    return r;
}

/* ---- executable graphs ---- */

static CUresult instantiate_locked(fk_gexec **out, fk_graph *g, unsigned long long flags) {
    fk_gexec *x;
    size_t i;
    if (!valid_graph_locked(g)) return CUDA_ERROR_INVALID_HANDLE;
    if (flags & ~(FKG_INSTANTIATE_AUTO_FREE_ON_LAUNCH | FKG_INSTANTIATE_UPLOAD | FKG_INSTANTIATE_DEVICE_LAUNCH |
                  FKG_INSTANTIATE_USE_NODE_PRIORITY))
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & FKG_INSTANTIATE_DEVICE_LAUNCH) return CUDA_ERROR_NOT_SUPPORTED;
    if (g->mem_nodes && g->execs) return CUDA_ERROR_INVALID_VALUE; /* one executable graph at a time */
    x = (fk_gexec *)calloc(1, sizeof *x);
    if (!x) abort();
    x->ctx = g->ctx;
    x->g = graph_clone_locked(g, 1);
    x->src = g;
    x->flags = flags;
    g->execs++;
    for (i = 0; i < x->g->nodes.n; i++) {
        const fk_gnode *n = (const fk_gnode *)x->g->nodes.v[i];
        if (n->gm && vec_find(&x->gms, n->gm) < 0) vec_push(&x->gms, n->gm);
    }
    vec_push(&GG.execs, x);
    *out = x;
    return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags, CUgraphNode *errNode,
                            int *result) {
    CUresult r;
    if (!phGraphExec) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = instantiate_locked(phGraphExec, hGraph, flags);
    fk_unlock(&G.lock);
    if (errNode) *errNode = NULL;
    if (result) *result = r ? 1 /* CUDA_GRAPH_INSTANTIATE_ERROR */ : 0;
    return r;
}
API_11040 cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    ENTER("cuGraphInstantiateWithFlags");
    return instantiate(phGraphExec, hGraph, flags, NULL, NULL);
}
API_OLD cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                           size_t bufferSize) {
    ENTER("cuGraphInstantiate");
    if (logBuffer && bufferSize) logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph, 0, phErrorNode, NULL);
}
API_11000 cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,
                                size_t bufferSize) {
    ENTER("cuGraphInstantiate_v2");
    if (logBuffer && bufferSize) logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph, 0, phErrorNode, NULL);
}
API_12000 cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph, fkg_instantiate_params *p) {
    ENTER("cuGraphInstantiateWithParams");
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    return instantiate(phGraphExec, hGraph, p->flags, &p->hErrNode_out, &p->result_out);
}

API_OLD cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuGraphExecDestroy");
    fk_lock(&G.lock);
    if (!hGraphExec || !vec_remove(&GG.execs, hGraphExec)) r = CUDA_ERROR_INVALID_HANDLE;
    else {
        /* launches already queued own what they use: they complete */
        if (hGraphExec->src) hGraphExec->src->execs--;
        if (hGraphExec->last_s) stream_unref_locked(hGraphExec->last_s);
        graph_free_locked(hGraphExec->g);
        free(hGraphExec->gms.v);
        free(hGraphExec);
    }
    fk_unlock(&G.lock);
    return r;
}

/* Queues `op` on `s`: the first op of a launch with the legacy-stream synchronisation of
   enqueue_locked, the others after it. */
static void launch_emit_locked(fk_stream *s, fk_op *op, int *first) {
    if (*first) {
        *first = 0;
        enqueue_locked(s, op);
    } else {
        push_op_locked(s, op);
    }
}

static fk_op *clone_op(const fk_op *t) {
    fk_op *o = new_op(t->kind, t->api);
    *o = *t;
    o->next = NULL;
    o->seq = 0;
    if (o->src_snapshot) dup_snapshot(o);
    return o;
}

/* Queues a wait of `s` for `target` up to `seq`, unless it is done already. */
static void launch_wait_locked(fk_stream *s, fk_stream *target, uint64_t seq, int *first) {
    fk_op *w;
    if (target == s || target->completed >= seq) return;
    w = new_op(OP_WAIT, "wait");
    w->ws = target;
    w->wseq = seq;
    target->refs++;
    launch_emit_locked(s, w, first);
}

static void launch_nodes_locked(const fk_graph *g, fk_stream *s, int *first) {
    size_t i, row;
    for (i = 0; i < g->nodes.n; i++) {
        const fk_gnode *n = (const fk_gnode *)g->nodes.v[i];
        switch (n->type) {
        case FKG_NODE_KERNEL:
        case FKG_NODE_MEMCPY:
        case FKG_NODE_HOST:
            launch_emit_locked(s, clone_op(&n->op), first);
            break;
        case FKG_NODE_MEMSET:
            for (row = 0; row < n->rows; row++) {
                fk_op *o = clone_op(&n->op);
                o->dst += (uint64_t)row * n->pitch;
                launch_emit_locked(s, o, first);
            }
            break;
        case FKG_NODE_EVENT_RECORD: {
            /* as cuEventRecord */
            fk_event *e = n->ev;
            fk_op *o = new_op(OP_RECORD, API_RECORD_NODE);
            capture_untag_locked(e);
            e->gen++;
            e->t_valid = 0;
            if (e->rs) stream_unref_locked(e->rs);
            e->rs = s;
            s->refs++;
            e->recorded = 1;
            o->ev = e;
            e->refs++;
            o->gen = e->gen;
            if (e->ipc) o->ipc_ticket = ipc_event_ticket(e); /* an interprocess event, as cuEventRecord */
            launch_emit_locked(s, o, first);
            e->rseq = o->seq;
            break;
        }
        case FKG_NODE_WAIT_EVENT:
            if (n->ev->recorded) launch_wait_locked(s, n->ev->rs, n->ev->rseq, first);
            break;
        case FKG_NODE_GRAPH:
            launch_nodes_locked(n->child, s, first);
            break;
        default: /* empty, memory allocation and free: nothing to run */
            break;
        }
    }
}

static void graph_launch_locked(fk_gexec *x, fk_stream *s) {
    int first = 1;
    uint64_t before = s->enqueued;
    if (x->last_s) launch_wait_locked(s, x->last_s, x->last_seq, &first); /* launches of x are ordered */
    launch_nodes_locked(x->g, s, &first);
    if (x->gms.n) {
        /* the graph memory stays reserved until this launch has run */
        fk_vec *list = (fk_vec *)calloc(1, sizeof *list);
        fk_op *o = new_op(OP_HOSTFN, "cuGraphLaunch (graph memory)");
        size_t i;
        if (!list) abort();
        for (i = 0; i < x->gms.n; i++) {
            ((fk_gmem *)x->gms.v[i])->refs++;
            vec_push(list, x->gms.v[i]);
        }
        o->fn = gmem_launch_done;
        o->ud = list;
        launch_emit_locked(s, o, &first);
    }
    if (s->enqueued != before) {
        if (x->last_s != s) {
            if (x->last_s) stream_unref_locked(x->last_s);
            x->last_s = s;
            s->refs++;
        }
        x->last_seq = s->enqueued;
    }
}

API_OLD cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    fk_stream *s;
    fk_capture *c = NULL;
    fk_cmember *m;
    CUresult r;
    ENTER("cuGraphLaunch");
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r && !valid_exec_locked(hGraphExec)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r && s->ctx != hGraphExec->ctx) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) r = capture_check_locked(s, 0);
    if (!r) {
        m = GG.captures.n ? capture_member_locked(s, &c) : NULL;
        if (!m) graph_launch_locked(hGraphExec, s);
        else if (hGraphExec->g->mem_nodes) {
            c->invalidated = 1;
            r = CUDA_ERROR_NOT_SUPPORTED;
        } else {
            /* captured as a child graph node */
            fk_gnode *n = gnode_new(FKG_NODE_GRAPH);
            n->child = graph_clone_locked(hGraphExec->g, 0);
            capture_add_node_locked(c, m, n);
        }
    }
    fk_unlock(&G.lock);
    return r;
}

FKG_API_11010 cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) {
    fk_stream *s;
    CUresult r;
    ENTER("cuGraphUpload");
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r && !valid_exec_locked(hGraphExec)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r && s->ctx != hGraphExec->ctx) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) r = capture_check_locked(s, 0);
    fk_unlock(&G.lock);
    return r; /* nothing to upload */
}

/* ---- update ---- */

static int has_dep_index(const fk_gnode *n, size_t index) {
    size_t i;
    for (i = 0; i < n->deps.n; i++)
        if (((const fk_gnode *)n->deps.v[i])->index == index) return 1;
    return 0;
}

/* Whether `g` can update `xg` (an executable graph's copy); if not, fills *info. */
static int update_refused(const fk_graph *xg, const fk_graph *g, fkg_update_info *info) {
    size_t i, j;
    if (xg->nodes.n != g->nodes.n) {
        info->result = FKG_UPDATE_ERROR_TOPOLOGY_CHANGED;
        return 1;
    }
    for (i = 0; i < g->nodes.n; i++) {
        const fk_gnode *a = (const fk_gnode *)xg->nodes.v[i];
        fk_gnode *b = (fk_gnode *)g->nodes.v[i];
        int res = FKG_UPDATE_SUCCESS;
        info->errorNode = b;
        if (a->type != b->type) {
            info->result = FKG_UPDATE_ERROR_NODE_TYPE_CHANGED;
            return 1;
        }
        if (a->deps.n != b->deps.n) {
            info->result = FKG_UPDATE_ERROR_TOPOLOGY_CHANGED;
            return 1;
        }
        for (j = 0; j < b->deps.n; j++) {
            fk_gnode *d = (fk_gnode *)b->deps.v[j];
            if (!has_dep_index(a, d->index)) {
                info->result = FKG_UPDATE_ERROR_TOPOLOGY_CHANGED;
                info->errorFromNode = d;
                return 1;
            }
        }
        switch (b->type) {
        case FKG_NODE_MEMSET: /* the shape may not change */
            if (a->op.kind != b->op.kind || a->op.elem != b->op.elem || a->op.count != b->op.count ||
                a->rows != b->rows || a->pitch != b->pitch || a->op.dpitch != b->op.dpitch ||
                a->op.wbytes != b->op.wbytes || a->op.rows != b->op.rows)
                res = FKG_UPDATE_ERROR_PARAMETERS_CHANGED;
            break;
        case FKG_NODE_MEMCPY: /* the kinds of memory may not change */
            if (a->op.kind != b->op.kind || a->op.cpkind != b->op.cpkind || a->op.dmt != b->op.dmt ||
                a->op.smt != b->op.smt)
                res = FKG_UPDATE_ERROR_PARAMETERS_CHANGED;
            break;
        case FKG_NODE_MEM_ALLOC:
        case FKG_NODE_MEM_FREE:
            if (a->gm != b->gm) res = FKG_UPDATE_ERROR_NOT_SUPPORTED;
            break;
        case FKG_NODE_GRAPH:
            if (update_refused(a->child, b->child, info)) {
                info->errorNode = b;
                info->errorFromNode = NULL;
                return 1;
            }
            break;
        default:
            break;
        }
        if (res) {
            info->result = res;
            return 1;
        }
    }
    info->errorNode = NULL;
    return 0;
}

static void update_apply_locked(fk_graph *xg, const fk_graph *g, int top) {
    size_t i;
    for (i = 0; i < g->nodes.n; i++) {
        fk_gnode *a = (fk_gnode *)xg->nodes.v[i];
        const fk_gnode *b = (const fk_gnode *)g->nodes.v[i];
        if (top) a->alias = b;
        switch (b->type) {
        case FKG_NODE_KERNEL:
        case FKG_NODE_HOST:
        case FKG_NODE_MEMSET:
        case FKG_NODE_MEMCPY:
            if (a->op.src_snapshot) free((void *)(uintptr_t)a->op.src);
            a->op = b->op;
            if (a->op.src_snapshot) dup_snapshot(&a->op);
            a->func = b->func;
            break;
        case FKG_NODE_EVENT_RECORD:
        case FKG_NODE_WAIT_EVENT:
            if (a->ev != b->ev) {
                event_unref_locked(a->ev);
                a->ev = b->ev;
                a->ev->refs++;
            }
            break;
        case FKG_NODE_GRAPH:
            update_apply_locked(a->child, b->child, 0);
            break;
        default:
            break;
        }
    }
}

static CUresult exec_update(CUgraphExec x, CUgraph g, fkg_update_info *info) {
    CUresult r = CUDA_SUCCESS;
    fk_lock(&G.lock);
    memset(info, 0, sizeof *info);
    if (!valid_exec_locked(x) || !valid_graph_locked(g)) r = CUDA_ERROR_INVALID_HANDLE;
    else if (update_refused(x->g, g, info)) r = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    else update_apply_locked(x->g, g, 1);
    if (r == CUDA_ERROR_INVALID_HANDLE) info->result = 1; /* CU_GRAPH_EXEC_UPDATE_ERROR */
    fk_unlock(&G.lock);
    return r;
}
API_12000 cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph, fkg_update_info *resultInfo) {
    ENTER("cuGraphExecUpdate_v2");
    if (!resultInfo) return CUDA_ERROR_INVALID_VALUE;
    return exec_update(hGraphExec, hGraph, resultInfo);
}
API_OLD cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
                          int *updateResult_out) {
    fkg_update_info info;
    CUresult r;
    ENTER("cuGraphExecUpdate");
    if (!hErrorNode_out || !updateResult_out) return CUDA_ERROR_INVALID_VALUE;
    r = exec_update(hGraphExec, hGraph, &info);
    *hErrorNode_out = info.errorNode;
    *updateResult_out = info.result;
    return r;
}

static CUresult exec_kernel_set_params(CUgraphExec x, CUgraphNode hNode, const fkg_kernel_params *p) {
    CUresult r = CUDA_SUCCESS;
    fk_gnode *a = NULL, tmp;
    size_t i;
    if (!p || !hNode) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_exec_locked(x)) r = CUDA_ERROR_INVALID_HANDLE;
    else {
        /* the node of the graph instantiated (or of the last update's graph) names the copy */
        for (i = 0; i < x->g->nodes.n && !a; i++) {
            fk_gnode *n = (fk_gnode *)x->g->nodes.v[i];
            if (n->from == hNode || n->alias == hNode) a = n;
        }
        if (!a || a->type != FKG_NODE_KERNEL) r = CUDA_ERROR_INVALID_VALUE;
    }
    if (!r) {
        memset(&tmp, 0, sizeof tmp);
        r = kernel_node_set_locked(&tmp, p);
        if (!r) {
            a->op = tmp.op;
            a->func = tmp.func;
        }
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuGraphExecKernelNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                       const fkg_kernel_params_v1 *nodeParams) {
    fkg_kernel_params p;
    ENTER("cuGraphExecKernelNodeSetParams");
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    kernel_params_from_v1(nodeParams, &p);
    return exec_kernel_set_params(hGraphExec, hNode, &p);
}
API_12000 cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                            const fkg_kernel_params *nodeParams) {
    ENTER("cuGraphExecKernelNodeSetParams_v2");
    return exec_kernel_set_params(hGraphExec, hNode, nodeParams);
}

/* ---- graph memory attributes ---- */

API_11040 cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuDeviceGetGraphMemAttribute");
    if (!valid_dev(device)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[device].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    switch (attr) {
    case FKG_GRAPH_MEM_USED_CURRENT: *(cuuint64_t *)value = GG.mem[device].used; break;
    case FKG_GRAPH_MEM_USED_HIGH: *(cuuint64_t *)value = GG.mem[device].used_high; break;
    case FKG_GRAPH_MEM_RESERVED_CURRENT: *(cuuint64_t *)value = GG.mem[device].reserved; break;
    case FKG_GRAPH_MEM_RESERVED_HIGH: *(cuuint64_t *)value = GG.mem[device].reserved_high; break;
    default: r = CUDA_ERROR_INVALID_VALUE;
    }
    fk_unlock(&G.lock);
    return r;
}

API_11040 cuDeviceSetGraphMemAttribute(CUdevice device, int attr, void *value) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuDeviceSetGraphMemAttribute");
    if (!valid_dev(device)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[device].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    if (!value || *(cuuint64_t *)value != 0) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (attr == FKG_GRAPH_MEM_USED_HIGH) GG.mem[device].used_high = GG.mem[device].used;
    else if (attr == FKG_GRAPH_MEM_RESERVED_HIGH) GG.mem[device].reserved_high = GG.mem[device].reserved;
    else r = CUDA_ERROR_INVALID_VALUE;
    fk_unlock(&G.lock);
    return r;
}

API_11040 cuDeviceGraphMemTrim(CUdevice device) {
    ENTER("cuDeviceGraphMemTrim");
    if (!valid_dev(device)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[device].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    fk_lock(&G.lock);
    GG.mem[device].reserved = GG.mem[device].used;
    fk_unlock(&G.lock);
    return CUDA_SUCCESS;
}

/* ---- fake-only exports ---- */

/* Graphs with a live handle (made by cuGraphCreate, cuGraphClone or a capture, ended or not). */
FK_EXPORT uint64_t cudrvFakeLiveGraphs(void) {
    uint64_t n;
    fk_lock(&G.lock);
    n = GG.graphs.n;
    fk_unlock(&G.lock);
    return n;
}

/* Executable graphs not destroyed. */
FK_EXPORT uint64_t cudrvFakeLiveGraphExecs(void) {
    uint64_t n;
    fk_lock(&G.lock);
    n = GG.execs.n;
    fk_unlock(&G.lock);
    return n;
}

/* Entries of fake_cuda.c's PROC_TABLE (name, the CUDA version of the variant, function), from
   cudaTypedefs.h. */
#define FK_GRAPH_PROCS                                                                      \
    P("cuStreamBeginCapture", 10000, cuStreamBeginCapture),                                 \
    P("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),                              \
    P("cuStreamEndCapture", 10000, cuStreamEndCapture),                                     \
    P("cuStreamIsCapturing", 10000, cuStreamIsCapturing),                                   \
    P("cuStreamGetCaptureInfo", 10010, cuStreamGetCaptureInfo),                             \
    P("cuStreamGetCaptureInfo", 11030, cuStreamGetCaptureInfo_v2),                          \
    P("cuStreamGetCaptureInfo", 12030, cuStreamGetCaptureInfo_v3),                          \
    P("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode),       \
    P("cuGraphCreate", 10000, cuGraphCreate),                                               \
    P("cuGraphDestroy", 10000, cuGraphDestroy),                                             \
    P("cuGraphClone", 10000, cuGraphClone),                                                 \
    P("cuGraphGetNodes", 10000, cuGraphGetNodes),                                           \
    P("cuGraphGetRootNodes", 10000, cuGraphGetRootNodes),                                   \
    P("cuGraphNodeGetType", 10000, cuGraphNodeGetType),                                     \
    P("cuGraphAddEmptyNode", 10000, cuGraphAddEmptyNode),                                   \
    P("cuGraphAddKernelNode", 10000, cuGraphAddKernelNode),                                 \
    P("cuGraphAddKernelNode", 12000, cuGraphAddKernelNode_v2),                              \
    P("cuGraphKernelNodeSetParams", 10000, cuGraphKernelNodeSetParams),                     \
    P("cuGraphKernelNodeSetParams", 12000, cuGraphKernelNodeSetParams_v2),                  \
    P("cuGraphAddMemcpyNode", 10000, cuGraphAddMemcpyNode),                                 \
    P("cuGraphAddMemsetNode", 10000, cuGraphAddMemsetNode),                                 \
    P("cuGraphAddHostNode", 10000, cuGraphAddHostNode),                                     \
    P("cuGraphAddEventRecordNode", 11010, cuGraphAddEventRecordNode),                       \
    P("cuGraphAddEventWaitNode", 11010, cuGraphAddEventWaitNode),                           \
    P("cuGraphAddChildGraphNode", 10000, cuGraphAddChildGraphNode),                         \
    P("cuGraphAddMemAllocNode", 11040, cuGraphAddMemAllocNode),                             \
    P("cuGraphAddMemFreeNode", 11040, cuGraphAddMemFreeNode),                               \
    P("cuGraphInstantiate", 10000, cuGraphInstantiate),                                     \
    P("cuGraphInstantiate", 11000, cuGraphInstantiate_v2),                                  \
    P("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags),                   \
    P("cuGraphInstantiateWithParams", 12000, cuGraphInstantiateWithParams),                 \
    P("cuGraphExecDestroy", 10000, cuGraphExecDestroy),                                     \
    P("cuGraphLaunch", 10000, cuGraphLaunch),                                               \
    P("cuGraphUpload", 11010, cuGraphUpload),                                               \
    P("cuGraphExecUpdate", 10020, cuGraphExecUpdate),                                       \
    P("cuGraphExecUpdate", 12000, cuGraphExecUpdate_v2),                                    \
    P("cuGraphExecKernelNodeSetParams", 10010, cuGraphExecKernelNodeSetParams),             \
    P("cuGraphExecKernelNodeSetParams", 12000, cuGraphExecKernelNodeSetParams_v2),          \
    P("cuDeviceGetGraphMemAttribute", 11040, cuDeviceGetGraphMemAttribute),                 \
    P("cuDeviceSetGraphMemAttribute", 11040, cuDeviceSetGraphMemAttribute),                 \
    P("cuDeviceGraphMemTrim", 11040, cuDeviceGraphMemTrim),

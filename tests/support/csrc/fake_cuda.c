/*
 * fake_cuda.c -- an emulated CUDA driver (libcuda.so / nvcuda.dll) for testing cudrv without a GPU.
 *
 * Portable C11, self-contained: it does not include cuda.h. Every type, enum value, struct layout and
 * signature below is copied from the CUDA 13.0 cuda.h; the version table (which ABI variant of a
 * function appeared in which CUDA version) is copied from cudaTypedefs.h (PFN_<name>_v<VERSION>).
 *
 * ==================================================================================================
 * CONFIGURATION (environment variables, read once, at the first driver call)
 * ==================================================================================================
 *  CUDRV_FAKE_MODE=linux|wddm|tcc      driver model of every device (default linux)
 *  CUDRV_FAKE_DEVICES=<entry>[,<entry>...] | <N>
 *                                      one device per entry, each with its own mode (overrides MODE).
 *                                      An entry is <mode>, <mode>-novmm (that device has no virtual
 *                                      memory management, whatever CUDRV_FAKE_VMM says) or <mode>-vmm
 *                                      (it has VMM, whatever CUDRV_FAKE_VMM says); spaces around an
 *                                      entry are ignored. E.g. "linux,tcc-novmm". A plain number N
 *                                      (0 to 16) means N devices of CUDRV_FAKE_MODE (0: cuInit returns
 *                                      CUDA_ERROR_NO_DEVICE). Default: one device. At most 16.
 *  CUDRV_FAKE_VMM=0|1                  virtual memory management on every device (default 1, in every
 *                                      mode). 0: attribute 102 (VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
 *                                      reads 0 and the cuMemCreate family returns
 *                                      CUDA_ERROR_NOT_SUPPORTED (801). See "Virtual memory" below.
 *  CUDRV_FAKE_MEMORY=<bytes>           device memory per device (default 16 GiB): a decimal, 0x-hex or
 *                                      0-octal integer. Reserved bytes (cuMemAlloc, managed memory,
 *                                      pool reservations, cuMemCreate) count against it; beyond it:
 *                                      CUDA_ERROR_OUT_OF_MEMORY. Backing host memory is allocated
 *                                      lazily (at the first access), so huge sizes are cheap.
 *  CUDRV_FAKE_DELAY_US=<us>            each stream worker sleeps this long before every operation
 *                                      (an integer, as for MEMORY).
 *  CUDRV_FAKE_UNMAP_US=<us>            cuMemUnmap sleeps this long (holding no lock) before it
 *                                      unmaps, as a real unmap of much memory takes a while.
 *  CUDRV_FAKE_FREE_US_PER_GIB=<us>     cuMemFree_v2 of device memory leaves work behind, this long per
 *                                      GiB freed, done one free after another; a cuMemAlloc_v2 that
 *                                      comes before it is done first sleeps 3 ms (holding no lock), as
 *                                      driver 580 makes such an allocation wait 5-7.5 ms.
 *  CUDRV_FAKE_LAUNCH_US=<us>           cuLaunchKernel, cuLaunchCooperativeKernel and cuLaunchKernelEx
 *                                      sleep this long (holding no lock) after they queued (or
 *                                      captured) a launch, before they return: the window between a
 *                                      launch and what its caller does next, widened for tests.
 *  CUDRV_FAKE_DRIVER_VERSION=<v>       cuDriverGetVersion (default 13000; 11010 for the legacy build):
 *                                      a decimal integer 1000 * major + 10 * minor, 1000 to 999999.
 *                                      cuGetProcAddress serves no function introduced after it.
 *  CUDRV_FAKE_FAIL=<fn>:<n>:<code>[,...]  inject CUresult <code> at the n-th call (1-based) of <fn>;
 *                                      "<n>+" means the n-th and every later call. <fn> matches the
 *                                      exported name (cuMemAlloc_v2) or its base name (cuMemAlloc), and
 *                                      must be a function that this library exports. <code> is a
 *                                      non-zero integer (decimal or 0x-hex). At most 32 entries.
 *                                      Calls are counted per entry, thread-safely; the injected error
 *                                      is returned before any other check, with no side effect.
 *  CUDRV_FAKE_REPORT_ON_EXIT=0|1       1: print the leak/violation report to stderr at unload.
 *
 *  Strict: an empty variable is the same as an unset one, but any other invalid value, and any
 *  CUDRV_FAKE_* variable that is not one of the above (or CUDRV_FAKE_CHILD, which cudrv-test-support
 *  sets in its child processes, or CUDRV_FAKE_CFLAGS, which its build script reads), prints one line
 *  to stderr naming the variable, its value and what is accepted, and makes cuInit return
 *  CUDA_ERROR_INVALID_VALUE (1). The rest of the driver then behaves as before cuInit.
 *
 * ==================================================================================================
 * BEHAVIOUR
 * ==================================================================================================
 *  - Before cuInit every call returns CUDA_ERROR_NOT_INITIALIZED (3), except cuDriverGetVersion,
 *    cuGetErrorName, cuGetErrorString and cuGetProcAddress(_v2). After cudrvFakeShutdown() every
 *    call returns CUDA_ERROR_DEINITIALIZED (4).
 *  - Calls that need a context, with none current: CUDA_ERROR_INVALID_CONTEXT (201). Unknown
 *    handles: CUDA_ERROR_INVALID_HANDLE (400); bad values: CUDA_ERROR_INVALID_VALUE (1); bad device
 *    ordinals: CUDA_ERROR_INVALID_DEVICE (101).
 *  - Devices model an H200 (CC 9.0, 132 SMs, ...). Modes: linux (everything supported, concurrent
 *    managed access 1, pool handle type POSIX_FD); wddm (pools supported, TCC_DRIVER 0, concurrent
 *    managed access 0, pool handle types WIN32|WIN32_KMT, kernel exec timeout 1); tcc
 *    (MEMORY_POOLS_SUPPORTED 0, TCC_DRIVER 1, no pool handle types, concurrent managed access 0,
 *    and every pool entry point returns CUDA_ERROR_NOT_SUPPORTED (801)). Every mode has virtual memory
 *    management (attribute 102 reads 1) unless CUDRV_FAKE_VMM=0 or a "-novmm" device entry turns it
 *    off (102 reads 0, and 110, GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, too). Valid attributes that
 *    are not modelled return 0; attribute ids outside [1, CU_DEVICE_ATTRIBUTE_MAX) are INVALID_VALUE.
 *  - Device memory lives in host memory at device addresses 0x7f0000000000 + device * 2^40
 *    (512-byte aligned, 2 MiB aligned for >= 2 MiB). Addresses are handed out next-fit (a freed
 *    range is reused as late as possible); a range held by a pool (cached or in use) is never reused.
 *  - Primary contexts are reference counted; the current context is per thread. When the last
 *    reference is released, the context's work is drained and it becomes inactive (its memory is
 *    NOT freed, so leaks stay visible).
 *  - Streams are asynchronous: each stream (and the legacy stream 0x0/0x1 of each context, and each
 *    per-thread default stream) has a worker thread that runs its operations in order.
 *  - Per-thread default streams (CU_STREAM_PER_THREAD, 0x2): as in the real driver, every host thread
 *    has its own in each context, created at its first use (by any call that takes the handle 0x2
 *    on that thread), with its own worker: work on different threads' per-thread streams runs
 *    concurrently and unordered. An event recorded on 0x2, cuStreamWaitEvent(0x2, ...),
 *    cuStreamSynchronize(0x2) and cuStreamQuery(0x2) mean the calling thread's stream only.
 *    Per-thread streams are blocking streams (flags 0). When a thread exits, its per-thread streams
 *    are released as cuStreamDestroy releases a stream: work already queued still runs (later work
 *    on the legacy stream still waits for it), then the stream is freed (POSIX: a pthread key
 *    destructor; Windows: DllMain's DLL_THREAD_DETACH). A thread that calls the driver again after
 *    that (from a later thread-exit destructor) gets a new per-thread stream, which is not reclaimed.
 *    Per-thread streams are never "live streams" in the report; cudrvFakePerThreadStreams() counts
 *    those whose thread has not exited.
 *  - The legacy stream synchronises with blocking streams as in the real driver: an operation on
 *    the legacy stream waits for all earlier work on every blocking stream of its context (user
 *    streams created without CU_STREAM_NON_BLOCKING, and every thread's per-thread stream), and an
 *    operation on any blocking stream waits for all earlier work on the legacy stream.
 *  - Synchronous APIs (cuMemcpyHtoD_v2, cuMemcpyDtoH_v2, cuMemcpyDtoD_v2, cuMemsetD8_v2,
 *    cuMemsetD32_v2, cuMemcpyPeer) run on the legacy stream and wait for their own completion. cuMemcpyHtoDAsync from pageable memory snapshots the source at the
 *    call (as the real driver stages it); cuMemcpyDtoHAsync to pageable memory is synchronous (as in
 *    the real driver); pinned memory (cuMemHostAlloc / cuMemHostRegister) is accessed when the copy runs.
 *    cuStreamDestroy lets queued work finish, then releases the stream.
 *  - Events: each record bumps a generation; cuStreamWaitEvent captures the record at call time
 *    (waits on never-recorded or completed events are no-ops). Elapsed time is between completion
 *    timestamps; CU_EVENT_DISABLE_TIMING events give INVALID_HANDLE; incomplete events NOT_READY;
 *    never-recorded events INVALID_HANDLE.
 *  - Memory pools (not in tcc mode): a default pool per device plus cuMemPoolCreate pools. An async
 *    allocation gets its address at enqueue time and is live from then on; cuMemFreeAsync returns it
 *    to the pool when the free op runs. Freed blocks stay cached (reserved) until cuMemPoolTrimTo or
 *    until a synchronisation point (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize)
 *    finds reserved > CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (default 0). A cached block is reused by any
 *    stream once its free has run (smallest block that fits). On OUT_OF_MEMORY the pool releases its
 *    cached blocks and retries once. Reservations are rounded to 512 bytes (the real driver reserves
 *    2 MiB chunks).
 *  - Virtual memory management (VMM; where the device has it, see CUDRV_FAKE_VMM): the granularity
 *    (minimum and recommended) is 2 MiB. cuMemAddressReserve reserves a range of virtual addresses
 *    in [0x600000000000, 0x700000000000), shared by all devices (size: a non-zero multiple of 2 MiB;
 *    alignment 0 or a power of two; a free, aligned `addr` hint is honoured; flags 0); it holds no
 *    memory. cuMemCreate makes a physical allocation on prop->location (type PINNED, location type
 *    DEVICE, size a non-zero multiple of 2 MiB, requestedHandleTypes within the device's handle
 *    types: POSIX_FD in linux mode, WIN32|WIN32_KMT otherwise; flags 0): it counts against
 *    CUDRV_FAKE_MEMORY until it is freed, which happens when its handle has been released (once for
 *    cuMemCreate, once more for each cuMemRetainAllocationHandle / cuMemImportFromShareableHandle)
 *    and it is mapped nowhere. cuMemMap (offset 0, flags 0, size a multiple of 2 MiB and at most the
 *    allocation's size, [ptr, ptr + size) inside one reservation and not mapped yet) maps it; a
 *    mapping starts with no access for any device, and cuMemSetAccess gives access (PROT_NONE, READ
 *    or READWRITE, per device, to whole mappings: [ptr, ptr + size) must start at a mapping and be
 *    fully mapped by mappings that lie inside it; cuMemUnmap takes the same kind of range).
 *    cuMemAddressFree needs the exact reserved range, with nothing mapped in it. Export/import: the
 *    shareable handle is a number, not an OS handle (do not close it), that only this process can
 *    import, while the allocation lives. Without VMM: when no device has it, every function of the
 *    family returns 801 whatever its arguments; otherwise cuMemCreate and
 *    cuMemGetAllocationGranularity for a device without it, and cuMemSetAccess naming one, return 801
 *    (virtual addresses are shared by all devices, as in the real driver). The family: cuMemCreate,
 *    cuMemRelease, cuMemMap, cuMemUnmap, cuMemSetAccess, cuMemGetAccess, cuMemAddressReserve,
 *    cuMemAddressFree, cuMemGetAllocationGranularity, cuMemGetAllocationPropertiesFromHandle,
 *    cuMemExportToShareableHandle, cuMemImportFromShareableHandle, cuMemRetainAllocationHandle.
 *  - Access checking: every memset, memcpy and kernel pointer range is checked against the live
 *    allocations AT THE MOMENT THE OP RUNS on its worker. A range not fully inside one live
 *    allocation (device, pool, managed, cuMemHostAlloc or registered memory), or not fully inside
 *    contiguous VMM mappings that give the op's device the access it needs (read for sources, read
 *    and write for destinations), is a violation: it is recorded (op, address, size, stream) and the
 *    op is skipped. So are unmapped and released VMM memory. The host side of HtoD/DtoH copies
 *    is a plain host pointer and is not checked. cuMemFree_v2 frees at once (it does not wait for
 *    queued work), so a queued op that touches the memory is caught as a use after free.
 *  - Modules: cuModuleLoadData(Ex) takes NUL-terminated PTX(-like) text and collects every
 *    ".entry <name>"; each name must be a built-in kernel, else CUDA_ERROR_INVALID_PTX (218) with
 *    "fake ptxas: line N: unknown entry 'name' ..." in CU_JIT_ERROR_LOG_BUFFER (the used size,
 *    including the NUL, is written back to CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES). Text with no
 *    .entry, or with a line containing ".fake_syntax_error", is 218 too. ELF or fatbin images are
 *    CUDA_ERROR_NO_BINARY_FOR_GPU (209).
 *  - Built-in kernels (they behave as grid-stride loops: the result does not depend on the launch
 *    dimensions, which are only validated):
 *      fill_u32(CUdeviceptr out, uint32_t value, uint64_t n)           out[i] = value
 *      add_f32(CUdeviceptr a, CUdeviceptr b, CUdeviceptr out, uint64_t n)  out[i] = a[i] + b[i]
 *      spin_fill_u32(CUdeviceptr out, uint32_t value, uint64_t n, uint64_t spin_us)
 *                                                            sleeps spin_us, then out[i] = value
 *      empty()                                                          nothing
 *      fill_pattern_u8(CUdeviceptr out, uint64_t n, uint64_t seed)
 *            out[i] = (uint8_t)((seed * 2654435761 + i * 31) >> 3)   (wrapping uint64 arithmetic)
 *    Parameters come through kernelParams (each entry points at the value) or through extra
 *    (CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE / _END, natural C alignment: offsets 0, 8, 16, 24).
 *  - cuGetProcAddress(_v2) takes the base name ("cuMemAlloc") and returns the newest variant whose
 *    introduction version is <= min(cudaVersion, driver version). Variants: see PROC_TABLE. Per-thread
 *    stream flags are accepted but the legacy-stream variants are served (no _ptsz/_ptds exports).
 *    Note, as in the real driver, cuCtxSynchronize / cuCtxGetDevice at >= 13000 give the _v2 ABI
 *    (with a CUcontext argument), cuStreamGetCtx at >= 12050 gives cuStreamGetCtx_v2.
 *  - Built with -DCUDRV_FAKE_LEGACY_EXPORTS=<v>, only functions that existed in CUDA <v> are exported.
 *
 * ==================================================================================================
 * GRAPHS AND STREAM CAPTURE (fake_graph.c, #included below; its header has the details)
 * ==================================================================================================
 *  - Exported: cuStreamBeginCapture(_v2), cuStreamEndCapture, cuStreamIsCapturing,
 *    cuStreamGetCaptureInfo(_v2, _v3), cuThreadExchangeStreamCaptureMode; cuGraphCreate, Destroy,
 *    Clone, GetNodes, GetRootNodes, NodeGetType; cuGraphAdd{Empty,Kernel(_v2),Memcpy,Memset,Host,
 *    EventRecord,EventWait,ChildGraph,MemAlloc,MemFree}Node, cuGraphKernelNodeSetParams(_v2);
 *    cuGraphInstantiate(_v2), cuGraphInstantiateWithFlags/WithParams, cuGraphExecDestroy,
 *    cuGraphLaunch, cuGraphUpload, cuGraphExecUpdate(_v2), cuGraphExecKernelNodeSetParams(_v2);
 *    cuDeviceGetGraphMemAttribute, cuDeviceSetGraphMemAttribute, cuDeviceGraphMemTrim. Nothing else
 *    of the graph API (cuGetProcAddress does not find it).
 *  - Capture: every op queued on a capturing stream (enqueue_locked) becomes a node depending on
 *    the stream's capture dependencies instead of running: kernels, memsets, copies, host
 *    functions; cuMemAllocAsync / cuMemFreeAsync give memory alloc / free nodes (not in tcc mode),
 *    cuGraphLaunch a child graph node. As in the real driver, cuEventRecord in a capture makes no
 *    node: cuStreamWaitEvent with that event makes another stream join the capture (or joins it
 *    back). Errors as in cuda.h: 900 (sync/query of a capturing stream, unsafe calls prohibited by
 *    the capture mode: synchronous copies/memsets, cuCtxSynchronize, cuEventQuery/Synchronize,
 *    cuMemAllocPitch, cuMemAllocManaged),
 *    901 (work on an invalidated capture, ending it), 902/905 (waits that merge captures or cross
 *    the capture boundary), 903, 904 (unjoined work), 906 (legacy-stream work while a blocking
 *    stream captures), 907 (query of an event recorded in a capture), 908, 401 (begin while
 *    capturing, end while not). Call-time capture errors are checked by cuLaunchKernel(Ex),
 *    cuLaunchCooperativeKernel, cuLaunchHostFunc, the 1D, 2D and 3D memsets and copies, cuEventRecord,
 *    cuStreamWaitEvent, cuMemAllocAsync, cuMemFreeAsync and cuGraphLaunch.
 *  - Launch: an executable graph's nodes are queued on the stream in creation order (a topological
 *    order), as the ops their stream APIs make; launches of one executable graph are ordered across
 *    streams. Graph memory keeps its address for the graph's life (no reuse across launches;
 *    AUTO_FREE_ON_LAUNCH has nothing to do) and counts as a live allocation meanwhile.
 *  - cudrvFakeLiveGraphs / cudrvFakeLiveGraphExecs count graphs and executable graphs with a live
 *    handle; CUDRV_FAKE_REPORT_ON_EXIT prints them on a second report line.
 *
 * ==================================================================================================
 * API EXTENSIONS (the "API extensions" section below)
 * ==================================================================================================
 *  - JIT options (cuModuleLoadDataEx, cuLinkCreate, cuLibraryLoadData) are checked: MAX_REGISTERS
 *    1..255, OPTIMIZATION_LEVEL 0..4, TARGET a CUjit_target of cuda.h 13.0, FALLBACK_STRATEGY 0/1,
 *    CACHE_MODE 0..2, any other option below CU_JIT_NUM_OPTIONS accepted; anything else is
 *    CUDA_ERROR_INVALID_VALUE before the image is looked at. The information log names the options
 *    that change code ("fake ptxas: 5 entries compiled (max registers 32, optimisation level 3, ...)");
 *    CU_JIT_WALL_TIME gets 0.25 ms (a float in the slot); a module compiled with MAX_REGISTERS r < 16
 *    reports NUM_REGS r (16 otherwise); a TARGET newer than sm_90 (or an 'a'/'f' one other than 90)
 *    is CUDA_ERROR_NO_BINARY_FOR_GPU with "cannot run on the device" in the error log.
 *  - Linker (cuLinkCreate_v2, AddData_v2, AddFile_v2, Complete, Destroy): PTX inputs are compiled
 *    (errors: 218 with "<name>: fake ptxas: ..." in the error log); CUBIN, FATBINARY, OBJECT and
 *    LIBRARY inputs must be images of the fake linker (else 209). Entries are merged; one defined
 *    twice makes cuLinkComplete fail with CUDA_ERROR_INVALID_IMAGE and "duplicate definition of
 *    'x' in <name>". The linked image is a 64-byte ELF header marked "FKLINK" followed by the text
 *    ".entry <name>
..." and a NUL: cuModuleLoadData(Ex) and cuLibraryLoadData load it, and the
 *    linker links it again. The logs go through the option arrays given to cuLinkCreate (kept until
 *    cuLinkDestroy, as the real driver keeps them), with the buffers' sizes as given there.
 *    cuLinkAddFile reads the file (CUDA_ERROR_FILE_NOT_FOUND, 301, if it cannot).
 *  - Libraries (cuLibraryLoadData, Unload, GetKernel, cuKernelGetFunction, cuKernelGetName,
 *    cuLibraryGetKernelCount, EnumerateKernels): no context needed to load; cuKernelGetFunction
 *    loads the library's code into the current context at its first use there. A library counts as
 *    one live module in the report; its code in each context does not.
 *  - cuLaunchKernelEx checks PROGRAMMATIC_STREAM_SERIALIZATION (0/1), MEM_SYNC_DOMAIN (0/1),
 *    ACCESS_POLICY_WINDOW (num_bytes <= attribute 109, hitRatio in [0, 1], properties 0..2) and
 *    PREFERRED_CLUSTER_DIMENSION (needs CLUSTER_DIMENSION; a multiple of it that divides the grid);
 *    PRIORITY is taken as given. Work still runs in stream order (a valid schedule of programmatic
 *    dependent launch). Every successful launch is recorded (cudrvFakeLastLaunch: grid, block,
 *    shared memory, cooperative, cluster, preferred cluster, PSS, priority, domain, window, API).
 *    cuOccupancyMaxActiveClusters: blocks per SM (as cuOccupancyMaxActiveBlocksPerMultiprocessor)
 *    * 132 / cluster size (0 above 8 blocks, or 16 with NON_PORTABLE_CLUSTER_SIZE_ALLOWED; without a
 *    cluster size: CUDA_ERROR_INVALID_VALUE); cuOccupancyMaxPotentialClusterSize: 8, or 16 when
 *    allowed.
 *  - Pitched memory: cuMemAllocPitch_v2 (ElementSizeBytes 4, 8 or 16) rounds the pitch to 512
 *    bytes. cuMemcpy2DAsync_v2 / cuMemcpy3DAsync_v2 copy between host and device memory (CUDA
 *    arrays are not emulated: 1), pitches at least the width; device sides are access-checked over
 *    their whole span when the op runs; a pageable host source is staged at the call, a pageable
 *    host destination makes the copy synchronous. cuMemsetD2D8/16/32 (_v2: legacy stream, waits;
 *    Async) fill `Height` rows of `Width` elements, `dstPitch` apart (address and pitch aligned to
 *    the element size).
 *  - Managed memory: cuMemAdvise / _v2 and cuMemPrefetchAsync / _v2 take a range inside one
 *    managed allocation (1 otherwise); advice is kept per allocation (not per page) and read back
 *    by cuMemRangeGetAttribute (READ_MOSTLY, PREFERRED_LOCATION, ACCESSED_BY,
 *    LAST_PREFETCH_LOCATION, in the int encoding: device, -1 host, -2 none). A prefetch is an op of
 *    its stream (access-checked) that sets the last prefetch location when it runs; it needs
 *    concurrent managed access (linux mode) on the target and the stream's device, else
 *    CUDA_ERROR_INVALID_DEVICE.
 *  - cuPointerGetAttribute: CONTEXT, MEMORY_TYPE, DEVICE_POINTER, HOST_POINTER, IS_MANAGED,
 *    DEVICE_ORDINAL, IS_LEGACY_CUDA_IPC_CAPABLE (cuMemAlloc memory only), RANGE_START_ADDR,
 *    RANGE_SIZE, MAPPED, ALLOWED_HANDLE_TYPES (the pool's or the physical allocation's),
 *    MEMPOOL_HANDLE; a pointer in no allocation is 1. cuMemGetAddressRange_v2: the allocation's
 *    base and size (CUDA_ERROR_NOT_FOUND, 500, outside every allocation).
 *  - IPC (linux mode only: 801 elsewhere, as IPC_EVENT_SUPPORTED is 0 there) works across processes:
 *    exporting device memory moves the allocation's backing into shared memory (a file in $TMPDIR,
 *    or /tmp, mapped MAP_SHARED; a named file mapping on Windows), keeping its contents. Legacy:
 *    cuIpcGetMemHandle takes the base of a cuMemAlloc allocation (pool memory: 1);
 *    cuIpcOpenMemHandle_v2 maps it at a new address of the current device (flags 0 or
 *    LAZY_ENABLE_PEER_ACCESS; a handle of the same process: CUDA_ERROR_INVALID_CONTEXT, 201; memory
 *    already freed: 400), as a live allocation until cuIpcCloseMemHandle (cuMemFree refuses it).
 *    Events created with CU_EVENT_INTERPROCESS keep their records in shared memory (tickets and the
 *    highest completed); cuIpcOpenEventHandle opens them in another process, where
 *    cuStreamWaitEvent queues an op that waits for the exporter's completed records,
 *    cuEventSynchronize and cuEventQuery poll them, and cuEventRecord adds records of its own.
 *    Pools: cuMemPoolExportToShareableHandle needs the type among the pool's handleTypes and
 *    writes a number (not an OS handle: do not close it) that any process can import;
 *    cuMemPoolImportFromShareableHandle makes an imported pool (no allocations of its own: 1);
 *    cuMemPoolExportPointer takes a live allocation of a pool with handle types;
 *    cuMemPoolImportPointer (into an imported pool, from another process) maps it, freed with
 *    cuMemFree(Async).
 *
 * ==================================================================================================
 * DELIBERATE DEVIATIONS FROM THE REAL DRIVER
 * ==================================================================================================
 *  - Errors of asynchronous work (bad pointers) are recorded as violations and the op is skipped; the
 *    call that enqueued it returned CUDA_SUCCESS and no sticky CUDA_ERROR_ILLEGAL_ADDRESS follows.
 *  - cuMemFree_v2 does not synchronise (the real one does, implicitly); this is what catches queued
 *    use-after-free. cuMemsetD8_v2/cuMemsetD32_v2/cuMemcpyDtoD_v2 wait for completion (real: may
 *    return early for device memory).
 *  - Only the variants listed in PROC_TABLE exist: no 32-bit-size v1 ABIs (cuMemAlloc@2000, ...)
 *    and no _ptds/_ptsz variants (per-thread flags of cuGetProcAddress are accepted and ignored).
 *  - VMM: cuMemUnmap does not wait for queued work (as cuMemFree_v2 here), so queued work on unmapped
 *    memory is caught; cuMemAddressFree refuses a range that still has mappings
 *    (CUDA_ERROR_INVALID_VALUE; the real driver does not document this case); shareable handles are
 *    numbers that only this process can import, not OS handles; cuMemMap takes only offset 0 (as the
 *    real driver documents) and no partial cuMemSetAccess / cuMemUnmap of a mapping.
 *  - cuMemFreeAsync also accepts cuMemAlloc memory (freed when the op runs). cuMemFree_v2 of a pool
 *    allocation returns it to its pool at once. Pool reuse is opportunistic across streams once the
 *    free has run; reservations are 512-byte granular.
 *  - Releasing the last primary-context reference drains its streams but frees nothing (leaks stay
 *    visible in the report).
 *  - Kernel launch dimensions are validated but do not change the result (grid-stride semantics).
 *  - API extensions: launch attributes change nothing but the record (programmatic dependent launch
 *    never overlaps kernels); managed-memory advice is per allocation, not per page; an imported IPC
 *    mapping reserves device addresses that count against CUDRV_FAKE_MEMORY; the linker and
 *    libraries link and load only PTX and the fake linker's own images; exported pool handles are
 *    numbers, not file descriptors or NT handles.
 *
 * Fake-only exports: cudrvFakeReport, cudrvFakeViolation, cudrvFakeResetViolations, cudrvFakeShutdown,
 * cudrvFakePerThreadStreams, cudrvFakeLiveGraphs, cudrvFakeLiveGraphExecs (fake_graph.c),
 * cudrvFakeLastLaunch (the record of the last successful launch: struct CudrvFakeLaunch),
 * cudrvFakeFaultsInjected (how many calls CUDRV_FAKE_FAIL has failed so far),
 * cudrvFakeHostFnDriverCalls (how many driver calls were made from inside host functions, where
 * the real driver forbids them; each is also recorded as a violation).
 * cudrvFakeReport first waits until every stream is idle. Its
 * live_allocations also counts VMM physical allocations (until freed, see above, with their bytes)
 * and address reservations (until cuMemAddressFree; they add no bytes).
 */

#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------------ */
/* Portability layer                                                                                 */
/* ------------------------------------------------------------------------------------------------ */
#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
typedef SRWLOCK fk_mutex;
typedef CONDITION_VARIABLE fk_cond;
#define FK_MUTEX_INIT SRWLOCK_INIT
#define FK_COND_INIT CONDITION_VARIABLE_INIT
static void fk_lock(fk_mutex *m) { AcquireSRWLockExclusive(m); }
static void fk_unlock(fk_mutex *m) { ReleaseSRWLockExclusive(m); }
static void fk_wait(fk_cond *c, fk_mutex *m) { SleepConditionVariableSRW(c, m, INFINITE, 0); }
static void fk_broadcast(fk_cond *c) { WakeAllConditionVariable(c); }
static void fk_sleep_us(uint64_t us) {
    if (us) Sleep((DWORD)((us + 999) / 1000));
}
static double fk_now_ms(void) {
    LARGE_INTEGER f, c;
    QueryPerformanceFrequency(&f);
    QueryPerformanceCounter(&c);
    return (double)c.QuadPart * 1000.0 / (double)f.QuadPart;
}
#define FK_EXPORT __declspec(dllexport)
#define CUDAAPI __stdcall
#define CUDA_CB __stdcall
#else
#include <pthread.h>
#include <time.h>
typedef pthread_mutex_t fk_mutex;
typedef pthread_cond_t fk_cond;
#define FK_MUTEX_INIT PTHREAD_MUTEX_INITIALIZER
#define FK_COND_INIT PTHREAD_COND_INITIALIZER
static void fk_lock(fk_mutex *m) { pthread_mutex_lock(m); }
static void fk_unlock(fk_mutex *m) { pthread_mutex_unlock(m); }
static void fk_wait(fk_cond *c, fk_mutex *m) { pthread_cond_wait(c, m); }
static void fk_broadcast(fk_cond *c) { pthread_cond_broadcast(c); }
static void fk_sleep_us(uint64_t us) {
    struct timespec ts;
    if (!us) return;
    ts.tv_sec = (time_t)(us / 1000000u);
    ts.tv_nsec = (long)((us % 1000000u) * 1000u);
    while (nanosleep(&ts, &ts) != 0) {
    }
}
static double fk_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}
#define FK_EXPORT __attribute__((visibility("default")))
#define CUDAAPI
#define CUDA_CB
#endif

#if defined(__GNUC__)
#define FK_UNUSED __attribute__((unused))
#else
#define FK_UNUSED
#endif

/* Exports are gated on the version that introduced them (legacy build). */
#ifdef CUDRV_FAKE_LEGACY_EXPORTS
#define FK_EXPORT_LIMIT CUDRV_FAKE_LEGACY_EXPORTS
#define FK_DEFAULT_DRIVER_VERSION CUDRV_FAKE_LEGACY_EXPORTS
#else
#define FK_EXPORT_LIMIT 1000000
#define FK_DEFAULT_DRIVER_VERSION 13000
#endif
#define FK_API FK_EXPORT CUresult CUDAAPI
#define FK_HIDDEN static FK_UNUSED CUresult CUDAAPI
#if FK_EXPORT_LIMIT >= 11000
#define API_11000 FK_API
#else
#define API_11000 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 11020
#define API_11020 FK_API
#else
#define API_11020 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 11030
#define API_11030 FK_API
#else
#define API_11030 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 11040
#define API_11040 FK_API
#else
#define API_11040 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 11060
#define API_11060 FK_API
#else
#define API_11060 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 12000
#define API_12000 FK_API
#else
#define API_12000 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 12050
#define API_12050 FK_API
#else
#define API_12050 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 12080
#define API_12080 FK_API
#else
#define API_12080 FK_HIDDEN
#endif
#if FK_EXPORT_LIMIT >= 13000
#define API_13000 FK_API
#else
#define API_13000 FK_HIDDEN
#endif
/* Everything else used here predates CUDA 11.0 (the VMM functions are from 10.2). */
#define API_OLD FK_API

/* ------------------------------------------------------------------------------------------------ */
/* CUDA ABI (copied from cuda.h, CUDA 13.0)                                                          */
/* ------------------------------------------------------------------------------------------------ */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef struct fk_ctx *CUcontext;
typedef struct fk_stream *CUstream;
typedef struct fk_event *CUevent;
typedef struct fk_module *CUmodule;
typedef struct fk_func *CUfunction;
typedef struct fk_pool *CUmemoryPool;
typedef void *CUgreenCtx;
typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;
typedef void(CUDA_CB *CUhostFn)(void *userData);
typedef size_t(CUDA_CB *CUoccupancyB2DSize)(int blockSize);
typedef int CUjit_option;
typedef int CUdriverProcAddressQueryResult;

typedef struct CUmemLocation_st {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;
typedef struct CUmemPoolProps_st {
    int allocType;   /* CUmemAllocationType */
    int handleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;
typedef union CUlaunchAttributeValue_union {
    char pad[64];
    void *align_;
    struct {
        void *base_ptr;
        size_t num_bytes;
        float hitRatio;
        int hitProp, missProp; /* CUaccessProperty */
    } accessPolicyWindow;
    int cooperative;
    struct {
        unsigned int x, y, z;
    } clusterDim;
    int programmaticStreamSerializationAllowed;
    int priority;
    int memSyncDomain; /* CUlaunchMemSyncDomain */
    struct {
        unsigned int x, y, z;
    } preferredClusterDim;
} CUlaunchAttributeValue;
typedef struct CUlaunchAttribute_st {
    int id; /* CUlaunchAttributeID */
    char pad[8 - sizeof(int)];
    CUlaunchAttributeValue value;
} CUlaunchAttribute;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps layout");
_Static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
_Static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig layout");

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_INVALID_SOURCE = 300,
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND = 302,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999
};

enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
};
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_BLOCKING_SYNC 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_EVENT_INTERPROCESS 0x4
#define CU_MEMHOSTALLOC_ALL 0x7
#define CU_MEMHOSTREGISTER_ALL 0xF
#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_MEM_ATTACH_HOST 0x2
#define CU_JIT_INFO_LOG_BUFFER 3
#define CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES 4
#define CU_JIT_ERROR_LOG_BUFFER 5
#define CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES 6
#define CU_LAUNCH_PARAM_END ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define CU_LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)
#define CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW 1
#define CU_LAUNCH_ATTRIBUTE_COOPERATIVE 2
#define CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION 4
#define CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6
#define CU_LAUNCH_ATTRIBUTE_PRIORITY 8
#define CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN 10
#define CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION 11
#define CU_LAUNCH_ATTRIBUTE_MAX_KNOWN 16
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define CU_MEM_HANDLE_TYPE_WIN32 0x2
#define CU_MEM_HANDLE_TYPE_WIN32_KMT 0x4
#define CU_MEM_ACCESS_FLAGS_PROT_NONE 0x0
#define CU_MEM_ACCESS_FLAGS_PROT_READ 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
enum {
    CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1,
    CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
    CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    CU_MEMPOOL_ATTR_USED_MEM_HIGH
};
enum {
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2,
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
    CU_FUNC_ATTRIBUTE_PTX_VERSION = 5,
    CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6,
    CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7,
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9,
    CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET = 10,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH = 11,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT = 12,
    CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH = 13,
    CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14,
    CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15,
    CU_FUNC_ATTRIBUTE_MAX_ = 16
};
#define CU_DEVICE_ATTRIBUTE_MAX 148

/* ------------------------------------------------------------------------------------------------ */
/* Model constants                                                                                   */
/* ------------------------------------------------------------------------------------------------ */
#define FK_MAX_DEVICES 16
#define FK_SM_COUNT 132
#define FK_SMEM_OPTIN 232448
#define FK_SMEM_DEFAULT 49152
#define FK_SMEM_PER_SM 233472
#define FK_DEV_BASE 0x7f0000000000ULL
#define FK_DEV_SPAN (1ULL << 40)
#define FK_MAGIC_STREAM 0x5354524dU
#define FK_MAGIC_EVENT 0x45564e54U
#define FK_MAGIC_MODULE 0x4d4f444cU
#define FK_MAGIC_FUNC 0x46554e43U
#define FK_MAGIC_POOL 0x504f4f4cU
#define FK_MAGIC_CTX 0x43545854U
#define FK_MAX_VIOLATIONS 4096

enum { MODE_LINUX = 0, MODE_WDDM = 1, MODE_TCC = 2 };
static const char *const MODE_NAMES[] = {"linux", "wddm", "tcc"};

/* ------------------------------------------------------------------------------------------------ */
/* Small vector of pointers                                                                          */
/* ------------------------------------------------------------------------------------------------ */
typedef struct {
    void **v;
    size_t n, cap;
} fk_vec;

static void vec_push(fk_vec *a, void *p) {
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        void **nv = (void **)realloc(a->v, nc * sizeof(void *));
        if (!nv) abort();
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = p;
}
static void vec_insert(fk_vec *a, size_t i, void *p) {
    vec_push(a, p);
    memmove(&a->v[i + 1], &a->v[i], (a->n - 1 - i) * sizeof(void *));
    a->v[i] = p;
}
static void vec_remove_at(fk_vec *a, size_t i) {
    memmove(&a->v[i], &a->v[i + 1], (a->n - 1 - i) * sizeof(void *));
    a->n--;
}
static int vec_find(const fk_vec *a, const void *p) {
    size_t i;
    for (i = 0; i < a->n; i++)
        if (a->v[i] == p) return (int)i;
    return -1;
}
static int vec_remove(fk_vec *a, const void *p) {
    int i = vec_find(a, p);
    if (i >= 0) vec_remove_at(a, (size_t)i);
    return i >= 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* State                                                                                             */
/* ------------------------------------------------------------------------------------------------ */
enum { AK_DEVICE, AK_POOL, AK_MANAGED, AK_HOSTALLOC, AK_REGISTERED, AK_MAPPED, AK_IPC };

/* An address range with its backing host memory. */
typedef struct fk_block {
    uint64_t base, size;
    int dev; /* -1 for host blocks */
    unsigned char *backing;
    int owns_backing; /* 1: calloc'd lazily by us; 2: aligned host alloc by us; 0: user memory;
                         3: shared memory we made (IPC export); 4: shared memory we opened (import) */
    int pins;
    int dead;
    struct fk_shm *shm; /* owns_backing 3 and 4 */
} fk_block;

struct fk_pool;
struct fk_phys;
/* A live allocation, as the user sees it; or (AK_MAPPED, in G.mtab) one cuMemMap mapping. */
typedef struct fk_alloc {
    uint64_t base, size;
    int kind;
    int dev;
    fk_block *blk;
    uint64_t boff; /* offset of `base` in blk's backing (non-zero only for mappings) */
    struct fk_pool *pool;
    int free_pending;
    struct fk_phys *phys;                 /* AK_MAPPED: the physical allocation mapped */
    unsigned char access[FK_MAX_DEVICES]; /* AK_MAPPED: CU_MEM_ACCESS_FLAGS_PROT_* per device */
    int ipc;                              /* AK_IPC: 1 legacy (cuIpcOpenMemHandle), 2 pool import */
    /* AK_MANAGED advice, as location + 2 (0: none, 1: the host, d + 2: device d) */
    int adv_read_mostly, adv_pref, adv_last_prefetch;
    unsigned adv_accessed; /* bit d: device d; bit 31: the host */
} fk_alloc;

/* A VMM physical allocation (cuMemCreate). Its backing is `blk` (dev -1: no device range). */
typedef struct fk_phys {
    uint64_t handle; /* the CUmemGenericAllocationHandle, never reused */
    int dev;
    uint64_t size;
    int handle_types;
    unsigned char alloc_flags[8]; /* CUmemAllocationProp.allocFlags, as given */
    fk_block *blk;
    int handle_refs; /* unreleased handles: cuMemCreate, Retain, Import */
    int maps;        /* mappings */
    uint64_t shared; /* the shareable handle handed out by cuMemExportToShareableHandle, or 0 */
} fk_phys;

/* A cuMemAddressReserve range. */
typedef struct fk_vres {
    uint64_t base, size;
} fk_vres;

typedef struct fk_pool {
    uint32_t magic;
    int dev;
    int is_default;
    int destroyed;
    uint64_t threshold, reserved, reserved_high, used, used_high, max_size;
    int reuse[3];
    int access[FK_MAX_DEVICES];
    int live;
    fk_vec cached; /* fk_block* */
    int handle_types; /* CUmemPoolProps::handleTypes */
    int imported;     /* cuMemPoolImportFromShareableHandle: no allocations of its own */
} fk_pool;

enum { OP_MEMSET, OP_COPY, OP_RECORD, OP_WAIT, OP_HOSTFN, OP_FREE, OP_KERNEL };
/* Ops of the API extensions (pitched copies and memsets, prefetches, waits on events of another
   process), past the others so that the numbers above stay as they are. */
enum { OP_REGION = 100, OP_MEMSET2D, OP_PREFETCH, OP_IPC_WAIT };
enum { CP_HTOD, CP_DTOH, CP_DTOD };
enum { K_FILL_U32, K_ADD_F32, K_SPIN_FILL_U32, K_EMPTY, K_FILL_PATTERN_U8, K_COUNT };

struct fk_stream;
typedef struct fk_op {
    struct fk_op *next;
    int kind;
    const char *api;
    uint64_t seq;
    /* memset / copy */
    uint64_t dst, src;
    size_t count; /* elements */
    int elem;     /* element size */
    uint32_t value;
    int cpkind;
    int src_snapshot;   /* src is a malloc'd snapshot (host) owned by the op */
    int dst_host_unchk; /* DtoH host side */
    /* record / wait */
    struct fk_event *ev;
    uint64_t gen;
    struct fk_stream *ws;
    uint64_t wseq;
    /* host fn */
    CUhostFn fn;
    void *ud;
    /* free */
    fk_alloc *fa;
    /* kernel */
    int kernel;
    uint64_t kp[4];
    uint32_t kval;
    /* OP_REGION (2D/3D copy), OP_MEMSET2D: memory type (1 host, 2 device), pitch and rows per slice
       of each side (dst, src above are the first bytes), bytes per row, rows per slice, slices */
    int dmt, smt;
    size_t dpitch, spitch, dheight, sheight, wbytes, rows, depth;
    /* OP_RECORD of an interprocess event: its ticket; OP_IPC_WAIT: the ticket waited for */
    uint64_t ipc_ticket;
    /* OP_PREFETCH: the managed allocation's base, and the location + 2 */
    int prefetch_loc;
} fk_op;

enum { SK_USER, SK_LEGACY, SK_PTDS };
typedef struct fk_stream {
    uint32_t magic;
    struct fk_ctx *ctx;
    unsigned flags;
    int priority;
    int kind;
    fk_op *head, *tail;
    uint64_t enqueued, completed;
    int destroyed;
    int started;
    int refs;
    uint64_t thread_no; /* SK_PTDS: which thread's (1, 2, ... in order of first use) */
} fk_stream;

typedef struct fk_event {
    uint32_t magic;
    struct fk_ctx *ctx;
    unsigned flags;
    fk_stream *rs;
    uint64_t rseq;
    uint64_t gen;
    int recorded;
    double t_ms;
    int t_valid;
    int refs;
    struct fk_ipc_event *ipc; /* CU_EVENT_INTERPROCESS events, and events opened from a handle */
} fk_event;

typedef struct fk_func {
    uint32_t magic;
    struct fk_module *mod;
    int kernel;
    int max_dyn_smem;
    int carveout;
    int cluster[3];
    int nonportable;
    int sched;
} fk_func;

typedef struct fk_module {
    uint32_t magic;
    struct fk_ctx *ctx;
    int nfuncs;
    fk_func funcs[K_COUNT];
    int max_regs;            /* CU_JIT_MAX_REGISTERS of the load (0: none) */
    struct fk_library *lib;  /* a library's code in a context (not counted as a module) */
} fk_module;

typedef struct fk_ctx {
    uint32_t magic;
    int dev;
    int refs;
    int active;
    unsigned flags;
    unsigned peers; /* bitmask of devices with peer access enabled */
    fk_stream *legacy;
} fk_ctx;

typedef struct {
    int mode;
    int vmm; /* virtual memory management supported */
    uint64_t limit, reserved;
    uint64_t cursor;
    fk_vec ranges; /* fk_block*, sorted by base */
    fk_ctx ctx;
    fk_pool *default_pool, *cur_pool;
} fk_device;

typedef struct {
    char name[64];
    uint64_t n;
    int plus;
    int code;
    uint64_t calls;
    uint64_t injected;
} fk_fault;

static struct {
    fk_mutex lock;
    fk_cond cv;
    int envread;
    int initialized;
    int shutdown;
    int ndev;
    fk_device dev[FK_MAX_DEVICES];
    uint64_t delay_us;
    uint64_t unmap_us;
    uint64_t free_us_per_gib;
    double free_backlog_ms; /* when the work that device frees left behind is done (fk_now_ms) */
    uint64_t launch_us;
    int driver_version;
    int report_on_exit;
    fk_fault faults[32];
    int nfaults;
    fk_vec dtab;        /* fk_alloc*, device + pool allocations, sorted */
    fk_vec htab;        /* fk_alloc*, managed + host allocations, sorted */
    fk_vec streams;     /* user streams with a live handle */
    fk_vec all_streams; /* every stream struct still alive (for draining) */
    fk_vec events, modules, pools;
    fk_vec mtab;  /* fk_alloc* (AK_MAPPED), VMM mappings, sorted */
    fk_vec vres;  /* fk_vres*, address reservations, sorted */
    fk_vec phys;  /* fk_phys*, live physical allocations */
    uint64_t vcursor, next_handle, next_shared;
    uint64_t ptds_threads; /* per-thread streams made so far */
    uint64_t ptds_live;    /* per-thread streams whose thread has not exited */
    int config_error;
    char *violations[FK_MAX_VIOLATIONS];
    uint64_t nviolations;
} G = {.lock = FK_MUTEX_INIT, .cv = FK_COND_INIT};

static _Thread_local fk_ctx *tl_ctx;

/* ------------------------------------------------------------------------------------------------ */
/* API extensions: declarations (the code is in the "API extensions" section further down)          */
/* ------------------------------------------------------------------------------------------------ */
#include <stdatomic.h>
#ifndef _WIN32
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

/* A shared-memory mapping, for IPC: a file in the temporary directory, mapped MAP_SHARED (POSIX),
   or a named file mapping in the session's namespace (Windows). */
typedef struct fk_shm {
    char name[40];
    void *p;
    uint64_t size;
    int owner; /* made here: removed when released */
#ifdef _WIN32
    HANDLE h;
#endif
} fk_shm;

/* The shared state of an interprocess event: record tickets handed out, and the highest completed. */
typedef struct {
    _Atomic uint64_t recorded, completed;
} fk_ipc_shared;
typedef struct fk_ipc_event {
    fk_shm *shm;  /* an fk_ipc_shared */
    int imported; /* opened from another process's handle */
} fk_ipc_event;

/* JIT options of a load or link, checked (see jit_options). */
typedef struct {
    int max_regs, opt_level, target, fallback, line_info, debug_info, cache_mode;
    long wall_time_at; /* index of CU_JIT_WALL_TIME, or -1 */
    char desc[192];    /* the options, for the information log */
} fk_jit;

/* What the last successful launch asked for (cudrvFakeLastLaunch). */
struct CudrvFakeLaunch {
    uint64_t launches; /* successful launches so far */
    uint32_t grid[3], block[3];
    uint32_t shared_mem_bytes;
    int32_t cooperative;
    uint32_t cluster[3];           /* 0, 0, 0: no cluster dimension */
    uint32_t preferred_cluster[3]; /* 0, 0, 0: none */
    int32_t programmatic_stream_serialization;
    int32_t has_priority, priority;
    int32_t mem_sync_domain; /* -1: not set */
    int32_t has_access_policy_window;
    int32_t apw_hit, apw_miss;
    float apw_hit_ratio;
    uint64_t apw_base, apw_bytes;
    char api[32];
};

static struct {
    fk_vec libraries, links;
    uint64_t shm_serial, shared_serial;
    struct CudrvFakeLaunch last;
} GX; /* state of the API extensions, under G.lock */

/* The configuration of the cuLaunchKernelEx call in progress on this thread (for the record). */
static _Thread_local const struct CUlaunchConfig_st *tl_launch_config;

static void shm_release(fk_shm *s);
static fk_ipc_event *ipc_event_new(void);
static void ipc_event_free(fk_ipc_event *ie);
static uint64_t ipc_event_ticket(fk_event *e);
static void ipc_event_complete(fk_event *e, uint64_t ticket);
static int ipc_event_done(const fk_event *e);
static void run_ext_op(struct fk_op *op, fk_stream *s);
static void push_ipc_wait_locked(fk_stream *s, fk_event *e);
static void record_launch_locked(const char *api, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned smem, int cooperative, const unsigned *cluster);
static int is_fake_image(const unsigned char *u);
#define FK_IMAGE_HEADER 64

/* ------------------------------------------------------------------------------------------------ */
/* Initialisation, entry checks, fault injection                                                     */
/* ------------------------------------------------------------------------------------------------ */
static int known_function_name(const char *name);

/* Every CUDRV_FAKE_* variable that may be set. */
static const char *const KNOWN_VARS[] = {
    "CUDRV_FAKE_MODE", "CUDRV_FAKE_DEVICES", "CUDRV_FAKE_VMM", "CUDRV_FAKE_MEMORY", "CUDRV_FAKE_DELAY_US",
    "CUDRV_FAKE_UNMAP_US", "CUDRV_FAKE_FREE_US_PER_GIB", "CUDRV_FAKE_LAUNCH_US", "CUDRV_FAKE_DRIVER_VERSION",
    "CUDRV_FAKE_FAIL", "CUDRV_FAKE_REPORT_ON_EXIT",
    /* not read here: cudrv-test-support sets the first in its child processes, and its build
       script reads the second */
    "CUDRV_FAKE_CHILD", "CUDRV_FAKE_CFLAGS",
};
#define FK_VAR_PREFIX "CUDRV_FAKE_"

/* Reports an invalid configuration variable (lock held): one line on stderr, and cuInit fails. */
static void config_error(const char *var, const char *value, const char *accepted) {
    fprintf(stderr,
            "cudrv fake driver: invalid %s=\"%s\": expected %s (cuInit returns CUDA_ERROR_INVALID_VALUE)\n",
            var, value, accepted);
    G.config_error = 1;
}

/* Exact mode names; -1 if `s` (of `len` bytes) is none. */
static int parse_mode(const char *s, size_t len) {
    int m;
    for (m = 0; m < (int)(sizeof MODE_NAMES / sizeof MODE_NAMES[0]); m++)
        if (strlen(MODE_NAMES[m]) == len && !strncmp(s, MODE_NAMES[m], len)) return m;
    return -1;
}

/* A whole unsigned integer (decimal, 0x-hex or 0-octal, as strtoull with base 0), no sign, no
   spaces, no overflow. */
static int parse_u64(const char *s, uint64_t *out) {
    char *end;
    unsigned long long v;
    if (!(*s >= '0' && *s <= '9')) return 0;
    errno = 0;
    v = strtoull(s, &end, 0);
    if (errno || *end) return 0;
    *out = (uint64_t)v;
    return 1;
}

/* One CUDRV_FAKE_DEVICES entry: <mode>[-novmm|-vmm], spaces around it ignored. vmm: -1 when the
   entry does not say. */
static int parse_device_entry(const char *s, size_t len, int *mode, int *vmm) {
    const char *dash;
    while (len && *s == ' ') s++, len--;
    while (len && s[len - 1] == ' ') len--;
    dash = (const char *)memchr(s, '-', len);
    *vmm = -1;
    if (dash) {
        size_t rest = len - (size_t)(dash - s);
        if (rest == 6 && !strncmp(dash, "-novmm", 6)) *vmm = 0;
        else if (rest == 4 && !strncmp(dash, "-vmm", 4)) *vmm = 1;
        else return 0;
        len = (size_t)(dash - s);
    }
    *mode = parse_mode(s, len);
    return *mode >= 0;
}

/* CUDRV_FAKE_FAIL (lock held). Returns 0 if it is invalid (no fault is then injected). */
static int parse_faults(const char *s) {
    const char *p = s;
    for (;;) {
        fk_fault *f = &G.faults[G.nfaults];
        size_t len = strcspn(p, ":,");
        char *end;
        long code;
        if (G.nfaults == 32 || len == 0 || len >= sizeof f->name || p[len] != ':') return 0;
        memcpy(f->name, p, len);
        f->name[len] = 0;
        if (!known_function_name(f->name)) return 0;
        p += len + 1;
        if (!(*p >= '0' && *p <= '9')) return 0;
        errno = 0;
        f->n = strtoull(p, &end, 10);
        if (errno || f->n < 1) return 0;
        p = end;
        f->plus = 0;
        if (*p == '+') f->plus = 1, p++;
        if (*p != ':') return 0;
        p++;
        if (!((*p >= '0' && *p <= '9') || (*p == '-' && p[1] >= '0' && p[1] <= '9'))) return 0;
        errno = 0;
        code = strtol(p, &end, 0);
        if (errno || code == 0 || code < -2147483647L - 1 || code > 2147483647L) return 0;
        f->code = (int)code;
        f->calls = 0;
        f->injected = 0;
        G.nfaults++;
        p = end;
        if (*p == 0) return 1;
        if (*p != ',') return 0;
        p++;
    }
}

static int var_name_is(const char *entry, size_t len, const char *name) {
#ifdef _WIN32
    return strlen(name) == len && !_strnicmp(entry, name, len); /* names are case-insensitive */
#else
    return strlen(name) == len && !strncmp(entry, name, len);
#endif
}

/* Reports every CUDRV_FAKE_* variable of the environment `entry` ("NAME=value") that is not known. */
static void check_var_name(const char *entry) {
    size_t len = strcspn(entry, "="), i;
    if (len < sizeof FK_VAR_PREFIX - 1) return;
#ifdef _WIN32
    if (_strnicmp(entry, FK_VAR_PREFIX, sizeof FK_VAR_PREFIX - 1)) return;
#else
    if (strncmp(entry, FK_VAR_PREFIX, sizeof FK_VAR_PREFIX - 1)) return;
#endif
    for (i = 0; i < sizeof KNOWN_VARS / sizeof KNOWN_VARS[0]; i++)
        if (var_name_is(entry, len, KNOWN_VARS[i])) return;
    fprintf(stderr,
            "cudrv fake driver: unknown variable %.*s=\"%s\": the fake driver reads CUDRV_FAKE_MODE, "
            "CUDRV_FAKE_DEVICES, CUDRV_FAKE_VMM, CUDRV_FAKE_MEMORY, CUDRV_FAKE_DELAY_US, "
            "CUDRV_FAKE_UNMAP_US, CUDRV_FAKE_FREE_US_PER_GIB, CUDRV_FAKE_LAUNCH_US, "
            "CUDRV_FAKE_DRIVER_VERSION, CUDRV_FAKE_FAIL and "
            "CUDRV_FAKE_REPORT_ON_EXIT "
            "(cuInit returns CUDA_ERROR_INVALID_VALUE)\n",
            (int)len, entry, entry[len] ? entry + len + 1 : "");
    G.config_error = 1;
}

#ifndef _WIN32
extern char **environ;
#endif
static void check_var_names(void) {
#ifdef _WIN32
    char *block = GetEnvironmentStringsA(), *e;
    if (!block) return;
    for (e = block; *e; e += strlen(e) + 1) check_var_name(e);
    FreeEnvironmentStringsA(block);
#else
    char **e;
    for (e = environ; e && *e; e++) check_var_name(*e);
#endif
}

/* A variable's value; NULL when unset or empty. */
static const char *env_value(const char *name) {
    const char *s = getenv(name);
    return s && *s ? s : NULL;
}

static void read_env_locked(void) {
    const char *s;
    int mode = MODE_LINUX, vmm = 1, i;
    uint64_t mem = 16ULL << 30, v;
    if (G.envread) return;
    G.envread = 1;
    G.driver_version = FK_DEFAULT_DRIVER_VERSION;
    if ((s = env_value("CUDRV_FAKE_MODE"))) {
        mode = parse_mode(s, strlen(s));
        if (mode < 0) {
            config_error("CUDRV_FAKE_MODE", s, "linux, wddm or tcc");
            mode = MODE_LINUX;
        }
    }
    if ((s = env_value("CUDRV_FAKE_VMM"))) {
        if (!strcmp(s, "0") || !strcmp(s, "1")) vmm = *s == '1';
        else config_error("CUDRV_FAKE_VMM", s, "0 (no virtual memory management) or 1 (the default)");
    }
    if ((s = env_value("CUDRV_FAKE_MEMORY"))) {
        if (parse_u64(s, &v)) mem = v;
        else config_error("CUDRV_FAKE_MEMORY", s, "a number of bytes (decimal, 0x-hex or 0-octal integer)");
    }
    if ((s = env_value("CUDRV_FAKE_DELAY_US"))) {
        if (parse_u64(s, &v)) G.delay_us = v;
        else config_error("CUDRV_FAKE_DELAY_US", s, "a number of microseconds (decimal, 0x-hex or 0-octal integer)");
    }
    if ((s = env_value("CUDRV_FAKE_UNMAP_US"))) {
        if (parse_u64(s, &v)) G.unmap_us = v;
        else config_error("CUDRV_FAKE_UNMAP_US", s, "a number of microseconds (decimal, 0x-hex or 0-octal integer)");
    }
    if ((s = env_value("CUDRV_FAKE_FREE_US_PER_GIB"))) {
        if (parse_u64(s, &v)) G.free_us_per_gib = v;
        else config_error("CUDRV_FAKE_FREE_US_PER_GIB", s, "a number of microseconds (decimal, 0x-hex or 0-octal integer)");
    }
    if ((s = env_value("CUDRV_FAKE_LAUNCH_US"))) {
        if (parse_u64(s, &v)) G.launch_us = v;
        else config_error("CUDRV_FAKE_LAUNCH_US", s, "a number of microseconds (decimal, 0x-hex or 0-octal integer)");
    }
    if ((s = env_value("CUDRV_FAKE_DRIVER_VERSION"))) {
        char *end;
        long ver;
        errno = 0;
        ver = (*s >= '0' && *s <= '9') ? strtol(s, &end, 10) : 0;
        if (ver >= 1000 && ver <= 999999 && !errno && !*end) G.driver_version = (int)ver;
        else
            config_error("CUDRV_FAKE_DRIVER_VERSION", s,
                         "a decimal version 1000 * major + 10 * minor (such as 12080), from 1000 to 999999");
    }
    if ((s = env_value("CUDRV_FAKE_REPORT_ON_EXIT"))) {
        if (!strcmp(s, "0") || !strcmp(s, "1")) G.report_on_exit = *s == '1';
        else config_error("CUDRV_FAKE_REPORT_ON_EXIT", s, "0 or 1");
    }
    G.ndev = 1;
    for (i = 0; i < FK_MAX_DEVICES; i++) {
        G.dev[i].mode = mode;
        G.dev[i].vmm = vmm;
    }
    if ((s = env_value("CUDRV_FAKE_DEVICES"))) {
        static const char accepted[] =
            "a device count from 0 to 16, or 1 to 16 comma-separated entries <mode>[-novmm|-vmm] with "
            "<mode> linux, wddm or tcc (such as \"linux,tcc-novmm\")";
        if (*s >= '0' && *s <= '9') {
            if (parse_u64(s, &v) && v <= FK_MAX_DEVICES) G.ndev = (int)v;
            else config_error("CUDRV_FAKE_DEVICES", s, accepted);
        } else {
            const char *p = s;
            int n = 0, ok = 1;
            for (;;) {
                size_t len = strcspn(p, ",");
                int m, dv;
                if (n == FK_MAX_DEVICES || !parse_device_entry(p, len, &m, &dv)) {
                    ok = 0;
                    break;
                }
                G.dev[n].mode = m;
                if (dv >= 0) G.dev[n].vmm = dv;
                n++;
                p += len;
                if (!*p) break;
                p++;
            }
            if (ok) G.ndev = n;
            else {
                config_error("CUDRV_FAKE_DEVICES", s, accepted);
                for (i = 0; i < FK_MAX_DEVICES; i++) {
                    G.dev[i].mode = mode;
                    G.dev[i].vmm = vmm;
                }
            }
        }
    }
    for (i = 0; i < FK_MAX_DEVICES; i++) {
        G.dev[i].limit = mem;
        G.dev[i].cursor = FK_DEV_BASE + (uint64_t)i * FK_DEV_SPAN;
    }
    if ((s = env_value("CUDRV_FAKE_FAIL")) && !parse_faults(s)) {
        G.nfaults = 0;
        config_error("CUDRV_FAKE_FAIL", s,
                     "at most 32 comma-separated entries <function>:<n>[+]:<code>, with <function> an "
                     "exported driver function (such as cuMemAlloc or cuMemAlloc_v2), <n> >= 1 and <code> "
                     "a non-zero CUresult");
    }
    check_var_names();
}

/* Base name of an exported name: strips a trailing _v<digits>. */
static int name_matches(const char *pattern, const char *exported) {
    size_t n = strlen(exported);
    const char *u;
    if (!strcmp(pattern, exported)) return 1;
    u = strrchr(exported, '_');
    if (u && u[1] == 'v' && u[2] >= '0' && u[2] <= '9') n = (size_t)(u - exported);
    return strlen(pattern) == n && !strncmp(pattern, exported, n);
}

/* Whether this thread runs a host function now (a stream worker), and how many driver calls were
 * made from inside host functions, where the real driver may refuse them or deadlock
 * (cudrvFakeHostFnDriverCalls). */
static _Thread_local int tl_in_host_fn;
static uint64_t g_host_fn_driver_calls;
static void add_violation_locked(const char *fmt, ...);

/* Common entry: shutdown, fault injection, initialisation. */
static CUresult fk_enter(const char *name, int need_init) {
    CUresult r = CUDA_SUCCESS;
    int i;
    fk_lock(&G.lock);
    read_env_locked();
    if (tl_in_host_fn) {
        g_host_fn_driver_calls++;
        add_violation_locked("%s called inside a host function (the driver forbids it: it may fail or deadlock)", name);
    }
    if (G.shutdown) {
        r = CUDA_ERROR_DEINITIALIZED;
        goto out;
    }
    for (i = 0; i < G.nfaults; i++) {
        fk_fault *f = &G.faults[i];
        if (name_matches(f->name, name)) {
            f->calls++;
            if (f->calls == f->n || (f->plus && f->calls > f->n)) r = f->code, f->injected++;
        }
    }
    if (r) goto out;
    if (need_init && !G.initialized) r = CUDA_ERROR_NOT_INITIALIZED;
out:
    fk_unlock(&G.lock);
    return r;
}

#define ENTER(name)                                  \
    do {                                             \
        CUresult enter_r_ = fk_enter((name), 1);     \
        if (enter_r_ != CUDA_SUCCESS) return enter_r_; \
    } while (0)
#define ENTER_NOINIT(name)                           \
    do {                                             \
        CUresult enter_r_ = fk_enter((name), 0);     \
        if (enter_r_ != CUDA_SUCCESS) return enter_r_; \
    } while (0)

static void add_violation_locked(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (G.nviolations < FK_MAX_VIOLATIONS) {
        size_t len = strlen(buf) + 1;
        char *p = (char *)malloc(len);
        if (p) memcpy(p, buf, len);
        G.violations[G.nviolations] = p;
    }
    G.nviolations++;
}

/* Current context, checked. Lock held. */
static CUresult cur_ctx_locked(fk_ctx **out) {
    fk_ctx *c = tl_ctx;
    if (!c || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

static int valid_ctx(const fk_ctx *c) {
    int i;
    for (i = 0; i < G.ndev; i++)
        if (c == &G.dev[i].ctx) return c->magic == FK_MAGIC_CTX;
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* Memory                                                                                             */
/* ------------------------------------------------------------------------------------------------ */
static void *host_aligned_alloc(size_t size) {
    /* 4096-aligned, zeroed; the original pointer is stored just before the aligned block. */
    unsigned char *raw = (unsigned char *)calloc(1, size + 4096 + sizeof(void *));
    uintptr_t a;
    if (!raw) return NULL;
    a = ((uintptr_t)raw + sizeof(void *) + 4095) & ~(uintptr_t)4095;
    ((void **)a)[-1] = raw;
    return (void *)a;
}
static void host_aligned_free(void *p) {
    if (p) free(((void **)p)[-1]);
}

/* Binary search: index of the last alloc with base <= addr, or -1. */
static long tab_floor(const fk_vec *t, uint64_t addr) {
    long lo = 0, hi = (long)t->n - 1, res = -1;
    while (lo <= hi) {
        long mid = (lo + hi) / 2;
        if (((fk_alloc *)t->v[mid])->base <= addr) {
            res = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return res;
}
static void tab_insert(fk_vec *t, fk_alloc *a) {
    long i = tab_floor(t, a->base);
    vec_insert(t, (size_t)(i + 1), a);
}
static fk_alloc *tab_exact(const fk_vec *t, uint64_t addr, long *idx) {
    long i = tab_floor(t, addr);
    if (i >= 0 && ((fk_alloc *)t->v[i])->base == addr) {
        if (idx) *idx = i;
        return (fk_alloc *)t->v[i];
    }
    return NULL;
}
static fk_alloc *tab_containing(const fk_vec *t, uint64_t addr) {
    long i = tab_floor(t, addr);
    fk_alloc *a;
    if (i < 0) return NULL;
    a = (fk_alloc *)t->v[i];
    return addr < a->base + a->size || (a->size == 0 && addr == a->base) ? a : NULL;
}

static void block_free_backing(fk_block *b) {
    if (b->owns_backing == 1) free(b->backing);
    if (b->owns_backing == 2) host_aligned_free(b->backing);
    if (b->shm) shm_release(b->shm); /* owns_backing 3 and 4 */
    free(b);
}

/* Releases a device address range (lock held). */
static void release_block_locked(fk_block *b) {
    if (b->dev >= 0) {
        fk_device *d = &G.dev[b->dev];
        vec_remove(&d->ranges, b);
        d->reserved -= b->size;
    }
    if (b->pins) b->dead = 1;
    else block_free_backing(b);
}

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* Reserves a device address range of `size` bytes on device `dev` (lock held). */
static CUresult reserve_block_locked(int dev, uint64_t size, fk_block **out) {
    fk_device *d = &G.dev[dev];
    uint64_t align = size >= (2u << 20) ? (2u << 20) : 512;
    uint64_t lo = FK_DEV_BASE + (uint64_t)dev * FK_DEV_SPAN, hi = lo + FK_DEV_SPAN, cand;
    size_t i, pos = 0;
    int pass, found = 0;
    fk_block *b;
    size = round_up(size, 512);
    if (size == 0 || size > d->limit || d->reserved + size > d->limit) return CUDA_ERROR_OUT_OF_MEMORY;
    cand = round_up(d->cursor, align);
    for (pass = 0; pass < 2 && !found; pass++) {
        if (pass == 1) cand = lo;
        for (i = 0; i < d->ranges.n; i++) {
            fk_block *r = (fk_block *)d->ranges.v[i];
            if (r->base + r->size <= cand) continue;
            if (r->base >= cand + size) break;
            cand = round_up(r->base + r->size, align);
        }
        if (cand + size <= hi) {
            found = 1;
            pos = i;
        }
    }
    if (!found) return CUDA_ERROR_OUT_OF_MEMORY;
    b = (fk_block *)calloc(1, sizeof *b);
    if (!b) return CUDA_ERROR_OUT_OF_MEMORY;
    b->base = cand;
    b->size = size;
    b->dev = dev;
    b->owns_backing = 1;
    vec_insert(&d->ranges, pos, b);
    d->reserved += size;
    d->cursor = cand + size;
    *out = b;
    return CUDA_SUCCESS;
}

static fk_alloc *new_alloc(uint64_t base, uint64_t size, int kind, int dev, fk_block *blk) {
    fk_alloc *a = (fk_alloc *)calloc(1, sizeof *a);
    if (!a) abort();
    a->base = base;
    a->size = size;
    a->kind = kind;
    a->dev = dev;
    a->blk = blk;
    return a;
}

/* Pool bookkeeping (lock held). */
static void pool_release_cached_locked(fk_pool *p, uint64_t keep) {
    while (p->reserved > keep && p->cached.n) {
        /* release the largest cached block first */
        size_t i, best = 0;
        fk_block *b;
        for (i = 1; i < p->cached.n; i++)
            if (((fk_block *)p->cached.v[i])->size > ((fk_block *)p->cached.v[best])->size) best = i;
        b = (fk_block *)p->cached.v[best];
        vec_remove_at(&p->cached, best);
        p->reserved -= b->size;
        release_block_locked(b);
    }
}

static void pool_maybe_free_locked(fk_pool *p) {
    if (p->destroyed && p->live == 0) {
        pool_release_cached_locked(p, 0);
        free(p->cached.v);
        free(p);
    }
}

static CUresult pool_alloc_locked(fk_pool *p, uint64_t size, fk_alloc **out) {
    uint64_t need = round_up(size, 512);
    fk_block *b = NULL;
    size_t i;
    long best = -1;
    CUresult r;
    for (i = 0; i < p->cached.n; i++) {
        fk_block *c = (fk_block *)p->cached.v[i];
        if (c->size >= need && (best < 0 || c->size < ((fk_block *)p->cached.v[best])->size)) best = (long)i;
    }
    if (best >= 0) {
        b = (fk_block *)p->cached.v[best];
        vec_remove_at(&p->cached, (size_t)best);
    } else {
        if (p->max_size && p->reserved + need > p->max_size) pool_release_cached_locked(p, 0);
        if (p->max_size && p->reserved + need > p->max_size) return CUDA_ERROR_OUT_OF_MEMORY;
        r = reserve_block_locked(p->dev, need, &b);
        if (r == CUDA_ERROR_OUT_OF_MEMORY) {
            pool_release_cached_locked(p, 0);
            r = reserve_block_locked(p->dev, need, &b);
        }
        if (r) return r;
        p->reserved += b->size;
        if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    }
    *out = new_alloc(b->base, size, AK_POOL, p->dev, b);
    (*out)->pool = p;
    p->used += size;
    if (p->used > p->used_high) p->used_high = p->used;
    p->live++;
    tab_insert(&G.dtab, *out);
    return CUDA_SUCCESS;
}

/* Returns a pool allocation to its pool (lock held); the alloc is already out of dtab. */
static void pool_free_locked(fk_alloc *a) {
    fk_pool *p = a->pool;
    p->used -= a->size;
    p->live--;
    vec_push(&p->cached, a->blk);
    free(a);
    pool_maybe_free_locked(p);
}

/* Frees any live allocation (lock held). */
static void free_alloc_locked(fk_alloc *a) {
    long idx;
    fk_vec *t = (a->kind == AK_DEVICE || a->kind == AK_POOL || a->kind == AK_IPC) ? &G.dtab : &G.htab;
    if (tab_exact(t, a->base, &idx) == a) vec_remove_at(t, (size_t)idx);
    if (a->kind == AK_POOL) {
        pool_free_locked(a);
        return;
    }
    if (a->kind == AK_MANAGED) G.dev[a->dev].reserved -= a->blk->size;
    release_block_locked(a->blk); /* host blocks have dev == -1: no device range to release */
    free(a);
}

static void trim_after_sync_locked(int dev) {
    size_t i;
    for (i = 0; i < G.pools.n; i++) {
        fk_pool *p = (fk_pool *)G.pools.v[i];
        if (p->dev == dev && p->reserved > p->threshold) pool_release_cached_locked(p, p->threshold);
    }
}

/* The host memory behind a device-side range, as one or more pinned segments (more than one when
   the range spans several VMM mappings, whose backings are separate). */
typedef struct {
    unsigned char *p;
    uint64_t len;
    fk_block *blk; /* pinned; NULL for plain host memory */
} fk_seg;
typedef struct {
    fk_seg one;
    fk_seg *segs; /* &one, or a malloc'd array */
    size_t n;
    uint64_t len;
} fk_view;

static void view_host(fk_view *v, void *p, uint64_t len) {
    v->one.p = (unsigned char *)p;
    v->one.len = len;
    v->one.blk = NULL;
    v->segs = &v->one;
    v->n = len ? 1 : 0;
    v->len = len;
}

static int back_block_locked(const char *api, fk_block *b) {
    if (b->backing) return 1;
    b->backing = (unsigned char *)calloc(1, (size_t)b->size);
    if (!b->backing)
        add_violation_locked("%s: fake driver could not back %" PRIu64 " bytes with host memory", api, b->size);
    return b->backing != NULL;
}

static void view_push(fk_view *v, unsigned char *p, uint64_t len, fk_block *b) {
    if (v->n == 1) {
        fk_seg *a = (fk_seg *)malloc(4 * sizeof *a);
        if (!a) abort();
        a[0] = v->one;
        v->segs = a;
    } else if (v->n > 1 && (v->n & (v->n - 1)) == 0 && v->n >= 4) {
        fk_seg *a = (fk_seg *)realloc(v->segs, 2 * v->n * sizeof *a);
        if (!a) abort();
        v->segs = a;
    }
    v->segs[v->n].p = p;
    v->segs[v->n].len = len;
    v->segs[v->n].blk = b;
    v->n++;
    v->len += len;
}

static void unpin_locked(fk_block *b) {
    if (!b) return;
    if (--b->pins == 0 && b->dead) block_free_backing(b);
}
static void unpin_view_locked(fk_view *v) {
    size_t i;
    for (i = 0; i < v->n; i++) unpin_locked(v->segs[i].blk);
    if (v->segs != &v->one) free(v->segs);
    v->segs = &v->one;
    v->n = 0;
}

/* Whether mapping `m` gives device `dev` the access `what` needs. */
static int mapping_allows(const fk_alloc *m, int dev, int write) {
    int f = m->access[dev];
    return write ? f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE : (f & CU_MEM_ACCESS_FLAGS_PROT_READ) != 0;
}

/* Access check + pin of a device-side range at op run time (lock held). Fills *v (empty for len 0)
   and returns 1, or records a violation and returns 0. */
static int pin_range_locked(const char *api, const char *what, uint64_t addr, uint64_t len, fk_stream *s,
                            fk_view *v) {
    fk_alloc *a = NULL;
    char where[96];
    int write = strstr(what, "write") != NULL;
    view_host(v, NULL, 0);
    if (len == 0) return 1; /* nothing accessed */
    if (s->kind == SK_LEGACY) snprintf(where, sizeof where, "the legacy stream of device %d", s->ctx->dev);
    else if (s->kind == SK_PTDS)
        snprintf(where, sizeof where, "the per-thread stream of thread #%" PRIu64 " on device %d", s->thread_no,
                 s->ctx->dev);
    else snprintf(where, sizeof where, "stream %p", (void *)s);
    if (addr + len < addr) {
        add_violation_locked("%s: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s wraps around the address space",
                             api, what, len, addr, where);
        return 0;
    }
    if (tab_containing(&G.mtab, addr)) {
        /* VMM: contiguous mappings, each giving this device the access needed */
        uint64_t cur = addr, end = addr + len;
        while (cur < end) {
            fk_alloc *m = tab_containing(&G.mtab, cur);
            uint64_t take;
            if (!m) {
                add_violation_locked("%s: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s reaches unmapped "
                                     "virtual memory at 0x%" PRIx64 " (never mapped, or unmapped with cuMemUnmap)",
                                     api, what, len, addr, where, cur);
                unpin_view_locked(v);
                return 0;
            }
            if (!mapping_allows(m, s->ctx->dev, write)) {
                add_violation_locked("%s: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s touches the mapping "
                                     "0x%" PRIx64 " of %" PRIu64 " bytes, to which device %d has no %s access "
                                     "(cuMemSetAccess)",
                                     api, what, len, addr, where, m->base, m->size, s->ctx->dev,
                                     write ? "read-write" : "read");
                unpin_view_locked(v);
                return 0;
            }
            if (!back_block_locked(api, m->blk)) {
                unpin_view_locked(v);
                return 0;
            }
            take = (end < m->base + m->size ? end : m->base + m->size) - cur;
            m->blk->pins++;
            view_push(v, m->blk->backing + m->boff + (cur - m->base), take, m->blk);
            cur += take;
        }
        return 1;
    }
    a = tab_containing(&G.dtab, addr);
    if (!a || addr + len > a->base + a->size) a = tab_containing(&G.htab, addr);
    if (a && addr + len > a->base + a->size) a = NULL;
    if (!a) {
        fk_alloc *nearby = tab_containing(&G.dtab, addr);
        size_t i;
        if (!nearby) nearby = tab_containing(&G.htab, addr);
        for (i = 0; !nearby && i < G.vres.n; i++) {
            const fk_vres *r = (const fk_vres *)G.vres.v[i];
            if (addr >= r->base && addr < r->base + r->size) {
                add_violation_locked("%s: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s is in reserved "
                                     "virtual memory that is not mapped (never mapped, or unmapped with "
                                     "cuMemUnmap)",
                                     api, what, len, addr, where);
                return 0;
            }
        }
        if (nearby)
            add_violation_locked("%s: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s overruns the "
                                 "allocation 0x%" PRIx64 " of %" PRIu64 " bytes",
                                 api, what, len, addr, where, nearby->base, nearby->size);
        else
            add_violation_locked("%s: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s is not inside a "
                                 "live allocation (freed, or never allocated)",
                                 api, what, len, addr, where);
        return 0;
    }
    if (!back_block_locked(api, a->blk)) return 0;
    a->blk->pins++;
    view_push(v, a->blk->backing + a->boff + (addr - a->base), len, a->blk);
    return 1;
}

/* Copies between a view and a plain buffer: `len` bytes at offset `off` of the view. */
static void view_read(const fk_view *v, uint64_t off, unsigned char *buf, uint64_t len) {
    size_t i;
    for (i = 0; i < v->n && len; i++) {
        const fk_seg *g = &v->segs[i];
        uint64_t take;
        if (off >= g->len) {
            off -= g->len;
            continue;
        }
        take = g->len - off < len ? g->len - off : len;
        memmove(buf, g->p + off, (size_t)take);
        buf += take;
        len -= take;
        off = 0;
    }
}
static void view_write(const fk_view *v, uint64_t off, const unsigned char *buf, uint64_t len) {
    size_t i;
    for (i = 0; i < v->n && len; i++) {
        const fk_seg *g = &v->segs[i];
        uint64_t take;
        if (off >= g->len) {
            off -= g->len;
            continue;
        }
        take = g->len - off < len ? g->len - off : len;
        memmove(g->p + off, buf, (size_t)take);
        buf += take;
        len -= take;
        off = 0;
    }
}

/* Copies the whole of `src` into `dst` (same length). */
static void view_copy(const fk_view *dst, const fk_view *src) {
    size_t i = 0, j = 0;
    uint64_t oi = 0, oj = 0;
    if (dst->n == 1 && src->n == 1) {
        memmove(dst->segs[0].p, src->segs[0].p, (size_t)dst->len);
        return;
    }
    while (i < dst->n && j < src->n) {
        const fk_seg *d = &dst->segs[i], *g = &src->segs[j];
        uint64_t take = d->len - oi < g->len - oj ? d->len - oi : g->len - oj;
        memmove(d->p + oi, g->p + oj, (size_t)take);
        oi += take;
        oj += take;
        if (oi == d->len) i++, oi = 0;
        if (oj == g->len) j++, oj = 0;
    }
}

/* Fills the view with the repeated `elem`-byte pattern `pat` (byte k of the range is pat[k % elem]). */
static void view_fill(const fk_view *v, const unsigned char *pat, int elem) {
    size_t i;
    uint64_t off = 0;
    for (i = 0; i < v->n; i++) {
        const fk_seg *g = &v->segs[i];
        uint64_t k = 0;
        if (elem == 1) memset(g->p, pat[0], (size_t)g->len);
        else {
            for (; k < g->len && (off + k) % (uint64_t)elem; k++) g->p[k] = pat[(off + k) % (uint64_t)elem];
            for (; k + (uint64_t)elem <= g->len; k += (uint64_t)elem) memcpy(g->p + k, pat, (size_t)elem);
            for (; k < g->len; k++) g->p[k] = pat[(off + k) % (uint64_t)elem];
        }
        off += g->len;
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* Streams and their workers                                                                          */
/* ------------------------------------------------------------------------------------------------ */
static void stream_unref_locked(fk_stream *s) {
    if (--s->refs == 0) {
        vec_remove(&G.all_streams, s);
        free(s);
    }
}
static void event_unref_locked(fk_event *e) {
    if (--e->refs == 0) {
        if (e->rs) stream_unref_locked(e->rs);
        if (e->ipc) ipc_event_free(e->ipc);
        free(e);
    }
}

static fk_stream *new_stream_locked(fk_ctx *c, unsigned flags, int prio, int kind) {
    fk_stream *s = (fk_stream *)calloc(1, sizeof *s);
    if (!s) abort();
    s->magic = FK_MAGIC_STREAM;
    s->ctx = c;
    s->flags = flags;
    s->priority = prio;
    s->kind = kind;
    s->refs = 1;
    vec_push(&G.all_streams, s);
    return s;
}

static void run_kernel(fk_op *op, fk_stream *s);
static void run_data_op(fk_op *op, fk_stream *s);

static void finish_op_locked(fk_op *op) {
    if (op->ws) stream_unref_locked(op->ws);
    if (op->ev) event_unref_locked(op->ev);
    if (op->src_snapshot) free((void *)(uintptr_t)op->src);
    free(op);
}

static void worker_loop(fk_stream *s) {
    fk_lock(&G.lock);
    for (;;) {
        fk_op *op;
        while (!s->head && !s->destroyed) fk_wait(&G.cv, &G.lock);
        if (!s->head) break;
        op = s->head;
        if (op->kind == OP_WAIT) {
            while (op->ws->completed < op->wseq) fk_wait(&G.cv, &G.lock);
        } else {
            uint64_t delay = G.delay_us;
            fk_unlock(&G.lock);
            fk_sleep_us(delay);
            if (op->kind == OP_HOSTFN) {
                tl_in_host_fn = 1;
                op->fn(op->ud);
                tl_in_host_fn = 0;
            } else if (op->kind == OP_KERNEL) run_kernel(op, s);
            else if (op->kind == OP_MEMSET || op->kind == OP_COPY) run_data_op(op, s);
            else if (op->kind >= OP_REGION) run_ext_op(op, s);
            fk_lock(&G.lock);
            if (op->kind == OP_RECORD && op->ipc_ticket) ipc_event_complete(op->ev, op->ipc_ticket);
            if (op->kind == OP_RECORD && op->ev->gen == op->gen) {
                op->ev->t_ms = fk_now_ms();
                op->ev->t_valid = 1;
            } else if (op->kind == OP_FREE) {
                free_alloc_locked(op->fa);
            }
        }
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        finish_op_locked(op);
        s->completed++;
        fk_broadcast(&G.cv);
    }
    s->started = 0;
    stream_unref_locked(s);
    fk_unlock(&G.lock);
}

#ifdef _WIN32
static DWORD WINAPI worker_main(LPVOID arg) {
    worker_loop((fk_stream *)arg);
    return 0;
}
static int start_thread(fk_stream *s) {
    HANDLE h = CreateThread(NULL, 0, worker_main, s, 0, NULL);
    if (!h) return -1;
    CloseHandle(h);
    return 0;
}
#else
static void *worker_main(void *arg) {
    worker_loop((fk_stream *)arg);
    return NULL;
}
static int start_thread(fk_stream *s) {
    pthread_t t;
    pthread_attr_t at;
    int r;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&at, 256 * 1024);
    r = pthread_create(&t, &at, worker_main, s);
    pthread_attr_destroy(&at);
    return r;
}
#endif

static void push_op_locked(fk_stream *s, fk_op *op) {
    op->next = NULL;
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    op->seq = ++s->enqueued;
    if (!s->started) {
        s->started = 1;
        s->refs++;
        if (start_thread(s) != 0) abort();
    }
    fk_broadcast(&G.cv);
}

static fk_op *new_op(int kind, const char *api) {
    fk_op *op = (fk_op *)calloc(1, sizeof *op);
    if (!op) abort();
    op->kind = kind;
    op->api = api;
    return op;
}

static void push_wait_locked(fk_stream *s, fk_stream *target, uint64_t seq) {
    fk_op *w;
    if (target == s || target->completed >= seq) return;
    w = new_op(OP_WAIT, "wait");
    w->ws = target;
    w->wseq = seq;
    target->refs++;
    push_op_locked(s, w);
}

static int stream_pending(const fk_stream *s) { return s->completed < s->enqueued; }

static int capture_divert_locked(fk_stream *s, fk_op *op); /* fake_graph.c */

/* Enqueues with the legacy-stream implicit synchronisation; returns the op's sequence number (0 for
   an op captured into a graph instead, on a capturing stream). */
static uint64_t enqueue_locked(fk_stream *s, fk_op *op) {
    if (capture_divert_locked(s, op)) return 0;
    if (s->kind == SK_LEGACY) {
        size_t i;
        for (i = 0; i < G.all_streams.n; i++) {
            fk_stream *o = (fk_stream *)G.all_streams.v[i];
            if (o != s && o->ctx == s->ctx && !(o->flags & CU_STREAM_NON_BLOCKING) && stream_pending(o))
                push_wait_locked(s, o, o->enqueued);
        }
    } else if (!(s->flags & CU_STREAM_NON_BLOCKING)) {
        fk_stream *l = s->ctx->legacy;
        if (l && stream_pending(l)) push_wait_locked(s, l, l->enqueued);
    }
    push_op_locked(s, op);
    return op->seq;
}

static void wait_seq_locked(fk_stream *s, uint64_t seq) {
    while (s->completed < seq) fk_wait(&G.cv, &G.lock);
}

/* ---- per-thread default streams ---- */

/* The calling thread's per-thread streams, one slot per device (context). Kept in a platform TLS
   slot (not _Thread_local), whose value the thread-exit hook can clear. */
typedef struct fk_thread {
    fk_stream *ptds[FK_MAX_DEVICES];
} fk_thread;

/* Releases a thread's per-thread streams: queued work still runs, then each is freed. */
static void thread_exit_hook(void *arg) {
    fk_thread *t = (fk_thread *)arg;
    int i;
    if (!t) return;
    fk_lock(&G.lock);
    for (i = 0; i < FK_MAX_DEVICES; i++) {
        fk_stream *s = t->ptds[i];
        if (!s) continue;
        s->destroyed = 1;
        G.ptds_live--;
        stream_unref_locked(s);
    }
    fk_broadcast(&G.cv);
    fk_unlock(&G.lock);
    free(t);
}

#ifdef _WIN32
static DWORD g_tls = TLS_OUT_OF_INDEXES;
static int tls_available(void) { return g_tls != TLS_OUT_OF_INDEXES; }
static fk_thread *thread_slot(void) { return tls_available() ? (fk_thread *)TlsGetValue(g_tls) : NULL; }
static void set_thread_slot(fk_thread *t) {
    if (g_tls != TLS_OUT_OF_INDEXES) TlsSetValue(g_tls, t);
}
/* DLL_THREAD_DETACH runs in each exiting thread (not at process exit, where it would race with
   threads killed while holding G.lock); ExitProcess gives DLL_PROCESS_DETACH instead. */
BOOL WINAPI DllMain(HINSTANCE inst, DWORD reason, LPVOID reserved);
BOOL WINAPI DllMain(HINSTANCE inst, DWORD reason, LPVOID reserved) {
    (void)inst;
    (void)reserved;
    if (reason == DLL_PROCESS_ATTACH) g_tls = TlsAlloc();
    if (reason == DLL_THREAD_DETACH && g_tls != TLS_OUT_OF_INDEXES) {
        fk_thread *t = (fk_thread *)TlsGetValue(g_tls);
        if (t) {
            TlsSetValue(g_tls, NULL);
            thread_exit_hook(t);
        }
    }
    return TRUE;
}
#else
static pthread_key_t g_tls;
static int g_tls_ok;
static pthread_once_t g_tls_once = PTHREAD_ONCE_INIT;
/* glibc sets the key's value to NULL before it calls the destructor. */
static void make_tls_key(void) { g_tls_ok = pthread_key_create(&g_tls, thread_exit_hook) == 0; }
static int tls_available(void) {
    pthread_once(&g_tls_once, make_tls_key);
    return g_tls_ok;
}
static fk_thread *thread_slot(void) { return tls_available() ? (fk_thread *)pthread_getspecific(g_tls) : NULL; }
static void set_thread_slot(fk_thread *t) {
    if (g_tls_ok) pthread_setspecific(g_tls, t);
}
/* Exiting threads must not call into an unloaded library. */
__attribute__((destructor)) static void fk_delete_tls_key(void) {
    if (g_tls_ok) {
        g_tls_ok = 0;
        pthread_key_delete(g_tls);
    }
}
#endif

/* The calling thread's per-thread stream of context `c`, made at its first use (lock held). */
static fk_stream *per_thread_stream_locked(fk_ctx *c) {
    fk_thread *t = thread_slot();
    if (!t && tls_available()) {
        t = (fk_thread *)calloc(1, sizeof *t);
        if (!t) abort();
        set_thread_slot(t);
    } else if (!t) {
        /* no TLS slot could be made: one table per thread, never reclaimed */
        static _Thread_local fk_thread fallback;
        t = &fallback;
    }
    if (!t->ptds[c->dev]) {
        fk_stream *s = new_stream_locked(c, 0, 0, SK_PTDS);
        s->thread_no = ++G.ptds_threads;
        G.ptds_live++;
        t->ptds[c->dev] = s;
    }
    return t->ptds[c->dev];
}

/* Resolves a stream handle (lock held). */
static CUresult get_stream_locked(CUstream h, fk_stream **out) {
    uintptr_t v = (uintptr_t)h;
    if (v <= 2) {
        fk_ctx *c;
        CUresult r = cur_ctx_locked(&c);
        if (r) return r;
        *out = v == 2 ? per_thread_stream_locked(c) : c->legacy;
        return CUDA_SUCCESS;
    }
    if (vec_find(&G.streams, h) < 0) return CUDA_ERROR_INVALID_HANDLE;
    *out = h;
    return CUDA_SUCCESS;
}

static void sync_ctx_locked(fk_ctx *c) {
    size_t i;
    int again = 1;
    while (again) {
        again = 0;
        for (i = 0; i < G.all_streams.n; i++) {
            fk_stream *s = (fk_stream *)G.all_streams.v[i];
            if (s->ctx == c && stream_pending(s)) {
                fk_wait(&G.cv, &G.lock);
                again = 1;
                break;
            }
        }
    }
    trim_after_sync_locked(c->dev);
}

static void drain_all_locked(void) {
    size_t i;
    int again = 1;
    while (again) {
        again = 0;
        for (i = 0; i < G.all_streams.n; i++) {
            if (stream_pending((fk_stream *)G.all_streams.v[i])) {
                fk_wait(&G.cv, &G.lock);
                again = 1;
                break;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* Op execution                                                                                       */
/* ------------------------------------------------------------------------------------------------ */
static void run_data_op(fk_op *op, fk_stream *s) {
    fk_view d, src;
    uint64_t bytes = (uint64_t)op->count * (uint64_t)op->elem;
    int ok = 1;
    view_host(&d, NULL, 0);
    view_host(&src, NULL, 0);
    fk_lock(&G.lock);
    if (op->kind == OP_MEMSET) {
        ok = pin_range_locked(op->api, "write", op->dst, bytes, s, &d);
    } else {
        if (op->cpkind == CP_DTOH) view_host(&d, (void *)(uintptr_t)op->dst, bytes);
        else ok = pin_range_locked(op->api, "write", op->dst, bytes, s, &d);
        if (!ok) {
        } else if (op->cpkind == CP_HTOD) view_host(&src, (void *)(uintptr_t)op->src, bytes);
        else ok = pin_range_locked(op->api, "read", op->src, bytes, s, &src);
    }
    fk_unlock(&G.lock);
    if (ok && bytes) {
        if (op->kind == OP_MEMSET) {
            unsigned char pat[4];
            if (op->elem == 2) {
                uint16_t v16 = (uint16_t)op->value;
                memcpy(pat, &v16, 2);
            } else {
                memcpy(pat, &op->value, 4);
            }
            view_fill(&d, pat, op->elem);
        } else {
            view_copy(&d, &src);
        }
    }
    fk_lock(&G.lock);
    unpin_view_locked(&d);
    unpin_view_locked(&src);
    fk_unlock(&G.lock);
}

static const struct {
    const char *name;
    int nparams;
    int size[4];
    int off[4];
    int total;
} KERNELS[K_COUNT] = {
    {"fill_u32", 3, {8, 4, 8, 0}, {0, 8, 16, 0}, 24},
    {"add_f32", 4, {8, 8, 8, 8}, {0, 8, 16, 24}, 32},
    {"spin_fill_u32", 4, {8, 4, 8, 8}, {0, 8, 16, 24}, 32},
    {"empty", 0, {0, 0, 0, 0}, {0, 0, 0, 0}, 0},
    {"fill_pattern_u8", 3, {8, 8, 8, 0}, {0, 8, 16, 0}, 24},
};

static void run_kernel(fk_op *op, fk_stream *s) {
    fk_view v[3];
    const char *api = op->api;
    uint64_t n, i;
    int ok = 1, k;
    for (k = 0; k < 3; k++) view_host(&v[k], NULL, 0);
    switch (op->kernel) {
    case K_EMPTY:
        return;
    case K_SPIN_FILL_U32:
        fk_sleep_us(op->kp[3]);
        /* fallthrough */
    case K_FILL_U32:
        n = op->kp[2];
        fk_lock(&G.lock);
        ok = pin_range_locked(api, "kernel write", op->kp[0], n * 4, s, &v[0]);
        fk_unlock(&G.lock);
        if (ok) {
            unsigned char pat[4];
            memcpy(pat, &op->kval, 4);
            view_fill(&v[0], pat, 4);
        }
        break;
    case K_ADD_F32:
        n = op->kp[3];
        fk_lock(&G.lock);
        for (k = 0; k < 3 && ok; k++)
            ok = pin_range_locked(api, k < 2 ? "kernel read" : "kernel write", op->kp[k], n * 4, s, &v[k]);
        fk_unlock(&G.lock);
        if (ok) {
            /* in chunks, through a buffer, so that ranges split across VMM mappings work too */
            enum { CHUNK = 1024 };
            float x[CHUNK], y[CHUNK];
            for (i = 0; i < n; i += CHUNK) {
                uint64_t m = n - i < CHUNK ? n - i : CHUNK, j;
                view_read(&v[0], i * 4, (unsigned char *)x, m * 4);
                view_read(&v[1], i * 4, (unsigned char *)y, m * 4);
                for (j = 0; j < m; j++) x[j] += y[j];
                view_write(&v[2], i * 4, (const unsigned char *)x, m * 4);
            }
        }
        break;
    case K_FILL_PATTERN_U8:
        n = op->kp[1];
        fk_lock(&G.lock);
        ok = pin_range_locked(api, "kernel write", op->kp[0], n, s, &v[0]);
        fk_unlock(&G.lock);
        if (ok) {
            uint64_t off = 0;
            size_t g;
            for (g = 0; g < v[0].n; g++) {
                const fk_seg *seg = &v[0].segs[g];
                for (i = 0; i < seg->len; i++) seg->p[i] = (uint8_t)((op->kp[2] * 2654435761u + (off + i) * 31u) >> 3);
                off += seg->len;
            }
        }
        break;
    default:
        break;
    }
    fk_lock(&G.lock);
    for (k = 0; k < 3; k++) unpin_view_locked(&v[k]);
    fk_unlock(&G.lock);
}

/* CUDA graphs and stream capture (the same translation unit). */
#include "fake_graph.c"

/* ------------------------------------------------------------------------------------------------ */
/* Errors, version, proc address                                                                      */
/* ------------------------------------------------------------------------------------------------ */
static const struct {
    int code;
    const char *name;
    const char *str;
} ERRORS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {300, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {301, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", "shared object symbol not found"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "cannot set while device is active in this process"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    FK_GRAPH_ERRORS /* fake_graph.c */
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

API_OLD cuGetErrorName(CUresult error, const char **pStr) {
    size_t i;
    ENTER_NOINIT("cuGetErrorName");
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == error) {
            *pStr = ERRORS[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

API_OLD cuGetErrorString(CUresult error, const char **pStr) {
    size_t i;
    ENTER_NOINIT("cuGetErrorString");
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (ERRORS[i].code == error) {
            *pStr = ERRORS[i].str;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

API_OLD cuDriverGetVersion(int *driverVersion) {
    ENTER_NOINIT("cuDriverGetVersion");
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    *driverVersion = G.driver_version;
    fk_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static void init_ctx_locked(int i) {
    fk_ctx *c = &G.dev[i].ctx;
    c->magic = FK_MAGIC_CTX;
    c->dev = i;
    c->legacy = new_stream_locked(c, 0, 0, SK_LEGACY);
}

static fk_pool *new_pool_locked(int dev, int is_default) {
    fk_pool *p = (fk_pool *)calloc(1, sizeof *p);
    int i;
    if (!p) abort();
    p->magic = FK_MAGIC_POOL;
    p->dev = dev;
    p->is_default = is_default;
    p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
    for (i = 0; i < FK_MAX_DEVICES; i++) p->access[i] = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    p->access[dev] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    vec_push(&G.pools, p);
    return p;
}

API_OLD cuInit(unsigned int Flags) {
    int i;
    CUresult r = CUDA_SUCCESS;
    ENTER_NOINIT("cuInit");
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (G.config_error) r = CUDA_ERROR_INVALID_VALUE; /* the reason is on stderr */
    else if (G.ndev == 0) r = CUDA_ERROR_NO_DEVICE;
    else if (!G.initialized) {
        for (i = 0; i < G.ndev; i++) {
            init_ctx_locked(i);
            if (G.dev[i].mode != MODE_TCC) {
                G.dev[i].default_pool = new_pool_locked(i, 1);
                G.dev[i].cur_pool = G.dev[i].default_pool;
            }
        }
        G.initialized = 1;
    }
    fk_unlock(&G.lock);
    return r;
}

/* ------------------------------------------------------------------------------------------------ */
/* Devices                                                                                            */
/* ------------------------------------------------------------------------------------------------ */
static int valid_dev(CUdevice d) { return d >= 0 && d < G.ndev; }

API_OLD cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount");
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = G.ndev;
    return CUDA_SUCCESS;
}

API_OLD cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER("cuDeviceGet");
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

API_OLD cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName");
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "Fake NVIDIA H200 (%s)", MODE_NAMES[G.dev[dev].mode]);
    return CUDA_SUCCESS;
}

static CUresult get_uuid(const char *api, CUuuid *uuid, CUdevice dev) {
    int i;
    ENTER(api);
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    for (i = 0; i < 16; i++) uuid->bytes[i] = (char)(0x5a ^ (i * 17));
    uuid->bytes[0] = (char)0xfa;
    uuid->bytes[1] = (char)0x4e;
    uuid->bytes[14] = (char)G.dev[dev].mode;
    uuid->bytes[15] = (char)dev;
    return CUDA_SUCCESS;
}
API_OLD cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return get_uuid("cuDeviceGetUuid", uuid, dev); }
API_11040 cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return get_uuid("cuDeviceGetUuid_v2", uuid, dev); }

static int pci_bus(CUdevice d) { return 0x19 + d * 0x10; }

API_OLD cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    ENTER("cuDeviceGetPCIBusId");
    if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(pciBusId, (size_t)len, "0000:%02X:00.0", pci_bus(dev));
    return CUDA_SUCCESS;
}

API_OLD cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    ENTER("cuDeviceTotalMem_v2");
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)G.dev[dev].limit;
    return CUDA_SUCCESS;
}

static int attr_value(int dev, int a) {
    int m = G.dev[dev].mode, linux_ = m == MODE_LINUX, win = m != MODE_LINUX;
    switch (a) {
    case 1: return 1024;             /* MAX_THREADS_PER_BLOCK */
    case 2: case 3: return 1024;     /* MAX_BLOCK_DIM_X/Y */
    case 4: return 64;               /* MAX_BLOCK_DIM_Z */
    case 5: return 2147483647;       /* MAX_GRID_DIM_X */
    case 6: case 7: return 65535;    /* MAX_GRID_DIM_Y/Z */
    case 8: return FK_SMEM_DEFAULT;  /* SHARED_MEMORY_PER_BLOCK */
    case 9: return 65536;            /* TOTAL_CONSTANT_MEMORY */
    case 10: return 32;              /* WARP_SIZE */
    case 11: return 2147483647;      /* MAX_PITCH */
    case 12: return 65536;           /* REGISTERS_PER_BLOCK */
    case 13: return 1980000;         /* CLOCK_RATE (kHz) */
    case 14: return 512;             /* TEXTURE_ALIGNMENT */
    case 15: return 1;               /* GPU_OVERLAP */
    case 16: return FK_SM_COUNT;     /* MULTIPROCESSOR_COUNT */
    case 17: return m == MODE_WDDM;  /* KERNEL_EXEC_TIMEOUT */
    case 18: return 0;               /* INTEGRATED */
    case 19: return 1;               /* CAN_MAP_HOST_MEMORY */
    case 20: return 0;               /* COMPUTE_MODE default */
    case 21: return 131072;
    case 22: return 131072;
    case 23: return 65536;
    case 30: return 512;             /* SURFACE_ALIGNMENT */
    case 31: return 1;               /* CONCURRENT_KERNELS */
    case 32: return 1;               /* ECC_ENABLED */
    case 33: return pci_bus(dev);    /* PCI_BUS_ID */
    case 34: return 0;               /* PCI_DEVICE_ID */
    case 35: return m == MODE_TCC;   /* TCC_DRIVER */
    case 36: return 2619000;         /* MEMORY_CLOCK_RATE */
    case 37: return 6144;            /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: return 52428800;        /* L2_CACHE_SIZE */
    case 39: return 2048;            /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: return 5;               /* ASYNC_ENGINE_COUNT */
    case 41: return 1;               /* UNIFIED_ADDRESSING */
    case 50: return 0;               /* PCI_DOMAIN_ID */
    case 51: return 32;              /* TEXTURE_PITCH_ALIGNMENT */
    case 75: return 9;               /* COMPUTE_CAPABILITY_MAJOR */
    case 76: return 0;               /* COMPUTE_CAPABILITY_MINOR */
    case 78: return 1;               /* STREAM_PRIORITIES_SUPPORTED */
    case 79: case 80: return 1;      /* GLOBAL/LOCAL_L1_CACHE_SUPPORTED */
    case 81: return FK_SMEM_PER_SM;  /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: return 65536;           /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: return 1;               /* MANAGED_MEMORY */
    case 84: return 0;               /* MULTI_GPU_BOARD */
    case 85: return dev;             /* MULTI_GPU_BOARD_GROUP_ID */
    case 86: return 0;               /* HOST_NATIVE_ATOMIC_SUPPORTED */
    case 87: return 2;               /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    case 88: return 0;               /* PAGEABLE_MEMORY_ACCESS */
    case 89: return linux_;          /* CONCURRENT_MANAGED_ACCESS */
    case 90: return 1;               /* COMPUTE_PREEMPTION_SUPPORTED */
    case 91: return linux_;          /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
    case 92: case 93: case 94: return 0; /* *_STREAM_MEM_OPS_V1 (removed) */
    case 95: return 1;               /* COOPERATIVE_LAUNCH */
    case 96: return 0;               /* COOPERATIVE_MULTI_DEVICE_LAUNCH (deprecated) */
    case 97: return FK_SMEM_OPTIN;   /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 98: return 0;               /* CAN_FLUSH_REMOTE_WRITES */
    case 99: return 1;               /* HOST_REGISTER_SUPPORTED */
    case 100: return 0;              /* PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES */
    case 101: return 0;              /* DIRECT_MANAGED_MEM_ACCESS_FROM_HOST */
    case 102: return G.dev[dev].vmm; /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: return linux_;         /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 104: case 105: return win;  /* HANDLE_TYPE_WIN32(_KMT)_HANDLE_SUPPORTED */
    case 106: return 32;             /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 107: return 1;              /* GENERIC_COMPRESSION_SUPPORTED */
    case 108: return 82837504;       /* MAX_PERSISTING_L2_CACHE_SIZE */
    case 109: return 134213632;      /* MAX_ACCESS_POLICY_WINDOW_SIZE */
    case 110: return linux_ && G.dev[dev].vmm; /* GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED */
    case 111: return 1024;           /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    case 112: return 1;              /* SPARSE_CUDA_ARRAY_SUPPORTED */
    case 113: return linux_;         /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    case 114: return 1;              /* TIMELINE_SEMAPHORE_INTEROP_SUPPORTED */
    case 115: return m != MODE_TCC;  /* MEMORY_POOLS_SUPPORTED */
    case 116: return linux_;         /* GPU_DIRECT_RDMA_SUPPORTED */
    case 117: return linux_;         /* GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS */
    case 118: return linux_ ? 100 : 0; /* GPU_DIRECT_RDMA_WRITES_ORDERING */
    case 119:                        /* MEMPOOL_SUPPORTED_HANDLE_TYPES */
        return m == MODE_LINUX ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
               : m == MODE_WDDM ? (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT)
                                : 0;
    case 120: return 1;              /* CLUSTER_LAUNCH */
    case 121: return 1;              /* DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED */
    case 122: case 123: return 1;    /* CAN_USE_64_BIT_STREAM_MEM_OPS, WAIT_VALUE_NOR */
    case 124: return linux_;         /* DMA_BUF_SUPPORTED */
    case 125: return linux_;         /* IPC_EVENT_SUPPORTED */
    case 126: return 4;              /* MEM_SYNC_DOMAIN_COUNT */
    case 127: return 1;              /* TENSOR_MAP_ACCESS_SUPPORTED */
    case 129: return 0;              /* UNIFIED_FUNCTION_POINTERS */
    case 131: return -1;             /* NUMA_ID */
    case 134: return -1;             /* HOST_NUMA_ID */
    case 139: return 0x233510DE;     /* GPU_PCI_DEVICE_ID */
    case 140: return 0x18BE10DE;     /* GPU_PCI_SUBSYSTEM_ID */
    default: return 0;
    }
}

API_OLD cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    ENTER("cuDeviceGetAttribute");
    if (!pi || attrib < 1 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pi = attr_value(dev, attrib);
    return CUDA_SUCCESS;
}

API_OLD cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
    ENTER("cuDeviceCanAccessPeer");
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev) || !valid_dev(peerDev)) return CUDA_ERROR_INVALID_DEVICE;
    *canAccessPeer = dev != peerDev;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------------------------------ */
/* Contexts                                                                                           */
/* ------------------------------------------------------------------------------------------------ */
API_OLD cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    fk_lock(&G.lock);
    G.dev[dev].ctx.refs++;
    G.dev[dev].ctx.active = 1;
    *pctx = &G.dev[dev].ctx;
    fk_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static CUresult primary_release(const char *api, CUdevice dev) {
    CUresult r = CUDA_SUCCESS;
    ENTER(api);
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    fk_lock(&G.lock);
    if (G.dev[dev].ctx.refs <= 0) r = CUDA_ERROR_INVALID_CONTEXT;
    else if (--G.dev[dev].ctx.refs == 0) {
        sync_ctx_locked(&G.dev[dev].ctx);
        G.dev[dev].ctx.active = 0;
        G.dev[dev].ctx.peers = 0;
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuDevicePrimaryCtxRelease(CUdevice dev) { return primary_release("cuDevicePrimaryCtxRelease", dev); }
API_OLD cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return primary_release("cuDevicePrimaryCtxRelease_v2", dev); }

API_OLD cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    ENTER("cuDevicePrimaryCtxGetState");
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    fk_lock(&G.lock);
    *flags = G.dev[dev].ctx.flags;
    *active = G.dev[dev].ctx.active;
    fk_unlock(&G.lock);
    return CUDA_SUCCESS;
}

API_OLD cuCtxSetCurrent(CUcontext ctx) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuCtxSetCurrent");
    fk_lock(&G.lock);
    if (ctx && (!valid_ctx(ctx) || !ctx->active)) r = CUDA_ERROR_INVALID_CONTEXT;
    else tl_ctx = ctx;
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuCtxGetCurrent(CUcontext *pctx) {
    ENTER("cuCtxGetCurrent");
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = tl_ctx;
    return CUDA_SUCCESS;
}

static CUresult ctx_or_current_locked(CUcontext ctx, fk_ctx **out) {
    if (!ctx) return cur_ctx_locked(out);
    if (!valid_ctx(ctx) || !ctx->active) return CUDA_ERROR_INVALID_CONTEXT;
    *out = ctx;
    return CUDA_SUCCESS;
}

static CUresult ctx_get_device(const char *api, CUdevice *device, CUcontext ctx) {
    fk_ctx *c;
    CUresult r;
    ENTER(api);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = ctx_or_current_locked(ctx, &c);
    if (!r) *device = c->dev;
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuCtxGetDevice(CUdevice *device) { return ctx_get_device("cuCtxGetDevice", device, NULL); }
API_13000 cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) {
    return ctx_get_device("cuCtxGetDevice_v2", device, ctx);
}

static CUresult ctx_sync(const char *api, CUcontext ctx) {
    fk_ctx *c;
    CUresult r;
    ENTER(api);
    fk_lock(&G.lock);
    r = ctx_or_current_locked(ctx, &c);
    if (!r) r = capture_ctx_sync_check_locked(c); /* fake_graph.c */
    if (!r) sync_ctx_locked(c);
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuCtxSynchronize(void) { return ctx_sync("cuCtxSynchronize", NULL); }
API_13000 cuCtxSynchronize_v2(CUcontext ctx) { return ctx_sync("cuCtxSynchronize_v2", ctx); }

API_OLD cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuCtxGetStreamPriorityRange");
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    fk_unlock(&G.lock);
    if (r) return r;
    if (leastPriority) *leastPriority = 0;
    if (greatestPriority) *greatestPriority = -5;
    return CUDA_SUCCESS;
}

API_OLD cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuCtxEnablePeerAccess");
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && (!peerContext || !valid_ctx(peerContext) || !peerContext->active)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r && peerContext->dev == c->dev) r = CUDA_ERROR_INVALID_DEVICE;
    if (!r && (c->peers & (1u << peerContext->dev))) r = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    if (!r) c->peers |= 1u << peerContext->dev;
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuCtxDisablePeerAccess(CUcontext peerContext) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuCtxDisablePeerAccess");
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && (!peerContext || !valid_ctx(peerContext))) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r && !(c->peers & (1u << peerContext->dev))) r = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
    if (!r) c->peers &= ~(1u << peerContext->dev);
    fk_unlock(&G.lock);
    return r;
}

/* ------------------------------------------------------------------------------------------------ */
/* Streams                                                                                            */
/* ------------------------------------------------------------------------------------------------ */
static CUresult stream_create(const char *api, CUstream *phStream, unsigned int flags, int priority) {
    fk_ctx *c;
    CUresult r;
    ENTER(api);
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    if (priority > 0) priority = 0;
    if (priority < -5) priority = -5;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) {
        fk_stream *s = new_stream_locked(c, flags, priority, SK_USER);
        vec_push(&G.streams, s);
        *phStream = s;
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    return stream_create("cuStreamCreate", phStream, Flags, 0);
}
API_OLD cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    return stream_create("cuStreamCreateWithPriority", phStream, flags, priority);
}

static CUresult stream_destroy(const char *api, CUstream h) {
    CUresult r = CUDA_SUCCESS;
    ENTER(api);
    fk_lock(&G.lock);
    if ((uintptr_t)h <= 2 || !vec_remove(&G.streams, h)) r = CUDA_ERROR_INVALID_HANDLE;
    else {
        h->destroyed = 1;
        fk_broadcast(&G.cv);
        stream_unref_locked(h);
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuStreamDestroy(CUstream hStream) { return stream_destroy("cuStreamDestroy", hStream); }
API_OLD cuStreamDestroy_v2(CUstream hStream) { return stream_destroy("cuStreamDestroy_v2", hStream); }

API_OLD cuStreamSynchronize(CUstream hStream) {
    fk_stream *s;
    CUresult r;
    ENTER("cuStreamSynchronize");
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) r = capture_sync_check_locked(s); /* fake_graph.c */
    if (!r) {
        s->refs++;
        wait_seq_locked(s, s->enqueued);
        trim_after_sync_locked(s->ctx->dev);
        stream_unref_locked(s);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuStreamQuery(CUstream hStream) {
    fk_stream *s;
    CUresult r;
    ENTER("cuStreamQuery");
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) r = capture_sync_check_locked(s); /* fake_graph.c */
    if (!r && stream_pending(s)) r = CUDA_ERROR_NOT_READY;
    fk_unlock(&G.lock);
    return r;
}

static int valid_event(const fk_event *e) { return e && vec_find(&G.events, e) >= 0; }

API_OLD cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    fk_stream *s;
    CUresult r;
    ENTER("cuStreamWaitEvent");
    if (Flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r && !valid_event(hEvent)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r && capture_wait_event_locked(s, hEvent, Flags, &r)) { /* fake_graph.c: capture join, wait node */
    } else if (!r && hEvent->ipc && hEvent->ipc->imported) push_ipc_wait_locked(s, hEvent);
    else if (!r && hEvent->recorded) push_wait_locked(s, hEvent->rs, hEvent->rseq);
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuStreamGetPriority(CUstream hStream, int *priority) {
    fk_stream *s;
    CUresult r;
    ENTER("cuStreamGetPriority");
    if (!priority) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) *priority = s->priority;
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuStreamGetFlags(CUstream hStream, unsigned int *flags) {
    fk_stream *s;
    CUresult r;
    ENTER("cuStreamGetFlags");
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) *flags = s->flags;
    fk_unlock(&G.lock);
    return r;
}

static CUresult stream_get_ctx(const char *api, CUstream hStream, CUcontext *pctx, CUgreenCtx *pg) {
    fk_stream *s;
    CUresult r;
    ENTER(api);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) *pctx = s->ctx;
    if (!r && pg) *pg = NULL;
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    return stream_get_ctx("cuStreamGetCtx", hStream, pctx, NULL);
}
API_12050 cuStreamGetCtx_v2(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx) {
    return stream_get_ctx("cuStreamGetCtx_v2", hStream, pCtx, pGreenCtx);
}

API_OLD cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
    fk_stream *s;
    CUresult r;
    ENTER("cuLaunchHostFunc");
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r) r = capture_check_locked(s, 0); /* fake_graph.c */
    if (!r) {
        fk_op *op = new_op(OP_HOSTFN, "cuLaunchHostFunc");
        op->fn = fn;
        op->ud = userData;
        enqueue_locked(s, op);
    }
    fk_unlock(&G.lock);
    return r;
}

/* ------------------------------------------------------------------------------------------------ */
/* Events                                                                                             */
/* ------------------------------------------------------------------------------------------------ */
API_OLD cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuEventCreate");
    if (!phEvent || (Flags & ~7u)) return CUDA_ERROR_INVALID_VALUE;
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) {
        fk_event *e = (fk_event *)calloc(1, sizeof *e);
        if (!e) abort();
        e->magic = FK_MAGIC_EVENT;
        e->ctx = c;
        e->flags = Flags;
        e->refs = 1;
        if ((Flags & CU_EVENT_INTERPROCESS) && !(e->ipc = ipc_event_new())) {
            free(e);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            vec_push(&G.events, e);
            *phEvent = e;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

static CUresult event_destroy(const char *api, CUevent e) {
    CUresult r = CUDA_SUCCESS;
    ENTER(api);
    fk_lock(&G.lock);
    if (!e || !vec_remove(&G.events, e)) r = CUDA_ERROR_INVALID_HANDLE;
    else event_unref_locked(e);
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuEventDestroy(CUevent hEvent) { return event_destroy("cuEventDestroy", hEvent); }
API_OLD cuEventDestroy_v2(CUevent hEvent) { return event_destroy("cuEventDestroy_v2", hEvent); }

API_OLD cuEventRecord(CUevent hEvent, CUstream hStream) {
    fk_stream *s;
    CUresult r;
    ENTER("cuEventRecord");
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r && !valid_event(hEvent)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r && !capture_event_record_locked(s, hEvent, &r) /* fake_graph.c */) {
        fk_op *op = new_op(OP_RECORD, "cuEventRecord");
        fk_event *e = hEvent;
        e->gen++;
        e->t_valid = 0;
        if (e->rs) stream_unref_locked(e->rs);
        e->rs = s;
        s->refs++;
        e->recorded = 1;
        op->ev = e;
        op->gen = e->gen;
        if (e->ipc) op->ipc_ticket = ipc_event_ticket(e);
        e->refs++;
        e->rseq = enqueue_locked(s, op);
    }
    fk_unlock(&G.lock);
    return r;
}

static int event_done_locked(const fk_event *e) { return !e->recorded || e->rs->completed >= e->rseq; }

API_OLD cuEventQuery(CUevent hEvent) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuEventQuery");
    fk_lock(&G.lock);
    if (!valid_event(hEvent)) r = CUDA_ERROR_INVALID_HANDLE;
    else if ((r = capture_event_check_locked(hEvent)) != CUDA_SUCCESS) { /* fake_graph.c */
    } else if (hEvent->ipc && hEvent->ipc->imported ? !ipc_event_done(hEvent) : !event_done_locked(hEvent))
        r = CUDA_ERROR_NOT_READY;
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuEventSynchronize(CUevent hEvent) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuEventSynchronize");
    fk_lock(&G.lock);
    if (!valid_event(hEvent)) r = CUDA_ERROR_INVALID_HANDLE;
    else if ((r = capture_event_check_locked(hEvent)) != CUDA_SUCCESS) { /* fake_graph.c */
    } else if (hEvent->ipc && hEvent->ipc->imported) {
        /* an event of another process: its shared state says when its records complete */
        fk_event *e = hEvent;
        e->refs++;
        while (!ipc_event_done(e)) {
            fk_unlock(&G.lock);
            fk_sleep_us(50);
            fk_lock(&G.lock);
        }
        event_unref_locked(e);
    } else if (hEvent->recorded) {
        fk_event *e = hEvent;
        fk_stream *s = e->rs;
        uint64_t seq = e->rseq;
        e->refs++;
        s->refs++;
        wait_seq_locked(s, seq);
        trim_after_sync_locked(s->ctx->dev);
        stream_unref_locked(s);
        event_unref_locked(e);
    }
    fk_unlock(&G.lock);
    return r;
}

static CUresult elapsed(const char *api, float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    CUresult r = CUDA_SUCCESS;
    ENTER(api);
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_event(hStart) || !valid_event(hEnd)) r = CUDA_ERROR_INVALID_HANDLE;
    else if ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING) r = CUDA_ERROR_INVALID_HANDLE;
    else if (!hStart->recorded || !hEnd->recorded) r = CUDA_ERROR_INVALID_HANDLE;
    else if (!event_done_locked(hStart) || !event_done_locked(hEnd) || !hStart->t_valid || !hEnd->t_valid)
        r = CUDA_ERROR_NOT_READY;
    else *pMilliseconds = (float)(hEnd->t_ms - hStart->t_ms);
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return elapsed("cuEventElapsedTime", pMilliseconds, hStart, hEnd);
}
API_12080 cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return elapsed("cuEventElapsedTime_v2", pMilliseconds, hStart, hEnd);
}

/* ------------------------------------------------------------------------------------------------ */
/* Memory management                                                                                  */
/* ------------------------------------------------------------------------------------------------ */
API_OLD cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    fk_ctx *c;
    fk_block *b;
    CUresult r;
    ENTER("cuMemAlloc_v2");
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (G.free_us_per_gib && fk_now_ms() < G.free_backlog_ms) {
        /* CUDRV_FAKE_FREE_US_PER_GIB: too soon after a free, the allocation waits. */
        fk_unlock(&G.lock);
        fk_sleep_us(3000);
        fk_lock(&G.lock);
    }
    r = cur_ctx_locked(&c);
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r) r = reserve_block_locked(c->dev, bytesize, &b);
    if (!r) {
        fk_alloc *a = new_alloc(b->base, bytesize, AK_DEVICE, c->dev, b);
        tab_insert(&G.dtab, a);
        *dptr = a->base;
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemFree_v2(CUdeviceptr dptr) {
    fk_ctx *c;
    fk_alloc *a;
    CUresult r;
    ENTER("cuMemFree_v2");
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && dptr == 0) goto out; /* freeing NULL is a no-op */
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r && graph_mem_free_locked(dptr, &r)) goto out; /* fake_graph.c: graph memory */
    if (!r) {
        a = tab_exact(&G.dtab, dptr, NULL);
        if (!a) {
            a = tab_exact(&G.htab, dptr, NULL);
            if (a && a->kind != AK_MANAGED) a = NULL;
        }
        /* a legacy IPC mapping is closed with cuIpcCloseMemHandle, not freed */
        if (!a || a->free_pending || (a->kind == AK_IPC && a->ipc == 1)) r = CUDA_ERROR_INVALID_VALUE;
        else {
            if (G.free_us_per_gib && a->kind == AK_DEVICE) {
                /* CUDRV_FAKE_FREE_US_PER_GIB: the work this free leaves behind follows what earlier
                 * frees left. */
                double now = fk_now_ms(), start = G.free_backlog_ms > now ? G.free_backlog_ms : now;
                G.free_backlog_ms = start + (double)a->size * (double)G.free_us_per_gib / (double)(1ull << 30) / 1000.0;
            }
            free_alloc_locked(a);
        }
    }
out:
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemGetInfo_v2(size_t *free_, size_t *total) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuMemGetInfo_v2");
    if (!free_ || !total) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) {
        fk_device *d = &G.dev[c->dev];
        *total = (size_t)d->limit;
        *free_ = (size_t)(d->limit - d->reserved);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuMemAllocManaged");
    if (!dptr || bytesize == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 24b) */
    if (!r) {
        fk_device *d = &G.dev[c->dev];
        uint64_t sz = round_up(bytesize, 512);
        void *p;
        if (d->reserved + sz > d->limit) r = CUDA_ERROR_OUT_OF_MEMORY;
        else if (!(p = host_aligned_alloc(bytesize))) r = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            fk_block *b = (fk_block *)calloc(1, sizeof *b);
            fk_alloc *a;
            if (!b) abort();
            b->base = (uint64_t)(uintptr_t)p;
            b->size = sz;
            b->dev = -1;
            b->backing = (unsigned char *)p;
            b->owns_backing = 2;
            d->reserved += sz;
            a = new_alloc(b->base, bytesize, AK_MANAGED, c->dev, b);
            tab_insert(&G.htab, a);
            *dptr = a->base;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

static int htab_overlaps(uint64_t base, uint64_t size) {
    long i = tab_floor(&G.htab, base + size - 1);
    if (i < 0) return 0;
    {
        fk_alloc *a = (fk_alloc *)G.htab.v[i];
        return a->base + a->size > base;
    }
}

API_OLD cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuMemHostAlloc");
    if (!pp || bytesize == 0 || (Flags & ~(unsigned)CU_MEMHOSTALLOC_ALL)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r) {
        void *p = host_aligned_alloc(bytesize);
        if (!p) r = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            fk_block *b = (fk_block *)calloc(1, sizeof *b);
            fk_alloc *a;
            if (!b) abort();
            b->base = (uint64_t)(uintptr_t)p;
            b->size = bytesize;
            b->dev = -1;
            b->backing = (unsigned char *)p;
            b->owns_backing = 2;
            a = new_alloc(b->base, bytesize, AK_HOSTALLOC, -1, b);
            tab_insert(&G.htab, a);
            *pp = p;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemFreeHost(void *p) {
    fk_alloc *a;
    CUresult r = CUDA_SUCCESS;
    ENTER("cuMemFreeHost");
    fk_lock(&G.lock);
    a = tab_exact(&G.htab, (uint64_t)(uintptr_t)p, NULL);
    if (!p || !a || a->kind != AK_HOSTALLOC) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r) free_alloc_locked(a);
    fk_unlock(&G.lock);
    return r;
}

static CUresult host_register(const char *api, void *p, size_t bytesize, unsigned int Flags) {
    fk_ctx *c;
    CUresult r;
    ENTER(api);
    if (!p || bytesize == 0 || (Flags & ~(unsigned)CU_MEMHOSTREGISTER_ALL)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r && htab_overlaps((uint64_t)(uintptr_t)p, bytesize)) r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (!r) {
        fk_block *b = (fk_block *)calloc(1, sizeof *b);
        if (!b) abort();
        b->base = (uint64_t)(uintptr_t)p;
        b->size = bytesize;
        b->dev = -1;
        b->backing = (unsigned char *)p;
        tab_insert(&G.htab, new_alloc(b->base, bytesize, AK_REGISTERED, -1, b));
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
    return host_register("cuMemHostRegister", p, bytesize, Flags);
}
API_OLD cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    return host_register("cuMemHostRegister_v2", p, bytesize, Flags);
}

API_OLD cuMemHostUnregister(void *p) {
    fk_ctx *c;
    fk_alloc *a;
    CUresult r;
    ENTER("cuMemHostUnregister");
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r) {
        a = tab_exact(&G.htab, (uint64_t)(uintptr_t)p, NULL);
        if (!p || !a || a->kind != AK_REGISTERED) r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
        else free_alloc_locked(a);
    }
    fk_unlock(&G.lock);
    return r;
}

/* ---- memset / memcpy ---- */
static int host_is_pinned_locked(const void *p, size_t n) {
    uint64_t a = (uint64_t)(uintptr_t)p;
    fk_alloc *al = tab_containing(&G.htab, a);
    return al && a + n <= al->base + al->size;
}

static CUresult submit_memset(const char *api, CUdeviceptr dst, uint32_t value, size_t n, int elem, CUstream h,
                              int sync) {
    fk_stream *s;
    CUresult r;
    ENTER(api);
    if (elem == 4 && (dst & 3)) return CUDA_ERROR_INVALID_VALUE;
    if (elem == 2 && (dst & 1)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = sync ? get_stream_locked(NULL, &s) : get_stream_locked(h, &s);
    if (!r) r = capture_check_locked(s, sync); /* fake_graph.c */
    if (!r) {
        fk_op *op = new_op(OP_MEMSET, api);
        uint64_t seq;
        op->dst = dst;
        op->value = value;
        op->count = n;
        op->elem = elem;
        seq = enqueue_locked(s, op);
        if (sync) wait_seq_locked(s, seq);
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    return submit_memset("cuMemsetD8_v2", dstDevice, uc, N, 1, NULL, 1);
}
API_OLD cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
    return submit_memset("cuMemsetD32_v2", dstDevice, ui, N, 4, NULL, 1);
}
API_OLD cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N) {
    return submit_memset("cuMemsetD16_v2", dstDevice, us, N, 2, NULL, 1);
}
API_OLD cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream) {
    return submit_memset("cuMemsetD16Async", dstDevice, us, N, 2, hStream, 0);
}
API_OLD cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
    return submit_memset("cuMemsetD8Async", dstDevice, uc, N, 1, hStream, 0);
}
API_OLD cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
    return submit_memset("cuMemsetD32Async", dstDevice, ui, N, 4, hStream, 0);
}

/* sync: 0 = async, 1 = synchronous API (legacy stream, wait). */
static CUresult submit_copy(const char *api, int kind, uint64_t dst, uint64_t src, size_t n, CUstream h, int sync) {
    fk_stream *s;
    CUresult r;
    ENTER(api);
    if (n && ((kind == CP_HTOD && !src) || (kind == CP_DTOH && !dst))) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = sync ? get_stream_locked(NULL, &s) : get_stream_locked(h, &s);
    if (!r) r = capture_check_locked(s, sync); /* fake_graph.c */
    if (!r) {
        fk_op *op = new_op(OP_COPY, api);
        uint64_t seq;
        op->cpkind = kind;
        op->dst = dst;
        op->src = src;
        op->count = n;
        op->elem = 1;
        if (!sync && kind == CP_HTOD && n && !host_is_pinned_locked((const void *)(uintptr_t)src, n) &&
            !capture_stream_locked(s) /* fake_graph.c: a captured copy reads it at launch */) {
            /* pageable source: staged at the call, as the real driver does */
            void *snap = malloc(n);
            if (!snap) abort();
            memcpy(snap, (const void *)(uintptr_t)src, n);
            op->src = (uint64_t)(uintptr_t)snap;
            op->src_snapshot = 1;
        }
        if (!sync && kind == CP_DTOH && n && !host_is_pinned_locked((const void *)(uintptr_t)dst, n))
            sync = 1; /* pageable destination: synchronous, as in the real driver */
        seq = enqueue_locked(s, op);
        if (sync) wait_seq_locked(s, seq);
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    return submit_copy("cuMemcpyHtoD_v2", CP_HTOD, dstDevice, (uint64_t)(uintptr_t)srcHost, ByteCount, NULL, 1);
}
API_OLD cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return submit_copy("cuMemcpyDtoH_v2", CP_DTOH, (uint64_t)(uintptr_t)dstHost, srcDevice, ByteCount, NULL, 1);
}
API_OLD cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    return submit_copy("cuMemcpyDtoD_v2", CP_DTOD, dstDevice, srcDevice, ByteCount, NULL, 1);
}
API_OLD cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream) {
    return submit_copy("cuMemcpyHtoDAsync_v2", CP_HTOD, dstDevice, (uint64_t)(uintptr_t)srcHost, ByteCount,
                       hStream, 0);
}
API_OLD cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    return submit_copy("cuMemcpyDtoHAsync_v2", CP_DTOH, (uint64_t)(uintptr_t)dstHost, srcDevice, ByteCount,
                       hStream, 0);
}
API_OLD cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    return submit_copy("cuMemcpyDtoDAsync_v2", CP_DTOD, dstDevice, srcDevice, ByteCount, hStream, 0);
}

static CUresult check_peer_ctxs(const char *api, CUcontext a, CUcontext b) {
    CUresult r = CUDA_SUCCESS;
    ENTER(api);
    fk_lock(&G.lock);
    if (!a || !b || !valid_ctx(a) || !valid_ctx(b) || !a->active || !b->active) r = CUDA_ERROR_INVALID_CONTEXT;
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext,
                     size_t ByteCount) {
    CUresult r = check_peer_ctxs("cuMemcpyPeer", dstContext, srcContext);
    if (r) return r;
    return submit_copy("cuMemcpyPeer", CP_DTOD, dstDevice, srcDevice, ByteCount, NULL, 1);
}
API_OLD cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                          CUcontext srcContext, size_t ByteCount, CUstream hStream) {
    CUresult r = check_peer_ctxs("cuMemcpyPeerAsync", dstContext, srcContext);
    if (r) return r;
    return submit_copy("cuMemcpyPeerAsync", CP_DTOD, dstDevice, srcDevice, ByteCount, hStream, 0);
}

/* ------------------------------------------------------------------------------------------------ */
/* Memory pools (CUDA_ERROR_NOT_SUPPORTED in tcc mode)                                               */
/* ------------------------------------------------------------------------------------------------ */
static int valid_pool(const fk_pool *p) { return p && vec_find(&G.pools, p) >= 0; }

API_11020 cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    ENTER("cuDeviceGetDefaultMemPool");
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[dev].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    *pool_out = G.dev[dev].default_pool;
    return CUDA_SUCCESS;
}

API_11020 cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    ENTER("cuDeviceGetMemPool");
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[dev].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    fk_lock(&G.lock);
    *pool = G.dev[dev].cur_pool;
    fk_unlock(&G.lock);
    return CUDA_SUCCESS;
}

API_11020 cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuDeviceSetMemPool");
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[dev].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    fk_lock(&G.lock);
    if (!valid_pool(pool)) r = CUDA_ERROR_INVALID_HANDLE;
    else if (pool->dev != dev) r = CUDA_ERROR_INVALID_DEVICE;
    else G.dev[dev].cur_pool = pool;
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    int dev;
    unsigned supported;
    ENTER("cuMemPoolCreate");
    if (!pool || !poolProps) return CUDA_ERROR_INVALID_VALUE;
    if (poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    dev = poolProps->location.id;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (G.dev[dev].mode == MODE_TCC) return CUDA_ERROR_NOT_SUPPORTED;
    supported = (unsigned)attr_value(dev, 119);
    if ((unsigned)poolProps->handleTypes & ~supported) return CUDA_ERROR_NOT_SUPPORTED;
    fk_lock(&G.lock);
    *pool = new_pool_locked(dev, 0);
    (*pool)->max_size = poolProps->maxSize;
    (*pool)->handle_types = poolProps->handleTypes;
    fk_unlock(&G.lock);
    return CUDA_SUCCESS;
}

/* Validates a pool handle for a pool entry point (lock held). No pool exists on a tcc device; an
   invalid handle gives NOT_SUPPORTED where the current device (or every device) is tcc. */
static int all_tcc(void) {
    int i;
    for (i = 0; i < G.ndev; i++)
        if (G.dev[i].mode != MODE_TCC) return 0;
    return 1;
}
static CUresult pool_entry_locked(CUmemoryPool pool) {
    fk_ctx *c = tl_ctx;
    if (valid_pool(pool)) return CUDA_SUCCESS; /* pools only exist on devices that support them */
    if (all_tcc() || (c && c->active && G.dev[c->dev].mode == MODE_TCC)) return CUDA_ERROR_NOT_SUPPORTED;
    return CUDA_ERROR_INVALID_HANDLE;
}

API_11020 cuMemPoolDestroy(CUmemoryPool pool) {
    CUresult r;
    ENTER("cuMemPoolDestroy");
    fk_lock(&G.lock);
    r = pool_entry_locked(pool);
    if (!r && pool->is_default) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) {
        vec_remove(&G.pools, pool);
        if (G.dev[pool->dev].cur_pool == pool) G.dev[pool->dev].cur_pool = G.dev[pool->dev].default_pool;
        pool->destroyed = 1;
        pool->magic = 0;
        pool_release_cached_locked(pool, 0);
        pool_maybe_free_locked(pool);
    }
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    CUresult r;
    ENTER("cuMemPoolSetAttribute");
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = pool_entry_locked(pool);
    if (!r) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
            pool->reuse[attr - 1] = *(int *)value != 0;
            break;
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            pool->threshold = *(cuuint64_t *)value;
            break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
            if (*(cuuint64_t *)value != 0) r = CUDA_ERROR_INVALID_VALUE;
            else pool->reserved_high = pool->reserved;
            break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
            if (*(cuuint64_t *)value != 0) r = CUDA_ERROR_INVALID_VALUE;
            else pool->used_high = pool->used;
            break;
        default:
            r = CUDA_ERROR_INVALID_VALUE;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    CUresult r;
    ENTER("cuMemPoolGetAttribute");
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = pool_entry_locked(pool);
    if (!r) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
            *(int *)value = pool->reuse[attr - 1];
            break;
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = pool->threshold; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = pool->reserved; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = pool->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = pool->used; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = pool->used_high; break;
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    CUresult r;
    ENTER("cuMemPoolTrimTo");
    fk_lock(&G.lock);
    r = pool_entry_locked(pool);
    if (!r) pool_release_cached_locked(pool, minBytesToKeep);
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count) {
    CUresult r;
    size_t i;
    ENTER("cuMemPoolSetAccess");
    if (!map && count) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = pool_entry_locked(pool);
    for (i = 0; !r && i < count; i++) {
        int f = map[i].flags;
        if (map[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_dev(map[i].location.id) ||
            (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
             f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
            r = CUDA_ERROR_INVALID_VALUE;
        else if (map[i].location.id == pool->dev && f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            r = CUDA_ERROR_INVALID_DEVICE;
    }
    for (i = 0; !r && i < count; i++) pool->access[map[i].location.id] = map[i].flags;
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolGetAccess(int *flags, CUmemoryPool memPool, CUmemLocation *location) {
    CUresult r;
    ENTER("cuMemPoolGetAccess");
    if (!flags || !location) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = pool_entry_locked(memPool);
    if (!r && (location->type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_dev(location->id)))
        r = CUDA_ERROR_INVALID_VALUE;
    if (!r) *flags = memPool->access[location->id];
    fk_unlock(&G.lock);
    return r;
}

static CUresult alloc_async(const char *api, CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream h,
                            int from_pool) {
    fk_stream *s;
    fk_alloc *a;
    CUresult r;
    ENTER(api);
    fk_lock(&G.lock);
    r = get_stream_locked(h, &s);
    if (!r && G.dev[s->ctx->dev].mode == MODE_TCC) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && (!dptr || bytesize == 0 || (from_pool && !pool))) r = CUDA_ERROR_INVALID_VALUE;
    if (!r && pool) r = valid_pool(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
    if (!r && pool && G.dev[pool->dev].mode == MODE_TCC) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && pool && pool->imported) r = CUDA_ERROR_INVALID_VALUE; /* imported pools only import */
    if (!r && !capture_alloc_async_locked(s, bytesize, &a, &r) /* fake_graph.c: alloc node */)
        r = pool_alloc_locked(pool ? pool : G.dev[s->ctx->dev].cur_pool, bytesize, &a);
    if (!r) *dptr = a->base;
    fk_unlock(&G.lock);
    return r;
}
API_11020 cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async("cuMemAllocAsync", dptr, bytesize, NULL, hStream, 0);
}
API_11020 cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return alloc_async("cuMemAllocFromPoolAsync", dptr, bytesize, pool, hStream, 1);
}

API_11020 cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    fk_stream *s;
    fk_alloc *a;
    CUresult r;
    ENTER("cuMemFreeAsync");
    fk_lock(&G.lock);
    r = get_stream_locked(hStream, &s);
    if (!r && G.dev[s->ctx->dev].mode == MODE_TCC) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && !capture_free_async_locked(s, dptr, &r) /* fake_graph.c: free node, graph memory */) {
        a = tab_exact(&G.dtab, dptr, NULL);
        if (!a || a->free_pending) r = CUDA_ERROR_INVALID_VALUE;
        else {
            fk_op *op = new_op(OP_FREE, "cuMemFreeAsync");
            a->free_pending = 1;
            op->fa = a;
            enqueue_locked(s, op);
        }
    }
    fk_unlock(&G.lock);
    return r;
}

/* ------------------------------------------------------------------------------------------------ */
/* Virtual memory management (CUDA_ERROR_NOT_SUPPORTED where the device has none)                    */
/* ------------------------------------------------------------------------------------------------ */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUmemAllocationProp_st {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp layout");
_Static_assert(sizeof(((CUmemAllocationProp *)0)->allocFlags) == 8, "CUmemAllocationProp layout");
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0
#define CU_MEM_ALLOC_GRANULARITY_RECOMMENDED 1
#define FK_GRANULARITY (2ULL << 20)
#define FK_VA_BASE 0x600000000000ULL
#define FK_VA_END 0x700000000000ULL
#define FK_HANDLE_BASE 0x10000ULL    /* first CUmemGenericAllocationHandle */
#define FK_SHARED_BASE 0x40000000ULL /* shareable handles: not valid fds or Windows handles */

/* Whether any device has VMM (lock held or after initialisation). */
static int any_vmm(void) {
    int i;
    for (i = 0; i < G.ndev; i++)
        if (G.dev[i].vmm) return 1;
    return 0;
}

/* Entry of every VMM function: 801 when no device has VMM, whatever the arguments. */
#define ENTER_VMM(name)                                  \
    do {                                                 \
        ENTER(name);                                     \
        if (!any_vmm()) return CUDA_ERROR_NOT_SUPPORTED; \
    } while (0)

/* The handle types a device can export: those of attributes 103-105. */
static int vmm_handle_types(int dev) {
    return G.dev[dev].mode == MODE_LINUX ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                         : (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT);
}

static CUresult check_alloc_prop(const CUmemAllocationProp *prop, int *dev) {
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    if (!G.dev[prop->location.id].vmm) return CUDA_ERROR_NOT_SUPPORTED;
    *dev = prop->location.id;
    return CUDA_SUCCESS;
}

/* The live physical allocation of a handle the caller holds (lock held), or NULL. */
static fk_phys *find_phys_locked(CUmemGenericAllocationHandle h) {
    size_t i;
    for (i = 0; i < G.phys.n; i++) {
        fk_phys *p = (fk_phys *)G.phys.v[i];
        if (p->handle == h) return p->handle_refs > 0 ? p : NULL;
    }
    return NULL;
}

/* Frees a physical allocation once no handle and no mapping holds it (lock held). */
static void phys_maybe_free_locked(fk_phys *p) {
    if (p->handle_refs > 0 || p->maps > 0) return;
    G.dev[p->dev].reserved -= p->size;
    release_block_locked(p->blk); /* dev -1: frees the backing, or marks it dead while pinned */
    vec_remove(&G.phys, p);
    free(p);
}

/* The reservation that holds [base, base + size), or NULL (lock held). */
static fk_vres *vres_containing(uint64_t base, uint64_t size) {
    size_t i;
    for (i = 0; i < G.vres.n; i++) {
        fk_vres *r = (fk_vres *)G.vres.v[i];
        if (base >= r->base && base + size >= base && base + size <= r->base + r->size) return r;
        if (r->base > base) break;
    }
    return NULL;
}

/* Whether [base, base + size) overlaps no reservation; *pos: where a reservation there goes. */
static int vres_free(uint64_t base, uint64_t size, size_t *pos) {
    size_t i;
    for (i = 0; i < G.vres.n; i++) {
        fk_vres *r = (fk_vres *)G.vres.v[i];
        if (r->base + r->size <= base) continue;
        if (r->base >= base + size) break;
        return 0;
    }
    *pos = i;
    return 1;
}

/* Whether some mapping overlaps [base, base + size) (lock held). */
static int mapped_anywhere(uint64_t base, uint64_t size) {
    long i = tab_floor(&G.mtab, base + size - 1);
    if (i < 0) return 0;
    {
        const fk_alloc *m = (const fk_alloc *)G.mtab.v[i];
        return m->base + m->size > base;
    }
}

/* The mappings that exactly tile [ptr, ptr + size): the first starts at ptr, each next one starts
   where the previous ends, the last ends at ptr + size. *first, *count: their indices in G.mtab. */
static CUresult whole_mappings(uint64_t ptr, uint64_t size, long *first, long *count) {
    long i;
    uint64_t cur = ptr;
    if (size == 0 || ptr + size < ptr || !tab_exact(&G.mtab, ptr, &i)) return CUDA_ERROR_INVALID_VALUE;
    *first = i;
    while (cur < ptr + size) {
        const fk_alloc *m;
        if (i >= (long)G.mtab.n) return CUDA_ERROR_INVALID_VALUE;
        m = (const fk_alloc *)G.mtab.v[i];
        if (m->base != cur || m->base + m->size > ptr + size) return CUDA_ERROR_INVALID_VALUE;
        cur = m->base + m->size;
        i++;
    }
    *count = i - *first;
    return CUDA_SUCCESS;
}

API_OLD cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
    CUresult r;
    int dev;
    ENTER_VMM("cuMemGetAllocationGranularity");
    if (!granularity ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    r = check_alloc_prop(prop, &dev);
    if (!r) *granularity = (size_t)FK_GRANULARITY;
    return r;
}

API_OLD cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                            unsigned long long flags) {
    uint64_t align = FK_GRANULARITY, cand;
    size_t pos = 0;
    int pass, found = 0;
    ENTER_VMM("cuMemAddressReserve");
    if (!ptr || size == 0 || size % FK_GRANULARITY || (alignment & (alignment - 1)) || flags != 0 ||
        size > FK_VA_END - FK_VA_BASE)
        return CUDA_ERROR_INVALID_VALUE;
    if (alignment > align) align = alignment;
    fk_lock(&G.lock);
    if (addr && addr % align == 0 && addr >= FK_VA_BASE && addr <= FK_VA_END - size && vres_free(addr, size, &pos)) {
        cand = addr;
        found = 1;
    }
    if (!G.vcursor) G.vcursor = FK_VA_BASE;
    for (pass = 0; pass < 2 && !found; pass++) {
        cand = round_up(pass == 0 ? G.vcursor : FK_VA_BASE, align);
        while (!found && cand <= FK_VA_END - size) {
            const fk_vres *in_the_way = NULL;
            size_t i;
            for (i = 0; i < G.vres.n && !in_the_way; i++) {
                const fk_vres *r = (const fk_vres *)G.vres.v[i];
                if (r->base < cand + size && r->base + r->size > cand) in_the_way = r;
            }
            if (in_the_way) cand = round_up(in_the_way->base + in_the_way->size, align);
            else found = vres_free(cand, size, &pos);
        }
    }
    if (found) {
        fk_vres *r = (fk_vres *)calloc(1, sizeof *r);
        if (!r) abort();
        r->base = cand;
        r->size = size;
        vec_insert(&G.vres, pos, r);
        G.vcursor = cand + size;
        *ptr = cand;
    }
    fk_unlock(&G.lock);
    return found ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

API_OLD cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    size_t i;
    ENTER_VMM("cuMemAddressFree");
    fk_lock(&G.lock);
    for (i = 0; i < G.vres.n; i++) {
        fk_vres *v = (fk_vres *)G.vres.v[i];
        if (v->base == ptr && v->size == size && !mapped_anywhere(ptr, size)) {
            vec_remove_at(&G.vres, i);
            free(v);
            r = CUDA_SUCCESS;
            break;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                    unsigned long long flags) {
    CUresult r;
    int dev;
    ENTER_VMM("cuMemCreate");
    if (!handle || size == 0 || size % FK_GRANULARITY || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    r = check_alloc_prop(prop, &dev);
    if (r) return r;
    if (prop->requestedHandleTypes & ~vmm_handle_types(dev)) return CUDA_ERROR_NOT_SUPPORTED;
    fk_lock(&G.lock);
    if (size > G.dev[dev].limit || G.dev[dev].reserved + size > G.dev[dev].limit) r = CUDA_ERROR_OUT_OF_MEMORY;
    else {
        fk_phys *p = (fk_phys *)calloc(1, sizeof *p);
        fk_block *b = (fk_block *)calloc(1, sizeof *b);
        if (!p || !b) abort();
        b->size = size;
        b->dev = -1; /* no device address range of its own: it is reached through mappings */
        b->owns_backing = 1;
        p->handle = FK_HANDLE_BASE + ++G.next_handle;
        p->dev = dev;
        p->size = size;
        p->handle_types = prop->requestedHandleTypes;
        memcpy(p->alloc_flags, &prop->allocFlags, sizeof p->alloc_flags);
        p->blk = b;
        p->handle_refs = 1;
        G.dev[dev].reserved += size;
        vec_push(&G.phys, p);
        *handle = p->handle;
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemRelease(CUmemGenericAllocationHandle handle) {
    fk_phys *p;
    CUresult r = CUDA_SUCCESS;
    ENTER_VMM("cuMemRelease");
    fk_lock(&G.lock);
    p = find_phys_locked(handle);
    if (!p) r = CUDA_ERROR_INVALID_VALUE;
    else {
        p->handle_refs--;
        phys_maybe_free_locked(p);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                 unsigned long long flags) {
    fk_phys *p;
    CUresult r = CUDA_SUCCESS;
    ENTER_VMM("cuMemMap");
    if (size == 0 || ptr % FK_GRANULARITY || size % FK_GRANULARITY || offset != 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    p = find_phys_locked(handle);
    if (!p || size > p->size || !vres_containing(ptr, size) || mapped_anywhere(ptr, size))
        r = CUDA_ERROR_INVALID_VALUE;
    else {
        fk_alloc *m = new_alloc(ptr, size, AK_MAPPED, p->dev, p->blk);
        m->phys = p;
        m->boff = offset;
        tab_insert(&G.mtab, m);
        p->maps++;
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemUnmap(CUdeviceptr ptr, size_t size) {
    long first, count, i;
    CUresult r;
    ENTER_VMM("cuMemUnmap");
    fk_sleep_us(G.unmap_us);
    fk_lock(&G.lock);
    r = whole_mappings(ptr, size, &first, &count);
    for (i = 0; !r && i < count; i++) {
        fk_alloc *m = (fk_alloc *)G.mtab.v[first];
        fk_phys *p = m->phys;
        vec_remove_at(&G.mtab, (size_t)first);
        free(m);
        p->maps--;
        phys_maybe_free_locked(p);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    long first, n, i;
    size_t k;
    CUresult r = CUDA_SUCCESS;
    ENTER_VMM("cuMemSetAccess");
    if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    for (k = 0; k < count; k++) {
        int f = desc[k].flags;
        if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
            (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
             f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
            return CUDA_ERROR_INVALID_VALUE;
        if (!valid_dev(desc[k].location.id)) return CUDA_ERROR_INVALID_DEVICE;
        if (!G.dev[desc[k].location.id].vmm) return CUDA_ERROR_NOT_SUPPORTED;
    }
    fk_lock(&G.lock);
    r = whole_mappings(ptr, size, &first, &n);
    for (i = 0; !r && i < n; i++)
        for (k = 0; k < count; k++)
            ((fk_alloc *)G.mtab.v[first + i])->access[desc[k].location.id] = (unsigned char)desc[k].flags;
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr) {
    fk_alloc *m;
    CUresult r = CUDA_SUCCESS;
    ENTER_VMM("cuMemGetAccess");
    if (!flags || !location || location->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(location->id)) return CUDA_ERROR_INVALID_DEVICE;
    fk_lock(&G.lock);
    m = tab_containing(&G.mtab, ptr);
    if (!m) r = CUDA_ERROR_INVALID_VALUE;
    else *flags = m->access[location->id];
    fk_unlock(&G.lock);
    return r;
}

API_11000 cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    fk_alloc *m;
    CUresult r = CUDA_SUCCESS;
    ENTER_VMM("cuMemRetainAllocationHandle");
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    m = tab_containing(&G.mtab, (uint64_t)(uintptr_t)addr);
    if (!m) r = CUDA_ERROR_INVALID_VALUE;
    else {
        m->phys->handle_refs++;
        *handle = m->phys->handle;
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
    fk_phys *p;
    CUresult r = CUDA_SUCCESS;
    ENTER_VMM("cuMemGetAllocationPropertiesFromHandle");
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    p = find_phys_locked(handle);
    if (!p) r = CUDA_ERROR_INVALID_VALUE;
    else {
        memset(prop, 0, sizeof *prop);
        prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop->requestedHandleTypes = p->handle_types;
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = p->dev;
        memcpy(&prop->allocFlags, p->alloc_flags, sizeof p->alloc_flags);
    }
    fk_unlock(&G.lock);
    return r;
}

static int single_handle_type(int t) {
    return t == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || t == CU_MEM_HANDLE_TYPE_WIN32 ||
           t == CU_MEM_HANDLE_TYPE_WIN32_KMT;
}

API_OLD cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle, int handleType,
                                     unsigned long long flags) {
    fk_phys *p;
    CUresult r = CUDA_SUCCESS;
    ENTER_VMM("cuMemExportToShareableHandle");
    if (!shareableHandle || flags != 0 || !single_handle_type(handleType)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    p = find_phys_locked(handle);
    if (!p || !(p->handle_types & handleType)) r = CUDA_ERROR_INVALID_VALUE;
    else {
        if (!p->shared) p->shared = FK_SHARED_BASE + 4 * ++G.next_shared;
        if (handleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) *(int *)shareableHandle = (int)p->shared;
        else if (handleType == CU_MEM_HANDLE_TYPE_WIN32) *(void **)shareableHandle = (void *)(uintptr_t)p->shared;
        else *(unsigned int *)shareableHandle = (unsigned int)p->shared;
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int shHandleType) {
    size_t i;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    ENTER_VMM("cuMemImportFromShareableHandle");
    if (!handle || !single_handle_type(shHandleType)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    for (i = 0; i < G.phys.n; i++) {
        fk_phys *p = (fk_phys *)G.phys.v[i];
        if (p->shared && p->shared == (uint64_t)(uintptr_t)osHandle && (p->handle_types & shHandleType)) {
            p->handle_refs++;
            *handle = p->handle;
            r = CUDA_SUCCESS;
            break;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

/* ------------------------------------------------------------------------------------------------ */
/* Modules and functions                                                                              */
/* ------------------------------------------------------------------------------------------------ */
static void write_log(char *buf, size_t *size_io, const char *msg) {
    size_t cap = *size_io, len = strlen(msg) + 1;
    if (!buf || cap == 0) return;
    if (len > cap) len = cap;
    memcpy(buf, msg, len - 1);
    buf[len - 1] = 0;
    *size_io = len;
}

static int kernel_by_name(const char *name, size_t len) {
    int k;
    for (k = 0; k < K_COUNT; k++)
        if (strlen(KERNELS[k].name) == len && !strncmp(KERNELS[k].name, name, len)) return k;
    return -1;
}

/* Parses the image; returns CUDA_SUCCESS or an error with `msg` filled in. */
static CUresult parse_image(const void *image, int *kernels, int *nk, char *msg, size_t msglen) {
    const unsigned char *u = (const unsigned char *)image;
    const char *t = (const char *)image, *line = t;
    uint32_t magic;
    int lineno = 1, seen[K_COUNT] = {0};
    *nk = 0;
    if (!u[0] || !u[1] || !u[2] || !u[3]) magic = 0;
    else memcpy(&magic, u, 4);
    if (is_fake_image(u)) {
        line = t + FK_IMAGE_HEADER; /* an image the fake linker made: its entries follow the header */
    } else if ((u[0] == 0x7f && u[1] == 'E' && u[2] == 'L' && u[3] == 'F') || magic == 0xBA55ED50u ||
               magic == 0x466243b1u) {
        snprintf(msg, msglen, "fake driver: binary images (ELF/cubin/fatbin) are not supported, pass PTX text");
        return CUDA_ERROR_NO_BINARY_FOR_GPU;
    }
    while (*line) {
        size_t ll = strcspn(line, "\n");
        const char *p = line, *end = line + ll;
        /* .fake_syntax_error anywhere on the line */
        for (p = line; p + 18 <= end; p++)
            if (!strncmp(p, ".fake_syntax_error", 18)) {
                snprintf(msg, msglen, "fake ptxas: line %d: syntax error at '.fake_syntax_error'", lineno);
                return CUDA_ERROR_INVALID_PTX;
            }
        for (p = line; p + 6 <= end; p++) {
            if (!strncmp(p, ".entry", 6) && (p + 6 == end || p[6] == ' ' || p[6] == '\t')) {
                const char *n = p + 6, *ne;
                int k;
                while (n < end && (*n == ' ' || *n == '\t')) n++;
                ne = n;
                while (ne < end && (((*ne | 32) >= 'a' && (*ne | 32) <= 'z') || (*ne >= '0' && *ne <= '9') ||
                                    *ne == '_' || *ne == '$'))
                    ne++;
                k = kernel_by_name(n, (size_t)(ne - n));
                if (k < 0) {
                    snprintf(msg, msglen,
                             "fake ptxas: line %d: unknown entry '%.*s' (built-in kernels: fill_u32, add_f32, "
                             "spin_fill_u32, empty, fill_pattern_u8)",
                             lineno, (int)(ne - n), n);
                    return CUDA_ERROR_INVALID_PTX;
                }
                if (!seen[k]) {
                    seen[k] = 1;
                    kernels[(*nk)++] = k;
                }
                p = ne - 1;
            }
        }
        line = *end ? end + 1 : end;
        if (*end) lineno++;
    }
    if (*nk == 0) {
        snprintf(msg, msglen, "fake ptxas: line %d: no .entry found in the module", lineno);
        return CUDA_ERROR_INVALID_PTX;
    }
    snprintf(msg, msglen, "fake ptxas: %d entr%s compiled", *nk, *nk == 1 ? "y" : "ies");
    return CUDA_SUCCESS;
}

/* Compiles an image as a load or a link input would be: checks the JIT options (CUDA_ERROR_INVALID_VALUE
   for a bad one, before anything else), parses the image, writes both logs (and their used sizes)
   and the wall time. Returns CUDA_SUCCESS with the kernels, or the error. Lock not held. */
static CUresult jit_compile(const void *image, unsigned int numOptions, CUjit_option *options, void **optionValues,
                            int *kernels, int *nk, int *max_regs);

static CUresult module_load(const char *api, CUmodule *module, const void *image, unsigned int numOptions,
                            CUjit_option *options, void **optionValues) {
    fk_ctx *c;
    CUresult r;
    int kernels[K_COUNT], nk = 0, max_regs = 0;
    ENTER(api);
    if (!module || !image || (numOptions && (!options || !optionValues))) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    fk_unlock(&G.lock);
    if (r) return r;
    r = jit_compile(image, numOptions, options, optionValues, kernels, &nk, &max_regs);
    if (r) return r;
    {
        fk_module *m = (fk_module *)calloc(1, sizeof *m);
        int k;
        if (!m) abort();
        m->magic = FK_MAGIC_MODULE;
        m->ctx = c;
        m->nfuncs = nk;
        m->max_regs = max_regs;
        for (k = 0; k < nk; k++) {
            m->funcs[k].magic = FK_MAGIC_FUNC;
            m->funcs[k].mod = m;
            m->funcs[k].kernel = kernels[k];
            m->funcs[k].max_dyn_smem = FK_SMEM_DEFAULT;
            m->funcs[k].carveout = -1;
        }
        fk_lock(&G.lock);
        vec_push(&G.modules, m);
        fk_unlock(&G.lock);
        *module = m;
    }
    return CUDA_SUCCESS;
}
API_OLD cuModuleLoadData(CUmodule *module, const void *image) {
    return module_load("cuModuleLoadData", module, image, 0, NULL, NULL);
}
API_OLD cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                           void **optionValues) {
    return module_load("cuModuleLoadDataEx", module, image, numOptions, options, optionValues);
}

API_OLD cuModuleUnload(CUmodule hmod) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuModuleUnload");
    fk_lock(&G.lock);
    if (!hmod || vec_find(&G.modules, hmod) < 0 || hmod->lib) r = CUDA_ERROR_INVALID_HANDLE;
    else {
        vec_remove(&G.modules, hmod);
        hmod->magic = 0;
        free(hmod);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    CUresult r = CUDA_ERROR_NOT_FOUND;
    int k;
    ENTER("cuModuleGetFunction");
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!hmod || vec_find(&G.modules, hmod) < 0) r = CUDA_ERROR_INVALID_HANDLE;
    else
        for (k = 0; k < hmod->nfuncs; k++)
            if (!strcmp(KERNELS[hmod->funcs[k].kernel].name, name)) {
                *hfunc = &hmod->funcs[k];
                r = CUDA_SUCCESS;
            }
    fk_unlock(&G.lock);
    return r;
}

/* Lock held. */
static int valid_func(const fk_func *f) {
    size_t i;
    for (i = 0; i < G.modules.n; i++) {
        const fk_module *m = (const fk_module *)G.modules.v[i];
        if (f >= m->funcs && f < m->funcs + m->nfuncs) return 1;
    }
    return 0;
}

API_OLD cuFuncGetAttribute(int *pi, int attrib, CUfunction hfunc) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuFuncGetAttribute");
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_func(hfunc)) r = CUDA_ERROR_INVALID_HANDLE;
    else
        switch (attrib) {
        case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
        case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
        case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
        case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *pi = 0; break;
        case CU_FUNC_ATTRIBUTE_NUM_REGS:
            *pi = hfunc->mod->max_regs && hfunc->mod->max_regs < 16 ? hfunc->mod->max_regs : 16;
            break;
        case CU_FUNC_ATTRIBUTE_PTX_VERSION:
        case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 90; break;
        case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *pi = 0; break;
        case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = hfunc->max_dyn_smem; break;
        case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = hfunc->carveout; break;
        case CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET: *pi = 0; break;
        case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
        case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
        case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
            *pi = hfunc->cluster[attrib - CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH];
            break;
        case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: *pi = hfunc->nonportable; break;
        case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE: *pi = hfunc->sched; break;
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuFuncSetAttribute(CUfunction hfunc, int attrib, int value) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuFuncSetAttribute");
    fk_lock(&G.lock);
    if (!valid_func(hfunc)) r = CUDA_ERROR_INVALID_HANDLE;
    else
        switch (attrib) {
        case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            if (value < 0 || value > FK_SMEM_OPTIN) r = CUDA_ERROR_INVALID_VALUE;
            else hfunc->max_dyn_smem = value;
            break;
        case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
            if (value < -1 || value > 100) r = CUDA_ERROR_INVALID_VALUE;
            else hfunc->carveout = value;
            break;
        case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
        case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
        case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
            if (value < 0 || value > 16) r = CUDA_ERROR_INVALID_VALUE;
            else hfunc->cluster[attrib - CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH] = value;
            break;
        case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: hfunc->nonportable = value != 0; break;
        case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
            if (value < 0 || value > 2) r = CUDA_ERROR_INVALID_VALUE;
            else hfunc->sched = value;
            break;
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
    fk_unlock(&G.lock);
    return r;
}

/* ---- occupancy ---- */
static int blocks_per_sm(int blockSize, size_t dynSmem) {
    int warps, by_threads, by_regs, by_smem = 32;
    if (blockSize <= 0 || blockSize > 1024) return 0;
    warps = (blockSize + 31) / 32;
    by_threads = 64 / warps; /* 2048 threads = 64 warps per SM */
    by_regs = 65536 / (16 * warps * 32);
    if (dynSmem > FK_SMEM_OPTIN) return 0;
    if (dynSmem) by_smem = (int)(FK_SMEM_PER_SM / (dynSmem + 1024));
    {
        int b = by_threads < by_regs ? by_threads : by_regs;
        if (by_smem < b) b = by_smem;
        return b > 32 ? 32 : b;
    }
}

API_OLD cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                    size_t dynamicSMemSize) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuOccupancyMaxActiveBlocksPerMultiprocessor");
    if (!numBlocks) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_func(func)) r = CUDA_ERROR_INVALID_HANDLE;
    fk_unlock(&G.lock);
    if (!r) *numBlocks = blocks_per_sm(blockSize, dynamicSMemSize);
    return r;
}

API_OLD cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                         CUoccupancyB2DSize blockSizeToDynamicSMemSize, size_t dynamicSMemSize,
                                         int blockSizeLimit) {
    CUresult r = CUDA_SUCCESS;
    int bs, best_bs = 0, best_occ = -1, best_blocks = 0, limit;
    ENTER("cuOccupancyMaxPotentialBlockSize");
    if (!minGridSize || !blockSize) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_func(func)) r = CUDA_ERROR_INVALID_HANDLE;
    fk_unlock(&G.lock);
    if (r) return r;
    limit = blockSizeLimit > 0 && blockSizeLimit < 1024 ? blockSizeLimit : 1024;
    for (bs = limit; bs > 0; bs -= 32) {
        size_t sm = blockSizeToDynamicSMemSize ? blockSizeToDynamicSMemSize(bs) : dynamicSMemSize;
        int b = blocks_per_sm(bs, sm);
        if (b * bs > best_occ) {
            best_occ = b * bs;
            best_bs = bs;
            best_blocks = b;
        }
        if (bs < 32) break;
    }
    *blockSize = best_bs;
    *minGridSize = best_blocks * FK_SM_COUNT;
    return CUDA_SUCCESS;
}

/* ---- launches ---- */
static CUresult launch(const char *api, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, unsigned smem, CUstream h, void **kernelParams, void **extra,
                       int cooperative, const unsigned *cluster) {
    fk_stream *s;
    CUresult r = CUDA_SUCCESS;
    fk_op *op;
    unsigned char pbuf[32];
    int k, i;
    memset(pbuf, 0, sizeof pbuf);
    fk_lock(&G.lock);
    if (!valid_func(f)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r) r = get_stream_locked(h, &s);
    if (r) goto out;
    k = f->kernel;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || gx > 2147483647u || gy > 65535 ||
        gz > 65535 || bx > 1024 || by > 1024 || bz > 64 || (uint64_t)bx * by * bz > 1024 ||
        smem > (unsigned)f->max_dyn_smem || (kernelParams && extra)) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if (cluster) {
        if (cluster[0] == 0 || cluster[1] == 0 || cluster[2] == 0 || gx % cluster[0] || gy % cluster[1] ||
            gz % cluster[2] || (uint64_t)cluster[0] * cluster[1] * cluster[2] > (f->nonportable ? 16u : 8u)) {
            r = CUDA_ERROR_INVALID_VALUE;
            goto out;
        }
    }
    if (cooperative &&
        (uint64_t)gx * gy * gz > (uint64_t)blocks_per_sm((int)(bx * by * bz), smem) * FK_SM_COUNT) {
        r = CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
        goto out;
    }
    if (KERNELS[k].nparams) {
        if (kernelParams) {
            for (i = 0; i < KERNELS[k].nparams; i++) {
                if (!kernelParams[i]) {
                    r = CUDA_ERROR_INVALID_VALUE;
                    goto out;
                }
                memcpy(pbuf + KERNELS[k].off[i], kernelParams[i], (size_t)KERNELS[k].size[i]);
            }
        } else if (extra) {
            void *buf = NULL;
            size_t *sz = NULL;
            for (i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
                if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = extra[i + 1];
                else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE) sz = (size_t *)extra[i + 1];
                else {
                    r = CUDA_ERROR_INVALID_VALUE;
                    goto out;
                }
            }
            if (!buf || !sz || *sz < (size_t)KERNELS[k].total) {
                r = CUDA_ERROR_INVALID_VALUE;
                goto out;
            }
            memcpy(pbuf, buf, (size_t)KERNELS[k].total);
        } else {
            r = CUDA_ERROR_INVALID_VALUE;
            goto out;
        }
    }
    if ((r = capture_check_locked(s, 0)) != CUDA_SUCCESS) goto out; /* fake_graph.c */
    op = new_op(OP_KERNEL, api);
    op->kernel = k;
    for (i = 0; i < KERNELS[k].nparams; i++) {
        if (KERNELS[k].size[i] == 4) memcpy(&op->kval, pbuf + KERNELS[k].off[i], 4);
        else memcpy(&op->kp[i], pbuf + KERNELS[k].off[i], 8);
    }
    enqueue_locked(s, op);
    record_launch_locked(api, gx, gy, gz, bx, by, bz, smem, cooperative, cluster);
out:
    fk_unlock(&G.lock);
    if (r == CUDA_SUCCESS) fk_sleep_us(G.launch_us);
    return r;
}

API_OLD cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                       unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    ENTER("cuLaunchKernel");
    return launch("cuLaunchKernel", f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                  sharedMemBytes, hStream, kernelParams, extra, 0, NULL);
}

API_OLD cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                  unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                  unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                  void **kernelParams) {
    ENTER("cuLaunchCooperativeKernel");
    return launch("cuLaunchCooperativeKernel", f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                  sharedMemBytes, hStream, kernelParams, NULL, 1, NULL);
}

/* Checks the launch attributes of cuLaunchKernelEx and cuOccupancy*Cluster*: every value in its
   range (CUDA_ERROR_INVALID_VALUE otherwise), a preferred cluster a multiple of the cluster and a
   divisor of the grid. Fills *coop and cluster (has_cluster). */
static CUresult check_launch_attrs(const CUlaunchConfig *config, int *coop, unsigned *cluster, int *has_cluster) {
    unsigned i;
    const CUlaunchAttribute *pref = NULL;
    *coop = 0;
    *has_cluster = 0;
    if (!config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    for (i = 0; i < config->numAttrs; i++) {
        const CUlaunchAttribute *a = &config->attrs[i];
        const CUlaunchAttributeValue *v = &a->value;
        switch (a->id) {
        case CU_LAUNCH_ATTRIBUTE_COOPERATIVE: *coop = v->cooperative != 0; break;
        case CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
            *has_cluster = 1;
            cluster[0] = v->clusterDim.x;
            cluster[1] = v->clusterDim.y;
            cluster[2] = v->clusterDim.z;
            break;
        case CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
            if (v->programmaticStreamSerializationAllowed != 0 && v->programmaticStreamSerializationAllowed != 1)
                return CUDA_ERROR_INVALID_VALUE;
            break;
        case CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN:
            if (v->memSyncDomain != 0 && v->memSyncDomain != 1) return CUDA_ERROR_INVALID_VALUE;
            break;
        case CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW:
            if (v->accessPolicyWindow.num_bytes > (size_t)134213632 || !(v->accessPolicyWindow.hitRatio >= 0.0f) ||
                v->accessPolicyWindow.hitRatio > 1.0f || (unsigned)v->accessPolicyWindow.hitProp > 2u ||
                (unsigned)v->accessPolicyWindow.missProp > 2u)
                return CUDA_ERROR_INVALID_VALUE;
            break;
        case CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION: pref = a; break;
        default:
            if (a->id < 0 || a->id > CU_LAUNCH_ATTRIBUTE_MAX_KNOWN) return CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (pref) {
        unsigned p[3] = {pref->value.preferredClusterDim.x, pref->value.preferredClusterDim.y,
                         pref->value.preferredClusterDim.z};
        unsigned g[3] = {config->gridDimX, config->gridDimY, config->gridDimZ};
        if (!*has_cluster) return CUDA_ERROR_INVALID_VALUE;
        for (i = 0; i < 3; i++)
            if (!p[i] || !cluster[i] || p[i] % cluster[i] || !g[i] || g[i] % p[i]) return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

API_11060 cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    unsigned cluster[3];
    int coop, has_cluster;
    CUresult r;
    ENTER("cuLaunchKernelEx");
    r = check_launch_attrs(config, &coop, cluster, &has_cluster);
    if (r) return r;
    tl_launch_config = config;
    r = launch("cuLaunchKernelEx", f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
               config->blockDimY, config->blockDimZ, config->sharedMemBytes, config->hStream, kernelParams, extra,
               coop, has_cluster ? cluster : NULL);
    tl_launch_config = NULL;
    return r;
}

/* ------------------------------------------------------------------------------------------------ */
/* API extensions: JIT options, the linker, libraries, launch attributes and cluster occupancy,     */
/* pitched memory and 2D/3D copies and memsets, managed-memory prefetch and advice, pointer          */
/* attributes, IPC (events, legacy memory handles, pool export and import)                          */
/* ------------------------------------------------------------------------------------------------ */

/* ---- shared memory (IPC) ---- */
#ifdef _WIN32
static unsigned long fk_pid(void) { return (unsigned long)GetCurrentProcessId(); }
static int shm_map(fk_shm *s, int create) {
    char name[80];
    snprintf(name, sizeof name, "Local\\%s", s->name);
    if (create) {
        s->h = CreateFileMappingA(INVALID_HANDLE_VALUE, NULL, PAGE_READWRITE, (DWORD)(s->size >> 32), (DWORD)s->size,
                                  name);
        if (s->h && GetLastError() == ERROR_ALREADY_EXISTS) { /* another's: not ours to share */
            CloseHandle(s->h);
            SetLastError(ERROR_ALREADY_EXISTS);
            return 0;
        }
    } else s->h = OpenFileMappingA(FILE_MAP_ALL_ACCESS, FALSE, name);
    if (!s->h) return 0;
    s->p = MapViewOfFile(s->h, FILE_MAP_ALL_ACCESS, 0, 0, (SIZE_T)s->size);
    if (!s->p) {
        CloseHandle(s->h);
        return 0;
    }
    return 1;
}
static void shm_release(fk_shm *s) {
    UnmapViewOfFile(s->p);
    CloseHandle(s->h);
    free(s);
}
/* After a failed shm_map(s, 1): whether the name was another mapping's. */
static int shm_name_taken(void) { return GetLastError() == ERROR_ALREADY_EXISTS; }
#else
static unsigned long fk_pid(void) { return (unsigned long)getpid(); }
static void shm_path(const fk_shm *s, char *path, size_t len) {
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = "/tmp";
    snprintf(path, len, "%s/%s", dir, s->name);
}
static int shm_map(fk_shm *s, int create) {
    char path[600];
    struct stat st;
    void *p;
    int fd;
    shm_path(s, path, sizeof path);
    fd = open(path, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) return 0; /* errno EEXIST: the name is taken (see shm_name_taken) */
    if ((create && ftruncate(fd, (off_t)s->size) != 0) || fstat(fd, &st) != 0 || (uint64_t)st.st_size < s->size) {
        close(fd);
        if (create) unlink(path);
        errno = 0;
        return 0;
    }
    p = mmap(NULL, (size_t)s->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        if (create) unlink(path);
        errno = 0;
        return 0;
    }
    s->p = p;
    return 1;
}
static void shm_release(fk_shm *s) {
    char path[600];
    munmap(s->p, (size_t)s->size);
    if (s->owner) {
        shm_path(s, path, sizeof path);
        unlink(path);
    }
    free(s);
}
/* After a failed shm_map(s, 1): whether the name was another mapping's. */
static int shm_name_taken(void) { return errno == EEXIST; }
#endif

/* A new zeroed mapping of `size` bytes, named after this process, `kind` and a serial (lock held).
   The pid alone does not make a name unique: a process that died without releasing its mappings
   (killed, or ended with exports alive) leaves its files in the temporary directory, and a later
   process may get its pid. So the name also carries the time this process first made one, and a
   name that is taken all the same moves on to the next serial. */
static fk_shm *shm_new(char kind, uint64_t size) {
    static uint32_t nonce;
    fk_shm *s = (fk_shm *)calloc(1, sizeof *s);
    int tries;
    if (!s) return NULL;
    if (!nonce) nonce = (uint32_t)(fk_now_ms() * 1000.0) | 1u;
    s->size = size;
    s->owner = 1;
    for (tries = 0; tries < 64; tries++) {
        snprintf(s->name, sizeof s->name, "cudrv-%c%lu-%08x-%" PRIu64, kind, fk_pid(), (unsigned)nonce,
                 ++GX.shm_serial);
        if (shm_map(s, 1)) return s;
        if (!shm_name_taken()) break;
    }
    free(s);
    return NULL;
}

/* Opens another process's mapping (NULL when it is gone). */
static fk_shm *shm_attach(const char *name, uint64_t size) {
    fk_shm *s = (fk_shm *)calloc(1, sizeof *s);
    if (!s) return NULL;
    snprintf(s->name, sizeof s->name, "%s", name);
    s->size = size;
    if (!shm_map(s, 0)) {
        free(s);
        return NULL;
    }
    return s;
}

/* What an IPC handle carries (the 64 bytes of CUipcMemHandle, CUipcEventHandle and
   CUmemPoolPtrExportData): a magic, the exporting process, its device, the size and the mapping. */
typedef struct {
    char magic[8];
    uint32_t pid;
    int32_t dev;
    uint64_t size;
    char name[40];
} fk_wire;
typedef struct {
    char reserved[64];
} CUipcMemHandle, CUipcEventHandle;
typedef struct {
    unsigned char reserved[64];
} CUmemPoolPtrExportData;
_Static_assert(sizeof(fk_wire) == 64, "IPC handle layout");

static void wire_write(void *out, const char *magic, int dev, uint64_t size, const char *name) {
    fk_wire w;
    memset(&w, 0, sizeof w);
    memcpy(w.magic, magic, 8);
    w.pid = (uint32_t)fk_pid();
    w.dev = dev;
    w.size = size;
    snprintf(w.name, sizeof w.name, "%s", name);
    memcpy(out, &w, sizeof w);
}

/* Reads a handle of kind `magic`; 0 if it is not one. */
static int wire_read(const void *in, const char *magic, fk_wire *w) {
    memcpy(w, in, sizeof *w);
    w->name[sizeof w->name - 1] = 0;
    return !memcmp(w->magic, magic, 8) && w->size > 0 && w->name[0];
}

/* Makes the backing of device block `b` shared memory, keeping its contents, for an IPC export
   (lock held; waits until no op uses the block). 0 if no shared memory could be made. */
static int block_share_locked(fk_block *b) {
    fk_shm *s;
    while (!b->shm && b->pins) fk_wait(&G.cv, &G.lock);
    if (b->shm) return 1;
    if (!(s = shm_new('m', b->size))) return 0;
    if (b->backing) {
        memcpy(s->p, b->backing, (size_t)b->size);
        if (b->owns_backing == 1) free(b->backing);
    }
    b->backing = (unsigned char *)s->p;
    b->owns_backing = 3;
    b->shm = s;
    return 1;
}

/* Maps another process's shared memory `name` of `size` bytes at a new address of device `dev`, as
   an AK_IPC allocation of kind `ipc` (lock held). */
static CUresult map_shared_locked(int dev, const char *name, uint64_t size, int ipc, CUdeviceptr *out) {
    fk_block *b;
    fk_alloc *a;
    fk_shm *s = shm_attach(name, size);
    CUresult r;
    if (!s) return CUDA_ERROR_INVALID_HANDLE; /* the exporter freed it, or never made it */
    r = reserve_block_locked(dev, size, &b);
    if (r) {
        shm_release(s);
        return r;
    }
    b->backing = (unsigned char *)s->p;
    b->owns_backing = 4;
    b->shm = s;
    a = new_alloc(b->base, size, AK_IPC, dev, b);
    a->ipc = ipc;
    tab_insert(&G.dtab, a);
    *out = a->base;
    return CUDA_SUCCESS;
}

/* ---- IPC: legacy memory handles ---- */
static int ipc_supported(int dev) { return G.dev[dev].mode == MODE_LINUX; /* IPC_EVENT_SUPPORTED (125) */ }

API_OLD cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
    fk_ctx *c;
    fk_alloc *a = NULL;
    CUresult r;
    ENTER("cuIpcGetMemHandle");
    if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && !ipc_supported(c->dev)) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r) {
        a = tab_exact(&G.dtab, dptr, NULL);
        if (!a || a->kind != AK_DEVICE || a->free_pending) r = CUDA_ERROR_INVALID_VALUE; /* cuMemAlloc bases only */
    }
    if (!r && !block_share_locked(a->blk)) r = CUDA_ERROR_OUT_OF_MEMORY;
    if (!r) wire_write(pHandle, "FKIPCMEM", a->dev, a->blk->size, a->blk->shm->name);
    fk_unlock(&G.lock);
    return r;
}

API_11000 cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    fk_ctx *c;
    fk_wire w;
    CUresult r;
    ENTER("cuIpcOpenMemHandle_v2");
    if (!pdptr || (Flags & ~1u) || !wire_read(&handle, "FKIPCMEM", &w)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && !ipc_supported(c->dev)) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && w.pid == (uint32_t)fk_pid()) r = CUDA_ERROR_INVALID_CONTEXT; /* a handle of this very process */
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r) r = map_shared_locked(c->dev, w.name, w.size, 1, pdptr);
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuIpcCloseMemHandle(CUdeviceptr dptr) {
    fk_ctx *c;
    fk_alloc *a;
    CUresult r;
    ENTER("cuIpcCloseMemHandle");
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 25) */
    if (!r) {
        a = tab_exact(&G.dtab, dptr, NULL);
        if (!a || a->kind != AK_IPC || a->ipc != 1) r = CUDA_ERROR_INVALID_VALUE;
        else free_alloc_locked(a);
    }
    fk_unlock(&G.lock);
    return r;
}

/* ---- IPC: events ---- */
static fk_ipc_shared *ipc_shared(const fk_event *e) { return (fk_ipc_shared *)e->ipc->shm->p; }

static fk_ipc_event *ipc_event_new(void) {
    fk_ipc_event *ie = (fk_ipc_event *)calloc(1, sizeof *ie);
    if (!ie) return NULL;
    if (!(ie->shm = shm_new('e', 4096))) {
        free(ie);
        return NULL;
    }
    return ie;
}
static void ipc_event_free(fk_ipc_event *ie) {
    shm_release(ie->shm);
    free(ie);
}
static uint64_t ipc_event_ticket(fk_event *e) { return atomic_fetch_add(&ipc_shared(e)->recorded, 1) + 1; }
static void ipc_event_complete(fk_event *e, uint64_t ticket) {
    fk_ipc_shared *sh = ipc_shared(e);
    uint64_t c = atomic_load(&sh->completed);
    while (c < ticket && !atomic_compare_exchange_weak(&sh->completed, &c, ticket)) {
    }
}
static int ipc_event_done(const fk_event *e) {
    fk_ipc_shared *sh = ipc_shared(e);
    return atomic_load(&sh->completed) >= atomic_load(&sh->recorded);
}
static void push_ipc_wait_locked(fk_stream *s, fk_event *e) {
    uint64_t target = atomic_load(&ipc_shared(e)->recorded);
    fk_op *op;
    if (atomic_load(&ipc_shared(e)->completed) >= target) return;
    op = new_op(OP_IPC_WAIT, "cuStreamWaitEvent");
    op->ev = e;
    e->refs++;
    op->ipc_ticket = target;
    enqueue_locked(s, op);
}

API_OLD cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event) {
    CUresult r = CUDA_SUCCESS;
    ENTER("cuIpcGetEventHandle");
    if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!valid_event(event)) r = CUDA_ERROR_INVALID_HANDLE;
    else if (!event->ipc) r = CUDA_ERROR_INVALID_VALUE; /* not created with CU_EVENT_INTERPROCESS */
    else if (!ipc_supported(event->ctx->dev)) r = CUDA_ERROR_NOT_SUPPORTED;
    else wire_write(pHandle, "FKIPCEVT", event->ctx->dev, event->ipc->shm->size, event->ipc->shm->name);
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle) {
    fk_ctx *c;
    fk_wire w;
    CUresult r;
    ENTER("cuIpcOpenEventHandle");
    if (!phEvent || !wire_read(&handle, "FKIPCEVT", &w)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && !ipc_supported(c->dev)) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && w.pid == (uint32_t)fk_pid()) r = CUDA_ERROR_INVALID_CONTEXT;
    if (!r) {
        fk_ipc_event *ie = (fk_ipc_event *)calloc(1, sizeof *ie);
        fk_event *e = (fk_event *)calloc(1, sizeof *e);
        if (!ie || !e) abort();
        if (!(ie->shm = shm_attach(w.name, w.size))) {
            free(ie);
            free(e);
            r = CUDA_ERROR_INVALID_HANDLE; /* the exporter destroyed it */
        } else {
            ie->imported = 1;
            e->magic = FK_MAGIC_EVENT;
            e->ctx = c;
            e->flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
            e->refs = 1;
            e->ipc = ie;
            vec_push(&G.events, e);
            *phEvent = e;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

/* ---- IPC: memory pools ---- */
API_11020 cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool, int handleType,
                                           unsigned long long flags) {
    CUresult r;
    ENTER("cuMemPoolExportToShareableHandle");
    if (!handle_out || flags || !single_handle_type(handleType)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = pool_entry_locked(pool);
    if (!r && (pool->imported || !(pool->handle_types & handleType))) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) {
        uint64_t v = FK_SHARED_BASE + 4 * ++GX.shared_serial;
        if (handleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) *(int *)handle_out = (int)v;
        else if (handleType == CU_MEM_HANDLE_TYPE_WIN32) *(void **)handle_out = (void *)(uintptr_t)v;
        else *(unsigned int *)handle_out = (unsigned int)v;
    }
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle, int handleType,
                                             unsigned long long flags) {
    fk_ctx *c;
    CUresult r;
    ENTER("cuMemPoolImportFromShareableHandle");
    if (!pool_out || flags || !single_handle_type(handleType)) return CUDA_ERROR_INVALID_VALUE;
    if ((uint64_t)(uintptr_t)handle < FK_SHARED_BASE) return CUDA_ERROR_INVALID_VALUE; /* not a pool's */
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && G.dev[c->dev].mode == MODE_TCC) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && !(attr_value(c->dev, 119) & handleType)) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r) {
        fk_pool *p = new_pool_locked(c->dev, 0);
        p->imported = 1;
        p->handle_types = handleType;
        *pool_out = p;
    }
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr) {
    fk_alloc *a;
    CUresult r = CUDA_SUCCESS;
    ENTER("cuMemPoolExportPointer");
    if (!shareData_out) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    a = tab_exact(&G.dtab, ptr, NULL);
    if (!a || a->kind != AK_POOL || a->free_pending || !a->pool->handle_types) r = CUDA_ERROR_INVALID_VALUE;
    else if (!block_share_locked(a->blk)) r = CUDA_ERROR_OUT_OF_MEMORY;
    else wire_write(shareData_out, "FKPOOLPT", a->dev, a->blk->size, a->blk->shm->name);
    fk_unlock(&G.lock);
    return r;
}

API_11020 cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *shareData) {
    fk_wire w;
    CUresult r;
    ENTER("cuMemPoolImportPointer");
    if (!ptr_out || !shareData || !wire_read(shareData, "FKPOOLPT", &w)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = pool_entry_locked(pool);
    if (!r && (!pool->imported || w.pid == (uint32_t)fk_pid())) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) r = map_shared_locked(pool->dev, w.name, w.size, 2, ptr_out);
    fk_unlock(&G.lock);
    return r;
}

/* ---- pointer attributes ---- */
#define CU_POINTER_ATTRIBUTE_CONTEXT 1
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_POINTER 3
#define CU_POINTER_ATTRIBUTE_HOST_POINTER 4
#define CU_POINTER_ATTRIBUTE_IS_MANAGED 8
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE 10
#define CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define CU_POINTER_ATTRIBUTE_MAPPED 13
#define CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES 14
#define CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE 17

/* The allocation (or VMM mapping) holding `ptr` (lock held), or NULL. */
static fk_alloc *alloc_of_locked(uint64_t ptr) {
    fk_alloc *a = tab_containing(&G.dtab, ptr);
    if (!a) a = tab_containing(&G.htab, ptr);
    if (!a) a = tab_containing(&G.mtab, ptr);
    return a;
}

API_OLD cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    fk_alloc *a;
    CUresult r = CUDA_SUCCESS;
    ENTER("cuPointerGetAttribute");
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    a = alloc_of_locked(ptr);
    if (!a) r = CUDA_ERROR_INVALID_VALUE;
    else {
        int host = a->kind == AK_HOSTALLOC || a->kind == AK_REGISTERED;
        switch (attribute) {
        case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = a->dev >= 0 ? &G.dev[a->dev].ctx : tl_ctx; break;
        case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned *)data = host ? 1u : 2u; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
        case CU_POINTER_ATTRIBUTE_HOST_POINTER:
            if (host || a->kind == AK_MANAGED) *(void **)data = (void *)(uintptr_t)ptr;
            else r = CUDA_ERROR_INVALID_VALUE;
            break;
        case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = a->kind == AK_MANAGED; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = a->dev >= 0 ? a->dev : tl_ctx ? tl_ctx->dev : 0; break;
        case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = a->kind == AK_DEVICE; break;
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = a->base; break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = (size_t)a->size; break;
        case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
        case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
            *(unsigned long long *)data = a->kind == AK_POOL     ? (unsigned long long)a->pool->handle_types
                                          : a->kind == AK_MAPPED ? (unsigned long long)a->phys->handle_types
                                                                 : 0;
            break;
        case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *(CUmemoryPool *)data = a->kind == AK_POOL ? a->pool : NULL; break;
        default: r = CUDA_ERROR_INVALID_VALUE;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    fk_ctx *c;
    fk_alloc *a;
    CUresult r;
    ENTER("cuMemGetAddressRange_v2");
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) {
        a = alloc_of_locked(dptr);
        if (!a) r = CUDA_ERROR_NOT_FOUND;
        else {
            if (pbase) *pbase = a->base;
            if (psize) *psize = (size_t)a->size;
        }
    }
    fk_unlock(&G.lock);
    return r;
}

/* ---- pitched memory, 2D and 3D copies and memsets ---- */
typedef struct CUDA_MEMCPY2D_st {
    size_t srcXInBytes, srcY;
    int srcMemoryType; /* CUmemorytype */
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
typedef struct CUDA_MEMCPY3D_st {
    size_t srcXInBytes, srcY, srcZ, srcLOD;
    int srcMemoryType;
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
} CUDA_MEMCPY3D;
_Static_assert(sizeof(CUDA_MEMCPY2D) == 128, "CUDA_MEMCPY2D layout");
_Static_assert(sizeof(CUDA_MEMCPY3D) == 200, "CUDA_MEMCPY3D layout");
enum { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2, CU_MEMORYTYPE_ARRAY = 3, CU_MEMORYTYPE_UNIFIED = 4 };

/* One side of a region copy: its first byte, memory type (1 host, 2 device), pitch, rows per slice. */
typedef struct {
    int mt;
    uint64_t p;
    size_t pitch, height;
} fk_side;

static CUresult make_side(int mt, const void *host, CUdeviceptr dev, const void *array, size_t x, size_t y, size_t z,
                          size_t pitch, size_t height, fk_side *out) {
    uint64_t base;
    if (array || mt == CU_MEMORYTYPE_ARRAY) return CUDA_ERROR_INVALID_VALUE; /* CUDA arrays are not emulated */
    if (mt == CU_MEMORYTYPE_HOST) base = (uint64_t)(uintptr_t)host, out->mt = 1;
    else if (mt == CU_MEMORYTYPE_DEVICE || mt == CU_MEMORYTYPE_UNIFIED) base = dev, out->mt = 2;
    else return CUDA_ERROR_INVALID_VALUE;
    if (!base) return CUDA_ERROR_INVALID_VALUE;
    out->p = base + ((uint64_t)z * height + y) * pitch + x;
    out->pitch = pitch;
    out->height = height;
    return CUDA_SUCCESS;
}

/* Bytes from a region's first byte to its last, inclusive: 0 for an empty region. */
static uint64_t region_span(size_t pitch, size_t height, size_t w, size_t rows, size_t depth) {
    if (!w || !rows || !depth) return 0;
    return ((uint64_t)(depth - 1) * height + (rows - 1)) * pitch + w;
}

static CUresult submit_region(const char *api, fk_side d, fk_side s, size_t w, size_t rows, size_t depth, CUstream h) {
    fk_stream *st;
    CUresult r;
    uint64_t dspan, sspan;
    if ((rows > 1 || depth > 1) && (d.pitch < w || s.pitch < w)) return CUDA_ERROR_INVALID_VALUE;
    if (depth > 1 && (d.height < rows || s.height < rows)) return CUDA_ERROR_INVALID_VALUE;
    dspan = region_span(d.pitch, d.height, w, rows, depth);
    sspan = region_span(s.pitch, s.height, w, rows, depth);
    fk_lock(&G.lock);
    r = get_stream_locked(h, &st);
    if (!r) r = capture_check_locked(st, 0); /* fake_graph.c (review 24b: as the 1D copies) */
    if (!r && dspan) {
        fk_op *op = new_op(OP_REGION, api);
        uint64_t seq;
        int sync = 0;
        op->dst = d.p, op->dmt = d.mt, op->dpitch = d.pitch, op->dheight = d.height;
        op->src = s.p, op->smt = s.mt, op->spitch = s.pitch, op->sheight = s.height;
        op->wbytes = w, op->rows = rows, op->depth = depth;
        if (s.mt == 1 && !host_is_pinned_locked((const void *)(uintptr_t)s.p, (size_t)sspan)) {
            /* pageable source: staged at the call, packed, as the real driver stages it */
            unsigned char *snap = (unsigned char *)malloc(w * rows * depth);
            size_t z, y;
            if (!snap) abort();
            for (z = 0; z < depth; z++)
                for (y = 0; y < rows; y++)
                    memcpy(snap + (z * rows + y) * w,
                           (const unsigned char *)(uintptr_t)s.p + ((uint64_t)z * s.height + y) * s.pitch, w);
            op->src = (uint64_t)(uintptr_t)snap, op->src_snapshot = 1, op->spitch = w, op->sheight = rows;
        }
        if (d.mt == 1 && !host_is_pinned_locked((const void *)(uintptr_t)d.p, (size_t)dspan))
            sync = 1; /* pageable destination: synchronous, as in the real driver */
        seq = enqueue_locked(st, op);
        if (sync) wait_seq_locked(st, seq);
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                           unsigned int ElementSizeBytes) {
    fk_ctx *c;
    fk_block *b;
    CUresult r;
    uint64_t pitch;
    ENTER("cuMemAllocPitch_v2");
    if (!dptr || !pPitch || !WidthInBytes || !Height || WidthInBytes > 2147483647u ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    pitch = round_up(WidthInBytes, 512);
    if (Height > UINT64_MAX / pitch) return CUDA_ERROR_OUT_OF_MEMORY;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) r = capture_unsafe_call_locked(); /* fake_graph.c: a potentially unsafe call (review 24b) */
    if (!r) r = reserve_block_locked(c->dev, pitch * Height, &b);
    if (!r) {
        fk_alloc *a = new_alloc(b->base, pitch * Height, AK_DEVICE, c->dev, b);
        tab_insert(&G.dtab, a);
        *dptr = a->base;
        *pPitch = (size_t)pitch;
    }
    fk_unlock(&G.lock);
    return r;
}

API_OLD cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream hStream) {
    fk_side d, s;
    CUresult r;
    ENTER("cuMemcpy2DAsync_v2");
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    r = make_side(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstXInBytes, p->dstY, 0, p->dstPitch,
                  p->Height, &d);
    if (!r)
        r = make_side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcXInBytes, p->srcY, 0, p->srcPitch,
                      p->Height, &s);
    if (!r) r = submit_region("cuMemcpy2DAsync_v2", d, s, p->WidthInBytes, p->Height, 1, hStream);
    return r;
}

API_OLD cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *p, CUstream hStream) {
    fk_side d, s;
    CUresult r;
    ENTER("cuMemcpy3DAsync_v2");
    if (!p || p->srcLOD || p->dstLOD || p->reserved0 || p->reserved1) return CUDA_ERROR_INVALID_VALUE;
    r = make_side(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstXInBytes, p->dstY, p->dstZ,
                  p->dstPitch, p->dstHeight, &d);
    if (!r)
        r = make_side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcXInBytes, p->srcY, p->srcZ,
                      p->srcPitch, p->srcHeight, &s);
    if (!r) r = submit_region("cuMemcpy3DAsync_v2", d, s, p->WidthInBytes, p->Height, p->Depth, hStream);
    return r;
}

/* sync: 1 = the synchronous API (legacy stream, waits for completion). */
static CUresult submit_memset2d(const char *api, CUdeviceptr dst, size_t pitch, uint32_t value, size_t width,
                                size_t height, int elem, CUstream h, int sync) {
    fk_stream *s;
    CUresult r;
    ENTER(api);
    if ((elem == 2 && ((dst | pitch) & 1)) || (elem == 4 && ((dst | pitch) & 3))) return CUDA_ERROR_INVALID_VALUE;
    if (height > 1 && pitch < width * (size_t)elem) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = sync ? get_stream_locked(NULL, &s) : get_stream_locked(h, &s);
    if (!r) r = capture_check_locked(s, sync); /* fake_graph.c (review 24b: as the 1D memsets) */
    if (!r && width && height) {
        fk_op *op = new_op(OP_MEMSET2D, api);
        uint64_t seq;
        op->dst = dst, op->dmt = 2, op->dpitch = pitch, op->dheight = height;
        op->wbytes = width * (size_t)elem, op->rows = height, op->depth = 1;
        op->value = value, op->elem = elem;
        seq = enqueue_locked(s, op);
        if (sync) wait_seq_locked(s, seq);
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, unsigned char uc, size_t Width, size_t Height) {
    return submit_memset2d("cuMemsetD2D8_v2", dst, pitch, uc, Width, Height, 1, NULL, 1);
}
API_OLD cuMemsetD2D16_v2(CUdeviceptr dst, size_t pitch, unsigned short us, size_t Width, size_t Height) {
    return submit_memset2d("cuMemsetD2D16_v2", dst, pitch, us, Width, Height, 2, NULL, 1);
}
API_OLD cuMemsetD2D32_v2(CUdeviceptr dst, size_t pitch, unsigned int ui, size_t Width, size_t Height) {
    return submit_memset2d("cuMemsetD2D32_v2", dst, pitch, ui, Width, Height, 4, NULL, 1);
}
API_OLD cuMemsetD2D8Async(CUdeviceptr dst, size_t pitch, unsigned char uc, size_t Width, size_t Height, CUstream h) {
    return submit_memset2d("cuMemsetD2D8Async", dst, pitch, uc, Width, Height, 1, h, 0);
}
API_OLD cuMemsetD2D16Async(CUdeviceptr dst, size_t pitch, unsigned short us, size_t Width, size_t Height,
                           CUstream h) {
    return submit_memset2d("cuMemsetD2D16Async", dst, pitch, us, Width, Height, 2, h, 0);
}
API_OLD cuMemsetD2D32Async(CUdeviceptr dst, size_t pitch, unsigned int ui, size_t Width, size_t Height, CUstream h) {
    return submit_memset2d("cuMemsetD2D32Async", dst, pitch, ui, Width, Height, 4, h, 0);
}

static void run_region(fk_op *op, fk_stream *s) {
    uint64_t dspan = region_span(op->dpitch, op->dheight, op->wbytes, op->rows, op->depth);
    uint64_t sspan = region_span(op->spitch, op->sheight, op->wbytes, op->rows, op->depth);
    fk_view dv, sv;
    int ok = 1;
    view_host(&dv, NULL, 0);
    view_host(&sv, NULL, 0);
    fk_lock(&G.lock);
    if (op->kind == OP_MEMSET2D || op->dmt == 2) ok = pin_range_locked(op->api, "write", op->dst, dspan, s, &dv);
    else view_host(&dv, (void *)(uintptr_t)op->dst, dspan);
    if (ok && op->kind == OP_REGION) {
        if (op->smt == 2) ok = pin_range_locked(op->api, "read", op->src, sspan, s, &sv);
        else view_host(&sv, (void *)(uintptr_t)op->src, sspan);
    }
    fk_unlock(&G.lock);
    if (ok && dspan) {
        unsigned char *row = (unsigned char *)malloc(op->wbytes);
        size_t z, y, k;
        if (!row) abort();
        if (op->kind == OP_MEMSET2D) {
            unsigned char pat[4];
            uint16_t v16 = (uint16_t)op->value;
            if (op->elem == 2) memcpy(pat, &v16, 2);
            else memcpy(pat, &op->value, 4);
            for (k = 0; k < op->wbytes; k++) row[k] = op->elem == 1 ? (unsigned char)op->value : pat[k % (size_t)op->elem];
        }
        for (z = 0; z < op->depth; z++)
            for (y = 0; y < op->rows; y++) {
                if (op->kind == OP_REGION) view_read(&sv, ((uint64_t)z * op->sheight + y) * op->spitch, row, op->wbytes);
                view_write(&dv, ((uint64_t)z * op->dheight + y) * op->dpitch, row, op->wbytes);
            }
        free(row);
    }
    fk_lock(&G.lock);
    unpin_view_locked(&dv);
    unpin_view_locked(&sv);
    fk_unlock(&G.lock);
}

/* ---- managed memory: advice, prefetch, range attributes ---- */
#define CU_MEM_LOCATION_TYPE_HOST 2
#define CU_MEM_LOCATION_TYPE_HOST_NUMA 3
#define CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT 4

/* The managed allocation holding all of [ptr, ptr + count) (lock held), or NULL. */
static fk_alloc *managed_range_locked(CUdeviceptr ptr, size_t count) {
    fk_alloc *a = tab_containing(&G.htab, ptr);
    if (!a || a->kind != AK_MANAGED || !count || ptr + count < ptr || ptr + count > a->base + a->size) return NULL;
    return a;
}

/* Locations as fk_alloc keeps them: 0 none, 1 the host, d + 2 device d; -1 invalid. */
static int loc_of_device(int d) { return d == -1 ? 1 : valid_dev(d) ? d + 2 : -1; }
static int loc_of(CUmemLocation l) {
    if (l.type == CU_MEM_LOCATION_TYPE_DEVICE) return valid_dev(l.id) ? l.id + 2 : -1;
    if (l.type == CU_MEM_LOCATION_TYPE_HOST || l.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
        l.type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT)
        return 1;
    return -1;
}
static int loc_legacy(int loc) { return loc == 0 ? -2 : loc == 1 ? -1 : loc - 2; }
static unsigned loc_bit(int loc) { return loc == 1 ? 1u << 31 : 1u << (loc - 2); }

static CUresult advise(const char *api, CUdeviceptr p, size_t count, int advice, int loc) {
    fk_alloc *a;
    CUresult r = CUDA_SUCCESS;
    ENTER(api);
    if (advice < 1 || advice > 6) return CUDA_ERROR_INVALID_VALUE;
    if ((advice == 3 || advice == 5 || advice == 6) && loc < 1) return CUDA_ERROR_INVALID_DEVICE;
    fk_lock(&G.lock);
    a = managed_range_locked(p, count);
    if (!a) r = CUDA_ERROR_INVALID_VALUE;
    else switch (advice) {
        case 1: a->adv_read_mostly = 1; break;
        case 2: a->adv_read_mostly = 0; break;
        case 3: a->adv_pref = loc; break;
        case 4: a->adv_pref = 0; break;
        case 5: a->adv_accessed |= loc_bit(loc); break;
        default: a->adv_accessed &= ~loc_bit(loc); break;
        }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuMemAdvise(CUdeviceptr devPtr, size_t count, int advice, CUdevice device) {
    return advise("cuMemAdvise", devPtr, count, advice, loc_of_device(device));
}
API_12000 cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, int advice, CUmemLocation location) {
    return advise("cuMemAdvise_v2", devPtr, count, advice, loc_of(location));
}

static CUresult prefetch(const char *api, CUdeviceptr p, size_t count, int loc, unsigned flags, CUstream h) {
    fk_stream *s;
    CUresult r;
    ENTER(api);
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    if (loc < 1) return CUDA_ERROR_INVALID_DEVICE;
    fk_lock(&G.lock);
    r = get_stream_locked(h, &s);
    if (!r && !managed_range_locked(p, count)) r = CUDA_ERROR_INVALID_VALUE;
    /* prefetching needs concurrent managed access (attribute 89), on the target and the stream's device */
    if (!r && ((loc >= 2 && G.dev[loc - 2].mode != MODE_LINUX) || G.dev[s->ctx->dev].mode != MODE_LINUX))
        r = CUDA_ERROR_INVALID_DEVICE;
    if (!r) {
        fk_op *op = new_op(OP_PREFETCH, api);
        op->dst = p;
        op->count = count;
        op->elem = 1;
        op->prefetch_loc = loc;
        enqueue_locked(s, op);
    }
    fk_unlock(&G.lock);
    return r;
}
API_OLD cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream) {
    return prefetch("cuMemPrefetchAsync", devPtr, count, loc_of_device(dstDevice), 0, hStream);
}
API_12000 cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                CUstream hStream) {
    return prefetch("cuMemPrefetchAsync_v2", devPtr, count, loc_of(location), flags, hStream);
}

static void run_prefetch(fk_op *op, fk_stream *s) {
    fk_view v;
    fk_lock(&G.lock);
    if (pin_range_locked(op->api, "read", op->dst, op->count, s, &v)) {
        fk_alloc *a = tab_containing(&G.htab, op->dst);
        if (a && a->kind == AK_MANAGED) a->adv_last_prefetch = op->prefetch_loc;
        unpin_view_locked(&v);
    }
    fk_unlock(&G.lock);
}

API_OLD cuMemRangeGetAttribute(void *data, size_t dataSize, int attribute, CUdeviceptr devPtr, size_t count) {
    fk_alloc *a;
    CUresult r = CUDA_SUCCESS;
    ENTER("cuMemRangeGetAttribute");
    if (!data || !dataSize) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    a = managed_range_locked(devPtr, count);
    if (!a) r = CUDA_ERROR_INVALID_VALUE;
    else if (attribute == 3) { /* ACCESSED_BY: every location, then CU_DEVICE_INVALID (-2) */
        size_t n = dataSize / 4, i = 0;
        int d;
        if (dataSize % 4) r = CUDA_ERROR_INVALID_VALUE;
        else {
            for (d = 0; d < G.ndev && i < n; d++)
                if (a->adv_accessed & (1u << d)) ((int *)data)[i++] = d;
            if ((a->adv_accessed & (1u << 31)) && i < n) ((int *)data)[i++] = -1;
            while (i < n) ((int *)data)[i++] = -2;
        }
    } else if (dataSize != 4) r = CUDA_ERROR_INVALID_VALUE;
    else if (attribute == 1) *(int *)data = a->adv_read_mostly; /* READ_MOSTLY */
    else if (attribute == 2) *(int *)data = loc_legacy(a->adv_pref); /* PREFERRED_LOCATION */
    else if (attribute == 4) *(int *)data = loc_legacy(a->adv_last_prefetch); /* LAST_PREFETCH_LOCATION */
    else r = CUDA_ERROR_INVALID_VALUE;
    fk_unlock(&G.lock);
    return r;
}

/* ---- the worker side of the extension ops ---- */
static void run_ext_op(fk_op *op, fk_stream *s) {
    switch (op->kind) {
    case OP_REGION:
    case OP_MEMSET2D: run_region(op, s); break;
    case OP_PREFETCH: run_prefetch(op, s); break;
    case OP_IPC_WAIT: {
        fk_ipc_shared *sh = ipc_shared(op->ev); /* the op holds a reference on the event */
        while (atomic_load(&sh->completed) < op->ipc_ticket) fk_sleep_us(50);
        break;
    }
    default: break;
    }
}

/* ---- JIT options, shared by module loads, links and libraries ---- */
#define CU_JIT_MAX_REGISTERS 0
#define CU_JIT_WALL_TIME 2
#define CU_JIT_OPTIMIZATION_LEVEL 7
#define CU_JIT_TARGET 9
#define CU_JIT_FALLBACK_STRATEGY 10
#define CU_JIT_GENERATE_DEBUG_INFO 11
#define CU_JIT_GENERATE_LINE_INFO 13
#define CU_JIT_CACHE_MODE 14
#define CU_JIT_NUM_OPTIONS 35

/* Whether `t` is a CUjit_target of cuda.h 13.0 (compute_30 to compute_121, with the 'a' (1 << 16)
   and 'f' (2 << 16) variants). */
static int valid_target(unsigned t) {
    static const unsigned cc[] = {30, 32, 35, 37, 50, 52, 53, 60, 61, 62, 70, 72, 75,
                                  80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121};
    size_t i;
    if ((t >> 16) > 2) return 0;
    for (i = 0; i < sizeof cc / sizeof cc[0]; i++)
        if (cc[i] == (t & 0xFFFF)) return 1;
    return 0;
}

/* Checks the options (CUDA_ERROR_INVALID_VALUE for a value out of range or an unknown option) and
   describes those that change the code, for the information log. */
static CUresult jit_options(unsigned n, CUjit_option *options, void **values, fk_jit *j) {
    unsigned i;
    size_t len = 0;
    memset(j, 0, sizeof *j);
    j->opt_level = j->fallback = j->cache_mode = -1;
    j->wall_time_at = -1;
    for (i = 0; i < n; i++) {
        uintptr_t v = (uintptr_t)values[i];
        switch (options[i]) {
        case CU_JIT_MAX_REGISTERS:
            if (v < 1 || v > 255) return CUDA_ERROR_INVALID_VALUE;
            j->max_regs = (int)v;
            break;
        case CU_JIT_WALL_TIME: j->wall_time_at = (long)i; break;
        case CU_JIT_OPTIMIZATION_LEVEL:
            if (v > 4) return CUDA_ERROR_INVALID_VALUE;
            j->opt_level = (int)v;
            break;
        case CU_JIT_TARGET:
            if (!valid_target((unsigned)v)) return CUDA_ERROR_INVALID_VALUE;
            j->target = (int)v;
            break;
        case CU_JIT_FALLBACK_STRATEGY:
            if (v > 1) return CUDA_ERROR_INVALID_VALUE;
            j->fallback = (int)v;
            break;
        case CU_JIT_GENERATE_DEBUG_INFO: j->debug_info = v != 0; break;
        case CU_JIT_GENERATE_LINE_INFO: j->line_info = v != 0; break;
        case CU_JIT_CACHE_MODE:
            if (v > 2) return CUDA_ERROR_INVALID_VALUE;
            j->cache_mode = (int)v;
            break;
        default:
            if ((unsigned)options[i] >= CU_JIT_NUM_OPTIONS) return CUDA_ERROR_INVALID_VALUE;
        }
    }
#define DESC(...) len += (size_t)snprintf(j->desc + len, len < sizeof j->desc ? sizeof j->desc - len : 0, __VA_ARGS__)
    if (j->max_regs) DESC("%smax registers %d", len ? ", " : "", j->max_regs);
    if (j->opt_level >= 0) DESC("%soptimisation level %d", len ? ", " : "", j->opt_level);
    if (j->target)
        DESC("%starget compute_%d%s", len ? ", " : "", j->target & 0xFFFF,
             (j->target >> 16) == 1 ? "a" : (j->target >> 16) == 2 ? "f" : "");
    if (j->fallback >= 0) DESC("%sprefer %s", len ? ", " : "", j->fallback ? "binary" : "PTX");
    if (j->line_info) DESC("%sline info", len ? ", " : "");
    if (j->debug_info) DESC("%sdebug info", len ? ", " : "");
    if (j->cache_mode >= 0) DESC("%scache mode %s", len ? ", " : "", j->cache_mode == 1 ? "cg" : j->cache_mode == 2 ? "ca" : "default");
#undef DESC
    return CUDA_SUCCESS;
}

/* Writes `msg` into the error (error = 1) or information log named by the options, and the used
   size into its size slot; the other log is emptied. */
static void jit_logs(unsigned n, CUjit_option *options, void **values, int error, const char *msg) {
    char *errbuf = NULL, *infobuf = NULL;
    size_t errsz = 0, infosz = 0;
    unsigned i;
    for (i = 0; i < n; i++) {
        if (options[i] == CU_JIT_ERROR_LOG_BUFFER) errbuf = (char *)values[i];
        if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) errsz = (size_t)(uintptr_t)values[i];
        if (options[i] == CU_JIT_INFO_LOG_BUFFER) infobuf = (char *)values[i];
        if (options[i] == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES) infosz = (size_t)(uintptr_t)values[i];
    }
    if (error) {
        write_log(errbuf, &errsz, msg);
        if (infobuf && infosz) infobuf[0] = 0, infosz = 1;
    } else {
        if (errbuf && errsz) errbuf[0] = 0, errsz = 1;
        write_log(infobuf, &infosz, msg);
    }
    for (i = 0; i < n; i++) {
        if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) values[i] = (void *)(uintptr_t)errsz;
        if (options[i] == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES) values[i] = (void *)(uintptr_t)infosz;
    }
}

/* The compiler's wall time, a float of milliseconds in the first bytes of the option's slot. */
static void jit_wall_time(void **values, const fk_jit *j) {
    float ms = 0.25f;
    if (j->wall_time_at >= 0) memcpy(&values[j->wall_time_at], &ms, sizeof ms);
}

static CUresult jit_compile(const void *image, unsigned int numOptions, CUjit_option *options, void **optionValues,
                            int *kernels, int *nk, int *max_regs) {
    fk_jit j;
    char msg[512];
    CUresult r;
    if (numOptions && (!options || !optionValues)) return CUDA_ERROR_INVALID_VALUE;
    r = jit_options(numOptions, options, optionValues, &j);
    if (r) return r;
    r = parse_image(image, kernels, nk, msg, sizeof msg);
    if (!r && j.target && ((j.target & 0xFFFF) > 90 || ((j.target >> 16) && (j.target & 0xFFFF) != 90))) {
        snprintf(msg, sizeof msg, "fake ptxas: code for compute_%d%s cannot run on the device (sm_90)",
                 j.target & 0xFFFF, (j.target >> 16) == 1 ? "a" : (j.target >> 16) == 2 ? "f" : "");
        r = CUDA_ERROR_NO_BINARY_FOR_GPU;
    }
    if (!r && j.desc[0]) {
        size_t len = strlen(msg);
        snprintf(msg + len, sizeof msg - len, " (%s)", j.desc);
    }
    jit_logs(numOptions, options, optionValues, r != CUDA_SUCCESS, msg);
    if (r) return r;
    jit_wall_time(optionValues, &j);
    *max_regs = j.max_regs;
    return CUDA_SUCCESS;
}

/* ---- the linker ---- */
#define FK_MAGIC_LINK 0x4c494e4bU
#define CUDA_ERROR_FILE_NOT_FOUND 301
static const char FK_IMAGE_MARK[8] = {'F', 'K', 'L', 'I', 'N', 'K', 0, 0};

/* Whether `u` is an image the fake linker made: a 64-byte ELF header marked FKLINK, then the text of
   its entries (see cuLinkComplete). */
static int is_fake_image(const unsigned char *u) {
    return u[0] == 0x7f && u[1] == 'E' && u[2] == 'L' && u[3] == 'F' && !memcmp(u + 8, FK_IMAGE_MARK, 8);
}

typedef struct fk_link {
    uint32_t magic;
    fk_ctx *ctx;
    /* the caller's option arrays, which the driver keeps (and writes the logs through) until
       cuLinkDestroy */
    unsigned nopts;
    CUjit_option *options;
    void **values;
    fk_jit jit;
    size_t errcap, infocap; /* the log buffers' sizes, as given to cuLinkCreate */
    int kernels[K_COUNT], nk, ninputs;
    char dup[160]; /* the first duplicate definition, reported by cuLinkComplete */
    unsigned char *image;
    size_t image_size;
} fk_link;
typedef fk_link *CUlinkState;
enum { CU_JIT_INPUT_CUBIN, CU_JIT_INPUT_PTX, CU_JIT_INPUT_FATBINARY, CU_JIT_INPUT_OBJECT, CU_JIT_INPUT_LIBRARY };

static fk_link *valid_link_locked(CUlinkState l) { return l && vec_find(&GX.links, l) >= 0 ? l : NULL; }

/* Writes a log of the link: the size slots, which earlier writes set to the used sizes, get the
   buffers' sizes back first (the driver keeps those itself). */
static void link_log(fk_link *l, int error, const char *msg) {
    unsigned i;
    for (i = 0; i < l->nopts; i++) {
        if (l->options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) l->values[i] = (void *)(uintptr_t)l->errcap;
        if (l->options[i] == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES) l->values[i] = (void *)(uintptr_t)l->infocap;
    }
    jit_logs(l->nopts, l->options, l->values, error, msg);
}

API_OLD cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues, CUlinkState *stateOut) {
    fk_ctx *c;
    fk_jit j;
    CUresult r;
    ENTER("cuLinkCreate_v2");
    if (!stateOut || (numOptions && (!options || !optionValues))) return CUDA_ERROR_INVALID_VALUE;
    r = jit_options(numOptions, options, optionValues, &j);
    if (r) return r;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r) {
        fk_link *l = (fk_link *)calloc(1, sizeof *l);
        if (!l) abort();
        l->magic = FK_MAGIC_LINK;
        l->ctx = c;
        unsigned i;
        l->nopts = numOptions;
        l->options = options;
        l->values = optionValues;
        l->jit = j;
        for (i = 0; i < numOptions; i++) {
            if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) l->errcap = (size_t)(uintptr_t)optionValues[i];
            if (options[i] == CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES) l->infocap = (size_t)(uintptr_t)optionValues[i];
        }
        vec_push(&GX.links, l);
        *stateOut = l;
    }
    fk_unlock(&G.lock);
    return r;
}

static CUresult link_add(fk_link *l, int type, const void *data, size_t size, const char *name) {
    int kernels[K_COUNT], nk = 0, k, i;
    char msg[512], log[700];
    CUresult r;
    if (type < CU_JIT_INPUT_CUBIN || type > CU_JIT_INPUT_LIBRARY) return CUDA_ERROR_INVALID_VALUE;
    if (!memchr(data, 0, size)) return CUDA_ERROR_INVALID_VALUE; /* the fake reads text: it must end */
    if (type != CU_JIT_INPUT_PTX && (size < FK_IMAGE_HEADER + 1 || !is_fake_image((const unsigned char *)data))) {
        snprintf(log, sizeof log,
                 "fake nvlink: %s: not an image of the fake linker (it links PTX text and its own output)", name);
        link_log(l, 1, log);
        return CUDA_ERROR_NO_BINARY_FOR_GPU;
    }
    if (type == CU_JIT_INPUT_PTX && is_fake_image((const unsigned char *)data)) return CUDA_ERROR_INVALID_VALUE;
    r = parse_image(data, kernels, &nk, msg, sizeof msg);
    if (r) {
        snprintf(log, sizeof log, "%s: %s", name, msg);
        link_log(l, 1, log);
        return r;
    }
    for (i = 0; i < nk; i++) {
        for (k = 0; k < l->nk && l->kernels[k] != kernels[i]; k++) {
        }
        if (k < l->nk) {
            if (!l->dup[0])
                snprintf(l->dup, sizeof l->dup, "fake nvlink: duplicate definition of '%s' in %s",
                         KERNELS[kernels[i]].name, name);
        } else l->kernels[l->nk++] = kernels[i];
    }
    l->ninputs++;
    snprintf(log, sizeof log, "fake nvlink: added %s (%d entr%s)", name, nk, nk == 1 ? "y" : "ies");
    link_log(l, 0, log);
    return CUDA_SUCCESS;
}

API_OLD cuLinkAddData_v2(CUlinkState state, int type, void *data, size_t size, const char *name,
                         unsigned int numOptions, CUjit_option *options, void **optionValues) {
    fk_link *l;
    CUresult r;
    ENTER("cuLinkAddData_v2");
    (void)options;
    (void)optionValues;
    if (!data || !size || (numOptions && (!options || !optionValues))) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    l = valid_link_locked(state);
    fk_unlock(&G.lock);
    if (!l) return CUDA_ERROR_INVALID_HANDLE;
    r = link_add(l, type, data, size, name ? name : "(unnamed)");
    return r;
}

API_OLD cuLinkAddFile_v2(CUlinkState state, int type, const char *path, unsigned int numOptions,
                         CUjit_option *options, void **optionValues) {
    fk_link *l;
    FILE *f;
    unsigned char *buf;
    long len;
    CUresult r;
    ENTER("cuLinkAddFile_v2");
    if (!path || (numOptions && (!options || !optionValues))) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    l = valid_link_locked(state);
    fk_unlock(&G.lock);
    if (!l) return CUDA_ERROR_INVALID_HANDLE;
    if (!(f = fopen(path, "rb"))) return CUDA_ERROR_FILE_NOT_FOUND;
    if (fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return CUDA_ERROR_FILE_NOT_FOUND;
    }
    buf = (unsigned char *)calloc(1, (size_t)len + 1);
    if (!buf) abort();
    if (fread(buf, 1, (size_t)len, f) != (size_t)len) {
        fclose(f);
        free(buf);
        return CUDA_ERROR_FILE_NOT_FOUND;
    }
    fclose(f);
    r = len ? link_add(l, type, buf, (size_t)len + 1, path) : CUDA_ERROR_INVALID_VALUE;
    free(buf);
    return r;
}

API_OLD cuLinkComplete(CUlinkState state, void **cubinOut, size_t *sizeOut) {
    fk_link *l;
    CUresult r = CUDA_SUCCESS;
    ENTER("cuLinkComplete");
    if (!cubinOut || !sizeOut) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    l = valid_link_locked(state);
    fk_unlock(&G.lock);
    if (!l) return CUDA_ERROR_INVALID_HANDLE;
    if (!l->ninputs) return CUDA_ERROR_INVALID_VALUE;
    if (l->dup[0]) {
        link_log(l, 1, l->dup);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    if (!l->image) {
        size_t len = FK_IMAGE_HEADER + 1, at;
        int k;
        char info[160];
        for (k = 0; k < l->nk; k++) len += 8 + strlen(KERNELS[l->kernels[k]].name);
        l->image = (unsigned char *)calloc(1, len);
        if (!l->image) abort();
        memcpy(l->image, "\x7f" "ELF", 4);
        l->image[4] = 2; /* 64-bit */
        l->image[5] = 1; /* little-endian */
        l->image[6] = 1; /* ELF version */
        memcpy(l->image + 8, FK_IMAGE_MARK, 8);
        at = FK_IMAGE_HEADER;
        for (k = 0; k < l->nk; k++)
            at += (size_t)sprintf((char *)l->image + at, ".entry %s\n", KERNELS[l->kernels[k]].name);
        l->image_size = at + 1;
        snprintf(info, sizeof info, "fake nvlink: linked %d input%s into %d entr%s", l->ninputs,
                 l->ninputs == 1 ? "" : "s", l->nk, l->nk == 1 ? "y" : "ies");
        link_log(l, 0, info);
        jit_wall_time(l->values, &l->jit);
    }
    *cubinOut = l->image;
    *sizeOut = l->image_size;
    return r;
}

API_OLD cuLinkDestroy(CUlinkState state) {
    fk_link *l;
    ENTER("cuLinkDestroy");
    fk_lock(&G.lock);
    l = valid_link_locked(state);
    if (l) vec_remove(&GX.links, l);
    fk_unlock(&G.lock);
    if (!l) return CUDA_ERROR_INVALID_HANDLE;
    free(l->image);
    l->magic = 0;
    free(l);
    return CUDA_SUCCESS;
}

/* ---- context-independent libraries ---- */
#define FK_MAGIC_LIBRARY 0x4c494252U
#define FK_MAGIC_KERNEL 0x4b524e4cU
struct fk_library;
typedef struct fk_kernel {
    uint32_t magic;
    struct fk_library *lib;
    int index; /* in the library's kernels */
} fk_kernel;
typedef struct fk_library {
    uint32_t magic;
    int nk, max_regs;
    int kernels[K_COUNT];
    fk_kernel kern[K_COUNT];
    fk_module *mods[FK_MAX_DEVICES]; /* its code in each device's context, made on first use */
} fk_library;
typedef fk_library *CUlibrary;
typedef fk_kernel *CUkernel;

static fk_library *valid_library_locked(CUlibrary l) { return l && vec_find(&GX.libraries, l) >= 0 ? l : NULL; }
static fk_kernel *valid_kernel_locked(CUkernel k) {
    size_t i;
    for (i = 0; k && i < GX.libraries.n; i++) {
        fk_library *l = (fk_library *)GX.libraries.v[i];
        if (k >= l->kern && k < l->kern + l->nk) return k;
    }
    return NULL;
}

API_12000 cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                            unsigned int numJitOptions, int *libraryOptions, void **libraryOptionValues,
                            unsigned int numLibraryOptions) {
    int kernels[K_COUNT], nk = 0, max_regs = 0, k;
    unsigned i;
    CUresult r;
    ENTER("cuLibraryLoadData");
    (void)libraryOptionValues;
    if (!library || !code || (numLibraryOptions && (!libraryOptions || !libraryOptionValues)))
        return CUDA_ERROR_INVALID_VALUE;
    for (i = 0; i < numLibraryOptions; i++)
        if (libraryOptions[i] < 0 || libraryOptions[i] > 1) return CUDA_ERROR_INVALID_VALUE;
    r = jit_compile(code, numJitOptions, jitOptions, jitOptionsValues, kernels, &nk, &max_regs);
    if (r) return r;
    {
        fk_library *l = (fk_library *)calloc(1, sizeof *l);
        if (!l) abort();
        l->magic = FK_MAGIC_LIBRARY;
        l->nk = nk;
        l->max_regs = max_regs;
        for (k = 0; k < nk; k++) {
            l->kernels[k] = kernels[k];
            l->kern[k].magic = FK_MAGIC_KERNEL;
            l->kern[k].lib = l;
            l->kern[k].index = k;
        }
        fk_lock(&G.lock);
        vec_push(&GX.libraries, l);
        fk_unlock(&G.lock);
        *library = l;
    }
    return CUDA_SUCCESS;
}

API_12000 cuLibraryUnload(CUlibrary library) {
    fk_library *l;
    int d;
    ENTER("cuLibraryUnload");
    fk_lock(&G.lock);
    l = valid_library_locked(library);
    if (l) {
        vec_remove(&GX.libraries, l);
        for (d = 0; d < FK_MAX_DEVICES; d++)
            if (l->mods[d]) {
                vec_remove(&G.modules, l->mods[d]);
                l->mods[d]->magic = 0;
                free(l->mods[d]);
            }
        l->magic = 0;
        free(l);
    }
    fk_unlock(&G.lock);
    return l ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API_12000 cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    fk_library *l;
    CUresult r = CUDA_ERROR_NOT_FOUND;
    int k;
    ENTER("cuLibraryGetKernel");
    if (!pKernel || !name) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if (!(l = valid_library_locked(library))) r = CUDA_ERROR_INVALID_HANDLE;
    else
        for (k = 0; k < l->nk; k++)
            if (!strcmp(KERNELS[l->kernels[k]].name, name)) {
                *pKernel = &l->kern[k];
                r = CUDA_SUCCESS;
            }
    fk_unlock(&G.lock);
    return r;
}

API_12000 cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    fk_ctx *c;
    fk_kernel *k = NULL;
    CUresult r;
    ENTER("cuKernelGetFunction");
    if (!pFunc) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    r = cur_ctx_locked(&c);
    if (!r && !(k = valid_kernel_locked(kernel))) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r) {
        fk_library *l = k->lib;
        fk_module *m = l->mods[c->dev];
        if (!m) { /* the library's code in this context, loaded at first use */
            int i;
            m = (fk_module *)calloc(1, sizeof *m);
            if (!m) abort();
            m->magic = FK_MAGIC_MODULE;
            m->ctx = c;
            m->nfuncs = l->nk;
            m->max_regs = l->max_regs;
            m->lib = l;
            for (i = 0; i < l->nk; i++) {
                m->funcs[i].magic = FK_MAGIC_FUNC;
                m->funcs[i].mod = m;
                m->funcs[i].kernel = l->kernels[i];
                m->funcs[i].max_dyn_smem = FK_SMEM_DEFAULT;
                m->funcs[i].carveout = -1;
            }
            vec_push(&G.modules, m);
            l->mods[c->dev] = m;
        }
        *pFunc = &m->funcs[k->index];
    }
    fk_unlock(&G.lock);
    return r;
}

API_12000 cuLibraryGetKernelCount(unsigned int *count, CUlibrary lib) {
    fk_library *l;
    ENTER("cuLibraryGetKernelCount");
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if ((l = valid_library_locked(lib))) *count = (unsigned)l->nk;
    fk_unlock(&G.lock);
    return l ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API_12000 cuLibraryEnumerateKernels(CUkernel *kernels, unsigned int numKernels, CUlibrary lib) {
    fk_library *l;
    unsigned i;
    ENTER("cuLibraryEnumerateKernels");
    if (!kernels && numKernels) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if ((l = valid_library_locked(lib)))
        for (i = 0; i < numKernels && i < (unsigned)l->nk; i++) kernels[i] = &l->kern[i];
    fk_unlock(&G.lock);
    return l ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API_12000 cuKernelGetName(const char **name, CUkernel hfunc) {
    fk_kernel *k;
    ENTER("cuKernelGetName");
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    if ((k = valid_kernel_locked(hfunc))) *name = KERNELS[k->lib->kernels[k->index]].name;
    fk_unlock(&G.lock);
    return k ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* ---- cluster occupancy ---- */
/* The cluster size a query names (its CLUSTER_DIMENSION attribute, else the kernel's required
   size; 0 if neither), the most the kernel allows, and the blocks per SM of its configuration. */
static CUresult cluster_query(const char *api, CUfunction func, const CUlaunchConfig *config, int *size, int *limit,
                              int *blocks) {
    unsigned cluster[3];
    int coop, has_cluster;
    CUresult r = CUDA_SUCCESS;
    ENTER(api);
    fk_lock(&G.lock);
    if (!valid_func(func)) r = CUDA_ERROR_INVALID_HANDLE;
    fk_unlock(&G.lock);
    if (r) return r;
    r = check_launch_attrs(config, &coop, cluster, &has_cluster);
    if (r) return r;
    *limit = func->nonportable ? 16 : 8;
    *size = 0;
    if (has_cluster) *size = (int)(cluster[0] * cluster[1] * cluster[2]);
    else if (func->cluster[0])
        *size = func->cluster[0] * (func->cluster[1] ? func->cluster[1] : 1) * (func->cluster[2] ? func->cluster[2] : 1);
    *blocks =
        blocks_per_sm((int)(config->blockDimX * config->blockDimY * config->blockDimZ), config->sharedMemBytes);
    return CUDA_SUCCESS;
}

API_11060 cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config) {
    int size, limit, blocks;
    CUresult r;
    if (!numClusters || !config) return CUDA_ERROR_INVALID_VALUE;
    r = cluster_query("cuOccupancyMaxActiveClusters", func, config, &size, &limit, &blocks);
    if (r) return r;
    if (!size) return CUDA_ERROR_INVALID_VALUE; /* no cluster size given */
    *numClusters = size > limit ? 0 : blocks * FK_SM_COUNT / size;
    return CUDA_SUCCESS;
}

API_11060 cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func, const CUlaunchConfig *config) {
    int size, limit, blocks;
    CUresult r;
    if (!clusterSize || !config) return CUDA_ERROR_INVALID_VALUE;
    r = cluster_query("cuOccupancyMaxPotentialClusterSize", func, config, &size, &limit, &blocks);
    if (r) return r;
    *clusterSize = !blocks ? 0 : size ? (size > limit ? 0 : size) : limit;
    return CUDA_SUCCESS;
}

/* ---- the record of the last launch ---- */
static void record_launch_locked(const char *api, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned smem, int cooperative, const unsigned *cluster) {
    struct CudrvFakeLaunch *l = &GX.last;
    uint64_t n = l->launches + 1;
    unsigned i;
    memset(l, 0, sizeof *l);
    l->launches = n;
    l->grid[0] = gx, l->grid[1] = gy, l->grid[2] = gz;
    l->block[0] = bx, l->block[1] = by, l->block[2] = bz;
    l->shared_mem_bytes = smem;
    l->cooperative = cooperative;
    if (cluster) l->cluster[0] = cluster[0], l->cluster[1] = cluster[1], l->cluster[2] = cluster[2];
    l->mem_sync_domain = -1;
    snprintf(l->api, sizeof l->api, "%s", api);
    for (i = 0; tl_launch_config && i < tl_launch_config->numAttrs; i++) {
        const CUlaunchAttribute *a = &tl_launch_config->attrs[i];
        switch (a->id) {
        case CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
            l->programmatic_stream_serialization = a->value.programmaticStreamSerializationAllowed;
            break;
        case CU_LAUNCH_ATTRIBUTE_PRIORITY:
            l->has_priority = 1;
            l->priority = a->value.priority;
            break;
        case CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN: l->mem_sync_domain = a->value.memSyncDomain; break;
        case CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW:
            l->has_access_policy_window = 1;
            l->apw_base = (uint64_t)(uintptr_t)a->value.accessPolicyWindow.base_ptr;
            l->apw_bytes = a->value.accessPolicyWindow.num_bytes;
            l->apw_hit_ratio = a->value.accessPolicyWindow.hitRatio;
            l->apw_hit = a->value.accessPolicyWindow.hitProp;
            l->apw_miss = a->value.accessPolicyWindow.missProp;
            break;
        case CU_LAUNCH_ATTRIBUTE_PREFERRED_CLUSTER_DIMENSION:
            l->preferred_cluster[0] = a->value.preferredClusterDim.x;
            l->preferred_cluster[1] = a->value.preferredClusterDim.y;
            l->preferred_cluster[2] = a->value.preferredClusterDim.z;
            break;
        default: break;
        }
    }
}

/* Fake-only: copies the record of the last successful launch into *out. Returns 0. */
FK_EXPORT int cudrvFakeLastLaunch(struct CudrvFakeLaunch *out) {
    if (!out) return -1;
    fk_lock(&G.lock);
    *out = GX.last;
    fk_unlock(&G.lock);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* cuGetProcAddress                                                                                   */
/* ------------------------------------------------------------------------------------------------ */
typedef struct {
    const char *name; /* base name, as cuGetProcAddress takes it */
    int version;      /* the CUDA version that introduced this variant (cudaTypedefs.h) */
    void *fn;
    const char *exported; /* the variant's exported name */
} fk_proc;

API_11030 cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
API_12000 cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                              CUdriverProcAddressQueryResult *symbolStatus);

#define P(name, ver, fn) {name, ver, (void *)fn, #fn}
static const fk_proc PROC_TABLE[] = {
    P("cuInit", 2000, cuInit),
    P("cuDriverGetVersion", 2020, cuDriverGetVersion),
    P("cuGetProcAddress", 11030, cuGetProcAddress),
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    P("cuGetErrorName", 6000, cuGetErrorName),
    P("cuGetErrorString", 6000, cuGetErrorString),
    P("cuDeviceGetCount", 2000, cuDeviceGetCount),
    P("cuDeviceGet", 2000, cuDeviceGet),
    P("cuDeviceGetName", 2000, cuDeviceGetName),
    P("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    P("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    P("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
    P("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    P("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    P("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
    P("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool),
    P("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool),
    P("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer),
    P("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    P("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    P("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    P("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    P("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    P("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    P("cuCtxGetDevice", 2000, cuCtxGetDevice),
    P("cuCtxGetDevice", 13000, cuCtxGetDevice_v2),
    P("cuCtxSynchronize", 2000, cuCtxSynchronize),
    P("cuCtxSynchronize", 13000, cuCtxSynchronize_v2),
    P("cuCtxGetStreamPriorityRange", 5050, cuCtxGetStreamPriorityRange),
    P("cuCtxEnablePeerAccess", 4000, cuCtxEnablePeerAccess),
    P("cuCtxDisablePeerAccess", 4000, cuCtxDisablePeerAccess),
    P("cuStreamCreate", 2000, cuStreamCreate),
    P("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
    P("cuStreamDestroy", 2000, cuStreamDestroy),
    P("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    P("cuStreamSynchronize", 2000, cuStreamSynchronize),
    P("cuStreamQuery", 2000, cuStreamQuery),
    P("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
    P("cuStreamGetPriority", 5050, cuStreamGetPriority),
    P("cuStreamGetFlags", 5050, cuStreamGetFlags),
    P("cuStreamGetCtx", 9020, cuStreamGetCtx),
    P("cuStreamGetCtx", 12050, cuStreamGetCtx_v2),
    P("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
    P("cuEventCreate", 2000, cuEventCreate),
    P("cuEventDestroy", 2000, cuEventDestroy),
    P("cuEventDestroy", 4000, cuEventDestroy_v2),
    P("cuEventRecord", 2000, cuEventRecord),
    P("cuEventQuery", 2000, cuEventQuery),
    P("cuEventSynchronize", 2000, cuEventSynchronize),
    P("cuEventElapsedTime", 2000, cuEventElapsedTime),
    P("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
    P("cuMemAlloc", 3020, cuMemAlloc_v2),
    P("cuMemFree", 3020, cuMemFree_v2),
    P("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    P("cuMemAllocAsync", 11020, cuMemAllocAsync),
    P("cuMemFreeAsync", 11020, cuMemFreeAsync),
    P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
    P("cuMemPoolCreate", 11020, cuMemPoolCreate),
    P("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
    P("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute),
    P("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute),
    P("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo),
    P("cuMemPoolSetAccess", 11020, cuMemPoolSetAccess),
    P("cuMemPoolGetAccess", 11020, cuMemPoolGetAccess),
    P("cuMemAddressReserve", 10020, cuMemAddressReserve),
    P("cuMemAddressFree", 10020, cuMemAddressFree),
    P("cuMemCreate", 10020, cuMemCreate),
    P("cuMemRelease", 10020, cuMemRelease),
    P("cuMemMap", 10020, cuMemMap),
    P("cuMemUnmap", 10020, cuMemUnmap),
    P("cuMemSetAccess", 10020, cuMemSetAccess),
    P("cuMemGetAccess", 10020, cuMemGetAccess),
    P("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle),
    P("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle),
    P("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    P("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle),
    P("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    P("cuMemsetD8", 3020, cuMemsetD8_v2),
    P("cuMemsetD32", 3020, cuMemsetD32_v2),
    P("cuMemsetD8Async", 3020, cuMemsetD8Async),
    P("cuMemsetD32Async", 3020, cuMemsetD32Async),
    P("cuMemsetD16", 3020, cuMemsetD16_v2),
    P("cuMemsetD16Async", 3020, cuMemsetD16Async),
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    P("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
    P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    P("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    P("cuMemcpyPeer", 4000, cuMemcpyPeer),
    P("cuMemcpyPeerAsync", 4000, cuMemcpyPeerAsync),
    P("cuMemHostAlloc", 2020, cuMemHostAlloc),
    P("cuMemFreeHost", 2000, cuMemFreeHost),
    P("cuMemAllocManaged", 6000, cuMemAllocManaged),
    P("cuMemHostRegister", 4000, cuMemHostRegister),
    P("cuMemHostRegister", 6050, cuMemHostRegister_v2),
    P("cuMemHostUnregister", 4000, cuMemHostUnregister),
    P("cuModuleLoadData", 2000, cuModuleLoadData),
    P("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx),
    P("cuModuleUnload", 2000, cuModuleUnload),
    P("cuModuleGetFunction", 2000, cuModuleGetFunction),
    P("cuFuncGetAttribute", 2020, cuFuncGetAttribute),
    P("cuFuncSetAttribute", 9000, cuFuncSetAttribute),
    P("cuLaunchKernel", 4000, cuLaunchKernel),
    P("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel),
    P("cuLaunchKernelEx", 11060, cuLaunchKernelEx),
    P("cuOccupancyMaxActiveBlocksPerMultiprocessor", 6050, cuOccupancyMaxActiveBlocksPerMultiprocessor),
    P("cuOccupancyMaxPotentialBlockSize", 6050, cuOccupancyMaxPotentialBlockSize),
    FK_GRAPH_PROCS /* fake_graph.c */
    /* API extensions */
    P("cuLinkCreate", 6050, cuLinkCreate_v2),
    P("cuLinkAddData", 6050, cuLinkAddData_v2),
    P("cuLinkAddFile", 6050, cuLinkAddFile_v2),
    P("cuLinkComplete", 5050, cuLinkComplete),
    P("cuLinkDestroy", 5050, cuLinkDestroy),
    P("cuLibraryLoadData", 12000, cuLibraryLoadData),
    P("cuLibraryUnload", 12000, cuLibraryUnload),
    P("cuLibraryGetKernel", 12000, cuLibraryGetKernel),
    P("cuKernelGetFunction", 12000, cuKernelGetFunction),
    P("cuKernelGetName", 12030, cuKernelGetName),
    P("cuLibraryGetKernelCount", 12040, cuLibraryGetKernelCount),
    P("cuLibraryEnumerateKernels", 12040, cuLibraryEnumerateKernels),
    P("cuOccupancyMaxActiveClusters", 11080, cuOccupancyMaxActiveClusters),
    P("cuOccupancyMaxPotentialClusterSize", 11080, cuOccupancyMaxPotentialClusterSize),
    P("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
    P("cuMemcpy2DAsync", 3020, cuMemcpy2DAsync_v2),
    P("cuMemcpy3DAsync", 3020, cuMemcpy3DAsync_v2),
    P("cuMemsetD2D8", 3020, cuMemsetD2D8_v2),
    P("cuMemsetD2D16", 3020, cuMemsetD2D16_v2),
    P("cuMemsetD2D32", 3020, cuMemsetD2D32_v2),
    P("cuMemsetD2D8Async", 3020, cuMemsetD2D8Async),
    P("cuMemsetD2D16Async", 3020, cuMemsetD2D16Async),
    P("cuMemsetD2D32Async", 3020, cuMemsetD2D32Async),
    P("cuMemPrefetchAsync", 8000, cuMemPrefetchAsync),
    P("cuMemPrefetchAsync", 12020, cuMemPrefetchAsync_v2),
    P("cuMemAdvise", 8000, cuMemAdvise),
    P("cuMemAdvise", 12020, cuMemAdvise_v2),
    P("cuMemRangeGetAttribute", 8000, cuMemRangeGetAttribute),
    P("cuPointerGetAttribute", 4000, cuPointerGetAttribute),
    P("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    P("cuIpcGetEventHandle", 4010, cuIpcGetEventHandle),
    P("cuIpcOpenEventHandle", 4010, cuIpcOpenEventHandle),
    P("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle),
    P("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2),
    P("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle),
    P("cuMemPoolExportToShareableHandle", 11020, cuMemPoolExportToShareableHandle),
    P("cuMemPoolImportFromShareableHandle", 11020, cuMemPoolImportFromShareableHandle),
    P("cuMemPoolExportPointer", 11020, cuMemPoolExportPointer),
    P("cuMemPoolImportPointer", 11020, cuMemPoolImportPointer),
};
#undef P

/* Whether `name` is a base name or an exported name of a function of this library. */
static int known_function_name(const char *name) {
    size_t i;
    for (i = 0; i < sizeof PROC_TABLE / sizeof PROC_TABLE[0]; i++)
        if (!strcmp(PROC_TABLE[i].name, name) || !strcmp(PROC_TABLE[i].exported, name)) return 1;
    return 0;
}

static CUresult get_proc(const char *api, const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                         CUdriverProcAddressQueryResult *status) {
    size_t i;
    int known = 0, best_ver = -1, drv;
    void *best = NULL;
    ENTER_NOINIT(api);
    if (!symbol || !pfn || (flags & ~(cuuint64_t)3)) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(&G.lock);
    drv = G.driver_version;
    fk_unlock(&G.lock);
    *pfn = NULL;
    for (i = 0; i < sizeof PROC_TABLE / sizeof PROC_TABLE[0]; i++) {
        const fk_proc *p = &PROC_TABLE[i];
        if (strcmp(p->name, symbol) || p->version > drv) continue;
        known = 1;
        if (p->version <= cudaVersion && p->version > best_ver) {
            best_ver = p->version;
            best = p->fn;
        }
    }
    if (best) {
        *pfn = best;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    if (status) *status = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

API_11030 cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return get_proc("cuGetProcAddress", symbol, pfn, cudaVersion, flags, NULL);
}
API_12000 cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                              CUdriverProcAddressQueryResult *symbolStatus) {
    return get_proc("cuGetProcAddress_v2", symbol, pfn, cudaVersion, flags, symbolStatus);
}

/* ------------------------------------------------------------------------------------------------ */
/* Fake-only exports                                                                                  */
/* ------------------------------------------------------------------------------------------------ */
struct CudrvFakeReport {
    uint64_t live_allocations;
    uint64_t live_bytes;
    uint64_t live_streams;
    uint64_t live_events;
    uint64_t live_modules;
    uint64_t violation_count;
};

static void report_locked(struct CudrvFakeReport *out) {
    size_t i;
    memset(out, 0, sizeof *out);
    for (i = 0; i < G.dtab.n; i++) {
        const fk_alloc *a = (const fk_alloc *)G.dtab.v[i];
        out->live_allocations++;
        out->live_bytes += a->size;
    }
    for (i = 0; i < G.htab.n; i++) {
        const fk_alloc *a = (const fk_alloc *)G.htab.v[i];
        if (a->kind == AK_REGISTERED) continue;
        out->live_allocations++;
        out->live_bytes += a->size;
    }
    for (i = 0; i < G.phys.n; i++) {
        out->live_allocations++;
        out->live_bytes += ((const fk_phys *)G.phys.v[i])->size;
    }
    out->live_allocations += G.vres.n; /* address reservations hold no memory */
    out->live_streams = G.streams.n;
    out->live_events = G.events.n;
    /* a library counts as one module; its code in each context does not count */
    out->live_modules = GX.libraries.n;
    for (i = 0; i < G.modules.n; i++)
        if (!((const fk_module *)G.modules.v[i])->lib) out->live_modules++;
    out->violation_count = G.nviolations;
}

/* Waits until every stream is idle, then fills *out. Returns 0. */
FK_EXPORT int cudrvFakeReport(struct CudrvFakeReport *out) {
    if (!out) return -1;
    fk_lock(&G.lock);
    read_env_locked();
    drain_all_locked();
    report_locked(out);
    fk_unlock(&G.lock);
    return 0;
}

/* Copies violation `index` (NUL-terminated, truncated to len). Returns 0, or -1 if out of range. */
FK_EXPORT int cudrvFakeViolation(unsigned index, char *buf, size_t len) {
    int r = -1;
    fk_lock(&G.lock);
    if (index < G.nviolations && index < FK_MAX_VIOLATIONS) {
        const char *v = G.violations[index] ? G.violations[index] : "(out of memory)";
        if (buf && len) {
            size_t n = strlen(v);
            if (n >= len) n = len - 1;
            memcpy(buf, v, n);
            buf[n] = 0;
        }
        r = 0;
    }
    fk_unlock(&G.lock);
    return r;
}

FK_EXPORT void cudrvFakeResetViolations(void) {
    uint64_t i;
    fk_lock(&G.lock);
    for (i = 0; i < G.nviolations && i < FK_MAX_VIOLATIONS; i++) {
        free(G.violations[i]);
        G.violations[i] = NULL;
    }
    G.nviolations = 0;
    fk_unlock(&G.lock);
}

/* The number of per-thread default streams whose thread has not exited (they are never counted as
   live streams by cudrvFakeReport). */
FK_EXPORT uint64_t cudrvFakePerThreadStreams(void) {
    uint64_t n;
    fk_lock(&G.lock);
    n = G.ptds_live;
    fk_unlock(&G.lock);
    return n;
}

/* How many calls CUDRV_FAKE_FAIL has failed so far: whether a fault was reached. */
FK_EXPORT uint64_t cudrvFakeFaultsInjected(void) {
    uint64_t n = 0;
    int i;
    fk_lock(&G.lock);
    read_env_locked();
    for (i = 0; i < G.nfaults; i++) n += G.faults[i].injected;
    fk_unlock(&G.lock);
    return n;
}

/* How many driver calls were made from inside host functions (see tl_in_host_fn). */
FK_EXPORT uint64_t cudrvFakeHostFnDriverCalls(void) {
    uint64_t n;
    fk_lock(&G.lock);
    n = g_host_fn_driver_calls;
    fk_unlock(&G.lock);
    return n;
}

FK_EXPORT void cudrvFakeShutdown(void) {
    fk_lock(&G.lock);
    read_env_locked();
    G.shutdown = 1;
    fk_unlock(&G.lock);
}

#if defined(__GNUC__)
__attribute__((destructor)) static void fk_report_at_exit(void) {
    struct CudrvFakeReport r;
    uint64_t i;
    if (!G.report_on_exit) return;
    fk_lock(&G.lock);
    report_locked(&r);
    fprintf(stderr,
            "cudrv fake driver report: live_allocations=%" PRIu64 " live_bytes=%" PRIu64 " live_streams=%" PRIu64
            " live_events=%" PRIu64 " live_modules=%" PRIu64 " violations=%" PRIu64 "\n",
            r.live_allocations, r.live_bytes, r.live_streams, r.live_events, r.live_modules, r.violation_count);
    graph_report_at_exit_locked(); /* fake_graph.c */
    for (i = 0; i < G.nviolations && i < FK_MAX_VIOLATIONS; i++)
        fprintf(stderr, "  violation %" PRIu64 ": %s\n", i, G.violations[i] ? G.violations[i] : "?");
    fk_unlock(&G.lock);
}
#endif

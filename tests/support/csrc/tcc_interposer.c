/*
 * cudrv's TCC interposer: libcudrv_tcc.so.
 *
 * A CUDA driver library that makes a real Linux GPU look like a Windows GPU in TCC mode, so that
 * cudrv's fallback allocator (StreamOrderedPool) runs on real hardware. It loads the real driver
 * (`CUDRV_TCC_REAL_DRIVER`, default `libcuda.so.1`) and forwards every call to it, with exactly
 * three differences:
 *
 *   - cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) reads 0;
 *   - cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_TCC_DRIVER) reads 1;
 *   - every memory-pool entry point (INTERCEPTED below) returns CUDA_ERROR_NOT_SUPPORTED (801)
 *     without calling the real driver.
 *
 * How calls reach the real driver:
 *
 *   - cuGetProcAddress / cuGetProcAddress_v2 ask the real driver, and hand back the real pointer,
 *     except for the intercepted names (and cuDeviceGetAttribute, cuGetProcAddress itself), for
 *     which they hand back this library's own function. A name the real driver does not serve
 *     fails exactly as it does there.
 *   - Exported symbols, for callers that look functions up by name (dlsym): cuInit,
 *     cuDriverGetVersion and cuDeviceGetAttribute are ordinary functions. Every other name in
 *     FORWARDED (every function that cudrv-sys declares) is a GNU indirect function whose resolver
 *     returns the real driver's symbol of the same name, so a dlsym of the interposer gives the
 *     real function itself (no trampoline, any signature) or NULL where the real driver lacks it.
 *     The intercepted names and cuGetProcAddress(_v2) are indirect functions too, resolving to this
 *     library's version where the real driver exports the name, and to NULL where it does not: a
 *     dlsym of the interposer finds exactly what a dlsym of the real driver finds.
 *
 * If the real driver cannot be loaded, the reason is printed to stderr once and every call returns
 * CUDA_ERROR_SHARED_OBJECT_INIT_FAILED (303).
 *
 * No CUDA header is included (CI machines have none): the few types and values needed are copied
 * below from CUDA 13.0's cuda.h. Linux (glibc) only: indirect functions need the GNU ELF loader.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- from cuda.h (CUDA 13.0) ---------------------------------------------------------------- */

typedef int CUresult;                         /* enum cudaError_enum */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_SHARED_OBJECT_INIT_FAILED 303
#define CUDA_ERROR_NOT_SUPPORTED 801

typedef int CUdevice;                         /* CUdevice_v1 */
typedef unsigned long long CUdeviceptr;       /* CUdeviceptr_v2 (64-bit targets) */
typedef uint64_t cuuint64_t;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef int CUdevice_attribute;               /* enum CUdevice_attribute_enum */
#define CU_DEVICE_ATTRIBUTE_TCC_DRIVER 35
#define CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED 115
typedef int CUmemPool_attribute;              /* enum CUmemPool_attribute_enum */
typedef int CUmemAccess_flags;                /* enum CUmemAccess_flags_enum */
typedef int CUmemAllocationType;              /* enum CUmemAllocationType_enum */
typedef int CUmemAllocationHandleType;        /* enum CUmemAllocationHandleType_enum */
typedef struct CUmemAccessDesc_st CUmemAccessDesc;
typedef struct CUmemLocation_st CUmemLocation;
typedef struct CUmemPoolProps_st CUmemPoolProps;
typedef struct CUmemPoolPtrExportData_st CUmemPoolPtrExportData;
typedef int CUdriverProcAddressQueryResult;   /* enum CUdriverProcAddressQueryResult_enum */
#define CU_GET_PROC_ADDRESS_SUCCESS 0

/* ---- loading the real driver ---------------------------------------------------------------- */

#define EXPORT __attribute__((visibility("default")))
#define UNUSED __attribute__((unused))

/* The type of an indirect function's target, as its resolver returns it. `void (*)(void)` converts
 * to and from every function pointer type without -Wcast-function-type complaining. */
typedef void (*any_fn)(void);

typedef CUresult (*init_fn)(unsigned int);
typedef CUresult (*version_fn)(int *);
typedef CUresult (*attribute_fn)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*proc_v1_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*proc_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static struct {
    void *lib;
    init_fn init;
    version_fn version;
    attribute_fn attribute;
    proc_v1_fn proc_v1;
    proc_v2_fn proc_v2;
} real;
static pthread_once_t real_once = PTHREAD_ONCE_INIT;

EXPORT CUresult cuDriverGetVersion(int *driverVersion);

static void load_real(void) {
    const char *path = getenv("CUDRV_TCC_REAL_DRIVER");
    if (path == NULL || path[0] == '\0') path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "cudrv_tcc: cannot load the real CUDA driver %s (set CUDRV_TCC_REAL_DRIVER): %s\n", path,
                dlerror());
        return;
    }
    void *version = dlsym(lib, "cuDriverGetVersion");
    if (version == NULL || version == (void *)&cuDriverGetVersion) {
        fprintf(stderr, "cudrv_tcc: %s is %s\n", path,
                version == NULL ? "not a CUDA driver (no cuDriverGetVersion)" : "the TCC interposer itself");
        dlclose(lib);
        return;
    }
    real.init = (init_fn)dlsym(lib, "cuInit");
    real.version = (version_fn)version;
    real.attribute = (attribute_fn)dlsym(lib, "cuDeviceGetAttribute");
    real.proc_v1 = (proc_v1_fn)dlsym(lib, "cuGetProcAddress");
    real.proc_v2 = (proc_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    real.lib = lib;
}

/* The real driver's handle, loaded on first use; NULL when it could not be loaded. */
static void *real_driver(void) {
    pthread_once(&real_once, load_real);
    return real.lib;
}

/* Loads the real driver when the interposer is loaded, so that indirect-function resolvers (which
 * run inside dlsym) only ever look symbols up. */
__attribute__((constructor)) static void load_at_startup(void) {
    (void)real_driver();
}

/* The real driver's export `name`, or NULL. */
static any_fn real_symbol(const char *name) {
    void *lib = real_driver();
    return lib == NULL ? NULL : (any_fn)dlsym(lib, name);
}

/* ---- forwarded functions -------------------------------------------------------------------- */

EXPORT CUresult cuInit(unsigned int Flags) {
    if (real_driver() == NULL || real.init == NULL) return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
    return real.init(Flags);
}

EXPORT CUresult cuDriverGetVersion(int *driverVersion) {
    if (real_driver() == NULL) return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
    return real.version(driverVersion);
}

/* ---- the three differences ------------------------------------------------------------------ */

static CUresult tcc_cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    if (real_driver() == NULL || real.attribute == NULL) return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
    CUresult rc = real.attribute(pi, attrib, dev);
    if (rc == CUDA_SUCCESS && pi != NULL) {
        if (attrib == CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) *pi = 0;
        if (attrib == CU_DEVICE_ATTRIBUTE_TCC_DRIVER) *pi = 1;
    }
    return rc;
}

EXPORT CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    return tcc_cuDeviceGetAttribute(pi, attrib, dev);
}

static CUresult tcc_cuDeviceGetDefaultMemPool(UNUSED CUmemoryPool *pool_out, UNUSED CUdevice dev) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuDeviceGetMemPool(UNUSED CUmemoryPool *pool, UNUSED CUdevice dev) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuDeviceSetMemPool(UNUSED CUdevice dev, UNUSED CUmemoryPool pool) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemAllocAsync(UNUSED CUdeviceptr *dptr, UNUSED size_t bytesize, UNUSED CUstream hStream) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemFreeAsync(UNUSED CUdeviceptr dptr, UNUSED CUstream hStream) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemAllocFromPoolAsync(UNUSED CUdeviceptr *dptr, UNUSED size_t bytesize,
                                            UNUSED CUmemoryPool pool, UNUSED CUstream hStream) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolTrimTo(UNUSED CUmemoryPool pool, UNUSED size_t minBytesToKeep) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolSetAttribute(UNUSED CUmemoryPool pool, UNUSED CUmemPool_attribute attr,
                                          UNUSED void *value) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolGetAttribute(UNUSED CUmemoryPool pool, UNUSED CUmemPool_attribute attr,
                                          UNUSED void *value) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolSetAccess(UNUSED CUmemoryPool pool, UNUSED const CUmemAccessDesc *map,
                                       UNUSED size_t count) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolGetAccess(UNUSED CUmemAccess_flags *flags, UNUSED CUmemoryPool memPool,
                                       UNUSED CUmemLocation *location) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolCreate(UNUSED CUmemoryPool *pool, UNUSED const CUmemPoolProps *poolProps) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolDestroy(UNUSED CUmemoryPool pool) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolExportToShareableHandle(UNUSED void *handle_out, UNUSED CUmemoryPool pool,
                                                     UNUSED CUmemAllocationHandleType handleType,
                                                     UNUSED unsigned long long flags) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolImportFromShareableHandle(UNUSED CUmemoryPool *pool_out, UNUSED void *handle,
                                                       UNUSED CUmemAllocationHandleType handleType,
                                                       UNUSED unsigned long long flags) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolExportPointer(UNUSED CUmemPoolPtrExportData *shareData_out, UNUSED CUdeviceptr ptr) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemPoolImportPointer(UNUSED CUdeviceptr *ptr_out, UNUSED CUmemoryPool pool,
                                           UNUSED CUmemPoolPtrExportData *shareData) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemGetDefaultMemPool(UNUSED CUmemoryPool *pool_out, UNUSED CUmemLocation *location,
                                           UNUSED CUmemAllocationType type) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemGetMemPool(UNUSED CUmemoryPool *pool, UNUSED CUmemLocation *location,
                                    UNUSED CUmemAllocationType type) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemSetMemPool(UNUSED CUmemLocation *location, UNUSED CUmemAllocationType type,
                                    UNUSED CUmemoryPool pool) {
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* Every intercepted base name (what cuGetProcAddress takes), and the exported names that carry it:
 * X(exported name, implementation). The per-thread-stream variants (_ptsz) fail the same way. */
#define INTERCEPTED(X)                                                                                 \
    X(cuDeviceGetDefaultMemPool, tcc_cuDeviceGetDefaultMemPool)                                        \
    X(cuDeviceGetMemPool, tcc_cuDeviceGetMemPool)                                                      \
    X(cuDeviceSetMemPool, tcc_cuDeviceSetMemPool)                                                      \
    X(cuMemAllocAsync, tcc_cuMemAllocAsync)                                                            \
    X(cuMemFreeAsync, tcc_cuMemFreeAsync)                                                              \
    X(cuMemAllocFromPoolAsync, tcc_cuMemAllocFromPoolAsync)                                            \
    X(cuMemPoolTrimTo, tcc_cuMemPoolTrimTo)                                                            \
    X(cuMemPoolSetAttribute, tcc_cuMemPoolSetAttribute)                                                \
    X(cuMemPoolGetAttribute, tcc_cuMemPoolGetAttribute)                                                \
    X(cuMemPoolSetAccess, tcc_cuMemPoolSetAccess)                                                      \
    X(cuMemPoolGetAccess, tcc_cuMemPoolGetAccess)                                                      \
    X(cuMemPoolCreate, tcc_cuMemPoolCreate)                                                            \
    X(cuMemPoolDestroy, tcc_cuMemPoolDestroy)                                                          \
    X(cuMemPoolExportToShareableHandle, tcc_cuMemPoolExportToShareableHandle)                          \
    X(cuMemPoolImportFromShareableHandle, tcc_cuMemPoolImportFromShareableHandle)                      \
    X(cuMemPoolExportPointer, tcc_cuMemPoolExportPointer)                                              \
    X(cuMemPoolImportPointer, tcc_cuMemPoolImportPointer)                                              \
    X(cuMemGetDefaultMemPool, tcc_cuMemGetDefaultMemPool)                                              \
    X(cuMemGetMemPool, tcc_cuMemGetMemPool)                                                            \
    X(cuMemSetMemPool, tcc_cuMemSetMemPool)
#define INTERCEPTED_PTSZ(X)                                                                            \
    X(cuMemAllocAsync_ptsz, tcc_cuMemAllocAsync)                                                       \
    X(cuMemFreeAsync_ptsz, tcc_cuMemFreeAsync)                                                         \
    X(cuMemAllocFromPoolAsync_ptsz, tcc_cuMemAllocFromPoolAsync)

/* ---- cuGetProcAddress ----------------------------------------------------------------------- */

static CUresult tcc_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
static CUresult tcc_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus);

/* What the interposer serves in place of `found`, the real driver's answer for `symbol`. */
static void *substitute(const char *symbol, void *found) {
    if (symbol == NULL || found == NULL) return found;
#define SUBSTITUTE(name, impl)                                                                         \
    if (strcmp(symbol, #name) == 0) return (void *)&impl;
    INTERCEPTED(SUBSTITUTE)
#undef SUBSTITUTE
    if (strcmp(symbol, "cuDeviceGetAttribute") == 0) return (void *)&tcc_cuDeviceGetAttribute;
    if (strcmp(symbol, "cuGetProcAddress") == 0) {
        /* The real driver picks the ABI by cudaVersion: hand back ours of the same one. */
        if (found == (void *)real.proc_v2) return (void *)&tcc_cuGetProcAddress_v2;
        if (found == (void *)real.proc_v1) return (void *)&tcc_cuGetProcAddress;
    }
    return found;
}

static CUresult tcc_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    if (real_driver() == NULL || real.proc_v1 == NULL) return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
    CUresult rc = real.proc_v1(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn != NULL) *pfn = substitute(symbol, *pfn);
    return rc;
}

static CUresult tcc_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus) {
    if (real_driver() == NULL || real.proc_v2 == NULL) return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
    CUresult rc = real.proc_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn != NULL &&
        (symbolStatus == NULL || *symbolStatus == CU_GET_PROC_ADDRESS_SUCCESS)) {
        *pfn = substitute(symbol, *pfn);
    }
    return rc;
}

/* ---- exported names: GNU indirect functions ------------------------------------------------- */

/* `name` resolves to `impl` where the real driver exports `name`, else to NULL. */
#define EXPORT_IMPL(name, impl)                                                                        \
    static any_fn resolve_##name(void) { return real_symbol(#name) == NULL ? NULL : (any_fn)&impl; } \
    EXPORT void name(void) __attribute__((ifunc("resolve_" #name)));

INTERCEPTED(EXPORT_IMPL)
INTERCEPTED_PTSZ(EXPORT_IMPL)
EXPORT_IMPL(cuGetProcAddress, tcc_cuGetProcAddress)
EXPORT_IMPL(cuGetProcAddress_v2, tcc_cuGetProcAddress_v2)

/* `name` resolves to the real driver's `name` (NULL where it has none). */
#define FORWARD(name)                                                                                  \
    static any_fn resolve_##name(void) { return real_symbol(#name); }                                 \
    EXPORT void name(void) __attribute__((ifunc("resolve_" #name)));

/* Every function that cudrv-sys declares (its generated functions.rs for CUDA 13.0), less the ones
 * defined above. */
#define FORWARDED(X) \
    X(cuGetErrorString) X(cuGetErrorName) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName) \
    X(cuDeviceGetUuid_v2) X(cuDeviceGetLuid) X(cuDeviceTotalMem_v2) \
    X(cuDeviceGetTexture1DLinearMaxWidth) X(cuDeviceGetHostAtomicCapabilities) \
    X(cuDeviceGetNvSciSyncAttributes) X(cuDeviceGetExecAffinitySupport) \
    X(cuFlushGPUDirectRDMAWrites) X(cuDeviceGetProperties) X(cuDeviceComputeCapability) \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxSetFlags_v2) \
    X(cuDevicePrimaryCtxGetState) X(cuDevicePrimaryCtxReset_v2) X(cuCtxCreate_v4) \
    X(cuCtxDestroy_v2) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) X(cuCtxSetCurrent) \
    X(cuCtxGetCurrent) X(cuCtxGetDevice) X(cuCtxGetDevice_v2) X(cuCtxGetFlags) X(cuCtxSetFlags) \
    X(cuCtxGetId) X(cuCtxSynchronize) X(cuCtxSynchronize_v2) X(cuCtxSetLimit) X(cuCtxGetLimit) \
    X(cuCtxGetCacheConfig) X(cuCtxSetCacheConfig) X(cuCtxGetApiVersion) \
    X(cuCtxGetStreamPriorityRange) X(cuCtxResetPersistingL2Cache) X(cuCtxGetExecAffinity) \
    X(cuCtxRecordEvent) X(cuCtxWaitEvent) X(cuCtxAttach) X(cuCtxDetach) X(cuCtxGetSharedMemConfig) \
    X(cuCtxSetSharedMemConfig) X(cuModuleLoad) X(cuModuleLoadData) X(cuModuleLoadDataEx) \
    X(cuModuleLoadFatBinary) X(cuModuleUnload) X(cuModuleGetLoadingMode) X(cuModuleGetFunction) \
    X(cuModuleGetFunctionCount) X(cuModuleEnumerateFunctions) X(cuModuleGetGlobal_v2) \
    X(cuLinkCreate_v2) X(cuLinkAddData_v2) X(cuLinkAddFile_v2) X(cuLinkComplete) X(cuLinkDestroy) \
    X(cuModuleGetTexRef) X(cuModuleGetSurfRef) X(cuLibraryLoadData) X(cuLibraryLoadFromFile) \
    X(cuLibraryUnload) X(cuLibraryGetKernel) X(cuLibraryGetKernelCount) \
    X(cuLibraryEnumerateKernels) X(cuLibraryGetModule) X(cuKernelGetFunction) \
    X(cuKernelGetLibrary) X(cuLibraryGetGlobal) X(cuLibraryGetManaged) \
    X(cuLibraryGetUnifiedFunction) X(cuKernelGetAttribute) X(cuKernelSetAttribute) \
    X(cuKernelSetCacheConfig) X(cuKernelGetName) X(cuKernelGetParamInfo) X(cuMemGetInfo_v2) \
    X(cuMemAlloc_v2) X(cuMemAllocPitch_v2) X(cuMemFree_v2) X(cuMemGetAddressRange_v2) \
    X(cuMemAllocHost_v2) X(cuMemFreeHost) X(cuMemHostAlloc) X(cuMemHostGetDevicePointer_v2) \
    X(cuMemHostGetFlags) X(cuMemAllocManaged) X(cuDeviceRegisterAsyncNotification) \
    X(cuDeviceUnregisterAsyncNotification) X(cuDeviceGetByPCIBusId) X(cuDeviceGetPCIBusId) \
    X(cuIpcGetEventHandle) X(cuIpcOpenEventHandle) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle_v2) \
    X(cuIpcCloseMemHandle) X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuMemcpy) \
    X(cuMemcpyPeer) X(cuMemcpyHtoD_v2) X(cuMemcpyDtoH_v2) X(cuMemcpyDtoD_v2) X(cuMemcpyDtoA_v2) \
    X(cuMemcpyAtoD_v2) X(cuMemcpyHtoA_v2) X(cuMemcpyAtoH_v2) X(cuMemcpyAtoA_v2) X(cuMemcpy2D_v2) \
    X(cuMemcpy2DUnaligned_v2) X(cuMemcpy3D_v2) X(cuMemcpy3DPeer) X(cuMemcpyAsync) \
    X(cuMemcpyPeerAsync) X(cuMemcpyHtoDAsync_v2) X(cuMemcpyDtoHAsync_v2) X(cuMemcpyDtoDAsync_v2) \
    X(cuMemcpyHtoAAsync_v2) X(cuMemcpyAtoHAsync_v2) X(cuMemcpy2DAsync_v2) X(cuMemcpy3DAsync_v2) \
    X(cuMemcpy3DPeerAsync) X(cuMemcpyBatchAsync_v2) X(cuMemcpy3DBatchAsync_v2) X(cuMemsetD8_v2) \
    X(cuMemsetD16_v2) X(cuMemsetD32_v2) X(cuMemsetD2D8_v2) X(cuMemsetD2D16_v2) X(cuMemsetD2D32_v2) \
    X(cuMemsetD8Async) X(cuMemsetD16Async) X(cuMemsetD32Async) X(cuMemsetD2D8Async) \
    X(cuMemsetD2D16Async) X(cuMemsetD2D32Async) X(cuArrayCreate_v2) X(cuArrayGetDescriptor_v2) \
    X(cuArrayGetSparseProperties) X(cuMipmappedArrayGetSparseProperties) \
    X(cuArrayGetMemoryRequirements) X(cuMipmappedArrayGetMemoryRequirements) X(cuArrayGetPlane) \
    X(cuArrayDestroy) X(cuArray3DCreate_v2) X(cuArray3DGetDescriptor_v2) X(cuMipmappedArrayCreate) \
    X(cuMipmappedArrayGetLevel) X(cuMipmappedArrayDestroy) X(cuMemGetHandleForAddressRange) \
    X(cuMemBatchDecompressAsync) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) \
    X(cuMemRelease) X(cuMemMap) X(cuMemMapArrayAsync) X(cuMemUnmap) X(cuMemSetAccess) \
    X(cuMemGetAccess) X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) \
    X(cuMemGetAllocationGranularity) X(cuMemGetAllocationPropertiesFromHandle) \
    X(cuMemRetainAllocationHandle) X(cuMulticastCreate) X(cuMulticastAddDevice) \
    X(cuMulticastBindMem) X(cuMulticastBindAddr) X(cuMulticastUnbind) X(cuMulticastGetGranularity) \
    X(cuPointerGetAttribute) X(cuMemPrefetchAsync_v2) X(cuMemAdvise_v2) X(cuMemPrefetchBatchAsync) \
    X(cuMemDiscardBatchAsync) X(cuMemDiscardAndPrefetchBatchAsync) X(cuMemRangeGetAttribute) \
    X(cuMemRangeGetAttributes) X(cuPointerSetAttribute) X(cuPointerGetAttributes) \
    X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuStreamGetPriority) X(cuStreamGetDevice) \
    X(cuStreamGetFlags) X(cuStreamGetId) X(cuStreamGetCtx) X(cuStreamGetCtx_v2) \
    X(cuStreamWaitEvent) X(cuStreamAddCallback) X(cuStreamBeginCapture_v2) \
    X(cuStreamBeginCaptureToGraph) X(cuThreadExchangeStreamCaptureMode) X(cuStreamEndCapture) \
    X(cuStreamIsCapturing) X(cuStreamGetCaptureInfo_v3) X(cuStreamUpdateCaptureDependencies_v2) \
    X(cuStreamAttachMemAsync) X(cuStreamQuery) X(cuStreamSynchronize) X(cuStreamDestroy_v2) \
    X(cuStreamCopyAttributes) X(cuStreamGetAttribute) X(cuStreamSetAttribute) X(cuEventCreate) \
    X(cuEventRecord) X(cuEventRecordWithFlags) X(cuEventQuery) X(cuEventSynchronize) \
    X(cuEventDestroy_v2) X(cuEventElapsedTime_v2) X(cuImportExternalMemory) \
    X(cuExternalMemoryGetMappedBuffer) X(cuExternalMemoryGetMappedMipmappedArray) \
    X(cuDestroyExternalMemory) X(cuImportExternalSemaphore) X(cuSignalExternalSemaphoresAsync) \
    X(cuWaitExternalSemaphoresAsync) X(cuDestroyExternalSemaphore) X(cuStreamWaitValue32_v2) \
    X(cuStreamWaitValue64_v2) X(cuStreamWriteValue32_v2) X(cuStreamWriteValue64_v2) \
    X(cuStreamBatchMemOp_v2) X(cuFuncGetAttribute) X(cuFuncSetAttribute) X(cuFuncSetCacheConfig) \
    X(cuFuncGetModule) X(cuFuncGetName) X(cuFuncGetParamInfo) X(cuFuncIsLoaded) X(cuFuncLoad) \
    X(cuLaunchKernel) X(cuLaunchKernelEx) X(cuLaunchCooperativeKernel) \
    X(cuLaunchCooperativeKernelMultiDevice) X(cuLaunchHostFunc) X(cuFuncSetBlockShape) \
    X(cuFuncSetSharedSize) X(cuParamSetSize) X(cuParamSeti) X(cuParamSetf) X(cuParamSetv) \
    X(cuLaunch) X(cuLaunchGrid) X(cuLaunchGridAsync) X(cuParamSetTexRef) \
    X(cuFuncSetSharedMemConfig) X(cuGraphCreate) X(cuGraphAddKernelNode_v2) \
    X(cuGraphKernelNodeGetParams_v2) X(cuGraphKernelNodeSetParams_v2) X(cuGraphAddMemcpyNode) \
    X(cuGraphMemcpyNodeGetParams) X(cuGraphMemcpyNodeSetParams) X(cuGraphAddMemsetNode) \
    X(cuGraphMemsetNodeGetParams) X(cuGraphMemsetNodeSetParams) X(cuGraphAddHostNode) \
    X(cuGraphHostNodeGetParams) X(cuGraphHostNodeSetParams) X(cuGraphAddChildGraphNode) \
    X(cuGraphChildGraphNodeGetGraph) X(cuGraphAddEmptyNode) X(cuGraphAddEventRecordNode) \
    X(cuGraphEventRecordNodeGetEvent) X(cuGraphEventRecordNodeSetEvent) X(cuGraphAddEventWaitNode) \
    X(cuGraphEventWaitNodeGetEvent) X(cuGraphEventWaitNodeSetEvent) \
    X(cuGraphAddExternalSemaphoresSignalNode) X(cuGraphExternalSemaphoresSignalNodeGetParams) \
    X(cuGraphExternalSemaphoresSignalNodeSetParams) X(cuGraphAddExternalSemaphoresWaitNode) \
    X(cuGraphExternalSemaphoresWaitNodeGetParams) X(cuGraphExternalSemaphoresWaitNodeSetParams) \
    X(cuGraphAddBatchMemOpNode) X(cuGraphBatchMemOpNodeGetParams) \
    X(cuGraphBatchMemOpNodeSetParams) X(cuGraphExecBatchMemOpNodeSetParams) \
    X(cuGraphAddMemAllocNode) X(cuGraphMemAllocNodeGetParams) X(cuGraphAddMemFreeNode) \
    X(cuGraphMemFreeNodeGetParams) X(cuDeviceGraphMemTrim) X(cuDeviceGetGraphMemAttribute) \
    X(cuDeviceSetGraphMemAttribute) X(cuGraphClone) X(cuGraphNodeFindInClone) \
    X(cuGraphNodeGetType) X(cuGraphGetNodes) X(cuGraphGetRootNodes) X(cuGraphGetEdges_v2) \
    X(cuGraphNodeGetDependencies_v2) X(cuGraphNodeGetDependentNodes_v2) \
    X(cuGraphAddDependencies_v2) X(cuGraphRemoveDependencies_v2) X(cuGraphDestroyNode) \
    X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithParams) X(cuGraphExecGetFlags) \
    X(cuGraphExecKernelNodeSetParams_v2) X(cuGraphExecMemcpyNodeSetParams) \
    X(cuGraphExecMemsetNodeSetParams) X(cuGraphExecHostNodeSetParams) \
    X(cuGraphExecChildGraphNodeSetParams) X(cuGraphExecEventRecordNodeSetEvent) \
    X(cuGraphExecEventWaitNodeSetEvent) X(cuGraphExecExternalSemaphoresSignalNodeSetParams) \
    X(cuGraphExecExternalSemaphoresWaitNodeSetParams) X(cuGraphNodeSetEnabled) \
    X(cuGraphNodeGetEnabled) X(cuGraphUpload) X(cuGraphLaunch) X(cuGraphExecDestroy) \
    X(cuGraphDestroy) X(cuGraphExecUpdate_v2) X(cuGraphKernelNodeCopyAttributes) \
    X(cuGraphKernelNodeGetAttribute) X(cuGraphKernelNodeSetAttribute) X(cuGraphDebugDotPrint) \
    X(cuUserObjectCreate) X(cuUserObjectRetain) X(cuUserObjectRelease) X(cuGraphRetainUserObject) \
    X(cuGraphReleaseUserObject) X(cuGraphAddNode_v2) X(cuGraphNodeSetParams) \
    X(cuGraphExecNodeSetParams) X(cuGraphConditionalHandleCreate) \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor) \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags) X(cuOccupancyMaxPotentialBlockSize) \
    X(cuOccupancyMaxPotentialBlockSizeWithFlags) X(cuOccupancyAvailableDynamicSMemPerBlock) \
    X(cuOccupancyMaxPotentialClusterSize) X(cuOccupancyMaxActiveClusters) X(cuTexRefSetArray) \
    X(cuTexRefSetMipmappedArray) X(cuTexRefSetAddress_v2) X(cuTexRefSetAddress2D_v3) \
    X(cuTexRefSetFormat) X(cuTexRefSetAddressMode) X(cuTexRefSetFilterMode) \
    X(cuTexRefSetMipmapFilterMode) X(cuTexRefSetMipmapLevelBias) X(cuTexRefSetMipmapLevelClamp) \
    X(cuTexRefSetMaxAnisotropy) X(cuTexRefSetBorderColor) X(cuTexRefSetFlags) \
    X(cuTexRefGetAddress_v2) X(cuTexRefGetArray) X(cuTexRefGetMipmappedArray) \
    X(cuTexRefGetAddressMode) X(cuTexRefGetFilterMode) X(cuTexRefGetFormat) \
    X(cuTexRefGetMipmapFilterMode) X(cuTexRefGetMipmapLevelBias) X(cuTexRefGetMipmapLevelClamp) \
    X(cuTexRefGetMaxAnisotropy) X(cuTexRefGetBorderColor) X(cuTexRefGetFlags) X(cuTexRefCreate) \
    X(cuTexRefDestroy) X(cuSurfRefSetArray) X(cuSurfRefGetArray) X(cuTexObjectCreate) \
    X(cuTexObjectDestroy) X(cuTexObjectGetResourceDesc) X(cuTexObjectGetTextureDesc) \
    X(cuTexObjectGetResourceViewDesc) X(cuSurfObjectCreate) X(cuSurfObjectDestroy) \
    X(cuSurfObjectGetResourceDesc) X(cuTensorMapEncodeTiled) X(cuTensorMapEncodeIm2col) \
    X(cuTensorMapEncodeIm2colWide) X(cuTensorMapReplaceAddress) X(cuDeviceCanAccessPeer) \
    X(cuCtxEnablePeerAccess) X(cuCtxDisablePeerAccess) X(cuDeviceGetP2PAttribute) \
    X(cuDeviceGetP2PAtomicCapabilities) X(cuGraphicsUnregisterResource) \
    X(cuGraphicsSubResourceGetMappedArray) X(cuGraphicsResourceGetMappedMipmappedArray) \
    X(cuGraphicsResourceGetMappedPointer_v2) X(cuGraphicsResourceSetMapFlags_v2) \
    X(cuGraphicsMapResources) X(cuGraphicsUnmapResources) X(cuCoredumpGetAttribute) \
    X(cuCoredumpGetAttributeGlobal) X(cuCoredumpSetAttribute) X(cuCoredumpSetAttributeGlobal) \
    X(cuGetExportTable) X(cuGreenCtxCreate) X(cuGreenCtxDestroy) X(cuCtxFromGreenCtx) \
    X(cuDeviceGetDevResource) X(cuCtxGetDevResource) X(cuGreenCtxGetDevResource) \
    X(cuDevSmResourceSplitByCount) X(cuDevResourceGenerateDesc) X(cuGreenCtxRecordEvent) \
    X(cuGreenCtxWaitEvent) X(cuStreamGetGreenCtx) X(cuGreenCtxStreamCreate) X(cuGreenCtxGetId) \
    X(cuLogsRegisterCallback) X(cuLogsUnregisterCallback) X(cuLogsCurrent) X(cuLogsDumpToFile) \
    X(cuLogsDumpToMemory) X(cuCheckpointProcessGetRestoreThreadId) X(cuCheckpointProcessGetState) \
    X(cuCheckpointProcessLock) X(cuCheckpointProcessCheckpoint) X(cuCheckpointProcessRestore) \
    X(cuCheckpointProcessUnlock)

FORWARDED(FORWARD)

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
 *   - every memory-pool entry point, and every entry point of graph memory nodes (the
 *     stream-ordered allocator inside graphs: cuGraphAddMemAllocNode and its family, INTERCEPTED
 *     below) returns CUDA_ERROR_NOT_SUPPORTED (801) without calling the real driver. (A graph
 *     memory node added through the generic cuGraphAddNode is not intercepted.)
 *
 * and, with `CUDRV_TCC_NO_VMM=1` (TCC devices are reported to lack virtual memory management too),
 * two more:
 *
 *   - cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) reads 0, and so
 *     does CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED;
 *   - every function of the cuMemCreate family (VMM_INTERCEPTED below: cuMemCreate, cuMemRelease,
 *     cuMemMap, cuMemUnmap, cuMemSetAccess, cuMemGetAccess, cuMemAddressReserve, cuMemAddressFree,
 *     cuMemGetAllocationGranularity, cuMemGetAllocationPropertiesFromHandle,
 *     cuMemExportToShareableHandle, cuMemImportFromShareableHandle, cuMemRetainAllocationHandle)
 *     returns 801 without calling the real driver.
 *
 * `CUDRV_TCC_NO_VMM` takes 0 (the default, as does an empty value) or 1. Any other value is printed
 * to stderr (one line) and makes cuInit return CUDA_ERROR_INVALID_VALUE (1).
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
 *     dlsym of the interposer finds exactly what a dlsym of the real driver finds. The VMM family
 *     (with CUDRV_TCC_NO_VMM=1) resolves the same way; without it, it is forwarded like FORWARDED.
 *
 * If the real driver cannot be loaded, one line on stderr says so: that this is the cudrv TCC
 * interposer (and its path), which library it tried to load, and dlerror()'s text. Every call then
 * returns CUDA_ERROR_SHARED_OBJECT_INIT_FAILED (303), except cuGetErrorName / cuGetErrorString, which
 * the interposer serves itself in that case: cuGetErrorString(303) gives the same explanation, so a
 * caller that describes the 303 of cuDriverGetVersion or cuInit shows why. (When the real driver is
 * loaded, they are forwarded like every other function.)
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
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_SHARED_OBJECT_INIT_FAILED 303
#define CUDA_ERROR_NOT_SUPPORTED 801

typedef int CUdevice;                         /* CUdevice_v1 */
typedef unsigned long long CUdeviceptr;       /* CUdeviceptr_v2 (64-bit targets) */
typedef uint64_t cuuint64_t;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef int CUdevice_attribute;               /* enum CUdevice_attribute_enum */
#define CU_DEVICE_ATTRIBUTE_TCC_DRIVER 35
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED 110
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
typedef unsigned long long CUmemGenericAllocationHandle; /* CUmemGenericAllocationHandle_v1 */
typedef struct CUmemAllocationProp_st CUmemAllocationProp;
typedef int CUmemAllocationGranularity_flags; /* enum CUmemAllocationGranularity_flags_enum */
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
    int no_vmm;       /* CUDRV_TCC_NO_VMM=1 */
    int config_error; /* an invalid CUDRV_TCC_NO_VMM: cuInit fails */
    char load_error[1024]; /* why the real driver could not be loaded (lib == NULL) */
} real;
static pthread_once_t real_once = PTHREAD_ONCE_INIT;

EXPORT CUresult cuDriverGetVersion(int *driverVersion);

static void read_config(void) {
    const char *s = getenv("CUDRV_TCC_NO_VMM");
    if (s == NULL || s[0] == '\0' || strcmp(s, "0") == 0) return;
    if (strcmp(s, "1") == 0) {
        real.no_vmm = 1;
        return;
    }
    fprintf(stderr,
            "cudrv TCC interposer: invalid CUDRV_TCC_NO_VMM=\"%s\": expected 0 (virtual memory management "
            "forwarded, the default) or 1 (reported as unsupported) (cuInit returns CUDA_ERROR_INVALID_VALUE)\n",
            s);
    real.config_error = 1;
}

/* Records (and prints, as one line) why the real driver could not be loaded. */
static void load_failed(const char *path, const char *why) {
    Dl_info self;
    const char *me = dladdr((void *)&load_failed, &self) && self.dli_fname ? self.dli_fname : "libcudrv_tcc.so";
    snprintf(real.load_error, sizeof real.load_error,
             "cudrv TCC interposer (%s): cannot load the real CUDA driver \"%s\" (named by CUDRV_TCC_REAL_DRIVER, "
             "default libcuda.so.1): %s; every driver call returns CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
             me, path, why);
    fprintf(stderr, "%s\n", real.load_error);
}

static void load_real(void) {
    read_config();
    const char *path = getenv("CUDRV_TCC_REAL_DRIVER");
    if (path == NULL || path[0] == '\0') path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        load_failed(path, why != NULL ? why : "dlopen failed (no dlerror text)");
        return;
    }
    void *version = dlsym(lib, "cuDriverGetVersion");
    if (version == NULL || version == (void *)&cuDriverGetVersion) {
        load_failed(path, version == NULL ? "it is not a CUDA driver (it exports no cuDriverGetVersion)"
                                          : "it is the TCC interposer itself");
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
    if (real.config_error) return CUDA_ERROR_INVALID_VALUE; /* the reason is on stderr */
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
        if (real.no_vmm && (attrib == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
                            attrib == CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED))
            *pi = 0;
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

/* Graph memory nodes: the stream-ordered allocator inside graphs, missing with it. */
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_v1_st CUDA_MEM_ALLOC_NODE_PARAMS;
typedef int CUgraphMem_attribute; /* enum CUgraphMem_attribute_enum */
static CUresult tcc_cuGraphAddMemAllocNode(UNUSED CUgraphNode *node, UNUSED CUgraph graph,
                                           UNUSED const CUgraphNode *deps, UNUSED size_t ndeps,
                                           UNUSED CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuGraphMemAllocNodeGetParams(UNUSED CUgraphNode node, UNUSED CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuGraphAddMemFreeNode(UNUSED CUgraphNode *node, UNUSED CUgraph graph,
                                          UNUSED const CUgraphNode *deps, UNUSED size_t ndeps,
                                          UNUSED CUdeviceptr dptr) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuGraphMemFreeNodeGetParams(UNUSED CUgraphNode node, UNUSED CUdeviceptr *dptr) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuDeviceGraphMemTrim(UNUSED CUdevice device) { return CUDA_ERROR_NOT_SUPPORTED; }
static CUresult tcc_cuDeviceGetGraphMemAttribute(UNUSED CUdevice device, UNUSED CUgraphMem_attribute attr,
                                                 UNUSED void *value) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuDeviceSetGraphMemAttribute(UNUSED CUdevice device, UNUSED CUgraphMem_attribute attr,
                                                 UNUSED void *value) {
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* The cuMemCreate family, with CUDRV_TCC_NO_VMM=1. */
static CUresult tcc_cuMemAddressReserve(UNUSED CUdeviceptr *ptr, UNUSED size_t size, UNUSED size_t alignment,
                                        UNUSED CUdeviceptr addr, UNUSED unsigned long long flags) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemAddressFree(UNUSED CUdeviceptr ptr, UNUSED size_t size) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemCreate(UNUSED CUmemGenericAllocationHandle *handle, UNUSED size_t size,
                                UNUSED const CUmemAllocationProp *prop, UNUSED unsigned long long flags) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemRelease(UNUSED CUmemGenericAllocationHandle handle) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemMap(UNUSED CUdeviceptr ptr, UNUSED size_t size, UNUSED size_t offset,
                             UNUSED CUmemGenericAllocationHandle handle, UNUSED unsigned long long flags) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemUnmap(UNUSED CUdeviceptr ptr, UNUSED size_t size) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemSetAccess(UNUSED CUdeviceptr ptr, UNUSED size_t size, UNUSED const CUmemAccessDesc *desc,
                                   UNUSED size_t count) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemGetAccess(UNUSED unsigned long long *flags, UNUSED const CUmemLocation *location,
                                   UNUSED CUdeviceptr ptr) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemExportToShareableHandle(UNUSED void *shareableHandle,
                                                 UNUSED CUmemGenericAllocationHandle handle,
                                                 UNUSED CUmemAllocationHandleType handleType,
                                                 UNUSED unsigned long long flags) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemImportFromShareableHandle(UNUSED CUmemGenericAllocationHandle *handle,
                                                   UNUSED void *osHandle,
                                                   UNUSED CUmemAllocationHandleType shHandleType) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemGetAllocationGranularity(UNUSED size_t *granularity, UNUSED const CUmemAllocationProp *prop,
                                                  UNUSED CUmemAllocationGranularity_flags option) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemGetAllocationPropertiesFromHandle(UNUSED CUmemAllocationProp *prop,
                                                           UNUSED CUmemGenericAllocationHandle handle) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult tcc_cuMemRetainAllocationHandle(UNUSED CUmemGenericAllocationHandle *handle, UNUSED void *addr) {
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* The cuMemCreate family: X(exported name, implementation), intercepted with CUDRV_TCC_NO_VMM=1. None
 * has a per-thread-stream variant. */
#define VMM_INTERCEPTED(X)                                                                             \
    X(cuMemAddressReserve, tcc_cuMemAddressReserve)                                                    \
    X(cuMemAddressFree, tcc_cuMemAddressFree)                                                          \
    X(cuMemCreate, tcc_cuMemCreate)                                                                    \
    X(cuMemRelease, tcc_cuMemRelease)                                                                  \
    X(cuMemMap, tcc_cuMemMap)                                                                          \
    X(cuMemUnmap, tcc_cuMemUnmap)                                                                      \
    X(cuMemSetAccess, tcc_cuMemSetAccess)                                                              \
    X(cuMemGetAccess, tcc_cuMemGetAccess)                                                              \
    X(cuMemExportToShareableHandle, tcc_cuMemExportToShareableHandle)                                  \
    X(cuMemImportFromShareableHandle, tcc_cuMemImportFromShareableHandle)                              \
    X(cuMemGetAllocationGranularity, tcc_cuMemGetAllocationGranularity)                                \
    X(cuMemGetAllocationPropertiesFromHandle, tcc_cuMemGetAllocationPropertiesFromHandle)              \
    X(cuMemRetainAllocationHandle, tcc_cuMemRetainAllocationHandle)

/* ---- cuGetErrorName / cuGetErrorString without a real driver ------------------------------- */

static CUresult tcc_cuGetErrorName(CUresult error, const char **pStr) {
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *pStr = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *pStr = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_SHARED_OBJECT_INIT_FAILED: *pStr = "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED: *pStr = "CUDA_ERROR_NOT_SUPPORTED"; return CUDA_SUCCESS;
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult tcc_cuGetErrorString(CUresult error, const char **pStr) {
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *pStr = "no error"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *pStr = "invalid argument"; return CUDA_SUCCESS;
    case CUDA_ERROR_SHARED_OBJECT_INIT_FAILED:
        *pStr = real.load_error[0] != '\0' ? real.load_error : "shared object initialization failed";
        return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED: *pStr = "operation not supported"; return CUDA_SUCCESS;
    default: *pStr = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
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
    X(cuMemSetMemPool, tcc_cuMemSetMemPool)                                                            \
    X(cuGraphAddMemAllocNode, tcc_cuGraphAddMemAllocNode)                                              \
    X(cuGraphMemAllocNodeGetParams, tcc_cuGraphMemAllocNodeGetParams)                                  \
    X(cuGraphAddMemFreeNode, tcc_cuGraphAddMemFreeNode)                                                \
    X(cuGraphMemFreeNodeGetParams, tcc_cuGraphMemFreeNodeGetParams)                                    \
    X(cuDeviceGraphMemTrim, tcc_cuDeviceGraphMemTrim)                                                  \
    X(cuDeviceGetGraphMemAttribute, tcc_cuDeviceGetGraphMemAttribute)                                  \
    X(cuDeviceSetGraphMemAttribute, tcc_cuDeviceSetGraphMemAttribute)
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
    if (real.no_vmm) {
        VMM_INTERCEPTED(SUBSTITUTE)
    }
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

/* `name` resolves to the real driver's `name` (NULL where it has none), or to `impl` where the real
 * driver has it and CUDRV_TCC_NO_VMM=1. real_symbol loads the driver (and reads the setting) first. */
#define EXPORT_VMM(name, impl)                                                                         \
    static any_fn resolve_##name(void) {                                                               \
        any_fn found = real_symbol(#name);                                                             \
        return found == NULL || !real.no_vmm ? found : (any_fn)&impl;                                  \
    }                                                                                                  \
    EXPORT void name(void) __attribute__((ifunc("resolve_" #name)));

VMM_INTERCEPTED(EXPORT_VMM)

/* `name` resolves to the real driver's `name`, or to `impl` where no real driver could be loaded. */
#define EXPORT_ERROR_TEXT(name, impl)                                                                  \
    static any_fn resolve_##name(void) {                                                               \
        any_fn found = real_symbol(#name);                                                             \
        return real.lib == NULL ? (any_fn)&impl : found;                                               \
    }                                                                                                  \
    EXPORT void name(void) __attribute__((ifunc("resolve_" #name)));

EXPORT_ERROR_TEXT(cuGetErrorName, tcc_cuGetErrorName)
EXPORT_ERROR_TEXT(cuGetErrorString, tcc_cuGetErrorString)

/* `name` resolves to the real driver's `name` (NULL where it has none). */
#define FORWARD(name)                                                                                  \
    static any_fn resolve_##name(void) { return real_symbol(#name); }                                 \
    EXPORT void name(void) __attribute__((ifunc("resolve_" #name)));

/* Every function that cudrv-sys declares (its generated functions.rs for CUDA 13.0), less the ones
 * defined above (the intercepted ones, the VMM family, cuGetErrorName and cuGetErrorString). */
#define FORWARDED(X) \
    X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName) \
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
    X(cuMemBatchDecompressAsync) X(cuMemMapArrayAsync) X(cuMulticastCreate) X(cuMulticastAddDevice) \
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
    X(cuGraphClone) X(cuGraphNodeFindInClone) \
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

/* driver-call-times.c: where a replay's time goes in the driver. A shim between cudrv (or the TCC
 * interposer) and the real driver that times cuMemAlloc, cuMemFree, cuMemGetInfo, cuEventQuery,
 * cuEventRecord and cuStreamSynchronize, and prints their counts and totals at exit (stderr). For
 * measurement on a GPU machine only; not part of cudrv. Build it there against the real driver:
 *
 *   L=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
 *   gcc -O2 -shared -fPIC -o /tmp/times.so scripts/driver-call-times.c -ldl \
 *       -Wl,--no-as-needed -L"$(dirname "$L")" -l:libcuda.so.1
 *   # cudrv's pool without VMM, through the interposer, under a budget:
 *   CUDRV_DRIVER_PATH=.gpu/lib/libcudrv_tcc.so CUDRV_TCC_REAL_DRIVER=/tmp/times.so CUDRV_TCC_NO_VMM=1 \
 *       .gpu/bin/replay --resource pool --memory 1.10x traces/mixed_images.csv
 *   # or natively: CUDRV_DRIVER_PATH=/tmp/times.so .gpu/bin/replay --resource sync ...
 *
 * Linked against libcuda.so.1, so that a lookup on its handle (dlsym, as the interposer makes)
 * finds every other function in the real driver; cuGetProcAddress (how cudrv-sys resolves) hands
 * out the timed functions in place of the real ones. Allocations of 8 GiB and more (a budgeted
 * replay's hog, which takes the rest of the device) are counted apart. See BENCHMARKS.md, run 79. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#include <stddef.h>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
static void *lib;
static void *sym(const char *n) { if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL); return dlsym(lib, n); }
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6; }
enum { ALLOC, FREE, INFO, QUERY, RECORD, SSYNC, N };
static const char *names[N] = {"cuMemAlloc", "cuMemFree", "cuMemGetInfo", "cuEventQuery", "cuEventRecord", "cuStreamSynchronize"};
static double tot[N], mx[N]; static long cnt[N];
static double big_ms; static long big_n; /* allocations of 8 GiB and more (the replay's hog) */
static FILE *log_file; static int log_opened;
static void log_call(const char *op, double t0, double d, CUdeviceptr p, size_t n) {
    if (!log_opened) { const char *path = getenv("DRIVER_CALL_LOG"); log_opened = 1; if (path) log_file = fopen(path, "w"); }
    if (log_file) fprintf(log_file, "%s,%.4f,%.1f,%llx,%zu\n", op, t0, d * 1e3, p, n);
}
static void count(int i, double d) { tot[i] += d; cnt[i]++; if (d > mx[i]) mx[i] = d; }
#define TIME(i, call) do { double t0 = now(); CUresult r = call; count(i, now() - t0); return r; } while (0)
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    static CUresult (*f)(CUdeviceptr *, size_t); if (!f) f = sym("cuMemAlloc_v2");
    if (n >= (1ull << 30) * 8) { double t0 = now(); CUresult r = f(p, n); big_ms += now() - t0; big_n++; return r; }
    double t0 = now(); CUresult r = f(p, n); double d = now() - t0;
    count(ALLOC, d);
    log_call(r == 0 ? "alloc" : "refused", t0, d, r == 0 ? *p : 0, n);
    return r;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    static CUresult (*f)(CUdeviceptr); if (!f) f = sym("cuMemFree_v2");
    double t0 = now(); CUresult r = f(p); double d = now() - t0;
    count(FREE, d);
    log_call("free", t0, d, p, 0);
    return r;
}
CUresult cuMemGetInfo_v2(size_t *a, size_t *b) { static CUresult (*f)(size_t *, size_t *); if (!f) f = sym("cuMemGetInfo_v2"); TIME(INFO, f(a, b)); }
CUresult cuEventQuery(void *e) { static CUresult (*f)(void *); if (!f) f = sym("cuEventQuery"); TIME(QUERY, f(e)); }
CUresult cuEventRecord(void *e, void *s) { static CUresult (*f)(void *, void *); if (!f) f = sym("cuEventRecord"); TIME(RECORD, f(e, s)); }
CUresult cuStreamSynchronize(void *s) { static CUresult (*f)(void *); if (!f) f = sym("cuStreamSynchronize"); TIME(SSYNC, f(s)); }
static void subst(const char *s, void **pfn) {
    if (!strcmp(s, "cuMemAlloc")) *pfn = (void *)&cuMemAlloc_v2;
    else if (!strcmp(s, "cuMemFree")) *pfn = (void *)&cuMemFree_v2;
    else if (!strcmp(s, "cuMemGetInfo")) *pfn = (void *)&cuMemGetInfo_v2;
    else if (!strcmp(s, "cuEventQuery")) *pfn = (void *)&cuEventQuery;
    else if (!strcmp(s, "cuEventRecord")) *pfn = (void *)&cuEventRecord;
    else if (!strcmp(s, "cuStreamSynchronize")) *pfn = (void *)&cuStreamSynchronize;
}
CUresult cuGetProcAddress_v2(const char *s, void **pfn, int v, cuuint64_t fl, int *st) {
    static CUresult (*f)(const char *, void **, int, cuuint64_t, int *); if (!f) f = sym("cuGetProcAddress_v2");
    CUresult r = f(s, pfn, v, fl, st); if (r == 0 && *pfn && (st == NULL || *st == 0)) subst(s, pfn); return r;
}
CUresult cuGetProcAddress(const char *s, void **pfn, int v, cuuint64_t fl) {
    static CUresult (*f)(const char *, void **, int, cuuint64_t); if (!f) f = sym("cuGetProcAddress");
    CUresult r = f(s, pfn, v, fl); if (r == 0 && *pfn) subst(s, pfn); return r;
}
__attribute__((destructor)) static void report(void) {
    for (int i = 0; i < N; i++) if (cnt[i]) fprintf(stderr, "shim: %-20s %8ld calls %10.1f ms (mean %8.1f us, max %8.1f ms)\n", names[i], cnt[i], tot[i], tot[i] * 1e3 / cnt[i], mx[i]);
    if (big_n) fprintf(stderr, "shim: hog allocations %ld, %.1f ms\n", big_n, big_ms);
    if (log_file) fclose(log_file);
}

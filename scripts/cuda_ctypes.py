"""The CUDA driver through ctypes, for the measurement scripts beside this file: `cu` (libcuda),
`ck` (a call's result, or exit naming it), and device 0's primary context made current (`dev`);
`free_memory`, and `alloc_timed` / `free_timed` for the probes that time single calls."""
import ctypes
import time

cu = ctypes.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        raise SystemExit(f"{what} -> {r}")


ck(cu.cuInit(0), "init")
dev = ctypes.c_int()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p()
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "set")


def free_memory():
    """The device's free memory as `cuMemGetInfo` reports it, in bytes."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ck(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    return free.value


def alloc_timed(n):
    """`cuMemAlloc` of `n` bytes: (the pointer, or None where the driver refused), microseconds."""
    p = ctypes.c_uint64()
    t = time.perf_counter()
    r = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    return (p if r == 0 else None), (time.perf_counter() - t) * 1e6


def free_timed(p):
    """`cuMemFree` of `p` (or exit): microseconds."""
    t = time.perf_counter()
    ck(cu.cuMemFree_v2(p), "cuMemFree")
    return (time.perf_counter() - t) * 1e6

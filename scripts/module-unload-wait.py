#!/usr/bin/env python3
"""Does cuModuleUnload wait for a kernel of the module that is still running?

Launches a kernel that spins for about a second on a non-blocking stream, then unloads its
module at once and times the unload; then synchronises the stream. If the unload returns
before the kernel ends, a module dropped right after a launch unloads code that still runs
(cudrv keeps a module alive only for graphs). ctypes on libcuda.so.1 (through cuda_ctypes.py, which
makes device 0's primary context current); run on a machine with a GPU:
python3 scripts/module-unload-wait.py
"""
import ctypes as C
import time

from cuda_ctypes import ck, cu

PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 cycles) {
  .reg .u64 %rd<5>;
  .reg .pred %p;
  ld.param.u64 %rd1, [cycles];
  mov.u64 %rd2, %clock64;
L:
  mov.u64 %rd3, %clock64;
  sub.u64 %rd4, %rd3, %rd2;
  setp.lt.u64 %p, %rd4, %rd1;
  @%p bra L;
  ret;
}
"""

stream = C.c_void_p()
ck(cu.cuStreamCreate(C.byref(stream), 1), "cuStreamCreate")


def load_spin():
    """A freshly loaded module of PTX, and its `spin` kernel."""
    mod, fn = C.c_void_p(), C.c_void_p()
    ck(cu.cuModuleLoadData(C.byref(mod), C.c_char_p(PTX)), "cuModuleLoadData")
    ck(cu.cuModuleGetFunction(C.byref(fn), mod, b"spin"), "cuModuleGetFunction")
    return mod, fn


def launch_spin(fn, cycles):
    """Queues `spin(cycles)` on the stream."""
    arg = C.c_uint64(cycles)
    params = (C.c_void_p * 1)(C.cast(C.byref(arg), C.c_void_p))
    ck(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None), "cuLaunchKernel")


def unload_then_sync(handle, unload=cu.cuModuleUnload, name="cuModuleUnload"):
    """Unloads `handle` (a module, or with `unload` a library) at once, then synchronises the
    stream: what each returned, and took."""
    t1 = time.perf_counter()
    rc_unload = unload(handle)
    t2 = time.perf_counter()
    rc_sync = cu.cuStreamSynchronize(stream)
    t3 = time.perf_counter()
    return (
        f"{name} rc={rc_unload} took {1e3 * (t2 - t1):.1f} ms, "
        f"then cuStreamSynchronize rc={rc_sync} took {1e3 * (t3 - t2):.1f} ms"
    )


for cycles in (2_000_000_000, 4_000_000_000):
    mod, fn = load_spin()
    t0 = time.perf_counter()
    launch_spin(fn, cycles)
    launched = time.perf_counter()
    print(f"cycles={cycles}: launch {1e3 * (launched - t0):.3f} ms, {unload_then_sync(mod)}")

# A launch still queued (behind another module's kernel) when its module is unloaded: the
# unload must wait for both kernels (about 2 s), and the stream must then report no error.
(first, first_fn), (queued, queued_fn) = load_spin(), load_spin()
launch_spin(first_fn, 2_000_000_000)
launch_spin(queued_fn, 2_000_000_000)
print(f"queued behind another module's kernel: {unload_then_sync(queued)}")
ck(cu.cuModuleUnload(first), "cuModuleUnload")

# The same for a library (`cuLibraryLoadData`, CUDA 12.0; cudrv's `Library`): does
# `cuLibraryUnload` wait for a running kernel of one of its functions?
if hasattr(cu, "cuLibraryLoadData"):
    lib, kernel, fn = C.c_void_p(), C.c_void_p(), C.c_void_p()
    ck(cu.cuLibraryLoadData(C.byref(lib), C.c_char_p(PTX), None, None, 0, None, None, 0), "cuLibraryLoadData")
    ck(cu.cuLibraryGetKernel(C.byref(kernel), lib, b"spin"), "cuLibraryGetKernel")
    ck(cu.cuKernelGetFunction(C.byref(fn), kernel), "cuKernelGetFunction")
    launch_spin(fn, 2_000_000_000)
    print(f"library, cycles=2000000000: {unload_then_sync(lib, cu.cuLibraryUnload, 'cuLibraryUnload')}")
else:
    print("library: this driver has no cuLibraryLoadData")

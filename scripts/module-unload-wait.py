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
for cycles in (2_000_000_000, 4_000_000_000):
    mod = C.c_void_p()
    ck(cu.cuModuleLoadData(C.byref(mod), C.c_char_p(PTX)), "cuModuleLoadData")
    fn = C.c_void_p()
    ck(cu.cuModuleGetFunction(C.byref(fn), mod, b"spin"), "cuModuleGetFunction")
    arg = C.c_uint64(cycles)
    params = (C.c_void_p * 1)(C.cast(C.byref(arg), C.c_void_p))
    t0 = time.perf_counter()
    ck(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None), "cuLaunchKernel")
    t1 = time.perf_counter()
    rc_unload = cu.cuModuleUnload(mod)
    t2 = time.perf_counter()
    rc_sync = cu.cuStreamSynchronize(stream)
    t3 = time.perf_counter()
    print(
        f"cycles={cycles}: launch {1e3 * (t1 - t0):.3f} ms, cuModuleUnload rc={rc_unload} took "
        f"{1e3 * (t2 - t1):.1f} ms, then cuStreamSynchronize rc={rc_sync} took {1e3 * (t3 - t2):.1f} ms"
    )

# A launch still queued (behind another module's kernel) when its module is unloaded: the
# unload must wait for both kernels (about 2 s), and the stream must then report no error.
mods = []
for _ in range(2):
    m = C.c_void_p()
    ck(cu.cuModuleLoadData(C.byref(m), C.c_char_p(PTX)), "cuModuleLoadData")
    mods.append(m)
fns = []
for m in mods:
    f = C.c_void_p()
    ck(cu.cuModuleGetFunction(C.byref(f), m, b"spin"), "cuModuleGetFunction")
    fns.append(f)
arg = C.c_uint64(2_000_000_000)
params = (C.c_void_p * 1)(C.cast(C.byref(arg), C.c_void_p))
for f in fns:
    ck(cu.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, params, None), "cuLaunchKernel")
t1 = time.perf_counter()
rc_unload = cu.cuModuleUnload(mods[1])
t2 = time.perf_counter()
rc_sync = cu.cuStreamSynchronize(stream)
t3 = time.perf_counter()
print(
    f"queued behind another module's kernel: cuModuleUnload rc={rc_unload} took {1e3 * (t2 - t1):.1f} ms, "
    f"then cuStreamSynchronize rc={rc_sync} took {1e3 * (t3 - t2):.1f} ms"
)
ck(cu.cuModuleUnload(mods[0]), "cuModuleUnload")

"""The CUDA driver through ctypes, for the measurement scripts beside this file: `cu` (libcuda),
`ck` (a call's result, or exit naming it), and device 0's primary context made current (`dev`)."""
import ctypes

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

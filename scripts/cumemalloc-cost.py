#!/usr/bin/env python3
"""What cuMemAlloc and cuMemFree cost on the device, roomy and near capacity (all but 6.5 GiB taken
by one allocation), through ctypes on libcuda.so.1: `python3 scripts/cumemalloc-cost.py` on a
machine with a GPU. Medians of 10 pairs (5 from 1 GiB). See BENCHMARKS.md."""
import ctypes, time, sys, statistics as st
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0: raise RuntimeError(f"{what} -> {r}")
ck(cu.cuInit(0), "init")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ck(cu.cuCtxSetCurrent(ctx), "set")
free = ctypes.c_size_t(); total = ctypes.c_size_t()
def info():
    ck(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "info"); return free.value
p = ctypes.c_uint64()
def pair(sz, n):
    ta, tf = [], []
    for _ in range(n):
        t0 = time.perf_counter(); ck(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(sz)), f"alloc {sz}"); t1 = time.perf_counter()
        ck(cu.cuMemFree_v2(p), "free"); t2 = time.perf_counter()
        ta.append((t1-t0)*1e6); tf.append((t2-t1)*1e6)
    return st.median(ta), st.median(tf)
def table(label):
    print(f"## {label}: free {info()/2**30:.2f} GiB")
    t0=time.perf_counter()
    for _ in range(100): info()
    print(f"cuMemGetInfo {(time.perf_counter()-t0)/100*1e6:.1f} us")
    for mib in [2, 12, 32, 128, 512, 1024, 4096]:
        if mib << 20 > info() - (64<<20): continue
        a, f = pair(mib << 20, 10 if mib < 1024 else 5)
        print(f"{mib:6d} MiB  alloc {a:9.1f} us  free {f:9.1f} us  per MiB {(a+f)/mib:7.2f} us")
    # many held at once then freed (as a pool's chunks)
    for mib, k in [(12, 50), (200, 20)]:
        ptrs = []
        t0 = time.perf_counter()
        for _ in range(k):
            q = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(q), ctypes.c_size_t(mib << 20)), "a"); ptrs.append(q)
        t1 = time.perf_counter()
        for q in ptrs: ck(cu.cuMemFree_v2(q), "f")
        t2 = time.perf_counter()
        print(f"{k} x {mib} MiB held: alloc {(t1-t0)/k*1e6:.1f} us each, free {(t2-t1)/k*1e6:.1f} us each")
table("roomy")
# hog: leave about 6.5 GiB
hog = ctypes.c_uint64(); left = 6_500 << 20
ck(cu.cuMemAlloc_v2(ctypes.byref(hog), ctypes.c_size_t(info() - left)), "hog")
table("hogged")
ck(cu.cuMemFree_v2(hog), "hogfree")

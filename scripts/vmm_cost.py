#!/usr/bin/env python3
"""What the virtual memory management calls cost, against cuMemAlloc/cuMemFree of the same size:
cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, and mapping
a range as many 2 MiB handles. ctypes only: runs on the device machine as
`python3 scripts/vmm_cost.py`. Figures: BENCHMARKS.md."""
import ctypes, time
from cuda_ctypes import cu, ck, dev
class Loc(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Flags(ctypes.Structure): _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]
class Prop(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc), ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", Flags)]
class Access(ctypes.Structure): _fields_ = [("location", Loc), ("flags", ctypes.c_int)]
prop = Prop(); prop.type = 1; prop.location = Loc(1, dev.value)
acc = Access(Loc(1, dev.value), 3)
gran = ctypes.c_size_t(); ck(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "gran")
print(f"granularity {gran.value >> 10} KiB")
def t(f):
    t0 = time.perf_counter(); f(); return time.perf_counter() - t0
def one(size, n=20):
    tot = dict.fromkeys(["alloc", "free", "reserve", "create", "map", "access", "unmap", "release", "addrfree"], 0.0)
    for _ in range(n):
        p = ctypes.c_uint64()
        tot["alloc"] += t(lambda: ck(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)), "alloc"))
        tot["free"] += t(lambda: ck(cu.cuMemFree_v2(p), "free"))
        va = ctypes.c_uint64(); h = ctypes.c_uint64()
        tot["reserve"] += t(lambda: ck(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)), "reserve"))
        tot["create"] += t(lambda: ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)), "create"))
        tot["map"] += t(lambda: ck(cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_uint64(0)), "map"))
        tot["access"] += t(lambda: ck(cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)), "access"))
        tot["unmap"] += t(lambda: ck(cu.cuMemUnmap(va, ctypes.c_size_t(size)), "unmap"))
        tot["release"] += t(lambda: ck(cu.cuMemRelease(h), "release"))
        tot["addrfree"] += t(lambda: ck(cu.cuMemAddressFree(va, ctypes.c_size_t(size)), "addrfree"))
    print(f"{size >> 20:>5} MiB: " + ", ".join(f"{k} {v / n * 1e6:.0f}us" for k, v in tot.items()), flush=True)
def remap(size, n=10):
    # a reserved range mapped with 2 MiB handles created once: unmap + map + set access each time
    va = ctypes.c_uint64(); g = gran.value; k = size // g
    ck(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)), "reserve")
    hs = [ctypes.c_uint64() for _ in range(k)]
    for h in hs: ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(g), ctypes.byref(prop), ctypes.c_uint64(0)), "create")
    tm = ta = tu = 0.0
    for _ in range(n):
        tm += t(lambda: [ck(cu.cuMemMap(ctypes.c_uint64(va.value + i * g), ctypes.c_size_t(g), ctypes.c_size_t(0), h, ctypes.c_uint64(0)), "map") for i, h in enumerate(hs)])
        ta += t(lambda: ck(cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)), "access"))
        tu += t(lambda: [ck(cu.cuMemUnmap(ctypes.c_uint64(va.value + i * g), ctypes.c_size_t(g)), "unmap") for i in range(k)])
    for h in hs: ck(cu.cuMemRelease(h), "release")
    ck(cu.cuMemAddressFree(va, ctypes.c_size_t(size)), "addrfree")
    print(f"{size >> 20:>5} MiB as {k} handles of 2 MiB: map {tm / n * 1e6:.0f}us, set access {ta / n * 1e6:.0f}us, unmap {tu / n * 1e6:.0f}us", flush=True)
for s in [2 << 20, 32 << 20, 128 << 20, 1 << 30]: one(s)
for s in [32 << 20, 128 << 20]: remap(s)

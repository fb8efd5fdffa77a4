#!/usr/bin/env python3
"""What cuMemAlloc, cuMemFree and cuMemGetInfo cost on an empty device, beside 300 live chunks,
and with all but 6 GiB of the device taken (as in the budgeted replays). ctypes only: runs on
the device machine as `python3 scripts/driver_alloc_cost.py`. Figures: BENCHMARKS.md."""
import ctypes, time
from cuda_ctypes import cu, ck, dev
free = ctypes.c_size_t(); total = ctypes.c_size_t()
def meminfo():
    ck(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "info"); return free.value
def bench(label, sizes, n=40):
    t0 = time.perf_counter(); [meminfo() for _ in range(1000)]; t_info = (time.perf_counter() - t0) / 1000
    out = []
    for s in sizes:
        p = ctypes.c_uint64(); ta = tf = 0.0
        for _ in range(n):
            t0 = time.perf_counter(); ck(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(s)), f"alloc {s}"); ta += time.perf_counter() - t0
            t0 = time.perf_counter(); ck(cu.cuMemFree_v2(p), "free"); tf += time.perf_counter() - t0
        out.append(f"{s>>20}MiB alloc {ta/n*1e6:.0f}us free {tf/n*1e6:.0f}us")
    print(f"{label}: cuMemGetInfo {t_info*1e6:.1f}us; " + "; ".join(out), flush=True)
sizes = [16<<20, 128<<20, 1<<30]
bench("empty device", sizes)
# many live chunks, as a pool holds (300 x 20 MiB)
live = []
for _ in range(300):
    p = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(20<<20)), "live"); live.append(p)
bench("300 live 20 MiB chunks", sizes)
# fill the rest but 6 GiB, as the budgeted replays do
f = meminfo(); filler = ctypes.c_uint64()
ck(cu.cuMemAlloc_v2(ctypes.byref(filler), ctypes.c_size_t((f - (6<<30)) // (2<<20) * (2<<20))), "filler")
bench("filled, 6 GiB free", sizes)

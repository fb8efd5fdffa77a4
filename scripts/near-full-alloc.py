#!/usr/bin/env python3
"""Why `cuMemAlloc` is slow for a pool trading chunks at the brim of a budget (run 79: about 5 ms a
call, against 5-53 us for per-request allocations under the same budget). With all but 6 GiB of
device 0 taken by one allocation, then 200 MiB blocks allocated until the device is full, times
an allocation right after a free (a trade), after a pause, with room to spare, and at the brim
without a free before it. `python3 scripts/near-full-alloc.py` on a machine with a GPU; medians
of 10. See BENCHMARKS.md."""
import time, statistics as st
from cuda_ctypes import alloc_timed as alloc, free_timed as release, free_memory as info

MIB = 1 << 20

hog, _ = alloc(info() - (6 << 30)); assert hog
blocks = []
while True:
    p, _ = alloc(200 * MIB)
    if p is None: break
    blocks.append(p)
print(f"filled: {len(blocks)} x 200 MiB, {info() / MIB:.1f} MiB left")
def case(label, before, size=200 * MIB, n=10):
    ta, tf = [], []
    for _ in range(n):
        tf.append(before())
        p, t = alloc(size); assert p, label
        ta.append(t); blocks.append(p)
    print(f"{label:58s} alloc {st.median(ta):8.1f} us (max {max(ta):8.1f})  free {st.median(tf):7.1f} us")
def free_one(pause=0.0):
    def f():
        t = release(blocks.pop(0))
        if pause: time.sleep(pause)
        return t
    return f
case("at the brim: free one block, allocate one at once", free_one())
case("at the brim: free one, allocate 190 MiB at once", free_one(), 190 * MIB)
for pause in (0.002, 0.01, 0.05):
    case(f"at the brim: free one, wait {pause * 1e3:.0f} ms, allocate", free_one(pause))
# room to spare: three blocks more free than the allocation needs
for _ in range(3): release(blocks.pop(0))
time.sleep(0.1)
print(f"room: {info() / MIB:.1f} MiB free")
case("600 MiB to spare: free one, allocate one at once", free_one())
# at the brim without a free just before: allocate into the spare room until full
ta = []
for _ in range(3):
    p, t = alloc(200 * MIB); assert p; ta.append(t); blocks.append(p)
print(f"{'filling the last 600 MiB, no free just before':58s} alloc {', '.join(f'{t:.1f}' for t in ta)} us")
for p in blocks: release(p)
release(hog)

#!/usr/bin/env python3
"""What makes `cuMemAlloc` wait at the brim of the device (run 80: 7.8 ms right after a free of the
pages it needs, 0.1 ms with room to spare), and what avoids it: how short a pause after the free
suffices, whether a synchronisation or a `cuMemGetInfo` in between does the same, and how much of
the allocation may come from the pages just freed. With all but 8 GiB of device 0 taken by one
allocation, the rest is filled with 200 MiB blocks and then 2 MiB blocks, so that under 2 MiB is
left. Each case starts from that brim, frees `freed` MiB, leaves `spare` MiB that were free before
(taken back first, after a settling pause) and allocates `size` MiB. Medians of 10 (of 5 for the
last cases: how the pause needed grows with the bytes freed).
`cd scripts && python3 brim-pause.py` on a machine with a GPU. See BENCHMARKS.md, run 81."""
import time, statistics as st
from cuda_ctypes import cu, ck, alloc_timed as alloc, free_timed as release, free_memory as info

MIB = 1 << 20


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


hog, _ = alloc(info() - (8 << 30))
assert hog
big, small = [], []
for size, into in ((200 * MIB, big), (2 * MIB, small)):
    while (p := alloc(size)[0]) is not None:
        into.append(p)
print(f"filled: {len(big)} x 200 MiB and {len(small)} x 2 MiB, {info() / MIB:.1f} MiB left")


def case(label, freed=200, spare=0, size=200, between=None, n=10):
    """From the brim: make `spare` MiB free and let it settle, then free `freed` MiB of 200 MiB
    blocks, run `between`, and allocate `size` MiB; afterwards refill to the brim."""
    times = []
    for _ in range(n):
        if spare:
            for _ in range(spare // 200):
                release(big.pop(0))
            spin(0.05)
        for _ in range(freed // 200):
            release(big.pop(0))
        if between:
            between()
        p, t = alloc(size * MIB)
        assert p, label
        times.append(t)
        spin(0.05)
        # Back to the brim in 200 MiB and 2 MiB blocks (an allocation of another size goes back).
        left = freed + spare - size
        if size == 200:
            big.append(p)
        else:
            release(p)
            left += size
            spin(0.05)
        for _ in range(left // 200):
            q, _ = alloc(200 * MIB)
            assert q, label
            big.append(q)
        for _ in range(left % 200 // 2):
            q, _ = alloc(2 * MIB)
            if q is not None:
                small.append(q)
        spin(0.05)
    print(f"{label:62s} alloc median {st.median(times):8.1f} us  min {min(times):8.1f}  max {max(times):8.1f}")


case("brim: free 200, allocate 200 at once")
for ms in (0.05, 0.1, 0.25, 0.5, 1, 2):
    case(f"brim: free 200, spin {ms} ms, allocate 200", between=lambda ms=ms: spin(ms / 1e3))
case("brim: free 200, cuCtxSynchronize, allocate 200", between=lambda: ck(cu.cuCtxSynchronize(), "sync"))
case("brim: free 200, cuMemGetInfo, allocate 200", between=info)
case("brim: free 200, allocate 2 at once", size=2)
case("brim: free 200, allocate 100 at once", size=100)
case("spare 200: free 200, allocate 200 at once", spare=200)
case("spare 200: free 200, allocate 400 at once", spare=200, size=400)
case("spare 200: free 400, allocate 200 at once", spare=200, freed=400)
case("spare 400: free 200, allocate 200 at once", spare=400)
case("spare 200: no free, allocate 200", spare=200, freed=0)
# How the pause needed grows with what was freed: several 200 MiB blocks freed, then one
# allocation of their sum.
for freed in (600, 1000):
    for ms in (0.5, 1, 1.5, 2, 3):
        case(f"brim: free {freed}, spin {ms} ms, allocate {freed}", freed=freed, size=freed,
             between=lambda ms=ms: spin(ms / 1e3), n=5)
print(f"end: {info() / MIB:.1f} MiB left")
for p in big + small:
    release(p)
release(hog)

#!/usr/bin/env python3
"""A host-side model of an *expandable segment*: what the stream-ordered pool could do where the
device has virtual memory management. Requests are placed by best fit, with coalescing, in one
contiguous address range per group (small: up to 1 MiB; the rest), which grows at its top by
mapping 2 MiB pages and shrinks when its top block is freed. No chunk boundaries: any freed
neighbours merge, so a request of a new size is served from merged free space.

Per trace it prints the peak live bytes (requests rounded to 512 B), the peak of mapped bytes
over peak live, and the map calls of a cold replay and of the warm replay right after (growth in
steps of max(what is missing, an eighth of what is mapped), exact near 1.2x peak live). With
`--budget X`, growth is exact and mapping more than X times the trace's peak live bytes is out
of memory.

Streams are ignored: the pool orders reuse across streams with events, as it does now.

    python3 scripts/segment_model.py [--budget 1.10] traces/*.csv

Figures and what they mean for the pool: BENCHMARKS.md ("An expandable segment, modelled")."""
import bisect
import sys

GRANULE = 512
PAGE = 2 << 20
SMALL = 1 << 20
HEADROOM = 0.20


def round_up(n, to):
    return max(to, (n + to - 1) // to * to)


class Segment:
    """Best fit with coalescing over [0, top); free space above `top` is not a block."""

    def __init__(self):
        self.free = []  # sorted (size, addr)
        self.size_at = {}  # addr -> size of a free block
        self.start_at_end = {}  # end -> addr of a free block
        self.top = 0

    def _add(self, a, s):
        bisect.insort(self.free, (s, a))
        self.size_at[a] = s
        self.start_at_end[a + s] = a

    def _remove(self, a, s):
        i = bisect.bisect_left(self.free, (s, a))
        del self.free[i]
        del self.size_at[a]
        del self.start_at_end[a + s]

    def alloc(self, s):
        i = bisect.bisect_left(self.free, (s, -1))
        if i < len(self.free):
            fs, a = self.free[i]
            self._remove(a, fs)
            if fs > s:
                self._add(a + s, fs - s)
            return a
        a = self.top
        if a in self.start_at_end:  # a free block ends at the top: grow from its start
            b = self.start_at_end[a]
            self._remove(b, self.size_at[b])
            a = b
        self.top = a + s
        return a

    def release(self, a, s):
        if a + s in self.size_at:
            n = self.size_at[a + s]
            self._remove(a + s, n)
            s += n
        if a in self.start_at_end:
            b = self.start_at_end[a]
            bs = self.size_at[b]
            self._remove(b, bs)
            a, s = b, s + bs
        if a + s == self.top:
            self.top = a
        else:
            self._add(a, s)


def read(path):
    events = []
    for line in open(path):
        if line.startswith("#") or line.startswith("op"):
            continue
        op, ident, size, _stream = line.strip().split(",")
        events.append((op, ident, int(size)))
    return events


def peak_live(events):
    live, cur, peak = {}, 0, 0
    for op, ident, size in events:
        if op == "a":
            live[ident] = round_up(size, GRANULE)
            cur += live[ident]
            peak = max(peak, cur)
        else:
            cur -= live.pop(ident)
    return peak


def replay(path, budget=None):
    events = read(path)
    limit = budget * peak_live(events) if budget else None
    segs = {"small": Segment(), "large": Segment()}
    mapped = dict.fromkeys(segs, 0)
    peak = peak_mapped = 0
    calls = []
    for _ in range(2):  # cold, then warm on the same state
        maps = 0
        live = {}
        cur = 0
        for op, ident, size in events:
            if op == "a":
                s = round_up(size, GRANULE)
                g = "small" if s <= SMALL else "large"
                a = segs[g].alloc(s)
                live[ident] = (g, a, s)
                cur += s
                peak = max(peak, cur)
                if segs[g].top > mapped[g]:
                    missing = segs[g].top - mapped[g]
                    step = round_up(max(missing, mapped[g] // 8), PAGE)
                    if step > missing and (limit or sum(mapped.values()) + step > peak * (1 + HEADROOM)):
                        step = round_up(missing, PAGE)
                    if limit and sum(mapped.values()) + step > limit:
                        print(f"segment: {path.rsplit('/', 1)[-1]} budget={budget}x OOM")
                        return
                    mapped[g] += step
                    maps += 1
            else:
                g, a, s = live.pop(ident)
                segs[g].release(a, s)
                cur -= s
                if sum(mapped.values()) > peak * (1 + HEADROOM):
                    for h, seg in segs.items():  # unmap what lies above each top
                        mapped[h] = min(mapped[h], round_up(seg.top, PAGE))
            peak_mapped = max(peak_mapped, sum(mapped.values()))
        calls.append(maps)
    name = path.rsplit("/", 1)[-1] + (f" budget={budget}x" if budget else "")
    print(
        f"segment: {name} peak_live={peak} mapped/live={peak_mapped / peak:.3f} "
        f"cold_maps={calls[0]} warm_maps={calls[1]}"
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    budget = None
    if args[:1] == ["--budget"]:
        budget, args = float(args[1]), args[2:]
    if not args:
        raise SystemExit("usage: segment_model.py [--budget X] TRACE.csv...")
    for p in args:
        replay(p, budget)

#!/usr/bin/env python3
"""Record GPU allocation traces from PyTorch workloads, for cudrv's allocator benchmarks.

The traces are replayed by `benches/memory.rs` (and anything else that reads `traces/*.csv`). This
script records three workloads whose allocation patterns differ from the two training traces
already in `traces/` (gpt2_train.csv, resnet50_train.csv): irregular, growing sizes from
inference with a KV cache, a serving loop whose batch changes every step and which uses two
streams, and training on images of varying size.

Usage
-----
    python3 traces/record.py all --out traces/        # the three workloads, one process each
    python3 traces/record.py decode_kvcache --out /tmp/t
    python3 traces/record.py serving_batching --out /tmp/t
    python3 traces/record.py mixed_images --out /tmp/t
    python3 traces/record.py all --quick --out /tmp/t # tiny versions, a smoke test (seconds)
    python3 traces/record.py selftest                 # tests the conversion and CSV code; no GPU,
                                                      # no torch needed

Needs a CUDA GPU, PyTorch 2.x and nothing else: no internet (random-initialised models written in
plain torch, no torchvision, no downloads). Each workload finishes in well under a minute on an
H200, and its live memory stays far under 40 GB (at most 6 GB allocated; but PyTorch's default
allocator reserves 54 GB for serving_batching, see "Measured" at the end). Written for an H200 with PyTorch 2.11 / CUDA 13, and meant to work
with any PyTorch from 2.1 on (2.0 through the legacy recording call, see below).

Common options (`--help` lists all):
    --out DIR          where the CSVs go (default: the directory holding this script, traces/);
                       files are DIR/<workload>.csv, overwritten if present
    --seed N           seed of every random choice (default 0); the same seed, PyTorch version and
                       GPU give the same trace
    --device N         CUDA device index (default 0)
    --max-entries N    size of PyTorch's trace ring buffer (default 4,000,000 events)
    --no-warmup        record without the warm-up pass (see "Warm-up" below)
    --in-process       with `all`: run the workloads in this process instead of one child process
                       each (a child each is the default: fresh allocator, fresh peak figures)
    --quick            tiny sizes, for a smoke test only
    --requests N       decode_kvcache: requests (default 3); serving_batching: requests (default 32)
    --steps N          mixed_images: training steps (default 16)
    --layers N         transformer layers of decode_kvcache and serving_batching (default 12)

What it prints, for each workload: the output file and its size, the number of events (allocs,
frees), the number of streams, the trace's peak live bytes, PyTorch's max_memory_reserved and
max_memory_allocated over the recorded run and their ratio, the bytes that were already live when
recording began (weights, optimizer state, library workspaces: not in the trace), how many
allocations the trace leaves live, and the time taken. `all` ends with a summary table (the same
figures, read back from the CSV comment lines). A nonzero exit status means a workload failed;
nothing is written for a workload whose trace is incomplete.

Output format (the same as the existing traces)
-----------------------------------------------
    # torch max_memory_reserved=<B> max_memory_allocated=<B> trace_peak_live=<B> events=<N> streams=<S>
    op,id,size,stream
    a,<id>,<size>,<stream index>
    f,<id>,<size>,<stream index>

Sizes are the bytes PyTorch was asked for (not its rounded block sizes); a free carries the size
of its allocation. Ids are dense, from 0, in order of allocation. Stream indices are 0, 1, ... in
order of first appearance in the trace (in serving_batching the side stream is index 0, since its
first event is a prompt copy, and the main stream index 1). Allocations still live at the end stay unfreed: the replayer
frees them. `max_memory_reserved` / `max_memory_allocated` are PyTorch's caching allocator's peaks
over the recorded part only (reset_peak_memory_stats and empty_cache are called just before);
they include the memory that was live before recording (weights etc.), which the trace does not.

How the trace is recorded
-------------------------
PyTorch's allocator history: `torch.cuda.memory._record_memory_history(enabled="all",
context=None, stacks="python", max_entries=N)` (no stack traces are gathered, which keeps the
overhead low), then `torch.cuda.memory._snapshot()["device_traces"][device]`. Its entries are
converted:
  * `alloc` (addr, size, stream)      -> `a,<fresh id>,<size>,<stream index>`
  * `free_requested` (addr, ...)      -> `f,<id of the live allocation at addr>,<its size>,<stream>`
    This is the stream-ordered free point: the moment the program dropped the tensor. PyTorch's
    own `free_completed` (when the block is reusable after record_stream events) is ignored, as are
    `segment_alloc` / `segment_free` / `segment_map` / `segment_unmap` / `snapshot` entries.
    An address is reused after its free, so ids are given per allocation, not per address.
  * `oom` entries are counted and reported (there should be none).
Checks that stop the recording of a workload (nothing written, exit status 1):
  * the ring buffer overflowed: the trace holds max_entries events or more, or a free names an
    address that is not live in the trace and was not live before recording began (the oldest
    events were overwritten). Raise --max-entries.
  * an allocation at an address the trace still holds live (an event was lost).
Frees of blocks that were live before recording began (found from the snapshot's segments taken
just before recording) are dropped: their allocation is not in the trace. The warm-up is written so
that there are none or almost none; the count is printed.
API fallbacks: if `_record_memory_history` does not take the keyword arguments above (PyTorch
2.0), the legacy form `_record_memory_history(True, record_context=False,
trace_alloc_max_entries=N, trace_alloc_record_context=False)` is used. If
`F.scaled_dot_product_attention` is missing, attention is computed with plain matmul + softmax.
Recording is switched off (which also clears PyTorch's buffer) after each workload.

Warm-up (decided: yes, by default)
----------------------------------
Each workload runs a short pass of the same code before recording (one short generation; a short
serving loop; one training step), then drops everything it made, synchronizes, empties the cache
and resets the peak statistics. This keeps one-time allocations out of the trace: cuBLAS/cuBLASLt
workspaces (allocated through PyTorch's allocator on a stream's first matmul and kept for the
process's life), cuDNN's first-use state, and the optimizer's momentum buffers (created at the
first step). A long-running server or training job has all of these already, and they would
otherwise show up as a few large allocations at the start that are never freed. Model weights are
also allocated before recording. None of them are in the trace; their bytes are printed as
"live before recording" and are inside PyTorch's max_memory_allocated. `--no-warmup` records the
first pass instead.

Determinism
-----------
Request lengths, arrival times and image sizes come from `random.Random(seed)`; weights and data
from `torch.manual_seed(seed)`. Token values do not influence any size, so the trace depends only
on the seed, the PyTorch version (which kernels allocate what) and the GPU. Python's garbage
collector is off while recording, so that no collection moves a free. cuDNN autotuning
(`cudnn.benchmark`) is off: with it on, every new image size would try several algorithms, each
with its own workspace allocation, chosen by timing (not reproducible).

The workloads
-------------
1. decode_kvcache: autoregressive decoding, one request at a time, with a naive growing KV cache.
   A decoder-only transformer (12 layers, d_model 1024, 16 heads, MLP 4096, vocab 32000, learned
   positions; about 215M parameters, random, bf16), in torch.inference_mode. 3 requests in
   sequence, each with a random prompt length in 32..2048 and a random number of new tokens in
   16..512. Prefill runs the whole prompt (causal attention) and computes logits for every
   position, as naive code does, then samples (temperature + top-k 50); each decode step feeds one
   token and grows every layer's K and V by `torch.cat([cache, new], dim=2)`, so each step, in
   each layer, frees the old K and V and allocates copies 2 KiB larger (heads * head_dim * 2
   bytes): irregular, ever-growing sizes. The generated ids grow by torch.cat as well. About 260 allocations per generated token.

2. serving_batching: a continuous-batching serving loop with per-request KV caches and a second
   stream. The same transformer; 32 requests with prompt lengths in 32..1024 and output lengths in
   16..256, arriving over time (8 at the start, then gaps of 0..3 steps). At most 16 requests
   run at once and at most 4 (and 4096 prompt tokens) are admitted per step. Every step: finished
   requests leave (their caches are freed), new ones join with a batched prefill (right-padded to
   the longest prompt among them, causal attention; each request's cache is cut out as its own
   contiguous (layers, 2, heads, len, head_dim) tensor; logits only at each last prompt token),
   and all running requests take one decode step: their caches are padded to the longest and
   stacked (F.pad + torch.stack), each layer appends the new K/V by torch.cat and attends with a
   padding mask, and each request's cache then grows by torch.cat. So batch composition, padded
   length and cache sizes change every step. Inputs are copied from pinned host memory to the GPU
   on a side stream (`with torch.cuda.stream(side)`): each step's decode inputs (token ids,
   positions), and the next step's prompts are prefetched while the current step computes; the
   main stream waits for the side stream (`wait_stream`) and marks each copied tensor with
   `record_stream(main)` before using it. The copied tensors are allocated (and freed) on the side
   stream, so the trace has two streams. Sampled tokens come back to the host every step (the
   only synchronization), as a server needs them there.

3. mixed_images: CNN training on images of varying size. A ResNet-50 (bottleneck blocks
   [3, 4, 6, 3], written in plain torch), SGD with momentum 0.9 and weight decay (PyTorch's
   default foreach implementation), bf16 autocast, cross-entropy on random labels over 1000
   classes. 16 steps; each draws a resolution from 128..512 in steps of 32 and a batch size so
   that batch * resolution^2 stays under 128 * 224^2 pixels (batch in [max/2, max], at most 256),
   so every activation size changes from step to step. Each step: zero_grad(set_to_none=True),
   new input and labels on the GPU, forward under autocast (its bf16 weight copies are freed at
   the end of the autocast region), backward, optimizer step, loss.item().

Measured (seed 0, defaults, PyTorch 2.11.0+cu130 on an H200; two runs gave byte-identical files):

| trace | events | streams | trace peak live | torch max reserved / max allocated | CSV | recorded run |
|---|---|---|---|---|---|---|
| decode_kvcache | 378,582 | 1 | 249,766,152 | 822,083,584 / 725,923,840 = 1.132 | 5.6 MB | 24 s |
| serving_batching | 279,970 | 2 | 2,374,533,376 | 54,345,596,928 / 2,852,164,608 = 19.05 | 4.3 MB | 21 s |
| mixed_images | 29,781 | 1 | 5,711,140,992 | 9,412,018,176 / 6,002,573,824 = 1.568 | 0.5 MB | 3 s |

The events scale with --requests / --steps (decode_kvcache with 4 requests: 646,796 events, 9.7 MB).
serving_batching's 54 GB reserved is PyTorch's default caching allocator, not the workload: every
step needs blocks slightly larger than the ones it just freed (the padded, stacked caches grow by
one token), each in a new cudaMalloc'd segment, and segments never merge. With
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the same run reserves 3,011,510,272 bytes (1.057 of
max allocated) and the events in the CSV are identical; only the comment line's figures differ.
Without the warm-up, the cuBLAS workspace (32 MiB) shows up as an allocation never freed (--quick
decode_kvcache: trace peak live 43.5 MB instead of 10.0 MB).
"""

import argparse
import collections
import gc
import os
import random
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("decode_kvcache", "serving_batching", "mixed_images")
HEADER = "op,id,size,stream"
DEFAULT_MAX_ENTRIES = 4_000_000


# --------------------------------------------------------------------------------------------------
# Trace conversion and CSV writing: pure Python, no torch (tested by `selftest`).
# --------------------------------------------------------------------------------------------------


class TraceError(RuntimeError):
    """The recorded trace is unusable (an event was lost)."""


class TraceOverflow(TraceError):
    """PyTorch's trace ring buffer overflowed: the oldest events are missing."""


class Converted:
    """A converted trace: events as (op, id, size, stream index) tuples, plus figures."""

    def __init__(self):
        self.events = []  # ("a" | "f", id, size, stream index)
        self.streams = []  # raw stream handles, by index
        self.peak_live = 0
        self.end_live_bytes = 0
        self.end_live_count = 0
        self.allocs = 0
        self.frees = 0
        self.skipped_preexisting = 0  # frees of blocks live before recording began (dropped)
        self.size_mismatches = 0  # free_requested whose size differs from its alloc's
        self.stream_mismatches = 0  # free_requested on another stream than its alloc
        self.ooms = 0
        self.raw_entries = 0


def convert_trace(entries, preexisting=None, max_entries=None):
    """Converts PyTorch's device trace (a list of dicts) into our events.

    entries: `torch.cuda.memory._snapshot()["device_traces"][device]`, oldest first; each a dict
        with "action", "addr" ("device_free" for oom), "size", "stream".
    preexisting: {addr: size} of blocks live when recording began; a free of one of them (before
        the address is allocated again in the trace) is dropped instead of being an error.
    max_entries: the ring buffer's size; a trace that long may have wrapped, so it is an error.
    Raises TraceOverflow / TraceError on an incomplete trace.
    """
    out = Converted()
    out.raw_entries = len(entries)
    if max_entries is not None and len(entries) >= max_entries:
        raise TraceOverflow(
            "the trace holds %d entries, the ring buffer's size (max_entries=%d): the oldest "
            "events may have been overwritten; rerun with a larger --max-entries"
            % (len(entries), max_entries)
        )
    pre = dict(preexisting or {})
    stream_index = {}
    live = {}  # addr -> (id, size, stream index)
    cur = 0
    next_id = 0

    def sidx(handle):
        handle = int(handle or 0)
        if handle not in stream_index:
            stream_index[handle] = len(out.streams)
            out.streams.append(handle)
        return stream_index[handle]

    for n, e in enumerate(entries):
        action = e.get("action")
        if action == "alloc":
            addr, size = int(e["addr"]), int(e["size"])
            if addr in live:
                raise TraceError(
                    "entry %d: alloc at 0x%x, which the trace still holds live (id %d): a free "
                    "was lost" % (n, addr, live[addr][0])
                )
            pre.pop(addr, None)  # cannot be pre-existing any more: it was free in between
            s = sidx(e.get("stream"))
            live[addr] = (next_id, size, s)
            out.events.append(("a", next_id, size, s))
            next_id += 1
            out.allocs += 1
            cur += size
            if cur > out.peak_live:
                out.peak_live = cur
        elif action == "free_requested":
            addr = int(e["addr"])
            if addr in live:
                aid, size, s_alloc = live.pop(addr)
                s = sidx(e.get("stream"))
                if s != s_alloc:
                    out.stream_mismatches += 1
                if int(e.get("size", size)) != size:
                    out.size_mismatches += 1
                out.events.append(("f", aid, size, s))
                out.frees += 1
                cur -= size
            elif addr in pre:
                del pre[addr]
                out.skipped_preexisting += 1
            else:
                raise TraceOverflow(
                    "entry %d: free of 0x%x, which was never allocated in the trace nor live "
                    "before recording: the first events are missing (ring buffer overflow?); "
                    "rerun with a larger --max-entries" % (n, addr)
                )
        elif action == "oom":
            out.ooms += 1
        # free_completed, segment_*, snapshot, anything newer: not ours.
    out.end_live_bytes = cur
    out.end_live_count = len(live)
    return out


def live_blocks(snapshot):
    """{addr: requested size} of the blocks allocated (live) in a `_snapshot()` dict."""
    res = {}
    for seg in snapshot.get("segments", []) or []:
        addr = int(seg.get("address", 0))
        for b in seg.get("blocks", []) or []:
            baddr = int(b.get("address", addr))
            size = int(b.get("size", 0))
            if b.get("state") == "active_allocated":
                res[baddr] = int(b.get("requested_size", size) or size)
            addr = baddr + size
    return res


def comment_line(max_reserved, max_allocated, conv):
    return "# torch max_memory_reserved=%d max_memory_allocated=%d trace_peak_live=%d events=%d streams=%d" % (
        max_reserved,
        max_allocated,
        conv.peak_live,
        len(conv.events),
        len(conv.streams),
    )


def write_csv(path, conv, max_reserved, max_allocated):
    """Writes the trace atomically (a temporary file renamed into place)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".record-", suffix=".csv", dir=d)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a plain file's mode instead
        with os.fdopen(fd, "w", newline="\n") as f:
            f.write(comment_line(max_reserved, max_allocated, conv) + "\n")
            f.write(HEADER + "\n")
            f.writelines("%s,%d,%d,%d\n" % ev for ev in conv.events)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_csv(path):
    """Reads a trace back: (comment fields as {name: int}, events as tuples)."""
    fields, events = {}, []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("#"):
                for tok in line[1:].split():
                    if "=" in tok:
                        k, v = tok.split("=", 1)
                        try:
                            fields[k] = int(v)
                        except ValueError:
                            fields[k] = v
            elif line and not line.startswith("op,"):
                op, i, size, s = line.split(",")
                events.append((op, int(i), int(size), int(s)))
    return fields, events


def fmt_bytes(n):
    return "{:,}".format(int(n))


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="record.py",
        description="Record PyTorch allocation traces for cudrv's allocator benchmarks. "
        "See the module docstring (top of this file) for the workloads and the format.",
    )
    p.add_argument("workload", choices=WORKLOADS + ("all", "selftest"))
    p.add_argument(
        "--out",
        default=os.path.dirname(os.path.abspath(__file__)),
        help="output directory (default: this script's directory); files are OUT/<workload>.csv",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--max-entries", type=int, default=DEFAULT_MAX_ENTRIES, help="trace ring buffer size")
    p.add_argument("--no-warmup", action="store_true", help="record the first pass (no warm-up)")
    p.add_argument("--in-process", action="store_true", help="with `all`: no child processes")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--requests", type=int, default=None, help="decode_kvcache (3) / serving_batching (32)")
    p.add_argument("--steps", type=int, default=None, help="mixed_images training steps (16)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (12)")
    a = p.parse_args(argv)
    if a.max_entries < 1:
        p.error("--max-entries must be positive")
    for k in ("requests", "steps", "layers"):
        v = getattr(a, k)
        if v is not None and v < 1:
            p.error("--%s must be positive" % k)
    return a


def config(name, a):
    """The parameters of a workload, from the defaults, --quick and the explicit options."""
    if name == "decode_kvcache":
        c = dict(layers=12, d_model=1024, heads=16, d_ff=4096, vocab=32000, max_pos=4096,
                 requests=3, prompt=(32, 2048), new_tokens=(16, 512))
        if a.quick:
            c.update(layers=2, requests=2, prompt=(16, 128), new_tokens=(4, 16))
        if a.requests:
            c["requests"] = a.requests
    elif name == "serving_batching":
        c = dict(layers=12, d_model=1024, heads=16, d_ff=4096, vocab=32000, max_pos=4096,
                 requests=32, prompt=(32, 1024), new_tokens=(16, 256), max_batch=16,
                 max_prefill=4, prefill_tokens=4096, initial=8, gaps=(0, 0, 1, 1, 2, 3))
        if a.quick:
            c.update(layers=2, requests=6, prompt=(8, 64), new_tokens=(2, 12), max_batch=4,
                     max_prefill=2, initial=2)
        if a.requests:
            c["requests"] = a.requests
    elif name == "mixed_images":
        c = dict(steps=16, res=(128, 512, 32), pixels=128 * 224 * 224, max_batch=256,
                 classes=1000, layers=(3, 4, 6, 3))
        if a.quick:
            c.update(steps=3, res=(64, 128, 32), pixels=8 * 128 * 128, max_batch=16, layers=(1, 1, 1, 1))
        if a.steps:
            c["steps"] = a.steps
        return c
    else:
        raise ValueError(name)
    if a.layers:
        c["layers"] = a.layers
    return c


# --------------------------------------------------------------------------------------------------
# Models and workloads (need torch; defined when first used).
# --------------------------------------------------------------------------------------------------


def build_workloads(torch):
    nn = torch.nn
    F = torch.nn.functional
    sdpa = getattr(F, "scaled_dot_product_attention", None)

    def attention(q, k, v, mask=None, causal=False):
        if sdpa is not None:
            return sdpa(q, k, v, attn_mask=mask, is_causal=causal)
        # Fallback for a PyTorch without SDPA: plain attention.
        s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        if causal:
            t, u = q.shape[-2], k.shape[-2]
            keep = torch.ones(t, u, dtype=torch.bool, device=q.device).tril(u - t)
            s = s.masked_fill(~keep, float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    class Block(nn.Module):
        def __init__(self, d, h, ff):
            super().__init__()
            self.d, self.h = d, h
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, ff, bias=False)
            self.fc2 = nn.Linear(ff, d, bias=False)

        def heads(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(self.d, dim=2)
            shape = (b, t, self.h, self.d // self.h)
            return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

        def finish(self, x, q, k, v, mask=None, causal=False):
            b, t, _ = x.shape
            y = attention(q, k, v, mask=mask, causal=causal)
            y = y.transpose(1, 2).reshape(b, t, self.d)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

        def forward(self, x, cache=None):
            """One layer with a naive KV cache: K and V grow by torch.cat."""
            q, k, v = self.heads(x)
            if cache is not None:
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
            x = self.finish(x, q, k, v, causal=cache is None and x.shape[1] > 1)
            return x, (k, v)

    class Decoder(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.tok = nn.Embedding(c["vocab"], c["d_model"])
            self.pos = nn.Embedding(c["max_pos"], c["d_model"])
            self.blocks = nn.ModuleList(Block(c["d_model"], c["heads"], c["d_ff"]) for _ in range(c["layers"]))
            self.ln_f = nn.LayerNorm(c["d_model"])
            self.head = nn.Linear(c["d_model"], c["vocab"], bias=False)

        def embed(self, ids, pos):
            return self.tok(ids) + self.pos(pos)

        def logits(self, x):
            return self.head(self.ln_f(x))

    def sample(logits, temperature=0.8, top_k=50):
        """Temperature + top-k sampling; logits (B, V) -> token ids (B, 1)."""
        v, i = torch.topk(logits.float() / temperature, top_k, dim=-1)
        choice = torch.multinomial(torch.softmax(v, dim=-1), 1)
        return i.gather(-1, choice)

    def make_decoder(c, device):
        return Decoder(c).to(device=device, dtype=torch.bfloat16).eval()

    # ---------------------------------------------------------------------------------------------
    class DecodeKVCache:
        """Sequential requests, each prefill + token-by-token decode with a torch.cat KV cache."""

        def __init__(self, c, seed, device):
            self.c, self.device = c, device
            torch.manual_seed(seed)
            self.model = make_decoder(c, device)
            rng = random.Random(seed)
            self.requests = [(rng.randint(*c["prompt"]), rng.randint(*c["new_tokens"])) for _ in range(c["requests"])]
            self.host_gen = torch.Generator().manual_seed(seed)

        def describe(self):
            return "requests (prompt, new tokens): %s" % self.requests

        def generate(self, prompt_len, new_tokens):
            m, dev = self.model, self.device
            # The prompt comes from the host (a tokenizer), as in a real program.
            ids = torch.randint(0, self.c["vocab"], (1, prompt_len), generator=self.host_gen).to(dev)
            x = m.embed(ids, torch.arange(prompt_len, device=dev))
            caches = []
            for blk in m.blocks:
                x, kv = blk(x)
                caches.append(kv)
            logits = m.logits(x)  # every position's logits, as naive code computes them
            nxt = sample(logits[:, -1])
            del logits, x
            out = torch.cat([ids, nxt], dim=1)
            for t in range(new_tokens - 1):
                pos = prompt_len + t
                x = m.embed(nxt, torch.arange(pos, pos + 1, device=dev))
                for i, blk in enumerate(m.blocks):
                    x, caches[i] = blk(x, caches[i])
                nxt = sample(m.logits(x)[:, -1])
                out = torch.cat([out, nxt], dim=1)
            return out.tolist()  # to the host (detokenize): synchronizes

        def warmup(self):
            with torch.inference_mode():
                self.generate(64, 4)

        def run(self):
            with torch.inference_mode():
                for p, n in self.requests:
                    self.generate(p, n)

    # ---------------------------------------------------------------------------------------------
    class Req:
        __slots__ = ("rid", "prompt_len", "target", "arrival", "generated", "length", "last", "cache")

        def __init__(self, rid, prompt_len, target, arrival):
            self.rid, self.prompt_len, self.target, self.arrival = rid, prompt_len, target, arrival
            self.generated = 0  # tokens produced so far
            self.length = 0  # tokens in the KV cache
            self.last = 0  # last produced token (host)
            self.cache = None  # (layers, 2, heads, length, head_dim)

    class ServingBatching:
        """Continuous batching: requests join and leave every step; inputs on a side stream."""

        def __init__(self, c, seed, device):
            self.c, self.device = c, device
            torch.manual_seed(seed)
            self.model = make_decoder(c, device)
            self.seed = seed
            self.side = torch.cuda.Stream(device=device)

        def make_requests(self, seed, n):
            c = self.c
            rng = random.Random(seed)
            reqs, step = [], 0
            for i in range(n):
                if i >= c["initial"]:
                    step += rng.choice(c["gaps"])
                reqs.append(Req(i, rng.randint(*c["prompt"]), rng.randint(*c["new_tokens"]), step))
            return reqs

        def describe(self):
            reqs = self.make_requests(self.seed, self.c["requests"])
            return "requests (prompt, output, arrival step): %s" % [(r.prompt_len, r.target, r.arrival) for r in reqs]

        def h2d(self, host_tensors):
            """Copies pinned host tensors to the GPU on the side stream (allocated there)."""
            with torch.cuda.stream(self.side):
                return [t.pin_memory().to(self.device, non_blocking=True) for t in host_tensors]

        def take(self, tensors):
            """Makes the main stream wait for the side stream's copies before using them."""
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.side)
            for t in tensors:
                t.record_stream(main)
            return tensors

        def admit(self, step, queue, active, gen):
            """Picks the requests that join at `step`; prefetches their prompts on the side stream."""
            c = self.c
            new, tokens = [], 0
            while (queue and queue[0].arrival <= step and active + len(new) < c["max_batch"]
                   and len(new) < c["max_prefill"]
                   and (not new or tokens + queue[0].prompt_len <= c["prefill_tokens"])):
                r = queue.popleft()
                new.append(r)
                tokens += r.prompt_len
            if not new:
                return new, None
            pmax = max(r.prompt_len for r in new)
            ids = torch.randint(0, c["vocab"], (len(new), pmax), generator=gen)  # right-padded
            lens = torch.tensor([r.prompt_len for r in new], dtype=torch.long)
            return new, self.h2d([ids, lens])

        def prefill(self, reqs, ids, lens):
            m, dev = self.model, self.device
            b, p = ids.shape
            x = m.embed(ids, torch.arange(p, device=dev))
            per_layer = []
            for blk in m.blocks:
                q, k, v = blk.heads(x)
                x = blk.finish(x, q, k, v, causal=True)  # right padding: real tokens see no padding
                per_layer.append(torch.stack([k, v]))  # (2, b, heads, p, head_dim)
                del q, k, v
            kv = torch.stack(per_layer)  # (layers, 2, b, heads, p, head_dim)
            del per_layer
            for i, r in enumerate(reqs):
                r.cache = kv[:, :, i, :, : r.prompt_len].contiguous()
                r.length = r.prompt_len
            del kv
            last = x[torch.arange(b, device=dev), lens - 1]  # each request's last prompt token
            return sample(m.logits(last))

        def decode(self, reqs, ids, pos):
            m, dev = self.model, self.device
            tmax = max(r.length for r in reqs)
            # Pad every cache to the longest and stack them: (batch, layers, 2, heads, tmax, head_dim).
            kv = torch.stack([F.pad(r.cache, (0, 0, 0, tmax - r.length)) for r in reqs])
            valid = torch.arange(tmax + 1, device=dev)[None, :] < pos[:, None]
            valid[:, tmax] = True  # the new token itself
            mask = valid[:, None, None, :]
            x = m.embed(ids[:, None], pos[:, None])
            new = []
            for li, blk in enumerate(m.blocks):
                q, k, v = blk.heads(x)
                kk = torch.cat([kv[:, li, 0], k], dim=2)
                vv = torch.cat([kv[:, li, 1], v], dim=2)
                x = blk.finish(x, q, kk, vv, mask=mask)
                new.append(torch.stack([k, v], dim=1))  # (batch, 2, heads, 1, head_dim)
                del q, k, v, kk, vv
            del kv, valid, mask
            tok = sample(m.logits(x)[:, -1])
            new = torch.stack(new, dim=1)  # (batch, layers, 2, heads, 1, head_dim)
            for i, r in enumerate(reqs):
                r.cache = torch.cat([r.cache, new[i]], dim=3)
                r.length += 1
            return tok

        def serve(self, reqs, seed):
            gen = torch.Generator().manual_seed(seed)
            queue = collections.deque(sorted(reqs, key=lambda r: (r.arrival, r.rid)))
            running = []
            step = 0
            new, pre = self.admit(step, queue, 0, gen)
            while new or running or queue:
                if not new and not running:
                    step = max(step + 1, queue[0].arrival)  # idle until the next arrival
                    new, pre = self.admit(step, queue, 0, gen)
                    continue
                dec = None
                if running:
                    ids = torch.tensor([r.last for r in running], dtype=torch.long)
                    pos = torch.tensor([r.length for r in running], dtype=torch.long)
                    dec = self.h2d([ids, pos])
                toks = []
                if new:
                    toks.append(self.prefill(new, *self.take(pre)))
                if running:
                    toks.append(self.decode(running, *self.take(dec)))
                pre = dec = None
                # Who finishes is known on the host before the tokens are: admit the next step's
                # requests now, so that their prompts are copied while this step computes.
                finishing = sum(1 for r in running if r.generated + 1 >= r.target)
                finishing += sum(1 for r in new if r.target <= 1)
                nxt_new, nxt_pre = self.admit(step + 1, queue, len(running) + len(new) - finishing, gen)
                out = torch.cat(toks).view(-1).tolist()  # sampled tokens to the host: synchronizes
                del toks
                for r, t in zip(new + running, out):
                    r.last = t
                    r.generated += 1
                done = [r for r in running + new if r.generated >= r.target]
                running = [r for r in running + new if r.generated < r.target]
                for r in done:
                    r.cache = None  # the request leaves: its cache is freed
                del done
                new, pre = nxt_new, nxt_pre
                step += 1
            return step

        def warmup(self):
            with torch.inference_mode():
                self.serve([Req(0, 48, 3, 0), Req(1, 20, 2, 0), Req(2, 33, 2, 1)], self.seed + 1)
            torch.cuda.synchronize(self.device)

        def run(self):
            with torch.inference_mode():
                self.steps = self.serve(self.make_requests(self.seed, self.c["requests"]), self.seed)

    # ---------------------------------------------------------------------------------------------
    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x if self.down is None else self.down(x)
            out = F.relu(self.bn1(self.conv1(x)), inplace=True)
            out = F.relu(self.bn2(self.conv2(out)), inplace=True)
            out = self.bn3(self.conv3(out))
            out += identity
            return F.relu(out, inplace=True)

    class ResNet(nn.Module):
        def __init__(self, layers, classes):
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], 64
            for i, n in enumerate(layers):
                width = 64 * 2 ** i
                for j in range(n):
                    blocks.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                    cin = width * 4
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    class MixedImages:
        """ResNet-50 training steps on batches of random resolution and batch size."""

        def __init__(self, c, seed, device):
            self.c, self.device = c, device
            torch.backends.cudnn.benchmark = False  # see the docstring: reproducible, no trials
            torch.manual_seed(seed)
            self.model = ResNet(c["layers"], c["classes"]).to(device).train()
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
            rng = random.Random(seed)
            lo, hi, st = c["res"]
            self.shapes = []
            for _ in range(c["steps"]):
                r = rng.randrange(lo, hi + 1, st)
                bmax = max(2, min(c["max_batch"], c["pixels"] // (r * r)))
                self.shapes.append((rng.randint(max(1, bmax // 2), bmax), r))

        def describe(self):
            return "steps (batch, resolution): %s" % self.shapes

        def step(self, b, r):
            self.opt.zero_grad(set_to_none=True)
            x = torch.randn(b, 3, r, r, device=self.device)
            y = torch.randint(0, self.c["classes"], (b,), device=self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            return loss.item()

        def warmup(self):
            lo = self.c["res"][0]
            self.step(4, max(lo, 64))
            self.opt.zero_grad(set_to_none=True)  # grads of the warm-up step: freed before recording

        def run(self):
            for b, r in self.shapes:
                self.step(b, r)

    return {"decode_kvcache": DecodeKVCache, "serving_batching": ServingBatching, "mixed_images": MixedImages}


# --------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------


def history_on(torch, max_entries):
    """Starts PyTorch's allocator history without stack traces; returns which API was used."""
    mem = torch.cuda.memory
    if not hasattr(mem, "_record_memory_history") or not hasattr(mem, "_snapshot"):
        raise RuntimeError("this PyTorch has no torch.cuda.memory._record_memory_history / _snapshot")
    try:
        mem._record_memory_history(enabled="all", context=None, stacks="python", max_entries=max_entries)
        return "new"
    except TypeError:
        # PyTorch 2.0: _record_memory_history(enabled: bool, record_context, trace_alloc_max_entries,
        # trace_alloc_record_context, ...)
        mem._record_memory_history(
            True, record_context=False, trace_alloc_max_entries=max_entries, trace_alloc_record_context=False)
        return "legacy"


def history_off(torch, api):
    mem = torch.cuda.memory
    try:
        if api == "legacy":
            mem._record_memory_history(False)
        else:
            mem._record_memory_history(enabled=None)
    except Exception as e:  # never hide the workload's own error behind this one
        print("warning: could not switch the allocator history off: %s" % e, file=sys.stderr)


def device_trace(snapshot, index):
    traces = snapshot.get("device_traces")
    if traces is None:
        raise RuntimeError("the snapshot has no 'device_traces': allocator history was not recorded")
    if index < len(traces):
        return traces[index]
    if len(traces) == 1:
        return traces[0]
    raise RuntimeError("the snapshot has %d device traces, none for device %d" % (len(traces), index))


def record(name, a):
    """Records one workload in this process; returns 0 or raises."""
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("PyTorch is needed to record (%s); `selftest` runs without it" % e)

    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available to PyTorch")
    dev_index = a.device
    torch.cuda.set_device(dev_index)
    device = torch.device("cuda", dev_index)
    c = config(name, a)
    path = os.path.join(a.out, name + ".csv")
    print("== %s -> %s" % (name, path), flush=True)
    print("   torch %s, CUDA %s, %s, PYTORCH_CUDA_ALLOC_CONF=%r, config %s" % (
        torch.__version__, torch.version.cuda, torch.cuda.get_device_name(dev_index),
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")), c), flush=True)

    t0 = time.time()
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    wl = build_workloads(torch)[name](c, a.seed, device)
    print("   " + wl.describe(), flush=True)
    if not a.no_warmup:
        wl.warmup()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(a.seed)
    pre = live_blocks(torch.cuda.memory._snapshot())
    pre_bytes = sum(pre.values())

    t1 = time.time()
    gc.disable()
    api = history_on(torch, a.max_entries)
    try:
        wl.run()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        history_off(torch, api)
        gc.enable()
    t2 = time.time()
    max_reserved = torch.cuda.max_memory_reserved(device)
    max_allocated = torch.cuda.max_memory_allocated(device)

    entries = device_trace(snap, dev_index)
    del snap
    conv = convert_trace(entries, pre, a.max_entries)
    del entries
    if not conv.events:
        raise TraceError("the trace is empty: nothing was recorded")
    write_csv(path, conv, max_reserved, max_allocated)
    t3 = time.time()

    extra = getattr(wl, "steps", None)
    print("   file            %s (%s bytes)" % (path, fmt_bytes(os.path.getsize(path))))
    print("   events          %s (%s allocs, %s frees; %s raw trace entries; history API: %s)" % (
        fmt_bytes(len(conv.events)), fmt_bytes(conv.allocs), fmt_bytes(conv.frees), fmt_bytes(conv.raw_entries), api))
    print("   streams         %d (raw handles in index order: %s)%s" % (
        len(conv.streams), ", ".join("0x%x" % s for s in conv.streams),
        "" if extra is None else "; %d serving steps" % extra))
    print("   trace peak live %s bytes" % fmt_bytes(conv.peak_live))
    print("   torch max_memory_reserved %s, max_memory_allocated %s (ratio %.3f)" % (
        fmt_bytes(max_reserved), fmt_bytes(max_allocated), max_reserved / max(1, max_allocated)))
    print("   live before recording (weights, optimizer state, workspaces; not in the trace): %s bytes in %d blocks; "
          "%d of their frees dropped" % (fmt_bytes(pre_bytes), len(pre), conv.skipped_preexisting))
    print("   left live at the end of the trace: %d allocations, %s bytes" % (
        conv.end_live_count, fmt_bytes(conv.end_live_bytes)))
    if conv.ooms or conv.size_mismatches or conv.stream_mismatches:
        print("   WARNING: %d oom entries, %d frees whose size differs from their alloc's, %d frees on another "
              "stream than their alloc" % (conv.ooms, conv.size_mismatches, conv.stream_mismatches))
    print("   time: setup+warm-up %.1f s, recorded run %.1f s, conversion %.1f s" % (t1 - t0, t2 - t1, t3 - t2),
          flush=True)
    return 0


def child_argv(name, a):
    """The command line that records `name` alone with the options of `a`."""
    cmd = [sys.executable, os.path.abspath(__file__), name, "--out", a.out, "--seed", str(a.seed),
           "--device", str(a.device), "--max-entries", str(a.max_entries)]
    for flag in ("no_warmup", "quick"):
        if getattr(a, flag):
            cmd.append("--" + flag.replace("_", "-"))
    for opt in ("requests", "steps", "layers"):
        if getattr(a, opt) is not None:
            cmd += ["--" + opt, str(getattr(a, opt))]
    return cmd


def run_all(a):
    status = 0
    if a.in_process:
        for name in WORKLOADS:
            try:
                record(name, a)
            except Exception as e:
                status = 1
                print("error: %s failed: %s: %s" % (name, type(e).__name__, e), file=sys.stderr, flush=True)
    else:
        for name in WORKLOADS:
            rc = subprocess.call(child_argv(name, a))
            if rc != 0:
                status = 1
                print("error: %s failed (exit status %d)" % (name, rc), file=sys.stderr, flush=True)
    print("\n| trace | events | streams | trace peak live | torch max reserved | torch max allocated | reserved/allocated |")
    print("|---|---|---|---|---|---|---|")
    for name in WORKLOADS:
        path = os.path.join(a.out, name + ".csv")
        if not os.path.exists(path):
            print("| %s | (not written) | | | | | |" % name)
            continue
        f, _ = read_csv(path)
        r, al = f.get("max_memory_reserved", 0), f.get("max_memory_allocated", 0)
        print("| %s | %s | %s | %s | %s | %s | %.3f |" % (
            name + ".csv", fmt_bytes(f.get("events", 0)), f.get("streams", "?"), fmt_bytes(f.get("trace_peak_live", 0)),
            fmt_bytes(r), fmt_bytes(al), r / max(1, al)))
    return status


# --------------------------------------------------------------------------------------------------
# Self-test of the pure parts (no GPU, no torch)
# --------------------------------------------------------------------------------------------------


def selftest():
    def ev(action, addr, size=0, stream=0):
        return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}

    S0, S1 = 0x5555AA00, 0  # raw handles; the first seen becomes index 0
    entries = [
        ev("segment_alloc", 0x1000, 2 << 20, S0),
        ev("alloc", 0x1000, 100, S0),  # id 0
        ev("alloc", 0x2000, 300, S1),  # id 1, stream index 1
        ev("free_requested", 0x9000, 512, S1),  # pre-existing block: dropped
        ev("free_requested", 0x1000, 100, S0),
        ev("free_completed", 0x1000, 100, S0),
        ev("alloc", 0x1000, 50, S0),  # address reuse: id 2
        {"action": "oom", "device_free": 123, "size": 1 << 40, "stream": S0},
        ev("snapshot", 0, 0, 0),
        ev("alloc", 0x9000, 700, S1),  # reuse of the pre-existing address: id 3
        ev("free_requested", 0x9000, 700, S1),
        ev("free_requested", 0x2000, 300, S1),
        ev("segment_free", 0x1000, 2 << 20, S0),
    ]
    pre = {0x9000: 512, 0xA000: 64}
    conv = convert_trace(entries, pre, max_entries=100)
    want = [("a", 0, 100, 0), ("a", 1, 300, 1), ("f", 0, 100, 0), ("a", 2, 50, 0), ("a", 3, 700, 1),
            ("f", 3, 700, 1), ("f", 1, 300, 1)]
    assert conv.events == want, conv.events
    assert conv.streams == [S0, S1], conv.streams
    # live: 100 -> 400 -> 300 -> 350 -> 1050 -> 350 -> 50
    assert conv.peak_live == 1050, conv.peak_live
    assert (conv.end_live_count, conv.end_live_bytes) == (1, 50)
    assert conv.skipped_preexisting == 1 and conv.ooms == 1 and conv.allocs == 4 and conv.frees == 3
    assert conv.size_mismatches == 0 and conv.stream_mismatches == 0

    # A free whose size or stream differs is counted, and carries its alloc's size.
    c2 = convert_trace([ev("alloc", 1, 10, 7), ev("free_requested", 1, 11, 8)])
    assert c2.events == [("a", 0, 10, 0), ("f", 0, 10, 1)] and c2.size_mismatches == 1 and c2.stream_mismatches == 1

    # Overflow: a free of an address never seen (first events overwritten).
    try:
        convert_trace([ev("free_requested", 0x42, 8, 0), ev("alloc", 0x43, 8, 0)], {})
        raise AssertionError("no overflow detected")
    except TraceOverflow:
        pass
    # Overflow: the buffer is full.
    try:
        convert_trace([ev("alloc", i, 8, 0) for i in range(10)], {}, max_entries=10)
        raise AssertionError("full buffer not detected")
    except TraceOverflow:
        pass
    convert_trace([ev("alloc", i, 8, 0) for i in range(9)], {}, max_entries=10)
    # A pre-existing address may be freed only once before being allocated in the trace.
    try:
        convert_trace([ev("free_requested", 0x9000, 8, 0), ev("free_requested", 0x9000, 8, 0)], {0x9000: 8})
        raise AssertionError("double free not detected")
    except TraceOverflow:
        pass
    # A lost free: alloc at a live address.
    try:
        convert_trace([ev("alloc", 0x10, 8, 0), ev("alloc", 0x10, 8, 0)])
        raise AssertionError("lost free not detected")
    except TraceError:
        pass

    # live_blocks from segments (with and without block addresses).
    snap = {"segments": [
        {"address": 0x100000, "total_size": 4096, "blocks": [
            {"size": 1024, "requested_size": 1000, "state": "active_allocated"},
            {"size": 1024, "requested_size": 0, "state": "inactive"},
            {"size": 2048, "requested_size": 2000, "state": "active_allocated"}]},
        {"address": 0x200000, "total_size": 512, "blocks": [
            {"address": 0x200000, "size": 512, "requested_size": 512, "state": "active_pending_free"}]},
        {"address": 0x300000, "blocks": [
            {"address": 0x300000, "size": 512, "requested_size": 100, "state": "active_allocated"}]},
    ], "device_traces": [[]]}
    assert live_blocks(snap) == {0x100000: 1000, 0x100800: 2000, 0x300000: 100}, live_blocks(snap)
    assert device_trace({"device_traces": [[1], [2]]}, 1) == [2]
    assert device_trace({"device_traces": [[1]]}, 3) == [1]

    # CSV round trip, in the existing traces' format.
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sub", "t.csv")
        write_csv(path, conv, 9378463744, 8690289664)
        with open(path) as f:
            lines = f.read().split("\n")
        assert lines[0] == ("# torch max_memory_reserved=9378463744 max_memory_allocated=8690289664 "
                            "trace_peak_live=1050 events=7 streams=2"), lines[0]
        assert lines[1] == HEADER and lines[2] == "a,0,100,0" and lines[-2] == "f,1,300,1" and lines[-1] == ""
        fields, events = read_csv(path)
        assert events == want and fields["events"] == 7 and fields["trace_peak_live"] == 1050
        assert sorted(os.listdir(os.path.dirname(path))) == ["t.csv"]  # no temporary left behind
        umask = os.umask(0)
        os.umask(umask)
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask, oct(os.stat(path).st_mode)
        # Recompute peak live as benches/memory.rs does.
        live = peak = 0
        for op, _, size, _ in events:
            live += size if op == "a" else -size
            peak = max(peak, live)
        assert peak == fields["trace_peak_live"]

    # Arguments.
    a = parse_args(["all", "--out", "/tmp/x", "--seed", "3", "--max-entries", "10"])
    assert (a.workload, a.out, a.seed, a.max_entries, a.in_process, a.quick) == ("all", "/tmp/x", 3, 10, False, False)
    a = parse_args(["serving_batching", "--requests", "5", "--layers", "2", "--quick"])
    assert config("serving_batching", a)["requests"] == 5 and config("serving_batching", a)["layers"] == 2
    assert config("decode_kvcache", parse_args(["decode_kvcache"]))["requests"] == 3
    assert config("mixed_images", parse_args(["mixed_images", "--steps", "2"]))["steps"] == 2
    assert parse_args(["decode_kvcache"]).out == os.path.dirname(os.path.abspath(__file__))
    a = parse_args(["all", "--out", "o", "--quick", "--requests", "3", "--no-warmup"])
    cmd = child_argv("mixed_images", a)
    assert cmd[2:] == ["mixed_images", "--out", "o", "--seed", "0", "--device", "0", "--max-entries",
                       str(DEFAULT_MAX_ENTRIES), "--no-warmup", "--quick", "--requests", "3"], cmd
    assert parse_args(cmd[2:]).requests == 3
    for bad in (["nope"], ["all", "--max-entries", "0"], ["all", "--requests", "0"]):
        try:
            with open(os.devnull, "w") as devnull:
                old, sys.stderr = sys.stderr, devnull
                try:
                    parse_args(bad)
                finally:
                    sys.stderr = old
            raise AssertionError("accepted %s" % bad)
        except SystemExit:
            pass
    print("selftest: ok")
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.workload == "selftest":
        return selftest()
    if a.workload == "all":
        return run_all(a)
    try:
        return record(a.workload, a)
    except (TraceError, RuntimeError) as e:
        print("error: %s: %s: %s (nothing written)" % (a.workload, type(e).__name__, e), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())

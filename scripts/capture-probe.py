#!/usr/bin/env python3
"""What the driver answers, during a stream capture, to calls that cudrv refuses or passes through
(review 24): an upload of an executable graph into the capturing stream, another thread's
cuMemAlloc / cuMemFree during a global capture (with that thread's mode global, then relaxed),
a query of an event recorded in the capture, and (review 25) another thread's pinned allocation,
host registration and synchronisation of an unrelated stream during a global capture. Each case
prints the call's result, then the capture's status and cuStreamEndCapture's result. ctypes on libcuda.so.1 (through
cuda_ctypes.py); run on a machine with a GPU: python3 scripts/capture-probe.py
"""
import ctypes as C
import threading

from cuda_ctypes import ck, ctx, cu

GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2
STATUS = {0: "none", 1: "active", 2: "invalidated"}

stream = C.c_void_p()
ck(cu.cuStreamCreate(C.byref(stream), 1), "cuStreamCreate")
buf = C.c_uint64()
ck(cu.cuMemAlloc_v2(C.byref(buf), 1 << 20), "cuMemAlloc")


def status():
    s = C.c_int()
    rc = cu.cuStreamIsCapturing(stream, C.byref(s))
    return STATUS.get(s.value, s.value) if rc == 0 else f"rc={rc}"


def begin(mode):
    ck(cu.cuStreamBeginCapture_v2(stream, mode), "cuStreamBeginCapture")
    ck(cu.cuMemsetD8Async(buf, 1, 1 << 20, stream), "cuMemsetD8Async (captured)")


def end(case, rc):
    st = status()
    graph = C.c_void_p()
    rc_end = cu.cuStreamEndCapture(stream, C.byref(graph))
    if graph.value:
        cu.cuGraphDestroy(graph)
    print(f"{case}: rc={rc} then capture {st}, cuStreamEndCapture rc={rc_end}", flush=True)


def exec_graph():
    begin(THREAD_LOCAL)
    graph, exe = C.c_void_p(), C.c_void_p()
    ck(cu.cuStreamEndCapture(stream, C.byref(graph)), "cuStreamEndCapture")
    ck(cu.cuGraphInstantiateWithFlags(C.byref(exe), graph, C.c_ulonglong(0)), "cuGraphInstantiate")
    return exe


def on_thread(call, relaxed):
    """`call()` on another thread (the context current there), its mode relaxed or left global."""
    out = []

    def body():
        ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        if relaxed:
            mode = C.c_int(RELAXED)
            ck(cu.cuThreadExchangeStreamCaptureMode(C.byref(mode)), "exchange")
        out.append(call())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0]


exe = exec_graph()
for mode, name in ((THREAD_LOCAL, "thread-local"), (GLOBAL, "global")):
    begin(mode)
    end(f"cuGraphUpload into a {name} capture", cu.cuGraphUpload(exe, stream))

for relaxed in (False, True):
    mode = "relaxed" if relaxed else "global"
    p = C.c_uint64()
    begin(GLOBAL)
    end(f"another thread's cuMemAlloc ({mode} mode) during a global capture",
        on_thread(lambda: cu.cuMemAlloc_v2(C.byref(p), 1 << 20), relaxed))
    if p.value:
        begin(GLOBAL)
        rc = on_thread(lambda: cu.cuMemFree_v2(p), relaxed)
        end(f"another thread's cuMemFree ({mode} mode) during a global capture", rc)
        if rc != 0:
            cu.cuMemFree_v2(p)

# Review 25: what else cudrv relaxes (pinned memory, registration), and what it does not (a
# synchronisation of an unrelated non-blocking stream), on another thread in the global mode.
other = C.c_void_p()
ck(cu.cuStreamCreate(C.byref(other), 1), "cuStreamCreate")
host = C.c_void_p()
plain = C.create_string_buffer(1 << 16)
for relaxed in (False, True):
    mode = "relaxed" if relaxed else "global"
    for name, call in (
        ("cuMemHostAlloc", lambda: cu.cuMemHostAlloc(C.byref(host), C.c_size_t(1 << 16), 1)),
        ("cuMemFreeHost", lambda: cu.cuMemFreeHost(host) if host.value else -1),
        ("cuMemHostRegister", lambda: cu.cuMemHostRegister_v2(plain, C.c_size_t(1 << 16), 1)),
        ("cuMemHostUnregister", lambda: cu.cuMemHostUnregister(plain)),
        ("cuStreamSynchronize of another stream", lambda: cu.cuStreamSynchronize(other)),
    ):
        begin(GLOBAL)
        rc = on_thread(call, relaxed)
        if name == "cuMemFreeHost" and rc == 0:
            host.value = None
        end(f"another thread's {name} ({mode} mode) during a global capture", rc)
    if host.value:
        cu.cuMemFreeHost(host)
        host.value = None
    cu.cuMemHostUnregister(plain)

event = C.c_void_p()
ck(cu.cuEventCreate(C.byref(event), 0), "cuEventCreate")
begin(RELAXED)
ck(cu.cuEventRecord(event, stream), "cuEventRecord (captured)")
rc_query = cu.cuEventQuery(event)
rc_sync = cu.cuEventSynchronize(event)
end(f"cuEventQuery of an event recorded in the capture (cuEventSynchronize rc={rc_sync})", rc_query)
print("capture-probe: done", flush=True)

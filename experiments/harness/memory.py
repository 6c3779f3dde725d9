"""Peak memory of one step, measured (never a formula), per rank.

GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
CPU: PyTorch has no CPU peak counter, so the step runs under
``torch.profiler`` with ``profile_memory=True``; the CPU allocator then reports
every allocation and free as a ``[memory]`` event with a signed byte count.
Summing those events in time order gives the live tensor bytes over the step;
its maximum is the peak. The profiler sees the profiled thread's events only:
a free on another thread (gloo's workers drop the last reference to a
collective's buffers) has no event, and is inferred when its address is
allocated again (``_live_peak``); one never reused stays counted (an
overestimate). Profiling is slow, so this runs in a separate,
untimed step and never distorts the timings.

Both report the peak *increase* over what was live when the step began, so
the numbers are comparable across devices: ``peak_bytes`` = activations, saved
tensors, temporaries and communication buffers of the step.

One definition for every method (the records' ``mem_peak_bytes``): the bytes of
the step's own inputs and weights (``Step.start_bytes``: the (B, N/G, ...)
shards of a sequence-parallel method, the replicated (B, N, H) input and the
weight slices of TP V1) PLUS the peak increase during the step. Each method
is thus charged for what it needs to hold, inputs included; "peak above
inputs" alone hid TP's replicated input. The part a method's formula models,
the bytes kept for backward, is measured separately (``saved_for_backward``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class MemoryPeak:
    peak_bytes: int          # max live bytes during the step, above the starting level
    start_bytes: int         # live bytes at the start (GPU: memory_allocated; CPU: given)
    method: str              # how it was measured, for the record
    # GPU: CUDA's own counters over the step, whole (inputs, weights and the cache included; reserved: the
    # caching allocator's segments, what the papers' logs and nvidia-smi see); None on CPU
    allocated_bytes: int | None = None     # torch.cuda.max_memory_allocated
    reserved_bytes: int | None = None      # torch.cuda.max_memory_reserved


def _cpu_peak(fn: Callable[[], object]) -> int:
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # silence kineto's start/stop chatter
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False,
                 with_stack=False) as prof:
        fn()
    # (time, address, signed bytes) of every CPU allocation and free, from the profiler's event tree
    # (which, unlike the flat event list, carries the address).
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
    events.sort(key=lambda x: x[0])
    return _live_peak(events)


def _live_peak(events: list[tuple[int, int, int]]) -> int:
    """Peak of the live bytes over time-ordered (time, address, signed bytes) allocator events.

    The profiler records the events of the threads it profiles only: a tensor whose last reference
    is dropped on another thread (gloo's worker threads hold the buffers of the collectives they
    run, e.g. Ulysses' all-to-alls) is freed without an event. An allocation at an address that
    is still live in the count proves that free: the earlier block is taken off then."""
    live: dict[int, int] = {}       # address -> bytes of blocks allocated during the step, not freed yet
    level = peak = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            level -= live.pop(ptr, 0)
            live[ptr] = nbytes
        else:
            live.pop(ptr, None)
        level += nbytes
        peak = max(peak, level)
    return int(peak)


def measure_peak(fn: Callable[[], object], device: torch.device, *, start_bytes: int = 0) -> MemoryPeak:
    """Run ``fn`` once and return its peak live-memory increase on this rank.

    ``start_bytes`` is what the caller knows is live on CPU (e.g. the inputs);
    on GPU the allocator's own count is used instead.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        allocated = torch.cuda.max_memory_allocated(device)
        return MemoryPeak(int(allocated - start), int(start), "torch.cuda.max_memory_allocated",
                          int(allocated), int(torch.cuda.max_memory_reserved(device)))
    return MemoryPeak(_cpu_peak(fn), int(start_bytes), "torch.profiler CPU allocator events (live-bytes peak)")


def is_oom(exc: BaseException) -> bool:
    """True for out-of-memory errors as the papers' tables report them (CUDA or host)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, (MemoryError, RuntimeError)) and (
        "out of memory" in text.lower() or "CUDA error: out of memory" in text
        or "DefaultCPUAllocator: can't allocate memory" in text)


def saved_for_backward(forward: Callable[[], object], exclude: tuple = ()) -> int:
    """Bytes autograd keeps for the backward of one ``forward()`` (grad enabled): every tensor saved
    through ``save_for_backward`` or by a built-in op, counted once per storage (views of one buffer
    share it). This is what ``Method.memory`` models ("activation bytes kept for backward"), so the
    two are compared directly (tests/test_memory_reconcile.py); it does not depend on the allocator.
    ``exclude``: tensors not counted (the layer's weights, which matmuls save for dX but which are
    parameters, not activations)."""
    seen: dict[int, int] = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return int(sum(seen.values()))

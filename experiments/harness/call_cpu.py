"""The process CPU one call costs a rank, at a few tokens: the host's work beside the kernels.

One measurement, two launchers: ``benchmarks.cpu_per_call`` (gloo over loopback, ``mp.spawn``) and the
emulated cluster's ``calls`` probe (``experiments/cluster/emulator/call_probe.py``: every rank in its
namespace and capped CPU cgroup, as a run). Both write ``call_cpu.json`` rows of one schema
(``row``), which the emulated validation reads as the host's work per op
(``experiments/perfmodel/emulated/host_cost.py``).

A call is a method's fwd+bwd on 8 heads x 32, float32, causal (``cpu_double_ring_emulated_2x4``'s
shapes; with a ``mask`` beside causal where a row names one), one a sample, as the harness times an op;
or ``decode:<row>``: ``decode_layer.decode_step`` of the inference benchmark's layer (8 heads, 2 KV heads of
64, as the CPU decode specs) on a cache of N tokens of context per sequence, steps back to back as that
benchmark times them (``timing.autorange``), the cache rewound after each sample. A step among others costs an
emulated rank more CPU than a lone one after a barrier
(docs/findings.md#the-host-term-on-the-emulated-cluster-2026-12-06).

    meta, mine = measure("decode:tp", 64, node_size=4, calls=60, batch=4)   # on every rank
    every = [None] * world; dist.all_gather_object(every, mine)
    rec = row(meta, every)                                                     # call_cpu.json's row
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from baselines import AttnShape, get
from burst_impl import comm

from .case import Case
from .inference_cases import row_of
from .inference_steps import build_inference_step
from .row_file import merge_rows

HEADS, HEAD_DIM, CALLS = 8, 32, 12
DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM = 8, 2, 64     # experiments/cpu/cpu_decode_*_2x4.yaml
DECODE_PREFIX = "decode:"      # a decode step's rows: decode:<row>, a row of baselines.decode_layer.ROWS
MIN_SAMPLE_S = 1.0     # a decode sample's length, as the CPU decode specs run it (experiments/cpu/cpu_decode_*_2x4)
# each decode row's (method, merge) in the inference benchmark's cases (row_of, inverted)
_ROW_CASES = {row_of(m, g): (m, g) for m, g in (("burst", "all_gather"), ("burst", "heads"), ("tp_v1", None))}


def time_calls(setup, step, calls: int, steps: int = 1) -> dict:
    """This rank's process CPU and wall seconds per step of each of ``calls`` samples of ``steps`` calls of
    ``step()`` back to back, after one warm-up sample (``setup()`` before each sample, outside the timing; a
    barrier before each and after its CPU is read)."""
    cpu, wall = [], []
    # as the harness times a step (experiments/harness/timing.py): the warm-up call agrees on the inputs across
    # the ranks, the timed calls reuse that agreement, so its all-gather is not charged to every call
    with comm.agree_once():
        for i in range(calls + 1):
            setup()
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                step()
            c1 = time.process_time()
            dist.barrier()
            if i:                                   # the first sample warms up
                cpu.append((c1 - c0) / steps)
                wall.append((time.perf_counter() - w0) / steps)
    return {"cpu": cpu, "wall": wall}


def _training(name: str, n: int, node_size: int, layout: str, mask: str | None = None):
    m, world = get(name), dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, n // world, HEADS, HEAD_DIM, requires_grad=True) for _ in range(3))
    do = torch.randn(1, n // world, HEADS, HEAD_DIM)
    extra = {} if mask is None else {"mask": mask}

    def setup():
        q.grad = k.grad = v.grad = None

    def step():
        out = m.call(q, k, v, causal=True, layout=layout, node_size=node_size, **extra)
        (out[0] if isinstance(out, tuple) else out).backward(do)

    meta = dict(method=name, seqlen=n, world_size=world, node_size=node_size, heads=HEADS, head_dim=HEAD_DIM,
                dtype="float32", causal=True, layout=layout, **extra)
    return setup, step, meta


def _decode(name: str, context: int, batch: int, node_size: int):
    """The inference benchmark's own decode step (``inference_steps.build_inference_step``) of ``name``'s row,
    its steps back to back as that benchmark runs them: on the emulated cluster a step among others costs its
    rank more CPU than a lone one after a barrier."""
    method, merge_ = _ROW_CASES[name[len(DECODE_PREFIX):]]
    shape = AttnShape(batch, context, DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, dist.get_world_size(),
                      dtype="float32", causal=True, layout="zigzag")
    case = Case(experiment="call_cpu", method=method, level="inference", mode="decode", shape=shape, warmup=1,
                repeats=1, seed=0, merge=merge_, min_sample_s=MIN_SAMPLE_S)
    step = build_inference_step(case, rank=dist.get_rank(), group=None, device=torch.device("cpu"))
    meta = dict(method=name, mode="decode", seqlen=context, batch=batch, world_size=shape.world_size,
                node_size=node_size, heads=DECODE_HEADS, kv_heads=DECODE_KV_HEADS, head_dim=DECODE_HEAD_DIM,
                dtype="float32", causal=True, layout="zigzag")
    return step.setup, step.one, meta, step.calls


def measure(name: str, n: int, *, node_size: int, calls: int = CALLS, layout: str = "zigzag",
            batch: int = 1, mask: str | None = None) -> tuple[dict, dict]:
    """(the call's description, this rank's ``time_calls`` samples) of ``name`` at N = ``n`` (module
    docstring): a training call on ``layout`` (causal, and ``mask`` where given: ``host_cost``'s call that skips
    most ring steps), one a sample; or decode steps of ``batch`` sequences, as many a sample as the inference
    benchmark runs (``timing.autorange``), the cache rewound after each sample."""
    if name.startswith(DECODE_PREFIX):
        setup, step, meta, steps = _decode(name, n, batch, node_size)
    else:
        (setup, step, meta), steps = _training(name, n, node_size, layout, mask), 1
    return {**meta, "steps_per_sample": steps}, time_calls(setup, step, calls, steps)


def row(meta: dict, per_rank: list[dict]) -> dict:
    """``call_cpu.json``'s row: ``meta`` with each rank's median CPU per call, their median and the slowest
    rank's median wall per call, and every rank's samples (``per_rank``: every rank's ``time_calls``, in rank
    order)."""
    cpu = [statistics.median(r["cpu"]) for r in per_rank]
    wall = [max(w) for w in zip(*(r["wall"] for r in per_rank))]
    return dict(meta, calls=len(per_rank[0]["cpu"]), cpu_s_per_rank=cpu, cpu_s_median=statistics.median(cpu),
                wall_s_median=statistics.median(wall), cpu_count=os.cpu_count(),
                cpu_samples_s_per_rank=[list(r["cpu"]) for r in per_rank], wall_samples_s=wall)


def _call_key(r: dict) -> tuple:
    """A row's call: method, N, world and node size, batch, layout and mask."""
    return (r["method"], r["seqlen"], r["world_size"], r["node_size"], r.get("batch"), r.get("layout", "zigzag"),
            r.get("mask"))


def merge(path, rows: list[dict], **fields) -> None:
    """Add ``rows`` to ``path``'s (``call_cpu.json``), replacing rows of the same call (``_call_key``), so that
    probes at several world sizes fill one file (``row_file.merge_rows``); ``fields`` (a probe's provenance) go on
    each new row."""
    merge_rows(path, [{**r, **fields} for r in rows], _call_key, benchmark="experiments.harness.call_cpu")

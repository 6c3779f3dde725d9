"""The host's work per op on the emulated cluster: what a call costs a rank's CPU beside kernels and transfers.

A CPU rank runs Python, the dispatcher and a method's own bookkeeping in series with its kernels, on
the same capped share of a core. A GPU's host runs ahead of its stream, so the hardware cost model
has no such term (``costs.EmulatedCosts.host_s`` adds it). It is measured apart from the runs, on the
emulated cluster itself (``burst-bench cluster calls <profile> --out <experiment>/call_cpu.json``, every rank
in its namespace and CPU cgroup) or over loopback (``python -m benchmarks.cpu_per_call --out``; no veth, no
shaped queue, no throttled neighbours: less CPU a call): each rank's process CPU (all threads, gloo's too)
per call, per method, at a few tokens per rank, where the kernels cost almost nothing
(``experiments/harness/call_cpu.py``). Then per method, at that shape:

    host per op = max(0, CPU per call / the rank's CPU cap - the model's compute per rank) / ops per rank

The model's compute there is its kernels (the kernel table) and its transfers' excess (the overlap
probe's line, whose intercept already holds gloo's per-message CPU); subtracting what the model
charges itself keeps that from being counted twice. ``EmulatedCosts.op_seconds`` then charges the host
per op on every op of a rank's compute stream, at every N. Medians over ranks; the cap is the run's
(``cluster.cpu_quota``): CPU seconds at that many CPUs take 1 / cap wall seconds.

    call = load_call_cpu(results_root)          # None without the file
    host = host_per_op(call, "burst_double_ring", world_size=8, node_size=4, dtype="float32",
                       hardware=hw, costs=costs, cpus=0.25)

A plan's tiles cost the host too: each is selected before its kernel and merged after it, work the kernel
table does not time. ``per_call_host`` measures it apart from the op's, from two calls of ``CALL_METHOD`` that
differ only in their kernel calls: at the same small N and ops, the balanced layout runs several tiles a ring
step where zigzag runs one (``cpu_per_call --layouts zigzag,balanced``). The model counts each call's kernel
calls (its compute with one second added per call, less its compute without):

    host per kernel call = [(CPU balanced - CPU zigzag) / cap - (model balanced - model zigzag)]
                           / (kernel calls balanced - kernel calls zigzag)

``host_per_op`` then takes the model's compute with that term in it, so the op's share is what is left.

Much of a call's host work runs once per ring step, whatever its tiles: posting the step's hops, waiting on them,
planning it (docs/findings.md, "Where the masked cases' missing CPU goes"). A mask that skips a step's pair drops its
ops from the schedule but not that work. Where ``call`` also has the method's call with ``STEP_MASK`` (every ring
step but a rank's own skipped) at the same N and layout, the two calls split the host into per step and per op
(``split_host``; the model counts each call's ring steps as it counts kernel calls):

    causal:  CPU / cap - model = steps x host per step + ops causal x host per op
    masked:  CPU / cap - model = steps x host per step + ops masked x host per op

``EmulatedCosts.step_host_s`` then charges every ring step its host per step (``schedules.common.Ctx.step_host``),
a skipped one too. Without that call (every probe before 2026-12-07), or for a method with no ring steps (Ulysses,
the all-gather baseline), the host is all per op, as before.

A decode step is measured the same way as its own call (``decode:<row>``: ``decode_layer.decode_step`` at a
few tokens of context, at the run's batch, steps back to back as the benchmark runs them), since its ops
are not a training call's: ``decode_small_case`` finds that row and ``per_op_from`` divides by the decode
schedule's ops (``validate_decode`` builds it).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass

from baselines import AttnShape
from burst_impl.layout import is_balanced_name

from ...harness.call_cpu import DECODE_PREFIX     # call_cpu.json rows of a decode step
from ..model import predict_case
from ..schedules.common import EXCESS_SUFFIX, STEP_HOST_SUFFIX
from .excess import probe_path

CALL_CPU_FILE = "call_cpu.json"
CALL_METHOD, CALL_LAYOUTS = "burst", ("zigzag", "balanced")   # per_call_host's two measured calls
STEP_MASK = "window:0:0"      # split_host's second call: causal and this mask, so only a rank's own step is live


@dataclass(frozen=True)
class SmallCase:
    """The measured call's case (``measured.needed`` asks the model for its kernel keys)."""

    method: str
    shape: AttnShape
    cpu_s: float                  # the call's measured process CPU per rank (median over ranks)
    mode: str = "fwd_bwd"
    level: str = "op"


def load_call_cpu(results_root, experiment: str | None = None) -> dict | None:
    """``{"rows": [...], "path": ...}`` of ``call_cpu.json`` (``excess.probe_path``: the experiment's own
    where it has one, else the results root's), or None."""
    path = probe_path(results_root, CALL_CPU_FILE, experiment)
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    return {"rows": list(rec["rows"]), "path": str(path)}


def _layout_is(row: dict, layout: str | None) -> bool:
    """``layout`` None: the op's own call, any layout but a balanced one (measured for ``per_call_host``)."""
    have = row.get("layout", "zigzag")
    return have == layout if layout is not None else not is_balanced_name(have)


def _smallest(call: dict | None, method: str, *, world_size: int, node_size: int, dtype: str,
              batch: int | None = None, layout: str | None = None, mask: str | None = None) -> dict | None:
    """The smallest-N row of ``call`` for ``method`` at this world and node size, dtype, layout (``_layout_is``)
    and mask (None: a row with none) (and ``batch``)."""
    rows = [r for r in (call or {}).get("rows", []) if r["method"] == method and int(r["world_size"]) == world_size
            and int(r["node_size"]) == node_size and r["dtype"] == dtype and _layout_is(r, layout)
            and r.get("mask") == mask and (batch is None or int(r.get("batch", 1)) == batch)]
    return min(rows, key=lambda r: int(r["seqlen"])) if rows else None


def small_case(call: dict | None, method: str, *, world_size: int, node_size: int, dtype: str,
               layout: str | None = None, mask: str | None = None) -> SmallCase | None:
    """The smallest measured call of ``method`` at this world and node size, dtype, layout and mask, or None."""
    r = _smallest(call, method, world_size=world_size, node_size=node_size, dtype=dtype, layout=layout, mask=mask)
    if r is None:
        return None
    shape = AttnShape(1, int(r["seqlen"]), int(r["heads"]), int(r["heads"]), int(r["head_dim"]), world_size,
                      dtype=dtype, causal=bool(r["causal"]), layout=r["layout"], **({"mask": mask} if mask else {}))
    return SmallCase(method, shape, float(r["cpu_s_median"]))


def decode_small_case(call: dict | None, row: str, *, world_size: int, node_size: int, dtype: str,
                      batch: int) -> SmallCase | None:
    """The smallest measured decode step of ``row`` at this world and node size, dtype and batch, or None."""
    r = _smallest(call, DECODE_PREFIX + row, world_size=world_size, node_size=node_size, dtype=dtype, batch=batch)
    if r is None:
        return None
    shape = AttnShape(batch, int(r["seqlen"]), int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"]), world_size,
                      dtype=dtype, causal=True, layout=r["layout"])
    return SmallCase(DECODE_PREFIX + row, shape, float(r["cpu_s_median"]), mode="decode", level="inference")


def compute_per_rank(schedule) -> tuple[float, int]:
    """(median over ranks of compute-stream seconds, median over ranks of the method's ops on it: neither a
    transfer's excess nor a ring step's host task is an op)."""
    busy: dict[int, float] = {}
    ops: dict[int, int] = {}
    for t in schedule.tasks:
        if t.kind == "compute":
            busy[t.rank] = busy.get(t.rank, 0.0) + t.duration
            ops[t.rank] = ops.get(t.rank, 0) + (not t.name.endswith((EXCESS_SUFFIX, STEP_HOST_SUFFIX)))
    return statistics.median(busy.values()), int(statistics.median(ops.values()))


def _schedule(case: SmallCase, hardware, costs, **terms):
    """The model's schedule of ``case``, with ``costs``' host terms replaced by ``terms`` (``call_host_s``,
    ``step_host_s``)."""
    cost = lambda hw, dt: dataclasses.replace(costs(hw, dt), **terms)   # noqa: E731
    return predict_case(case.method, case.shape, mode=case.mode, level=case.level, hardware=hardware, costs=cost,
                        keep_schedule=True).schedule


def _compute(case: SmallCase, hardware, costs, **terms):
    """(compute-stream seconds, ops) per rank (``compute_per_rank``) of ``_schedule``."""
    return compute_per_rank(_schedule(case, hardware, costs, **terms))


def ring_steps(schedule) -> int:
    """Median over ranks of the ring steps a schedule holds its ranks for (its ``Ctx.step_host`` tasks: a schedule
    priced with a host per step)."""
    steps: dict[int, int] = {}
    for t in schedule.tasks:
        if t.kind == "compute":
            steps[t.rank] = steps.get(t.rank, 0) + t.name.endswith(STEP_HOST_SUFFIX)
    return int(statistics.median(steps.values())) if steps else 0


def per_call_host(call: dict | None, *, world_size: int, node_size: int, dtype: str, hardware, costs,
                  cpus: float | None) -> dict | None:
    """The host seconds per kernel call (module docstring), with what it came from; None when the run was not
    capped, or ``call`` lacks ``CALL_METHOD``'s two layouts at one N, or they do not differ in kernel calls."""
    cases = [small_case(call, CALL_METHOD, world_size=world_size, node_size=node_size, dtype=dtype, layout=x)
             for x in CALL_LAYOUTS]
    if not cpus or None in cases or cases[0].shape.seqlen != cases[1].shape.seqlen:
        return None
    (m0, _), (m1, _) = (_compute(c, hardware, costs, call_host_s=0.0) for c in cases)
    (u0, _), (u1, _) = (_compute(c, hardware, costs, call_host_s=1.0) for c in cases)
    calls = (round(u0 - m0), round(u1 - m1))          # one second a call: the model's kernel calls per rank
    if calls[1] <= calls[0]:
        return None
    extra = (cases[1].cpu_s - cases[0].cpu_s) / cpus - (m1 - m0)
    return {"call_host_s": max(0.0, extra / (calls[1] - calls[0])), "calls": calls, "seqlen": cases[0].shape.seqlen,
            "cpu_s": (cases[0].cpu_s, cases[1].cpu_s), "model_s": (m0, m1), "cpus": cpus}


def host_per_op(call: dict | None, method: str, *, world_size: int, node_size: int, dtype: str, hardware,
                costs, cpus: float | None, steps: bool = False) -> dict | None:
    """The host seconds per op of ``method`` (module docstring), with what it came from; None when the
    run was not capped or ``call`` has no row for it. ``costs(hw, dtype)``: the run's cost model. ``steps``: split
    off the host per ring step where ``call`` has the method's ``STEP_MASK`` call (``split_host``), for a caller
    that charges it (``EmulatedCosts.step_host_s``); else the host is all per op."""
    case = small_case(call, method, world_size=world_size, node_size=node_size, dtype=dtype)
    if case is None or not cpus:
        return None
    schedule = _schedule(case, hardware, costs)
    whole = per_op_from(case, schedule, cpus)
    masked = steps and small_case(call, method, world_size=world_size, node_size=node_size, dtype=dtype,
                                  layout=case.shape.layout, mask=STEP_MASK)
    split = split_host(case, whole, masked, hardware=hardware, costs=costs, cpus=cpus) if masked else None
    return {**whole, **split} if split else whole


def split_host(causal: SmallCase, whole: dict, masked: SmallCase, *, hardware, costs, cpus: float) -> dict | None:
    """The host per ring step and per op of a method from its causal call (``whole``: ``per_op_from`` of it) and
    its ``STEP_MASK`` call (module docstring), with what they came from. Both terms keep the causal call at its
    measured CPU, as ``per_op_from``'s one term does: a per-op term below 0 is 0 and the steps take the causal
    call's whole excess. None (the host stays all per op) when the calls' N differ, the method has no ring steps,
    the mask skips no op, the causal call has no excess, or the per-op term alone would exceed it (no split of it
    with both terms at least 0)."""
    if masked.shape.seqlen != causal.shape.seqlen:
        return None
    ops0, e0 = whole["ops"], whole["measured_s"] - whole["model_s"]
    m1, ops1 = _compute(masked, hardware, costs)
    steps = ring_steps(_schedule(causal, hardware, costs, step_host_s=1.0))
    e1 = masked.cpu_s / cpus - m1
    if steps <= 0 or ops1 >= ops0 or e0 <= 0:
        return None
    per_op = max(0.0, (e0 - e1) / (ops0 - ops1))
    if ops0 * per_op > e0:
        return None
    return {"host_s_per_op": per_op, "host_s_per_step": (e0 - ops0 * per_op) / steps, "steps": steps,
            "mask": STEP_MASK, "masked_ops": ops1, "masked_cpu_s": masked.cpu_s, "masked_model_s": m1}


def per_op_from(case: SmallCase, schedule, cpus: float) -> dict:
    """The host seconds per op of ``case``'s measured call against the model's ``schedule`` of it."""
    model_s, ops = compute_per_rank(schedule)
    measured_s = case.cpu_s / cpus
    per_op = max(0.0, measured_s - model_s) / ops if ops else 0.0
    return {"host_s_per_op": per_op, "ops": ops, "seqlen": case.shape.seqlen, "measured_s": measured_s,
            "model_s": model_s, "cpu_s": case.cpu_s, "cpus": cpus}

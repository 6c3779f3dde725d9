"""Test cases taken from the registry (``baselines.registry.methods_with``).

A test about every method of a capability builds its cases from the registry's answer, so a method
added there is covered without an edit. A method that cannot run on this machine (``available()``
false: a peer package or CUDA missing) stays in a parametrised list as a skipped case with that
reason, rather than dropping out silently.
"""
from __future__ import annotations

import pytest

from baselines.registry import METHODS


def unavailable_reason(name: str) -> str | None:
    """Why registry method ``name`` cannot run here, else None (also for a name a test gives a case of
    its own, such as test_defects' "burst_lse")."""
    m = METHODS.get(name)
    if m is None or m.available():
        return None
    return f"method {name!r} is unavailable here (needs {m.external or 'an optional package'})"


def method_params(cases: list[tuple]) -> list:
    """``cases`` (tuples whose first item is a method name) as pytest params, those of a method that
    cannot run here marked skip with the reason."""
    out = []
    for case in cases:
        reason = unavailable_reason(case[0])
        out.append(pytest.param(*case, marks=pytest.mark.skip(reason=reason)) if reason else pytest.param(*case))
    return out


def write_rows(path, rows: list[dict]) -> None:
    """Synthetic result rows (record fields and shape keys side by side, as tests build them) written
    through the suite's one writer: the shape keys become the case's config, the provenance a test does
    not care about gets placeholders."""
    from experiments.harness import record

    for r in rows:
        row = {"experiment": "t", "case_id": r.get("method", "m"), "method": "m", "level": "op", "mode": "fwd_bwd",
               "timestamp": "2026-01-01T00:00:00", "git": {}, "versions": {}, "hardware": {}, "machine": "test",
               **r}
        cfg = {k: v for k, v in row.items() if k not in record.FIELDS and k not in ("status", "reason", "schema")}
        rec = record.Record.from_row({"status": "ok", **{k: v for k, v in row.items() if k not in cfg}})
        rec["config"] = {**cfg, **(row.get("config") or {})}
        record.write(path, rec)


# ---------------------------------------------------------------- one fp64 case of a method on every rank

# fp64 against the fp64 reference: both accumulate in fp64 (u = 1.1e-16) over at most a few dozen keys and
# W merges; 1e-12 relative leaves a factor ~100 over the worst case seen (1e-15) and is 10^10 below a wrong
# mask or a misplaced block.
FP64_RTOL = 1e-12
FP64_D = 8


def rel_err(got, want, full) -> float:
    """Error relative to the largest finite value of the whole reference tensor ``full`` (a shard may be
    all zeros: dk, dv of keys in length-1 documents)."""
    from tests.refs import max_err

    scale = full.double().abs().nan_to_num(posinf=0.0, neginf=0.0).max().item()
    return max_err(got, want) / max(scale, 1e-300)


def returns_lse(name: str) -> bool:
    """Whether registry method ``name`` hands back the lse with ``return_lse=True``: a keyword of its own
    function, or of the BurstAttention operator it binds (``operator_backward``) through ``**kw``."""
    import inspect

    m = METHODS[name]
    params = inspect.signature(m.fn).parameters
    return "return_lse" in params or (m.operator_backward is not None
                                      and any(p.kind is p.VAR_KEYWORD for p in params.values()))


def fp64_case(method, n, layout, causal, heads, mask, opts, refs: dict, strided: bool = False) -> tuple:
    """One fp64 case of registry method ``method`` on this rank (inside a process group) -> (worst relative
    error of out, lse where the method returns it, dq, dk, dv against the fp64 reference's shard; the bytes
    counted by kind and by link class; the method's formulas of both for this rank). ``strided``: q, k, v
    with non-contiguous strides (heads and positions swapped in memory). ``refs`` caches the inputs and
    reference per (n, heads, causal, mask)."""
    import torch

    from baselines import AttnShape, get
    from burst_impl import comm
    from burst_impl.layout import shard
    from tests.refs import attention_reference, make_inputs

    rank, G = comm.world()
    z, zkv = heads
    key = (n, heads, causal, mask)
    if key not in refs:
        inputs = make_inputs(1, n, z, zkv, FP64_D, torch.float64, seed=n)
        refs[key] = inputs, attention_reference(*inputs, causal, mask=mask or None)
    (q, k, v, do), ref = refs[key]
    shape = AttnShape(1, n, z, zkv, FP64_D, G, dtype="float64", causal=causal, layout=layout, mask=mask)
    lay = shape.resolved_layout
    ql, kl, vl = (shard(t, lay, rank, G) for t in (q, k, v))
    if strided:
        ql, kl, vl = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (ql, kl, vl))
        assert not ql.is_contiguous()
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    m = get(method)
    kw = dict(causal=causal, layout=layout, mask=mask, **opts)
    with comm.count_bytes() as counts:
        if returns_lse(method):
            out, lse = m.call(ql, kl, vl, return_lse=True, **kw)
        else:
            out, lse = m.call(ql, kl, vl, **kw), None
        out.backward(shard(do, lay, rank, G))
    got = dict(out=out, dq=ql.grad, dk=kl.grad, dv=vl.grad)
    err = max(rel_err(got[name], shard(ref[name], lay, rank, G), ref[name]) for name in got)
    if lse is not None:
        err = max(err, rel_err(lse, shard(ref["lse"], lay, rank, G, dim=2), ref["lse"]))
    link_opts = {name: x for name, x in opts.items() if name != "node_size"}
    formula = (m.bytes(shape, rank=rank, **opts), m.links(shape, rank, opts.get("node_size"), **link_opts))
    return err, (dict(counts), counts.link_dict()), formula


def fp64_failures(cases: list[tuple], strided: bool = False) -> list:
    """``fp64_case`` for every case (``(method, n, layout, causal, heads, mask, opts)``) on this rank; the
    failures: worst error above ``FP64_RTOL``, or counted bytes != the formulas."""
    refs: dict = {}
    bad = []
    for case in cases:
        err, counted, formula = fp64_case(*case, refs, strided=strided)
        if not err <= FP64_RTOL or counted != formula:
            bad.append((case, err, counted, formula))
    return bad


def deepspeed_comm_without_shm_op() -> None:
    """On this rank, DeepSpeed's comm backend starts without its shared-memory op. DeepSpeed 0.19.8's
    ``TorchBackend`` JIT-compiles that C++ op (csrc/cpu/comm/shm*.cpp, about 90 CPU-seconds: 35-45 s of a
    fresh checkout's suite on 2 cores) when its comm starts, and uses it only in ``inference_all_reduce``;
    ``DistributedAttention``'s all-to-alls go through torch.distributed with or without it
    (deepspeed/comm/torch.py). Call it in a rank before its first DeepSpeed call."""
    import importlib

    # by module path: the package attribute deepspeed.comm.torch is torch itself (its ``from .comm import *``)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

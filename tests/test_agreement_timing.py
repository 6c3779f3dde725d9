"""Fair timing (issue 39, item 4): the cross-rank agreement runs on a method's first call of a case,
never in the harness's timed calls, while a user calling the operator directly keeps the check.

Every collective the timed region makes is recorded by wrapping ``torch.distributed``'s collective
entry points on each rank; the method's own traffic (burst's ring: ``batch_isend_irecv``) is told
apart from any other collective. Two gloo ranks, 8 tokens per rank: the collectives counted do not
depend on the size, so the smallest case keeps the test cheap.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from burst_impl import burst_attn_func, comm
from experiments.harness import timing

# collectives other than the method's ring sends (the agreement is an all_gather)
_OTHERS = ("all_gather", "all_gather_object", "all_reduce", "broadcast", "all_to_all_single", "barrier")


class _Recorder:
    """Counts the calls of ``dist``'s collectives while ``on`` (the timed step itself)."""

    def __init__(self):
        self.on, self.calls, self._orig = False, [], {}

    def __enter__(self):
        for name in _OTHERS + ("batch_isend_irecv",):
            orig = getattr(dist, name)
            self._orig[name] = orig

            def wrapped(*a, _name=name, _orig=orig, **kw):
                if self.on:
                    self.calls.append(_name)
                return _orig(*a, **kw)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def _timed_collectives(warmup: int) -> dict:
    torch.manual_seed(dist.get_rank())
    q, k, v, do = (torch.randn(1, 8, 2, 8) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    rec = _Recorder()
    per_call: list[list[str]] = []

    def step():
        rec.on, rec.calls = True, []
        burst_attn_func(q, k, v, causal=True).backward(do)
        rec.on = False
        per_call.append(rec.calls)

    with rec:
        timing.time_steps(step, warmup=warmup, repeats=3, device=torch.device("cpu"))
        direct_before = comm.agreement_count()
        step()                                     # a user's direct call, outside the harness
        step()
        direct = comm.agreement_count() - direct_before
    others = [[c for c in calls if c != "batch_isend_irecv"] for calls in per_call]
    return dict(first=others[0], timed=others[warmup:warmup + 3],
                ring=[calls.count("batch_isend_irecv") for calls in per_call], direct=direct)


def test_timed_calls_make_no_collective_beyond_the_methods_own(pools):
    for got in pools.run(2, _timed_collectives, 1):
        assert got["first"] == ["all_gather"], "the warm-up (first call of the case) agrees on the inputs"
        assert got["timed"] == [[], [], []], "a timed call ran a collective that is not burst's own"
        assert len(set(got["ring"])) == 1 and got["ring"][0] > 0, "every call makes the same ring sends"
        assert got["direct"] == 2, "outside the harness every call keeps the check (the safe default)"


def test_without_warm_up_the_first_timed_call_agrees(pools):
    for got in pools.run(2, _timed_collectives, 0):
        # warmup=0: the case's first call is a timed one and pays the check, once
        assert got["timed"] == [["all_gather"], [], []]

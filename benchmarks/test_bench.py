"""One pytest-benchmark per case of ``--spec`` (see conftest.py).

The timed callable and the inputs are those of the harness (experiments.harness.steps),
so numbers are comparable with ``python -m experiments.run``; differences: here
pytest-benchmark does the statistics, of each rank's own times. The record in
``benchmark.extra_info`` carries the harness's two times from those samples, round
by round over ranks (the rounds start together at a barrier): the slowest rank's
(``time_median_s``) and the mean rank's (``time_mean_rank_s``); it also carries the
method, shape, world size, measured bytes next to the formula, measured peak
memory and the FLOPs of the suite's convention.
"""
from __future__ import annotations

import os
import statistics

import pytest
import torch
import torch.distributed as dist

from burst_impl import comm
from burst_impl.flops import case_flops, tflops_per_s, tokens_per_s
from experiments.harness.measure import memory_model_bytes
from experiments.harness.memory import measure_peak
from experiments.harness.plan import case_problem
from experiments.harness.results import base_record
from experiments.harness.steps import build_step
from experiments.harness.timing import barrier, over_ranks


@pytest.fixture(scope="session")
def device(request):
    kind = request.config.getoption("--bench-device")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def test_case(benchmark, case, device):
    why = case_problem(case)
    if why:
        pytest.skip(why)
    from baselines.registry import METHODS

    on = dist.is_initialized()
    group = dist.group.WORLD if on else None
    rank = dist.get_rank() if on else 0
    torch.manual_seed(case.seed)
    step = build_step(case, rank=rank, group=group, device=device)

    def setup():
        if step.setup is not None:
            step.setup()
        barrier(group, device)  # ranks start each round together

    benchmark.pedantic(step.step, setup=setup, rounds=case.repeats, warmup_rounds=case.warmup, iterations=1)
    # Untimed, after the timing (profiling leaves background work that would skew it):
    # bytes and peak memory of one full step.
    with comm.count_bytes() as counts:
        mem = measure_peak(step.full, device, start_bytes=step.live_bytes())
    method = METHODS[case.method]
    if case.level == "model":   # a whole decoder: the step's own formula and the model FLOP convention
        from burst_impl.model.flops import model_flops

        formula = step.context.comm_formula(case)
        flops = model_flops(step.context.cfg, case.batch, case.seqlen, mode=case.mode, causal=case.causal)["total"]
        mem_model = None
    else:
        formula = method.bytes(case.shape)
        flops, _ = case_flops(case.level, case.shape, case.mode)   # layer level: projections included
        mem_model = memory_model_bytes(case)
    # the suite's one record type (experiments/harness/record.py), this rank's view; pytest-benchmark keeps
    # the times and their statistics itself
    rec = base_record(case, "ok")
    rec.update({
        "comm_fwd_bytes": counts.phase_total("forward"), "comm_bwd_bytes": counts.phase_total("backward"),
        "comm_fwd_formula_bytes": sum(v for (p, _), v in formula.items() if p == "forward"),
        "comm_bwd_formula_bytes": sum(v for (p, _), v in formula.items() if p == "backward"),
        "mem_peak_bytes": mem.peak_bytes, "mem_method": mem.method,
        "mem_model_bytes": mem_model, "flops": flops,
    })
    samples = list(benchmark.stats.stats.data) if benchmark.stats else []
    if samples:
        # every rank's samples, round by round (one all-gather, as the harness's timing.over_ranks)
        rounds = list(zip(*over_ranks(samples, device, group)))
        med = statistics.median(max(r) for r in rounds)
        rec.update(time_median_s=med, time_mean_rank_s=statistics.median(sum(r) / len(r) for r in rounds),
                   tflops_per_rank=tflops_per_s(flops, med) / case.world_size,
                   tokens_per_s=tokens_per_s(case.batch, case.seqlen, med))
    benchmark.extra_info.update(rank=rank, record=rec.to_json())

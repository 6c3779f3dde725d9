"""pytest-benchmark of the LM head + cross-entropy loss modes (burst_impl/loss_bench.py).

    pytest benchmarks/test_loss_bench.py --benchmark-json loss.json
    LOSS_BENCH_TOKENS=4096 LOSS_BENCH_VOCAB=32768 LOSS_BENCH_DTYPE=float32,bfloat16 \
        pytest benchmarks/test_loss_bench.py --benchmark-json loss.json

One benchmark per (dtype, vocab, mode): forward + backward of the mean loss,
the step of ``python -m experiments.benches.loss_bench``. Sizes from the environment
(LOSS_BENCH_TOKENS, LOSS_BENCH_HIDDEN, LOSS_BENCH_VOCAB, LOSS_BENCH_DTYPE,
LOSS_BENCH_MODES, LOSS_BENCH_ROUNDS; defaults 8192, 1024, 32768,131072, float32,
every mode, 3). ``extra_info`` carries the measured peak memory and the size of
the logits. Runs only when this file is named on the command line, so that
``pytest benchmarks --spec ...`` stays the spec's session (the parameter is
``loss_case``: conftest.py generates every ``case``).
"""
from __future__ import annotations

import os

import pytest
import torch

from experiments.benches.loss_bench import LossCase, build
from burst_impl.loss_modes import LOSS_MODES
from experiments.harness.memory import measure_peak


def _env_list(name: str, default: str) -> list[str]:
    return [s.strip() for s in os.environ.get(name, default).split(",") if s.strip()]


TOKENS = int(os.environ.get("LOSS_BENCH_TOKENS", 8192))
HIDDEN = int(os.environ.get("LOSS_BENCH_HIDDEN", 1024))
ROUNDS = int(os.environ.get("LOSS_BENCH_ROUNDS", 3))
CASES = [LossCase(mode, TOKENS, HIDDEN, int(vocab), dtype)
         for dtype in _env_list("LOSS_BENCH_DTYPE", "float32")
         for vocab in _env_list("LOSS_BENCH_VOCAB", "32768,131072")
         for mode in _env_list("LOSS_BENCH_MODES", ",".join(LOSS_MODES))]


@pytest.fixture
def device(request):
    kind = request.config.getoption("--bench-device", default="auto")
    return torch.device("cuda" if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()) else "cpu")


@pytest.mark.parametrize("loss_case", CASES, ids=[f"{c.dtype}-V{c.vocab}-{c.name}" for c in CASES])
def test_loss_mode(benchmark, request, loss_case, device):
    case = loss_case
    if not any("test_loss_bench" in str(a) for a in request.config.args):
        pytest.skip("run by path: pytest benchmarks/test_loss_bench.py")
    why = LOSS_MODES[case.mode].unavailable()
    if why:
        pytest.skip(why)
    b = build(case, device)
    benchmark.pedantic(b.step, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    mem = measure_peak(b.step, device, start_bytes=b.start_bytes)   # untimed, after the timing
    benchmark.extra_info.update({
        "mode": case.mode, "tokens": case.tokens, "hidden": case.hidden, "vocab": case.vocab, "dtype": case.dtype,
        "mem_peak_bytes": mem.peak_bytes, "mem_method": mem.method, "logits_bytes": case.logits_bytes,
        "threads": torch.get_num_threads(),
    })

"""pytest-benchmark sessions generated from an experiment spec.

    pytest benchmarks --spec cpu_fig4b_batch --benchmark-json out.json            # world size 1 cases
    torchrun --standalone --nproc-per-node 4 -m pytest benchmarks --spec cpu_fig2_train \
        --benchmark-json out.json                                                  # world size 4 cases

One benchmark per case of the spec whose world size equals the launch's
(``WORLD_SIZE``, 1 without torchrun). Under torchrun every rank runs the same
benchmarks (they are collective); only rank 0 writes JSON or saves runs.
"""
from __future__ import annotations

import datetime
import os

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("experiments", "experiment spec benchmarks")
    g.addoption("--spec", default=None,
                help="experiment spec or preset (name or YAML path), as for python -m experiments.run")
    g.addoption("--spec-cluster", default=None, help="override the spec's cluster profile (cpu, local, <name>)")
    g.addoption("--bench-device", default="auto", choices=("auto", "cpu", "cuda"))


def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def pytest_configure(config):
    rank, world = _world()
    if world > 1:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            cuda = config.getoption("--bench-device") != "cpu" and torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
        if rank != 0:
            # One JSON/saved run per session: rank 0's.
            for opt in ("benchmark_json", "benchmark_save", "benchmark_autosave", "benchmark_histogram"):
                if hasattr(config.option, opt):
                    setattr(config.option, opt, None if opt != "benchmark_autosave" else False)


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    name = metafunc.config.getoption("--spec")
    if not name:
        metafunc.parametrize("case", [pytest.param(None, marks=pytest.mark.skip(
            reason="pass --spec <spec or preset> to generate the benchmarks"))])
        return
    from experiments.harness.spec import load_any

    preset = load_any(name, cluster=metafunc.config.getoption("--spec-cluster"))
    _, world = _world()
    cases = [c for s in preset.specs for c in s.cases() if c.world_size == world]
    if not cases:
        metafunc.parametrize("case", [pytest.param(None, marks=pytest.mark.skip(
            reason=f"spec {name!r} has no case at world size {world}; launch with torchrun --nproc-per-node G"))])
        return
    metafunc.parametrize("case", cases, ids=[f"{c.experiment}/{c.case_id}" for c in cases])

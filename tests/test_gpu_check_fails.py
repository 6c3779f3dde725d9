"""The GPU check can fail, and fits a lent device (issue 39, item 3).

No GPU here. A host "with GPUs" is a fake ``nvidia-smi`` on PATH (a script in tmp_path printing what
the real one prints for ``-L``) next to this machine's CPU-only torch: exactly a GPU host whose torch
cannot use them, which the check must not pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import types

import pytest

from experiments import gpu_check as G
from experiments.harness.env import REPO

H200 = [G.Device(0, "NVIDIA H200", "9.0", 139.8)]
SMI = "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n"


def _fake_smi(tmp_path, body=SMI):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    smi = bin_ / "nvidia-smi"
    smi.write_text(body)
    smi.chmod(0o755)
    return bin_


def test_a_gpu_host_whose_torch_cannot_use_them_fails_the_check(tmp_path):
    env = dict(os.environ, PATH=f"{_fake_smi(tmp_path)}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--results", str(tmp_path / "r")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0, proc.stdout
    assert "nvidia-smi lists 1 GPU(s)" in proc.stdout and "torch cannot use them" in proc.stdout
    assert "plan:" in proc.stdout


def test_listed_gpus_reads_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path)}:{os.environ['PATH']}")
    assert G.listed_gpus() == ["GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"]


def test_a_failing_nvidia_smi_lists_nothing(tmp_path, monkeypatch):
    bin_ = _fake_smi(tmp_path, "#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    assert G.listed_gpus() == []


def _importer(present):
    def importer(name):
        if name not in present:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return types.ModuleType(name)
    return importer


def _versions(installed):
    return lambda dists: "1.0" if dists[0] in installed else None


def test_installed_but_not_importable_fails_the_packages_step():
    rows = G.package_report(_importer({"flash_attn"}), _versions({"flash-attn", "ring-flash-attn"}))
    problems = G.package_problems(rows)
    assert len(problems) == 1 and "ring-flash-attn 1.0 is installed but does not import" in problems[0]
    # not installed and not required: no problem, the steps needing it skip with the reason
    assert G.package_problems(G.package_report(_importer({"flash_attn"}), _versions({"flash-attn"}))) == []


def test_a_required_package_that_is_missing_fails(tmp_path, monkeypatch, capsys):
    rows = G.package_report(_importer({"flash_attn"}), _versions({"flash-attn"}))
    assert G.package_problems(rows, ("flash_attn",)) == []
    problems = G.package_problems(rows, ("ring_flash_attn", "flash_attn"))
    assert problems == ["--require ring_flash_attn: ring-flash-attn is not usable here "
                        "(ModuleNotFoundError: No module named 'ring_flash_attn')"]
    monkeypatch.setattr(G, "package_report", lambda: rows)
    argv = ["--steps", "packages", "--require", "ring_flash_attn,flash_attn",
            "--results", str(tmp_path / "r"), "--plots", str(tmp_path / "p")]
    assert G.main(argv, found=H200) == 1
    summary = json.loads((tmp_path / "r" / "nvidia-h200" / "summary.json").read_text())
    assert summary["steps"][0]["status"] == "failed" and "--require ring_flash_attn" in summary["steps"][0]["reason"]


def test_a_failed_xformers_probe_fails_the_packages_step(monkeypatch):
    import dataclasses

    from burst_impl import kernels as K

    monkeypatch.setitem(K.BACKENDS, "xformers", dataclasses.replace(K.BACKENDS["xformers"], available=lambda: False))
    rows = G.package_report(_importer({"xformers.ops.fmha"}), _versions({"xformers"}))
    assert any("lse probe failed" in p for p in G.package_problems(rows))


def test_an_unknown_requirement_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        G.main(["--require", "nope"], found=H200)
    assert e.value.code == 2 and "--require: ['nope'] unknown" in capsys.readouterr().err


def test_every_harness_step_fits_the_device_budget():
    for n_gpus in (1, 8):
        specs, _ = G.harness_specs(n_gpus)
        for group in (["harness", "peers"], ["multi"]):
            chosen = [s for s in specs if s["name"] in group]
            if not chosen:
                continue
            case_s = G.fit_budget(chosen)
            parsed = [G.parse_spec(s, "<t>") for s in chosen]
            cases = [c for p in parsed for c in p.cases()]
            launches = sum(len({c.shape.world_size for c in p.cases()}) for p in parsed)
            worst = sum(c.case_timeout_s for c in cases) + G.LAUNCH_ALLOWANCE_S * launches
            assert worst <= G.STEP_BUDGET_S < 600 and case_s >= 5, (group, n_gpus, worst, case_s)
    assert G.step_tests.__defaults__[0] <= G.STEP_BUDGET_S - 30      # packages runs before it in its call


def test_the_sweep_stops_at_its_budget_and_records_the_rest(tmp_path):
    import torch

    from experiments.harness import kernel_sweep as KS

    recs = KS.run_sweep(["cpu_flash"], [32, 64], device=torch.device("cpu"), results_root=tmp_path,
                        shape=KS.SweepShape(heads=1, head_dim=8), warmup=0, repeats=1, log=lambda m: None,
                        budget_s=0)
    assert recs and all(r["status"] == "skipped" and "time budget" in r["reason"] for r in recs)


def test_the_outputs_are_packed_into_one_archive(tmp_path):
    r, p = tmp_path / "r", tmp_path / "p"
    argv = ["--steps", "packages", "--results", str(r), "--plots", str(p)]
    G.main(argv, found=H200)
    with tarfile.open(r / "nvidia-h200.tar.gz") as tar:
        assert "r/nvidia-h200/summary.json" in tar.getnames()


def test_make_gpu_check_here_prints_the_plan_and_why_it_cannot_run(tmp_path):
    env = dict(os.environ, GPU_CHECK_ARGS=f"--results {tmp_path / 'r'}")
    proc = subprocess.run(["make", "-s", "gpu-check"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plan:" in proc.stdout and G.NO_DEVICE in proc.stdout

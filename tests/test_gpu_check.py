"""``make gpu-check`` (experiments/gpu_check.py), its CPU-side logic, with fake device lists.

No GPU here: the steps that need one are either stubbed or run with CPU
kernels (``--device cpu --kernels cpu_flash``), which exercises the same record
writing, summary and figure code a GPU run uses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from experiments import gpu_check as G
from experiments.harness import kernel_sweep as KS
from experiments.harness import results as R
from experiments.harness.env import REPO
from experiments.harness.spec import parse_spec

H200 = [G.Device(0, "NVIDIA H200", "9.0", 139.8)]


def test_no_device_says_so_and_exits_zero(tmp_path, capsys):
    assert G.main(["--results", str(tmp_path / "r"), "--plots", str(tmp_path / "p")], found=[]) == 0
    assert G.NO_DEVICE in capsys.readouterr().out
    assert not (tmp_path / "r").exists() and not (tmp_path / "p").exists()


def test_the_command_line_on_a_machine_without_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--results", "/nonexistent/r"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no CUDA device: nothing to check" in proc.stdout, proc.stderr


def test_slug():
    assert G.slug("NVIDIA H200") == "nvidia-h200"
    assert G.slug("NVIDIA A100-SXM4-80GB") == "nvidia-a100-sxm4-80gb"


def test_package_report_with_fake_imports(monkeypatch):
    import dataclasses

    from burst_impl import kernels as K

    present = {"flash_attn", "xformers.ops.fmha", "deepspeed"}

    def importer(name):
        if name not in present:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return types.ModuleType(name)

    monkeypatch.setitem(K.BACKENDS, "xformers", dataclasses.replace(K.BACKENDS["xformers"], available=lambda: True))
    rows = {r["package"]: r for r in G.package_report(importer, lambda dists: f"v-{dists[0]}")}
    assert list(rows) == ["torch", *(p[0] for p in G.PACKAGES)]
    assert rows["torch"]["version"] == torch.__version__ and "CUDA build" in rows["torch"]["detail"]
    assert rows["flash-attn"]["importable"] and rows["flash-attn"]["version"] == "v-flash-attn"
    assert not rows["ring-flash-attn"]["importable"]
    assert "No module named 'ring_flash_attn'" in rows["ring-flash-attn"]["detail"]
    assert not rows["liger-kernel"]["importable"] and not rows["cut-cross-entropy"]["importable"]
    assert rows["xformers"]["detail"] == "lse probe not run (no CUDA)"
    monkeypatch.setitem(K.BACKENDS, "xformers", dataclasses.replace(K.BACKENDS["xformers"], available=lambda: False))
    rows = {r["package"]: r for r in G.package_report(importer, lambda dists: None)}
    assert rows["xformers"]["importable"] and rows["xformers"]["detail"] != "lse probe not run (no CUDA)"


@pytest.mark.parametrize("n,sizes", [(1, None), (2, [2]), (3, [2]), (8, [2, 4, 8])])
def test_harness_specs_load_and_multi_gpu_needs_two(n, sizes):
    specs, why = G.harness_specs(n)
    parsed = {s["name"]: parse_spec(s, "<test>") for s in specs}
    assert set(parsed) == ({"harness", "peers"} | ({"multi"} if sizes else set()))
    assert parsed["harness"].kernels == G.CUDA_KERNELS and parsed["harness"].methods == ("burst",)
    assert parsed["peers"].methods == ("ring_flash_attn",)
    if sizes is None:
        assert "1 GPU visible" in why and "at least 2" in why
    else:
        assert why == "" and list(parsed["multi"].sweep["world_size"]) == sizes


def test_sweep_records_summary_and_figure_with_a_fake_gpu(tmp_path):
    """The whole script with a fake one-GPU list: package report and the kernel sweep (on CPU kernels)."""
    r, p = tmp_path / "r", tmp_path / "p"
    argv = ["--steps", "packages,sweep", "--device", "cpu", "--kernels", "cpu_flash,flash_attn",
            "--seqlens", "32,64", "--heads", "2", "--head-dim", "16", "--warmup", "0", "--repeats", "2",
            "--results", str(r), "--plots", str(p)]
    assert G.main(argv, found=H200) == 0
    out = r / "nvidia-h200"
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["packages", "sweep"]
    assert {s["status"] for s in summary["steps"]} == {"ok"}
    assert summary["devices"][0]["name"] == "NVIDIA H200" and summary["git"]["commit"]
    assert {"torch", "xformers"} <= set(summary["versions"]) and summary["hardware"]
    assert [row["package"] for row in summary["packages"]][0] == "torch"
    recs = R.read_records(out / "kernels" / R.RESULTS_FILE)
    ok = [x for x in recs if x["status"] == "ok"]
    assert {x["kernel"] for x in ok} == {"cpu_flash", KS.TORCH_SDPA}
    assert len(ok) == 2 * 2 * 2 * 2                                         # kernels x masks x modes x N
    for x in recs:
        assert set(R.REQUIRED_KEYS) <= set(x) and x["level"] == "kernel"
    for x in ok:
        assert len(x["time_samples_s"]) == 2 and x["tflops_total"] > 0 and x["mem_peak_bytes"] >= 0
        assert x["flops"] == 4 * 32 ** 2 * 2 * 16 * (x["seqlen"] // 32) ** 2 * (0.5 if x["causal"] else 1) * \
            (3.5 if x["mode"] == "fwd_bwd" else 1)
    skipped = [x for x in recs if x["status"] == "skipped"]
    assert {x["kernel"] for x in skipped} == {"flash_attn", *KS.SDPA_PINNED}          # CUDA-only kernels
    assert all("cuda" in x["reason"].lower() for x in skipped)
    fig = p / "nvidia-h200" / "kernel_tflops_vs_seqlen.png"
    assert fig.stat().st_size > 20_000


def test_a_failed_step_fails_the_check_and_the_others_still_run(tmp_path, monkeypatch):
    monkeypatch.setattr(G, "step_tests", lambda out: G.Step("tests", "failed", "pytest exit code 1"))

    def boom(*a, **k):
        raise RuntimeError("broken launch")

    monkeypatch.setattr(G, "step_harness", boom)
    argv = ["--steps", "tests,harness,multi", "--results", str(tmp_path / "r"), "--plots", str(tmp_path / "p")]
    assert G.main(argv, found=H200) == 1
    steps = {s["name"]: s for s in json.loads((tmp_path / "r" / "nvidia-h200" / "summary.json").read_text())["steps"]}
    assert steps["tests"]["status"] == "failed"
    assert steps["harness"]["status"] == "failed" and "broken launch" in steps["harness"]["reason"]
    assert steps["multi"]["status"] == "skipped" and "1 GPU visible" in steps["multi"]["reason"]


def test_junit_counts(tmp_path):
    x = tmp_path / "j.xml"
    x.write_text('<testsuites><testsuite name="pytest" tests="5" failures="1" errors="0" skipped="2"/></testsuites>')
    assert G.junit_counts(x) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2}
    assert G.junit_counts(tmp_path / "missing.xml") == {}


def test_sweep_rejects_an_unknown_kernel(tmp_path):
    with pytest.raises(ValueError, match="kernels: 'nope' is unknown"):
        KS.run_sweep(["nope"], [32], device=torch.device("cpu"), results_root=tmp_path)


def test_ring_flash_attn_at_world_size_one_gets_a_single_process_group():
    code = ("import torch, torch.distributed as dist\n"
            "from baselines.methods.ring_flash_attn import _start_single_process_group\n"
            "_start_single_process_group(torch.device('cpu'))\n"
            "t = torch.ones(3); dist.all_reduce(t); dist.barrier()\n"
            "print(dist.get_world_size(), dist.get_rank(), t.tolist())\n"
            "dist.destroy_process_group()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.strip() == "1 0 [1.0, 1.0, 1.0]", proc.stderr


def test_step_harness_runs_specs_through_the_runner(tmp_path):
    """The harness step on this machine: CUDA kernels and ring-flash-attn are skipped with the reason,
    a CPU kernel runs through the worker, and the step reports the kernels that ran."""
    specs, _ = G.harness_specs(1)
    st = G.step_harness(tmp_path / "r", specs, "harness")
    assert st.status == "skipped" and "cannot run here" in st.reason
    recs = R.read_records(tmp_path / "r" / "harness" / R.RESULTS_FILE)
    assert {r["kernel"] for r in recs} == set(G.CUDA_KERNELS) and {r["status"] for r in recs} == {"skipped"}
    tiny = G._spec("tiny", ["burst"], {"seqlen": 64, "world_size": 1, "heads": 2, "head_dim": 16,
                                       "dtype": "float32"}, kernels=["cpu_flash", "flash_attn"], modes=("fwd_bwd",))
    tiny.update(warmup=0, repeats=2)
    st = G.step_harness(tmp_path / "r", [tiny], "harness")
    assert st.status == "ok", st.reason
    assert st.details["kernels"] == ["cpu_flash"] and st.details["process_group"] == ["gloo"]
    assert any("flash_attn" in s for s in st.details["skipped"])


def test_a_deadline_skips_the_steps_it_leaves_no_time_for(tmp_path):
    """--deadline-s: a step starts only with MIN_STEP_S left after the margin; the others are recorded skipped."""
    r, p = tmp_path / "r", tmp_path / "p"
    argv = ["--steps", "packages,gemm,sweep", "--device", "cpu", "--deadline-s", "1",
            "--results", str(r), "--plots", str(p)]
    assert G.main(argv, found=H200) == 0
    steps = json.loads((r / "nvidia-h200" / "summary.json").read_text())["steps"]
    assert [(s["name"], s["status"]) for s in steps] == [("packages", "skipped"), ("gemm", "skipped"),
                                                         ("sweep", "skipped")]
    assert all("--deadline-s 1: under 15 s left" in s["reason"] for s in steps)

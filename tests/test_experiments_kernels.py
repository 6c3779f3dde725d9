"""The local kernel as a choice of the experiment harness: ``kernels:`` in a spec, one case per
kernel, ``backend=`` handed to the method, and the kernel that ran named in every record."""
from __future__ import annotations

import pytest
import torch

from experiments.harness import results as R
from experiments.harness.plan import case_problem
from experiments.harness.spec import parse_spec
from experiments.harness.steps import kernel_used
from experiments.run import main as run_main

BASE = {
    "name": "t_kern",
    "methods": ["burst"],
    "sweep": {"seqlen": 64, "world_size": 1, "heads": 2, "head_dim": 16, "dtype": "float32"},
    "measure": {"modes": ["fwd_bwd"], "level": "op"},
    "warmup": 0,
    "repeats": 2,
    "cluster": "cpu",
    "timeouts": {"case_s": 60, "pg_s": 30},
}


def _spec(**over):
    return parse_spec({**BASE, **over}, "k.yaml")


def test_one_case_per_kernel_with_the_kernel_in_its_name():
    spec = _spec(kernels=["cpu_flash", "reference"], methods=["burst", "ring"])
    cases = spec.cases()
    assert sorted((c.method, c.kernel) for c in cases) == [
        ("burst", "cpu_flash"), ("burst", "reference"), ("ring", "cpu_flash"), ("ring", "reference")]
    assert {c.case_id.rsplit(".", 1)[1] for c in cases} == {"cpu_flash", "reference"}
    assert len({c.case_id for c in cases}) == 4
    # without kernels: one automatic case, and its name is what it always was
    (auto,) = _spec().cases()
    assert auto.kernel is None and auto.case_id == "burst.op.fwd_bwd.N64.G1.B1.Z2.kv2.d16.float32.causal.contiguous"
    assert spec.resolved()["kernels"] == ["cpu_flash", "reference"]


def test_exclude_by_kernel():
    spec = _spec(kernels=["cpu_flash", "reference"], methods=["burst", "ring"],
                 exclude=[{"method": "ring", "kernel": "reference"}])
    assert len(spec.cases()) == 3


@pytest.mark.parametrize("over,key,rule", [
    (dict(kernels=["nope"]), "kernels", "'nope' is not a kernel"),
    (dict(kernels=["cpu_flash", "cpu_flash"]), "kernels", "lists a kernel twice"),
    (dict(kernels=["flash_attn"]), "kernels", "runs on cuda, but cluster 'cpu' runs on cpu"),
    (dict(kernels=["cpu_flash"], methods=["ring_rsa"]), "kernels", "runs its own kernel"),
    (dict(kernels=["cpu_flash"], exclude=[{"kernal": "x"}]), "exclude.kernal", "unknown key"),
])
def test_bad_kernels_are_load_errors(over, key, rule):
    with pytest.raises(ValueError, match=rf"k\.yaml: key '{key}'.*{rule}"):
        _spec(**over)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answer")
def test_a_cuda_kernel_on_a_machine_without_gpu_is_skipped_with_the_reason():
    (case,) = _spec(kernels=["xformers"], cluster="local").cases()
    why = case_problem(case)
    assert why.startswith("kernel 'xformers' cannot run here") and "cuda" in why


def test_kernel_used():
    cpu = torch.device("cpu")
    (auto,) = _spec().cases()
    assert kernel_used(auto, cpu) == "cpu_flash"                        # the automatic choice, resolved
    (ref,) = _spec(kernels=["reference"]).cases()
    assert kernel_used(ref, cpu) == "reference"
    (rsa,) = _spec(methods=["ring_rsa"]).cases()
    assert kernel_used(rsa, cpu).startswith("matmul")                   # the method's own


def test_the_step_calls_the_kernel_asked_for(monkeypatch):
    """build_step hands the case's kernel to the method as backend= (op and layer level)."""
    import dataclasses

    from burst_impl import kernels as K
    from experiments.harness.steps import build_step

    calls = []
    ref = K.BACKENDS["reference"]

    def spy(*a):
        calls.append("forward")
        return ref.forward(*a)

    monkeypatch.setitem(K.BACKENDS, "reference", dataclasses.replace(ref, forward=spy))
    for level, methods in (("op", ["burst"]), ("layer", ["burst", "tp_v1"])):
        for case in _spec(kernels=["reference"], methods=methods, measure={"modes": ["fwd_bwd"], "level": level}
                          ).cases():
            calls.clear()
            build_step(case, rank=0, group=None, device=torch.device("cpu")).full()
            assert calls, (level, case.method)
        (auto,) = _spec(measure={"modes": ["fwd_bwd"], "level": level}).cases()
        calls.clear()
        build_step(auto, rank=0, group=None, device=torch.device("cpu")).full()
        assert not calls, level                                         # automatic: cpu_flash


def test_worker_records_the_kernel_that_ran(tmp_path):
    import yaml

    p1 = tmp_path / "t_kern.yaml"
    p1.write_text(yaml.safe_dump({**BASE, "kernels": ["reference"]}))
    p2 = tmp_path / "t_kern_auto.yaml"       # ring_rsa takes no kernel: its automatic case, in a second spec
    p2.write_text(yaml.safe_dump({**BASE, "name": "t_kern_auto", "methods": ["burst", "ring_rsa"]}))
    root = tmp_path / "results"
    for p in (p1, p2):
        assert run_main([str(p), "--results", str(root), "--no-plots"]) == 0
    recs = R.read_records(root / "t_kern" / R.RESULTS_FILE) + R.read_records(root / "t_kern_auto" / R.RESULTS_FILE)
    got = {(r["method"], r["kernel"], r["config"]["kernel"]) for r in recs}
    assert got == {("burst", "reference", "reference"), ("burst", "cpu_flash", None),
                   ("ring_rsa", "matmul (materialised scores)", None)}, [r["reason"] for r in recs]
    assert all(r["status"] == "ok" and set(R.REQUIRED_KEYS) <= set(r) for r in recs)

"""The GPU check's model-constant steps, on what a CPU can check: the GEMM shapes and sweep, the
efficiency tables, the pinned SDPA kernels' refusal off CUDA, and the memory comparison and figures
re-derived from the committed H200 records (results/gpu_check/nvidia-h200)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments import gpu_ceilings as GC
from experiments import gpu_check as G
from experiments import gpu_memory as GM
from experiments.figure_parts import provenance
from experiments.harness import gemm_sweep as GS
from experiments.harness import kernel_sweep as KS
from experiments.harness.timed_step import MAX_STEPS_PER_SAMPLE

H200 = Path(__file__).resolve().parents[1] / "results" / "gpu_check" / "nvidia-h200"
GIB = 2 ** 30


def test_layer_shapes_are_the_decoder_gemms():
    shapes = {name.split("/")[1]: (m, n, k) for name, m, n, k in GS.layer_shapes("llama3_8b", 4096)}
    # 32 query heads and 8 kv heads of 128: q, k, v fused = 4096 + 2 x 1024 columns
    assert shapes == {"qkv": (4096, 6144, 4096), "out": (4096, 4096, 4096), "gate_up": (4096, 28672, 4096),
                      "down": (4096, 4096, 14336)}


def test_gemm_sweep_times_every_shape_and_picks_the_best():
    rows = GS.run_gemms(torch.device("cpu"), models=("tiny",), tokens=(32,), grid=(16, 32), warmup=0, repeats=2,
                        log=lambda _: None)
    assert len(rows) == 4 + 8 and all(r["tflops"] > 0 and len(r["time_samples_s"]) == 2 for r in rows)
    assert all(r["flops"] == 2.0 * r["m"] * r["n"] * r["k"] for r in rows)
    assert GS.best(rows)["tflops"] == max(r["tflops"] for r in rows)


def test_efficiency_is_tflops_over_the_peak_by_kernel_mask_and_mode():
    recs = [{"status": "ok", "method": "torch_sdpa_flash", "causal": False, "mode": "forward", "seqlen": n,
             "tflops_total": t} for n, t in ((1024, 300.0), (512, 260.0))]
    recs.append({"status": "failed", "method": "torch_sdpa_flash", "causal": False, "mode": "forward",
                 "seqlen": 2048, "tflops_total": None})
    assert GC.efficiency(recs, 1000.0) == {"torch_sdpa_flash": {"full": {"forward": [[512, 0.26], [1024, 0.3]]}}}


def test_pinned_sdpa_kernels_are_refused_off_cuda(tmp_path):
    recs = KS.run_sweep(list(KS.SDPA_PINNED), [64], device=torch.device("cpu"), results_root=tmp_path,
                        shape=KS.SweepShape(heads=2, head_dim=16), warmup=0, repeats=1, log=lambda _: None)
    assert {r["status"] for r in recs} == {"skipped"} and all("runs on CUDA" in r["reason"] for r in recs)


def test_the_h200_profile_carries_the_measured_tables():
    table = json.loads((H200 / "sdpa_profile.json").read_text())["efficiency"]["torch_sdpa_flash"]["full"]
    gemm = json.loads((H200 / "gemm.json").read_text())["gemm_efficiency"]
    acc = GC.load_hardware(GC.PROFILE).accelerator
    assert [list(p) for p in acc.attn_efficiency] == table["fwd_bwd"]
    assert [list(p) for p in acc.attn_efficiency_forward] == table["forward"]
    causal = json.loads((H200 / "sdpa_profile.json").read_text())["efficiency"]["torch_sdpa_flash"]["causal"]
    assert [list(p) for p in acc.attn_efficiency_causal] == causal["fwd_bwd"]
    assert [list(p) for p in acc.attn_efficiency_causal_forward] == causal["forward"]
    assert acc.gemm_efficiency == gemm


def test_the_memory_comparison_of_the_h200_records():
    rows = {r["case_id"]: r for r in GM.compare(GM.read(H200))}
    assert len(rows) == 6
    op = [r for r in rows.values() if r["level"] == "op"]
    # what the layer keeps for backward is the registry's formula to the byte, on the GPU as on the CPU
    assert all(abs(r["saved_gib"] - r["model_kept_gib"]) * GIB < 1e6 for r in op)
    for r in rows.values():
        assert r["reserved_whole_gib"] >= r["allocated_whole_gib"] >= r["peak_gib"] - 1e-9


def test_derive_redraws_from_the_records_alone(tmp_path):
    import shutil
    out = tmp_path / "r" / "nvidia-h200"
    shutil.copytree(H200, out, ignore=shutil.ignore_patterns("run1"))
    written = G.derive(out, tmp_path / "p", "NVIDIA H200")
    assert {p.name for p in written} == {"kernel_tflops_vs_seqlen.png", "sdpa_tflops_vs_seqlen.png", "memory.json"}
    rows = [json.loads((d / "memory.json").read_text())["rows"] for d in (out, H200)]
    assert rows[0] == rows[1]
    # the figures' footer: the suite's provenance line of the records drawn
    line = provenance(pd.DataFrame(KS.R.read_records(out / "kernels" / KS.R.RESULTS_FILE)))
    assert "70889de" in line and "debdac1" in line and "NVIDIA H200" in line


def test_derive_of_a_gpu_without_results_is_a_usage_error(tmp_path, capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        G.main(["--derive", "nvidia-h100", "--results", str(tmp_path)])
    assert e.value.code == 2 and "--derive 'nvidia-h100': no " in capsys.readouterr().err


def test_decode_rows_beside_the_models_roofline():
    """The decode step's arithmetic on CPU tensors: roofline bytes, the achieved rate, and the model's time
    for the same row (its K/V bytes at the profile's nominal HBM rate, x batch)."""
    res = GC.decode_table(torch.device("cpu"), budget_s=60, kernels=("cpu_flash",), contexts=(256,), batches=(1, 2),
                          heads=((4, 2),), copy_bytes=1 << 20, warmup=0, repeats=2, log=lambda _: None)
    copy, *rows = res["rows"]
    assert copy["kernel"] == "copy" and copy["bytes"] == 2 << 20
    assert [r["batch"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    for r in rows:
        kv = 2 * 256 * 2 * 128 * 2 * r["batch"]                       # K and V, bf16
        assert r["bytes"] == kv + 2 * 1 * 4 * 128 * 2 * r["batch"]      # plus q and out
        # a few KiB of K/V: memory-bound, so the model charges exactly the bytes at the nominal rate
        assert r["modelled_s"] == pytest.approx(r["bytes"] / (res["hbm_gbytes_s"] * 1e9), rel=1e-12)
        assert r["gbytes_s"] == pytest.approx(r["bytes"] / r["time_median_s"] / 1e9, rel=1e-12)


def test_varlen_spec_runs_through_the_runner(tmp_path):
    """The varlen step's spec, shrunk to a CPU kernel: its five mask cases run and name their masks."""
    spec = G.varlen_spec(kernels=("cpu_flash",))
    spec["sweep"].update(seqlen=[1536], heads=4, kv_heads=2, head_dim=16, dtype="float32")
    spec.update(warmup=0, repeats=2)
    st = G.step_harness(tmp_path, [spec], "varlen")
    assert st.status == "ok", st.reason
    recs = [r for r in G.R.read_records(tmp_path / "varlen" / G.R.RESULTS_FILE) if r["status"] == "ok"]
    assert sorted((r["causal"], r["config"]["mask"]) for r in recs) == [
        (False, ""), (False, "docs:magiattention:0"), (True, ""), (True, "docs:magiattention:0"),
        (True, "window:1024:0")]


def test_decode_spec_runs_through_the_runner(tmp_path):
    """The decode step's runner spec, shrunk to this CPU: a one-layer decode step at G 1 records its TPOT."""
    spec = G.decode_spec()
    spec["sweep"].update(seqlen=[512], batch=[1, 2], heads=4, kv_heads=2, head_dim=16, dtype="float32")
    spec.update(warmup=0, repeats=2)
    st = G.step_harness(tmp_path, [spec], "decode_op")
    assert st.status == "ok", st.reason
    recs = [r for r in G.R.read_records(tmp_path / "decode_op" / G.R.RESULTS_FILE) if r["status"] == "ok"]
    assert sorted(r["batch"] for r in recs) == [1, 2] and all(r["mode"] == "decode" for r in recs)
    for r in recs:   # a step of ms: a sample runs steps back to back (timing.autorange), its samples per step
        assert 1 < r["calls_per_sample"] <= MAX_STEPS_PER_SAMPLE, r["calls_per_sample"]
        assert r["tpot_s"] == pytest.approx(r["time_median_s"])
        # bytes and memory over one step: the cache holds the context and one step's token
        assert r["mem_kv_bytes_per_rank"] == [r["mem_kv_formula_bytes"]]


def test_ttft_samples_run_prefills_back_to_back(tmp_path):
    """TTFT through the runner at G 1: a prefill of ms, so a sample runs several into the emptied cache
    (``inference_steps._ttft_step``); the record is one prefill's time, and the cache after it holds the
    prompt once (the rewind between prefills, not a growing cache)."""
    spec = G.decode_spec()
    spec["name"] = "ttft_op"
    spec["measure"]["modes"] = ["ttft"]
    spec["sweep"].update(seqlen=[256], batch=[1], heads=4, kv_heads=2, head_dim=16, dtype="float32")
    spec.pop("exclude")
    spec.update(warmup=0, repeats=2)
    st = G.step_harness(tmp_path, [spec], "ttft_op")
    assert st.status == "ok", st.reason
    (r,) = [r for r in G.R.read_records(tmp_path / "ttft_op" / G.R.RESULTS_FILE) if r["status"] == "ok"]
    assert r["mode"] == "ttft" and 1 < r["calls_per_sample"] <= MAX_STEPS_PER_SAMPLE, r["calls_per_sample"]
    assert r["ttft_s"] == pytest.approx(r["time_median_s"])
    assert r["mem_kv_bytes_per_rank"] == [r["mem_kv_formula_bytes"]] == [2 * 256 * 2 * 16 * 4]

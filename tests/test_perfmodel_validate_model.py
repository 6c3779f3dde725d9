"""The emulated validation of a whole model's training step (``level: model`` records, ``emulated/cases.py``).

A synthetic model-level record of the tiny decoder on 2 emulated nodes x 1 rank, with hand-set kernel
times: the kernel table asks for the MLP's and the LM head's GEMMs at the model's shapes, the step is
predicted by ``model_level.predict_model`` (not as an attention layer), and with every kernel but the
GEMMs free its MLP and head parts are the hand count of GEMMs (fused loss: 3 head GEMMs; MLP: gate/up
and down forward, twice that backward, per layer).
"""
from __future__ import annotations

import pytest

from baselines import AttnShape
from burst_impl.model.config import get_config
from experiments.cluster.report import report
from experiments.perfmodel.emulated import validate
from experiments.perfmodel.emulated.measured import HBM, KernelTimes
from tests._helpers import write_rows
from tests.emulated_records import emulated_record

CFG = get_config("tiny")          # 2 layers, hidden 96, 12 heads x 8, ffn 192, vocab 64
G, N = 2, 64
GEMM = 1e-3                       # s per GEMM call (set by hand)


def _model_record(measured: float = 1.0) -> dict:
    rec = emulated_record(N, "burst", measured)
    s = AttnShape(1, N, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, G, dtype="float32", causal=True, layout="zigzag")
    rec.update({k: getattr(s, k) for k in validate.SHAPE_KEYS})
    rec.update({"mode": "train", "level": "model", "model": CFG.name, "zero": True, "loss": "fused",
                "checkpoint": "whole", "flops": 1e9, "case_id": "burst.model.train"})
    return rec


def _times(recs, gemm: float = GEMM) -> KernelTimes:
    keys = validate.needed_keys(recs)
    return KernelTimes(procs=G, threads=1, seconds={k: (gemm if k[0] == "gemm" else 0.0) for k in keys})


def test_the_table_asks_for_the_mlp_and_head_gemms():
    keys = validate.needed_keys([_model_record()])
    tokens = N // G
    for m, n, k in ((tokens, 2 * CFG.ffn_hidden, CFG.hidden), (tokens, CFG.hidden, CFG.ffn_hidden),
                    (tokens, CFG.vocab_size, CFG.hidden)):
        assert ("gemm", m, n, k, "float32") in keys, (m, n, k)
    assert HBM in keys


def test_a_model_record_is_predicted_as_the_whole_step():
    rec = _model_record()
    (row,) = validate.compare([rec], _times([rec]), rescale=False)
    assert row["kind"] == "model" and row["method"] == "burst+zero"     # Burst and Burst+ZeRO: two rows
    parts = row["parts_s"]
    assert parts["head"] == pytest.approx(3 * GEMM, rel=1e-12)               # fused loss: 3 head GEMMs
    assert parts["mlp"] == pytest.approx(CFG.n_layers * 6 * GEMM, rel=1e-12)   # (2 fwd + 4 bwd) per layer
    assert row["predicted_s"] == pytest.approx(sum(parts.values()), rel=1e-12)
    # twice the GEMM time: the GEMM parts double
    (slow,) = validate.compare([rec], _times([rec], 2 * GEMM), rescale=False)
    assert slow["parts_s"]["head"] == pytest.approx(2 * parts["head"], rel=1e-12)
    assert "whole-model steps" in validate.error_table([row])["text"]


def test_cluster_report_reads_model_records(tmp_path):
    rec = {**_model_record(), "experiment": "t_model", "comm_fwd_bytes": 1000, "comm_bwd_bytes": 2000,
           "cluster": {**_model_record()["cluster"], "calibration": {"per_rank_flops_s": 1e9}}}
    d = tmp_path / "t_model"
    d.mkdir()
    write_rows(d / "results.jsonl", [rec])
    (row,) = report("t_model", results_root=tmp_path)["rows"]
    assert row["t_comp_s"] == pytest.approx(1e9 / G / 1e9) and row["t_comp_from"] == "flops"
    assert row["method"] == "burst+zero"

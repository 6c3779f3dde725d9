"""Inference specs (measure.level: inference; experiments/harness/inference_cases.py): rows, case ids, the
model's shape, the rules as load errors naming the file, the key and the rule; the crossover's reading."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from experiments.harness.spec import EXPERIMENTS_DIR, load_any, load_spec, parse_spec
from experiments.perfmodel.inference_records import crossover

PRESETS = EXPERIMENTS_DIR / "presets"
BASE = {"name": "t_inf", "methods": ["burst", "tp_v1"],
        "sweep": {"seqlen": [64, 128], "world_size": 2, "heads": 4, "kv_heads": 2, "head_dim": 8, "dtype": "float32",
                  "layout": "zigzag"},
        "measure": {"modes": ["decode", "ttft"], "level": "inference"}, "inference": {}, "cluster": "cpu"}


def _spec(**patch):
    raw = {**BASE, **patch}
    return parse_spec(raw, "t.yaml")


def test_rows_and_case_ids():
    cases = _spec().cases()
    decode = [c.case_id for c in cases if c.mode == "decode" and c.seqlen == 64]
    assert decode == ["burst.inference.decode.N64.G2.B1.Z4.kv2.d8.float32.causal.zigzag.all_gather",
                      "burst.inference.decode.N64.G2.B1.Z4.kv2.d8.float32.causal.zigzag.heads",
                      "tp_v1.inference.decode.N64.G2.B1.Z4.kv2.d8.float32.causal.zigzag"]
    ttft = [c for c in cases if c.mode == "ttft"]
    assert [c.merge for c in ttft] == [None, None] * 2          # the prefill does not depend on the merge
    q2 = _spec(inference={"new_tokens": 2, "placement": "shortest", "merges": ["heads"]}).cases()
    assert q2[0].case_id.endswith(".heads.q2.shortest") and q2[0].new_tokens == 2
    # consecutive steps per sample (decode steps, or prefills): not in the case id (the same measurement, steadier)
    assert {c.min_sample_s for c in cases} == {0.2}
    assert _spec(measure={"modes": ["kv_capacity"], "level": "inference"}).cases()[0].min_sample_s == 0.0
    assert _spec(inference={"min_sample_s": 0}).cases()[0].case_id == cases[0].case_id


def test_the_cpu_specs_sample_ten_cfs_periods_as_the_host_probe_does():
    """The emulated CPU specs' samples span ten of the ranks' 100 ms CFS periods, and the host term's probe
    (call_cpu) runs its decode steps as they do."""
    from experiments.harness.call_cpu import MIN_SAMPLE_S
    from experiments.harness.cpuquota import PERIOD_US
    for name in ("cpu_decode_full_2x4", "cpu_decode_emulated_2x4", "cpu_ttft_emulated_2x4"):
        cases = load_spec(EXPERIMENTS_DIR / "cpu" / f"{name}.yaml").cases()
        assert {c.min_sample_s for c in cases} == {MIN_SAMPLE_S} == {10 * PERIOD_US / 1e6}, name


def test_the_model_sets_the_shape_and_the_paper_specs_load():
    s = load_spec("experiments/specs/decode_tpot_llama3_70b_h100_32gpu.yaml")
    assert (s.sweep["heads"], s.sweep["kv_heads"], s.sweep["head_dim"]) == ((64,), (8,), (128,))
    listed = {p: {Path(f).stem for f in yaml.safe_load((PRESETS / f"{p}.yaml").read_text())["specs"]}
              for p in ("paper", "cpu")}
    assert {"ttft_7b_a100_32gpu", "decode_tpot_llama3_8b_h100_32gpu", "kv_capacity_13b_a100_8gpu"} <= listed["paper"]
    assert "cpu_decode_emulated_2x4" in listed["cpu"]
    assert {x.name for x in load_any("cpu_inference").specs} == {"cpu_decode_full_2x4", "cpu_ttft_emulated_2x4",
                                                                  "cpu_kv_capacity"}


@pytest.mark.parametrize("patch,match", [
    ({"inference": None}, "key 'inference': is required at measure.level: inference"),
    ({"measure": {"modes": ["forward"], "level": "op"}}, "key 'inference': is only for measure.level: inference"),
    ({"measure": {"modes": ["decode"], "level": "op"}, "inference": None},
     "key 'measure.modes': mode 'decode' is an inference mode: it needs measure.level: inference"),
    ({"methods": ["ring"]}, "key 'methods': method 'ring' does not serve inference"),
    ({"inference": {"model": "llama3_8b"}}, "key 'sweep.heads': is set by inference.model 'llama3_8b'"),
    ({"inference": {"merges": ["ring"]}}, "key 'inference.merges': 'ring' is not a merge"),
    ({"sweep": {**BASE["sweep"], "heads": 6, "world_size": 4, "kv_heads": 2, "seqlen": 64}},
     "merge 'heads' leaves each rank heads=6 / world_size=4"),
    ({"inference": {"new_tokens": 0}}, "key 'inference.new_tokens': 0 must be >= 1"),
    ({"inference": {"min_sample_s": -1}}, "key 'inference.min_sample_s': -1.0 must be >= 0 (seconds)"),
    ({"measure": {"modes": ["decode"], "level": "inference", "min_sample_s": 1}},
     "key 'measure.min_sample_s': 1.0 applies at levels op and layer; at level 'inference' use inference.min_sample_s"),
])
def test_bad_inference_specs_are_load_errors(patch, match):
    raw = {k: v for k, v in {**BASE, **patch}.items() if v is not None}
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(raw, "t.yaml")


def test_crossover_reads_the_first_context_from_which_cp_stays_faster():
    def rec(n, v, t, b=1):
        return {"mode": "decode", "world_size": 8, "batch": b, "seqlen": n, "variant": v, "tpot_s": t}
    rows = [rec(4096, "tp", 1.0), rec(4096, "cp_all_gather", 2.0), rec(4096, "cp_heads", 1.5),
            rec(65536, "tp", 2.0), rec(65536, "cp_all_gather", 2.5), rec(65536, "cp_heads", 1.9),
            rec(1 << 20, "tp", 8.0), rec(1 << 20, "cp_all_gather", 3.0),
            rec(4096, "tp", 1.0, b=4), rec(4096, "cp_heads", 1.2, b=4)]
    out = {c["batch"]: c for c in crossover(rows)}
    assert out[1]["crossover"] == 65536 and out[1]["points"][-1] == (1 << 20, "cp_all_gather", 3.0 / 8.0)
    assert out[4]["crossover"] is None

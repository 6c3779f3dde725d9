"""The field's mask benchmark in the report (issue 37 items 4-5): MagiAttention's values read off their figures
(experiments/paper/magiattention_cp_h100_readings.yaml) load and combine; the section's fractions, marks and
check from synthetic records; bad readings are refused with the file and the key."""
from __future__ import annotations

import pytest
import yaml

from experiments.report import readings as RD
from experiments.report import varlen_section as V
from experiments.report.paper import PAPER_DIR, load_tables


def test_committed_readings_load_and_are_not_a_paper_table():
    (rd,) = [r for r in RD.load_readings() if r.id == "magiattention_cp_h100"]
    assert rd.world_sizes == (8, 16, 32, 64) and rd.uncertainty > 0
    assert set(rd.values) == set(RD.MASKS) and "magi_attn-native" in rd.methods
    # their ring P2P at 64 GPUs on varlen-causal, forward: about 29 TFLOP/s (the reading)
    assert rd.values["varlen-causal"]["fwd"]["ring_p2p"][3] == pytest.approx(29, abs=2)
    f, b = rd.values["causal"]["fwd"]["ulysses"][0], rd.values["causal"]["bwd"]["ulysses"][0]
    assert rd.fwd_bwd("causal", "ulysses")[0] == pytest.approx(3.5 / (1 / f + 2.5 / b))
    assert rd.suite_method("ring_allgather") == ("allgather_kv", "zigzag") and rd.suite_method("hybrid_dcp") is None
    assert all(not t.path.endswith(RD.READINGS_SUFFIX) for t in load_tables())


def test_bad_readings_are_refused_naming_the_key(tmp_path):
    raw = yaml.safe_load((PAPER_DIR / "magiattention_cp_h100_readings.yaml").read_text())
    raw["values"]["causal"]["fwd"]["ulysses"] = [1.0, 2.0]
    p = tmp_path / "x_readings.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"values\.causal\.fwd\.ulysses.*4 positive numbers"):
        RD.load_readings_file(p)
    del raw["read"]["uncertainty_tflops"]
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="uncertainty_tflops"):
        RD.load_readings_file(p)


def _rec(method, layout, g, causal, mask, t, status="ok", t_mean=None):
    return {"method": method, "layout": layout, "world_size": g, "causal": causal, "mask": mask, "status": status,
            "time_median_s": t, "time_mean_rank_s": t_mean or t, "flops": 1e12 * g}


def test_fractions_marks_and_the_check():
    docs = "docs:magiattention:0"
    recs = [_rec("burst", "balanced", 64, True, "", 1.0), _rec("burst", "balanced", 64, True, docs, 0.2),
            _rec("ring", "zigzag", 64, True, "", 1.0), _rec("ring", "zigzag", 64, True, docs, None, status="oom"),
            _rec("ulysses", "contiguous", 64, True, "", 1.0, t_mean=0.5), _rec("ulysses", "contiguous", 64, True,
                                                                                docs, 0.25, t_mean=0.25),
            {**_rec("burst_nolao", "balanced", 64, True, "", 1.0), "variant_of": "burst"}]
    rows = V._rows(recs)
    assert ("burst_nolao", "balanced") not in rows
    by = rows[("burst", "balanced")]
    # 1 TFLOP/s per GPU on causal; the varlen pack's FLOPs in this toy are the same, so 5x the rate
    assert V.fraction_cell(by[(64, "causal")], by[(64, "varlen-causal")]) == "1 → 5 (5.00)"
    ring = rows[("ring", "zigzag")]
    assert V.fraction_cell(ring[(64, "causal")], ring[(64, "varlen-causal")]) == "E"
    assert V.fraction_cell(None, by[(64, "varlen-causal")]) == "—"
    uly = rows[("ulysses", "contiguous")]
    assert V.fraction(uly[(64, "causal")], uly[(64, "varlen-causal")], "mean") == pytest.approx(2.0)
    assert "keeps 5.00" in V._check(recs).pieces[0] and "met." in V._check(recs).pieces[0]
    assert V.field_mask({"causal": False, "mask": docs}) == "varlen-full"

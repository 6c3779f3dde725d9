"""The report's "Inference beyond the papers" section (experiments/report/inference_section.py), built from
synthetic records: modelled TPOT with its crossover, TTFT, KV capacity, measured decode with the model's
prediction and error from inference_validation.json, the measured crossover. No results folder."""
from __future__ import annotations

import json

from experiments.report.doc import Heading, Para, Table
from experiments.report.evidence import Experiment, Root
from experiments.report.inference_section import inference_section
from experiments.report.render_md import render_md
from experiments.report.doc import Doc


def _rec(mode, variant, n, t, *, g=8, b=1, status="ok", cap=None, ci=None):
    key = {"decode": "tpot_s", "ttft": "ttft_s"}.get(mode)
    r = {"mode": mode, "variant": variant, "seqlen": n, "world_size": g, "batch": b, "status": status,
         "hardware_profile": "h100_sxm_ib_4x8", "model_config": "llama3_8b", "mem_kv_capacity_tokens": cap,
         "time_median_s": t, "time_ci_lo_s": ci and ci[0], "time_ci_hi_s": ci and ci[1]}
    if key:
        r[key] = t if status == "ok" else None
    return r


class _Ctx:
    def __init__(self, modelled, measured):
        self._m, self._x = modelled, measured

    def modelled(self, patterns):
        return [e for e in self._m if any(e.name.startswith(p.split("*")[0]) for p in patterns)]

    def measured(self, patterns):
        return [e for e in self._x if any(e.name.startswith(p.split("*")[0]) for p in patterns)]

    def href(self, path):
        return str(path)


def test_section_from_synthetic_records(tmp_path):
    mod, meas = Root(tmp_path / "modelled", "modelled"), Root(tmp_path / "ref", "reference")
    decode = [_rec("decode", v, n, t) for n, ts in ((4096, (2e-3, 3e-3, 1e-3)), (1 << 20, (4e-3, 5e-3, 9e-3)))
              for v, t in zip(("cp_all_gather", "cp_heads", "tp"), ts)]
    decode.append(_rec("decode", "tp", 1 << 20, None, b=32, status="oom"))
    ttft = [_rec("ttft", v, 4096, t) for v, t in (("cp_all_gather", 0.2), ("tp", 0.3))]
    cap = [_rec("kv_capacity", v, 65536, None, cap=c) for v, c in (("cp_all_gather", 4_000_000), ("tp", 5_000_000))]
    exps = [Experiment(mod, "decode_tpot_llama3_8b_h100_32gpu_model_level", tuple(decode)),
            Experiment(mod, "ttft_llama3_8b_h100_32gpu_model_level", tuple(ttft)),
            Experiment(mod, "kv_capacity_llama3_8b_h100_32gpu_model_level", tuple(cap))]
    measured = Experiment(meas, "cpu_decode_emulated_2x4", tuple(
        _rec("decode", v, n, t, ci=(0.9 * t, 1.1 * t)) for n, ts in ((4096, (0.05, 0.08, 0.04)),
                                                                   (131072, (0.07, 0.1, 0.09)))
        for v, t in zip(("cp_all_gather", "cp_heads", "tp"), ts)))
    measured.path.mkdir(parents=True)
    (measured.path / "inference_validation.json").write_text(json.dumps({
        "met": False, "worst_abs_error": 0.5,
        "rows": [{"mode": "decode", "world_size": 8, "batch": 1, "seqlen": 4096, "row": "tp", "predicted_s": 0.06,
                  "error": 0.5}]}))
    blocks = inference_section(_Ctx(exps, [measured]))
    assert isinstance(blocks[0], Heading) and blocks[0].anchor == "inference"
    tables = [b for b in blocks if isinstance(b, Table)]
    tpot = tables[0]
    assert tpot.header == ("G", "B", "4K", "1M", "CP faster from")
    assert tpot.rows[0] == ("8", "1", "CP 2 / TP 1", "CP 4 / TP 9", "1M")
    assert tpot.rows[1][3] == "CP - / TP OOM"
    assert tables[2].rows[0][2:] == ("4,000,000", "-", "5,000,000")           # KV capacity per row
    meas_rows = {r[3]: r for r in tables[3].rows if r[2] == "4K"}
    assert meas_rows["TP decode (Megatron)"][4:] == ("40 [36, 44]", "60", "+50%")
    text = " ".join(p for b in blocks if isinstance(b, Para) for p in b.pieces if isinstance(p, str))
    assert "Measured crossover (CP faster from): G=8 B=1: 128K" in text
    assert tables[-1].rows == (("cpu_decode_emulated_2x4", "50%", "NOT met", "1"),)
    assert "Inference beyond the papers" in render_md(Doc("t", blocks))


def test_section_without_records_says_so():
    text = render_md(Doc("t", inference_section(_Ctx([], []))))
    assert text.count("No modelled records") == 3 and "No measured inference records" in text

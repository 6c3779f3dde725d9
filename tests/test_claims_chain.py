"""The claims table's verdict chain, built from synthetic schema-3 records in a temporary results tree:
(a) the model against the emulated cluster, (b) modelled at the paper's size, (c) measured on an emulated
cluster of the paper's shape, (d) measured at CPU scale, and the headline, (b) qualified by (a).

Each test checks one rule of experiments/paper/verdict_rules.yaml and claims.yaml's regimes: a measurement
outside its claim's regime never contradicts it, one inside keeps its verdict, the headline is the modelled
verdict qualified by the model's validation, and a claim without an emulated check says so."""
from __future__ import annotations

import html
import shutil
from pathlib import Path

import pytest
import yaml

from experiments.harness import record
from experiments.harness.record import Record
from experiments.perfmodel.emulated.validate import TARGET, error_table
from experiments.report.build import write
from experiments.report.claims import load_claims, load_rules
from experiments.report.claims_section import chains
from experiments.report.context import load_context
from experiments.report.paper import PAPER_DIR, load_tables
from experiments.report.validation import model_rows

RULES = load_rules()
SPOKEN = {"min_tokens": 32768, "min_ranks": 8, "hardware": "gpu", "source": "synthetic"}


def _claim(cid: str, **kw) -> dict:
    """A speedup claim of BurstAttention over TP-V3 on synthetic experiments named after ``cid``."""
    c = {"id": cid, "paper": "BurstAttention", "claim": f"{cid}: BurstAttention is faster than TP-V3",
         "kind": "speedup", "method": "BurstAttention", "against": ["TP-V3 + FlashAttention"],
         "measured": [f"{cid}_cpu", f"{cid}_gpu"], "modelled": [f"{cid}_model"], "regime": SPOKEN,
         "emulated": {"nodes": 2, "ranks_per_node": 4, "experiments": [f"{cid}_emu"]},
         "validation": [f"{cid}_emu"]}
    c.update(kw)
    return {k: v for k, v in c.items() if v is not None}     # None: the key left out


def _paper(tmp: Path, claims: list[dict]) -> Path:
    d = tmp / "paper"
    shutil.copytree(PAPER_DIR, d)
    (d / "claims.yaml").write_text(yaml.safe_dump(claims, sort_keys=False))
    return d


def _record(exp: str, method: str, t: float, *, seqlen: int, world: int, modelled=False, gpu=False,
            cluster: dict | None = None) -> Record:
    rec = Record(status="ok")
    cfg = {"seqlen": seqlen, "world_size": world, "batch": 1, "heads": 8, "head_dim": 32, "dtype": "float32",
           "mask": "causal", "mode": "fwd_bwd"}
    rec.update(experiment=exp, case_id=f"{method}.N{seqlen}.G{world}", method=method, level="op",
               mode="fwd_bwd", kernel="auto", config=cfg, timestamp="2026-01-01T00:00:00", git={"commit": "x"},
               versions={}, machine="box", time_median_s=t,
               hardware={"gpu_count": world, "gpu_name": "A100"} if gpu else {"summary": "cpu"})
    if modelled:
        rec.update(source="modelled", hardware_profile="a100_pcie_8")
    else:
        # 7 samples spread +-2% around the median: enough for an interval (harness.speedup)
        rec.update(time_samples_s=[t * (0.98 + 0.04 * i / 6) for i in range(7)])
    if cluster:
        rec["cluster"] = cluster
    return rec


def _experiment(root: Path, exp: str, burst: float, tp: float, **kw) -> Path:
    for method, t in (("burst", burst), ("tp_v3", tp)):
        record.write(root / exp / "results.jsonl", _record(exp, method, t, **kw))
    return root / exp


def _emulated(root: Path, exp: str, burst: float, tp: float, *, errors: dict[str, float], shape=(2, 4)):
    """An emulated run of ``shape`` and its emulation report, whose model table is written by the
    emulator check's own ``error_table`` from the given errors (predicted / measured - 1)."""
    cl = {"scheduler": "emulated", "emulated": True, "nodes": shape[0], "ranks_per_node": shape[1],
          "profile": "synthetic_emu"}
    out = _experiment(root, exp, burst, tp, seqlen=4096, world=shape[0] * shape[1], cluster=cl)
    rows = [{"seqlen": 4096, "method": m, "world_size": 8, "case": "", "measured_s": 1.0, "predicted_s": 1 + e,
             "ratio": 1 + e, "error": e, "load_scale": 1.0, "critical_comm_s": 0.1} for m, e in errors.items()]
    # a smaller N with a large error: (a) reads the largest emulated size only
    rows += [{**r, "seqlen": 1024, "error": 0.9, "ratio": 1.9, "predicted_s": 1.9} for r in rows]
    (out / "emulation_report.txt").write_text(f"{exp}: emulated {shape[0]}x{shape[1]} synthetic (intra 1 MB/s)\n"
                                             + error_table(rows)["text"] + "\n")


def _tree(tmp: Path):
    """The results tree of every test: a reference root (this machine's measurements) and a modelled root."""
    base = tmp / "results"
    return base, base / "reference" / "box", base / "modelled"


def _chains(tmp: Path, claims: list[dict]):
    base, _, _ = _tree(tmp)
    ctx = load_context(base, machine="box", page_dir=tmp / "reports", paper_dir=_paper(tmp, claims))
    return {ch.claim.id: ch for ch in chains(ctx)}, ctx


def test_a_measurement_outside_the_regime_only_shows_a_direction(tmp_path):
    """The 1.37x-at-128K case: a CPU run at 1K tokens on 4 ranks where the claimed method is slower."""
    base, ref, mod = _tree(tmp_path)
    _experiment(ref, "c1_cpu", 2.0, 1.0, seqlen=1024, world=4)
    _experiment(mod, "c1_model", 1.0, 1.5, seqlen=32768, world=8, modelled=True)
    ch, ctx = _chains(tmp_path, [_claim("c1")])
    d = ch["c1"].cpu
    assert d.startswith(RULES.out_of_regime) and "the opposite direction" in d and "c1_cpu" in d, d
    assert "contradicted" not in d and "contradicted" not in ch["c1"].headline, ch["c1"]
    page = write(ctx)[0].read_text()
    assert 'class="v-contradicted"' not in page and 'class="v-direction"' in page


def test_a_measurement_inside_the_regime_keeps_its_verdict(tmp_path):
    base, ref, mod = _tree(tmp_path)
    _experiment(ref, "c2_gpu", 2.0, 1.0, seqlen=32768, world=8, gpu=True)
    _experiment(ref, "c2_cpu", 1.0, 2.0, seqlen=1024, world=4)
    _experiment(mod, "c2_model", 1.0, 1.5, seqlen=32768, world=8, modelled=True)
    ch, _ = _chains(tmp_path, [_claim("c2")])
    d, head = ch["c2"].cpu, ch["c2"].headline
    inside, outside = d.split(" | ")
    assert inside.startswith("contradicted") and "c2_gpu" in inside and "c2_cpu" not in inside, d
    assert outside.startswith(RULES.out_of_regime) and "the claim's direction" in outside, d
    assert head.startswith("reproduced in direction (modelled") and "measured in the claim's regime: " \
        "contradicted" in head, head


@pytest.mark.parametrize("errors, qualifier", [
    ({"burst": 0.05, "tp_v3": -0.08}, RULES.validated),
    ({"burst": 0.05, "tp_v3": -(TARGET + 0.1)}, RULES.not_trusted),
    ({"burst": 0.05}, RULES.not_validated),                    # tp_v3 is in no emulated run
])
def test_the_headline_is_the_modelled_verdict_qualified_by_the_validation(tmp_path, errors, qualifier):
    base, ref, mod = _tree(tmp_path)
    _emulated(ref, "c3_emu", 1.0, 1.2, errors=errors)
    _experiment(mod, "c3_model", 1.5, 1.0, seqlen=32768, world=8, modelled=True)
    ch, _ = _chains(tmp_path, [_claim("c3")])
    head, a = ch["c3"].headline, ch["c3"].validation
    assert head.startswith("contradicted (modelled at the paper's size); " + qualifier), head
    assert "N=4096" in a and "c3_emu" in a and f"{TARGET:.0%}" in a, a
    worst = max(abs(e) for e in errors.values())
    assert f"{worst:.0%}" in head or qualifier == RULES.not_validated, head
    if "tp_v3" not in errors:
        assert "no emulated run has tp_v3" in head and "in no emulated run: tp_v3" in a


@pytest.mark.parametrize("modelled_ratio, inside", [(1.05, True), (1.5, False)])
def test_a_modelled_margin_inside_the_models_error_is_said(tmp_path, modelled_ratio, inside):
    base, ref, mod = _tree(tmp_path)
    _emulated(ref, "m1_emu", 1.0, 1.2, errors={"burst": 0.02, "tp_v3": -0.08})
    _experiment(mod, "m1_model", 1.0, modelled_ratio, seqlen=32768, world=8, modelled=True)
    head = _chains(tmp_path, [_claim("m1")])[0]["m1"].headline
    assert head.startswith("reproduced in direction (modelled at the paper's size); " + RULES.validated), head
    assert (RULES.inside_error in head) == inside, head
    if inside:
        assert "smallest modelled margin 5% < worst |error| 8%" in head, head


def test_no_validation_and_no_model_are_said(tmp_path):
    base, ref, mod = _tree(tmp_path)
    _experiment(ref, "c4_cpu", 1.0, 2.0, seqlen=1024, world=4)
    ch, _ = _chains(tmp_path, [_claim("c4"), _claim("c5", modelled=None, regime={"source": "any size"},
                                                    measured=["c4_cpu"], validation=None,
                                                    validation_why_not="no model")])
    assert ch["c4"].validation.startswith(f"{RULES.not_validated}: no emulation report of c4_emu")
    assert ch["c4"].headline.startswith("not modelled at the paper's size"), ch["c4"].headline
    # a claim the model cannot speak to, in a regime any size is: the measurement is its headline
    assert ch["c5"].headline.startswith("reproduced in direction, measured in the claim's regime"), ch["c5"].headline


def test_the_emulated_column_needs_the_papers_shape(tmp_path):
    base, ref, mod = _tree(tmp_path)
    _emulated(ref, "c6_emu", 1.0, 1.3, errors={"burst": 0.0}, shape=(2, 2))
    _emulated(ref, "c7_emu", 1.0, 1.3, errors={"burst": 0.0})
    ch, _ = _chains(tmp_path, [_claim("c6"), _claim("c7"),
                               _claim("c8", emulated={"nodes": 1, "ranks_per_node": 8, "why_not": "no PCIe"})])
    assert ch["c6"].emulated.startswith("no run on an emulated 2x4 cluster (found: c6_emu (2x2 emulated))")
    # at the paper's shape but 4K tokens on CPU ranks: outside the regime, so a direction only
    assert ch["c7"].emulated.startswith(RULES.out_of_regime) and "the claim's direction" in ch["c7"].emulated
    assert ch["c8"].emulated == "no emulated 1x8 run: no PCIe"


def test_the_page_shows_the_chain_for_every_claim(tmp_path):
    base, ref, mod = _tree(tmp_path)
    _experiment(ref, "c9_cpu", 1.0, 2.0, seqlen=1024, world=4)
    base.joinpath("modelled").mkdir(parents=True, exist_ok=True)
    _, ctx = _chains(tmp_path, [_claim("c9")])
    html_path, md_path = write(ctx)
    md = md_path.read_text()
    row = next(line for line in md.splitlines() if line.startswith("| c9 |"))
    assert row.count(" | ") == 8 and "[regime: >= 32K tokens, >= 8 ranks, on GPUs]" in row, row
    for h in ("headline: (b) qualified by (a)", "(a) model vs emulated cluster", "(b) at the paper's size",
              "(c) emulated cluster of the paper's shape", "(d) measured here (CPU scale)"):
        assert h in md and html.escape(h) in html_path.read_text()


def test_the_committed_claims_carry_a_regime_and_the_chains_data():
    claims = load_claims({t.id for t in load_tables()})
    by_id = {c.id: c for c in claims}
    big = by_id["speedup_128k_32gpu"].regime
    assert (big.min_tokens, big.min_ranks, big.min_nodes, big.hardware) == (131072, 32, 4, "gpu")
    for c in claims:
        assert c.emulated is not None and (c.emulated.experiments or c.emulated.why_not)
        assert c.validation or c.validation_why_not


@pytest.mark.parametrize("edit, words", [
    ({"regime": {"hardware": "tpu"}}, ["claims.yaml", "[0].regime.hardware", "unknown hardware 'tpu'"]),
    ({"regime": {"min_tokens": -1}}, ["[0].regime.min_tokens", "must be >= 0"]),
    ({"emulated": None}, ["[0].emulated", "every claim names its paper's cluster"]),
    ({"emulated": {"nodes": 2, "ranks_per_node": 4}}, ["[0].emulated.why_not", "say why none can be run"]),
    ({"validation": None}, ["[0].validation_why_not", "say why the model is not validated"]),
])
def test_bad_chain_data_is_a_value_error_naming_file_key_and_rule(tmp_path, edit, words):
    d = _paper(tmp_path, [_claim("bad", **edit)])
    with pytest.raises(ValueError) as e:
        load_claims({t.id for t in load_tables(d)}, d)
    for w in words:
        assert w in str(e.value)


def test_bad_rules_are_a_value_error(tmp_path):
    d = _paper(tmp_path, [_claim("x")])
    f = d / "verdict_rules.yaml"
    f.write_text(f.read_text().replace("without_model: measured in regime", "without_model: always"))
    with pytest.raises(ValueError, match="verdict_rules.yaml: key 'without_model': unknown rule 'always'"):
        load_rules(d)


def test_the_model_rows_are_read_as_the_emulator_check_writes_them():
    rows = [{"seqlen": n, "method": m, "world_size": 8, "case": c, "measured_s": 2.0, "predicted_s": 2.0 * (1 + e),
             "ratio": 1 + e, "error": e, "load_scale": 1.0, "critical_comm_s": 0.5}
            for n, m, e, c in ((2048, "burst", -0.031, "zigzag"), (8192, "burst_double_ring", 0.284, "balanced"))]
    text = "first line\nother table\n" + error_table(rows)["text"] + "\noverlap excess ..."
    assert [(n, m, round(e, 3)) for n, m, e in model_rows(text)] == [(2048, "burst", -0.031),
                                                                     (8192, "burst_double_ring", 0.284)]

"""The report's paper-vs-model figures (experiments/report/figures.py), drawn from synthetic tables into a tmp
dir: settings are groups of bars in the table's order (no line joins two settings), the legend has one entry
per paper row, rows of one method differ by hatch, and an OOM is an empty bar marked "OOM"."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from experiments.figstyle import color
from experiments.report.figures import paper_figure
from experiments.report.model_error import Cell
from experiments.report.paper import OOM, Column, MethodMap, PaperTable, Row, values

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"BurstAttention": MethodMap("burst"), "BurstAttention with ZeRO": MethodMap("burst", {"zero": True}),
           "BurstAttention without LAO": MethodMap("burst_nolao"), "TP-V3": MethodMap("tp_v3")}
SETTINGS = (Column("7B, 32 GPUs, 2M tokens", {"model": "llama2_7b", "world_size": 32, "seqlen": 2 ** 21}),
            Column("14B, 32 GPUs, 1M tokens", {"model": "burstengine_14b", "world_size": 32, "seqlen": 2 ** 20}))
ROWS = (Row("TP-V3", "TP-V3", (70.0, OOM)), Row("Burst without LAO", "BurstAttention without LAO", (90.0, 95.0)),
        Row("Burst", "BurstAttention", (100.0, 118.0)), Row("Burst + ZeRO", "BurstAttention with ZeRO", (99.0, None)))
# the model's values per row and setting: None not modelled, "oom" out of memory
MODELLED = ((60.0, 50.0), (80.0, 85.0), ("oom", 110.0), (95.0, 97.0))


def _table() -> PaperTable:
    return PaperTable(id="synthetic", paper="BurstEngine", source="synthetic", title="tokens/s per GPU",
                      quantity="tokens_per_s_per_gpu", columns=SETTINGS, rows=ROWS, transposed=True)


def _cells(t: PaperTable) -> list[Cell]:
    ours = [v for row in MODELLED for v in row]
    return [Cell(pv, None if m is None else {"status": "oom" if m == "oom" else "ok"},
                 m if isinstance(m, float) else None) for pv, m in zip(values(t, METHODS), ours)]


@pytest.fixture
def fig(tmp_path, monkeypatch):
    kept = []
    monkeypatch.setattr(plt, "close", lambda f=None: kept.append(f))
    out = paper_figure(_table(), _cells(_table()), tmp_path / "synthetic.png", "paper: synthetic")
    assert out.exists() and out.stat().st_size > 5_000
    yield kept[0]
    plt.figure(kept[0].number)
    monkeypatch.undo()
    plt.close(kept[0])


def _bars(ax) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill() and p.get_height() > 0]


def test_settings_are_groups_of_bars_in_the_tables_order(fig):
    ax = fig.axes[0]
    assert [t.get_text().replace("\n", " ") for t in ax.get_xticklabels()] == [c.label for c in SETTINGS]
    joined = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 1]
    assert not joined, "a line joins two settings"
    # one bar per number: the paper's OOM and missing value, and the model's OOM, draw none
    paper = sum(isinstance(v, float) for r in ROWS for v in r.values)
    model = sum(isinstance(v, float) for r in MODELLED for v in r)
    assert len(_bars(ax)) == paper + model
    for b in _bars(ax):     # each bar in its setting's group
        assert -0.5 < b.get_x() and b.get_x() + b.get_width() < len(SETTINGS) - 0.5


def test_one_legend_entry_per_paper_row_coloured_by_method_hatched_within_a_method(fig):
    legend = fig.axes[-1].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[:len(ROWS)] == [r.label for r in ROWS]
    assert all(lab not in labels[len(ROWS):] for lab in labels[:len(ROWS)])
    assert len(labels) - len(ROWS) == 3, labels      # what solid, light and empty bars mean
    handles = legend.legend_handles[:len(ROWS)]
    colours = [tuple(h.get_facecolor()[:3]) for h in handles]
    assert colours[0] == pytest.approx(color("tp_v3")) and colours[2] == pytest.approx(color("burst"))
    assert colours[2] == pytest.approx(colours[3])               # Burst and Burst + ZeRO: one method
    burst = [h.get_hatch() or "" for h in handles[1:]]           # the family burst: three rows, three hatches
    assert len(set(burst)) == 3 and burst[1] == "", burst        # the method itself plain


def test_an_oom_is_an_empty_bar_marked_oom(fig):
    ax = fig.axes[0]
    empty = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    marks = [t for t in ax.texts if t.get_text() == "OOM"]
    # the paper's TP-V3 at 14B and the model's Burst at 7B
    assert len(empty) == 2 == len(marks)
    assert {round(p.get_x() + p.get_width() / 2, 6) for p in empty} == {round(t.get_position()[0], 6) for t in marks}
    assert [t.get_text() for t in ax.texts if t.get_text() not in ("OOM",)] == ["—"]   # Burst + ZeRO, 14B
    assert not [ln for ln in ax.get_lines() if isinstance(ln, Line2D) and ln.get_marker() == "v"]


@pytest.fixture
def model_figures(tmp_path, monkeypatch):
    """The model-level figures of two committed modelled experiments, drawn into a tmp dir and kept open."""
    from experiments.plots import draw_experiment

    kept = []
    monkeypatch.setattr(plt, "close", lambda f=None: kept.append(f))
    for exp in ("model_burstengine_main_7b", "model_burstengine_ablation_14b_1m"):
        draw_experiment(ROOT / "results" / "modelled", tmp_path, exp)
    yield kept
    monkeypatch.undo()
    for f in kept:
        plt.close(f)


def test_model_level_rows_of_one_method_differ_by_marker_and_hatch(model_figures):
    lines = next(f for f in model_figures if "throughput per rank" in f.axes[0].get_title())
    ax = lines.axes[0]
    # each row drawn with its p10/p90 bars: the container holds the data line
    by_label = {c.get_label(): c.lines[0] for c in ax.containers}
    # Burst-USP and LoongTrain-USP are two methods (burst_usp, loongtrain_usp): two colours; rows of one
    # method (the ablation's double-ring steps, below) share a colour and differ by hatch
    usp = [by_label[k] for k in by_label if "USP" in k]
    assert len(usp) == 2 and usp[0].get_color() != usp[1].get_color(), sorted(by_label)
    # 2M ran on 32 ranks, 4M on 64: the ticks say so, the line joins two settings that differ in G too
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2M\nG=32", "4M\nG=64"]
    bars = next(f for f in model_figures if f._suptitle is not None and "throughput and memory" in
                f._suptitle.get_text())
    patches = bars.axes[0].patches
    same = [p for p in patches if p.get_facecolor() == patches[-1].get_facecolor()]   # the double ring's steps
    assert len(same) >= 4 and len({p.get_hatch() or "" for p in same}) == len(same)

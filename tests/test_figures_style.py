"""Every kind of figure the suite draws, drawn from the committed results, reads well: one footer line
with the provenance (relative, never an absolute path) below everything else, legends outside the axes,
tick labels that do not overlap (from the artists' extents), short titles, one colour per method."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from baselines.registry import METHODS
from experiments.figstyle import FOOTER_GID, color, style

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "results" / "reference" / "cpu2-amd-epyc"
MODELLED = ROOT / "results" / "modelled"
# one experiment per drawing function: lines and bars (attention level), masks, model level, model summary
# bars (one sequence length), batch, and the emulated-vs-modelled bars of experiments.cluster.report
CASES = [(REF, "cpu_fig2_train"), (REF, "cpu_sparse_masks"), (REF, "cpu_model_fig2_train"),
         (REF, "cpu_fig4b_batch"), (MODELLED, "model_burstengine_ablation_14b_1m"),
         (REF.parent / "cpu2-amd-epyc+a800_ib_emu_2x4", "cpu_decode_emulated_2x4")]     # inference records


def test_every_method_has_its_own_colour_and_style():
    missing = sorted(n for n, m in METHODS.items() if m.colour is None or m.marker is None)
    assert not missing, f"give {missing} a colour and marker of their own (Method.colour, Method.marker)"
    assert len({color(m) for m in METHODS}) == len(METHODS)
    assert len({(style(m)["color"], style(m)["marker"], style(m)["linestyle"]) for m in METHODS}) == len(METHODS)


def _paper_figures(out: Path) -> None:
    """The report's paper-vs-model figures: lines over sequence length (Table 2), cumulative bars (ablation)."""
    from experiments.report.context import load_context
    from experiments.report.figures import paper_figure
    from experiments.report.model_error import cells

    ctx = load_context(page_dir=out)
    for tid in ("table2", "burstengine_ablation"):
        t = ctx.tables[tid]
        paper_figure(t, cells(t, ctx.methods, ctx.modelled(t.modelled)), out / f"{tid}.png", f"paper: {t.path_rel}")


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """The figures drawn, kept open: save_figure closes them, so close is intercepted while drawing."""
    from experiments.cluster.report import figure as emulated_figure, report
    from experiments.plots import draw_experiment

    from matplotlib.figure import Figure

    out, kept, saved = tmp_path_factory.mktemp("plots"), [], set()
    real_close, real_save = plt.close, Figure.savefig
    plt.close = lambda fig=None: kept.append(fig) if fig is not None else real_close()
    limit = plt.rcParams["figure.max_open_warning"]
    plt.rcParams["figure.max_open_warning"] = 0       # kept open on purpose, to be read below
    # a figure abandoned before saving (nothing to draw) is no figure of the suite's
    Figure.savefig = lambda self, *a, **k: (saved.add(id(self)), real_save(self, *a, **k))[1]
    try:
        for root, exp in CASES:
            draw_experiment(root, out / root.name, exp)
        emulated_figure(report("cpu_train_emulated", results_root=REF), out / "emulated_vs_modelled.png")
        _paper_figures(out)
    finally:
        plt.close, Figure.savefig = real_close, real_save
        plt.rcParams["figure.max_open_warning"] = limit
    yield [f for f in kept if id(f) in saved]
    for f in kept:
        real_close(f)


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 - 0.5 and b.x0 < a.x1 - 0.5 and a.y0 < b.y1 - 0.5 and b.y0 < a.y1 - 0.5


def test_every_figure_has_one_footer_line_below_everything(figures):
    assert len(figures) >= 12
    for fig in figures:
        feet = [t for t in fig.texts if t.get_gid() == FOOTER_GID]
        assert len(feet) == 1, [t.get_text() for t in fig.texts]
        text = feet[0].get_text()
        assert "\n" not in text and str(ROOT) not in text and "/tmp" not in text, text
        r = fig.canvas.get_renderer()
        top = feet[0].get_window_extent(r).y1
        assert all(top <= ax.get_tightbbox(r).y0 + 1 for ax in fig.axes), text


def test_tick_labels_never_overlap_and_legends_are_outside(figures):
    for fig in figures:
        r = fig.canvas.get_renderer()
        name = fig.texts[-1].get_text() if fig.texts else "?"
        for ax in fig.axes:
            for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
                boxes = [t.get_window_extent(r) for t in labels if t.get_visible() and t.get_text()]
                clash = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _boxes_overlap(a, b)]
                assert not clash, f"{name}: overlapping tick labels {[t.get_text() for t in labels]}"
            inside = ax.get_window_extent(r)
            for leg in [c for c in ax.get_children() if isinstance(c, plt.matplotlib.legend.Legend)]:
                assert not _boxes_overlap(leg.get_window_extent(r), inside), f"{name}: a legend over the data"


def test_titles_are_short(figures):
    for fig in figures:
        titles = [fig._suptitle.get_text()] if fig._suptitle else []
        titles += [ax.get_title() for ax in fig.axes]
        assert all(t.count("\n") <= 2 for t in titles), titles

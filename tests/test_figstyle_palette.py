"""The palette has room (>= 30 colours, 40 now), a fixed colour per method whatever else a figure holds, and
every registered method and model-only variant a colour of its own, far enough from every other to tell apart."""
from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import numpy as np

from baselines.registry import METHODS
from experiments.figstyle import PALETTE, color, style
from experiments.model_only import MODEL_ONLY

# CIE76 distance of tab20's two closest colours: the palette's added colours may come no closer than that
MIN_DISTANCE = 16.6


def _lab(rgb) -> np.ndarray:
    """sRGB (0..1) -> CIELAB (D65)."""
    c = np.asarray(rgb, float)
    c = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    xyz = c @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]).T
    xyz = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_the_palette_has_room_and_every_colour_is_distinguishable():
    assert len(PALETTE) >= 30 and len(set(PALETTE)) == len(PALETTE)
    used = {m.colour for m in [*METHODS.values(), *MODEL_ONLY.values()]}
    assert max(used) < len(PALETTE) and len(PALETTE) - len(used) >= 10, "room for ten more methods at least"
    closest = min((float(np.linalg.norm(_lab(a) - _lab(b))), i, j)
                  for (i, a), (j, b) in itertools.combinations(enumerate(PALETTE), 2))
    assert closest[0] >= MIN_DISTANCE, f"palette colours {closest[1]} and {closest[2]} are too close: {closest[0]:.1f}"


def test_the_existing_methods_keep_their_tab20_colours():
    assert PALETTE[:20] == tuple(plt.get_cmap("tab20").colors)
    for name, m in [*METHODS.items(), *MODEL_ONLY.items()]:
        assert color(name) == PALETTE[m.colour]


def test_every_method_and_model_only_variant_has_a_distinct_colour():
    names = [*METHODS, *MODEL_ONLY]
    assert not set(METHODS) & set(MODEL_ONLY), "a model-only variant must not shadow a registry method"
    assert all(m.colour is not None and m.marker for m in MODEL_ONLY.values())
    colours = {n: color(n) for n in names}
    twins = [(a, b) for a, b in itertools.combinations(names, 2) if colours[a] == colours[b]]
    assert not twins, f"methods sharing a colour: {twins}"


def test_a_methods_colour_is_its_own_in_any_figure():
    """Colour and style depend on the name only: the same in a figure of two methods as in one of all."""
    every = {n: style(n) for n in [*METHODS, *MODEL_ONLY]}
    assert {n: style(n) for n in ("burst", "tp_v3_noflash")} == {n: every[n] for n in ("burst", "tp_v3_noflash")}
    assert style("tp_v3_noflash")["linestyle"] == "--" and style("tp_v3")["linestyle"] == "-"
    assert color("a_name_with_no_colour") == color("a_name_with_no_colour") in PALETTE[:20]

"""Published values read off a figure (``experiments/paper/*_readings.yaml``): a benchmark's TFLOP/s per GPU per
mask, pass (forward, backward) and method at a list of world sizes, with the source, the setup, how the values
were read and their uncertainty. Not a paper table (``paper.py`` skips these files): its methods are the
benchmark's, mapped to this suite's closest method where there is one (``methods.<name>.suite``).

Checked on load (a ValueError naming the file, the key and the rule): the masks and passes known, one positive
number per world size, every method of the values declared under ``methods``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..harness.env import REPO
from ..harness.schema import FileErr
from .paper import PAPER_DIR, READINGS_SUFFIX, _read_yaml

MASKS = ("full", "causal", "varlen-full", "varlen-causal")
PASSES = ("fwd", "bwd")
# forward + backward from the two passes under the FLOP convention both use (backward = 2.5 x forward):
# time = F / fwd + 2.5 F / bwd, so TFLOP/s = 3.5 / (1 / fwd + 2.5 / bwd)
BWD_FACTOR = 2.5


@dataclass(frozen=True)
class Readings:
    id: str
    path: str
    source: dict
    setup: dict
    read: dict
    world_sizes: tuple[int, ...]
    methods: dict                      # their name -> {suite: method or None, layout, note}
    values: dict                       # mask -> pass -> method -> tuple of TFLOP/s per world size

    @property
    def path_rel(self) -> str:
        p = Path(self.path).resolve()
        return p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else p.name

    @property
    def uncertainty(self) -> float:
        return float(self.read.get("uncertainty_tflops", 0.0))

    def fwd_bwd(self, mask: str, method: str) -> tuple[float, ...]:
        """Forward + backward TFLOP/s per world size, combined from the two passes' values."""
        f, b = self.values[mask]["fwd"][method], self.values[mask]["bwd"][method]
        return tuple((1 + BWD_FACTOR) / (1 / x + BWD_FACTOR / y) for x, y in zip(f, b))

    def fraction(self, method: str, what: str = "fwd_bwd", num: str = "varlen-causal",
                 den: str = "causal") -> tuple[float, ...]:
        """``num``'s TFLOP/s over ``den``'s per world size, of one pass or of forward + backward."""
        if what == "fwd_bwd":
            a, b = self.fwd_bwd(num, method), self.fwd_bwd(den, method)
        else:
            a, b = self.values[num][what][method], self.values[den][what][method]
        return tuple(x / y for x, y in zip(a, b))

    def suite_method(self, method: str) -> tuple[str, str] | None:
        """(suite method, layout) this benchmark's method is compared with, or None."""
        m = self.methods.get(method) or {}
        return (m["suite"], m.get("layout", "")) if m.get("suite") else None


def _values(raw, sizes: int, methods: dict, err: FileErr) -> dict:
    if not isinstance(raw, dict) or not raw:
        raise err("values", "must map masks to passes to methods")
    out: dict = {}
    for mask, passes in raw.items():
        if mask not in MASKS:
            raise err(f"values.{mask}", f"unknown mask; known: {list(MASKS)}")
        if not isinstance(passes, dict) or set(passes) != set(PASSES):
            raise err(f"values.{mask}", f"must have exactly the passes {list(PASSES)}")
        for ps, by_method in passes.items():
            for m, vals in by_method.items():
                key = f"values.{mask}.{ps}.{m}"
                if m not in methods:
                    raise err(key, f"method {m!r} is not declared under 'methods'")
                if (not isinstance(vals, list) or len(vals) != sizes
                        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in vals)):
                    raise err(key, f"must be {sizes} positive numbers, one per world size; got {vals!r}")
                out.setdefault(mask, {}).setdefault(ps, {})[m] = tuple(float(v) for v in vals)
    return out


def load_readings_file(path: Path) -> Readings:
    raw = _read_yaml(path)
    err = FileErr(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a readings file must be a YAML mapping")
    for key in ("id", "source", "read", "world_sizes", "methods", "values"):
        if key not in raw:
            raise err(key, "is required")
    sizes = raw["world_sizes"]
    if not isinstance(sizes, list) or not sizes or not all(isinstance(g, int) and g > 0 for g in sizes):
        raise err("world_sizes", f"must be a list of positive integers; got {sizes!r}")
    if "uncertainty_tflops" not in (raw["read"] or {}):
        raise err("read.uncertainty_tflops", "is required: every value read off a figure says how well")
    methods = raw["methods"]
    if not isinstance(methods, dict):
        raise err("methods", "must map the benchmark's method names to {suite, layout, note}")
    return Readings(id=str(raw["id"]), path=str(path), source=dict(raw["source"]), setup=dict(raw.get("setup") or {}),
                    read=dict(raw["read"]), world_sizes=tuple(sizes), methods=dict(methods),
                    values=_values(raw["values"], len(sizes), methods, err))


def load_readings(paper_dir: Path = PAPER_DIR) -> list[Readings]:
    return [load_readings_file(p) for p in sorted(paper_dir.glob("*" + READINGS_SUFFIX))]

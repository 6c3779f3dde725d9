"""The host's work per call on the emulated cluster: each rank's process CPU of a call at a few tokens.

The performance model's host term (``experiments/perfmodel/emulated/host_cost.py``) is a call's CPU at a few
tokens per rank, where the kernels cost almost nothing, less the model's own compute there. Over loopback
(``benchmarks.cpu_per_call``) a rank's messages cross ``lo``; on the emulated cluster they cross a veth pair
and a shaped ``tc`` queue, and the rank runs at its capped share of a core, whose scheduler takes it off the
core between slices: the CPU a step costs there is what a run on the cluster pays. This probe measures it
with every rank in its namespace and CPU cgroup, as a run (``experiments.harness.call_cpu``, the calls
``cpu_per_call`` times), for each case:

* ``<method>:<tokens>[:<layout>[:<mask>]]``: a registry method's fwd+bwd at N = tokens, causal, on the layout
  (zigzag by default), with the mask (``burst_impl.masks``, e.g. ``window:0:0``) where one is named:
  ``host_cost`` splits a method's host work into per step and per op from its call with a mask that skips most
  ring steps beside its causal one;
* ``decode:<row>:<tokens>:<batch>``: one decode step of ``row`` (``baselines.decode_layer.ROWS``) over
  ``tokens`` of context per sequence, ``batch`` sequences.

Its rows are ``call_cpu.json``'s (``call_cpu.row``): the validation reads them as it reads the loopback ones.
``--out`` adds them to that file, replacing those of the same call, so that probes at G 4 and G 8 fill one.

    burst-bench cluster calls a800_ib_emu_2x4 --out results/.../cpu_decode_full_2x4/call_cpu.json
    torchrun ... -m experiments.cluster.emulator.call_probe <repeats> <case,...>   # what each rank runs

Measurements: docs/findings.md#the-host-term-on-the-emulated-cluster-2026-12-06.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from baselines import METHODS
from baselines.decode_layer import ROWS
from burst_impl import masks
from burst_impl.layout import LAYOUTS, is_balanced_name

from ...harness.call_cpu import DECODE_PREFIX, measure, merge, row
from .probe_rank import rank_main


@dataclass(frozen=True)
class Case:
    method: str            # a registry name, or decode:<row>
    tokens: int            # N: the sequence (training) or each sequence's context (decode)
    layout: str = "zigzag"
    batch: int = 1
    mask: str | None = None    # beside causal (a training call's)

    @property
    def name(self) -> str:
        if self.method.startswith(DECODE_PREFIX):
            return f"{self.method}:{self.tokens}:{self.batch}"
        return f"{self.method}:{self.tokens}:{self.layout}" + (f":{self.mask}" if self.mask else "")


# what the decode specs' validation reads (cpu_decode_*_2x4: rows at B 1 and 4) and TTFT's host (burst's)
CASES = tuple(Case(DECODE_PREFIX + r, 64, batch=b) for r in ROWS for b in (1, 4)) + (Case("burst", 64),)


def _one(item: str) -> Case:
    parts = item.split(":")
    if item.startswith(DECODE_PREFIX):
        if len(parts) != 4 or parts[1] not in ROWS or not (parts[2].isdigit() and parts[3].isdigit()) \
                or int(parts[3]) < 1:
            raise ValueError(f"case={item!r} must be decode:<row>:<tokens>:<batch> with row in {ROWS} and a "
                             "positive batch")
        return Case(DECODE_PREFIX + parts[1], int(parts[2]), batch=int(parts[3]))
    if len(parts) < 2 or parts[0] not in METHODS or not parts[1].isdigit():
        raise ValueError(f"case={item!r} must be <method>:<tokens>[:<layout>[:<mask>]] with a registry method")
    layout = parts[2] if len(parts) > 2 else "zigzag"
    if layout not in LAYOUTS and not is_balanced_name(layout):
        raise ValueError(f"case={item!r}: layout {layout!r} is not among {LAYOUTS} nor balanced[:K]")
    mask = ":".join(parts[3:]) or None
    if mask is not None:
        masks.parse(mask, int(parts[1]))     # ValueError naming the mask's rule, before any bring-up
    return Case(parts[0], int(parts[1]), layout=layout, mask=mask)


def parse_cases(text: str) -> list[Case]:
    """``<method>:<tokens>[:<layout>[:<mask>]]`` or ``decode:<row>:<tokens>:<batch>`` items, comma-separated."""
    return [_one(item) for item in text.split(",")]


def check_shape(cases: list[Case], nodes: int, per_node: int) -> None:
    """ValueError unless every case's tokens split over the world: a training call's zigzag halves (2 G), a
    decode cache's shards (at least one token a rank)."""
    world = nodes * per_node
    for c in cases:
        training = not c.method.startswith(DECODE_PREFIX)
        if c.tokens < 1 or (training and c.tokens % (2 * world)) or c.tokens < world:
            rule = f"a positive multiple of 2 x world size ({2 * world})" if training else f">= world size ({world})"
            raise ValueError(f"case={c.name!r}: tokens={c.tokens} must be {rule}")


def _probe_case(case: Case, repeats: int, per_node: int) -> dict:
    """This rank's ``call_cpu.measure`` of ``case``: its description and samples (``repeats`` calls)."""
    meta, mine = measure(case.method, case.tokens, node_size=per_node, calls=repeats, layout=case.layout,
                         batch=case.batch, mask=case.mask)
    return {"meta": meta, **mine}


def summarize(per_rank: list[dict], cases: list[Case]) -> list[dict]:
    """``call_cpu.json``'s rows, one per case (``call_cpu.row``), marked as measured on the emulated cluster."""
    return [{**row(per_rank[0][c.name]["meta"], [r[c.name] for r in per_rank]), "where": "emulated"}
            for c in cases]


def table(rows: list[dict]) -> str:
    lines = [f"{'method':<22} {'N':>6} {'B':>3} {'layout':<10} {'mask':<11} {'cpu ms/call':>11} {'wall ms/call':>12}"]
    lines += [f"{r['method']:<22} {r['seqlen']:>6} {r.get('batch', '-'):>3} {r['layout']:<10} {r.get('mask', '-'):<11} "
              f"{r['cpu_s_median'] * 1e3:11.2f} {r['wall_s_median'] * 1e3:12.2f}" for r in rows]
    return "\n".join(lines)


def write(out, rows: list[dict], provenance: dict) -> None:
    """Add ``rows`` to ``out`` (``call_cpu.merge``: replacing those of the same call), each with the probe's
    provenance (git, versions, hardware, the cluster, the time, repeats)."""
    merge(out, rows, provenance=provenance)


def main(argv: list[str]) -> int:
    return rank_main(argv, marker="CALL_PROBE", doc=__doc__, parse_cases=parse_cases, check_shape=check_shape,
                     probe_case=_probe_case)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

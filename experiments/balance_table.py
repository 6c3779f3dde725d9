"""The balance table: per-rank work max/mean for every mask x layout x world size (no process group).

Work of a rank = live (query, key) score entries of its query rows (forward, K/V-circulating
backward) and of its key columns (Burst's query-circulating backward); ``burst_impl.balance``.
The slowest rank sets a ring step's time, so max/mean over ranks is the fraction of time the
others wait (1.00 = even). Layouts: contiguous, zigzag, striped, ``greedy`` (the balanced
layout's first step alone: longest-first dispatch of K*G chunks to the least loaded rank, the
MagiAttention-style min-heap anchor) and ``balanced`` (greedy + swap search, what
``layout="balanced"`` runs). Masks at N tokens: causal, a causal window of N/32, documents from
the seeded long-tailed (log-normal) distribution with mean N/32 (causal within each), and
block-sparse (10% of the 128-token blocks plus the diagonal, causal).

    python -m experiments.balance_table                      # N = 64K, W = 4, 8, 32, seed 0
    python -m experiments.balance_table --seqlen 262144 --world 8 32 --seeds 0 1 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import time

from burst_impl import masks
from burst_impl.balance import DEFAULT_CHUNKS_PER_RANK, assign, chunk_work, imbalance, resolve_layout, work_per_rank
from burst_impl.layout import ChunkLayout

LAYOUTS = ("contiguous", "zigzag", "striped", "greedy", "balanced")


def mask_zoo(n: int, seed: int) -> dict[str, masks.Mask]:
    return {
        "causal": masks.resolve(True, None, n),
        f"window:{n // 32}:0": masks.resolve(True, f"window:{n // 32}:0", n),
        f"docs:{n // 32}:{seed}": masks.resolve(True, f"docs:{n // 32}:{seed}", n),
        f"bsparse:128:0.1:{seed}": masks.resolve(True, f"bsparse:128:0.1:{seed}", n),
    }


def _layout(name: str, mask: masks.Mask, n: int, world: int):
    if name == "greedy":
        k = DEFAULT_CHUNKS_PER_RANK
        rows, cols = chunk_work(mask, n, world * k)
        return ChunkLayout(tuple(tuple(c) for c in assign(rows, cols, world, k, search=False)), name="greedy")
    return resolve_layout(name, mask, n, world)


def table(n: int, worlds: list[int], seeds: list[int]) -> list[dict]:
    rows = []
    for seed in seeds:
        for mname, mask in mask_zoo(n, seed).items():
            if seed != seeds[0] and not (mname.startswith("docs") or mname.startswith("bsparse")):
                continue                                   # causal and window do not depend on the seed
            for world in worlds:
                for lname in LAYOUTS:
                    t0 = time.perf_counter()
                    lay = _layout(lname, mask, n, world)
                    took = time.perf_counter() - t0
                    w = work_per_rank(mask, lay, n, world)
                    rows.append(dict(mask=mname, layout=lname, world_size=world, seqlen=n,
                                     rows=imbalance(w["rows"]), cols=imbalance(w["cols"]), layout_s=took))
    return rows


def render(rows: list[dict]) -> str:
    """Markdown: one line per (mask, W), one column per layout, 'rows/cols' max/mean."""
    lines = ["| mask | W | " + " | ".join(LAYOUTS) + " |", "|---|---|" + "---|" * len(LAYOUTS)]
    keys = list(dict.fromkeys((r["mask"], r["world_size"]) for r in rows))
    for m, w in keys:
        cells = {r["layout"]: f"{r['rows']:.3f} / {r['cols']:.3f}" for r in rows
                 if r["mask"] == m and r["world_size"] == w}
        lines.append(f"| {m} | {w} | " + " | ".join(cells[x] for x in LAYOUTS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=1 << 16)
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = table(args.seqlen, args.world, args.seeds)
    print(f"work max/mean over ranks (query rows / key columns), N = {args.seqlen}, "
          f"{DEFAULT_CHUNKS_PER_RANK} chunks per rank for greedy and balanced")
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

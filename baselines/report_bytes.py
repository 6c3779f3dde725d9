"""Measured vs closed-form bytes per rank for every method, on gloo.

    python -m baselines.report_bytes                     # B=1 Z=8 Zkv=8 N=8192 d=64 G=4, causal, bf16
    python -m baselines.report_bytes --seqlen 1024 --methods ring ulysses --json out.json
    python -m baselines.report_bytes --links --world-size 8 --node-size 4 --methods burst burst_double_ring

``--links``: the closed-form bytes per link class (intra-node / inter-node) of every rank, from the
registry's per-link formulas (``Method.links``; tests assert them equal to the counted bytes on every
rank), ranks placed node-major over nodes of ``--node-size`` ranks. No processes are spawned.

Spawns G local processes (gloo), runs one forward + backward of each method
and prints, per (phase, kind), the bytes this rank's counters recorded next to
the method's formula (``registry.get(name).bytes(shape)``). Sequence-parallel
methods run as operators on (B, N/G, Z, d) shards; TP methods (``tp_v1``,
``tp_v3``) as attention layers (``baselines.layer``), whose other methods would
send exactly their operator's bytes. External adapters that cannot run here are
listed with their formula only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from baselines.registry import METHODS, get
from baselines.layer import layer_forward, layer_input, make_layer
from burst_impl import comm
from burst_impl.layout import shard
from burst_impl.shape import AttnShape



def default_methods() -> list[str]:
    """Every registered method but the timing variants (``Method.variant_of``: the same bytes as their base)."""
    return [name for name, m in METHODS.items() if m.variant_of is None]


def _shape(a, G):
    return AttnShape(a.batch, a.seqlen, a.heads, a.kv_heads, a.head_dim, G, dtype=a.dtype,
                     causal=not a.non_causal, layout=a.layout)


def _options(name: str, ulysses_degree: int | None) -> dict:
    """The method's keyword arguments from the command line: ``--ulysses-degree`` for usp and its variants."""

    m = get(name)
    return {"ulysses_degree": ulysses_degree} if ulysses_degree and (m.variant_of or m.name) == "usp" else {}


def _measure(name: str, shape, options: dict) -> dict:
    rank, G = dist.get_rank(), dist.get_world_size()
    method = get(name)
    g = torch.Generator().manual_seed(0)
    dt = shape.torch_dtype
    if method.level == "layer":
        lay = make_layer(name, shape, seed=0, **options)
        h = shape.heads * shape.head_dim
        x_full = torch.randn(shape.batch, shape.seqlen, h, generator=g).to(dt)
        x = layer_input(lay, x_full).requires_grad_()
        with comm.count_bytes() as counts:
            y = layer_forward(lay, x)
            y.backward(torch.ones_like(y))
        return dict(counts)
    full = [torch.randn(shape.batch, shape.seqlen, z, shape.head_dim, generator=g).to(dt)
            for z in (shape.heads, shape.kv_heads, shape.kv_heads)]
    q, k, v = (shard(t, shape.layout, rank, G).requires_grad_() for t in full)
    with comm.count_bytes() as counts:
        out = method.call(q, k, v, causal=shape.causal, layout=shape.layout, **options)
        out.backward(torch.ones_like(out))
    return dict(counts)


def _worker(rank, G, port, args, queue):
    torch.set_num_threads(max(1, torch.get_num_threads() // G))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=G,
                            timeout=datetime.timedelta(seconds=args.timeout))

    shape = _shape(args, G)
    out = {}
    for name in args.methods:
        m = get(name)
        opts = _options(name, args.ulysses_degree)
        try:
            m.validate(shape, **opts)
        except ValueError as e:
            out[name] = ("invalid", str(e))
            continue
        if not m.available():
            out[name] = ("unavailable", None)
            continue
        out[name] = ("measured", _measure(name, shape, opts))
    queue.put((rank, out))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def link_table(methods, shape, node_size: int, ulysses_degree=None) -> list[dict]:
    """Per method and rank: bytes sent per link class for one forward + backward (formulas only)."""

    rows = []
    for name in methods:
        m = get(name)
        opts = _options(name, ulysses_degree)
        m.validate(shape, **opts)
        for rank in range(shape.world_size):
            by: dict[str, int] = {}
            for (_, _, link), b in m.links(shape, rank, node_size, **opts).items():
                by[link] = by.get(link, 0) + int(b)
            rows.append({"method": name, "rank": rank, "intra": by.get("intra", 0), "inter": by.get("inter", 0)})
    return rows


def _print_links(rows, shape, node_size: int) -> None:
    G = shape.world_size
    print(f"bytes per link class sent per rank, one forward + backward (registry formulas): B={shape.batch} "
          f"Z={shape.heads} Zkv={shape.kv_heads} N={shape.seqlen} d={shape.head_dim} {shape.dtype} "
          f"{'causal' if shape.causal else 'non-causal'}, {G // node_size} nodes x {node_size} ranks (node-major)")
    print(f"  {'method':<30}{'ranks':<16}{'intra-node':>16}{'inter-node':>16}{'intra MiB':>11}{'inter MiB':>11}")
    groups: dict = {}
    for r in rows:       # ranks with equal bytes on one line
        groups.setdefault((r["method"], r["intra"], r["inter"]), []).append(r["rank"])
    for (name, intra, inter), ranks in groups.items():
        print(f"  {name:<30}{','.join(map(str, ranks)):<16}{intra:>16,}{inter:>16,}{intra / 2**20:>11.2f}"
              f"{inter / 2**20:>11.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--ulysses-degree", type=int, default=None, help="usp; default: registry policy")
    p.add_argument("--methods", nargs="+", default=default_methods())
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--links", action="store_true", help="bytes per link class from the formulas (no processes)")
    p.add_argument("--node-size", type=int, default=None, help="--links: ranks per node (default: all on one)")
    a = p.parse_args(argv)
    G = a.world_size
    if a.links:
        node_size = a.node_size or G
        if node_size < 1 or G % node_size:
            raise SystemExit(f"--node-size={node_size} must divide --world-size={G}")
        rows = link_table(a.methods, _shape(a, G), node_size, a.ulysses_degree)
        _print_links(rows, _shape(a, G), node_size)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(args=vars(a), links=rows), f, indent=1)
        return 0
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, G, port, a, queue)) for r in range(G)]
    for pr in procs:
        pr.start()
    per_rank = dict(queue.get(timeout=a.timeout + 60) for _ in range(G))
    for pr in procs:
        pr.join()


    shape = _shape(a, G)
    print(f"bytes sent per rank, one forward + backward: B={a.batch} Z={a.heads} Zkv={a.kv_heads} "
          f"N={a.seqlen} d={a.head_dim} G={G} {a.dtype} {'causal' if shape.causal else 'non-causal'} "
          f"layout={a.layout}")
    record = {}
    ok = True
    for name in a.methods:
        status, counts = per_rank[0][name]
        opts = _options(name, a.ulysses_degree)
        if status == "measured" and get(name).bytes_by_formula:
            status = "recorded by formula (its sends happen inside another package)"
        print(f"\n{name}: {status}" + (f" ({counts})" if status == "invalid" else ""))
        if status == "invalid":
            continue
        formula = get(name).bytes(shape, **opts)
        keys = sorted(set(formula) | (set(counts) if counts else set()))
        print(f"  {'phase/kind':<22}{'measured':>16}{'formula':>16}")
        for key in keys:
            meas = "-" if counts is None else f"{counts.get(key, 0):,}"
            print(f"  {key[0] + '/' + key[1]:<22}{meas:>16}{formula.get(key, 0):>16,}")
        tot_f = sum(formula.values())
        tot_m = "-" if counts is None else f"{sum(counts.values()):,}"
        print(f"  {'total':<22}{tot_m:>16}{tot_f:>16,}   ({tot_f / 2**20:.2f} MiB by formula)")
        print(f"  activation memory model: {get(name).memory(shape, **opts) / 2**20:.2f} MiB per rank")
        if counts is not None:
            same = all(per_rank[r][name][1] == formula for r in range(G))
            ok &= same
            print("  every rank measured == formula" if same else "  MISMATCH on some rank")
        record[name] = dict(status=status, formula={"/".join(k): v for k, v in formula.items()},
                            measured=None if counts is None else
                            [{"/".join(k): v for k, v in per_rank[r][name][1].items()} for r in range(G)])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), methods=record), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

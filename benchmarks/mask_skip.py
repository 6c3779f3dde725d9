"""Benchmark (not a test): what skipping masked blocks buys, measured.

The same BurstAttention call (forward + backward) with a mask, timed both ways
in interleaved rounds through the suite's timing module
(``experiments.harness.timing``: warm-up, barrier, maximum over ranks per step,
median and p10/p90), with the speedup's paired bootstrap interval:

* ``skip``: the plans (``burst_impl.plan``): fully masked block pairs are
  not computed, partial pairs only on their live tiles;
* ``no_skip``: every block pair computed whole under its dense mask
  (``plan.no_skipping()``): what a ring that applies the mask inside each
  step without planning does (the authors' "every ring step still runs").

Both move the same bytes (blocks travel either way). Default: the largest
CPU size of the presets (N = 8192, G = 4, 8 x 32 heads, float32) with a causal
sliding window of 256 tokens, contiguous layout.

    python -m benchmarks.mask_skip                       # spawns 4 gloo processes
    python -m benchmarks.mask_skip --mask docs:512:0 --layout balanced --out results/bench_mask_skip
    torchrun --standalone --nproc-per-node 4 -m benchmarks.mask_skip
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist


def _measure(args) -> dict:
    from burst_impl import burst_attn_func, plan
    from burst_impl.shape import AttnShape
    from burst_impl.flops import attention_flops
    from experiments.harness.timing import RepeatPolicy, ratio_interval, summarize, time_interleaved

    rank, g = dist.get_rank(), dist.get_world_size()
    shape = AttnShape(1, args.seqlen, args.heads, args.heads, args.head_dim, g, dtype=args.dtype, causal=True,
                      layout=args.layout, mask=args.mask)
    shape.validate()
    gen = torch.Generator().manual_seed(1000 + rank)
    q, k, v, do = (torch.randn(1, shape.local_seqlen, args.heads, args.head_dim, generator=gen)
                   .to(shape.torch_dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        for t in (q, k, v):
            t.grad = None
        out = burst_attn_func(q, k, v, causal=True, mask=args.mask, layout=args.layout, backward="burst")
        out.backward(do)

    def step_no_skip():
        with plan.no_skipping():        # plans are cached per skip setting: the two never share one
            step()

    # A B A B ...: a drift of the machine slows both alike, and the ratio is paired by round
    timed = time_interleaved([(step, None), (step_no_skip, None)], warmup=args.warmup,
                             policy=RepeatPolicy(min_repeats=args.repeats, max_repeats=args.repeats),
                             device=torch.device("cpu"))
    skip, no_skip = timed.samples
    res = {"skip": dict(samples=skip, **summarize(skip)), "no_skip": dict(samples=no_skip, **summarize(no_skip))}
    flops = attention_flops(shape, "fwd_bwd")
    res["speedup_median"] = res["no_skip"]["time_median_s"] / res["skip"]["time_median_s"]
    res["speedup"] = ratio_interval(no_skip, skip, paired=True)
    res["config"] = dict(vars(args), world_size=g, flops_fwd_bwd=flops)
    return res


def _worker(rank: int, world: int, port: int, args, box) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    res = _measure(args)
    if rank == 0:
        box.put(res)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", default="float32")   # this CPU has no bf16 arithmetic
    ap.add_argument("--mask", default="window:256:0")
    ap.add_argument("--layout", default="contiguous")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/bench_mask_skip")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:      # under torchrun
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("gloo")
        res = _measure(args)
        done = dist.get_rank() == 0
        dist.destroy_process_group()
        if not done:
            return 0
    else:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        box = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, box))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        res = box.get(timeout=3600)
        for p in procs:
            p.join()
    from experiments.harness.env import git_info, hardware, versions   # only rank 0 writes
    res["environment"] = dict(git=git_info(), versions=versions(), hardware=hardware(res["config"]["world_size"]),
                              load_average=os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.mask.replace(':', '-')}_{args.layout}_N{args.seqlen}_G{res['config']['world_size']}.json"
    (out / name).write_text(json.dumps(res, indent=1, default=str))
    s, n = res["skip"], res["no_skip"]
    print(f"{args.mask} {args.layout} N={args.seqlen} G={res['config']['world_size']}: "
          f"skip {s['time_median_s']:.3f} s [p10 {s['time_p10_s']:.3f}, p90 {s['time_p90_s']:.3f}], "
          f"no skip {n['time_median_s']:.3f} s [p10 {n['time_p10_s']:.3f}, p90 {n['time_p90_s']:.3f}]: "
          f"speedup {res['speedup_median']:.2f}x (median; 95% interval [{res['speedup']['lo']:.2f}, "
          f"{res['speedup']['hi']:.2f}]) -> {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

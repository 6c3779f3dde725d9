"""Benchmark (not a test): what the default-on cross-rank agreement (issue 22) costs per call.

On 2 gloo ranks, for N/G = 1K and 8K tokens: the validation of one BurstAttention call
(``attention.validate_call``) with the agreement on (one all-gather of 17 int64 per rank) and off,
median over many calls (interleaved), and the burst call's forward + backward with the agreement on,
median over a few calls; the difference of the two validations is the check's cost, printed in µs and
relative to the call. Small heads (Z = 2, d = 32, fp32, causal, contiguous) keep the 8K call short.

    python -m benchmarks.agreement_cost               # spawns 2 gloo processes; prints JSON lines
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HEADS, HEAD_DIM = 2, 32
LOCAL = (1024, 8192)
CHECKS, CALLS = 400, {1024: 5, 8192: 2}


def _validate_us(q, k, v, on: bool) -> float:
    from burst_impl import comm
    from burst_impl.attention import validate_call

    with comm.check_shapes(on):
        dist.barrier()
        t0 = time.perf_counter()
        validate_call(q, k, v, causal=True, method="burst", options=dict(topology="flat", node_size=None,
                                                                           overlap=True))
        return (time.perf_counter() - t0) * 1e6


def _call_s(q, k, v, do) -> float:
    from burst_impl import burst_attn_func

    q.grad = k.grad = v.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    burst_attn_func(q, k, v, causal=True).backward(do)
    return time.perf_counter() - t0


def _measure(local: int) -> dict:
    torch.manual_seed(dist.get_rank())
    q, k, v, do = (torch.randn(1, local, HEADS, HEAD_DIM) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    on, off = [], []
    for _ in range(CHECKS):                     # interleaved: load changes hit both alike
        on.append(_validate_us(q, k, v, True))
        off.append(_validate_us(q, k, v, False))
    _call_s(q, k, v, do)                        # warm-up
    calls = [_call_s(q, k, v, do) for _ in range(CALLS[local])]
    cost = statistics.median(on) - statistics.median(off)
    call = statistics.median(calls)
    return dict(local_tokens=local, world_size=dist.get_world_size(), rank=dist.get_rank(),
                validate_on_us=statistics.median(on), validate_off_us=statistics.median(off),
                check_us=cost, call_fwd_bwd_s=call, check_relative=cost * 1e-6 / call,
                heads=HEADS, head_dim=HEAD_DIM, dtype="float32")


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    for local in LOCAL:
        rec = _measure(local)
        if rank == 0:
            print(json.dumps(rec), flush=True)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()

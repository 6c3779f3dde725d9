"""Train a small Hugging Face causal LM sequence-parallel with a method of the suite, next to the
single-process model, and print both losses each step (rank 0).

    python -m baselines.hf.example                                  # one process: W = 1
    torchrun --nproc-per-node 4 -m baselines.hf.example --method burst --model llama --steps 5

CPU, gloo. Every rank builds the same seeded model, registers the method in transformers'
AttentionInterface (``baselines.hf.use_method``), cuts the same global batch into its layout shard
(``shard_batch``) and steps AdamW on the global mean loss; rank 0 also steps an unmodified copy on
the whole batch. A user error (unknown method, heads that do not split, a sequence length that does
not split over the ranks, ...) prints ``error: <message>`` and exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class UserError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # argparse's own errors as ours: "error: ...", status 2
        raise UserError(message)


@dataclass(frozen=True)
class Args:
    method: str
    model: str
    steps: int
    layout: str
    seqlen: int
    batch: int
    dtype: str
    lr: float
    fsdp: bool


def parse(argv) -> Args:
    p = _Parser(prog="python -m baselines.hf.example", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="burst", help="a sequence-parallel registry method (default burst)")
    p.add_argument("--model", default="llama", choices=("llama", "qwen2", "mistral"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous", "striped"))
    p.add_argument("--seqlen", type=int, default=48, help="global tokens per sequence (a multiple of 2W for zigzag)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--fsdp", action="store_true", help="shard the weights with FSDP2 over the same group")
    a = p.parse_args(argv)
    if a.steps < 1 or a.batch < 1:
        raise UserError(f"--steps={a.steps} and --batch={a.batch} must be >= 1")
    return Args(**vars(a))


def batch_at(step: int, batch: int, seqlen: int, vocab: int = 64) -> torch.Tensor:
    """(B, N) token ids, the same on every rank: arithmetic runs mod vocab with a seeded start and
    stride per row, so the next token is learnable from the context and the loss falls."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + stride * torch.arange(seqlen)) % vocab


def train(args: Args) -> None:
    # transformers (the optional [hf] extra) is imported only when a run starts, so that a user
    # error in the arguments is answered before that import
    from baselines import hf  # noqa: PLC0415 (optional dependency: transformers)
    from baselines.hf.models import build  # noqa: PLC0415 (optional dependency: transformers)

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dtype = DTYPES[args.dtype]
    model = build(args.model, dtype)
    name = hf.use_method(model, args.method, args.layout)
    if args.fsdp:
        hf.shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    single = build(args.model, dtype) if rank == 0 else None
    single_opt = torch.optim.AdamW(single.parameters(), lr=args.lr) if single is not None else None
    if rank == 0:
        print(f"{args.model} ({dtype}), attn_implementation={name!r}, W={world}, layout={args.layout}, "
              f"N={args.seqlen}, B={args.batch}{', FSDP2' if args.fsdp and dist.is_initialized() else ''}", flush=True)
    for step in range(args.steps):
        ids = batch_at(step, args.batch, args.seqlen)
        loss, _ = hf.sp_loss_and_grads(model, ids, layout=args.layout, fsdp=args.fsdp, grads=False)
        opt.step()
        if single is not None:
            ref, _ = hf.single_loss_and_grads(single, ids)
            single_opt.step()
            print(f"step {step}  loss {loss.item():.7f}  single-process {ref.item():.7f}  "
                  f"|diff| {abs(loss.item() - ref.item()):.1e}", flush=True)


def main(argv=None) -> int:
    started = False
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        if "WORLD_SIZE" in os.environ and not dist.is_initialized():      # under torchrun
            dist.init_process_group("gloo")
            started = True
        torch.manual_seed(0)
        train(args)
    except (UserError, ValueError) as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

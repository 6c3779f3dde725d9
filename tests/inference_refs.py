"""The single-process fp64 reference of the inference operators, and the seeded data the ranks share.

The reference attends queries at global positions over a whole sequence's K/V (positions 0..L-1)
with its own mask arithmetic (not ``burst_impl.masks``), so a wrong position in the cache, a lost
token or a wrong merge shows up as a difference."""
from __future__ import annotations

import torch

from burst_impl import comm

FP64_TOL = 1e-12


def sequence(seed: int, length: int, heads: int, kv_heads: int, head_dim: int):
    """(q (L, Z, d), k (L, Zkv, d), v) of one sequence, fp64, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = lambda z: (length, z, head_dim)  # noqa: E731
    return (torch.randn(shape(heads), generator=g, dtype=torch.float64),
            torch.randn(shape(kv_heads), generator=g, dtype=torch.float64),
            torch.randn(shape(kv_heads), generator=g, dtype=torch.float64))


def attend(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None):
    """q (S, Z, d) at positions q_pos over k/v (L, Zkv, d) at positions 0..L-1, causal (and keys q-window..q
    with a window) -> (out (S, Z, d), lse (Z, S)), fp64, scale 1/sqrt(d)."""
    z, zkv, d = q.shape[1], k.shape[1], q.shape[2]
    kh = k.repeat_interleave(z // zkv, dim=1).transpose(0, 1)          # (Z, L, d)
    vh = v.repeat_interleave(z // zkv, dim=1).transpose(0, 1)
    s = q.transpose(0, 1) @ kh.transpose(1, 2) / d ** 0.5            # (Z, S, L)
    kp = torch.arange(k.shape[0]).unsqueeze(0)
    qp = q_pos.unsqueeze(1)
    live = kp <= qp
    if window is not None:
        live &= kp >= qp - window
    s = s.masked_fill(~live, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, dim=-1) @ vh).transpose(0, 1), lse


def err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (-inf entries must match)."""
    got, want = got.double(), want.double()
    inf = torch.isinf(want)
    if not torch.equal(inf, torch.isinf(got)):
        return float("inf")
    scale = want[~inf].abs().max().clamp_min(1.0)
    return float(((got - want)[~inf]).abs().max() / scale) if (~inf).any() else 0.0


def bad_input_log(calls: dict, after=None) -> list[str]:
    """For each bad call: its ValueError's text (or "no error") and the bytes it sent (then ``after()``),
    so a test checks that every rank refused before any byte."""
    out = []
    for name, call in calls.items():
        with comm.count_bytes() as counts:
            try:
                call()
                out.append(f"{name}: no error")
            except ValueError as e:
                out.append(f"{name}: {e}")
        out.append(f"bytes {counts.total()}" + (f" {after()}" if after is not None else ""))
    return out

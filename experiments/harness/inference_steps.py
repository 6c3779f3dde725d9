"""Inference steps (``measure.level: inference``, ``inference_cases.py``): what is timed, and its record's fields.

* ``decode``: ``baselines.decode_layer.decode_step`` of ``new_tokens`` per sequence on a cache filled with
  synthetic K/V of ``seqlen`` tokens per sequence (``fill_cache``, placed as the prompt's prefill places
  it). A sample runs ``calls`` steps back to back, as a server decodes token after token
  (``timing.autorange``: enough for ``case.min_sample_s``, at most ``MAX_STEPS_PER_SAMPLE``; the harness
  divides the sample by them), so the context grows by up to ``calls x new_tokens`` tokens over a sample.
  The cache holds room for them (``ShardedKVCache.reserve``: steps write in place, as a server's
  preallocated cache does) and is rewound in the untimed setup before every sample (``rewind``), so every
  sample decodes from the same context. The new tokens' hidden states are seeded, the same on every rank.
* ``ttft``: ``prefill_step`` of the whole prompt into the emptied cache (setup: rewind to empty); a sample
  runs ``calls`` prefills back to back (``autorange`` as for decode), the cache emptied between them.
* ``kv_capacity``: nothing timed (``measure.measure_group`` calls ``kv_capacity_record``).

Record fields (``inference_fields``): ``tpot_s`` = step median / new_tokens, or ``ttft_s`` = step median;
``mem_kv_bytes_per_rank`` (what each rank's cache holds, counted) next to ``mem_kv_formula_bytes`` (the
largest rank's, ``kv_cache_bytes``), and the counted bytes sent next to ``decode_layer_bytes`` /
``prefill_layer_bytes``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from baselines.decode_layer import (DecodeLayer, decode_layer_bytes, decode_step, fill_cache, make_decode_layer,
                                    prefill_input_tokens, prefill_layer_bytes, prefill_step, cache_kv_heads)
from burst_impl import comm
from burst_impl.layout import shard

from .case import Case
from .inference_cases import ROW_LABELS, row_of
from .timed_step import MAX_STEPS_PER_SAMPLE, Step, repeated


@dataclass
class InferenceRun:
    """What an inference step holds, for its record."""

    layer: DecodeLayer

    def kv_bytes(self) -> int:
        return self.layer.cache.nbytes()


def kv_cache_bytes(row: str, shape, context: int, rank: int) -> int:
    """K and V bytes rank ``rank`` holds for ``context`` tokens of each of B sequences (one layer): its share
    of the tokens (the layout's shard; TP: all of them) x its KV heads (``cache_kv_heads``) x 2 d e."""
    if row == "tp":
        tokens = context
    else:
        tokens = shape.replace(seqlen=context).lengths[rank]
    return 2 * shape.batch * tokens * cache_kv_heads(row, shape) * shape.head_dim * shape.elem_size


def _hidden(case: Case, tokens: int, rank: int, device: torch.device, *, replicated: bool) -> torch.Tensor:
    """Seeded hidden states (B, tokens, H): the same on every rank when ``replicated`` (decode's new tokens)."""
    s = case.shape
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + (0 if replicated else rank) + 7)
    return torch.randn((s.batch, tokens, s.heads * s.head_dim), generator=g).to(device=device,
                                                                                 dtype=s.torch_dtype)


def build_inference_step(case: Case, *, rank: int, group, device: torch.device) -> Step:
    s = case.shape
    row = row_of(case.method, case.merge)
    lay = make_decode_layer(row, s, group=group, seed=case.seed, device=device, placement=case.placement)
    run = InferenceRun(lay)
    if case.mode == "ttft":
        return _ttft_step(case, row, lay, run, rank, device, group)
    fill_cache(lay, s.seqlen, seed=case.seed, reserve=case.new_tokens * MAX_STEPS_PER_SAMPLE)
    filled = lay.cache.snapshot()
    x = _hidden(case, case.new_tokens, rank, device, replicated=True)
    step = Step(step=lambda: decode_step(lay, x), setup=lambda: lay.cache.rewind(filled),
                start_bytes=_nbytes(lay, x), context=run)
    return repeated(step, case.min_sample_s, device=device, group=group)


def _ttft_step(case: Case, row: str, lay: DecodeLayer, run: InferenceRun, rank: int, device, group) -> Step:
    """The prompt's prefill into the emptied cache; a sample runs ``calls`` of them back to back, each into the
    cache emptied again (a rewind of views, nothing copied), as many as ``case.min_sample_s`` takes."""
    s = case.shape
    lay.cache.reserve(prefill_input_tokens(lay))
    empty = lay.cache.snapshot()
    x = _hidden(case, s.seqlen, rank, device, replicated=True)
    if row != "tp":      # TP: every rank the whole prompt, its own heads
        x = shard(x, s.resolved_layout, rank, s.world_size)

    def empty_cache():
        lay.cache.rewind(empty)
    step = Step(step=lambda: prefill_step(lay, x), setup=empty_cache, start_bytes=_nbytes(lay, x), context=run)
    return repeated(step, case.min_sample_s, device=device, group=group, between=empty_cache)


def _nbytes(lay: DecodeLayer, x: torch.Tensor) -> int:
    """The step's own inputs and weights (the suite's memory convention), and the cache it reads."""
    return sum(comm.nbytes(t) for t in (x, lay.wqkv, lay.wo)) + lay.cache.nbytes()


def inference_fields(case: Case, median_s: float | None, per_rank: list[dict]) -> dict:
    """The record fields of an inference case (``measure._record`` adds them): time per token, the KV bytes
    each rank holds next to their formula, bytes sent next to theirs, the row."""
    s = case.shape
    row = row_of(case.method, case.merge)
    out = {"variant": row, "variant_label": ROW_LABELS[row]}
    if median_s is not None:
        out["tpot_s" if case.mode == "decode" else "ttft_s"] = median_s / max(1, case.new_tokens)
    kv = [r.get("kv_bytes") for r in per_rank]
    if None not in kv:
        context = s.seqlen + (case.new_tokens if case.mode == "decode" else 0)
        out["mem_kv_bytes_per_rank"] = kv
        out["mem_kv_formula_bytes"] = max(kv_cache_bytes(row, s, context, r) for r in range(s.world_size))
    if case.measure_comm and per_rank[0].get("comm") is not None:
        formulas = [decode_layer_bytes(row, s, case.new_tokens) if case.mode == "decode"
                    else prefill_layer_bytes(row, s, r) for r in range(s.world_size)]
        out.update({
            "comm_fwd_bytes": max(r["comm_fwd"] for r in per_rank),
            "comm_fwd_bytes_per_rank": [r["comm_fwd"] for r in per_rank],
            "comm_fwd_formula_bytes": max(sum(f.values()) for f in formulas),
            "bytes_source": "counted",
            "comm_bytes_by_kind": per_rank[0]["comm"],
            "comm_formula_by_kind": {f"{p}/{k}": int(v) for (p, k), v in sorted(formulas[0].items())},
            "comm_bytes_by_link_per_rank": [r["links"] for r in per_rank],
            "comm_wait_s_per_rank": [r["wait_s"] for r in per_rank],
            "comm_measured_over": "one decode step" if case.mode == "decode" else "the prompt's prefill",
        })
    return out


def kv_capacity_record(case: Case, *, rank: int, world: int, device: torch.device, group, gather, base_record):
    """``kv_capacity``, not timed: the row's cache filled with ``seqlen`` tokens per sequence; the record (rank 0)
    has every rank's counted K/V bytes next to the formula. How many tokens fit in an accelerator's memory is
    the performance model's (``experiments.perfmodel.inference``), from this formula."""
    lay = make_decode_layer(row_of(case.method, case.merge), case.shape, group=group, seed=case.seed, device=device)
    fill_cache(lay, case.seqlen, seed=case.seed)
    per_rank = gather({"kv_bytes": lay.cache.nbytes()}, world)
    if rank != 0:
        return None
    rec = base_record(case, "ok")
    rec.update(inference_fields(case, None, per_rank))
    rec["mem_measured_over"] = "the filled cache (K and V of every token this rank holds)"
    return rec

"""Fused LM head + cross-entropy (burst_impl/loss.py) against F.linear + F.cross_entropy.

The exactness tests run on both paths of the fused loss (``grad_in_forward``
True: gradients computed in the forward; False: the recomputing backward;
reduction "none" has only the latter).

Tolerances, and why:

* fp64 inputs: the fused loss runs in fp64 and differs from the fp64 reference
  only in summation order, so value and gradients agree to 1e-12 relative to
  the tensor's largest entry (a K-term fp64 sum is off by at most ~K * 1.1e-16,
  K <= a few hundred here). This is the exactness check of the tiling: a wrong
  tile edge, label or rescale shows up as an O(1) error.
* fp32: both implementations against the fp64 reference of the same input
  values. Each output is a chain of sums (H terms in a logit, V in the lse and
  in d hidden, T in d W and the loss sum); the first-order worst-case error of
  a K-term fp32 sum is K * u (u = 2^-24, Higham, "Accuracy and Stability",
  §3.1) relative to the sum of the terms' magnitudes, which here is bounded by
  a small multiple of the largest entry. We allow K = H + V + T, times 2 for
  that multiple: tol = 2 (H + V + T) u max|ref|.
* bf16: inputs are exact in fp32. The fused loss computes in fp32 and rounds d
  hidden and d W once to bf16, so each entry may be off by its rounding,
  |x| 2^-8 (bf16 has 8 significant bits), plus the fp32 bound above; its fp32
  loss gets the fp32 bound alone. The unfused bf16 path rounds the logits and
  the softmax gradient to bf16 as well; the fused result must be at least as
  close to the fp64 reference (Frobenius norm) as the unfused one.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from burst_impl import loss as L
from burst_impl import loss_modes as M
from burst_impl import loss_tiles as LT
from burst_impl.loss import count_tokens, fused_linear_cross_entropy, linear_cross_entropy
from experiments.harness.memory import measure_peak

U32 = 2.0 ** -24
U_BF16 = 2.0 ** -8


def _problem(shape, H, V, dtype, *, ignore_frac=0.25, bias=False, seed=0, scale=1.0):
    """hidden `shape + (H,)`, weight (V, H), labels `shape` with some ignore_index, optional bias."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*shape, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype)
    labels = torch.randint(0, V, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignore_frac] = -100
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.5).to(dtype) if bias else None
    return hidden, weight, labels, b


def _run(fn, hidden, weight, labels, bias, reduction, grad_seed=1, **kw):
    """Loss and gradients (hidden, weight[, bias]) for a fixed incoming gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    out = fn(leaves[0], leaves[1], labels, bias=leaves[2] if bias is not None else None,
             reduction=reduction, **kw)
    g = torch.Generator().manual_seed(grad_seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype) if reduction == "none" \
        else torch.tensor(0.75, dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, go)
    return out.detach(), grads


def _ref64(hidden, weight, labels, bias, reduction):
    b = None if bias is None else bias.double()
    return _run(linear_cross_entropy, hidden.double(), weight.double(), labels, b, reduction)


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


# (reduction, grad_in_forward): both paths for "mean" and "sum"; "none" has only the recomputing one.
PATHS = [("mean", True), ("mean", False), ("sum", True), ("sum", False), ("none", False)]
PATH_IDS = [f"{r}-{'gradfwd' if g else 'recompute'}" for r, g in PATHS]

CASES = [
    # (tokens shape, H, V, chunk_tokens, chunk_vocab, bias): uneven tiles on both axes,
    # one tile, a tile larger than the problem, 3-D hidden, 1-token chunks.
    ((37,), 16, 53, 8, 10, False),
    ((2, 19), 24, 61, 7, 16, True),
    ((45,), 8, 30, 64, 64, False),
    ((3, 5), 12, 17, 1, 5, True),
    ((64,), 32, 300, 16, 128, False),
]


@pytest.mark.parametrize("reduction,gif", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"T{c[0]}-H{c[1]}-V{c[2]}-c{c[3]}x{c[4]}{'-bias' if c[5] else ''}")
def test_fp64_exact(case, reduction, gif):
    shape, H, V, ct, cv, bias = case
    hidden, weight, labels, b = _problem(shape, H, V, torch.float64, bias=bias)
    out, grads = _run(fused_linear_cross_entropy, hidden, weight, labels, b, reduction,
                      chunk_tokens=ct, chunk_vocab=cv, grad_in_forward=gif)
    ref, rgrads = _ref64(hidden, weight, labels, b, reduction)
    assert out.dtype == torch.float64 and out.shape == ref.shape
    assert _rel(out, ref) < 1e-12
    for gf, gr in zip(grads, rgrads):
        assert gf.shape == gr.shape and gf.dtype == gr.dtype
        assert _rel(gf, gr) < 1e-12


@pytest.mark.parametrize("reduction,gif", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("case", CASES[:3] + CASES[4:], ids=lambda c: f"T{c[0]}-H{c[1]}-V{c[2]}")
def test_fp32_against_fp64(case, reduction, gif):
    shape, H, V, ct, cv, bias = case
    T = torch.Size(shape).numel()
    hidden, weight, labels, b = _problem(shape, H, V, torch.float32, bias=bias)
    ref, rgrads = _ref64(hidden, weight, labels, b, reduction)
    tol = 2 * (H + V + T) * U32
    fused_kw = {"chunk_tokens": ct, "chunk_vocab": cv, "grad_in_forward": gif}
    for fn, kw in ((fused_linear_cross_entropy, fused_kw), (linear_cross_entropy, {})):
        out, grads = _run(fn, hidden, weight, labels, b, reduction, **kw)
        assert out.dtype == torch.float32
        assert _rel(out, ref) < tol, fn.__name__
        for gf, gr in zip(grads, rgrads):
            assert gf.dtype == torch.float32
            assert _rel(gf, gr) < tol, fn.__name__


@pytest.mark.parametrize("reduction,gif", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=["3d-bias", "2d"])
def test_bf16_against_fp64_and_unfused(case, reduction, gif):
    shape, H, V, ct, cv, bias = case
    T = torch.Size(shape).numel()
    hidden, weight, labels, b = _problem(shape, H, V, torch.bfloat16, bias=bias)
    ref, rgrads = _ref64(hidden, weight, labels, b, reduction)
    out, grads = _run(fused_linear_cross_entropy, hidden, weight, labels, b, reduction,
                      chunk_tokens=ct, chunk_vocab=cv, grad_in_forward=gif)
    uout, ugrads = _run(linear_cross_entropy, hidden, weight, labels, b, reduction)
    tol32 = 2 * (H + V + T) * U32
    assert out.dtype == torch.float32                 # the fused loss is not rounded to bf16
    assert _rel(out, ref) < tol32
    for gf, gu, gr in zip(grads, ugrads, rgrads):
        assert gf.dtype == torch.bfloat16
        err = (gf.double() - gr).abs()
        assert bool((err <= U_BF16 * gr.abs() + tol32 * gr.abs().max()).all())
        assert (gf.double() - gr).norm() <= (gu.double() - gr).norm()
    # and the two agree within their combined distance from the reference
    assert (out.double() - uout.double()).abs().max() <= (out.double() - ref).abs().max() \
        + (uout.double() - ref).abs().max() + 1e-12


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_stable_for_large_logits(gif):
    # logits of order 1e3: exp would overflow fp32 without the (running-)max shift.
    hidden, weight, labels, _ = _problem((40,), 16, 70, torch.float32, scale=400.0)
    out, grads = _run(fused_linear_cross_entropy, hidden, weight, labels, None, "sum", chunk_tokens=16, chunk_vocab=8,
                      grad_in_forward=gif)
    ref, rgrads = _ref64(hidden, weight, labels, None, "sum")
    assert torch.isfinite(out) and all(bool(torch.isfinite(g).all()) for g in grads)
    assert _rel(out, ref) < 2 * (16 + 70 + 40) * U32 * 400
    for gf, gr in zip(grads, rgrads):
        assert _rel(gf, gr) < 1e-4


@pytest.mark.parametrize("reduction,gif", PATHS, ids=PATH_IDS)
def test_all_ignored_gives_zero_loss_and_zero_gradients(reduction, gif):
    hidden, weight, labels, b = _problem((3, 4), 8, 11, torch.float32, bias=True)
    labels = torch.full_like(labels, -100)
    out, grads = _run(fused_linear_cross_entropy, hidden, weight, labels, b, reduction, chunk_tokens=2, chunk_vocab=4,
                      grad_in_forward=gif)
    assert out.shape == (() if reduction != "none" else labels.shape)
    assert bool((out == 0).all())
    assert all(bool((g == 0).all()) for g in grads)
    assert int(count_tokens(labels)) == 0
    if reduction == "mean":  # where we differ from torch on purpose (module docstring): torch gives 0/0
        ref, _ = _run(linear_cross_entropy, hidden, weight, labels, b, reduction)
        assert torch.isnan(ref)


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_no_tokens_at_all(gif):
    w = torch.randn(9, 4, requires_grad=True)
    h = torch.randn(0, 4, requires_grad=True)
    for reduction in ("mean", "sum"):
        out, n = fused_linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long), reduction=reduction,
                                            return_count=True, grad_in_forward=gif)
        out.backward()
        assert out.item() == 0 and int(n) == 0 and bool((w.grad == 0).all()) and h.grad.shape == (0, 4)


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_sum_with_external_count_is_the_global_mean(gif):
    """Two 'ranks' each take half the tokens: sum_r / global count == the mean over all tokens."""
    hidden, weight, labels, _ = _problem((2, 30), 16, 40, torch.float64)
    labels[0] = -100                                  # rank 0 ends up with only a few counted tokens
    labels[0, :3] = torch.tensor([1, 5, 7])
    ref, rgrads = _run(linear_cross_entropy, hidden, weight, labels, None, "mean")
    w = weight.clone().requires_grad_()
    parts = [(hidden[r].clone().requires_grad_(), labels[r]) for r in range(2)]
    sums, counts = zip(*(fused_linear_cross_entropy(h, w, y, reduction="sum", return_count=True, chunk_tokens=7,
                                                    chunk_vocab=9, grad_in_forward=gif) for h, y in parts))
    total = sum(int(c) for c in counts)
    assert int(counts[0]) == 3 and total == int(count_tokens(labels)) and counts[0].dtype == torch.int64
    loss = sum(s / total for s in sums)              # each rank back-propagates its own sum / global count
    (loss * 0.75).backward()
    assert _rel(loss.detach(), ref) < 1e-12
    assert _rel(torch.stack([h.grad for h, _ in parts]), rgrads[0]) < 1e-12
    assert _rel(w.grad, rgrads[1]) < 1e-12


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_noncontiguous_inputs_and_partial_requires_grad(gif):
    hidden, weight, labels, _ = _problem((20, 2), 12, 33, torch.float32)
    h = hidden.transpose(0, 1)                        # (2, 20, 12), non-contiguous
    y = labels.t()
    wt = weight.t().contiguous().t()                  # (V, H) with transposed strides
    ref = linear_cross_entropy(h.double(), weight.double(), y)
    # weight frozen: only d hidden is computed
    hh = h.detach().clone().requires_grad_()
    out = fused_linear_cross_entropy(hh, wt, y, chunk_tokens=6, chunk_vocab=8, grad_in_forward=gif)
    out.backward()
    href = h.detach().double().requires_grad_()
    linear_cross_entropy(href, weight.double(), y).backward()
    assert _rel(out.detach(), ref) < 1e-5 and _rel(hh.grad, href.grad) < 1e-5
    # hidden frozen: only d weight
    ww = wt.detach().clone().requires_grad_()
    fused_linear_cross_entropy(h, ww, y.to(torch.int32), chunk_tokens=6, chunk_vocab=8,
                               grad_in_forward=gif).backward()
    wref = weight.double().requires_grad_()
    linear_cross_entropy(h.double(), wref, y).backward()
    assert _rel(ww.grad, wref.grad) < 1e-5


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_native_half_path_matches_the_unfused_error(monkeypatch, gif):
    """The CUDA path (half operands, fp32 tiles) run on CPU: as accurate as the unfused bf16 loss, within 2x."""
    monkeypatch.setattr(LT, "upcast_operands", lambda t: t.dtype in (torch.float32, torch.float64))
    hidden, weight, labels, b = _problem((48,), 32, 90, torch.bfloat16, bias=True)
    ref, rgrads = _ref64(hidden, weight, labels, b, "mean")
    out, grads = _run(fused_linear_cross_entropy, hidden, weight, labels, b, "mean", chunk_tokens=16, chunk_vocab=32,
                      grad_in_forward=gif)
    uout, ugrads = _run(linear_cross_entropy, hidden, weight, labels, b, "mean")
    assert abs(out.double() - ref) <= 2 * abs(uout.double() - ref) + 1e-3
    for gf, gu, gr in zip(grads, ugrads, rgrads):
        assert (gf.double() - gr).norm() <= 2 * (gu.double() - gr).norm()


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_forward_and_backward_never_hold_the_logits(gif):
    """Peak live bytes (the suite's CPU measurement) stay far below the (T, V) fp32 logits."""
    T, H, V = 1024, 32, 16384                         # logits: 64 MiB in fp32
    # 8 MiB tiles, 8 of them (few ops: the profiler is slow per op): (128, V) rows with the
    # gradients in the forward, 512 x 4096 recomputing.
    ct, cv = (128, V) if gif else (512, 4096)
    hidden, weight, labels, _ = _problem((T,), H, V, torch.float32, ignore_frac=0.0)
    logits_bytes = T * V * 4
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def fused_fwd():
        with torch.no_grad():
            fused_linear_cross_entropy(h, w, labels, chunk_tokens=ct, chunk_vocab=cv)

    def step(fn, **kw):
        def run():
            h.grad = w.grad = None
            fn(h, w, labels, **kw).backward()
        return run

    cpu = torch.device("cpu")
    fwd = measure_peak(fused_fwd, cpu).peak_bytes
    both = measure_peak(step(fused_linear_cross_entropy, chunk_tokens=ct, chunk_vocab=cv, grad_in_forward=gif),
                        cpu).peak_bytes
    unfused = measure_peak(step(linear_cross_entropy), cpu).peak_bytes
    tile = ct * cv * 4
    grads = (T + V) * H * 4                           # d hidden and d W themselves (2.1 MiB)
    assert unfused >= logits_bytes                    # the measurement does see materialised logits
    assert fwd <= tile + (1 << 20)                    # no grad: the recomputing forward, one tile + O(T) vectors
    # Recomputing: + the fp32 d hidden accumulator. In the forward: the fp32 d hidden and d W are the
    # gradients themselves (fp32 inputs), scaled in place and handed over, no copy.
    extra = 0 if gif else T * H * 4
    assert both <= tile + grads + extra + (1 << 20) < logits_bytes // 4


def _count_gemm_work(monkeypatch):
    """Record the multiply-adds of every logits tile and gradient GEMM the fused loss runs."""
    work = []
    logits, gemm_acc = LT.Tiles.logits, LT.Tiles.gemm_acc

    def count_logits(self, t0, t1, w, b, shift=None):
        work.append((t1 - t0) * w.shape[0] * w.shape[1])
        return logits(self, t0, t1, w, b, shift)

    def count_gemm(self, acc, a, b, alpha):
        work.append(a.shape[0] * a.shape[1] * b.shape[1])
        return gemm_acc(self, acc, a, b, alpha)

    monkeypatch.setattr(LT.Tiles, "logits", count_logits)
    monkeypatch.setattr(LT.Tiles, "gemm_acc", count_gemm)
    return work


@pytest.mark.parametrize("gif,gemms", [(True, 3), (False, 4), (None, 3)], ids=["gradfwd", "recompute", "auto"])
def test_head_gemm_count(monkeypatch, gif, gemms):
    """Gradients in the forward: 3 (counted tokens x V x H) GEMMs per step, the unfused loss's count; the
    recomputing path 4 (its backward recomputes every tile). Auto takes the forward path when training."""
    hidden, weight, labels, _ = _problem((50,), 8, 37, torch.float32)
    n = int(count_tokens(labels))
    work = _count_gemm_work(monkeypatch)
    _run(fused_linear_cross_entropy, hidden, weight, labels, None, "mean", chunk_tokens=16, chunk_vocab=10,
         grad_in_forward=gif)
    assert sum(work) == gemms * n * 37 * 8


def test_auto_takes_the_recomputing_path_without_gradients(monkeypatch):
    """No gradient needed (no_grad, or no input requires grad) or reduction "none": one GEMM in the
    forward, lse only (the recomputing path; its backward, if any, does the rest)."""
    hidden, weight, labels, _ = _problem((50,), 8, 37, torch.float32)
    n = int(count_tokens(labels))
    work = _count_gemm_work(monkeypatch)
    with torch.no_grad():
        fused_linear_cross_entropy(hidden.requires_grad_(), weight, labels, chunk_tokens=16, chunk_vocab=10)
    fused_linear_cross_entropy(hidden.detach(), weight, labels, chunk_tokens=16, chunk_vocab=10)
    fused_linear_cross_entropy(hidden, weight, labels, reduction="none", chunk_tokens=16, chunk_vocab=10)
    assert sum(work) == 3 * n * 37 * 8                                 # 3 calls, one GEMM each
    assert len(work) == 3 * -(-n // 16) * 4                             # of (token chunks x 4) lse tiles


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_incoming_gradient_scales_every_gradient(gif, reduction):
    """(loss * 3.7).backward() gives 3.7 times the gradients of loss.backward(), for hidden, weight
    and bias: fails if the gradients kept from the forward were returned unscaled. fp64: exact to
    rounding (1e-12 as in test_fp64_exact)."""
    hidden, weight, labels, b = _problem((2, 13), 8, 29, torch.float64, bias=True)
    ref, rgrads = _ref64(hidden, weight, labels, b, reduction)            # incoming gradient 0.75 (_run)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    loss = fused_linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2], reduction=reduction,
                                      chunk_tokens=5, chunk_vocab=7, grad_in_forward=gif)
    (loss * 3.7).backward()
    for leaf, gr in zip(leaves, rgrads):
        assert _rel(leaf.grad, gr * (3.7 / 0.75)) < 1e-12


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_mean_is_the_sum_over_the_count(gif):
    """The mean's gradients are the sum's over the counted tokens (the 1/count kept in the forward's
    gradients is applied once, not twice or never); fp64, 1e-12."""
    hidden, weight, labels, _ = _problem((40,), 8, 23, torch.float64)
    n = int(count_tokens(labels))
    mean, gm = _run(fused_linear_cross_entropy, hidden, weight, labels, None, "mean", grad_in_forward=gif)
    total, gs = _run(fused_linear_cross_entropy, hidden, weight, labels, None, "sum", grad_in_forward=gif)
    assert 0 < n < 40 and _rel(mean * n, total) < 1e-12
    for a, c in zip(gm, gs):
        assert _rel(a * n, c) < 1e-12


def test_default_rows():
    """The forward path's default rows (GRAD_TILE): a 128 MiB fp32 tile on CPU, at least 512 rows; the
    chunks evened out; a problem of fewer tokens is one chunk."""
    assert L.grad_rows("cpu", 32768) == 1024 and L.grad_rows("cpu", 131072) == 512
    assert L.grad_rows("cuda", 122880) == 1092 and L.grad_rows("mps", 32768) == L.grad_rows("cpu", 32768)
    assert [LT.balanced_rows(n, 1024) for n in (5, 1024, 1025, 8192, 3000)] == [5, 1024, 513, 1024, 1000]
    assert LT.balanced_rows(0, 1024) == 1


def test_second_backward_through_one_graph_is_a_clear_error():
    """The gradients kept from the forward are scaled in place and released by the first backward."""
    hidden, weight, labels, _ = _problem((10,), 8, 13, torch.float32)
    h = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward=False"):
        loss.backward()
    loss = fused_linear_cross_entropy(h, weight, labels, grad_in_forward=False)   # the recomputing path can
    loss.backward(retain_graph=True)
    loss.backward()


# ---------------------------------------------------------------- bad input


def _ok():
    h, w, y, _ = _problem((2, 5), 8, 13, torch.float32, ignore_frac=0.0)
    return {"hidden": h, "weight": w, "labels": y}


BAD = [
    ({"chunk_tokens": 0}, r"chunk_tokens=0 must be a positive int"),
    ({"chunk_vocab": -4}, r"chunk_vocab=-4 must be a positive int"),
    ({"chunk_vocab": 2.0}, r"chunk_vocab=2.0 must be a positive int, got float"),
    ({"chunk_tokens": True}, r"chunk_tokens=True must be a positive int"),
    ({"labels": torch.tensor([[0, 1, 13, 2, 3], [0] * 5])}, r"labels\[0, 2\]=13 is outside the vocabulary.*\[0, 13\)"),
    ({"labels": torch.tensor([[0, 1, 2, 3, 4], [0, -1, 0, 0, 0]])}, r"labels\[1, 1\]=-1 is outside"),
    ({"labels": torch.tensor([[0, 1, 2, 3, 4], [0, -100, 0, 0, 0]]), "ignore_index": -1},
     r"labels\[1, 1\]=-100 is outside.*ignore_index=-1"),
    ({"labels": torch.zeros(2, 4, dtype=torch.long)}, r"labels.shape=\(2, 4\) must equal hidden.shape\[:-1\]=\(2, 5\)"),
    ({"labels": torch.zeros(10, dtype=torch.long)}, r"labels.shape=\(10,\) must equal"),
    ({"labels": torch.zeros(2, 5)}, r"labels.dtype=torch.float32 must be an integer dtype"),
    ({"weight": torch.zeros(13, 7)}, r"weight.shape=\(13, 7\) and hidden.shape=\(2, 5, 8\) must agree"),
    ({"weight": torch.zeros(13, 8, dtype=torch.float64)}, r"weight.dtype=torch.float64 must equal hidden.dtype"),
    ({"weight": torch.zeros(0, 8)}, r"vocabulary must not be empty"),
    ({"weight": torch.zeros(13)}, r"weight.shape=\(13,\) must be 2-D"),
    ({"hidden": torch.zeros(2, 5, 1, 8)}, r"hidden.shape=\(2, 5, 1, 8\) must be 2-D .* or 3-D"),
    ({"hidden": torch.zeros(2, 5, 8, dtype=torch.int32)}, r"hidden.dtype=torch.int32 must be one of"),
    ({"bias": torch.zeros(12)}, r"bias.shape=\(12,\) must be \(vocab,\)=\(13,\)"),
    ({"bias": torch.zeros(13, dtype=torch.float64)}, r"bias.dtype=torch.float64 must equal weight.dtype"),
    ({"reduction": "avg"}, r"reduction='avg' is unknown"),
    ({"ignore_index": -100.0}, r"ignore_index=-100.0 must be an int"),
    ({"grad_in_forward": True, "reduction": "none"}, r"grad_in_forward=True needs reduction 'mean' or 'sum'.*'none'"),
    ({"grad_in_forward": 1}, r"grad_in_forward=1 must be True, False or None"),
    ({"labels": torch.zeros(2, 5, dtype=torch.long, device="meta")}, r"must be on one device"),
]


@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("change,match", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_is_a_value_error(mode, change, match):
    args = {**_ok(), **change}
    kw = {k: args.pop(k) for k in list(args) if k not in ("hidden", "weight", "labels")}
    if mode == "unfused" and {"chunk_tokens", "chunk_vocab", "grad_in_forward"} & set(kw):
        pytest.skip("the unfused loss has no tiles and no gradient path to choose")
    with pytest.raises(ValueError, match=match):
        M.get_loss_mode(mode)(args["hidden"], args["weight"], args["labels"], **kw)


def test_valid_ignore_index_inside_the_vocabulary_is_ignored():
    a = _ok()
    y = a["labels"].clone()
    y[0, 0] = 3
    out = fused_linear_cross_entropy(a["hidden"], a["weight"], y, ignore_index=3, reduction="none")
    ref = linear_cross_entropy(a["hidden"], a["weight"], y, ignore_index=3, reduction="none")
    assert out[0, 0] == 0 and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- registry and peer adapters


def test_registry_names_and_availability_on_cpu(monkeypatch):
    assert list(M.LOSS_MODES) == ["unfused", "fused", "fused_recompute", "liger", "cce"]
    assert M.get_loss_mode("fused_recompute").options == {"grad_in_forward": False}
    assert M.get_loss_mode("fused").available() and M.get_loss_mode("unfused").available()
    with pytest.raises(ValueError, match=r"loss='chunked' is unknown; registered: \['cce', 'fused'"):
        M.get_loss_mode("chunked")
    monkeypatch.setattr(M, "_cuda_present", lambda: False)
    for name in ("liger", "cce"):
        assert not M.LOSS_MODES[name].available()
        assert "CUDA" in M.LOSS_MODES[name].unavailable()
    monkeypatch.setattr(M, "_cuda_present", lambda: True)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)      # import fails
    assert "not importable" in M.LOSS_MODES["cce"].unavailable()


@pytest.mark.parametrize("name", ["liger", "cce"])
def test_peer_adapters_reject_cpu_tensors_and_bad_input(name):
    a = _ok()
    with pytest.raises(ValueError, match=f"loss mode '{name}' needs CUDA tensors"):
        M.LOSS_MODES[name](a["hidden"], a["weight"], a["labels"])
    with pytest.raises(ValueError, match=r"labels\[0, 0\]=99 is outside"):
        M.LOSS_MODES[name](a["hidden"], a["weight"], torch.full_like(a["labels"], 99))


def _fake_peers(monkeypatch, calls):
    """Stand-ins for the two packages that check argument order and compute the unfused loss."""
    class FakeLiger:
        def __init__(self, ignore_index=-100, reduction="mean"):
            self.ignore_index, self.reduction = ignore_index, reduction

        def __call__(self, lin_weight, _input, target, bias=None):
            calls.append(("liger", lin_weight.shape, _input.shape, target.shape))
            assert lin_weight.dim() == 2 and _input.dim() == 2 and lin_weight.shape[1] == _input.shape[1]
            return F.cross_entropy(F.linear(_input, lin_weight, bias).float(), target,
                                   ignore_index=self.ignore_index, reduction=self.reduction)

    def fake_cce(e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean", shift=0,
                 impl="cce", **_):
        calls.append(("cce", e.shape, c.shape, targets.shape, impl))
        assert e.shape[:-1] == targets.shape and c.shape[1] == e.shape[-1]
        out = F.cross_entropy(F.linear(e, c, bias).flatten(0, -2).float(), targets.flatten(),
                              ignore_index=ignore_index, reduction=reduction)
        return out.view(targets.shape) if reduction == "none" else out

    liger_mod = types.ModuleType(M.LIGER_MODULE)
    liger_mod.LigerFusedLinearCrossEntropyLoss = FakeLiger
    cce_mod = types.ModuleType(M.CCE_MODULE)
    cce_mod.linear_cross_entropy = fake_cce
    monkeypatch.setitem(sys.modules, M.LIGER_MODULE, liger_mod)
    monkeypatch.setitem(sys.modules, M.CCE_MODULE, cce_mod)
    monkeypatch.setattr(M, "_cuda_present", lambda: True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["liger", "cce"])
def test_peer_adapters_pass_arguments_in_each_packages_order(monkeypatch, name, reduction):
    calls = []
    _fake_peers(monkeypatch, calls)
    monkeypatch.setattr(M, "_check_peer", lambda *a: L.check_loss_inputs(*a[1:4], bias=a[4], ignore_index=a[5],
                                                                           reduction=a[6]))
    assert M.LOSS_MODES[name].available()
    hidden, weight, labels, b = _problem((2, 9), 8, 21, torch.float32, bias=True)
    out, n = M.LOSS_MODES[name](hidden, weight, labels, bias=b, reduction=reduction, return_count=True)
    ref = linear_cross_entropy(hidden, weight, labels, bias=b, reduction=reduction)
    assert out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert int(n) == int(count_tokens(labels))
    if name == "liger":
        assert calls == [("liger", (21, 8), (18, 8), (18,))]
    else:
        assert calls == [("cce", (2, 9, 8), (21, 8), (2, 9), "cce")]


@pytest.mark.parametrize("kw,match", [(dict(repeats=0), "repeats=0"), (dict(repeats=2, warmup=-1), "warmup=-1")])
def test_loss_bench_refuses_an_empty_measurement(kw, match):
    """``--repeats 0`` used to fail later with a KeyError in the table; now a ValueError before any work."""
    from experiments.benches.loss_bench import run

    with pytest.raises(ValueError, match=match):
        run([], torch.device("cpu"), **{"warmup": 1, **kw})


@pytest.mark.parametrize("gif", [True, False], ids=["gradfwd", "recompute"])
def test_gradients_in_the_forward_do_not_keep_hidden(gif):
    """With its gradient computed in the forward, hidden is not kept for the backward (the final norm's
    output is freed when the forward returns); the recomputing path needs it. Checked with a weak
    reference to a non-leaf hidden."""
    import gc
    import weakref

    hidden, weight, labels, _ = _problem((12,), 8, 15, torch.float32)
    x = hidden.clone().requires_grad_()
    h = x * 2.0                                                   # MulBackward by a scalar keeps no tensor
    ref = weakref.ref(h)
    loss = fused_linear_cross_entropy(h, weight, labels, grad_in_forward=gif)
    del h
    gc.collect()
    assert (ref() is None) == gif
    loss.backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())

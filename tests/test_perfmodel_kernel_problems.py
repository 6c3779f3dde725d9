"""The hardware cost model's flash kernels by the problems they hold (experiments/perfmodel/costs.py,
``kernel_problems``): a varlen tile is its documents, each at its own length; a partial thread-block tile
costs a whole one; a band runs at its width. On the H100 profile (FlashAttention-2's sourced table)."""
from __future__ import annotations

import pytest

from baselines import AttnShape
from burst_impl.flops import mask_area
from burst_impl.kernels.common import TileMask
from burst_impl.plan import local_plan
from experiments.perfmodel import predict_case
from experiments.perfmodel.costs import CostModel
from experiments.profiles.hardware import load_hardware

REL = 1e-12          # sums of the same float terms in another order


@pytest.fixture(scope="module")
def h100():
    return CostModel(load_hardware("h100_sxm_ib_8x8"))


@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_varlen_tile_of_k_equal_documents_costs_k_documents(h100, mode, causal):
    """8 documents of 1000 tokens in one varlen call cost 8 x one 1000-token causal (full) kernel. Costed at the
    tile's size as before (8000 tokens: fwd+bwd efficiency 0.335 against 0.284 at 1024, no partial tiles), it was
    1.11x (forward) to 1.28x (backward) too cheap."""
    k, n = 8, 1000
    cu = tuple(range(0, k * n + 1, n))
    entries = k * (n * (n + 1) // 2 if causal else n * n)
    tm = TileMask("varlen" if causal else "varlen_full", k * n, k * n, cu=cu)
    t, f = h100.attention(1, 8, 128, k * n, k * n, False, mode, entries=entries, mask=tm)
    one, _ = h100.attention(1, 8, 128, n, n, causal, mode)
    assert t == pytest.approx(k * one, rel=REL)
    assert f == pytest.approx(4 * 8 * 128 * entries * {"forward": 1, "backward": 2.5, "fwd_bwd": 3.5}[mode])
    tile_size = f / (h100.peak * h100.attn_efficiency(k * n, mode))     # the tile-size cost it replaces
    assert t > 1.1 * tile_size


def test_a_partial_thread_block_tile_costs_a_whole_one(h100):
    """FlashAttention-2 at head dim 128: 128 x 64 tiles forward, 64 x 128 backward. 100 query rows run one
    whole 128-row tile forward (two 64-row tiles backward): the time of 128 rows, the FLOPs of 100."""
    for mode in ("forward", "backward", "fwd_bwd"):
        t100, f100 = h100.attention(1, 8, 128, 100, 8192, False, mode)
        t128, f128 = h100.attention(1, 8, 128, 128, 8192, False, mode)
        assert t100 == pytest.approx(t128, rel=REL) and f100 == pytest.approx(f128 * 100 / 128)
    # sides that are whole tiles cost exactly what the table says (every paper-size ring step)
    t, f = h100.attention(1, 8, 128, 8192, 8192, True, "fwd_bwd")
    assert t == pytest.approx(f / (h100.peak * h100.attn_efficiency(8192, "fwd_bwd")), rel=REL)


def test_a_band_runs_at_its_width_not_the_tile_size(h100):
    """A causal window of 1024 on a 16K x 16K tile: its live entries at the efficiency of 1025 keys per row."""
    n, w = 16384, 1024
    tm = TileMask("band", n, n, lo=-w, hi=0)
    entries = sum(min(i, w) + 1 for i in range(n))
    t, f = h100.attention(1, 8, 128, n, n, False, "fwd_bwd", entries=entries, mask=tm)
    assert t == pytest.approx(f / (h100.peak * h100.attn_efficiency(w + 1, "fwd_bwd")), rel=REL)


def test_ulysses_runs_the_local_plans_tiles(h100):
    """Ulysses' whole-sequence kernel is the local plan's (burst_impl.local runs it): a pack of documents is one
    varlen call, costed by its documents; the FLOPs stay the mask's area."""
    N, G = 16384, 2
    s = AttnShape(batch=1, seqlen=N, heads=8, kv_heads=8, head_dim=128, world_size=G, dtype="bfloat16",
                  causal=True, layout="contiguous", mask="docs:512:0")
    (tile,) = local_plan(s.attn_mask, N).tiles
    assert tile.kind == "varlen"
    docs = [b - a for a, b in zip(tile.mask.cu, tile.mask.cu[1:])]
    # one doc's kernel each, for Z/G heads, forward and backward
    expect = sum(h100.attention(1, 8 // G, 128, n, n, True, m)[0] for n in docs for m in ("forward", "backward"))
    hw = load_hardware("h100_sxm_ib_8x8")
    p = predict_case("ulysses", s, mode="fwd_bwd", level="op", hardware=hw, keep_schedule=True)
    attn = [t for t in p.schedule.tasks if t.name.startswith("attn_") and t.rank == 0]
    assert sum(t.duration for t in attn) == pytest.approx(expect, rel=1e-9)
    # the rank's FLOPs: Z/G heads over the whole mask's area, forward + backward
    assert sum(t.flops for t in attn) == pytest.approx(4 * 128 * (8 // G) * mask_area(s) * 3.5, rel=1e-9)


# ---------------------------------------------------------------- the emulated cluster's kernel table


def _ulysses_docs_record(seqlen: int = 1024, mask: str = "docs:32:0") -> dict:
    """A forward Ulysses record on the synthetic 2 x 1 emulated run, with a pack of ~32 documents: its whole
    sequence is one varlen tile (more than burst_impl.masks.MAX_DOC_PIECES documents)."""
    from experiments.perfmodel.emulated import validate
    from tests.emulated_records import emulated_record
    s = AttnShape(batch=1, seqlen=seqlen, heads=2, kv_heads=2, head_dim=8, world_size=2, dtype="float32",
                  causal=True, layout="contiguous", mask=mask)
    return {**emulated_record(seqlen, "ulysses", 1.0), **{k: getattr(s, k) for k in validate.SHAPE_KEYS},
            "case_id": f"ulysses.N{seqlen}.{mask}"}


def test_the_kernel_table_times_a_varlen_tile_as_itself(tmp_path):
    """The model asks the table for the varlen tile itself (its documents in the key), the key survives the
    table's JSON, and the prediction moves by exactly its time: it is used, not the unmasked tile scaled."""
    from experiments.perfmodel.emulated import validate
    from experiments.perfmodel.emulated.measured import HBM, KernelTimes
    rec = _ulysses_docs_record()
    keys = validate.needed_keys([rec])
    (masked,) = [k for k in keys if k[0] == "masked"]
    (tile,) = local_plan(AttnShape(batch=1, seqlen=1024, heads=2, kv_heads=2, head_dim=8, world_size=2,
                                   dtype="float32", causal=True, mask="docs:32:0").attn_mask, 1024).tiles
    assert masked == ("masked", 1, 1, 8, 1024, 1024, "varlen", None, None, tile.mask.cu, "forward", "float32")
    assert not any(k[0] == "attention" and k[4] == 1024 for k in keys)     # no unmasked stand-in asked for
    base = {k: (1e-12 if k == HBM else 0.0) for k in keys}

    def predicted(t: float) -> float:
        times = KernelTimes.load(KernelTimes(1, 1, {**base, masked: t}).save(tmp_path / "kt.json"))
        return validate.compare([rec], times, rescale=False)[0]["predicted_s"]
    assert predicted(0.7) - predicted(0.2) == pytest.approx(0.5, rel=1e-9)


def test_a_band_tile_is_asked_for_as_itself_and_timed_for_real():
    """A sliding window's band tiles are their own keys (the window in them), and the table's runner does such
    a key's work with the suite's exact masked path (``measure`` times the runner: test_perfmodel_validate)."""
    from unittest import mock

    from burst_impl.kernels import masked as exact
    from experiments.perfmodel.emulated import validate
    from experiments.perfmodel.emulated.measured import _runner
    keys = validate.needed_keys([_ulysses_docs_record(512, "window:16:0")])
    (band,) = [k for k in keys if k[0] == "masked"]
    assert band == ("masked", 1, 1, 8, 512, 512, "band", -16, 0, None, "forward", "float32")
    varlen = ("masked", 1, 1, 8, 32, 32, "varlen", None, None, (0, 10, 32), "backward", "float32")
    for key in (band, varlen):
        run = _runner(key)
        with mock.patch.object(exact, "segments", wraps=exact.segments) as seg:
            run()
        assert seg.called            # the tile's live row segments: the masked path, not the plain kernel


def test_causal_problems_at_the_profiles_causal_tables():
    """With ``attn_efficiency_causal`` a causal tile and a varlen-causal tile's documents are charged at it;
    full tiles, varlen-full documents and bands stay at the full table; without it, nothing changes."""
    import dataclasses

    from burst_impl.kernels import TileMask
    from experiments.perfmodel.costs import CostModel, kernel_problems
    from experiments.profiles.hardware import load_hardware

    hw = load_hardware("h200_sxm_ib_4x8")
    plain = dataclasses.replace(hw, accelerator=dataclasses.replace(
        hw.accelerator, attn_efficiency_causal=None, attn_efficiency_causal_forward=None))
    docs = TileMask("varlen", 4096, 4096, cu=(0, 1024, 4096))
    assert [c for _, _, c in kernel_problems(4096, 4096, True, "fwd_bwd", 0, docs)] == [True, True]
    assert [c for _, _, c in kernel_problems(4096, 4096, False, "fwd_bwd", 0, None)] == [False]
    for mode in ("forward", "backward", "fwd_bwd"):
        for causal, mask in ((True, None), (False, docs)):
            with_t, _ = CostModel(hw).attention(1, 8, 128, 4096, 4096, causal, mode, mask=mask)
            without, _ = CostModel(plain).attention(1, 8, 128, 4096, 4096, causal, mode, mask=mask)
            assert with_t > without, (mode, causal)       # the causal rows are below the full ones here
        full = TileMask("varlen_full", 4096, 4096, cu=(0, 1024, 4096))
        assert CostModel(hw).attention(1, 8, 128, 4096, 4096, False, mode, mask=full) == \
            CostModel(plain).attention(1, 8, 128, 4096, 4096, False, mode, mask=full)
    acc = hw.accelerator
    assert CostModel(hw).attn_efficiency(1024, "fwd_bwd", True) == dict(acc.attn_efficiency_causal)[1024]
    assert CostModel(hw).attn_efficiency(1024, "forward", True) == dict(acc.attn_efficiency_causal_forward)[1024]


def test_a_causal_forward_table_alone_is_refused():
    import pytest
    import yaml

    from experiments.profiles.hardware import HARDWARE_DIR, parse_hardware

    raw = yaml.safe_load((HARDWARE_DIR / "h200_sxm_ib_4x8.yaml").read_text())
    del raw["accelerator"]["attn_efficiency_causal"]
    with pytest.raises(ValueError, match="attn_efficiency_causal_forward.*needs accelerator.attn_efficiency_causal"):
        parse_hardware(raw)

"""The model's validation on our own measurements (experiments/perfmodel/emulated/: validate.py, measured.py).

Synthetic emulated records with hand-set kernel times: the predicted time is
checked against a hand-computed G=2 ring schedule, the error against its
definition (predicted / measured - 1), the verdict against the 20% target at
the two largest N, and the load scale against the run's calibration.
"""
from __future__ import annotations

import json

import pytest

from baselines import AttnShape, get
from experiments.cluster.report import with_model, write_report
from experiments.perfmodel.emulated import excess, validate
from experiments.perfmodel.emulated.costs import EmulatedCosts
from experiments.perfmodel.emulated.hardware import emulated_hardware
from experiments.perfmodel.emulated.measured import HBM, KernelTimes, measure
from experiments.perfmodel.schedules.common import merge_bytes
from tests._helpers import write_rows
from tests.emulated_records import RATE
from tests.emulated_records import emulated_cluster as _cluster
from tests.emulated_records import emulated_record as _record

ATTN = 0.25          # s per forward kernel call (set by hand)
PER_BYTE = 1e-9      # s per byte of memory traffic (1 GB/s)


def _times(records, attn: float = ATTN) -> KernelTimes:
    keys = validate.needed_keys(records)
    sec = {k: (PER_BYTE if k == HBM else attn) for k in keys}
    return KernelTimes(procs=2, threads=1, seconds=sec)


def _hand_burst_forward(seqlen: int) -> float:
    """G=2 ring, forward, full mask: step 0 computes on the own block while K, V go to the other node;
    step 1 starts when both are done, computes and merges (O, lse) in fp32."""
    shape = AttnShape(batch=1, seqlen=seqlen, heads=2, kv_heads=2, head_dim=8, world_size=2, dtype="float32",
                      causal=False, layout="contiguous")
    sent = sum(v for (p, _), v in get("burst").bytes(shape).items() if p == "forward")
    local = seqlen // 2
    return max(ATTN, sent / RATE) + ATTN + merge_bytes(1, local, 2, 8, 4) * PER_BYTE


def test_compare_reproduces_a_hand_computed_g2_ring():
    # N=4096: K, V of 2048 tokens x 2 heads x 8 x fp32 = 262144 B -> 0.26 s > ATTN: comm-bound step 0
    recs = [_record(4096, "burst", 1.0), _record(256, "burst", 0.6)]
    rows = validate.compare(recs, _times(recs), rescale=False)
    by_n = {r["seqlen"]: r for r in rows}
    for n in (256, 4096):
        assert by_n[n]["predicted_s"] == pytest.approx(_hand_burst_forward(n), rel=1e-9)
    assert _hand_burst_forward(4096) > 2 * ATTN + 0.01          # the transfer, not the kernel, set step 0
    assert _hand_burst_forward(256) == pytest.approx(2 * ATTN, rel=1e-3)   # compute-bound: transfer hidden
    r = by_n[4096]
    assert r["error"] == pytest.approx(r["predicted_s"] / 1.0 - 1, rel=1e-12)
    assert r["ratio"] == pytest.approx(r["predicted_s"], rel=1e-12)


def test_error_table_judges_the_two_largest_n_only():
    hand = {n: _hand_burst_forward(n) for n in (256, 1024, 4096)}
    # within 20% at 1024 and 4096 (+10%, -15%); 256 is far off but not judged
    recs = [_record(4096, "burst", hand[4096] / 1.10), _record(1024, "burst", hand[1024] / 0.85),
            _record(256, "burst", hand[256] * 3)]
    rep = validate.error_table(validate.compare(recs, _times(recs), rescale=False))
    assert rep["largest_n"] == [1024, 4096]
    assert rep["met"] and rep["worst_abs_error"] == pytest.approx(0.15, rel=1e-6)
    assert "met (worst 15.0%)" in rep["text"] and "OUT" not in rep["text"]
    # the judged rows' spread, at each bound issues set on the model (+10% and -15%, each on a bound as rounded;
    # N=256 is not judged)
    assert "2 within 15%, 2 within 20%; median |error| 12.5%" in rep["text"] and "of the 2 judged rows" in rep["text"]
    # one case at +25% fails the target, and the table says which
    recs[0] = _record(4096, "burst", hand[4096] / 1.25)
    rep = validate.error_table(validate.compare(recs, _times(recs), rescale=False))
    assert not rep["met"] and rep["worst_abs_error"] == pytest.approx(0.25, rel=1e-6)
    assert "NOT met" in rep["text"] and rep["text"].count("OUT") == 1


def test_load_scale_carries_the_table_to_the_run():
    # the run's calibration did 4*512^2*2*8*3.5 FLOPs at a rate that takes 2x the table's time for it
    cal = {"tokens": 512, "heads": 2, "head_dim": 8, "dtype": "float32"}
    key = ("attention", 1, 2, 8, 512, 512, False, "fwd_bwd", "float32")
    flops = 4 * 512 * 512 * 2 * 8 * 3.5
    cal["per_rank_flops_s"] = flops / 0.2
    recs = [_record(256, "burst", 1.0, _cluster(cal))]
    times = _times(recs)
    assert key in times.seconds             # needed_keys asks for the calibration work too
    times = KernelTimes(2, 1, {**times.seconds, key: 0.1})
    assert validate.load_scale(recs[0]["cluster"], times) == pytest.approx(2.0)
    slow = validate.compare(recs, times)[0]["predicted_s"]
    assert slow == pytest.approx(2 * validate.compare(recs, times, rescale=False)[0]["predicted_s"])


def test_measured_costs_refuse_unmeasured_work_and_round_trip(tmp_path):
    recs = [_record(256, "burst", 1.0)]
    times = _times(recs)
    back = KernelTimes.load(times.save(tmp_path / "t.json"))
    assert back.seconds == times.seconds
    hw = emulated_hardware(recs[0]["cluster"], "float32")
    with pytest.raises(KeyError, match="no measured time"):
        EmulatedCosts(hw, "float32", times=back).attention(1, 2, 8, 100, 100, False, "forward")
    with pytest.raises(ValueError, match="not an emulated run"):
        emulated_hardware({"emulated": False, "summary": "loopback"}, "float32")


def test_report_appends_the_model_table(tmp_path):
    """``with_model`` reads kernel_times.json next to the records (nothing measured) and appends the table."""
    recs = [_record(4096, "burst", 0.8), _record(256, "burst", 0.5)]
    d = tmp_path / "t_emu"
    d.mkdir()
    write_rows(d / "results.jsonl", [{**r, "experiment": "t_emu"} for r in recs])
    _times(recs).save(d / validate.KERNEL_TIMES_FILE)
    rep = with_model({"experiment": "t_emu", "text": "ratios"}, tmp_path, measure_missing=False)
    assert rep["text"].startswith("ratios\n\nperformance model")
    assert {r["seqlen"] for r in rep["model"]["rows"]} == {256, 4096}
    # written where a run writes it (the figure needs a full report's rows: tests/test_figures_style.py)
    (path,) = write_report(rep, tmp_path)
    assert path == d / "emulation_report.txt" and path.read_text().startswith(rep["text"] + "\nwritten by commit ")


def test_measure_times_real_work():
    key = ("attention", 1, 1, 8, 32, 48, True, "backward", "float32")
    t = measure([key, HBM], procs=1, threads=1, seconds=0.01, rounds=2)
    assert t.seconds[key] > 0 and 0 < t.seconds[HBM] < 1e-6   # more than 1 MB/s of memory traffic
    assert len(t.samples[key]) == 2                            # one per process and round


def test_a_capped_table_keeps_cpu_seconds_at_the_cap_and_its_clock(tmp_path):
    """Under a cap the table keeps each call's process CPU / the cap (the wall medians beside it); an uncapped one
    and a table from before the clock was recorded keep wall seconds; a missing key is timed on the table's clock."""
    key = ("attention", 1, 1, 8, 32, 48, True, "forward", "float32")
    with pytest.raises(ValueError, match="clock='cpu' must be one of cpu, wall; 'cpu' only with a cap"):
        measure([key], procs=1, threads=1, clock="cpu")
    with pytest.raises(ValueError, match="clock='tsc'"):
        measure([key], procs=1, threads=1, cpus=0.5, clock="tsc")
    t = measure([key], procs=1, threads=1, seconds=0.01, rounds=1)
    assert t.clock == "wall" and t.wall == {}
    capped = KernelTimes(1, 1, {key: 2e-3}, samples={key: [2e-3]}, cpus=0.25, clock="cpu", wall={key: 1.9e-3})
    back = KernelTimes.load(capped.save(tmp_path / "kt.json"))
    assert back == capped
    old = capped.to_json()
    del old["clock"]
    assert KernelTimes.from_json(old).clock == "wall"       # tables before 2026-12-07 were timed on the wall clock


def test_missing_keys_are_timed_on_the_tables_own_clock(tmp_path, monkeypatch):
    from experiments.perfmodel.emulated import validate as V
    key, other = (("attention", 1, 1, 8, 32, n, True, "forward", "float32") for n in (32, 48))
    KernelTimes(2, 1, {key: 1e-3}, cpus=0.25, clock="wall").save(tmp_path / V.KERNEL_TIMES_FILE)
    asked = {}

    def fake(keys, **kw):
        asked.update(kw)
        return KernelTimes(2, 1, {k: 2e-3 for k in keys}, cpus=kw["cpus"], clock=kw["clock"])
    monkeypatch.setattr(V, "measure", fake)
    quota = {"applied": True, "cpus_per_rank": 0.25}
    case = type("C", (), {"shape": type("S", (), {"world_size": 2})(),
                          "rec": {"cluster": {"ranks_per_node": 1, "cpu_quota": quota}}})
    t = V.kernel_times(tmp_path, [case], {key, other})
    assert asked["clock"] == "wall" and t.clock == "wall" and t.seconds[other] == 2e-3
    # a table timed afresh under the run's cap is on the CPU clock: test_perfmodel_host's table-under-cap test


def test_a_cpu_table_keeps_each_calls_cpu_over_the_cap_and_the_wall_beside():
    """``table_of`` on two processes' [wall, CPU] samples of two rounds: the CPU clock divides CPU by the cap, the
    wall clock keeps the wall; medians over processes and rounds."""
    from experiments.perfmodel.emulated.measured import table_of
    key = ("attention", 1, 1, 8, 32, 32, True, "forward", "float32")
    per_proc = [[[[0.010, 0.002], [0.014, 0.003]]], [[[0.012, 0.002], [0.016, 0.004]]]]
    t = table_of([key], per_proc, procs=2, threads=1, cpus=0.25, clock="cpu")
    assert t.samples[key] == pytest.approx([0.008, 0.012, 0.008, 0.016])
    assert t.seconds[key] == pytest.approx(0.010) and t.wall[key] == pytest.approx(0.013) and t.clock == "cpu"
    w = table_of([key], per_proc, procs=2, threads=1, cpus=None, clock="wall")
    assert w.seconds[key] == pytest.approx(0.013) and w.wall == {} and w.cpus is None


def test_a_run_without_calibration_is_not_compared_automatically(tmp_path):
    recs = [_record(256, "burst", 0.5)]           # given link rates: no calibration in the cluster block
    d = tmp_path / "t_emu"
    d.mkdir()
    write_rows(d / "results.jsonl", [{**r, "experiment": "t_emu"} for r in recs])
    with pytest.raises(ValueError, match="no compute calibration"):
        validate.validate_experiment(tmp_path, "t_emu", require_calibration=True)


def test_a_records_mask_reaches_the_model():
    """A sliding-window record is predicted with its mask (a fraction of the causal work): the mask is one
    of the shape keys read from the record, and the table names each row's layout and mask."""
    recs = [_record(4096, "burst", 1.0), _record(4096, "burst", 1.0)]
    recs[1] = {**recs[1], "causal": True, "mask": "window:64:0", "case_id": "burst.N4096.window"}
    recs[0] = {**recs[0], "causal": True}
    # hand-set times: every kernel call costs ATTN whatever its size, so compare the live work instead
    rows = validate.compare(recs, _times(recs), rescale=False)
    windowed = [k for k in validate.needed_keys([recs[1]]) if k[0] == "attention"]
    causal = [k for k in validate.needed_keys([recs[0]]) if k[0] == "attention"]
    assert windowed != causal           # different block shapes: the window trims the tiles
    rep = validate.error_table(rows)
    assert "window:64:0" in rep["text"] and "case" in rep["text"]


def test_a_measured_causal_kernel_is_not_halved_again():
    """A causal key is timed on the causal work: asked for with its own live entries (half the tile, as
    Ulysses' whole-sequence kernel passes mask_area) it costs the measured time, not half of it; a
    masked tile of a non-causal key scales against the whole tile. (Ulysses was predicted 38% low.)"""
    hw = emulated_hardware(_cluster(), "float32")
    causal = ("attention", 1, 2, 8, 64, 64, True, "forward", "float32")
    full = ("attention", 1, 2, 8, 64, 64, False, "forward", "float32")
    mc = EmulatedCosts(hw, "float32", times=KernelTimes(1, 1, {causal: 0.3, full: 0.5}))
    assert mc.attention(1, 2, 8, 64, 64, True, "forward")[0] == pytest.approx(0.3)
    assert mc.attention(1, 2, 8, 64, 64, True, "forward", entries=64 * 64 / 2)[0] == pytest.approx(0.3)
    assert mc.attention(1, 2, 8, 64, 64, True, "forward", entries=64 * 64 / 4)[0] == pytest.approx(0.15)
    assert mc.attention(1, 2, 8, 64, 64, False, "forward", entries=64 * 64 / 4)[0] == pytest.approx(0.125)
    # and the Ulysses schedule charges its kernels at the table's time
    shape = AttnShape(batch=1, seqlen=64, heads=4, kv_heads=4, head_dim=8, world_size=2, dtype="float32",
                      causal=True, layout="contiguous")
    rec = {"status": "ok", "method": "ulysses", "mode": "forward", "level": "op", "case_id": "u",
           "cluster": _cluster(), "time_median_s": 1.0, **{k: getattr(shape, k) for k in validate.SHAPE_KEYS}}
    keys = validate.needed_keys([rec])
    assert causal in keys
    sec = {k: (0.0 if k == HBM else 0.3 if k == causal else 0.0) for k in keys}
    row = validate.compare([rec], KernelTimes(1, 1, sec), rescale=False)[0]
    assert row["predicted_s"] - row["critical_comm_s"] == pytest.approx(0.3, rel=1e-9)


def test_ring_rsa_asks_for_its_softmax_and_both_gemm_shapes():
    """ring_rsa's CPU-bound pieces are measured as themselves: the softmax over the (N/G x N) rows in
    each direction, the score blocks stored into those rows, and its other GEMMs in their real shape
    (head-dim output)."""
    shape = AttnShape(batch=1, seqlen=64, heads=2, kv_heads=2, head_dim=8, world_size=2, dtype="float32",
                      causal=True, layout="contiguous")
    rec = {"status": "ok", "method": "ring_rsa", "mode": "fwd_bwd", "level": "op", "case_id": "r",
           "cluster": _cluster(), "time_median_s": 1.0, **{k: getattr(shape, k) for k in validate.SHAPE_KEYS}}
    keys = validate.needed_keys([rec])
    assert {("softmax", 2, 32, 64, m, "float32") for m in ("forward", "backward")} <= keys
    assert {("scores", 2, 32, 32, 8, 64, "float32"), ("gemm", 64, 8, 32, "float32")} <= keys
    assert ("gemm", 64, 32, 8, "float32") not in keys        # the score blocks are not plain GEMMs
    t = measure([("softmax", 2, 32, 64, "forward", "float32"), ("softmax", 2, 32, 64, "backward", "float32"),
                 ("scores", 2, 32, 32, 8, 64, "float32")], procs=1, threads=1, seconds=0.01, rounds=1)
    assert all(v > 0 for v in t.seconds.values())


def test_overlap_excess_lengthens_a_hidden_transfer_only(tmp_path):
    # the G=2 ring of the hand schedule with a measured excess on the inter link: step 0 computes
    # excess + ATTN beside its transfer, so a compute-bound step (N=256) gets the excess and a
    # comm-bound one (N=4096: the 0.26 s transfer > ATTN + excess) does not
    shape = AttnShape(batch=1, seqlen=256, heads=2, kv_heads=2, head_dim=8, world_size=2, dtype="float32",
                      causal=False, layout="contiguous")
    sent = sum(v for (p, _), v in get("burst").bytes(shape).items() if p == "forward")
    a, k = 0.004, 2e-8
    recs = [_record(4096, "burst", 1.0), _record(256, "burst", 0.6)]
    rows = {r["seqlen"]: r for r in validate.compare(recs, _times(recs), rescale=False,
                                                     excess={"inter": (a, k)})}
    assert rows[256]["predicted_s"] == pytest.approx(_hand_burst_forward(256) + a + k * sent, rel=1e-9)
    assert rows[4096]["predicted_s"] == pytest.approx(_hand_burst_forward(4096), rel=1e-9)
    # the probe's file in the results root is what validate_experiment fits and uses; another profile's is ignored
    rows_ = [{"pattern": "pair", "bytes": b, "cpu_excess_s": a + k * b} for b in (1 << 19, 1 << 21)]
    (tmp_path / excess.OVERLAP_FILE).write_text(json.dumps({"profile": "t_emu", "rows": rows_}))
    got = excess.load_excess(tmp_path, "t_emu")["fit"]["inter"]
    assert got == pytest.approx((a, k), rel=1e-9)
    assert excess.load_excess(tmp_path, "another_profile") is None
    # a probe record from before the CPU excess was measured is refused, with what to run
    (tmp_path / excess.OVERLAP_FILE).write_text(json.dumps({"profile": "t_emu", "rows": [
        {"pattern": "pair", "bytes": 1 << 19, "excess_s": a}]}))
    with pytest.raises(ValueError, match="cpu_excess_s.*experiments.cluster overlap t_emu"):
        excess.load_excess(tmp_path, "t_emu")


def test_fit_excess_keeps_both_terms_non_negative():
    line = [{"pattern": "ring", "bytes": 1e6, "cpu_excess_s": 0.003},
            {"pattern": "ring", "bytes": 3e6, "cpu_excess_s": 0.007}]
    assert excess.fit_excess(line)["intra"] == pytest.approx((0.001, 2e-9))
    # a line with a negative intercept goes through the origin instead; one size: all of it per byte
    steep = [{"pattern": "pair", "bytes": 1e6, "cpu_excess_s": 0.001},
             {"pattern": "pair", "bytes": 2e6, "cpu_excess_s": 0.005}]
    a, k = excess.fit_excess(steep)["inter"]
    assert a == 0 and k == pytest.approx((1e6 * 0.001 + 2e6 * 0.005) / (1e12 + 4e12))
    one = excess.fit_excess([{"pattern": "ring", "bytes": 2e6, "cpu_excess_s": 0.004}])
    assert one == {"intra": (0.0, pytest.approx(2e-9))}
    # the one-way case fits the line of a flat ring's edge hop, apart from the pair exchange's
    both = excess.fit_excess(steep + [{"pattern": "oneway", "bytes": 2e6, "cpu_excess_s": 0.002}])
    assert both["inter"] == (a, k) and both["inter_oneway"] == (0.0, pytest.approx(1e-9))
    # a measured excess below 0 (noise: both faster than the slower of the two) counts as none
    assert excess.fit_excess([{"pattern": "ring", "bytes": 2e6, "cpu_excess_s": -0.001}])["intra"] == (0.0, 0.0)


def test_a_probe_with_a_light_block_beside_a_hop_size_fits_a_plane_in_the_compute_beside_it():
    # excess = 1 ms + 2 ns/B + 0.1 x the compute beside the hop (CPU at the cap 0.25); 128 KiB beside a 16- and a
    # 512-token block, 2 MiB beside a 1024-token one
    a, k, c, cpus = 0.001, 2e-9, 0.1, 0.25

    def row(tokens, nbytes, compute_cpu, pattern="ring"):
        return {"pattern": pattern, "tokens": tokens, "bytes": nbytes, "compute_cpu_s": compute_cpu,
                "cpu_excess_s": a + k * nbytes + c * compute_cpu / cpus}
    rows = [row(16, 1 << 17, 0.0003), row(512, 1 << 17, 0.02), row(1024, 1 << 21, 0.07)]
    assert excess.fit_excess(rows, cpus)["intra"] == pytest.approx((a, k, c), rel=1e-6)
    # without the cap, or without two blocks beside one hop size, the line in bytes of probes before
    assert len(excess.fit_excess(rows)["intra"]) == 2
    assert len(excess.fit_excess(rows[1:], cpus)["intra"]) == 2
    # a hop that costs less beside more compute (noise) gets no compute term, not a negative one
    down = [row(16, 1 << 17, 0.0003), {**row(512, 1 << 17, 0.02), "cpu_excess_s": 0.0005}, row(1024, 1 << 21, 0.07)]
    assert excess.fit_excess(down, cpus)["intra"][2] == 0.0 and min(excess.fit_excess(down, cpus)["intra"]) >= 0
    assert "0.100 x the compute beside it" in excess.excess_text(excess.fit_excess(rows, cpus))
    # the cost model charges the plane: a posted hop beside 0.2 s of work, a blocking one beside nothing
    hw = emulated_hardware(_cluster(), "float32")
    cost = EmulatedCosts(hw, "float32", excess=excess.fit_excess(rows, cpus))
    assert cost.sender_seconds(1 << 17, True, beside=0.2) == pytest.approx(a + k * (1 << 17) + c * 0.2)
    assert cost.sender_seconds(1 << 17, True) == pytest.approx(a + k * (1 << 17))
    assert EmulatedCosts(hw, "float32", excess={"intra": (a, k)}).sender_seconds(1 << 17, True, beside=0.2) == \
        pytest.approx(a + k * (1 << 17))


def test_each_ranks_cpu_per_step_reads_at_the_cap_beside_the_model():
    """A record with each rank's CPU per step (``time_cpu_s_per_rank``) gets the busiest rank's CPU at its cap
    (the wall time that much CPU takes a rank capped at ``cpus``) and the model's critical compute beside it; a
    record without the field, or from an uncapped run, shows none and leaves the table as it was."""
    capped = _cluster(cpus=0.25)
    rec = {**_record(4096, "burst", 1.0, capped), "time_cpu_s_per_rank": [0.1, 0.2]}
    old = _record(4096, "burst", 1.0, capped)
    times = _times([rec])
    row = validate.compare([rec], times, rescale=False)[0]
    assert row["cpu_at_cap_s"] == pytest.approx(0.2 / 0.25)            # the busiest rank, 4 x its CPU at a quarter
    assert validate.compare([old], times, rescale=False)[0]["cpu_at_cap_s"] is None
    assert validate.compare([{**rec, "cluster": _cluster()}], times, rescale=False)[0]["cpu_at_cap_s"] is None
    text = validate.error_table([row])["text"]
    assert "CPU/cap s" in text and f"{0.8:9.3f} {row['critical_compute_s']:12.3f}" in text
    assert "CPU/cap s" not in validate.error_table(validate.compare([old], times, rescale=False))["text"]


def test_each_ranks_threads_split_beside_the_models_work_and_excess():
    """A record with the timing thread's CPU (``time_cpu_main_s_per_rank``) splits each rank's CPU at the cap into
    that thread's (kernels, host) and the rest (gloo's threads), beside the model's work and excess per rank on the
    compute stream; without the field the columns are absent."""
    capped = _cluster(cpus=0.25)
    rec = {**_record(4096, "burst", 1.0, capped), "time_cpu_s_per_rank": [0.1, 0.2],
           "time_cpu_main_s_per_rank": [0.08, 0.15]}
    times = _times([rec])
    row = validate.compare([rec], times, rescale=False, excess={"intra": (1e-3, 0.0), "inter": (1e-3, 0.0)})[0]
    assert row["main_at_cap_s_per_rank"] == pytest.approx([0.32, 0.6])
    assert row["rest_at_cap_s_per_rank"] == pytest.approx([0.08, 0.2])
    assert len(row["work_s_per_rank"]) == len(row["held_s_per_rank"]) == 2
    assert all(w > 0 for w in row["work_s_per_rank"]) and all(h > 0 for h in row["held_s_per_rank"])
    text = validate.error_table([row])["text"]
    assert "main/cap" in text and f" {0.6:8.3f} {max(row['work_s_per_rank']):6.3f} {0.2:8.3f}" in text
    plain = {k: v for k, v in rec.items() if k != "time_cpu_main_s_per_rank"}
    assert "main/cap" not in validate.error_table(validate.compare([plain], times, rescale=False))["text"]

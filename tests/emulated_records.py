"""Synthetic records of an emulated 2 nodes x 1 rank run, for the performance model's validation tests
(tests/test_perfmodel_validate.py, tests/test_perfmodel_host.py): one shaped inter-node link of ``RATE``
bytes/s per rank, a burst-shaped G=2 forward on 2 heads x 8."""
from __future__ import annotations

from baselines import AttnShape
from experiments.perfmodel.emulated import validate

RATE = 1e6           # bytes/s of the shaped inter-node link, per rank


def emulated_cluster(calibration=None, cpus: float | None = None) -> dict:
    """A record's ``cluster`` block; ``cpus``: each rank's CPU cap (``cpu_quota``; None: none recorded)."""
    c = {"emulated": True, "nodes": 2, "ranks_per_node": 1, "profile": "t_emu", "summary": "synthetic 2x1",
         "links": {"inter": {"bytes_per_s": RATE, "kind": "roce", "latency_us": 0.0}}, "calibration": calibration}
    if cpus is not None:
        c["cpu_quota"] = {"applied": True, "cpus_per_rank": cpus}
    return c


def emulated_record(seqlen: int, method: str, measured: float, cluster: dict | None = None) -> dict:
    s = AttnShape(batch=1, seqlen=seqlen, heads=2, kv_heads=2, head_dim=8, world_size=2, dtype="float32",
                  causal=False, layout="contiguous")
    return {"status": "ok", "method": method, "mode": "forward", "level": "op", "case_id": f"{method}.N{seqlen}",
            "cluster": cluster or emulated_cluster(), "time_median_s": measured, "time_samples_s": [measured],
            **{k: getattr(s, k) for k in validate.SHAPE_KEYS}}

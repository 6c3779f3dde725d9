"""Cluster performance model: predicts each method's per-layer time, bytes and memory at the papers' sizes.

    python -m experiments.perfmodel paper                       # every paper-size spec, its own hardware
    python -m experiments.perfmodel burstengine_attn_tflops_32gpu --hardware h200_sxm_ib_4x8

Pieces, one concept per file: ``simulator`` (deterministic discrete-event
engine), ``costs`` (time of kernels, GEMMs and transfers on a hardware
profile), ``placement`` (ranks on nodes, link class per hop), ``schedules/``
(one builder per method family), ``memory`` (peak per rank, OOM), ``model``
(one case), ``predict`` (a spec -> modelled records, figures, tables);
``emulated/`` (this machine's CPU ranks as a cost model, and the model
against emulated runs: the only place with host and overlap-excess terms).
Records go to ``results/modelled/<experiment>/results.jsonl`` with
``"source": "modelled"``; figures and tables to ``plots/modelled/<experiment>/``.
"""
from .model import ASSUMPTIONS, Prediction, predict_case

__all__ = ["ASSUMPTIONS", "Prediction", "predict_case"]

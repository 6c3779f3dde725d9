"""``Pending.wait``'s ``wait_s`` on CUDA (issue 39, item 5): ``r.wait()`` of an NCCL request only
orders the streams and returns at once, so the wait is timed between stream synchronisations
while a counter is open, and never adds one to an uncounted (timed) call.

CPU only: the received tensor stands in for a CUDA one by its ``device``; the fake synchronisation
takes 20 ms, the time the transfer would still need to land. The bound (>= 15 ms) leaves room for a
coarse clock; without the synchronisation the fake request returns at once and wait_s is ~0.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from burst_impl import comm


class _Req:
    def wait(self):   # NCCL: enqueue a stream wait, return immediately
        return None


def _pending(device: str):
    recv = [SimpleNamespace(device=torch.device(device))]
    return comm.Pending([_Req()], recv, keep=[], phase="forward")


def test_cuda_wait_is_timed_between_synchronisations(monkeypatch):
    syncs = []

    def fake_sync(device):
        syncs.append(device.type)
        if len(syncs) % 2 == 0:      # the second: the transfer lands
            time.sleep(0.02)

    monkeypatch.setattr(comm, "_synchronize", fake_sync)
    with comm.count_bytes() as counts:
        _pending("cuda").wait()
    assert syncs == ["cuda", "cuda"]
    assert counts.wait_s["forward"] >= 0.015
    _pending("cuda").wait()           # no counter open: a timed call, no synchronisation added
    assert len(syncs) == 2


def test_cpu_wait_needs_no_synchronisation(monkeypatch):
    monkeypatch.setattr(comm, "_synchronize", lambda device: (_ for _ in ()).throw(AssertionError("synced")))
    with comm.count_bytes() as counts:
        _pending("cpu").wait()
    assert counts.wait_s["forward"] < 0.015

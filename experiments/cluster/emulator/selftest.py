"""Self-test of an emulated cluster: measure each link class with bulk TCP transfers.

Every rank sends at once, for ``seconds``, to the next rank of its own node
(intra) and to the rank of the same local index on the next node (inter), the
situation the hardware convention describes (every rank sending at once). A
receiver in the destination rank's namespace reports the payload bytes/s it
got between its first and last byte. Run ``python -m experiments.cluster
selftest`` on a cluster that is up, or call ``measure`` from a test.

    python -m experiments.cluster.emulator.selftest serve <addr> <port> <seconds>   # inside a rank's namespace
    python -m experiments.cluster.emulator.selftest send <addr> <port> <seconds>
"""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time

from . import netns

BASE_PORT = 47000


def serve(addr: str, port: int, seconds: float) -> dict:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1)
    srv.settimeout(seconds + 60)
    conn, _ = srv.accept()
    conn.settimeout(seconds + 60)
    n, n0, first, last = 0, 0, None, None
    while True:
        b = conn.recv(1 << 20)
        if not b:
            break
        now = time.perf_counter()
        if first is None:
            first, n0 = now, len(b)   # bytes of the first read arrived before the clock started
        n += len(b)
        last = now
    span = (last - first) if first is not None else 0.0
    return {"bytes": n, "seconds": span, "bytes_per_s": (n - n0) / span if span > 0 else 0.0}


def send(addr: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    buf = b"\0" * (1 << 16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        conn.sendall(buf)
    conn.close()


def pairs(topo: netns.Topology) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """(class, source (node, rank), destination (node, rank)) for every measured flow."""
    out = []
    for i in range(topo.nodes):
        for k in range(topo.ranks_per_node):
            if topo.ranks_per_node > 1:
                out.append(("intra", (i, k), (i, (k + 1) % topo.ranks_per_node)))
            if topo.nodes > 1:
                out.append(("inter", (i, k), ((i + 1) % topo.nodes, k)))
    return out


def measure(topo: netns.Topology, seconds: float = 3.0, python: str = sys.executable) -> dict[str, dict]:
    """Measured payload rate per link class: ``{"intra": {"bytes_per_s": median, "flows": [...]}, ...}``."""
    flows = pairs(topo)
    servers, senders = [], []
    try:
        for n, (cls, _, (di, dk)) in enumerate(flows):
            cmd = netns.nsenter(topo.rank(di, dk), [python, "-m", "experiments.cluster.emulator.selftest", "serve",
                                                    topo.rank_addr(di, dk), str(BASE_PORT + n), str(seconds)])
            servers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for n, (cls, (si, sk), (di, dk)) in enumerate(flows):
            cmd = netns.nsenter(topo.rank(si, sk), [python, "-m", "experiments.cluster.emulator.selftest", "send",
                                                    topo.rank_addr(di, dk), str(BASE_PORT + n), str(seconds)])
            senders.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        results: dict[str, dict] = {}
        for (cls, src, dst), srv, snd in zip(flows, servers, senders):
            out, err = srv.communicate(timeout=seconds + 90)
            _, serr = snd.communicate(timeout=seconds + 90)
            if srv.returncode or snd.returncode:
                raise RuntimeError(f"self-test flow {cls} {src}->{dst} failed: {err.strip()[-400:]} "
                                   f"{serr.strip()[-400:]}")
            r = json.loads(out)
            results.setdefault(cls, {"flows": []})["flows"].append({"src": src, "dst": dst, **r})
        for cls, d in results.items():
            d["bytes_per_s"] = statistics.median(f["bytes_per_s"] for f in d["flows"])
        return results
    finally:
        for p in servers + senders:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str]) -> int:
    what, addr, port, seconds = argv[0], argv[1], int(argv[2]), float(argv[3])
    if what == "serve":
        print(json.dumps(serve(addr, port, seconds)))
    else:
        send(addr, port, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

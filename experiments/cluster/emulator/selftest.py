"""Self-test of an emulated cluster: measure each link class with bulk TCP transfers.

Every rank sends at once, for ``seconds``, to the next rank of its own node
(intra) and to the rank of the same local index on the next node (inter), the
situation the hardware convention describes (every rank sending at once). A
receiver in the destination rank's namespace reports the payload bytes/s it
got between its first and last byte. Run ``burst-bench cluster
selftest`` on a cluster that is up, or call ``measure`` from a test.

``measure_nic`` measures one NIC (NIC 0 of node 0) on its own: first one of its
ranks alone sends to the next node (``lone``: the NIC's rate, or the rank's cap),
then all ranks behind it at once (``concurrent``: the NIC's rate split evenly).

``measure_message`` times one short message after an idle spell (a ring's hop after its compute):
how far it runs ahead of bytes / rate on the link's bucket (``shaping.BURST_S``).

    python -m experiments.cluster.emulator.selftest serve <addr> <port> <seconds>   # inside a rank's namespace
    python -m experiments.cluster.emulator.selftest send <addr> <port> <seconds> [<start at, epoch s>]
    python -m experiments.cluster.emulator.selftest message-serve <addr> <port> <bytes>
    python -m experiments.cluster.emulator.selftest message-send <addr> <port> <bytes> <idle s>
"""
from __future__ import annotations

import json
import socket
import statistics
import struct
import subprocess
import sys
import time

from ...cli import ToolFailed
from . import netns

BASE_PORT = 47000
MODULE = "experiments.cluster.emulator.selftest"


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


def _connect(addr: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection((addr, port), timeout=10)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def send(addr: str, port: int, seconds: float, start_at: float = 0.0) -> None:
    """Send for ``seconds`` from wall-clock time ``start_at`` (0: now): flows meant to be concurrent start
    together, not one Python start-up apart (a flow running alone at first would get a whole NIC)."""
    conn = _connect(addr, port)
    buf = b"\0" * (1 << 16)
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        conn.sendall(buf)
    conn.close()


def serve_message(addr: str, port: int, nbytes: int) -> dict:
    """Receive one ``nbytes`` message; seconds from the sender's clock at its first byte (an 8-byte
    header: namespaces share the machine's clock) to the arrival of its last."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1)
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(60)
    data = bytearray()
    while len(data) < 8 + nbytes:
        b = conn.recv(1 << 20)
        if not b:
            break
        data += b
    last = time.time()
    t0 = struct.unpack("d", data[:8])[0]
    return {"bytes": len(data) - 8, "seconds": last - t0, "bytes_per_s": (len(data) - 8) / max(last - t0, 1e-9)}


def send_message(addr: str, port: int, nbytes: int, idle_s: float) -> None:
    """Connect, stay idle ``idle_s`` (the link's buckets fill, as between a ring's hops), send one message."""
    conn = _connect(addr, port)
    time.sleep(idle_s)
    conn.sendall(struct.pack("d", time.time()) + b"\0" * nbytes)
    conn.close()


def measure_message(topo: netns.Topology, src: tuple[int, int], dst: tuple[int, int], nbytes: int = 1 << 19,
                    idle_s: float = 0.2, repeats: int = 3, python: str = sys.executable) -> dict:
    """One message of ``nbytes`` from ``src`` to ``dst`` ((node, rank)) after ``idle_s`` of idle link, alone,
    ``repeats`` times: ``{"seconds": median, "samples": [...], "bytes": nbytes}``. Its time against
    bytes / rate says how far a short transfer runs ahead of the link (shaping.BURST_S)."""
    samples = []
    addr = topo.rank_addr(*dst)
    for i in range(repeats):
        port = BASE_PORT + 900 + i
        procs = [_spawn(topo, dst, ["message-serve", addr, port, nbytes], python),
                 _spawn(topo, src, ["message-send", addr, port, nbytes, idle_s], python, out=False)]
        try:
            samples.append(_result(*procs, f"message {src}->{dst}", timeout=120)["seconds"])
        finally:
            _kill(procs)
    return {"seconds": statistics.median(samples), "samples": samples, "bytes": nbytes, "idle_s": idle_s}


def _spawn(topo: netns.Topology, who: tuple[int, int], argv: list, python: str, *, out: bool = True):
    """This module's ``main(argv)`` in rank ``who``'s namespace."""
    cmd = netns.nsenter(topo.rank(*who), [python, "-m", MODULE, *(str(a) for a in argv)])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE if out else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _result(srv, snd, what: str, timeout: float) -> dict:
    """The server's JSON line once both ends have finished; ToolFailed with their stderr if one failed."""
    out, err = srv.communicate(timeout=timeout)
    _, serr = snd.communicate(timeout=timeout)
    if srv.returncode or snd.returncode:
        raise ToolFailed(f"self-test {what} failed: {err.strip()[-400:]} {serr.strip()[-400:]}")
    return json.loads(out)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


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


def nic_pairs(topo: netns.Topology, ranks_per_nic: int) -> dict[str, list]:
    """The flows of ``measure_nic``: a lone one, then every rank of NIC 0 of node 0 at once."""
    if topo.nodes < 2:
        raise ValueError(f"nodes={topo.nodes}: a NIC carries inter-node traffic; it needs 2 nodes or more")
    if ranks_per_nic < 1 or topo.ranks_per_node % ranks_per_nic:
        raise ValueError(f"ranks_per_nic={ranks_per_nic} must divide ranks_per_node={topo.ranks_per_node}")
    conc = [("concurrent", (0, k), (1, k)) for k in range(ranks_per_nic)]
    return {"lone": [("lone", (0, 0), (1, 0))], "concurrent": conc}


def measure(topo: netns.Topology, seconds: float = 3.0, python: str = sys.executable) -> dict[str, dict]:
    """Measured payload rate per link class: ``{"intra": {"bytes_per_s": median, "flows": [...]}, ...}``."""
    return measure_flows(topo, pairs(topo), seconds, python)


def measure_nic(topo: netns.Topology, ranks_per_nic: int, seconds: float = 2.0,
                python: str = sys.executable) -> dict[str, dict]:
    """``{"lone": {...}, "concurrent": {...}}`` as ``measure``: one flow through NIC 0 of node 0, then all
    ``ranks_per_nic`` flows through it at once (one after the other, so they never overlap)."""
    return {k: measure_flows(topo, flows, seconds, python, port=BASE_PORT + 500 * (i + 1))[k]
            for i, (k, flows) in enumerate(nic_pairs(topo, ranks_per_nic).items())}


def measure_flows(topo: netns.Topology, flows: list, seconds: float, python: str = sys.executable, *,
                  port: int = BASE_PORT) -> dict[str, dict]:
    """Run ``flows`` ((class, (node, rank) source, (node, rank) destination)) at once for ``seconds``;
    per class the flows' rates and their median."""
    servers, senders = [], []
    try:
        for n, (cls, _, dst) in enumerate(flows):
            servers.append(_spawn(topo, dst, ["serve", topo.rank_addr(*dst), port + n, seconds], python))
        start_at = time.time() + 1.5 + 0.2 * len(flows)     # after every sender has started and connected
        for n, (cls, src, dst) in enumerate(flows):
            senders.append(_spawn(topo, src, ["send", topo.rank_addr(*dst), port + n, seconds, start_at], python,
                                  out=False))
        results: dict[str, dict] = {}
        for (cls, src, dst), srv, snd in zip(flows, servers, senders):
            r = _result(srv, snd, f"flow {cls} {src}->{dst}", timeout=seconds + 90)
            results.setdefault(cls, {"flows": []})["flows"].append({"src": src, "dst": dst, **r})
        for cls, d in results.items():
            d["bytes_per_s"] = statistics.median(f["bytes_per_s"] for f in d["flows"])
        return results
    finally:
        _kill(servers + senders)


def main(argv: list[str]) -> int:
    what, addr, port, rest = argv[0], argv[1], int(argv[2]), argv[3:]
    if what == "message-serve":
        print(json.dumps(serve_message(addr, port, int(rest[0]))))
    elif what == "message-send":
        send_message(addr, port, int(rest[0]), float(rest[1]))
    elif what == "serve":
        print(json.dumps(serve(addr, port, float(rest[0]))))
    else:
        send(addr, port, float(rest[0]), float(rest[1]) if len(rest) > 1 else 0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

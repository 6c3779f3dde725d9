"""The emulated cluster for real: namespaces, shaped links, torchrun/gloo across namespaces, a rank that
dies, SIGTERM and SIGKILL of the owner, and one 2-node SLURM job end to end.

Skipped, with the reason, only where the machine forbids network namespaces (not root, no veth) or, for
the SLURM test, where the Debian packages are not installed (`.ci/run` installs them; README).
Every test checks that nothing is left behind: namespaces, their veths and qdiscs (they live only in
our namespaces), daemons and rank processes (by the run id in their command lines)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from experiments.cli import run_cli
from experiments.cluster.__main__ import main as cluster_main
from experiments.cluster.emulator import netns, selftest, shaping, slurmd
from experiments.harness import cpuquota
from experiments.cluster.emulator.emulated import EmulatedCluster
from experiments.profiles.cluster import parse_profile
from experiments.harness import results as R
from experiments.harness.env import REPO
from experiments.run import main as run_main
from experiments.perfmodel.emulated.lockstep import load_lockstep

WHY = netns.probe()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"emulated cluster unavailable here: {WHY}")

PROFILE = {"description": "test", "scheduler": "emulated", "hardware": "a100_pcie_roce_4x8", "device": "cpu",
           "nodes": 2, "ranks_per_node": 2, "link_rates": {"intra": 4e6, "inter": 1e6}}


def _profile(tmp_path: Path, **over) -> Path:
    p = tmp_path / f"emu_{len(list(tmp_path.glob('emu_*')))}.yaml"
    p.write_text(yaml.safe_dump({**PROFILE, **over}))
    return p


def _processes_with(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _assert_gone(run_id: str) -> None:
    assert not [ns for ns in netns.our_namespaces() if ns.startswith(run_id)], netns.our_namespaces()
    assert not netns.state_path(run_id).exists()
    assert not list(Path(tempfile.gettempdir()).glob(f"{run_id}-*"))      # the run's work directory
    root = cpuquota._root()
    if not isinstance(root, str):                                         # the ranks' cpu cgroups
        assert not list(root[0].glob(f"{run_id}-*"))
    deadline = time.monotonic() + 10
    while _processes_with(run_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(run_id), [Path(f"/proc/{p}/cmdline").read_bytes() for p in _processes_with(run_id)]


def _new_ours(before: set) -> set:
    """Run ids that appeared since ``before`` and are not another live process's: other engineers' runs
    on a shared machine bring up clusters of their own meanwhile (the state file names the owner)."""
    out = set()
    for rid in set(netns.run_ids()) - before:
        owner = netns.read_state(rid).get("owner_pid")
        if not owner or int(owner) == os.getpid() or not netns._alive(int(owner)):
            out.add(rid)
    return out


def test_up_shape_measure_down(tmp_path):
    """Topology up, every rank's link shaped per class, measured rates within 15% of the configured ones."""
    prof = parse_profile(yaml.safe_load(_profile(tmp_path).read_text()), "emu.yaml")
    with EmulatedCluster(prof, log=lambda *_: None) as cl:
        rid = cl.topo.run_id
        assert set(cl.topo.namespaces()) <= set(netns.our_namespaces())
        res = selftest.measure(cl.topo, seconds=2.0)
        for klass, want in (("intra", 4e6), ("inter", 1e6)):
            got = res[klass]["bytes_per_s"]
            assert abs(got / want - 1) < 0.15, (klass, got, want, res[klass]["flows"])
        route = subprocess.run(["ip", "-n", cl.topo.rank(0, 0), "route", "show"], capture_output=True, text=True)
        routes = {line.split()[0]: line for line in route.stdout.splitlines()}
        assert "quickack 1" in routes["10.77.0.0/16"], route.stdout        # no delayed ACKs across nodes
        assert "quickack" not in routes["10.77.0.0/24"], route.stdout      # inside the node they stay (netns.py)
        stats = shaping.class_stats(cl.topo.rank(0, 0))
        assert stats["1:10"]["bytes"] > 1e6 and stats["1:20"]["bytes"] > 1e6   # both classes carried traffic
        info = cl.info(4)
        assert info["links"]["inter"]["bytes_per_s"] == 1e6 and info["ranks_per_core"] == 4 / os.cpu_count()
    _assert_gone(rid)


def test_shared_nic_a_lone_flow_gets_the_nic_concurrent_flows_split_it(tmp_path):
    """Both ranks of a node behind ONE NIC of 2 x 2.5e5 bytes/s (shaped on the node's uplink): one rank
    alone gets the whole NIC, both at once half each, every flow within 15% (low rates: the sender never
    lacks CPU on a loaded machine, and concurrent senders start together, selftest.send)."""
    prof = parse_profile(yaml.safe_load(_profile(tmp_path, nics_per_node=1,
                                                 link_rates={"intra": 4e6, "inter": 2.5e5}).read_text()), "emu.yaml")
    with EmulatedCluster(prof, log=lambda *_: None) as cl:
        rid = cl.topo.run_id
        res = selftest.measure_nic(cl.topo, 2, seconds=1.0)
        (lone,), conc = res["lone"]["flows"], res["concurrent"]["flows"]
        assert abs(lone["bytes_per_s"] / 5e5 - 1) < 0.15, res
        assert len(conc) == 2 and all(abs(f["bytes_per_s"] / 2.5e5 - 1) < 0.15 for f in conc), res
        up = shaping.class_stats(cl.topo.node(0), "uplink")       # the bytes went through NIC 0's class
        assert up["1:100"]["bytes"] > 1e6 and up["1:1000"]["bytes"] > 5e5 and up["1:1001"]["bytes"] > 2e5, up
        info = cl.info(4)
        assert info["nics_per_node"] == 1 and info["links"]["inter"]["ranks_per_nic"] == 2
        assert info["links"]["inter"]["nic_bytes_per_s"] == 5e5 == info["links"]["inter"]["lone_bytes_per_s"]
    _assert_gone(rid)


def test_a_short_message_after_idle_does_not_run_ahead_of_the_nic(tmp_path):
    """One 512 KiB message through a shared NIC of 4e7 bytes/s after 200 ms of idle link takes at least
    0.85x bytes / rate: the NIC's bucket holds 0.5 ms of traffic (shaping.BURST_S). With the 5 ms bucket
    of before, 200 KB of it went at once (0.6x; a ring's hop after its compute rode it)."""
    prof = parse_profile(yaml.safe_load(_profile(tmp_path, nics_per_node=1,
                                                 link_rates={"intra": 4e6, "inter": 2e7}).read_text()), "emu.yaml")
    with EmulatedCluster(prof, log=lambda *_: None) as cl:
        rid = cl.topo.run_id
        m = selftest.measure_message(cl.topo, (0, 0), (1, 0), 1 << 19)
        assert m["seconds"] >= 0.85 * (1 << 19) / 4e7, m
    _assert_gone(rid)


def test_failure_shaping_a_nic_removes_everything(tmp_path, monkeypatch):
    prof = parse_profile(yaml.safe_load(_profile(tmp_path, nics_per_node=1).read_text()), "emu.yaml")
    real = shaping.nic_commands
    monkeypatch.setattr(shaping, "nic_commands",
                        lambda *a, **k: real(*a, **k) + [["qdisc", "add", "dev", "nosuchnic", "root", "htb"]])
    before = set(netns.run_ids())
    cl = EmulatedCluster(prof, log=lambda *_: None)
    with pytest.raises(netns.NetnsError, match="nosuchnic"):
        cl.up()
    assert not _new_ours(before)
    _assert_gone(cl.topo.run_id)


def test_failure_half_way_removes_everything(tmp_path, monkeypatch):
    prof = parse_profile(yaml.safe_load(_profile(tmp_path).read_text()), "emu.yaml")
    real = shaping.rank_commands
    calls = {"n": 0}

    def broken(*a, **k):
        calls["n"] += 1
        cmds = real(*a, **k)
        return cmds if calls["n"] < 3 else cmds + [["qdisc", "add", "dev", "nosuchdev", "root", "htb"]]

    monkeypatch.setattr(shaping, "rank_commands", broken)
    before = set(netns.run_ids())
    cl = EmulatedCluster(prof, log=lambda *_: None)
    with pytest.raises(netns.NetnsError, match="nosuchdev"):
        cl.up()
    assert calls["n"] == 3                              # it failed on the third rank, half way
    assert not _new_ours(before)
    _assert_gone(cl.topo.run_id)


def _start_holder(profile: Path) -> tuple[subprocess.Popen, str]:
    """`python -m experiments.cluster up <profile>` in its own process; returns it and its run id."""
    before = set(netns.run_ids())
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cluster", "up", str(profile)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = [r for r in set(netns.run_ids()) - before if netns.read_state(r).get("scaling")]
        if new:
            return proc, new[0]
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the cluster did not come up")


def test_sigterm_tears_down_and_sigkill_leaves_stale_that_down_removes(tmp_path, capsys):
    prof = _profile(tmp_path)
    proc, rid = _start_holder(prof)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    _assert_gone(rid)
    proc, rid = _start_holder(prof)
    proc.kill()                                   # no chance to clean up
    proc.wait(timeout=30)
    assert rid in netns.stale()
    capsys.readouterr()
    assert run_cli(cluster_main, ["down", "--stale"]) == 0      # the CLI in this process: no second start-up
    out = capsys.readouterr()
    assert rid in out.out, out.out + out.err
    _assert_gone(rid)


def _spec(tmp_path: Path, name: str, target: Path, **over) -> Path:
    raw = {"name": name, "methods": ["ring", "burst"], "baseline": "ring",
           "sweep": {"seqlen": [512], "world_size": 4, "heads": 2, "head_dim": 16, "layout": "zigzag",
                     "dtype": "float32"},
           "measure": {"modes": ["fwd_bwd"], "level": "op", "memory": False},
           "warmup": 1, "repeats": 2, "seed": 1, "cluster": str(target), "timeouts": {"case_s": 90, "pg_s": 30},
           **over}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_torchrun_across_namespaces_shaped_and_a_rank_that_dies(tmp_path, monkeypatch):
    """Two nodes x two ranks: gloo rendezvous across namespaces, the ring's bytes pass the shaped links (its
    time is at least bytes / inter rate), and a rank that dies mid-run fails its case only; nothing is left."""
    target = _profile(tmp_path, link_rates={"intra": 2e6, "inter": 5e5})
    monkeypatch.setenv("EXPERIMENTS_INJECT_FAULT", "burst.op.fwd_bwd.N512.:error:3")
    before = set(netns.run_ids())
    assert run_main([str(_spec(tmp_path, "t_emu", target)), "--results", str(tmp_path / "r"), "--no-plots"]) == 0
    recs = R.latest_by_case(R.read_records(tmp_path / "r" / "t_emu" / "results.jsonl"))
    ring = next(r for k, r in recs.items() if k.startswith("ring."))
    burst = next(r for k, r in recs.items() if k.startswith("burst."))
    assert ring["status"] == "ok", ring["reason"]
    assert ring["hardware"]["nodes"] == 2 and ring["cluster"]["emulated"] is True
    assert ring["cluster"]["links"] == {"intra": ring["cluster"]["links"]["intra"],
                                        "inter": ring["cluster"]["links"]["inter"]}
    assert ring["cluster"]["links"]["inter"]["bytes_per_s"] == 5e5 and ring["cluster"]["ranks_per_core"] > 0
    quota = ring["cluster"]["cpu_quota"]     # each rank capped at its share of the cores (cpuquota.py)
    assert quota["cpus_per_rank"] == os.cpu_count() / 4
    assert quota["applied"] or quota["why"], quota          # applied, or the record says why not
    if os.path.isdir("/sys/fs/cgroup/cpu") and os.access("/sys/fs/cgroup/cpu", os.W_OK):
        assert quota["applied"], quota                     # a writable cgroup v1 cpu controller (this VM)
    sent = ring["comm_fwd_bytes"] + ring["comm_bwd_bytes"]
    assert sent == ring["comm_fwd_formula_bytes"] + ring["comm_bwd_formula_bytes"] > 0
    assert min(ring["time_samples_s"]) > 0.8 * sent / 5e5     # the ring waits on its inter-node hop
    assert burst["status"] == "failed" and "rank 3" in burst["reason"], burst["reason"]
    for rid in _new_ours(before):
        _assert_gone(rid)
    assert not _new_ours(before)


@pytest.mark.slow
def test_overlap_probe_at_three_nodes_every_pattern_finishes(tmp_path, capsys):
    """`burst-bench cluster overlap` on the committed 3 nodes x 2 ranks profile (given rates, one round of
    tiny cases): every pattern finishes on every rank (before, the oneway case's last node waited for a
    sender that never sent until gloo timed out), the odd node out of oneway's pairs is idle, and nothing
    is left behind."""
    cases = "ring:64:4096,pair:64:4096,oneway:64:4096"
    out = tmp_path / "overlap_probe.json"
    before = set(netns.run_ids())
    rc = run_cli(cluster_main, ["overlap", "a800_ib_emu_3x2", "--rates", "intra=4e6,inter=1e6", "--repeats", "1",
                                "--cases", cases, "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    rec = json.loads(out.read_text())
    assert [r["case"] for r in rec["rows"]] == cases.split(",")
    assert len(rec["per_rank"]) == 6
    idle = [r["oneway:64:4096"]["idle"] for r in rec["per_rank"]]
    assert idle == [False, False, False, False, True, True]           # node 2 has no partner
    assert all(r["transfer_wall_s"] > 0 for r in rec["rows"])
    for rid in _new_ours(before):
        _assert_gone(rid)
    assert not _new_ours(before)


def test_call_probe_on_one_node_of_a_cluster_writes_rows_the_validation_reads(tmp_path, capsys):
    """`burst-bench cluster calls` at --world-size 2 on the 3 x 2 profile (one node, given rates, one sample): a
    decode row and a training call measured with the ranks in their cgroups, rows in call_cpu.json at that world
    size with the cluster in their provenance, nothing left behind."""
    out = tmp_path / "call_cpu.json"
    before = set(netns.run_ids())
    rc = run_cli(cluster_main, ["calls", "a800_ib_emu_3x2", "--rates", "intra=4e6,inter=1e6", "--repeats", "1",
                                "--world-size", "2", "--cases", "decode:tp:8:1,burst:8", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["world_size"], r["node_size"]) for r in rows] == [("decode:tp", 2, 2), ("burst", 2, 2)]
    assert all(r["cpu_s_median"] > 0 and r["where"] == "emulated" for r in rows)
    assert rows[0]["steps_per_sample"] >= 1 and rows[0]["provenance"]["cluster"]["nodes"] == 1
    assert not _new_ours(before)


def test_lockstep_probe_on_one_node_writes_a_factor_the_validation_reads(tmp_path, capsys):
    """`burst-bench cluster lockstep` at --world-size 2 on the 3 x 2 profile (one node, given rates, one round of
    one piece size): a row with its world size, each kind's wall and CPU and a positive factor, that the
    inference validation's loader reads; nothing left behind."""
    out = tmp_path / "lockstep_probe.json"
    before = set(netns.run_ids())
    rc = run_cli(cluster_main, ["lockstep", "a800_ib_emu_3x2", "--rates", "intra=4e6,inter=1e6", "--repeats", "1",
                                "--world-size", "2", "--cases", "5000", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["world_size"] == 2 and row["case"] == "5000" and row["profile"] == "a800_ib_emu_3x2"
    assert all(row[f"{k}_wall_s"] > 0 and row[f"{k}_cpu_s"] > 0 for k in ("free", "lockstep", "sync"))
    assert row["factor"] > 0 and row["cluster"]["nodes"] == 1
    assert set(load_lockstep(tmp_path, "a800_ib_emu_3x2")["factors"]) == {2}
    assert not _new_ours(before)


@pytest.mark.slow
def test_a_spec_and_its_report_at_three_nodes(tmp_path, capsys):
    """A spec of world size 6 on 3 nodes x 2 ranks (two per NIC, given rates): every case ok across all
    three nodes, and `burst-bench cluster report` of its results; nothing is left behind."""
    target = _profile(tmp_path, hardware="a800_ib_4x8", nodes=3, ranks_per_node=2, nics_per_node=1,
                      link_rates={"intra": 4e6, "inter": 1e6})
    spec = _spec(tmp_path, "t_emu3", target, methods=["burst", "burst_double_ring"], baseline="burst",
                 sweep={"seqlen": [768], "world_size": 6, "heads": 2, "head_dim": 16, "layout": "zigzag",
                        "dtype": "float32"})
    before, out = set(netns.run_ids()), tmp_path / "r"
    assert run_main([str(spec), "--results", str(out), "--no-plots"]) == 0
    recs = R.latest_by_case(R.read_records(out / "t_emu3" / "results.jsonl"))
    assert sorted(k.split(".")[0] for k in recs) == ["burst", "burst_double_ring"]
    for r in recs.values():
        assert r["status"] == "ok", r["reason"]
        assert r["hardware"]["nodes"] == 3 and r["cluster"]["emulated"] is True
    capsys.readouterr()
    assert run_cli(cluster_main, ["report", "t_emu3", "--results", str(out)]) == 0
    text = capsys.readouterr().out
    assert "burst_double_ring" in text and "emulated 3x2" in text, text
    for rid in _new_ours(before):
        _assert_gone(rid)
    assert not _new_ours(before)


@pytest.mark.slow
@pytest.mark.skipif(bool(slurmd.missing()), reason=f"SLURM packages not installed ({', '.join(slurmd.missing())} "
                    "missing): apt-get install -y slurmd slurmctld slurm-client munge")
def test_slurm_job_end_to_end(tmp_path):
    """`experiments.run <spec> --cluster <emulated SLURM profile>`: munge, slurmctld and two slurmd in the
    namespaces, the rendered job script submitted with sbatch, srun + torchrun across both nodes, records
    merged into the results folder, everything stopped and removed afterwards."""
    target = _profile(tmp_path, launcher="slurm", partition="emu", account="", time_limit="00:10:00",
                      cpus_per_gpu=1, python=".venv/bin/python" if (REPO / ".venv").exists() else sys.executable,
                      link_rates={"intra": 2e7, "inter": 1e7})
    spec = _spec(tmp_path, "t_slurm", tmp_path / "unused.yaml", methods=["burst"], baseline="burst",
                 sweep={"seqlen": [256], "world_size": 4, "heads": 2, "head_dim": 16, "layout": "zigzag",
                        "dtype": "float32"}, warmup=0, repeats=1)
    before = set(netns.run_ids())
    out = tmp_path / "r"
    assert run_main([str(spec), "--cluster", str(target), "--results", str(out), "--no-plots"]) == 0
    recs = R.read_records(out / "t_slurm" / "results.jsonl")
    assert len(recs) == 1 and recs[0]["status"] == "ok", recs[0]["reason"]
    assert recs[0]["hardware"]["nodes"] == 2 and recs[0]["cluster"]["launcher"] == "slurm"
    logs = list((out / "t_slurm").glob("burst-t_slurm-g4-*.out"))
    assert logs and "node 1" in logs[0].read_text() and "merged 1 record" in logs[0].read_text()
    assert not (out / ".jobs").exists()
    for rid in _new_ours(before):
        _assert_gone(rid)
    assert not _new_ours(before)
    rid = recs[0]["cluster"]["run_id"]
    _assert_gone(rid)

"""Cluster profiles, the SLURM job scripts they render, the emulator's scaling rule and shaping commands,
and a job's results folder: no process launched, no namespace created."""
from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest

from burst_impl.shape import AttnShape
import yaml

from experiments.cluster import jobs
from experiments.cluster.emulator import emulation, shaping
from experiments.cluster.emulator.emulated import EmulatedCluster
from experiments.profiles.hardware import load_hardware
from experiments.profiles.cluster import PROFILE_DIR, known_profiles, load_profile, parse_profile, parse_time_limit
from experiments.cluster.emulator.rankexec import command as rank_command
from experiments.cluster.slurm import RESERVE_S, check_submittable, render_sbatch
from experiments.harness import results as R
from experiments.harness.spec import Case

SLURM_PROFILES = [n for n in known_profiles() if load_profile(n).via_slurm]


def _render(name: str, ws: int | None = None, budget: float = 1e9) -> str:
    prof = load_profile(name)
    return render_sbatch(spec_name="t", profile=prof, world_size=ws or prof.max_world, n_cases=3,
                         cases_file="/r/t/.work/t-G.cases.json", results_root="/r", repo="/repo", log_dir="/r/t",
                         case_budget_s=budget)


def test_shipped_profiles_load():
    assert {"a100_8", "a100_32", "a800_32", "a100_roce_emu", "a100_roce_emu_slurm"} <= set(known_profiles())
    emu = load_profile("a100_roce_emu")
    assert (emu.scheduler, emu.nodes, emu.ranks_per_node, emu.hardware) == ("emulated", 2, 2, "a100_pcie_roce_4x8")
    assert emu.max_world == 4 and emu.nodes_for(4) == 2 and emu.procs_per_node(4) == 2 and not emu.via_slurm
    assert load_profile("a100_roce_emu_slurm").via_slurm
    from experiments.harness.spec import load_any

    assert all(s.profile.via_slurm for s in load_any("emulated_slurm").specs)
    cpu = load_any("cpu")
    # the CPU preset runs on loopback, the emulated 2 x 2 cluster and (decode) the emulated 2 x 4 one
    assert {s.cluster for s in cpu.specs} == {"cpu", "a100_roce_emu", "a800_ib_emu_2x4"}


@pytest.mark.parametrize("edit,key", [
    (lambda d: d.pop("ranks_per_node"), "ranks_per_node"),
    (lambda d: d.update(ranks_per_node=0), "ranks_per_node"),
    (lambda d: d.pop("hardware"), "hardware"),
    (lambda d: d.update(hardware="a100_pcie_8"), "nodes"),         # 2 nodes, hardware without an inter link
    (lambda d: d.update(device="cuda"), "device"),
    (lambda d: d.update(launcher="mpirun"), "launcher"),
    (lambda d: d.update(link_rates={"intra": 1e6, "inter": -5}), "link_rates.inter"),
    (lambda d: d.update(link_rates={"intra": 1e6, "pcie": 5}), "link_rates.pcie"),
    (lambda d: d.update(link_rates={"intra": 1e6}), "link_rates.inter"),
    (lambda d: d.update(latency_cap_us=-1), "latency_cap_us"),
    (lambda d: d.update(nodes=0), "nodes"),
    (lambda d: d.update(time_limit="forever"), "time_limit"),
    (lambda d: d.update(env={"NCCL IB": "x"}), "env.NCCL IB"),
    (lambda d: d.update(speed=3), "speed"),
    (lambda d: d.update(scheduler="pbs"), "scheduler"),
    (lambda d: d.update(nics_per_node=3), "nics_per_node"),            # 3 NICs for 2 ranks
    (lambda d: d.update(nics_per_node=-1), "nics_per_node"),
])
def test_bad_profiles_name_file_and_key(edit, key):
    raw = yaml.safe_load((PROFILE_DIR / "a100_roce_emu.yaml").read_text())
    raw = copy.deepcopy(raw)
    edit(raw)
    with pytest.raises(ValueError, match=rf"bad\.yaml: key '{re.escape(key)}'"):
        parse_profile(raw, "bad.yaml")


def test_emulated_keys_are_refused_elsewhere():
    raw = yaml.safe_load((PROFILE_DIR / "a100_32.yaml").read_text())
    with pytest.raises(ValueError, match="key 'ranks_per_node': only applies to scheduler: emulated"):
        parse_profile({**raw, "ranks_per_node": 2}, "x.yaml")
    with pytest.raises(ValueError, match="key 'nics_per_node': only applies to scheduler: emulated"):
        parse_profile({**raw, "nics_per_node": 2}, "x.yaml")


# ---------------------------------------------------------------- NICs of emulated nodes


def test_nic_profiles_load_and_their_nics():
    conv = {n: load_profile(n) for n in ("a100_roce_emu", "a100_roce_emu_nic2", "a800_ib_emu_2x4",
                                         "a800_ib_emu_2x4_nic2")}
    assert [(p.nodes, p.ranks_per_node, p.ranks_per_nic) for p in conv.values()] == [
        (2, 2, 1), (2, 2, 2), (2, 4, 1), (2, 4, 2)]
    assert conv["a800_ib_emu_2x4"].hardware == conv["a800_ib_emu_2x4_nic2"].hardware == "a800_ib_4x8"


def test_an_emulated_nic_carries_no_more_ranks_than_the_hardwares():
    raw = yaml.safe_load((PROFILE_DIR / "a800_ib_emu_2x4_nic2.yaml").read_text())
    # 4 ranks on one NIC: the A800 has 2 GPUs per HCA, so a lone flow would outrun the real HCA
    with pytest.raises(ValueError, match=r"bad\.yaml: key 'nics_per_node': 1 puts 4 ranks on one NIC, more than the 2"):
        parse_profile({**raw, "nics_per_node": 1}, "bad.yaml")
    with pytest.raises(ValueError, match=r"key 'nics_per_node': 3 must divide ranks_per_node=4"):
        parse_profile({**raw, "nics_per_node": 3}, "bad.yaml")


def test_emulated_target_keeps_the_per_rank_share_and_widens_the_nic():
    from experiments.profiles.cluster import emulated_target

    hw = load_hardware("a800_ib_4x8")
    per_rank = emulated_target(load_profile("a800_ib_emu_2x4"))
    shared = emulated_target(load_profile("a800_ib_emu_2x4_nic2"))
    for t in (per_rank, shared):
        assert (t.nodes, t.devices_per_node) == (2, 4)
        assert t.inter.bytes_per_s == pytest.approx(hw.inter.bytes_per_s)      # every rank crossing: the share
    assert (per_rank.nics, shared.nics) == (4, 2)
    assert per_rank.inter_flow_bytes_per_s(1) == pytest.approx(hw.inter.bytes_per_s)   # a lone flow: the share
    assert shared.inter_flow_bytes_per_s(1) == pytest.approx(hw.inter.nic_bytes_per_s)  # a lone flow: the HCA
    with pytest.raises(ValueError, match="scheduler='slurm'"):
        emulated_target(load_profile("a800_32"))


def test_time_limits():
    assert parse_time_limit("04:00:00") == 14400
    assert parse_time_limit("1-12:00:00") == 129600
    assert parse_time_limit("30") == 1800 and parse_time_limit("10:30") == 630


# ---------------------------------------------------------------- the scaling rule


def test_scaling_rule_arithmetic():
    hw = load_hardware("a100_pcie_roce_4x8")
    cal = emulation.Calibration(tokens=1024, heads=8, head_dim=32, dtype="float32", procs=4, threads=1,
                                flops_per_s=(4e9, 5e9, 6e9, 5e9))
    s = emulation.scale(hw, cal, latency_cap_us=2000, netem=False)
    c_t = 19.5e12 * hw.accelerator.efficiency(1024)          # A100 fp32 peak x kernel efficiency at 1024 tokens
    assert s.target_flops_s == pytest.approx(c_t)
    assert s.dilation == pytest.approx(c_t / 5e9)            # median of the four ranks
    assert s.links["inter"].bytes_s == pytest.approx(600e9 / 8 * 0.8 / 8 * 5e9 / c_t)
    assert s.links["intra"].bytes_s == pytest.approx(256e9 / 8 * 0.75 * 5e9 / c_t)
    # latency: dilated, not applied without netem; applied and capped with it
    assert s.links["inter"].latency_dilated_us == pytest.approx(5 * s.dilation)
    assert s.links["inter"].latency_us == 0 and "netem" in s.links["inter"].latency_note
    s2 = emulation.scale(hw, cal, latency_cap_us=100, netem=True)
    assert s2.links["inter"].latency_us == 100 and "capped" in s2.links["inter"].latency_note
    with pytest.raises(ValueError, match="dtype='int8'"):
        emulation.scale(hw, emulation.Calibration(1024, 8, 32, "int8", 1, 1, (1e9,)))
    # two ranks per emulated NIC: the NIC is two per-rank shares, a lone flow gets it (below PCIe here)
    s3 = emulation.scale(hw, cal, ranks_per_nic=2)
    assert s3.links["inter"].bytes_s == pytest.approx(s.links["inter"].bytes_s)
    assert s3.links["inter"].nic_bytes_s == pytest.approx(2 * s.links["inter"].bytes_s)
    assert s3.links["inter"].lone_shape.bytes_per_s == pytest.approx(2 * s.links["inter"].bytes_s)
    assert s.links["inter"].lone_shape.bytes_per_s == pytest.approx(s.links["inter"].bytes_s)   # its own NIC
    # four per NIC would give a lone flow 30 GB/s: capped at the GPU's 24 GB/s PCIe link (scaled)
    s4 = emulation.scale(hw, cal, ranks_per_nic=4)
    assert s4.links["inter"].lone_shape.bytes_per_s == pytest.approx(s.links["intra"].bytes_s)


def test_shaping_commands():
    cmds = shaping.rank_commands("10.77.1.0/24", "10.77.0.0/16", shaping.LinkShape(1e6),
                                 shaping.LinkShape(2e5, latency_us=300), netem=False)
    text = [" ".join(c) for c in cmds]
    # payload bytes/s -> wire bit/s (1514-byte frames carry 1448 payload bytes)
    assert any(f"classid 1:10 htb rate {round(1e6 * 1514 / 1448 * 8)}bit" in t for t in text)
    assert any(f"classid 1:20 htb rate {round(2e5 * 1514 / 1448 * 8)}bit" in t for t in text)
    assert any("match ip dst 10.77.1.0/24 flowid 1:10" in t for t in text)
    assert any("match ip dst 10.77.0.0/16 flowid 1:20" in t for t in text)
    assert not any("netem" in t for t in text)
    with_netem = [" ".join(c) for c in shaping.rank_commands("a", "b", shaping.LinkShape(1e6),
                                                             shaping.LinkShape(2e5, 300), netem=True)]
    assert any("parent 1:20 handle 20: netem delay 300us" in t for t in with_netem)
    with pytest.raises(ValueError, match="bytes_per_s"):
        shaping.LinkShape(0)


def test_nic_shaping_commands():
    """Two NICs of two ranks: one HTB class per NIC at its rate, a leaf per rank (its share assured, the
    NIC as ceiling) chosen by source address, ACKs and the node's own traffic unshaped."""
    nic = shaping.NicShape(2, shaping.LinkShape(1e6), shaping.LinkShape(1e6))
    addrs = ["10.77.0.10", "10.77.0.11", "10.77.0.12", "10.77.0.13"]
    text = [" ".join(c) for c in shaping.nic_commands(addrs, nic)]
    full, half = round(1e6 * 1514 / 1448 * 8), round(5e5 * 1514 / 1448 * 8)
    assert text[0] == "qdisc add dev uplink root handle 1: htb default 30"
    for n in (0, 1):
        assert any(f"parent 1: classid 1:{100 + n} htb rate {full}bit ceil {full}bit" in t for t in text)
    for k, a in enumerate(addrs):
        assert any(f"parent 1:{100 + k // 2} classid 1:{1000 + k} htb rate {half}bit ceil {full}bit" in t for t in text)
        assert any(f"match ip src {a}/32 flowid 1:{1000 + k}" in t for t in text)
    assert any("flowid 1:30" in t and "at 33" in t for t in text)          # pure ACKs bypass the NIC
    with pytest.raises(ValueError, match="ranks_per_nic=2 must divide the node's 3 ranks"):
        shaping.nic_commands(addrs[:3], nic)
    with pytest.raises(ValueError, match="ranks_per_nic=0"):
        shaping.NicShape(0, shaping.LinkShape(1e6), shaping.LinkShape(1e6))


def test_fallback_says_so(monkeypatch):
    """Where namespaces are not permitted the cluster is plain loopback, and its record info says so."""
    from experiments.cluster.emulator import netns
    from experiments.figure_parts import cluster_note as _cluster_note

    monkeypatch.setattr(netns, "probe", lambda: "network namespaces need root (test)")
    with EmulatedCluster(load_profile("a100_roce_emu"), log=lambda *_: None) as cl:
        info = cl.info(4)
        assert not cl.emulated and info["emulated"] is False and "loopback" in info["fallback"]
        (cmd,) = cl.launches(4, ["--cases", "x"], port=1)
        assert "--standalone" in cmd and "nsenter" not in cmd
    import pandas as pd

    assert "not emulated" in _cluster_note(pd.DataFrame({"cluster": [info]}))


def test_rankexec_enters_the_ranks_namespace(tmp_path):
    env = {"BURST_EMU_RANK_NETNS": str(tmp_path / "bemu1-n{node}r{local_rank}"), "GROUP_RANK": "1",
           "LOCAL_RANK": "0"}
    (tmp_path / "bemu1-n1r0").touch()
    cmd = rank_command("experiments.harness.worker", ["--cases", "c"], env)
    assert cmd[:2] == ["nsenter", f"--net={tmp_path / 'bemu1-n1r0'}"] and cmd[-3:] == ["worker", "--cases", "c"][-3:] \
        or cmd[-2:] == ["--cases", "c"]
    with pytest.raises(SystemExit, match="does not exist"):
        rank_command("m", [], {**env, "LOCAL_RANK": "5"})
    assert rank_command("m", ["a"], {})[1:] == ["-m", "m", "a"]


# ---------------------------------------------------------------- SLURM job scripts (issue 8, item 5)


@pytest.mark.parametrize("name", SLURM_PROFILES)
def test_every_profiles_job_script(name, tmp_path):
    prof = load_profile(name)
    text = _render(name)
    p = tmp_path / "job.sbatch"
    p.write_text(text)
    assert subprocess.run(["bash", "-n", str(p)], capture_output=True).returncode == 0, text
    # per-node setup on every node, inside srun, before the executor's first launch
    setup_at = text.index("srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c")
    assert setup_at < text.index("-m experiments.harness.executor --slurm")
    # rendezvous: the first node's NodeAddr, a port of this job's own (the executor adds 1 per relaunch)
    assert "scontrol show node \"$FIRST_NODE\"" in text and "NodeAddr=" in text
    assert f"export MASTER_PORT=$(( {prof.master_port} + SLURM_JOB_ID % 2000 ))" in text
    assert '--master-port "$MASTER_PORT"' in text
    # a results folder per job, merged at the end; cases the executor did not record are recorded failed
    assert 'export RESULTS="$RESULTS_ROOT/.jobs/$SLURM_JOB_ID"' in text
    assert "--fail-rest" in text and "experiments.cluster.jobs merge" in text and "--cases \"$CASES\"" in text
    # the executor stops before the job's time limit, with a reserve for the last records and the merge
    assert f"TIME_LIMIT_S={prof.time_limit_s}" in text and f"RESERVE_S={RESERVE_S}" in text
    assert "--deadline-s $(( TIME_LIMIT_S - RESERVE_S - SECONDS ))" in text
    for k, v in prof.env.items():
        assert f"export {k}=" in text
    if prof.device == "cuda":
        # the venv is built on the compute node with the GPU path (CUDA torch + gpu extras), never a CPU torch
        assert "make venv VENV=.venv-gpu REQUIRE_GPU=1" in text and "flock .venv-gpu.lock" in text
        assert "nvidia-smi -L" in text and "torch.cuda.is_available()" in text
        assert "--gpus-per-node=" in text and "--device cuda" in text
        assert ".venv-gpu/bin/python -m experiments.harness.executor --slurm" in text
    else:
        assert "--gpus-per-node" not in text and "--device cpu" in text
        assert "--entry '-m experiments.cluster.emulator.rankexec experiments.harness.worker'" in text


def test_roce_and_ib_profiles_carry_nccl_settings():
    roce, ib = load_profile("a100_32"), load_profile("a800_32")
    assert {"NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_SOCKET_IFNAME"} <= set(roce.env)
    assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"} <= set(ib.env) and len(ib.env["NCCL_IB_HCA"].split(",")) == 4


def test_budget_beyond_the_time_limit_is_noted():
    text = _render("a100_8", ws=8, budget=101_400)
    assert "NOTE: the cases' budgets" in text
    assert "NOTE" not in _render("a100_8", ws=8, budget=100)


def test_placeholders_are_refused_before_submission(tmp_path, capsys):
    from experiments.run import main

    with pytest.raises(ValueError, match=r"a100_32\.yaml: key\(s\) \['partition', 'account'\]"):
        check_submittable(load_profile("a100_32"))
    check_submittable(load_profile("a100_roce_emu_slurm"))     # emulated: nothing to fill in
    with pytest.raises(SystemExit, match="refusing to submit.*<PARTITION>"):
        main(["a100_32", "--results", str(tmp_path / "r")])
    assert not list((tmp_path / "r").glob("*/slurm/*")) and not list((tmp_path / "r").glob("*/.work/*"))
    # a dry run shows the scripts, warns, and writes nothing under results/
    assert main(["a100_32", "--dry-run", "--results", str(tmp_path / "dry")]) == 0
    out = capsys.readouterr()
    assert "#SBATCH --nodes=4" in out.out and "WARNING (dry run)" in out.err
    assert not (tmp_path / "dry").exists()


# ---------------------------------------------------------------- a job's results folder


def _case(i: int) -> Case:
    return Case(experiment="t_job", method="burst", level="op", mode="fwd_bwd",
                shape=AttnShape(1, 64 * (i + 1), 2, 2, 16, 2, dtype="float32", causal=True, layout="zigzag"),
                warmup=0, repeats=1, seed=0)


def test_job_records_unfinished_and_merges(tmp_path):
    from experiments.harness.executor import record_rest

    root, job = tmp_path / "results", tmp_path / "results" / ".jobs" / "17"
    cases = [_case(i) for i in range(3)]
    R.append_record(root, R.base_record(_case(9), "ok"))                    # earlier results stay
    R.append_record(job, R.base_record(cases[0], "ok"))
    (job / "t_job" / R.RESULTS_FILE).open("a").write('{"torn')               # a killed writer's last line
    assert record_rest(cases, job, "time limit") == [cases[1].case_id, cases[2].case_id]
    assert jobs.merge(job, root) == 3
    recs = R.latest_by_case(R.read_records(root / "t_job" / R.RESULTS_FILE))
    assert len(recs) == 4 and recs[cases[2].case_id]["status"] == "failed"
    assert "time limit" in recs[cases[2].case_id]["reason"]
    assert not (root / ".jobs").exists()
    # a job killed before its merge step leaves its folder: the next run merges it
    R.append_record(root / ".jobs" / "18", R.base_record(cases[1], "ok"))
    assert jobs.merge_leftovers(root) == 1
    assert R.latest_by_case(R.read_records(root / "t_job" / R.RESULTS_FILE))[cases[1].case_id]["status"] == "ok"


def test_records_name_their_cluster(monkeypatch):
    monkeypatch.setenv(R.CLUSTER_ENV, json.dumps({"profile": "a100_roce_emu", "links": {"inter": {"bytes_per_s": 5}}}))
    rec = R.base_record(_case(0), "ok")
    assert rec["cluster"]["profile"] == "a100_roce_emu" and rec["cluster"]["links"]["inter"]["bytes_per_s"] == 5
    assert rec["cluster"]["ranks_per_core"] > 0
    monkeypatch.delenv(R.CLUSTER_ENV)
    assert R.base_record(_case(0), "ok")["cluster"]["profile"] is None


def test_a_dead_ranks_cause_beats_its_peers_lost_connections(tmp_path):
    c = _case(0)
    R.write_rank_error(tmp_path, c, 0, "failed",
                       "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.77.1.10]")
    R.write_rank_error(tmp_path, c, 3, "failed", "RuntimeError: injected failure")
    assert R.failure_from_errors(tmp_path, c, "x") == ("failed", "rank 3: RuntimeError: injected failure")

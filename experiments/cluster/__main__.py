"""The emulated cluster by hand (``burst-bench cluster``; ``python -m experiments.cluster`` is the same).

    burst-bench cluster up a100_roce_emu            # bring up, show, hold until Ctrl-C, tear down
    burst-bench cluster up a100_roce_emu --detach   # leave it up (remove with `down`)
    burst-bench cluster show                        # emulated clusters here: topology, rates, bytes per class
    burst-bench cluster selftest a100_roce_emu      # bring up, measure each link class, tear down
    burst-bench cluster selftest a100_roce_emu --rates intra=4e6,inter=1e6   # given rates, no calibration
    burst-bench cluster overlap a800_ib_emu_3x2 --out F.json   # what overlap hides (overlap_probe.py)
    burst-bench cluster messages a800_ib_emu_2x4 --out F.json  # what a small blocking message costs (message_probe.py)
    burst-bench cluster calls a800_ib_emu_2x4 --out call_cpu.json   # the CPU a call costs a rank (call_probe.py)
    burst-bench cluster lockstep a800_ib_emu_2x4 --out F.json  # a rank's share in lockstep (lockstep_probe.py)
    burst-bench cluster sends a800_ib_emu_2x4 --out F.json     # how long a send holds its rank (send_probe.py)
    burst-bench cluster down bemu1a2b3c             # one cluster; --stale: those whose owner died; --all
    burst-bench cluster report cpu_train_emulated   # measured vs predicted time ratios of an experiment
    burst-bench cluster report cpu_train_emulated --model   # + the performance model, per case
    burst-bench cluster ratios cpu_double_ring_emulated   # speedups over --ref and overlap on/off, intervals
    burst-bench cluster history cpu_varlen_magiattention_2x4 --target 0.15   # the model now against every committed run

A tool that fails (namespaces not permitted, a probe's rank that dies, a self-test outside its tolerance)
answers ``error: <message>`` and exit status 2, as a user's mistake does; ``--debug`` shows the traceback.

Needs root (network namespaces); SLURM profiles need the Debian packages slurmd, slurmctld, slurm-client, munge.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from ..cli import DEBUG_FLAG, DEBUG_HELP, ToolFailed, prog, run_cli
from ..harness import env as provenance
from ..harness.launch import run_launch
from .emulator import (call_probe, lockstep_probe, message_probe, netns, overlap_probe, selftest, send_probe,
                       shaping)
from .emulator.emulated import EmulatedCluster
from ..profiles.cluster import load_profile
from ..perfmodel.emulated.history import history_table, replay
from ..perfmodel.emulated.validate import MEMORY_RULES, TARGET
from ..perfmodel.emulated.validate_decode import is_inference, validate_inference, write_report as write_inference
from .report import ratios_of, report, results_root_of, with_model, write_report

SELFTEST_TOLERANCE = 0.15       # of each link class's measured rate from its configured one


def _profile(name: str, rates: str | None):
    prof = load_profile(name)
    if prof.scheduler != "emulated":
        raise SystemExit(f"profile {name!r} is not an emulated one (scheduler: {prof.scheduler})")
    if rates:
        d = {k: float(v) for k, v in (x.split("=") for x in rates.split(","))}
        prof = dataclasses.replace(prof, link_rates=d)
    return prof


def show(cl: EmulatedCluster | None = None) -> None:
    ids = [cl.topo.run_id] if cl is not None and cl.topo else netns.run_ids()
    if not ids:
        print("no emulated cluster on this machine")
    for rid in ids:
        st = netns.read_state(rid)
        topo = st.get("topology", {})
        owner = st.get("owner_pid")
        print(f"{rid}: profile {st.get('profile', '?')}, owner pid {owner}"
              f"{' (detached)' if st.get('detached') else ' (gone: stale)' if rid in netns.stale() else ''}, "
              f"work dir {st.get('work', '-')}")
        print(f"  head {topo.get('head_addr')} (slurmctld, munged)")
        for i, addr in enumerate(topo.get("node_addrs", [])):
            print(f"  node n{i} {addr} (namespace {rid}-n{i}): ranks "
                  + ", ".join(f"r{k} {a}" for k, a in enumerate(topo["rank_addrs"][i])))
        for k, v in (st.get("scaling", {}) or {}).get("links", {}).items():
            print(f"  {k:5s} {v['bytes_s'] / 1e6:10.4g} MB/s per rank (target {v['kind']} "
                  f"{v['target_bytes_s'] / 1e9:.3g} GB/s); latency {v['latency_us']:.0f} us applied, "
                  f"{v['latency_dilated_us']:.0f} us dilated {v['latency_note']}")
        inter = (st.get("scaling", {}) or {}).get("links", {}).get("inter") or {}
        if inter.get("ranks_per_nic", 1) > 1:
            nic = inter["bytes_s"] * inter["ranks_per_nic"]
            print(f"  NICs: {inter['ranks_per_nic']} ranks per NIC of {nic / 1e6:.4g} MB/s (a lone flow "
                  f"{(inter.get('lone_bytes_s') or nic) / 1e6:.4g} MB/s), shaped on each node's uplink")
        if st.get("scaling", {}).get("dilation"):
            print(f"  time dilation {st['scaling']['dilation']:.4g}x")
        for i in range(topo.get("nodes", 0)):
            for k in range(topo.get("ranks_per_node", 0)):
                cls = shaping.class_stats(f"{rid}-n{i}r{k}")
                sent = ", ".join(f"{name} {cls[h]['bytes']} B" for h, name in
                                 (("1:10", "intra"), ("1:20", "inter"), ("1:30", "other")) if h in cls)
                print(f"  n{i}r{k} sent: {sent}")
            up = shaping.class_stats(f"{rid}-n{i}", "uplink")       # NIC classes exist only where ranks share one
            nics = sorted(h for h in up if h.startswith("1:") and 100 <= int(h[2:] or 0) < 1000)
            if nics:
                print(f"  n{i} NICs sent: " + ", ".join(f"NIC {int(h[2:]) - 100} {up[h]['bytes']} B" for h in nics))


def _selftest(prof, seconds: float) -> int:
    with EmulatedCluster(prof) as cl:
        if not cl.emulated:
            raise ToolFailed(f"cannot self-test {prof.name}: {cl.fallback}")
        show(cl)
        res = selftest.measure(cl.topo, seconds)
        worst = 0.0
        for k, d in res.items():
            want = cl.scaling.links[k].bytes_s
            err = d["bytes_per_s"] / want - 1
            worst = max(worst, abs(err))
            flows = ", ".join(f"{f['bytes_per_s'] / 1e6:.4g}" for f in d["flows"])
            print(f"{k:5s}: configured {want / 1e6:.4g} MB/s, measured {d['bytes_per_s'] / 1e6:.4g} MB/s "
                  f"({err:+.1%}); flows {flows} MB/s")
        inter = cl.scaling.links.get("inter")
        if inter is not None and cl.topo.nodes > 1:      # one NIC alone, then all its ranks at once
            nic = selftest.measure_nic(cl.topo, inter.ranks_per_nic, seconds)
            wants = (("lone", inter.lone_shape.bytes_per_s), ("concurrent", inter.nic_bytes_s / inter.ranks_per_nic))
            for k, want in wants:
                err = nic[k]["bytes_per_s"] / want - 1
                worst = max(worst, abs(err))
                flows = ", ".join(f"{f['bytes_per_s'] / 1e6:.4g}" for f in nic[k]["flows"])
                print(f"NIC 0 of n0, {k:10s} ({len(nic[k]['flows'])} flow(s), {inter.ranks_per_nic} rank(s) per NIC): "
                      f"configured {want / 1e6:.4g} MB/s each, measured {nic[k]['bytes_per_s'] / 1e6:.4g} MB/s "
                      f"({err:+.1%}); flows {flows} MB/s")
        print(f"worst deviation {worst:.1%}")
        for line in _message_lines(cl):
            print(line)
    if worst > SELFTEST_TOLERANCE:
        raise ToolFailed(f"self-test of {prof.name}: worst deviation {worst:.1%} from the configured rates, "
                         f"above the {SELFTEST_TOLERANCE:.0%} tolerance (a loaded machine, or shaping that does "
                         "not hold)")
    return 0


def _message_lines(cl, nbytes: int = 1 << 19) -> list[str]:
    """One 512 KiB message per link class after an idle spell, against bytes / rate (a lone flow's)."""
    out = []
    for k, link in cl.scaling.links.items():
        if (k == "intra" and cl.topo.ranks_per_node < 2) or (k == "inter" and cl.topo.nodes < 2):
            continue
        rate = link.lone_shape.bytes_per_s          # a lone flow's: the whole NIC where ranks share one
        dst = (0, 1) if k == "intra" else (1, 0)
        m = selftest.measure_message(cl.topo, (0, 0), dst, nbytes)
        out.append(f"{k:5s}: one {nbytes >> 10} KiB message after {m['idle_s'] * 1e3:.0f} ms idle: "
                   f"{m['seconds'] * 1e3:.2f} ms, bytes / rate {nbytes / rate * 1e3:.2f} ms "
                   f"(x{m['seconds'] * rate / nbytes:.2f}; < 1: ahead of the link on its bucket)")
    return out


def _launch_probe(prof, module: str, marker: str, worker_args: list[str], world: int) -> tuple[list, dict]:
    """Bring a cluster up, run ``emulator/<module>.py`` on ``world`` ranks at once (placed as a run of that
    world size), tear it down: (its per-rank JSON, the cluster's info). Rank 0 prints ``<marker> <json>``."""
    with EmulatedCluster(prof) as cl, tempfile.TemporaryDirectory(prefix="bemu-probe-") as work:
        if not cl.emulated:
            raise ToolFailed(f"cannot probe {prof.name}: {cl.fallback}")
        env = dict(os.environ, **cl.env(world), OMP_NUM_THREADS="1")
        cmds = cl.launches(world, worker_args, port=29590, module=f"experiments.cluster.emulator.{module}")
        rc, logs = run_launch([(c, env) for c in cmds], provenance.REPO, Path(work) / "probe.log", timeout_s=900)
        info = cl.info(world)
    lines = [ln for ln in logs.splitlines() if ln.startswith(marker + " ")]
    if rc != 0 or not lines:
        raise ToolFailed(f"{module.replace('_', ' ')} failed (exit status {rc}); the ranks' log ends: "
                         f"{logs.strip()[-1200:]}")
    return json.loads(lines[0].split(" ", 1)[1]), info


def _write_probe(out: str | None, mod, prof, probe: str, info: dict, repeats: int, cases, rows, per_rank,
                 world: int) -> None:
    """The probe's record: the whole file, or through ``mod.write(out, rows, provenance)`` where the probe's rows
    join others (``call_probe``: call_cpu.json's rows of several world sizes)."""
    if not out:
        return
    meta = {"probe": probe, "profile": prof.name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "git": provenance.git_info(), "versions": provenance.versions(),
            "hardware": provenance.hardware(world), "cluster": info, "repeats": repeats}
    if hasattr(mod, "write"):
        mod.write(out, rows, meta)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({**meta, "cases": [c.name for c in cases], "rows": rows, "per_rank": per_rank}, f, indent=1)
    print(f"wrote {out}")


PROBES = {"overlap": (overlap_probe, "OVERLAP_PROBE"), "messages": (message_probe, "MESSAGE_PROBE"),
          "calls": (call_probe, "CALL_PROBE"), "lockstep": (lockstep_probe, "LOCKSTEP_PROBE"),
          "sends": (send_probe, "SEND_PROBE")}
PROBE_HELP = {    # kind: (help, default repeats, case syntax)
    "overlap": ("what overlap hides: compute, a transfer, and both at once on every rank", 5,
                "<ring|pair|oneway>:<tokens>:<bytes>"),
    "messages": ("what a small message costs a rank that waits for it (lone hops and gloo collectives)", 10,
                 "<ring|pair|all_gather|all_reduce|all_to_all>:<bytes>"),
    "calls": ("the process CPU a call costs each rank at a few tokens (the host term; call_cpu.json's rows)", 60,
              "<method>:<tokens>[:<layout>] or decode:<row>:<tokens>:<batch>"),
    "lockstep": ("the share of a core a rank runs at, free-running and meeting its peers after each piece", 10,
                 "<cpu_us> (a compute piece's CPU in microseconds) or mem<cpu_us> (a memory piece's)"),
    "sends": ("how long a ring's send holds the rank that posted it (gloo's socket buffers)", 6,
              "<oneway|intra>:<bytes>")}


def _probe(kind: str, prof, repeats: int, cases_text: str, out: str | None, world: int | None = None) -> int:
    """Bring a cluster up, run the ``kind`` probe (``PROBES``: ``overlap_probe``, what overlap hides;
    ``message_probe``, what a small blocking message costs; ``call_probe``, the CPU a call costs) on
    ``world`` ranks at once (None: every rank of the profile), print its table (and write it)."""
    mod, marker = PROBES[kind]
    cases = mod.parse_cases(cases_text)
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    full = prof.nodes * prof.ranks_per_node
    world = full if world is None else world
    if not 1 <= world <= full or (world > prof.ranks_per_node and world % prof.ranks_per_node):
        raise ValueError(f"world_size={world} must be at most {prof.name}'s {full} ranks, and a multiple of its "
                         f"{prof.ranks_per_node} ranks per node above one node")
    mod.check_shape(cases, prof.nodes_for(world), prof.procs_per_node(world))     # before minutes of bring-up
    per_rank, info = _launch_probe(prof, mod.__name__.rsplit(".", 1)[-1], marker, [str(repeats), cases_text], world)
    rows = mod.summarize(per_rank, cases)
    print(info["summary"])
    print(mod.table(rows))
    _write_probe(out, mod, prof, kind, info, repeats, cases, rows, per_rank, world)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog("python -m experiments.cluster"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring an emulated cluster up")
    up.add_argument("profile")
    up.add_argument("--rates", help="intra=<bytes/s>,inter=<bytes/s>: given rates instead of calibrating")
    up.add_argument("--detach", action="store_true", help="leave it up and exit (remove it with `down`)")
    sub.add_parser("show", help="emulated clusters on this machine")
    st = sub.add_parser("selftest", help="measure each link class of a fresh cluster")
    st.add_argument("profile")
    st.add_argument("--rates")
    st.add_argument("--seconds", type=float, default=3.0)
    for kind, (mod, _) in PROBES.items():
        pr = sub.add_parser(kind, help=PROBE_HELP[kind][0])
        pr.add_argument("profile")
        pr.add_argument("--rates")
        pr.add_argument("--repeats", type=int, default=PROBE_HELP[kind][1])
        pr.add_argument("--cases", default=",".join(c.name for c in mod.CASES),
                        help=f"{PROBE_HELP[kind][2]}, comma-separated")
        pr.add_argument("--out", help="write the rows, raw samples and provenance as JSON")
        pr.add_argument("--world-size", type=int, help="ranks to probe on, placed as a run of that many "
                                                        "(default: every rank of the profile)")
    dn = sub.add_parser("down", help="tear clusters down")
    dn.add_argument("run_id", nargs="?")
    dn.add_argument("--stale", action="store_true", help="every cluster whose owner process is gone")
    dn.add_argument("--all", action="store_true", help="every emulated cluster on this machine")
    rp = sub.add_parser("report", help="measured vs predicted time ratios of an emulated experiment")
    rp.add_argument("experiment")
    rp.add_argument("--results", default=None)
    rp.add_argument("--compute-from", help="experiment with the same cases on loopback (compute time per method)")
    rp.add_argument("--ref", default="burst", help="method the ratios are relative to")
    rp.add_argument("--json", action="store_true")
    rp.add_argument("--model", action="store_true",
                    help="also the performance model's predicted / measured per case (measures kernel times here "
                         "if results/<experiment>/kernel_times.json lacks them)")
    rp.add_argument("--write", action="store_true",
                    help="also write it as <results>/<experiment>/emulation_report.txt (what a run writes)")
    rp.add_argument("--plots", help="with --write: also draw <plots>/<experiment>/emulated_vs_modelled.png")
    ra = sub.add_parser("ratios", help="speedups over --ref and overlap on/off gains, with bootstrap intervals")
    ra.add_argument("experiment")
    ra.add_argument("--results", default=None)
    ra.add_argument("--ref", default="burst", help="method the speedups are relative to")
    ra.add_argument("--level", type=float, default=0.95, help="confidence level of the bootstrap intervals")
    ra.add_argument("--json", action="store_true")
    hi = sub.add_parser("history", help="the model as it is now against every committed run of an experiment "
                                        "(each with its own probes and kernel table; measures nothing)")
    hi.add_argument("experiment")
    hi.add_argument("--results", default=None)
    hi.add_argument("--commits", help="comma-separated commits (default: every commit that changed its records)")
    hi.add_argument("--target", type=float, default=TARGET, help="the bound on |predicted / measured - 1|")
    hi.add_argument("--bring-up-load", action="store_true",
                    help="price every record at its run's bring-up load, not its group's reference (as reports "
                         "before 2026-12-07)")
    hi.add_argument("--memory-rule", choices=MEMORY_RULES, default="compute",
                    help="the load memory-bound work (a decode step's attention) goes at: the compute load (since "
                         "2026-12-07), the bring-up's stream (2026-12-06) or the group's own stream")
    hi.add_argument("--kernel-table", default=None,
                    help="price every run with this kernel table instead of its own (one timed afresh here)")
    hi.add_argument("--cfs", action="store_true",
                    help="price each rank's compute under CFS as a fluid (perfmodel/emulated/cfs.py; opt-in)")
    hi.add_argument("--lockstep", action="store_true",
                    help="price a training run's work at its own lockstep probe's factor, as a decode step's "
                         "(perfmodel/emulated/lockstep.py; 1 for a run without the probe; opt-in)")
    hi.add_argument("--json", action="store_true")
    ap.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    if args.cmd == "up":
        cl = EmulatedCluster(_profile(args.profile, args.rates)).up()
        show(cl)
        if args.detach:
            if cl.topo:
                netns.write_state(cl.topo, owner_pid=0, detached=True)
                cl._down = True          # leave it up on purpose
            print(f"left up; remove with: burst-bench cluster down {cl.topo.run_id if cl.topo else ''}")
            return 0
        try:
            print("up; Ctrl-C tears it down")
            signal.pause() if hasattr(signal, "pause") else time.sleep(1e9)
        except KeyboardInterrupt:
            pass
        finally:
            cl.down()
        return 0
    if args.cmd == "show":
        show()
        return 0
    if args.cmd == "selftest":
        return _selftest(_profile(args.profile, args.rates), args.seconds)
    if args.cmd in PROBES:
        return _probe(args.cmd, _profile(args.profile, args.rates), args.repeats, args.cases, args.out,
                      args.world_size)
    if args.cmd == "down":
        ids = netns.run_ids() if args.all else netns.stale() if args.stale else [args.run_id] if args.run_id else []
        if not ids:
            print("nothing to remove" if (args.all or args.stale) else "name a run id, or --stale / --all")
        for rid in ids:
            print(f"{rid}: removed {len(netns.teardown(rid))} namespace(s)")
        return 0
    if args.cmd == "report":
        if args.plots and not args.write:
            raise ValueError(f"--plots={args.plots!r} draws the figure of --write; add --write")
        if is_inference(results_root_of(args.results), args.experiment):
            return _inference_report(args)
        out = report(args.experiment, results_root=args.results, compute_from=args.compute_from, ref=args.ref)
        if args.model:
            out = with_model(out, args.results)
        print(json.dumps(out, indent=1, default=str) if args.json else out["text"])
        if args.write:
            print("wrote " + ", ".join(str(f) for f in write_report(out, args.results, args.plots)))
        return 0
    if args.cmd == "history":
        if not 0 < args.target < 1:
            raise ValueError(f"target={args.target} must be in (0, 1)")
        commits = [c for c in (args.commits or "").split(",") if c] or None
        out = history_table(replay(results_root_of(args.results), args.experiment, commits,
                                   at_reference=not args.bring_up_load, memory_rule=args.memory_rule,
                                   kernel_table=args.kernel_table, cfs=args.cfs,
                                   lockstep=args.lockstep), args.target,
                            f"the kernel table {args.kernel_table}" if args.kernel_table else "kernel table")
        print(json.dumps(out, indent=1, default=str) if args.json else out["text"])
        return 0
    if args.cmd == "ratios":
        out = ratios_of(args.experiment, results_root=args.results, ref=args.ref, level=args.level)
        print(json.dumps(out, indent=1, default=str) if args.json else out["text"])
        return 0
    return 2


def _inference_report(args) -> int:
    """What a run of an inference spec prints and writes (perfmodel/emulated/validate_decode.py): the model is
    always compared (there is no report without it); --write also writes emulation_report.txt."""
    if args.json or args.ref != "burst" or args.compute_from:
        raise ValueError(f"experiment={args.experiment!r} is an inference experiment: its report takes only "
                         "--results, --model and --write (no --json, --ref or --compute-from)")
    root = results_root_of(args.results)
    # --write writes the validation file as well, as the run does; without it nothing is written
    print(write_inference(root, args.experiment) if args.write else
          f"{args.experiment}\n" + validate_inference(root, args.experiment, write=False)["text"])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))

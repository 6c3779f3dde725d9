"""The GPU check: every CUDA kernel and peer of the suite, run once, on whatever GPUs this machine has.

    make gpu-check                         # = python -m experiments.gpu_check (builds the venv first)
    python -m experiments.gpu_check --steps packages,tests    # a part of it

Installs nothing, builds nothing. Prints its plan first: the steps in five calls
(``CALLS``), each held to ``STEP_BUDGET_S`` (540 s) so that one command of a lent
device (600 s) runs it. Steps, each recorded as ok / failed / skipped (with the reason):

1. ``packages``: which GPU packages import here, and their versions (torch's CUDA and
   NCCL, flash-attn, xformers and whether its backward honours lse, ring-flash-attn
   through ``baselines.methods.ring_flash_attn_shim``, liger-kernel, cut-cross-entropy,
   deepspeed). Failed when a package is installed but does not import, when xformers'
   lse probe fails, or when a ``--require``d package is not usable.
2. ``tests``: ``pytest tests/test_cuda_path.py``: every CUDA kernel against the fp64
   reference (out, lse, dq, dk, dv; bf16, fp16, fp32; causal and not; GQA; the block
   backward from a global lse), the operator and the ring-flash-attn adapter at world size 1.
3. ``harness``: the experiment runner and worker at world size 1 (CUDA events,
   ``torch.cuda.max_memory_allocated``), ``burst`` with each CUDA kernel by name,
   then the ring-flash-attn adapter (skipped with the reason where not installed).
4. ``multi``: the same runner under ``torchrun --nproc-per-node G`` on NCCL for G =
   2, 4, ... up to the GPUs visible (burst, ring, ulysses, ring_flash_attn);
   skipped, with the reason, on one GPU.
5. ``sweep``: TFLOP/s vs sequence length of each CUDA kernel next to
   ``torch.nn.functional.scaled_dot_product_attention`` (``experiments.harness.kernel_sweep``).
6. ``sdpa``, ``gemm``, ``memory``: the H200 profile's constants (``gpu_ceilings``, ``gpu_memory``).
7. ``varlen``: burst at G 1 under full, causal, varlen-full, varlen-causal and window masks
   (``varlen_spec``): the kernel's TFLOP/s under each mask.
8. ``decode``: decode attention and a device copy against the model's HBM roofline
   (``gpu_ceilings.decode_table``, ``decode.json``), then the one-layer decode step through the
   runner (``decode_spec``, ``decode_op/``).

Writes, for the GPU it ran on (``<gpu>`` = its name in lower case, e.g. ``nvidia-h200``):
``results/gpu_check/<gpu>/summary.json`` (steps, packages, devices, git, versions,
hardware), ``tests/junit.xml`` and ``tests/pytest.log``, ``harness/``, ``peers/``,
``multi/`` and ``kernels/`` (``results.jsonl`` each, the suite's record format), and
``plots/gpu_check/<gpu>/kernel_tflops_vs_seqlen.png``, and packs all of it into
``results/gpu_check/<gpu>.tar.gz``. Exit status 1 if a step failed. Without a CUDA
device: exit 1 when ``nvidia-smi`` lists GPUs (torch cannot use them), else it says
there is nothing to check and exits 0.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .cli import prog
from .harness import env
from .harness import kernel_sweep as KS
from .harness import results as R
from .harness.env import REPO
from baselines.methods import ring_flash_attn_shim
from burst_impl.kernels import BACKENDS
from burst_impl.kernels import xformers as xf
from .harness.spec import Preset, parse_spec
from .run import plan, run_local, write_resolved
from . import gpu_ceilings as GC
from . import gpu_memory as GM
from . import kernel_figure as KF

STEPS = ("packages", "tests", "sdpa", "gemm", "memory", "harness", "multi", "sweep", "varlen", "decode")
CUDA_KERNELS = ("flash_attn", "xformers", "cuda_sdpa", "cuda_flash", "cuda_cudnn")
# (name shown, module imported, distribution names for the version)
PACKAGES = (
    ("flash-attn", "flash_attn", ("flash-attn", "flash_attn")),
    ("xformers", "xformers.ops.fmha", ("xformers",)),
    ("ring-flash-attn", "ring_flash_attn", ("ring-flash-attn", "ring_flash_attn")),
    ("liger-kernel", "liger_kernel", ("liger-kernel", "liger_kernel")),
    ("cut-cross-entropy", "cut_cross_entropy", ("cut-cross-entropy", "cut_cross_entropy")),
    ("deepspeed", "deepspeed", ("deepspeed",)),
)
NO_DEVICE = "no CUDA device: nothing to check"
# A lent device runs one command for at most 600 s, start-up and copying back included: each call of
# the check (CALLS, one ``--steps`` each) is held to this, the records of what ran coming back whole.
STEP_BUDGET_S = 540
CALLS = (("packages", "tests", "sdpa", "gemm", "memory"), ("harness",), ("multi",), ("sweep",), ("varlen", "decode"))
# --deadline-s: the whole invocation in one device command (a 15-minute lease has room for one call and
# a rerun): each step then gets what is left, less MARGIN_S for the summary and the archive
MARGIN_S = 20
MIN_STEP_S = 15
LAUNCH_ALLOWANCE_S = 45      # per runner launch: spawn, import torch, start CUDA and NCCL (under 15 s on an H200)
KERNEL_FIGURE, SDPA_FIGURE = "kernel_tflops_vs_seqlen.png", "sdpa_tflops_vs_seqlen.png"
# --require names: the module of a PACKAGES row (its first component)
REQUIRABLE = {module.split(".")[0]: shown for shown, module, _ in PACKAGES}


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    capability: str          # e.g. "9.0"
    memory_gib: float


@dataclass
class Step:
    name: str
    status: str = "ok"       # ok | failed | skipped
    reason: str = ""
    duration_s: float = 0.0
    details: dict = field(default_factory=dict)


def devices() -> list[Device]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(Device(i, p.name, f"{p.major}.{p.minor}", round(p.total_memory / 2 ** 30, 1)))
    return out


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the folder of this GPU's results and figures."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def listed_gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (the driver's view, whatever torch can use); [] without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:   # e.g. "NVIDIA-SMI has failed": no driver to talk to
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.startswith("GPU ")]


def _import(module: str) -> object:
    """Import ``module``; ring-flash-attn through its shim (its HF adapter clashes with transformers 5)."""
    if module == "ring_flash_attn":
        got = ring_flash_attn_shim.load()
        if got.module is None:
            raise ImportError(got.reason)
        return got.module
    return importlib.import_module(module)


def _version(dists) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_report(importer: Callable[[str], object] = _import,
                   version_of: Callable[[tuple], str | None] = _version) -> list[dict]:
    """One entry per GPU package: importable?, version, and why not (the import error)."""
    cuda = torch.cuda.is_available()
    nccl = env.versions().get("nccl")
    rows = [{"package": "torch", "importable": True, "version": torch.__version__,
             "detail": f"CUDA build {torch.version.cuda or 'none'}, CUDA available {cuda}, NCCL {nccl or 'none'}"}]
    for shown, module, dists in PACKAGES:
        row = {"package": shown, "module": module, "version": version_of(dists)}
        try:
            importer(module)
            row.update(importable=True, detail="")
        except Exception as e:  # noqa: BLE001 - any failure to import is the answer
            row.update(importable=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        rows.append(row)

    for row in rows:
        if row["package"] == "xformers" and row["importable"]:
            ok = BACKENDS["xformers"].available()
            row["probe_failed"] = not ok
            row["detail"] = ("backward honours the given lse (usable as a ring kernel)" if ok and cuda else
                             "lse probe not run (no CUDA)" if ok else xf.unavailable_reason())
    return rows


def package_problems(rows: list[dict], required: tuple[str, ...] = ()) -> list[str]:
    """Why the packages step fails: a package installed (it has a version) that does not import, xformers'
    lse probe failing, or a ``required`` package (a ``REQUIRABLE`` name) not usable. A package that is
    simply not installed is no problem unless required: the steps that need it skip, with the reason."""
    by_name = {r["package"]: r for r in rows}
    out = [f"{r['package']} {r['version']} is installed but does not import ({r['detail']})"
           for r in rows if not r["importable"] and r.get("version")]
    out += [f"xformers' lse probe failed: {r['detail']}" for r in rows if r.get("probe_failed")]
    for name in required:
        r = by_name[REQUIRABLE[name]]
        if not r["importable"] or r.get("probe_failed"):
            out.append(f"--require {name}: {r['package']} is not usable here ({r['detail'] or 'not installed'})")
    return list(dict.fromkeys(out))


def _stamp() -> dict:
    return {"timestamp": R.now(), "git": env.git_info(), "versions": env.versions(),
            "hardware": env.hardware(max(1, torch.cuda.device_count()))}


def write_json(path: Path, obj: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")
    return path


# ---------------------------------------------------------------- steps


def step_tests(out: Path, timeout_s: int = STEP_BUDGET_S - 60) -> Step:
    """pytest tests/test_cuda_path.py in a subprocess; counts from its junit XML."""
    d = out / "tests"
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda_path.py",
           f"--junitxml={d / 'junit.xml'}"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimeout after {timeout_s} s", -1
    (d / "pytest.log").write_text(log if isinstance(log, str) else log.decode(errors="replace"))
    counts = junit_counts(d / "junit.xml")
    status = "ok" if rc == 0 else "failed"
    tail = " ".join(str(log).strip().splitlines()[-1:])
    return Step("tests", status, "" if rc == 0 else f"pytest exit code {rc}: {tail}", details=counts)


def junit_counts(path: Path) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _spec(name: str, methods, sweep: dict, *, kernels=(), modes=("forward", "fwd_bwd"), comm=True) -> dict:
    raw = {"name": name, "methods": list(methods), "sweep": sweep, "cluster": "local",
           "measure": {"modes": list(modes), "level": "op", "memory": True, "comm": comm},
           "warmup": 3, "repeats": 10, "seed": 0, "timeouts": {"case_s": 300, "pg_s": 120},
           "description": "make gpu-check (experiments/gpu_check.py)"}
    if kernels:
        raw["kernels"] = list(kernels)
    return raw


def harness_specs(n_gpus: int, kernels=CUDA_KERNELS) -> tuple[list[dict], str]:
    """(specs to run, why the multi-GPU part is skipped or ''). Small sizes: seconds per case."""
    one = {"seqlen": [4096, 16384], "world_size": 1, "heads": 32, "kv_heads": [32, 8], "head_dim": 128,
           "dtype": "bfloat16", "causal": True}
    specs = [_spec("harness", ["burst"], one, kernels=kernels),
             _spec("peers", ["ring_flash_attn"], one)]
    sizes = [g for g in (2, 4, 8, 16, 32, 64) if g <= n_gpus]
    if not sizes:
        return specs, f"{n_gpus} GPU visible: world size > 1 needs at least 2 (torchrun --nproc-per-node G, NCCL)"
    multi = dict(one, seqlen=[8192, 32768], world_size=sizes, kv_heads=8, layout="zigzag")
    specs.append(_spec("multi", ["burst", "ring", "ulysses", "ring_flash_attn"], multi, modes=("fwd_bwd",)))
    return specs, ""


def varlen_spec(kernels=("cuda_flash",)) -> dict:
    """One rank's attention under the field's masks (full, causal, varlen-full, varlen-causal on
    MagiAttention's document lengths, sliding-window causal) in MagiAttention's head setup (GQA 64:8,
    d 128, bf16): at G = 1 the whole sequence is one tile, so each record is the kernel's own TFLOP/s
    under that mask (the FLOPs of the mask's area), beside which the model's kernel terms are read."""
    sweep = {"seqlen": [8192, 16384, 32768], "world_size": 1, "heads": 64, "kv_heads": 8, "head_dim": 128,
             "dtype": "bfloat16", "causal": [False, True], "mask": ["", "docs:magiattention:0", "window:1024:0"]}
    spec = _spec("varlen", ["burst"], sweep, kernels=kernels, modes=("fwd_bwd",))
    spec["exclude"] = [{"causal": False, "mask": "window:1024:0"}]     # the window is causal-shaped already
    return spec


def decode_spec() -> dict:
    """One decode step of one attention layer (the new token's QKV projection, the cache append, the
    attention over the cache) through the runner at G = 1, Llama-3 8B's heads (32:8, d 128): the
    record's TPOT beside what the model predicts for it on the profile (``perfmodel.inference``)."""
    sweep = {"seqlen": [4096, 65536, 262144, 1048576], "world_size": 1, "batch": [1, 16], "heads": 32,
             "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "causal": True}
    spec = _spec("decode_op", ["burst"], sweep, modes=("decode",))
    spec["measure"].update(level="inference", memory=False)
    spec["inference"] = {"merges": ["all_gather"], "new_tokens": 1, "placement": "round_robin"}
    spec["exclude"] = [{"batch": 16, "seqlen": 1048576}]             # 64 GiB of K/V at batch 16
    return spec


def step_decode(out: Path, device: torch.device, budget_s: float) -> Step:
    """Decode attention and a device copy against the model's HBM roofline (``gpu_ceilings.decode_table``),
    then the suite's decode step through the runner (``decode_spec``)."""
    t0 = time.monotonic()
    res = dict(GC.decode_table(device, budget_s=min(60.0, budget_s / 4)), **_stamp())
    write_json(out / "decode.json", res)
    op = step_harness(out, [decode_spec()], "decode_op", budget_s - (time.monotonic() - t0))
    ok = [r for r in res["rows"] if r["kernel"] != "copy" and r["status"] == "ok"]
    worst = max(ok, key=lambda r: r["measured_over_modelled"], default=None)
    best = min(ok, key=lambda r: r["measured_over_modelled"], default=None)
    details = {"copy_hbm_fraction": res["rows"][0]["hbm_fraction"], "decode_op": op.details,
               "measured_over_modelled": [best and best["measured_over_modelled"],
                                          worst and worst["measured_over_modelled"]]}
    if op.status == "failed":
        return Step("decode", "failed", f"decode_op: {op.reason}", details=details)
    return Step("decode", "ok" if ok else "skipped", "" if ok else "no decode point ran", details=details)


def fit_budget(specs: list[dict], budget_s: float = STEP_BUDGET_S) -> float:
    """Set every case's ``timeouts.case_s`` so the step fits ``budget_s``: the runner gives a group of
    interleaved cases the SUM of their case_s, so a step's worst case is the sum over all its cases
    plus each launch's start-up. Returns the case_s set."""
    parsed = [parse_spec(s, f"<gpu_check:{s['name']}>") for s in specs]
    n_cases = sum(len(p.cases()) for p in parsed)
    launches = sum(len({c.shape.world_size for c in p.cases()}) for p in parsed)
    case_s = (budget_s - LAUNCH_ALLOWANCE_S * launches) / max(1, n_cases)
    if case_s < 1:
        raise ValueError(f"{n_cases} cases in {launches} launches do not fit the step's {budget_s:.0f} s")
    for s in specs:
        s["timeouts"] = dict(s["timeouts"], case_s=math.floor(case_s * 10) / 10)   # down: the sum must fit
    return case_s


def step_harness(out: Path, specs: list[dict], name: str, budget_s: float = STEP_BUDGET_S) -> Step:
    """Run specs through the experiment runner (one launch per world size); ok unless a case failed."""
    fit_budget(specs, budget_s)
    parsed = [parse_spec(s, f"<gpu_check:{s['name']}>") for s in specs]
    preset = Preset(name=f"gpu_check_{name}", path="<gpu_check>", specs=tuple(parsed))
    for s in parsed:
        write_resolved(s, out)
    batches = plan(preset, results_root=out, force=True, retry_failed=False)
    counts = run_local(preset, batches, results_root=out)
    recs = [r for s in parsed
            for r in R.latest_by_case(R.read_records(R.experiment_dir(out, s.name) / R.RESULTS_FILE)).values()]
    bad = [r for r in recs if r["status"] in ("failed", "oom")]
    details = {"counts": counts, "kernels": sorted({str(r.get("kernel")) for r in recs if r["status"] == "ok"}),
               "process_group": sorted({r["config"].get("backend", "") for r in recs if r["status"] == "ok"}),
               "skipped": sorted({f"{r['method']}{'/' + r['config']['kernel'] if r['config'].get('kernel') else ''}: "
                                  f"{r['reason'][:160]}" for r in recs if r["status"] == "skipped"})}
    if bad:
        return Step(name, "failed", "; ".join(f"{r['case_id']}: {r['status']}: {r['reason'][:200]}" for r in bad[:3]),
                    details=details)
    if not any(r["status"] == "ok" for r in recs):
        return Step(name, "skipped", "no case could run here: " + "; ".join(details["skipped"][:3]), details=details)
    multi_rank = [r for r in recs if r["status"] == "ok" and r["world_size"] > 1]
    if multi_rank and {r["config"].get("backend") for r in multi_rank} != {"nccl"}:
        return Step(name, "failed", f"world size > 1 ran on {details['process_group']}, not NCCL", details=details)
    return Step(name, "ok", details=details)


def step_sweep(out: Path, plots: Path, device_name: str, *, kernels, seqlens, device: torch.device,
               warmup: int, repeats: int, shape: KS.SweepShape = KS.SweepShape(),
               budget_s: float = STEP_BUDGET_S - 90, sdpa=KS.SDPA_KERNELS) -> Step:
    # the figure and the summary come after the points: a margin of the budget is theirs
    recs = KS.run_sweep(list(kernels) + list(sdpa), seqlens, device=device, results_root=out,
                        experiment="kernels", warmup=warmup, repeats=repeats, shape=shape, budget_s=budget_s)
    fig = KF.draw(recs, plots / KERNEL_FIGURE, device_name=device_name)
    best = {}
    for r in recs:
        if r["status"] == "ok" and r["seqlen"] == max(seqlens) and r["causal"] and r["mode"] == "fwd_bwd":
            best[r["method"]] = round(r["tflops_total"], 1)
    bad = [r for r in recs if r["status"] == "failed"]
    details = {"figure": str(fig) if fig else None, f"tflops_causal_fwd_bwd_N{max(seqlens)}": best,
               "oom": sorted({f"{r['method']} N={r['seqlen']}" for r in recs if r["status"] == "oom"})}
    if bad:
        return Step("sweep", "failed", "; ".join(f"{r['case_id']}: {r['reason'][:200]}" for r in bad[:3]),
                    details=details)
    return Step("sweep", "ok" if best or fig else "skipped", "" if fig else "no kernel could run", details=details)


def step_sdpa(out: Path, plots: Path, device_name: str, device: torch.device, budget_s: float) -> Step:
    """The profile's attention-efficiency tables, measured (``gpu_ceilings.attention_table``)."""
    recs = GC.attention_table(out, device, budget_s=budget_s - 15)
    peak = GC.peak_tflops()
    table = GC.efficiency(recs, peak)
    write_json(out / "sdpa_profile.json", {"peak_tflops": peak, "profile": GC.PROFILE, "setup": GC.TABLE_SETUP,
                                           "efficiency": table, **_stamp()})
    fig = KF.draw(recs, plots / SDPA_FIGURE, device_name=device_name, setup=GC.TABLE_SETUP)
    bad = [r for r in recs if r["status"] in ("failed", "oom")]
    details = {"figure": str(fig) if fig else None, "efficiency": table}
    if bad:
        why = "; ".join(f"{r['case_id']}: {r['reason'][:160]}" for r in bad[:3])
        return Step("sdpa", "failed", why, details=details)
    return Step("sdpa", "ok" if table else "skipped", "" if table else "no SDPA backend could run", details=details)


def step_gemm(out: Path, device: torch.device, budget_s: float) -> Step:
    """bf16 GEMM TFLOP/s at the models' layer shapes and the best shape (``gpu_ceilings.gemm_table``)."""
    res = GC.gemm_table(device, budget_s=budget_s, peak=GC.peak_tflops())
    write_json(out / "gemm.json", res)
    best = res["best"]
    return Step("gemm", "ok" if best else "skipped", "" if best else "no GEMM ran",
                details={"gemm_efficiency": res["gemm_efficiency"], "layer_efficiency": res["layer_efficiency"],
                         "best": {k: best[k] for k in ("name", "tflops")} if best else None})


def step_memory(out: Path, budget_s: float) -> Step:
    """One attention call and one model step against the memory model (``gpu_memory``)."""
    st = step_harness(out, GM.specs(), "memory", budget_s)
    rows = _write_memory(out)
    st.details["rows"] = rows
    if st.status == "ok" and not rows:
        return Step("memory", "failed", "no record carries CUDA's counters", details=st.details)
    return st


def _write_memory(out: Path) -> list[dict]:
    """``gpu_memory.compare`` of the records under ``out``, written as ``memory.json`` (when any) and shown."""
    rows = GM.compare(GM.read(out))
    if rows:
        write_json(out / "memory.json", {"hardware": GM.HARDWARE, "rows": rows,
                                         "derived_from": "the memory_op and memory_model records"})
        print(GM.table(rows))
    return rows


def derive(out: Path, plots: Path, device_name: str) -> list[Path]:
    """Redraw the figures and rewrite memory.json from the records under ``out`` (no GPU needed): what a
    device's runs left there, merged (each record keeps its own run's provenance)."""
    written = []
    for exp, name, setup in (("kernels", KERNEL_FIGURE, None), ("sdpa_profile", SDPA_FIGURE, GC.TABLE_SETUP)):
        recs = list(R.latest_by_case(R.read_records(R.experiment_dir(out, exp) / R.RESULTS_FILE)).values())
        fig = KF.draw(recs, plots / name, device_name=device_name, setup=setup) if recs else None
        written += [fig] if fig else []
    return written + ([out / "memory.json"] if _write_memory(out) else [])


# ---------------------------------------------------------------- main


def _print_summary(summary: dict, done: list[Step]) -> None:
    """The short table a lent device's command ends with: each step, and the measured model constants."""
    print(f"\nsummary (git {summary['git']}, torch {summary['versions'].get('torch')}, "
          f"CUDA {summary['versions'].get('cuda')})")
    for s in done:
        print(f"  {s.name:<9} {s.status:<8} {s.duration_s:6.0f} s  {s.reason[:150]}")
        if s.name == "decode" and s.status == "ok":
            print(f"    copy at {s.details['copy_hbm_fraction']} of the nominal HBM rate; decode measured / "
                  f"modelled {s.details['measured_over_modelled']} (best, worst)")
        if s.details.get("gemm_efficiency") is not None:
            print(f"    gemm_efficiency {s.details['gemm_efficiency']} (best: {s.details['best']})")
        for kernel, masks in (s.details.get("efficiency") or {}).items():
            print(f"    {kernel}, full: {masks.get('full')}")


def _print_packages(rows: list[dict]) -> None:
    for r in rows:
        mark = "yes" if r["importable"] else "no "
        print(f"  {r['package']:<18} {mark}  {r.get('version') or '-':<14} {r.get('detail') or ''}")


def print_plan(steps: list[str]) -> None:
    """What this invocation runs, and how a device lent one command at a time should be asked."""
    print(f"plan: steps {','.join(steps)}; each call below is held to {STEP_BUDGET_S} s (a device command "
          "may run 600 s); installs nothing, builds nothing")
    for i, call in enumerate(CALLS, 1):
        mark = "runs now" if set(call) & set(steps) else "not asked"
        print(f"  {i}. python -m experiments.gpu_check --steps {','.join(call):<16} ({mark})")
    print("  then copy results/gpu_check/<gpu>.tar.gz (every record, log and figure so far)")


def no_usable_gpu(listed: list[str]) -> int:
    """Exit status when torch sees no CUDA device: 1 when the driver lists GPUs (a CPU-only or
    mismatched torch would otherwise pass the check without checking), else 0 (nothing to check)."""
    torch_says = (f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, "
                  "torch.cuda.is_available() = False")
    if listed:
        print(f"error: nvidia-smi lists {len(listed)} GPU(s) ({listed[0]}) but torch cannot use them ({torch_says}). "
              "Install a CUDA build of torch that matches the driver; nothing was checked.")
        return 1
    print(f"{NO_DEVICE} ({torch_says}; nvidia-smi lists no GPU). The CUDA tests skip here; run this on a GPU "
          "machine.")
    return 0


def pack(root: Path, out: Path, plots: Path) -> Path:
    """One archive of this GPU's results and figures (what a lent device's command hands back)."""
    path = root / f"{out.name}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for d in (out, plots):
            if d.exists():
                tar.add(d, arcname=f"{d.parent.name}/{d.name}")
    return path


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], tuple[str, ...]]:
    """(options, the steps asked, the packages required); usage errors exit 2 (argparse)."""
    ap = argparse.ArgumentParser(prog=prog("python -m experiments.gpu_check"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--results", default=str(REPO / "results" / "gpu_check"), help="results root (a folder per GPU)")
    ap.add_argument("--plots", default=str(REPO / "plots" / "gpu_check"), help="figures root (a folder per GPU)")
    ap.add_argument("--kernels", default=",".join(CUDA_KERNELS), help="local kernels to check (burst_impl.kernels)")
    ap.add_argument("--sdpa", default=",".join(KS.SDPA_KERNELS),
                    help="the sweep's SDPA yardsticks beside the kernels (comma-separated; '' for none)")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384,32768", help="sweep sequence lengths")
    ap.add_argument("--heads", type=int, default=32, help="sweep: query heads Z (MHA)")
    ap.add_argument("--head-dim", type=int, default=128, help="sweep: head dimension d")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--derive", metavar="GPU", default="",
                    help="no GPU needed: redraw the figures and rewrite memory.json of results/gpu_check/GPU "
                         "(e.g. nvidia-h200) from its records")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="run every step asked in one command of this many seconds: each step gets what is left")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="where the sweep runs (cpu: only for tests of this script)")
    ap.add_argument("--require", default="", help="comma-separated packages whose absence fails the check "
                    f"instead of skipping what needs them ({', '.join(REQUIRABLE)}), e.g. ring_flash_attn,flash_attn")
    args = ap.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        ap.error(f"--steps: {unknown} unknown; choose from {list(STEPS)}")
    required = tuple(r for r in args.require.split(",") if r)
    bad = sorted(set(required) - set(REQUIRABLE))
    if bad:
        ap.error(f"--require: {bad} unknown; choose from {list(REQUIRABLE)}")
    if required and "packages" not in steps:
        ap.error("--require is checked by the packages step: add it to --steps")
    if args.derive and not (Path(args.results) / args.derive / "summary.json").is_file():
        ap.error(f"--derive {args.derive!r}: no {Path(args.results) / args.derive / 'summary.json'} (a GPU check's "
                 f"results folder is named by its GPU, e.g. nvidia-h200)")
    return args, steps, required


def _device_name(out: Path) -> str:
    """The GPU's name as the check's summary recorded it."""
    summary = json.loads((out / "summary.json").read_text())
    return summary["devices"][0]["name"]


def _budget(deadline: float | None, cap: float) -> float:
    """Seconds a step may take: ``cap``, or what the deadline leaves after the margin if less."""
    return cap if deadline is None else min(cap, deadline - time.monotonic() - MARGIN_S)


def _step_calls(args, found: list[Device], out: Path, plots: Path, summary: dict, required, deadline):
    """(name, callable) of every step, in the order they run."""
    kernels = [k for k in args.kernels.split(",") if k]
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    gpu = found[0].name
    shown = (gpu if len(found) == 1 else f"{gpu} (1 of {len(found)})") if args.device == "cuda" else \
        f"CPU ({env.hardware()['cpu_model']}; --device cpu, a test of the script)"

    def packages() -> Step:
        rows = package_report()
        summary["packages"] = rows
        _print_packages(rows)
        problems = package_problems(rows, required)
        return Step("packages", "failed" if problems else "ok", "; ".join(problems),
                    details={r["package"]: r.get("version") if r["importable"] else None for r in rows})

    specs, multi_why = harness_specs(len(found), kernels)
    left = lambda cap: _budget(deadline, cap)  # noqa: E731 - read when the step starts
    return [
        ("packages", packages),
        ("tests", lambda: step_tests(out, int(left(180 if deadline else STEP_BUDGET_S - 60)))),
        ("sdpa", lambda: step_sdpa(out, plots, shown, device, left(STEP_BUDGET_S - 90))),
        ("gemm", lambda: step_gemm(out, device, left(120))),
        ("memory", lambda: step_memory(out, left(STEP_BUDGET_S))),
        ("harness", lambda: step_harness(out, [s for s in specs if s["name"] != "multi"], "harness",
                                         left(STEP_BUDGET_S))),
        ("multi", lambda: Step("multi", "skipped", multi_why) if multi_why else
         step_harness(out, [s for s in specs if s["name"] == "multi"], "multi", left(STEP_BUDGET_S))),
        ("varlen", lambda: step_harness(out, [varlen_spec()], "varlen", left(200))),
        ("decode", lambda: step_decode(out, device, left(240))),
        ("sweep", lambda: step_sweep(out, plots, shown, kernels=kernels, seqlens=seqlens, device=device,
                                     warmup=args.warmup, repeats=args.repeats,
                                     shape=KS.SweepShape(heads=args.heads, head_dim=args.head_dim),
                                     budget_s=left(STEP_BUDGET_S - 90),
                                     sdpa=[k for k in args.sdpa.split(",") if k])),
    ]


def main(argv: list[str] | None = None, *, found: list[Device] | None = None) -> int:
    args, steps, required = _parse(argv)
    if args.derive:
        out, plots = Path(args.results) / args.derive, Path(args.plots) / args.derive
        for path in derive(out, plots, _device_name(out)):
            print(f"written: {path}")
        return 0
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    print_plan(steps)
    found = devices() if found is None else found
    if not found:
        return no_usable_gpu(listed_gpus())
    gpu = found[0].name
    out, plots = Path(args.results) / slug(gpu), Path(args.plots) / slug(gpu)
    print(f"GPU check on {len(found)} x {gpu} -> {out}")
    summary = {"devices": [asdict(d) for d in found], "steps": [], "command": " ".join(sys.argv), **_stamp()}
    done: list[Step] = []
    for name, fn in _step_calls(args, found, out, plots, summary, required, deadline):
        if name not in steps:
            continue
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            if deadline is not None and _budget(deadline, STEP_BUDGET_S) < MIN_STEP_S:
                st = Step(name, "skipped", f"--deadline-s {args.deadline_s:.0f}: under {MIN_STEP_S} s left")
            else:
                st = fn()
        except Exception as e:  # noqa: BLE001 - a step that breaks is a failed step; the others still run
            st = Step(name, "failed", f"{type(e).__name__}: {str(e)[:600]}")
        st.duration_s = round(time.perf_counter() - t0, 1)
        done.append(st)
        summary["steps"] = [asdict(s) for s in done]
        write_json(out / "summary.json", summary)
        print(f"== {name}: {st.status}{' (' + st.reason + ')' if st.reason else ''} in {st.duration_s:.0f} s")
    _print_summary(summary, done)
    print(f"written: {out / 'summary.json'} (and the records beside it), {plots}")
    print(f"archive: {pack(Path(args.results), out, plots)}")
    return 1 if any(s.status == "failed" for s in done) else 0


if __name__ == "__main__":
    sys.exit(main())

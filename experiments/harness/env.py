"""Where a result came from: git state, library versions, hardware."""
from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def repo_relative(path) -> str:
    """``path`` as the repository names it (no checkout's absolute path in committed records, tables or
    figure titles); unchanged when it lies outside the repository."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def git_info() -> dict:
    if os.environ.get("BURST_BENCH_GIT_COMMIT"):
        # a copy of the working tree sent elsewhere (a lent device gets the files with the .git of an
        # older checkout): the commit its sender states it was copied from, with a clean tree
        return {"commit": os.environ["BURST_BENCH_GIT_COMMIT"],
                "dirty": os.environ.get("BURST_BENCH_GIT_DIRTY", "0") not in ("0", ""),
                "commit_source": "BURST_BENCH_GIT_COMMIT"}
    commit = _git("rev-parse", "HEAD")
    # Run outputs (results/, plots/) do not make the code dirty.
    status = _git("status", "--porcelain", "--", ".", ":!results", ":!plots")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - NCCL missing from this build
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "flash_attn": _pkg_version("flash-attn") or _pkg_version("flash_attn"),
        "ring_flash_attn": _pkg_version("ring-flash-attn") or _pkg_version("ring_flash_attn"),
        "xformers": _pkg_version("xformers"),
        "deepspeed": _pkg_version("deepspeed"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def hardware(world_size: int = 1) -> dict:
    gpu = torch.cuda.is_available()
    nnodes = int(os.environ.get("SLURM_NNODES") or os.environ.get("GROUP_WORLD_SIZE")
                 or os.environ.get("NNODES") or 1)
    info = {
        "host": socket.gethostname(),
        "nodes": nnodes,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu_name": torch.cuda.get_device_name(0) if gpu else None,
        "gpu_count": torch.cuda.device_count() if gpu else 0,
        "world_size": world_size,
    }
    info["summary"] = describe(info)
    return info


def describe(hw: dict) -> str:
    """One line for figure titles, e.g. '8x NVIDIA A100 (1 node)' or '2-core Intel Xeon (CPU, gloo)'."""
    if hw.get("gpu_name"):
        nodes = hw.get("nodes") or 1
        return f"{hw['gpu_name']} x{hw.get('gpu_count')}/node, {nodes} node{'s' if nodes > 1 else ''}"
    return f"{hw.get('cpu_count')}-core {hw.get('cpu_model')} (CPU, gloo)"


def slug(text: str) -> str:
    """'2-core AMD EPYC' -> '2-core-amd-epyc': a folder name."""
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "unknown"


def machine_slug(hw: dict | None = None) -> str:
    """A short, stable name of this machine's hardware, the folder its results live in
    (``results/<machine>/``): 'cpu2-amd-epyc' (cores, CPU model) or '8x-nvidia-a100-sxm4-80gb' (GPUs
    per node, GPU model). Machines of the same kind share it: their numbers are comparable."""
    hw = hw or hardware()
    if hw.get("gpu_name"):
        return slug(f"{hw.get('gpu_count')}x {hw['gpu_name']}")
    return slug(f"cpu{hw.get('cpu_count')} {hw.get('cpu_model')}")

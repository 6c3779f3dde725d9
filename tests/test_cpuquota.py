"""experiments.harness.cpuquota: per-process CPU caps (the emulated cluster's ranks, the model's kernel timing).
On a fake cgroup tree (v1 and v2 layouts, no privileges needed) and, where this machine allows it, on the real
one."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.harness import cpuquota


def _fake(tmp_path: Path, version: int) -> Path:
    root = tmp_path / "cg"
    if version == 2:
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        (root / "cgroup.subtree_control").write_text("")
    else:
        (root / "cpu").mkdir(parents=True)
        (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    return root


@pytest.mark.parametrize("version", [1, 2])
def test_create_writes_the_quota_and_names_the_template(tmp_path, monkeypatch, version):
    root = _fake(tmp_path, version)
    monkeypatch.setattr(cpuquota, "CGROUP", root)
    template, why = cpuquota.create("bemu123abc", ["bemu123abc-n0r0", "bemu123abc-n1r1"], 0.5)
    assert why == "" and template.endswith("bemu123abc-n{node}r{local_rank}")
    d = Path(cpuquota.rank_dir(template, {"GROUP_RANK": "1", "LOCAL_RANK": "1"}))
    if version == 2:
        assert (d / "cpu.max").read_text() == "50000 100000"
        assert (root / "cgroup.subtree_control").read_text() == "+cpu"
    else:
        assert (d / "cpu.cfs_quota_us").read_text() == "50000"
        assert (d / "cpu.cfs_period_us").read_text() == "100000"


def test_the_period_comes_from_the_environment(tmp_path, monkeypatch):
    root = _fake(tmp_path, 2)
    monkeypatch.setattr(cpuquota, "CGROUP", root)
    monkeypatch.setenv(cpuquota.PERIOD_ENV, "10000")
    template, _ = cpuquota.create("bemu123abc", ["bemu123abc-n0r0"], 0.25)
    assert (Path(cpuquota.rank_dir(template, {})) / "cpu.max").read_text() == "2500 10000"
    for bad in ("999", "ten", "2000000"):
        monkeypatch.setenv(cpuquota.PERIOD_ENV, bad)
        with pytest.raises(ValueError, match=f"{cpuquota.PERIOD_ENV}='{bad}' must be"):
            cpuquota.period_us()


def test_no_controller_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(cpuquota, "CGROUP", tmp_path)
    template, why = cpuquota.create("bemu123abc", ["bemu123abc-n0r0"], 1.0)
    assert template is None and "no cpu cgroup controller" in why


def test_bad_share_raises():
    with pytest.raises(ValueError, match="cpus=0 per rank"):
        cpuquota.create("bemu123abc", ["bemu123abc-n0r0"], 0)


def _real_root():
    root = cpuquota._root()
    if isinstance(root, str):
        return None, root
    try:
        probe = root[0] / "bemuprobe0-n0r0"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return None, str(e)
    return root, ""


def test_a_process_joins_a_real_group_and_the_group_is_removed():
    root, why = _real_root()
    if root is None:
        pytest.skip(f"no writable cpu cgroup here: {why}")
    template, why = cpuquota.create("bemuqtest1", ["bemuqtest1-n0r0"], 0.5)
    assert why == ""
    d = cpuquota.rank_dir(template, {"GROUP_RANK": "0", "LOCAL_RANK": "0"})
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        cpuquota.join(d, p.pid)
        assert str(p.pid) in (Path(d) / "cgroup.procs").read_text().split()
    finally:
        p.kill()
        p.wait()
    assert cpuquota.remove("bemuqtest1") == [] and not Path(d).exists()

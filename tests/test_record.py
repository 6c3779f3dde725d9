"""The one record type (experiments/harness/record.py) and the migration of older records (migrate.py).

The sample under tests/data/records_v2/ is committed schema-2 records, copied before the migration from
results/reference/cpu2-amd-epyc (op, layer and model level, perplexity, a skipped case) and results/modelled
(layer level with model-only variants, model level). ``rows_v2.json.gz`` beside them is what the report's
reader (``experiments.report.evidence._read``) returned for exactly those records at c247adb, before the
record type existed; the migrated records must give the same rows.
"""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import yaml

from experiments.harness import record
from experiments.harness.migrate import from_old, migrate_root
from experiments.harness.record import Record

SAMPLE = Path(__file__).parent / "data" / "records_v2"


def _old_records():
    for f in sorted(SAMPLE.glob("**/*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def _old_view(old: dict) -> dict:
    """What the readers before schema 3 saw: the record's keys, the config's filling in, and a modelled
    record's prediction (then ``model``) apart from the model's name."""
    cfg = old.get("config") or {}
    view = {**{k: v for k, v in cfg.items() if k not in old}, **old}
    if isinstance(old.get("model"), dict):
        view["prediction"] = view.pop("model")
        view["model"] = cfg.get("model")
    view.pop("schema")
    return view


def test_record_fields_are_typed_and_known():
    rec = Record(status="ok")
    rec.update(time_median_s=0.5, comm_fwd_bytes=10, mem_peak_bytes=3, method="burst")
    assert rec.timing.median_s == 0.5 and rec.comm.fwd_bytes == 10 and rec.memory.peak_bytes == 3
    assert rec["method"] == "burst" and rec.case.method == "burst"
    with pytest.raises(ValueError, match="'time_medain_s' is not in the record schema"):
        rec["time_medain_s"] = 1.0
    with pytest.raises(ValueError, match="'comm_fwd_bytes'.*must be int"):
        rec["comm_fwd_bytes"] = "many"
    with pytest.raises(ValueError, match="status='done'"):
        Record(status="done")


def test_round_trip_and_old_schema_refused(tmp_path):
    rec = Record(status="ok")
    rec.update(experiment="e", case_id="c", method="m", level="op", mode="forward", config={"seqlen": 8},
               timestamp="t", git={"commit": "x"}, versions={}, hardware={}, machine="here", time_samples_s=[1.0])
    path = tmp_path / "e" / "results.jsonl"
    record.write(path, rec)
    (back,) = record.read(path)
    assert back == rec and back.row()["seqlen"] == 8
    assert set(json.loads(path.read_text())) == {"schema", "status", "reason", "case", "timing", "provenance"}
    path.write_text(json.dumps({"schema": 2, "status": "ok"}) + "\n")
    with pytest.raises(ValueError, match="schema 2.*burst-bench migrate"):
        record.read(path)


def test_writer_refuses_an_incomplete_record(tmp_path):
    rec = Record(status="ok")
    rec.update(experiment="e", case_id="c")
    with pytest.raises(ValueError, match="lacks"):
        record.write(tmp_path / "r.jsonl", rec)


def test_each_key_the_writer_requires_is_refused_by_name_and_in_the_schema_list(tmp_path):
    """``results.REQUIRED_KEYS`` (what the schema tests look for in every row) is derived from the writer's
    ``record.REQUIRED``: a key the writer insists on is one the schema tests check."""
    from experiments.harness import results as R

    full = dict(experiment="e", case_id="c", method="m", level="op", mode="forward", config={"seqlen": 8},
                timestamp="t", git={"commit": "x"}, versions={}, hardware={}, machine="here")
    assert set(full) == set(record.REQUIRED) and set(record.REQUIRED) <= set(R.REQUIRED_KEYS)
    for k in record.REQUIRED:
        rec = Record(status="ok")
        rec.update({n: v for n, v in full.items() if n != k})
        with pytest.raises(ValueError, match=f"lacks \\['{k}'\\]"):
            record.write(tmp_path / "r.jsonl", rec)


def test_migration_keeps_every_value_readers_saw():
    """Every key of the old view has its value in the new row, and the row adds nothing but empty fields,
    except: an explicit None at the top of an old record (a modelled prefill's checkpoint and loss) now
    lets its config value show, since a record field of None means "not set" (documented in record.py)."""
    kinds = set()
    for old in _old_records():
        new = Record.from_json(json.loads(record.dumps(from_old(old)))).row()
        cfg = old.get("config") or {}
        for k, v in _old_view(old).items():
            expect = cfg[k] if v is None and cfg.get(k) is not None else v
            assert new.get(k) == expect, (old["case_id"], k)
        added = {k: v for k, v in new.items() if k not in _old_view(old) and v is not None and k != "schema"}
        assert not added, (old["case_id"], added)
        kinds.add((old.get("source", "measured"), old["level"], old["status"]))
    # the sample covers every producer: measured op/layer/model levels, skipped, modelled ok and oom
    assert {("measured", "op", "skipped"), ("measured", "model", "ok"), ("modelled", "layer", "ok"),
            ("modelled", "model", "ok")} <= kinds, kinds


def test_migration_renames_the_old_level():
    """Records written before the level was renamed carry ``"level": "block"`` (some reference runs did)."""
    old = {"schema": 2, "status": "ok", "reason": "", "case_id": "a", "level": "block", "method": "burst",
           "seqlen": 64, "config": {"level": "block", "seqlen": 64, "heads": 2}}
    row = from_old(old).row()
    assert row["level"] == "layer" and row["config"]["level"] == "layer" and row["seqlen"] == 64


def test_migrate_root_rewrites_once(tmp_path):
    root = tmp_path / "r"
    shutil.copytree(SAMPLE / "reference", root)
    first = migrate_root(root)
    assert sum(first.values()) > 0
    again = migrate_root(root)                 # schema-3 files are read and rewritten unchanged
    assert sum(again.values()) == 0
    for f in first:
        assert all(r.schema == record.SCHEMA_VERSION for r in record.read(f))


def test_migrate_rewords_old_provenance_and_touches_nothing_else(tmp_path):
    """Resolved specs naming a checkout's absolute path get the repository's; assumptions naming the removed
    CostModel.host_s get the model's present words; every other byte stays, and a second pass changes none."""
    from experiments.perfmodel.model import ASSUMPTIONS

    exp = tmp_path / "r" / "e"
    exp.mkdir(parents=True)
    old_text = ("kernel launch and Python overheads not modelled on accelerators (CostModel.host_s = 0; only "
                "the emulated cluster's validation charges its CPU ranks' measured host work per op)")
    rec = Record(status="ok")
    rec.update(experiment="e", case_id="c", method="m", level="op", mode="forward", config={}, timestamp="t",
               git={}, versions={}, hardware={}, machine="m", time_median_s=0.25,
               prediction={"assumptions": ["a", old_text], "time_s": 0.25})
    record.write(exp / "results.jsonl", rec)
    resolved = {"name": "e", "path": "/tmp/measure/tree/experiments/cpu/cpu_peers.yaml", "seqlen": [8]}
    (exp / "spec.resolved.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    other = tmp_path / "r" / "f"
    shutil.copytree(exp, other)
    (other / "spec.resolved.yaml").write_text(yaml.safe_dump({**resolved, "path": "/nowhere/else.yaml"}))

    done = migrate_root(tmp_path / "r")
    assert done == {str(exp / "results.jsonl"): 1, str(exp / "spec.resolved.yaml"): 1,
                    str(other / "results.jsonl"): 1, str(other / "spec.resolved.yaml"): 0}
    (back,) = record.read(exp / "results.jsonl")
    a, text = back["prediction"]["assumptions"]
    assert a == "a" and text in ASSUMPTIONS and "host_s" not in text
    assert back["prediction"]["time_s"] == back["time_median_s"] == 0.25
    assert yaml.safe_load((exp / "spec.resolved.yaml").read_text()) == {**resolved,
                                                                        "path": "experiments/cpu/cpu_peers.yaml"}
    assert yaml.safe_load((other / "spec.resolved.yaml").read_text())["path"] == "/nowhere/else.yaml"
    assert sum(migrate_root(tmp_path / "r").values()) == 0


def _same(old_row: dict, new_row: dict, where, may_add=()) -> None:
    for k, v in old_row.items():
        cfg = old_row.get("config") or {}
        expect = cfg[k] if v is None and cfg.get(k) is not None else v   # see the test above
        assert new_row.get(k) == expect, (where, k)
    added = {k: v for k, v in new_row.items()
             if k not in old_row and v is not None and k not in ("schema", *may_add)}
    assert not added, (where, added)


def test_report_rows_of_migrated_records_unchanged(tmp_path):
    """The report reads records only through ``evidence._read`` (every table, verdict and figure of the page
    is a function of these rows); ``rows_v2.json.gz`` is what it returned for the sample before the record
    type existed (c247adb). The migrated sample must give the same rows, in the same order, whatever the
    report's code does with them later."""
    from experiments.report import evidence

    want = json.loads(gzip.decompress((SAMPLE / "rows_v2.json.gz").read_bytes()))
    roots = tmp_path / "results"
    shutil.copytree(SAMPLE, roots, ignore=shutil.ignore_patterns("*.gz"))
    for root in ("reference", "modelled"):
        migrate_root(roots / root)
    assert sorted(want) == sorted(str(f.parent.relative_to(roots)) for f in roots.glob("**/results.jsonl"))
    for folder, rows in want.items():
        got = json.loads(json.dumps(evidence._read(roots / folder), default=str))
        assert [r["case_id"] for r in got] == [r["case_id"] for r in rows], folder
        for old_row, new_row in zip(rows, got):
            old_row = dict(old_row)
            old_row.pop("schema")
            if isinstance(old_row.get("model"), dict):   # a layer-level prediction the old reader left as "model"
                assert new_row["prediction"] == old_row["model"]
                old_row["model"] = old_row["config"].get("model")
            # the old reader replaced a modelled record's prediction by the model's name; the row keeps it now
            _same(old_row, new_row, (folder, old_row["case_id"]), may_add=("prediction",))

"""``base:``: a CPU mirror names its paper spec and states only what changes (experiments/harness/overrides.py).
The merge rule (mappings key by key, lists and scalars replace, null restores the default), its errors,
and every shipped mirror with a base: it loads, names itself, and restates nothing its base already says."""
from __future__ import annotations

import pytest
import yaml

from experiments.harness.overrides import merge, resolve_base
from experiments.harness.schema import FileErr
from experiments.harness.spec import EXPERIMENTS_DIR, load_spec, parse_spec, spec_mapping

MIRRORS = sorted(p for p in (EXPERIMENTS_DIR / "cpu").glob("*.yaml") if "base" in yaml.safe_load(p.read_text()))
# A small override of a paper spec: what a CPU mirror writes
SMALL = {"base": "fig2_train_7b_8gpu", "name": "t_small", "cluster": "cpu", "warmup": 1, "repeats": 2,
         "max_repeats": None, "timeouts": {"case_s": 60.0}, "sweep": {"seqlen": [256, 512], "world_size": 4,
                                                                     "heads": 4, "head_dim": 16}}


def test_merge_rule():
    base = {"a": 1, "m": {"x": 1, "y": [1, 2], "n": {"p": 1, "q": 2}}, "l": [1, 2], "gone": 3}
    over = {"a": 2, "m": {"y": [3], "n": {"q": None}}, "l": [9], "gone": None, "new": {"k": 1}}
    assert merge(base, over) == {"a": 2, "m": {"x": 1, "y": [3], "n": {"p": 1}}, "l": [9], "new": {"k": 1}}
    assert base["m"]["n"] == {"p": 1, "q": 2}          # the base is not modified
    assert merge({"m": {"x": 1}}, {"m": [1]}) == {"m": [1]}     # a list replaces even a mapping


def test_a_spec_with_a_base_is_its_written_out_merge():
    """The override loads as the base with the override's values, lists whole, the defaults where null."""
    base = spec_mapping(EXPERIMENTS_DIR / "specs" / "fig2_train_7b_8gpu.yaml")
    spec = parse_spec(SMALL, "t.yaml")
    written = {**base, **{k: v for k, v in SMALL.items() if k not in ("base", "max_repeats")},
               "sweep": {**base["sweep"], **SMALL["sweep"]}, "timeouts": {**base["timeouts"], "case_s": 60.0}}
    written.pop("max_repeats")
    assert spec == parse_spec(written, "t.yaml")
    assert spec.methods == tuple(base["methods"]) and spec.baseline == base["baseline"]
    assert spec.sweep["seqlen"] == (256, 512) and spec.sweep["dtype"] == ("bfloat16",)
    assert spec.max_repeats is None and spec.timeouts.pg_s == base["timeouts"]["pg_s"]
    assert len(spec.cases()) == 2 * len(base["methods"])


@pytest.mark.parametrize("over, key, rule", [
    ({"base": "no_such_spec"}, "'base'", "'no_such_spec' is not a spec in experiments/specs or experiments/cpu"),
    ({"base": ["fig2_train_7b_8gpu"]}, "'base'", "must be the name of a spec"),
    ({"not_a_key": 1}, "'not_a_key'", "unknown key"),
    ({"target": "cpu"}, "'target'", "was renamed 'cluster'"),
    ({"sweep": {"seqlen": 512, "no_axis": 1}}, "'sweep.no_axis'", "unknown"),
    ({"name": None}, "'name'", "is required with base:"),
], ids=["unknown-base", "base-not-a-name", "unknown-key", "old-key", "unknown-nested-key", "no-name"])
def test_bad_overrides_name_file_key_rule(over, key, rule):
    raw = {k: v for k, v in {**SMALL, **over}.items() if v is not None}
    with pytest.raises(ValueError, match=f"t.yaml: key {key}.*{rule}"):
        parse_spec(raw, "t.yaml")


def test_a_cycle_of_bases_is_an_error_naming_the_chain(tmp_path):
    for name, base in [("a", "b"), ("b", "c"), ("c", "a")]:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "base": base}))

    def find(name):
        p = tmp_path / f"{name}.yaml"
        return p if p.exists() else None

    with pytest.raises(ValueError, match=r"a.yaml: key 'base': the bases form a cycle: .*a.yaml -> .*b.yaml -> "
                                         r".*c.yaml -> .*a.yaml"):
        resolve_base(yaml.safe_load((tmp_path / "a.yaml").read_text()), tmp_path / "a.yaml", find=find,
                     check=lambda raw, err: None)


def test_a_bad_key_in_a_base_names_the_base_file(tmp_path):
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"name": "b", "bad": 1}))

    def check(raw, err: FileErr):
        if "bad" in raw:
            raise err("bad", "unknown key")

    with pytest.raises(ValueError, match="b.yaml: key 'bad': unknown key"):
        resolve_base({"name": "a", "base": "b"}, tmp_path / "a.yaml", find=lambda n: tmp_path / f"{n}.yaml",
                     check=check)


def test_bases_chain_nearest_wins(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"name": "c", "m": {"x": 1, "y": 1, "z": 1}, "l": [1]}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"name": "b", "base": "c", "m": {"y": 2, "z": 2}}))
    got = resolve_base({"name": "a", "base": "b", "m": {"z": 3}}, "a.yaml",
                       find=lambda n: tmp_path / f"{n}.yaml", check=lambda raw, err: None)
    assert got == {"name": "a", "m": {"x": 1, "y": 2, "z": 3}, "l": [1]}


def _restated(over, base, prefix=""):
    """Dotted keys whose value in ``over`` is what ``base`` already has."""
    out = []
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            out += _restated(v, base[k], f"{prefix}{k}.")
        elif k in base and base[k] == v:
            out.append(prefix + k)
    return out


def test_the_paper_mirrors_have_a_base():
    """The CPU mirrors of paper specs name them; the ones without a paper spec stay written out."""
    assert {p.stem for p in MIRRORS} >= {"cpu_fig2_train", "cpu_fig3_train", "cpu_fig4a_scaling", "cpu_fig4b_batch",
                                        "cpu_table2_prefill", "cpu_burstengine_attn", "cpu_sparse_masks",
                                        "cpu_model_fig2_train", "cpu_model_table2_prefill"}
    assert not {p.stem for p in MIRRORS} & {"cpu_peers", "cpu_train_emulated", "cpu_train_loopback",
                                            "cpu_double_ring_emulated", "cpu_model_table4_perplexity"}


@pytest.mark.parametrize("path", MIRRORS, ids=lambda p: p.stem)
def test_every_mirror_with_a_base_resolves_and_states_only_changes(path):
    raw = yaml.safe_load(path.read_text())
    base_path = next(p for d in ("specs", "cpu") if (p := EXPERIMENTS_DIR / d / f"{raw['base']}.yaml").exists())
    base = spec_mapping(base_path)
    spec = load_spec(path)
    assert spec.name == path.stem != base["name"]
    assert spec.cases() and spec.cluster == raw["cluster"]
    assert _restated({k: v for k, v in raw.items() if k != "base"}, base) == []

"""Document lengths from published distributions (burst_impl/doc_lengths.py, issue 37 item 1): packs sum to N,
no document above the cap, one list per seed, bad input named, and the draws follow the source's histogram."""
import math
import re

import numpy as np
import pytest
import yaml

from burst_impl import doc_lengths as D
from burst_impl import masks as M

NAMES = D.names()

# Enough documents that a wrong histogram fails by far (test_the_check_rejects_a_wrong_histogram), and
# every bin expects >= 5 of them (the chi-square rule of thumb): the rarest bin has p = 0.0014.
DRAWS = 200_000
# The chi-square test's level: a correct sampler fails it with probability 0.001 (seeds are fixed, so a
# pass stays a pass); Wilson & Hilferty's (1931) cube-root approximation of the quantile, within 0.5%
# of the exact one from 10 degrees of freedom up.
Z_999 = 3.0902


def _chi2_limit(dof: int) -> float:
    h = 2 / (9 * dof)
    return dof * (1 - h + Z_999 * math.sqrt(h)) ** 3


def _chi2(lengths, hist: D.LengthHistogram) -> float:
    obs = hist.counts(lengths)
    exp = np.asarray(hist.prob) * obs.sum()
    return float(((obs - exp) ** 2 / exp).sum())


def _documents(hist: D.LengthHistogram, seed: int) -> list[int]:
    """About DRAWS documents of one pack, uncut: a cap of the whole pack, far above every bin, and the
    last document (the only one cut at N) left out."""
    n = int(DRAWS * hist.mean)
    assert n > max(hist.hi)
    return D.sample_doc_lengths(n, hist, seed=seed, max_frac=1.0)[:-1]


def test_the_distributions_are_there_with_their_sources():
    assert {"magiattention", "pile", "prolong64k", "prolong512k"} <= set(NAMES)
    for name in NAMES:
        raw = yaml.safe_load((D.DATA_DIR / f"{name}.yaml").read_text())
        assert raw["name"] == name
        src = raw["source"]
        assert src["repository"] and src["path"] and re.fullmatch(r"[0-9a-f]{40}", src["commit"]), name
        assert len(raw["transcription"]) > 80, name          # the rule from the source's rows to these bins
        hist = D.load(name)
        assert math.isclose(sum(hist.prob), 1.0) and hist.lo[0] >= 1 and hist.source.endswith(src["commit"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,max_frac", [(4, 0.25), (7, 0.25), (1000, 0.25), (65536, 0.25), (1 << 19, 0.25),
                                        (1, 1.0), (4096, 0.1)])
def test_packs_sum_to_n_and_no_document_is_above_the_cap(name, n, max_frac):
    cap = math.floor(n * max_frac)
    for seed in range(3):
        out = D.sample_doc_lengths(n, name, seed=seed, max_frac=max_frac)
        assert sum(out) == n and all(type(x) is int and 1 <= x <= cap for x in out), (name, n, seed)


def test_long_documents_are_split_at_the_cap_not_dropped():
    # MagiAttention's rule: a document above the cap becomes cap-long pieces and a remainder, so the
    # pack keeps the long documents' tokens. At N = 512K (64 H100 x 8K) the cap is 128K, and a third of
    # the drawn tokens lie in documents longer than 16K: were they dropped, every piece would be short.
    n = 1 << 19
    out = [x for s in range(32) for x in D.sample_doc_lengths(n, "magiattention", seed=s)]
    assert max(out) == n // 4
    assert sum(x for x in out if x > 16384) / sum(out) > 0.1


def _cap_token_share(hist: D.LengthHistogram, cap: int) -> float:
    """The corpus's share of tokens that step 2 puts in cap-long pieces, by enumerating every length."""
    tokens = sum(p * float((np.arange(a, b + 1) // cap * cap).mean()) for a, b, p in zip(hist.lo, hist.hi, hist.prob))
    return tokens / hist.mean


@pytest.mark.parametrize("name", NAMES)
def test_packs_hold_the_corpus_share_of_long_document_tokens(name):
    # MagiAttention's packs keep the corpus's token mix: a pack's share of tokens in cap-long pieces is
    # the corpus's share in the documents above the cap, also where one document is far longer than
    # the pack (Pile's last bin reaches 9.3M tokens; drawing whole documents per pack gave Pile 0.68
    # against 0.97 here). Packs of 64K with a cap of 1K, so that the one piece cut at N per pack moves
    # the share by at most cap/N; tolerance: that, plus 4 standard errors of the mean over 64 packs.
    hist, n, packs = D.load(name), 1 << 16, 64
    cap = n // 64
    shares = []
    for seed in range(packs):
        out = np.asarray(D.sample_doc_lengths(n, name, seed=seed, max_frac=1 / 64))
        shares.append(out[out == cap].sum() / n)
    err = 4 * np.std(shares, ddof=1) / math.sqrt(packs) + cap / n
    assert abs(np.mean(shares) - _cap_token_share(hist, cap)) < err, (name, np.mean(shares), err)


def test_the_same_seed_gives_the_same_pack():
    for name in NAMES:
        a = D.sample_doc_lengths(1 << 16, name, seed=5)
        assert a == D.sample_doc_lengths(1 << 16, name, seed=5)
        assert a != D.sample_doc_lengths(1 << 16, name, seed=6), name


@pytest.mark.parametrize("name", NAMES)
def test_draws_follow_the_source_histogram(name):
    hist = D.load(name)
    lengths = _documents(hist, seed=0)
    assert len(lengths) > DRAWS // 2
    assert hist.counts(lengths).sum() == len(lengths)              # every length inside a bin
    assert _chi2(lengths, hist) < _chi2_limit(len(hist.prob) - 1), name


def test_the_check_rejects_a_wrong_histogram():
    # The same check must fail on a near miss: MagiAttention's two largest bins swapped (28.2% and
    # 24.6% of the documents), and ProLong's 64K lengths read against its 512K histogram.
    magi = D.load("magiattention")
    prob = list(magi.prob)
    prob[4], prob[5] = prob[5], prob[4]
    swapped = D.LengthHistogram("swapped", magi.lo, magi.hi, tuple(prob))
    limit = _chi2_limit(len(prob) - 1)
    assert _chi2(_documents(swapped, seed=0), magi) > 10 * limit
    assert _chi2(_documents(D.load("prolong64k"), seed=0), D.load("prolong512k")) > 10 * _chi2_limit(41)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n_tokens=0), "n_tokens=0 must be an integer >= 1"),
    (dict(n_tokens=64.0), "n_tokens=64.0 must be an integer"),
    (dict(n_tokens=True), "n_tokens=True"),
    (dict(seed=-1), "seed=-1 must be an integer >= 0"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(max_frac=0), "max_frac=0 must be a number in (0, 1]"),
    (dict(max_frac=1.5), "max_frac=1.5"),
    (dict(n_tokens=3), "max_frac=0.25 leaves no room for a document in n_tokens=3"),
    (dict(distribution="nope"), "distribution='nope' is not a document-length distribution"),
    (dict(distribution=3), "distribution=3 must be a name"),
])
def test_bad_input_names_the_parameter(kwargs, needle):
    args = dict(n_tokens=64, distribution="pile", seed=0) | kwargs
    n, dist = args.pop("n_tokens"), args.pop("distribution")
    with pytest.raises(ValueError) as e:
        D.sample_doc_lengths(n, dist, **args)
    assert needle in str(e.value), str(e.value)


def test_a_malformed_file_is_refused_naming_it(tmp_path, monkeypatch):
    (tmp_path / "overlap.yaml").write_text("bins:\n  - [1, 10, 5]\n  - [10, 20, 5]\n")
    (tmp_path / "zero.yaml").write_text("bins:\n  - [0, 10, 5]\n")
    monkeypatch.setattr(D, "DATA_DIR", tmp_path)
    for name, needle in (("overlap", "bin 1 starts at 10, inside or before bin 0"), ("zero", "1 <= lo <= hi")):
        with pytest.raises(ValueError) as e:
            D.load(name)
        assert needle in str(e.value) and name in str(e.value)


def test_masks_name_a_distribution_and_the_synthetic_one_stays_the_default():
    n = 4096
    m = M.parse("docs:magiattention:1", n)
    want = D.sample_doc_lengths(n, "magiattention", seed=1)
    assert list(np.diff(m.cu_seqlens)) == want and max(want) <= n // 4
    assert M.parse("docs:pile", n) == M.parse("docs:pile:0", n)
    assert M.label("docs:prolong64k:2") == "mask-docs-prolong64k-2"
    # docs:MEAN[:SEED] is still the synthetic log-normal, unchanged (existing specs and records)
    assert list(np.diff(M.parse("docs:100:3", n).cu_seqlens)) == M.long_tailed_lengths(n, 100, 3)
    assert M.check_spec("docs:prolong512k:0") is None
    for spec, needle in (("docs:nope", "'nope' is neither a MEAN"), ("docs:pile:-1", "SEED must be >= 0"),
                         ("docs:pile:x", "SEED must be integers"), ("docs:-3", "MEAN must be > 0")):
        assert needle in (M.check_spec(spec) or ""), spec

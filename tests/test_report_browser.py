"""The reproduction report in a real browser: headless Chromium loads reports/index.html from disk, every
image loads (the page's inline script marks broken ones on <body>), every section is present, and a
screenshot is saved (reports/screenshot.png) for a person to look at, and no table of a measured section
leaves out a value its records have. Skipped, with the reason, where no Chromium is installed (.ci/run
installs Debian's ``chromium``); under CI (``CI=true``) a missing Chromium fails instead."""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.report.build import write
from experiments.report.compare import method_select, shape
from experiments.report.context import load_context
from experiments.report.evidence import select
from experiments.report.paper import load_tables
from experiments.report.quantities import QUANTITIES

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
# --no-sandbox: CI runs as root, where Chromium refuses its sandbox; the page is ours and local
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--virtual-time-budget=15000")

# CI installs Chromium: there a missing one is a broken setup, not a machine without a browser
CI = os.environ.get("CI", "").lower() in ("true", "1")
NO_BROWSER = f"no Chromium here (looked for {', '.join(BROWSERS)}): apt-get install chromium, as .ci/run does"

pytestmark = pytest.mark.skipif(BROWSER is None and not CI, reason=NO_BROWSER)


def _chromium(*args: str) -> subprocess.CompletedProcess:
    if BROWSER is None:
        pytest.fail(f"CI=true: {NO_BROWSER}")
    return subprocess.run([BROWSER, *FLAGS, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def context():
    return load_context(page_dir=ROOT / "reports")


@pytest.fixture(scope="module")
def page(context) -> Path:
    html_path, _ = write(context)
    return html_path


def _sections(dom: str) -> dict[str, list[str]]:
    """The text of every table cell, per paper-table section (its heading's id up to the next heading)."""
    out = {}
    for part in re.split(r"(?=<h2[\s>])", dom):
        m = re.match(r'<h2[^>]*id="table-([^"]+)"', part)
        if m:
            out[m.group(1)] = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
                               for c in re.findall(r"<td[^>]*>(.*?)</td>", part, re.S)]
    return out


# the record fields each quantity is computed from, named here apart from the report's readers: a reader
# that overlooks one (Table 4's held-out perplexity once) would otherwise hide the value and pass
RAW = {"latency_s": ("time_median_s",), "step_time_s": ("time_median_s",), "tokens_per_s_per_gpu": ("time_median_s",),
       "memory_gb": ("mem_total_bytes", "mem_peak_bytes"), "tflops_per_gpu": ("tflops_per_rank",),
       "perplexity": ("perplexity", "losses")}


def missing_values(dom: str, ctx) -> list[str]:
    """Each value a measured section's records have (one of its RAW fields) that none of its table cells
    shows (as the page prints it: 4 significant digits), named by table, experiment, paper row and case."""
    sections, missing = _sections(dom), []
    for t in ctx.tables.values():
        q, shown = QUANTITIES[t.quantity], sections.get(t.id, [])
        for e in ctx.measured(t.measured):
            for r in t.rows:
                # one record per shape, as the table keeps them
                recs = {shape(x): x for x in select(e.records, method_select(ctx.methods[r.method], measured=True))}
                for rec in recs.values():
                    if rec.get("status") != "ok" or all(rec.get(k) in (None, []) for k in RAW[t.quantity]):
                        continue
                    v, case = q.read(rec), f"{t.id} / {e.rel} / {r.label} / {rec.get('case_id')}"
                    if v is None:
                        missing.append(f"{case}: has {RAW[t.quantity]}, the report reads none")
                    elif not any(c.startswith(f"{v:.4g}") for c in shown):
                        missing.append(f"{case}: {v:.4g}")
    return missing


def test_every_image_loads_and_every_section_is_there(page):
    out = _chromium("--dump-dom", page.as_uri())
    dom = out.stdout
    assert "<body" in dom, out.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom).group(1)
    images = int(re.search(r'data-images="(\d+)"', body).group(1))
    broken = json.loads(re.search(r"data-broken=\"([^\"]*)\"", body).group(1).replace("&quot;", '"'))
    assert images >= 10 and broken == [], f"{len(broken)} of {images} images did not load: {broken[:5]}"
    for anchor in ("claims", "model-error", "intervals", *(f"table-{t.id}" for t in load_tables())):
        assert f'id="{anchor}"' in dom, anchor


def test_a_screenshot_of_the_page(page):
    shot = page.parent / "screenshot.png"
    shot.unlink(missing_ok=True)
    out = _chromium(f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri())
    assert shot.exists() and shot.stat().st_size > 10_000, out.stderr[-2000:]


def test_no_measured_cell_is_empty_where_its_records_have_the_value(page, context):
    out = _chromium("--dump-dom", page.as_uri())
    assert "<body" in out.stdout, out.stderr[-2000:]
    missing = missing_values(out.stdout, context)
    assert not missing, f"{len(missing)} measured values not shown: {missing[:5]}"

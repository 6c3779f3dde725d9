"""The reproduction report in a real browser: headless Chromium loads reports/index.html from disk, every
image loads (the page's inline script marks broken ones on <body>), every section is present, and a
screenshot is saved (reports/screenshot.png) for a person to look at. Skipped, with the reason, where no
Chromium is installed (.ci/run installs Debian's ``chromium``)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.report.build import write
from experiments.report.context import load_context
from experiments.report.paper import load_tables

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
# --no-sandbox: CI runs as root, where Chromium refuses its sandbox; the page is ours and local
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--virtual-time-budget=15000")

pytestmark = pytest.mark.skipif(BROWSER is None, reason=f"no Chromium here (looked for {', '.join(BROWSERS)}): "
                                                        "apt-get install chromium, as .ci/run does")


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, *FLAGS, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page() -> Path:
    html_path, _ = write(load_context(page_dir=ROOT / "reports"))
    return html_path


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

"""The HTML report renders in headless Chromium with the timeline and the memory chart on
screen (``benchmarks/screenshot_report.py``).

The two charts draw with colours no other chart uses (``TIMELINE_COLOURS``,
``MEMORY_COLOURS``; checked below on the chart PNGs), so counting those colours' pixels in
the screenshot tells whether each chart is visible. Chromium is required, not optional:
``bash tests/install_chromium.sh`` (the first step of README's test command and of .ci/run)
installs it; without it this test fails and names the install command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from autopar.report.plots import MEMORY_COLOURS, TIMELINE_COLOURS
from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "reports" / "gpt-1.3b-dgx-a100-1"
WIDTH, HEIGHT = 1400, 3000


shot = load_script("benchmarks/screenshot_report.py")


@pytest.fixture(scope="module")
def screenshot_png(tmp_path_factory) -> Path:
    try:
        shot.find_chromium()
    except FileNotFoundError as exc:  # fail, never skip: CI must render the report
        pytest.fail(f"{exc}. Run: bash tests/install_chromium.sh")
    return shot.screenshot(REPORT / "report.html", tmp_path_factory.mktemp("shot") / "r.png",
                           width=WIDTH, height=HEIGHT)


def test_screenshot_is_a_full_size_page_not_blank(screenshot_png):
    image = np.asarray(Image.open(screenshot_png).convert("RGB"))
    assert image.shape == (HEIGHT, WIDTH, 3)
    not_white = (image < 250).any(axis=-1).mean()
    assert not_white > 0.05, f"only {not_white:.1%} of the screenshot is not white"
    packed = (image[..., 0].astype(np.uint32) << 16) | (image[..., 1].astype(np.uint32) << 8) \
        | image[..., 2]
    assert len(np.unique(packed)) > 200  # antialiased text, tables and charts


def test_timeline_and_memory_chart_are_visible(screenshot_png):
    counts = shot.chart_pixels(screenshot_png)
    # 1.3B on one node: p=1, the timeline draws 16 forwards and 16 backwards
    assert counts["timeline"]["F"] > 10_000 and counts["timeline"]["B"] > 20_000, counts
    assert sum(counts["memory"].values()) > 20_000, counts
    # all four kinds drawn (ZeRO shards the gradients: their bar is the thinnest, ~400 px)
    assert all(v > 200 for v in counts["memory"].values()), counts
    assert shot.main([str(REPORT / "report.html"), str(screenshot_png)]) == 0


def test_chart_colours_belong_to_one_chart_each():
    """Why counting colours works: no other image of the report uses those colours."""
    others = {"timeline": MEMORY_COLOURS, "memory": TIMELINE_COLOURS,
              "breakdown": {**TIMELINE_COLOURS, **MEMORY_COLOURS},
              "comparison": {**TIMELINE_COLOURS, **MEMORY_COLOURS}}
    for chart, foreign in others.items():
        counts = shot.colour_pixels(REPORT / f"{chart}.png", foreign)
        assert not any(counts.values()), (chart, counts)
    own = shot.colour_pixels(REPORT / "timeline.png", TIMELINE_COLOURS)
    assert min(own.values()) > 1000


def test_missing_chromium_names_the_install_command(monkeypatch):
    monkeypatch.setattr(shot.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="apt-get install -y chromium"):
        shot.find_chromium()

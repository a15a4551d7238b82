"""Render a report.html in headless Chromium and check the charts are on screen.

    python benchmarks/screenshot_report.py reports/gpt-1.3b-dgx-a100-1/report.html shot.png

runs ``chromium --headless --no-sandbox --disable-gpu --screenshot=shot.png
--window-size=1400,3000 file://.../report.html`` and prints how many pixels of the
timeline's and the memory chart's colours (``autopar.report.plots.TIMELINE_COLOURS`` and
``MEMORY_COLOURS``, used by no other chart) the screenshot holds. Exit status 1 when one of
the two charts is missing from the screenshot. Chromium comes from Debian
(``apt-get install -y chromium``, about 30 s); nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

try:
    from autopar.report.plots import MEMORY_COLOURS, TIMELINE_COLOURS
except ModuleNotFoundError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from autopar.report.plots import MEMORY_COLOURS, TIMELINE_COLOURS

INSTALL_HINT = "apt-get install -y chromium (Debian/Ubuntu; sudo if not root)"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# A chart counts as visible when its colours cover this many pixels: its legend patches
# alone cover about 100 each, the bars of the smallest example report over 20,000.
MIN_CHART_PIXELS = 2000


def find_chromium() -> str:
    """Path of a Chromium/Chrome executable; FileNotFoundError naming the install command."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(f"no Chromium found (looked for {', '.join(BROWSERS)}); "
                            f"install it with: {INSTALL_HINT}")


def screenshot(html: str | Path, png: str | Path, *, width: int = 1400, height: int = 3000,
               timeout_s: float = 60.0) -> Path:
    """Screenshot the top ``width`` × ``height`` pixels of ``html`` into ``png``.

    Raises FileNotFoundError (no Chromium, or no ``html``) and RuntimeError (Chromium
    failed or wrote no image; its stderr is included).
    """
    html, png = Path(html).resolve(), Path(png).resolve()
    if not html.is_file():
        raise FileNotFoundError(f"{html} does not exist")
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
           "--hide-scrollbars", f"--screenshot={png}", f"--window-size={width},{height}",
           html.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          cwd=png.parent)
    if proc.returncode != 0 or not png.is_file() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium exited with {proc.returncode} and wrote no screenshot "
                           f"to {png}:\n{proc.stderr[-2000:]}")
    return png


def _rgb(colour: str) -> tuple[int, int, int]:
    """``#4c72b0`` -> (76, 114, 176)."""
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def colour_pixels(png: str | Path, colours: dict[str, str]) -> dict[str, int]:
    """Number of pixels of exactly each colour (name -> ``#rrggbb``) in the image."""
    import numpy as np
    from PIL import Image

    image = np.asarray(Image.open(png).convert("RGB"))
    return {name: int((image == _rgb(c)).all(axis=-1).sum()) for name, c in colours.items()}


def chart_pixels(png: str | Path) -> dict[str, dict[str, int]]:
    """Pixels of each timeline colour and each memory-chart colour in a screenshot."""
    return {"timeline": colour_pixels(png, TIMELINE_COLOURS),
            "memory": colour_pixels(png, MEMORY_COLOURS)}


def main(argv: list[str] | None = None) -> int:
    """Screenshot a report and check the timeline and memory chart are visible."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, help="a report.html")
    parser.add_argument("png", type=Path, help="where to write the screenshot")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=3000)
    args = parser.parse_args(argv)
    screenshot(args.html, args.png, width=args.width, height=args.height)
    counts = chart_pixels(args.png)
    for chart, by_colour in counts.items():
        print(f"{chart}: " + ", ".join(f"{k} {v} px" for k, v in by_colour.items()))
    missing = [chart for chart, by_colour in counts.items()
               if sum(by_colour.values()) < MIN_CHART_PIXELS]
    if missing:
        print(f"not visible in the screenshot: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"screenshot {args.png}: timeline and memory chart visible")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

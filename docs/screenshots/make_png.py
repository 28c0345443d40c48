"""Turn the console's snapshot SVGs into the PNGs the README and docs/console.md show.

The snapshots (tests/__snapshots__/test_tui_snapshots/, made by
``pytest tests/test_tui_snapshots.py --snapshot-update``) are the reviewed
images, so the docs show exactly what the tests pin. Needs ``cairosvg`` (PyPI;
it uses the system's libcairo). Run from the repository root:

    python docs/screenshots/make_png.py
"""

from __future__ import annotations

from pathlib import Path

import cairosvg

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "__snapshots__" / "test_tui_snapshots"
SCREENS = {"setup": "test_setup_screen", "run": "test_run_screen", "report": "test_report_screen",
           "run-hang": "test_run_screen_with_a_hang", "hang-stacks": "test_hang_stacks_screen",
           "run-32-ranks": "test_run_screen_32_ranks", "help": "test_help_screen",
           "run-clocked": "test_run_screen_of_a_clocked_run",
           "run-256-ranks": "test_run_screen_256_ranks_at_the_first_laggard"}


def main() -> None:
    """Write docs/screenshots/<screen>.png for each snapshot."""
    for screen, snapshot in SCREENS.items():
        svg = (SNAPSHOTS / f"{snapshot}.svg").read_text(encoding="utf-8")
        # the SVG asks for Fira Code from the web, which cairo cannot fetch; a local monospace
        # font keeps the terminal's columns (box drawing included) lined up
        svg = svg.replace('"Fira Code"', '"DejaVu Sans Mono"').replace("Fira Code, monospace", "DejaVu Sans Mono")
        out = Path(__file__).parent / f"{screen}.png"
        cairosvg.svg2png(bytestring=svg.encode(), write_to=str(out))
        print(out.relative_to(ROOT))


if __name__ == "__main__":
    main()

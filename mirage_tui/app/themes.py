"""Load the console's themes from TOML files and register them with the app.

Textual has no theme-file loader, so this is one. The files ship inside the
package (``mirage_tui/themes/``, package data), so an installed mirage finds
them as an editable checkout does; the top-level ``themes`` is a link to that
folder, where the architecture notes say themes live.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from textual.app import App
from textual.theme import Theme

THEMES_DIR = Path(__file__).resolve().parents[1] / "themes"
DEFAULT_THEME = "mirage-dark"
#: The theme variable the rank tree and grid colour each rank state with; every theme file must set them all
#: (``behind`` is the grid's: see mirage_tui/state/rank_summary.py).
RANK_STATE_VARIABLES = {"running": "rank-running", "compiling": "rank-compiling", "in collective": "rank-collective", "stuck": "rank-stuck",
                        "missing": "rank-missing", "exited 0": "rank-exited", "exited": "rank-exited",
                        "failed": "rank-failed", "behind": "rank-behind"}
_FIELDS = ("primary", "secondary", "accent", "background", "surface", "panel", "foreground",
           "error", "warning", "success", "boost")


def load_theme(path: Path) -> Theme:
    """Build a Theme from one TOML file (Theme's own field names, plus a ``[variables]`` table)."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    variables = {str(k): str(v) for k, v in data.get("variables", {}).items()}
    missing = [v for v in RANK_STATE_VARIABLES.values() if v not in variables]
    if missing:
        raise ValueError(f"theme {path} lacks the rank-state variables {', '.join(missing)}")
    return Theme(
        name=data["name"],
        dark=bool(data.get("dark", True)),
        variables=variables,
        **{k: data[k] for k in _FIELDS if k in data},
    )


def theme_files(directory: Path = THEMES_DIR) -> dict[str, Path]:
    """Each theme's short name (its file's stem, e.g. ``light``) and file."""
    return {path.stem: path for path in sorted(directory.glob("*.toml"))}


def resolve(name: str, directory: Path = THEMES_DIR) -> str | None:
    """The registered name (``mirage-light``) for a short or full theme name, or None if there is none."""
    for stem, path in theme_files(directory).items():
        full = tomllib.loads(path.read_text(encoding="utf-8"))["name"]
        if name in (stem, full):
            return full
    return None


def register_themes(app: App, directory: Path = THEMES_DIR) -> list[str]:
    """Register every theme in ``directory`` with ``app``; return their names, the default first."""
    names = []
    for path in theme_files(directory).values():
        theme = load_theme(path)
        app.register_theme(theme)
        names.append(theme.name)
    names.sort(key=lambda n: n != DEFAULT_THEME)  # stable: the rest keep file order
    return names

"""Load the console's themes from ``themes/*.toml`` and register them with the app."""

from __future__ import annotations

import tomllib
from pathlib import Path

from textual.app import App
from textual.theme import Theme

#: Until the themes ship as package data they are read from the repository checkout.
THEMES_DIR = Path(__file__).parents[2] / "themes"
DEFAULT_THEME = "mirage-dark"
_FIELDS = ("primary", "secondary", "accent", "background", "surface", "panel", "foreground",
           "error", "warning", "success", "boost")


def load_theme(path: Path) -> Theme:
    """Build a Theme from one TOML file (Theme's own field names, plus a ``[variables]`` table)."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return Theme(
        name=data["name"],
        dark=bool(data.get("dark", True)),
        variables={str(k): str(v) for k, v in data.get("variables", {}).items()},
        **{k: data[k] for k in _FIELDS if k in data},
    )


def register_themes(app: App, directory: Path = THEMES_DIR) -> list[str]:
    """Register every theme in ``directory`` with ``app``; return their names, the default first."""
    names = []
    for path in sorted(directory.glob("*.toml")):
        theme = load_theme(path)
        app.register_theme(theme)
        names.append(theme.name)
    names.sort(key=lambda n: n != DEFAULT_THEME)  # stable: the rest keep file order
    return names

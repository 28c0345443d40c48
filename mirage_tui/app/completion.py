"""File completion for the Setup form's command field: the word being typed, completed as a path."""

from __future__ import annotations

import os

from textual.suggester import Suggester


def complete_path(value: str) -> str | None:
    """``value`` with its last word completed as far as the file system allows, or None.

    One match completes it (a folder gets its ``/``, to go on typing); several
    complete their common prefix. Hidden entries only when the word starts with a dot.
    """
    head, sep, word = value.rpartition(" ")
    if not word:
        return None
    folder, prefix = os.path.split(word)
    try:
        names = os.listdir(os.path.expanduser(folder) or ".")
    except OSError:
        return None
    matches = sorted(n for n in names if n.startswith(prefix) and (prefix.startswith(".") or not n.startswith(".")))
    if not matches:
        return None
    done = os.path.commonprefix(matches)
    if len(matches) == 1 and os.path.isdir(os.path.join(os.path.expanduser(folder) or ".", done)):
        done += os.sep
    if done == prefix:
        return None
    return f"{head}{sep}{os.path.join(folder, done)}"


class PathSuggester(Suggester):
    """Offers :func:`complete_path` as the Input's suggestion (the right arrow accepts it)."""

    def __init__(self) -> None:
        # the file system changes under the form: never answer from a cache
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        """The completed value."""
        return complete_path(value)

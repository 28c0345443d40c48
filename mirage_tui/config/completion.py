"""File completion for the Setup form's command field: the word being typed, completed as a path.

No Textual here: the form's suggester (:class:`mirage_tui.app.setup.PathSuggester`) calls it.
"""

from __future__ import annotations

import os


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


"""Where a hang report says a rank is now: the innermost frame of the user's code, links resolved."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mirage_tui.reports import diagnosis


def _stacks(*frames: str) -> str:
    lines = ["Current thread 0x00007f (most recent call first):"]
    lines += [f'  File "{path}", line {n} in {name}' for path, n, name in frames]
    return "\n".join(lines)


def test_the_innermost_frame_outside_torch_is_the_users():
    torch_dir = Path(importlib.util.find_spec("torch").submodule_search_locations[0])
    stacks = _stacks((str(torch_dir / "nn/parallel/distributed.py"), 1, "_pre_forward"), ("/work/train.py", 9, "main"))
    assert diagnosis._innermost_user_frame(stacks) == 'File "/work/train.py", line 9 in main'


def test_torch_reached_through_a_linked_environment_is_still_torch(tmp_path):
    """A virtual environment whose path is a symlink: the rank's frames name torch through the link."""
    torch_dir = Path(importlib.util.find_spec("torch").submodule_search_locations[0]).resolve()
    link = tmp_path / "venv-link"
    os.symlink(torch_dir.parent, link)
    stacks = _stacks((str(link / "torch/nn/parallel/distributed.py"), 1, "_pre_forward"), ("/work/train.py", 9, "main"))
    assert diagnosis._innermost_user_frame(stacks) == 'File "/work/train.py", line 9 in main'

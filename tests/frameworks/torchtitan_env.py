"""torchtitan 0.2.2 for the tests: its wheel and the packages it needs beyond the test venv, in a folder of their own.

torchtitan is no dependency of mirage's test venv: it pins nothing that clashes with
the ``frameworks`` extra, but adds a dozen packages (datasets, pyarrow, tensorboard,
tyro, ...) that the other framework tests would then import. So they are installed
with ``pip install --no-deps --target``, at the versions pip resolves for torchtitan
0.2.2 next to that venv (torch 2.13.0, transformers 5.25.0, huggingface_hub 2.4.0),
into ``<venv>/overlays/torchtitan-0.2.2``, and only torchtitan's runs get that folder
on ``PYTHONPATH``. Made once per venv (about 100 MB from PyPI), under a lock, moved
into place only when complete.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "0.2.2"
#: what torchtitan 0.2.2 needs that the test venv lacks, as pip resolved it there with -c tests/constraints.txt
PACKAGES = [
    f"torchtitan=={VERSION}", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "pyarrow==26.0.1",
    "xxhash==4.1.0", "torchdata==0.11.0", "tyro==1.0.17", "docstring_parser==0.18.0", "typeguard==4.6.1",
    "tomli==2.5.0", "tensorboard==2.21.0", "tensorboard-data-server==0.7.2", "absl-py==2.5.1", "grpcio==1.85.4",
    "markdown==3.11.4", "protobuf==7.36.2", "werkzeug==3.1.9", "pillow==13.0.0",
]
#: long enough for PyPI at a CI box's speed; a slower or absent index skips the tests that need it
INSTALL_TIMEOUT_S = 240


def overlay() -> tuple[Path | None, str]:
    """The folder holding torchtitan and its extra packages, made if need be; or None and why it could not be."""
    root = Path(os.environ.get("MIRAGE_TORCHTITAN_OVERLAY") or Path(sys.prefix) / "overlays" / f"torchtitan-{VERSION}")
    if (root / "torchtitan").is_dir():
        return root, ""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (root / "torchtitan").is_dir():  # made by another worker while this one waited
            return root, ""
        partial = root.with_name(root.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial),
               "--disable-pip-version-check", *PACKAGES]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            shutil.rmtree(partial, ignore_errors=True)
            return None, f"installing torchtitan {VERSION} took over {INSTALL_TIMEOUT_S} s (no fast package index)"
        if r.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"could not install torchtitan {VERSION} ({' '.join(cmd[1:4])} ...): {last}"
        partial.rename(root)
    return root, ""

"""Build ``shim/native/pinned_host.cpp``, the pinned host allocator ``shim/memory/pinned.py`` loads.

The same way, ``build(source)`` builds the shim's other C++ (``SOURCES``: the
backend's device guard, ``shim/native/device_guard.cpp``, the kernels of
``shim/native/fast_dispatch.cpp``, and ``shim/native/comms_native.cpp``, the collectives'
profiler events and DDP's timer). Each is one C++ file against torch's headers,
linked to ``libc10``/``libtorch_cpu``: those without Python or pybind11
compile in about 1.5 s; those that also need Python's headers and
``libtorch_python`` in about 15 s. The library is cached in
``$MIRAGE_CACHE_DIR`` if set, else in the virtual environment
(``<venv>/lib/mirage/``; ``~/.cache/mirage/`` for a Python outside one or a
venv we cannot write to), named by torch's version and a hash of the source
and the compile flags, so a new torch or an edited source builds a new one
(and removes all but the newest few it replaces). Ranks that start together build it once:
the first takes a lock, the others wait for it and load its result. A failed
compile is recorded next to where the library would be and not retried with
the same compiler (delete the record to retry), so that every rank of every
run does not pay for it again.

``python -m shim.native.build`` builds them ahead of time (tests/setup_venv.sh
does) and prints where they are. Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from shim.rank.runtime import RUNTIME

SOURCE = Path(__file__).with_name("pinned_host.cpp")
#: every library built this way (``source`` below): the pinned allocator, the backend's device guard
#: (``shim/native/device_guard.cpp``, loaded by ``shim/cuda/engine.py``) and the fast dispatch kernels; each is
#: cached and fails on its own
GUARD_SOURCE = Path(__file__).with_name("device_guard.cpp")
#: ops' kernels for the Python dispatch key (loaded by ``shim/tensor/fast_dispatch.py``); unlike the two
#: above it calls into Python, so it needs Python's headers and libtorch_python
FAST_DISPATCH_SOURCE = Path(__file__).with_name("fast_dispatch.cpp")
#: the collectives' profiler events and DDP's timer (shim/transport/profiler.py)
COMMS_SOURCE = Path(__file__).with_name("comms_native.cpp")
SOURCES = (SOURCE, GUARD_SOURCE, FAST_DISPATCH_SOURCE, COMMS_SOURCE)
#: libraries of one source name kept per torch, the newest first: one a checkout, and the few that other
#: checkouts sharing the virtual environment build
KEEP_BUILDS = 4


class BuildError(RuntimeError):
    """The library could not be built here (one line: why)."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("torch is not installed")
    return Path(spec.submodule_search_locations[0])


def _cache_dir() -> Path:
    if RUNTIME.settings.cache_dir:
        return Path(RUNTIME.settings.cache_dir)
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / "lib" / "mirage"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mirage"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    found = shutil.which(shlex.split(cxx)[0]) if cxx.strip() else None
    if found is None:
        raise BuildError(f"no C++ compiler: {cxx!r} not found (CXX names the compiler, default c++)")
    return cxx


def _command(cxx: str, torch_dir: Path, out: Path, source: Path = SOURCE) -> list[str]:
    # the flags torch.utils.cpp_extension uses (C++20, position independent); the C++ ABI is
    # that of every torch 2.13 wheel, and the rpath lets the loader find libc10 from anywhere
    lib = torch_dir / "lib"
    python = []
    if source.name == FAST_DISPATCH_SOURCE.name:
        # Python's symbols come from the interpreter that loads the library: headers only
        python = [f"-I{sysconfig.get_paths()['include']}", "-ltorch_python"]
    return [*shlex.split(cxx), "-O2", "-std=c++20", "-fPIC", "-shared", "-D_GLIBCXX_USE_CXX11_ABI=1",
            f"-I{torch_dir / 'include'}", str(source), "-o", str(out),
            f"-L{lib}", "-lc10", "-ltorch_cpu", *python, f"-Wl,-rpath,{lib}"]


def library_path(source: Path = SOURCE) -> Path:
    """Where the library for this torch and this source is (or will be) cached; imports nothing heavy."""
    torch_dir = _torch_dir()
    key = hashlib.sha256(source.read_bytes())
    # the flags, not where the source lies: checkouts at other paths share one cached library
    # (with the path in the key, each build deleted the other checkout's as stale)
    key.update(" ".join(_command("", torch_dir, Path(), Path(source.name))).encode())
    # the loaded torch's own (a rank's, at its start); importlib.metadata parses the wheel's METADATA (~3 ms)
    torch = sys.modules.get("torch")
    version = torch.__version__ if torch is not None else importlib.metadata.version("torch")
    return _cache_dir() / f"{source.stem}-torch{version}-{key.hexdigest()[:12]}.so"


def build(source: Path = SOURCE) -> Path:
    """``source``'s library's path, compiling it first if no process has yet; :class:`BuildError` if it cannot be."""
    out = library_path(source)
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.with_suffix(".lock"), "w")
    except OSError as e:
        raise BuildError(f"cannot write {out.parent}: {e.strerror} (MIRAGE_CACHE_DIR names another place)") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of one run start together: one compiles
        if out.exists():
            return out
        cxx = _compiler()  # no compiler is not recorded: installing one is enough to retry
        # a failure is this compiler's: another CXX gets its own try
        failed = out.with_name(f"{out.stem}-cxx{hashlib.sha256(cxx.encode()).hexdigest()[:8]}.failed")
        if failed.exists():
            raise BuildError(f"{failed.read_text().strip()} (recorded in {failed}; delete it to retry)")
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            r = subprocess.run(_command(cxx, _torch_dir(), tmp, source), capture_output=True, text=True)
        except OSError as e:  # CXX names something that is not a program (not recorded either)
            raise BuildError(f"cannot run the C++ compiler {cxx!r}: {e.strerror}") from None
        if r.returncode != 0:
            errors = [line for line in r.stderr.splitlines() if "error" in line] or r.stderr.splitlines() or ["?"]
            why = f"compiling {source.name} failed: {errors[0].strip()}"
            failed.write_text(why + "\n")
            tmp.unlink(missing_ok=True)
            raise BuildError(f"{why} (recorded in {failed}; delete it to retry)")
        os.replace(tmp, out)  # whole or absent: a rank never loads a half-written library
    _forget_older(out)
    return out


def _forget_older(out: Path) -> None:
    """Remove what earlier sources built for this torch beyond the :data:`KEEP_BUILDS` newest (a process that has
    one loaded keeps it: unlinking a mapped file leaves the mapping)."""
    # Not all of them: two checkouts of different sources sharing a virtual environment (a worktree, a
    # branch switched back to) would otherwise delete each other's library and rebuild it in turn.
    prefix = out.name.rsplit("-", 1)[0] + "-"
    # each file by the source hash after the prefix: its library (.so), lock, failure record, a build's .tmp
    files = [(path, path.name[len(prefix):].split(".", 1)[0].split("-", 1)[0])
             for path in out.parent.glob(f"{prefix}*")]
    ours = out.stem[len(prefix):]
    built: dict[str, float] = {}  # an older source's hash -> when its library was built
    for path, key in files:
        if path.suffix == ".so" and key != ours:
            try:
                built[key] = path.stat().st_mtime
            except OSError:  # another process's build removed it meanwhile
                pass
    keep = {ours, *sorted(built, key=built.get, reverse=True)[:KEEP_BUILDS - 1]}
    for path, key in files:
        if key not in keep:
            path.unlink(missing_ok=True)


def load(source: Path, what: str, loader: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL:
    """``source``'s library, built if need be and loaded; :class:`BuildError` (one line naming ``what``)
    if it cannot be built or does not load (built against another torch).

    ``loader`` ``ctypes.PyDLL`` keeps the GIL across calls, for a library that takes Python objects.
    """
    path = build(source)
    try:
        return loader(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {what}: {e}") from None


def main() -> None:
    """``python -m shim.native.build``: build every library now, print the paths and how long each took."""
    failed = False
    for source in SOURCES:
        start = time.monotonic()
        try:
            path = build(source)
        except BuildError as e:
            print(f"mirage: {source.name} not built: {e}", file=sys.stderr)
            failed = True
            continue
        print(f"{path} ({time.monotonic() - start:.1f} s)")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()

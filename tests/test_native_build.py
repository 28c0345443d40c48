"""shim/native/build.py: the cache of the shim's C++ libraries."""

from __future__ import annotations

import os
import shutil

from shim.native import build as native_build


def test_a_new_build_keeps_the_newest_few_of_other_sources(tmp_path, monkeypatch):
    """Two checkouts sharing a virtual environment must not delete each other's library at every start;
    the builds of many old edits do not pile up either."""
    monkeypatch.setattr(native_build, "_cache_dir", lambda: tmp_path / "cache")
    source = tmp_path / native_build.SOURCE.name
    shutil.copy(native_build.SOURCE, source)
    out = native_build.library_path(source)
    prefix = out.name.rsplit("-", 1)[0]
    out.parent.mkdir()
    older = [f"{prefix}-{i:012x}" for i in range(6)]  # the oldest first
    for i, name in enumerate(older):
        for suffix in (".so", ".lock"):
            path = out.parent / (name + suffix)
            path.write_bytes(b"")
            os.utime(path, (1000 + i, 1000 + i))
    (out.parent / f"{older[0]}-cxx12345678.failed").write_text("compiling failed\n")
    other = out.parent / "device_guard-torch0-abc.so"  # another library's: not this one's to remove
    other.write_bytes(b"")

    assert native_build.build(source) == out and out.stat().st_size > 0
    kept = sorted(p.name for p in out.parent.iterdir())
    newest = older[-(native_build.KEEP_BUILDS - 1):]
    assert kept == sorted([out.name, out.with_suffix(".lock").name, other.name]
                          + [name + suffix for name in newest for suffix in (".so", ".lock")])

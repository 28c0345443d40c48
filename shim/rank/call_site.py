"""Where in the user's code a collective (or ``init_process_group``) was called from.

Hang reports, desync findings and the console's in-flight pane name this site:
the first frame outside torch and mirage.
"""

from __future__ import annotations

import os
import sys

import torch

#: Frames in these folders are the machinery, not the user's code.
_SHIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_DIRS = (os.path.join(os.path.dirname(torch.__file__), ""), os.path.join(_SHIM_DIR, ""))


#: code object -> whether it is torch's or mirage's; (code object, line) -> its call site text.
#: Each code object is asked once, not each frame's file against the folders on every
#: collective. Still walked per call: the site is where this call came from (hang reports name
#: it), and one code object has many lines.
_INTERNAL_CODE: dict = {}
_SITES: dict = {}


def call_site() -> str:
    """file:line:function of the first frame outside torch and mirage."""
    f = sys._getframe(2)
    internal = _INTERNAL_CODE
    while f is not None:
        code = f.f_code
        inside = internal.get(code)
        if inside is None:
            if len(internal) > 4096:  # code made on the fly (exec, eval) must not pile up
                internal.clear()
            inside = internal[code] = code.co_filename.startswith(_INTERNAL_DIRS)
        if not inside:
            key = (code, f.f_lineno)
            site = _SITES.get(key)
            if site is None:
                if len(_SITES) > 4096:
                    _SITES.clear()
                site = _SITES[key] = f"{code.co_filename}:{key[1]}:{code.co_name}"
            return site
        f = f.f_back
    return ""

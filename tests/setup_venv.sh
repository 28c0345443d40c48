# Source this file: it makes the project's virtual environment and puts it first on PATH.
#
#   VENV=DIR        where the venv lives (default: .venv at the repository root)
#   SKIP_INSTALL=1  use the venv as it is; install nothing
#
# Installs the test and frameworks extras (tests/frameworks/ needs the latter),
# with tests/constraints.txt so that pip never replaces torch. Installs run only
# when pyproject.toml or tests/constraints.txt changed since the last install (a stamp
# in the venv holds their sha256), so sourcing again is fast. Safe under the
# caller's `set -euo pipefail`; it changes no shell options.

_mirage_setup_venv() {
    local root venv py stamp want
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    venv=${VENV:-$root/.venv}
    # Absolute, so PATH stays right after the caller changes directory.
    [[ $venv == /* ]] || venv=$PWD/$venv

    if [[ ! -x $venv/bin/python ]]; then
        if command -v python3.11 >/dev/null 2>&1; then
            py=python3.11
        elif command -v python3 >/dev/null 2>&1 &&
            python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            py=python3
        else
            echo "setup_venv: need python3.11 (or a python3 that is 3.11+) on PATH" >&2
            return 1
        fi
        echo "setup_venv: creating $venv with $py" >&2
        "$py" -m venv "$venv" || return 1
    fi

    if [[ ${SKIP_INSTALL:-0} != 1 ]]; then
        stamp=$venv/.mirage-installed
        want=$("$venv/bin/python" -c \
            'import hashlib, sys; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in sys.argv[1:])).hexdigest())' \
            "$root/pyproject.toml" "$root/tests/constraints.txt") || return 1
        if [[ ! -f $stamp || $(<"$stamp") != "$want" ]]; then
            echo "setup_venv: installing into $venv" >&2
            # torch first and pinned exactly: left to the resolver, another
            # version could be picked, which means gigabytes of download. The
            # constraints file keeps it so while the frameworks' requirements
            # are resolved (none may replace it).
            "$venv/bin/pip" install -q -c "$root/tests/constraints.txt" torch==2.13.0 || return 1
            # DS_BUILD_OPS=0: DeepSpeed installs without compiling its CUDA ops.
            (cd "$root" && DS_BUILD_OPS=0 "$venv/bin/pip" install -q -c tests/constraints.txt -e ".[test,frameworks]") ||
                return 1
            printf '%s\n' "$want" >"$stamp" || return 1
        fi
        # the shim's C++ (shim/native/build.py: the pinned host allocator and the device guard, ~2 s
        # each, the fast dispatch kernels, ~15 s), built now so that no rank waits for it; a no-op
        # once built. Without a C++ compiler the shim does without them.
        (cd "$root" && "$venv/bin/python" -m shim.native.build >/dev/null) ||
            echo "setup_venv: continuing without it (see docs/compatibility.md)" >&2
    fi

    export VENV=$venv
    export PATH="$venv/bin:$PATH"
}

# Called as an `if` condition so a failure returns from `source` (and stops a
# `set -e` caller) instead of killing an interactive shell.
if _mirage_setup_venv; then
    unset -f _mirage_setup_venv
else
    unset -f _mirage_setup_venv
    return 1
fi

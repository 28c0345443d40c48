#!/usr/bin/env bash
# Run mirage's test suite: sets up the venv (see setup_venv.sh), then pytest.
# Arguments go to pytest, e.g. `bash tests/run_suite.sh -k profiles -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tests/setup_venv.sh

# Two workers (pytest-xdist): a third of a rank-launching test's time is waiting (for the daemon,
# a hang timeout, a peer), which the other worker fills. MIRAGE_TEST_WORKERS=0 runs in one process.
# A short --basetemp: run directories live under tmp_path, and the daemon's socket paths must
# stay under 108 bytes (xdist's per-worker folders would push them over).
# --durations: the slowest tests, in every CI log, for keeping the default suite near ten minutes.
base=$(mktemp -d /tmp/mt.XXXXXX)
trap 'rm -rf "$base"' EXIT
# With no arguments: the default suite. The framework workloads, the Slurm cluster and the compiled
# distributed programs run as their own sets (-m frameworks, -m multihost, -m compile), which .ci/run
# runs after it.
if [[ $# -eq 0 ]]; then
    set -- -m "not frameworks and not multihost and not compile"
fi
status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 -n "${MIRAGE_TEST_WORKERS:-2}" --basetemp "$base/t" "$@" ||
    status=$?
if [[ $status -eq 5 ]]; then
    # pytest's "no tests collected" must not pass as a green run.
    echo "run_suite: pytest collected no tests" >&2
    status=1
fi
exit "$status"

#!/usr/bin/env bash
# Run mirage's test suite: sets up the venv (see setup_venv.sh), then pytest.
# Arguments go to pytest, e.g. `bash tests/run_suite.sh -k profiles -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tests/setup_venv.sh

status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
if [[ $status -eq 5 ]]; then
    # pytest's "no tests collected" must not pass as a green run.
    echo "run_suite: pytest collected no tests" >&2
    status=1
fi
exit "$status"

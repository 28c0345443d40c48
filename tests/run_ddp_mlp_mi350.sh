#!/usr/bin/env bash
# End-to-end demo: train a small MLP with PyTorch DDP on NPROC emulated
# MI350X GPUs, launched with torchrun under `mirage run`.
#
# Environment:
#   NPROC         GPUs / ranks per node (default 2)
#   STEPS         optimizer steps (default 50)
#   PROFILE       mirage profile / emulated GPU (default mi350x)
#   VENV          virtualenv location (default .venv)
#   SKIP_INSTALL  set to 1 to reuse an already-populated venv
#
# Prints "==> PASS: ..." and exits 0 when the run succeeds and prints
# ddp_mlp_ok; otherwise prints "==> FAIL: ..." and exits non-zero.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

NPROC="${NPROC:-2}"
STEPS="${STEPS:-50}"
PROFILE="${PROFILE:-mi350x}"
VENV="${VENV:-.venv}"
export NPROC STEPS PROFILE VENV

echo "==> Setting up venv at $VENV${SKIP_INSTALL:+ (SKIP_INSTALL=$SKIP_INSTALL)}"
# shellcheck source=tests/setup_venv.sh
source tests/setup_venv.sh

if ! command -v mirage >/dev/null 2>&1; then
    echo "==> FAIL: 'mirage' not found on PATH after venv setup ($VENV/bin)"
    exit 1
fi

log="$(mktemp "${TMPDIR:-/tmp}/ddp_mlp_mi350.XXXXXX")"
trap 'rm -f "$log"' EXIT

echo "==> Training DDP MLP: $NPROC ranks on emulated $PROFILE GPUs, $STEPS steps"
echo "==> mirage run --profile $PROFILE --gpus-per-node $NPROC -- torchrun --standalone --nproc_per_node=$NPROC tests/fixtures/ml/ddp_mlp.py"
set +e
mirage run --profile "$PROFILE" --gpus-per-node "$NPROC" \
    -- torchrun --standalone --nproc_per_node="$NPROC" \
    tests/fixtures/ml/ddp_mlp.py 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e

echo "==> Checking result"
if [[ $rc -eq 0 ]] && grep -q 'ddp_mlp_ok' "$log"; then
    echo "==> PASS: DDP MLP trained on $NPROC emulated $PROFILE GPUs via torchrun"
    exit 0
fi
if [[ $rc -eq 0 ]]; then
    echo "==> FAIL: mirage exited 0 but the output has no ddp_mlp_ok (DDP MLP on $NPROC emulated $PROFILE GPUs)"
    exit 1
fi
echo "==> FAIL: DDP MLP on $NPROC emulated $PROFILE GPUs via torchrun exited with code $rc"
exit "$rc"

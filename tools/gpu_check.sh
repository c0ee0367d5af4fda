#!/usr/bin/env bash
# The one device check to run when a session is lent a GPU, and its dry run on a CPU.
#
#   GPU machine (the `device` tool):  bash tools/gpu_wheels.sh   (here, once: wheels into .whl/)
#                                     run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   dry run here, on CPU:             DRY_RUN=1 PYTHON=.venv-latest/bin/python PYTHON_OLDER=.venv/bin/python \
#                                         bash tools/gpu_check.sh
#
# Steps: which GPU packages import; the op tests on CUDA (tests/test_ops_*.py; skipped in the dry run,
# the suite runs them on CPU); then ONE table from tools/bench_gpu.py: each GPU backend vs its torch
# reference (max error of the output and of every input gradient), tree vs flat throughput for
# attention / gated delta rule / SSD / one model step, and peak memory. The stack is the latest one:
# the machine's python3 (3.12 on the GPU machine) with megatron-core 0.19.2 from .whl/mcore-0.19.2;
# with .whl/mcore-0.16.1 (or PYTHON_OLDER in the dry run) the model step runs on 0.16.1 as well (one
# more row). Files land in $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DRY=${DRY_RUN:-0}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
WHL=${GPU_CHECK_WHEELS:-.whl}
status=0

if [ "$DRY" = 1 ]; then
  BENCH=(--device cpu --quick --dtype float32)
  echo "gpu_check: dry run on CPU ($PY)"
else
  BENCH=()
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi

install_dir() {  # install_dir WHEEL_DIR TARGET: the carried wheels of one folder into their own site dir
  ls "$1"/*.whl >/dev/null 2>&1 || return 1
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}
base="$PWD"
install_dir "$WHL/common" "$SITE/common" && base="$SITE/common:$base"
latest="$base"
install_dir "$WHL/mcore-0.19.2" "$SITE/mcore-0.19.2" && latest="$SITE/mcore-0.19.2:$base"
older=""
[ -z "${PYTHON_OLDER:-}" ] && install_dir "$WHL/mcore-0.16.1" "$SITE/mcore-0.16.1" && older="$SITE/mcore-0.16.1:$base"

PYTHONPATH="$latest" "$PY" - <<'PY' | tee "$OUT/backends.txt"
import sys
from importlib.metadata import version
from megatron_tree.ops.backend import module_available
print(f"python {sys.version.split()[0]}")
for dist in ("torch", "triton", "megatron-core", "fla-core", "mamba-ssm"):
    try:
        print(f"{dist:28s} {version(dist)}")
    except Exception:
        print(f"{dist:28s} -")
for m in ("triton", "fla.ops.gated_delta_rule", "mamba_ssm", "causal_conv1d", "transformer_engine"):
    print(f"import {m:21s} {'yes' if module_available(m) else 'no'}")
PY

if [ "$DRY" != 1 ]; then
  PYTHONPATH="$latest" timeout 300 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_ops_attention.py \
    tests/test_ops_gdn.py tests/test_ops_ssd.py tests/test_ops_conv.py > "$OUT/tests.log" 2>&1 || status=1
  tail -3 "$OUT/tests.log"
fi

rm -f "$OUT"/bench_*.json
PYTHONPATH="$latest" timeout 300 "$PY" tools/bench_gpu.py "${BENCH[@]}" --json "$OUT/bench_latest.json" \
  > "$OUT/bench_latest.log" 2>&1 || { status=1; tail -20 "$OUT/bench_latest.log"; }
if [ -n "$older" ] || [ -n "${PYTHON_OLDER:-}" ]; then
  PYO=${PYTHON_OLDER:-$PY}  # PYTHON_OLDER: an environment with megatron-core 0.16.1 of its own (.venv)
  PYTHONPATH="${older:-$PWD}" timeout 200 "$PYO" tools/bench_gpu.py "${BENCH[@]}" --model-step-only \
    --json "$OUT/bench_older.json" > "$OUT/bench_older.log" 2>&1 || { status=1; tail -20 "$OUT/bench_older.log"; }
fi
echo
ls "$OUT"/bench_*.json >/dev/null 2>&1 && "$PY" tools/bench_gpu.py --merge "$OUT"/bench_*.json | tee "$OUT/table.txt"
exit $status

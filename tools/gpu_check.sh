#!/usr/bin/env bash
# The one device check to run when a session is lent a GPU (the `device` tool's `run`):
# GPU backends (flex / fla / mamba-ssm / CUDA torch paths) tested against the torch references,
# then the GPU benchmarks. Results go to $OUT (the device tool brings them back).
#
# Carry the pure-Python / cp312 wheels the GPU machine lacks in .whl/ (see the device README):
#   fla-core==0.6.0 (+ flash-linear-attention==0.6.0), hypothesis, einops; mamba-ssm needs a CUDA
#   build for that machine's torch, so its backend is exercised only where it imports.
# Then: run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD" || exit 1
else
  export PYTHONPATH="$PWD"
fi
python3 - <<'PY' | tee "$OUT/backends.txt"
from megatron_tree.ops.backend import module_available
for m in ("triton", "fla.ops.gated_delta_rule", "mamba_ssm", "causal_conv1d", "transformer_engine"):
    print(f"{m:28s} {'yes' if module_available(m) else 'no'}")
PY
timeout 300 python3 -m pytest -q -x tests/test_ops_attention.py tests/test_ops_gdn.py tests/test_ops_ssd.py \
  tests/test_ops_conv.py 2>&1 | tee "$OUT/tests.log" | tail -5
timeout 200 python3 tools/bench_gpu.py --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.log" | tail -40

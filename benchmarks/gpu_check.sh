#!/usr/bin/env bash
# The GPU check, on MLX's CUDA backend: installs mlx with its CUDA 13 build, runs the engine tests, then
# benchmarks/throughput.py against mlx-lm (and benchmarks/speculative.py when a real model is named),
# writing benchmarks/results/cuda/ (and its log, gpu_check.log). Sized for one H200-class GPU within
# 10 minutes: install ~1 min, tests <= 5, the model ~1, throughput <= 2.5 (the timeouts below).
#
#     bash benchmarks/gpu_check.sh [MODEL_DIR]
#
# MODEL_DIR: an mlx-lm model directory; default: a random model of Qwen2.5-0.5B's shape, 4-bit
# (benchmarks/random_model.py): no download, and speed depends on the shape alone. Its answers mean
# nothing, so speculative decoding is measured only on a named model.
# WHEELS=DIR: a machine that reaches no package index installs DIR's wheels instead (no dependencies
# resolved: DIR holds mlx, mlx-cuda-13, mlx-lm and whatever else the machine lacks), into a folder of
# their own on PYTHONPATH, and runs the code from this checkout.
# Where the tests fail, `python -m benchmarks.cuda_probe` finds which op does, each probe in a fresh process.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results/cuda
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export MLX_ENABLE_TF32=0  # full float32 matmuls: parity with mlx-lm is token for token (tests/conftest.py)
PY=${PYTHON:-python3}

if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-check-site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/gpu-check-site:$PWD"
else
    "$PY" -m pip install -q "mlx[cuda13]>=0.32" -e ".[dev]"
fi
"$PY" - <<'PYEOF'
from minivllm.models.backend import detect_backend

backend = detect_backend()
assert backend.is_gpu, f"MLX runs on {backend.name} here, not a GPU: nothing to check"
print("backend:", backend.name)
PYEOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# 1. the engine on the GPU: parity with mlx-lm (each family, long contexts, hybrids), speculative decoding
#    (greedy and sampled exactness, the chi-square test, rollback), overlap, sampling, the attention
#    kernels, the prefix cache, single flight, preemption, the disk tier (tiny models). The Harmony tests
#    (litellm's copy of OpenAI's vocabulary) and the one through the HTTP server run on the CPU host only.
timeout 300 "$PY" -m pytest -q --maxfail=10 -p no:cacheprovider -k "not harmony and not through_the_server" \
    tests/test_engine.py tests/test_speculative.py tests/test_overlap.py tests/test_sampling.py \
    tests/test_paged_attention.py tests/test_families.py tests/test_hybrid.py tests/test_long_context.py \
    tests/test_prefix_cache.py tests/test_single_flight.py tests/test_preemption.py tests/test_kv_disk.py \
    || echo "TESTS FAILED: $?"

# 2. prefill and decode throughput against mlx-lm
MODEL=${1:-}
if [ -z "$MODEL" ]; then
    MODEL=/tmp/gpu-check-qwen2.5-0.5b-shape
    "$PY" -m benchmarks.random_model "$MODEL"
fi
echo "model: $MODEL"
timeout 150 "$PY" -m benchmarks.throughput --model "$MODEL" --runs 3 --out "$RESULTS" --allow-dirty

# 3. speculative decoding off / on against mlx-lm: the edit and free-form workloads at batch 1 and 4
if [ -n "${1:-}" ]; then
    timeout 150 "$PY" -m benchmarks.speculative --model "$MODEL" --runs 2 --out "$RESULTS" --allow-dirty
fi
ls -l "$RESULTS"

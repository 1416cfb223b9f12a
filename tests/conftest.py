import os

# Parity with mlx-lm is checked token for token: keep float32 matmuls in full float32 on GPU backends
# (MLX's CUDA backend defaults to TF32, whose rounding differs between batch shapes).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import minivllm  # noqa: E402, F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import pytest

from tests.reference import MlxLmReference
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """mlx-lm's greedy outputs for the tiny model: what every engine configuration must reproduce."""
    return MlxLmReference(tiny_model_dir)

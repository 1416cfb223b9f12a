import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import pytest

from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))

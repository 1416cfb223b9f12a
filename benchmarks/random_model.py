"""A random model of Qwen2.5-0.5B's shape, 4-bit like the default model, for speed on a machine that
cannot fetch real weights (the GPU check, benchmarks/gpu_check.sh).

    python -m benchmarks.random_model DIR

Speed depends on the shape, not on the weights' values: 24 layers, hidden 896, 14 query and 2 KV heads,
the 151,936-entry vocabulary, quantized by mlx-lm (affine, 4 bits, group 64). Its tokenizer is the tests'
small BPE one (a vocabulary of a few hundred tokens inside the model's), so its answers mean nothing:
measure throughput with it, never quality or speculative acceptance.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import shutil
import tempfile
from pathlib import Path

from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from tests.tiny_model import make_tiny_family_model

QWEN25_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}


def make_random_model(path: str | Path, bits: int = 4, group_size: int = 64, **shape) -> Path:
    """A random qwen2 model of QWEN25_05B's shape (overridden by `shape`), quantized, in path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = make_tiny_family_model(Path(tmp), "qwen2", **(QWEN25_05B | shape))
        model, config = load_model(float_dir)
        model, config = quantize_model(model, config, group_size=group_size, bits=bits)
        save_model(path, model)
        save_config(config, path / "config.json")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(float_dir / name, path / name)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    print(make_random_model(args.dir))


if __name__ == "__main__":
    main()

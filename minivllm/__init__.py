"""minivllm: a small LLM inference engine on MLX with paged KV, prefix caching and single flight."""

from minivllm import backend as _backend  # noqa: F401  (preloads OpenBLAS before mlx.core is imported)
from minivllm.config import EngineConfig
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]

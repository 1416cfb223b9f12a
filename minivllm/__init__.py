"""minivllm: a small LLM inference engine on MLX with paged KV, prefix caching and single flight.

Where a reader looks first: `llm` (LLM.generate), `config` (EngineConfig), `cli` (the engine's commands)
and `replay` (the prefix-cache trace replay). Below them: `engine/` (the step loop), `cache/` (pages and
eviction) and `models/` (architectures, loading, backend). These entry points may import anything in
minivllm and kernels; nothing in minivllm imports server.
"""

from minivllm.models import backend as _backend  # noqa: F401  (preloads OpenBLAS before mlx.core is imported)

# isort: split
from minivllm.cache.hints import CacheHints
from minivllm.config import EngineConfig
from minivllm.engine.sampling_params import SamplingParams, StructuredOutput
from minivllm.llm import LLM, GenerationError

__all__ = ["LLM", "CacheHints", "GenerationError", "EngineConfig", "SamplingParams", "StructuredOutput"]

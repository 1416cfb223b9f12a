"""The OpenAI-compatible HTTP server (`uvicorn server.app:app`) and the `minivllm` command. It may import
minivllm and kernels; minivllm never imports it."""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

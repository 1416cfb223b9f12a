"""Attention kernels: the MLX-ops reference that runs on every backend, and fused kernels only where a test
has run them. It imports MLX and numpy only, nothing of minivllm or server."""

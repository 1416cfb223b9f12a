import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

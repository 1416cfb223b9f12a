"""Scale-out across engine replicas: which replica a request goes to.

`routing` (the prefix-affinity rule, round-robin and least-loaded, over chained page hashes) is the one
rule both the trace replay (`minivllm replay --replicas`) and the live Ray Serve request router
(`server.cluster`) run. Plain Python with no MLX and no Ray: it may import nothing of minivllm.
"""

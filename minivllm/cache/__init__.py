"""The prefix cache: which KV pages exist and which are worth keeping.

`kv_manager` (the one owner of what pages each request holds, prefix restore, publication, release), `page_pool`
(free / in-use / cached pages, refcounts, the chained-hash index), `page_hash` (chained page
hashes) and `eviction` (the eviction policies, the very classes the trace replay runs). Plain Python with
no MLX: it may import nothing of minivllm but itself.
"""

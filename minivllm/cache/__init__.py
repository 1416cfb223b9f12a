"""The prefix cache: which KV pages exist and which are worth keeping.

`kv_manager` (the one owner of what pages each request holds, prefix restore, publication, release), `page_pool`
(free / in-use / cached pages, refcounts, the chained-hash index), `page_hash` (chained page
hashes), `eviction` (the eviction policies, the very classes the trace replay runs), and the disk tier
under the pool: `disk_tier` (the index, budget, writer and reader threads) over `page_file` (one page per
file, with the model's identity and a checksum). Plain Python and numpy with no MLX: it may import nothing
of minivllm but itself and `minivllm.config` (the eviction policies' names).
"""

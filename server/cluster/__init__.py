"""`minivllm serve --replicas N` on Ray Serve: the same OpenAI app as the ingress, N engine replicas each
with its own KV pool, and a request router that sends each prompt where its prefix is cached.

`router` (the Ray Serve RequestRouter around minivllm.cluster.routing), `replica` (one engine replica),
`remote_engine` (the ingress's client of the replicas) and `app` (the deployment graph, the command and the
builder a Ray Serve config imports). Everything here imports Ray; nothing outside this folder imports it
except `server.serve`, lazily, for `--replicas`.
"""

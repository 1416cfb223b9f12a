"""The Ray Serve request router of the engine replicas: prefix affinity by page hashes.

It runs in the ingress process, inside the handle the ingress calls the replicas with. For each request it
hashes the prompt's full pages (the prompt was tokenized once, at the ingress) and asks
`minivllm.cluster.routing.Router`, the rule the trace replay measures, for a ranking of the replicas; Ray
Serve tries them in that order, so a replica at `max_ongoing_requests` passes the request to the next.
A replica that dies is dropped from the ranking and its prefixes route elsewhere from then on.
"""

import logging
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from minivllm.cache.page_hash import extend_page_hashes, root_hash
from minivllm.cluster.routing import Router, RoutingConfig
from server.cluster import router_registry

logger = logging.getLogger(__name__)

_REMEMBERED_CHOICES = 1 << 16  # bound of the requests in flight tracked (past it the oldest count as ended)


class PageHashRouter(RequestRouter):
    def initialize_state(self, page_size: int = 16, **routing) -> None:
        """Called by Ray Serve with RequestRouterConfig.request_router_kwargs."""
        self.page_size = page_size
        self.routing = Router(RoutingConfig(**routing), load="in-flight")
        self.live: dict[str, RunningReplica] = {}  # replaced, never mutated: the ingress reads it
        self._choices: OrderedDict[str, list[str]] = OrderedDict()  # request in flight -> its ranking
        router_registry.register(self._deployment_id.app_name, self._deployment_id.name, self)

    # -- membership ---------------------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        logger.warning("engine replica %s died; routing around it", replica_id.unique_id)
        self._publish()

    def _publish(self) -> None:
        live = {r.replica_id.unique_id: r for r in self.curr_replicas.values()}
        self.routing.set_replicas(live)
        self.live = live

    # -- routing ------------------------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One rank per replica, best first; a request asked about twice keeps its first ranking, so it
        is counted once (in flight on its first choice until Ray Serve reports it completed)."""
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # all ranks full: back off, do not spin
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id
        ranking = self._choices.get(request_id)
        if ranking is None or ranking[0] not in by_name:
            if ranking is not None:  # its first choice is gone: route it afresh
                self.routing.finish(ranking[0])
            self.routing.set_replicas(by_name)
            ranking = self.routing.choose(self.page_keys(pending_request))
            self._choices[request_id] = ranking
            while len(self._choices) > _REMEMBERED_CHOICES:
                self.routing.finish(self._choices.popitem(last=False)[1][0])
        return [[by_name[name]] for name in ranking if name in by_name]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Ray Serve sent the request to replica_id, which may be a later rank than the first (full):
        charge its load there, so that it is that replica's until it completes."""
        super().on_request_routed(pending_request, replica_id, result)
        request_id = pending_request.metadata.internal_request_id
        ranking = self._choices.get(request_id)
        served = replica_id.unique_id
        if ranking is not None and ranking[0] != served:
            self.routing.reassign(self.page_keys(pending_request), ranking[0], served)
            self._choices[request_id] = [served] + [r for r in ranking if r != served]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Ray Serve calls this when a routed request ends, however it ends."""
        super().on_request_completed(replica_id, internal_request_id)
        ranking = self._choices.pop(internal_request_id, None)
        if ranking is not None:
            self.routing.finish(ranking[0])

    def page_keys(self, pending_request: PendingRequest) -> list[bytes]:
        """The chained hashes of the prompt's full pages: the keys the replicas' prefix caches match."""
        prompt = pending_request.kwargs.get("prompt")
        cache = pending_request.kwargs.get("cache")
        keys: list[bytes] = []
        if prompt:
            root = root_hash(getattr(cache, "salt", None))
            extend_page_hashes(keys, prompt, self.page_size, root)
        return keys

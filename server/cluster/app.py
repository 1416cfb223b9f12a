"""The Ray Serve application: the OpenAI app as ingress, N engine replicas behind the page-hash router.

`minivllm serve --replicas N` runs it on a local Ray (or the cluster RAY_ADDRESS names); on a multi-node
cluster, `serve deploy server/cluster/serve_config.yaml` imports `app_builder` from here.
"""

import dataclasses
import logging
import os
import signal

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from minivllm.cluster.routing import RoutingConfig
from server.app import create_app
from server.cluster.remote_engine import RemoteEngine
from server.cluster.replica import EngineReplica
from server.settings import Settings, SettingsError, settings_from_mapping

logger = logging.getLogger(__name__)

APP_NAME = "minivllm"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
ROUTER_CLASS = "server.cluster.router:PageHashRouter"
STATS_PERIOD_S = 1.0  # how often each replica reports its engine stats (routing_stats) to the router
INGRESS_MAX_ONGOING = 4096  # the ingress only forwards: let HTTP requests through, the engines queue


@serve.ingress()
class Ingress:
    async def __init__(self, engines: DeploymentHandle, settings: Settings):
        self.settings = settings
        self.client = await RemoteEngine.connect(engines, settings)

    def __serve_build_asgi_app__(self):
        return create_app(self.settings, self.client)


def build_app(
    settings: Settings, replicas: int, routing: RoutingConfig, cpus_per_replica: float = 1.0
) -> Application:
    """The deployment graph. Each replica admits up to max_num_seqs + max_waiting requests (its engine's
    own bound, answered with 429 past it), so Ray Serve only passes a request on when that is reached."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={"page_size": settings.page_size, **dataclasses.asdict(routing)},
        request_routing_stats_period_s=STATS_PERIOD_S,
        request_routing_stats_timeout_s=10 * STATS_PERIOD_S,
    )
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT,
        num_replicas=replicas,
        max_ongoing_requests=settings.max_num_seqs + settings.max_waiting,
        ray_actor_options={"num_cpus": cpus_per_replica},
        request_router_config=router,
    )
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT, max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(engine.bind(settings), settings)


def app_builder(args: dict) -> Application:
    """For Ray Serve configs: `args` holds `replicas`, `routing`, `cpus_per_replica` and `settings`, a
    mapping of setting names (as in `minivllm serve --help`, e.g. kv_cache_bytes: 2G) to values."""
    args = dict(args)
    try:
        settings = settings_from_mapping(args.pop("settings", None) or {})
    except SettingsError as e:
        raise ValueError(f"settings: {e}") from None
    replicas = int(args.pop("replicas", 1))
    routing = RoutingConfig(policy=args.pop("routing", "affinity"))
    cpus = float(args.pop("cpus_per_replica", 1.0))
    if args:
        raise ValueError(f"unknown application args: {', '.join(sorted(args))}")
    return build_app(settings, replicas, routing, cpus)


def cpus_per_replica(total_cpus: float, replicas: int) -> float:
    """An even share of the cluster's CPUs (Ray accepts fractions only below 1)."""
    share = total_cpus / replicas
    return float(int(share)) if share >= 1 else share


def run(settings: Settings, replicas: int, routing: RoutingConfig, host: str, port: int) -> int:
    """`minivllm serve --replicas N`: start (or join, with RAY_ADDRESS) Ray, serve until interrupted
    (Ctrl-C or SIGTERM), then shut Serve and Ray down."""
    import ray

    signal.signal(signal.SIGTERM, _interrupt)
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address, num_cpus=None if address else os.cpu_count(), include_dashboard=False)
    try:
        cpus = cpus_per_replica(ray.cluster_resources().get("CPU", 1.0), replicas)
        serve.start(http_options={"host": host, "port": port})
        logger.info(
            "serving on http://%s:%d with %d replicas, %s routing", host, port, replicas, routing.policy
        )
        serve.run(
            build_app(settings, replicas, routing, cpus), name=APP_NAME, route_prefix="/", blocking=True
        )
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # the same clean shutdown as Ctrl-C

"""`minivllm serve`: the server's settings as flags, then uvicorn on the app; with `--replicas N`, the same
app in front of N engine replicas on Ray Serve (Ray is imported only then)."""

import argparse
import logging
import sys

import uvicorn

from minivllm.cluster.routing import ROUTINGS, RoutingConfig
from server.app import create_app
from server.connections import uvicorn_config
from server.settings import OPTIONS, SettingsError, add_serve_arguments, settings_from_args

CONNECTION_OPTIONS = [
    o for o in OPTIONS if o.name in ("max_connections", "header_timeout", "keepalive_timeout")
]  # the body timeout is the app's own: it holds behind Ray Serve's proxy too


def serve_main(argv: list[str] | None = None) -> int:
    """Parse flags, validate, run uvicorn on the app (or Ray Serve). Returns the exit status."""
    parser = argparse.ArgumentParser(prog="minivllm serve", description="OpenAI-compatible minivllm server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--replicas",
        type=int,
        help="serve with this many engine replicas on Ray Serve (needs the ray extra); default: one process",
    )
    parser.add_argument(
        "--routing", choices=ROUTINGS, help="with --replicas: how requests pick a replica (default affinity)"
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as e:
        print(f"minivllm serve: error: {e}", file=sys.stderr)
        return 2
    if args.replicas is None and args.routing is not None:
        print("minivllm serve: error: --routing needs --replicas", file=sys.stderr)
        return 2
    if args.replicas is not None and args.replicas < 1:
        print("minivllm serve: error: --replicas must be >= 1", file=sys.stderr)
        return 2
    if args.replicas is not None and len(settings.models) > 1:
        print("minivllm serve: error: --replicas serves one model", file=sys.stderr)
        return 2
    changed = [o.env for o in CONNECTION_OPTIONS if getattr(settings, o.name) != o.default]
    if args.replicas is not None and changed:
        print(
            f"minivllm serve: error: {', '.join(changed)} set the single-process server's connections; with "
            "--replicas Ray Serve's proxy takes them",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.replicas is None:
        app = create_app(settings)
        config = uvicorn_config(app, settings, host=args.host, port=args.port, log_level=settings.log_level)
        uvicorn.Server(config).run()
        return 0
    try:
        from server.cluster.app import run
    except ImportError as e:
        print(
            f"minivllm serve: error: --replicas needs Ray Serve: pip install 'minivllm[ray]' ({e})",
            file=sys.stderr,
        )
        return 2
    routing = RoutingConfig(policy=args.routing or "affinity")
    return run(settings, args.replicas, routing, args.host, args.port)


if __name__ == "__main__":
    sys.exit(serve_main())

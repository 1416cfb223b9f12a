"""`minivllm serve`: the server's settings as flags, then uvicorn on the app."""

import argparse
import logging
import sys

import uvicorn

from server.app import create_app
from server.settings import SettingsError, add_serve_arguments, settings_from_args


def serve_main(argv: list[str] | None = None) -> int:
    """Parse flags, validate, run uvicorn on the app. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="minivllm serve", description="OpenAI-compatible minivllm server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as e:
        print(f"minivllm serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=settings.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())

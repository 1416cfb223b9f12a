"""The `minivllm` command: the engine's commands (generate, convert, replay, from minivllm.cli), `serve`
and `launch` (a coding agent against the server), which live here because they need the server (minivllm
never imports server)."""

import sys

from minivllm import cli
from server.launch import launch_main
from server.serve import serve_main

COMMANDS = {**cli.COMMANDS, "serve": serve_main, "launch": launch_main}


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())

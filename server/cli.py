"""The `minivllm` command: the engine's commands (generate, convert, replay, from minivllm.cli) and
`serve`, which lives here because it needs the server (minivllm never imports server)."""

import sys

from minivllm import cli
from server.serve import serve_main

COMMANDS = {**cli.COMMANDS, "serve": serve_main}


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())

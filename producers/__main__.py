"""``python -m producers [--config FILE] [produce options]`` runs the rollout worker;
``python -m producers serve ...`` runs the engine server."""

import sys

from producers.cli import cli


def _with_default_command(args: list[str]) -> list[str]:
    """Insert ``produce`` when no command is named (after a leading ``--config FILE``)."""
    if {"produce", "serve", "-h", "--help"} & set(args):
        return args
    head: list[str] = []
    if args[:1] == ["--config"]:
        head, args = args[:2], args[2:]
    elif args[:1] and args[0].startswith("--config="):
        head, args = args[:1], args[1:]
    return [*head, "produce", *args]


if __name__ == "__main__":
    cli.main(args=_with_default_command(sys.argv[1:]), prog_name="python -m producers")

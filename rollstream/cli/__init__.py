"""The ``rollstream`` command line: the root group and the role commands, each loaded only
when it is invoked, so ``rollstream --help`` never imports torch."""

from rollstream.cli.main import main

__all__ = ["main"]

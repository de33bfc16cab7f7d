"""``python -m rollstream`` is the ``rollstream`` command."""

from rollstream.cli import main

main()

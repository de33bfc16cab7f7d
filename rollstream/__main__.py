"""``python -m rollstream`` is the ``rollstream`` command."""

from rollstream.cli.main import main

main()

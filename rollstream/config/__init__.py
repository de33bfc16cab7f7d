"""The one configuration every command resolves: the file, the environment, ``--set``, the
profiles and policies laid under them, and where a run made by ``up`` keeps its files."""

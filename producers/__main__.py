"""``python -m producers [--config FILE] [produce options]`` runs the rollout worker
(``rollstream produce``); ``python -m producers serve ...`` runs the engine server
(``rollstream serve``)."""

import sys

from core.process import exec_role_command

if __name__ == "__main__":
    args = sys.argv[1:]
    named = next((a for a in args if a in ("produce", "serve")), None)
    if named is not None:
        args.remove(named)
    exec_role_command(named or "produce", args)

"""``python -m streams [--config FILE] [stream options]``: a stream worker
(``rollstream stream``)."""

import sys

from core.process import exec_role_command

if __name__ == "__main__":
    exec_role_command("stream", sys.argv[1:])

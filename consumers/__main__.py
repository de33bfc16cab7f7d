"""``python -m consumers [--config FILE] [train options]``: the trainer role
(``rollstream train``)."""

import sys

from core.process import exec_role_command

if __name__ == "__main__":
    exec_role_command("train", sys.argv[1:])

"""A weight-plane process that SIGKILLs itself at a chosen point, for the crash tests.

``python weights_crash.py mirror CONFIGS RUN VERSION``: mirror region A -> B from version 0
on, dying once every file of ``VERSION`` is in B but before its manifest is claimed.
``python weights_crash.py follow CONFIGS RUN VERSION``: a follower in B rebuilds
``VERSION`` (downloaded, applied, checked) and dies as it hands the snapshot over.
``CONFIGS`` is a JSON file: ``{"a": S3Config, "b": S3Config}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from core.config import S3Config
from weights.follower import Snapshot, WeightFollower
from weights.mirror import mirror_once
from weights.store import WeightStore
from weights.trust import Trust


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    what, configs_file, run, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    configs = {
        k: S3Config.model_validate(v) for k, v in json.loads(configs_file.read_text()).items()
    }
    src, dst = (WeightStore.from_config(configs[k], run) for k in ("a", "b"))
    if what == "mirror":
        claim = dst.claim

        def claim_or_die(claimed: int, manifest: bytes) -> str:
            if claimed == version:
                _die()
            return claim(claimed, manifest)

        dst.claim = claim_or_die  # type: ignore[method-assign]
        mirror_once(src, dst, since=0, trust=Trust(None))
    elif what == "follow":

        def hand_over(snapshot: Snapshot) -> None:
            if snapshot.version == version:
                _die()

        WeightFollower(dst, on_version=hand_over).sync(version)
    raise SystemExit(f"{what}: the kill at v{version} was never reached")


if __name__ == "__main__":
    main()

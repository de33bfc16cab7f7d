"""``python -m consumers.prebuild``: build (or check) the DeepSpeed ops a trainer loads,
once, so the first trainer starts fast (run by ``infra/dev.sh install``)."""

from __future__ import annotations

import logging

from consumers.build_lock import extensions_root
from consumers.config import EngineConfig
from consumers.train_engine import init_distributed, shutdown_distributed


def main() -> None:
    """Initialise ``deepspeed.comm`` once under the build lock, then tear it down."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    accelerator = init_distributed(EngineConfig())
    shutdown_distributed(together=False)
    print(f"DeepSpeed ops ready for {accelerator} under {extensions_root()}")


if __name__ == "__main__":
    main()

"""A run's weight stores, as the ``weights`` and ``export`` commands reach them.

``WeightsContext`` holds the resolved config, its ``[weights]`` section, the run and the
region; the stores and the verifying follower are built from it when a command needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import S3Config, WeightsConfig
from rollstream.config.settings import RollstreamConfig, load_config


@dataclass(frozen=True)
class WeightsContext:
    """Everything a ``weights`` subcommand needs to reach a run's stores."""

    config: RollstreamConfig
    weights: WeightsConfig
    run: str
    region: str

    def s3(self, region: str | None = None) -> S3Config:
        home = self.config.s3
        if home.starts_embedded:  # fill in the embedded store's address and credentials
            from infra.services import Services

            home = Services(self.config).running(kafka=False).s3
        return self.weights.region(region or self.region, home)

    def trusted(self) -> WeightsConfig:
        """``[weights]`` with the state dir's key pair filled in when it names none."""
        from infra.services import Services

        return Services(self.config).resolved().weights

    def store(self, region: str | None = None) -> Any:
        from weights.store import WeightStore

        return WeightStore.from_config(self.s3(region), self.run, self.config.policy)

    def follower(self) -> Any:
        """A follower of the region's store that verifies as every role's does."""
        from weights.follower import WeightFollower

        return WeightFollower.from_config(self.store(), self.trusted())


def load_settings(
    path: Path | None, policy: str | None = None
) -> tuple[RollstreamConfig, WeightsConfig]:
    """The run's config (``policy``'s view in a multi-policy run) and its ``[weights]``
    section from one TOML file."""
    config = load_config(path, policy=policy)
    return config, config.weights

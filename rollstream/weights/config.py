"""Configuration of weight publishing, following, mirroring and retention.

``WeightsConfig`` lives in ``rollstream.config`` (the ``[weights]`` section of the one
config file); it is re-exported here for the weights modules. Regions other than the home
store (the top-level ``[s3]`` section) are ``[weights.regions.<name>]`` tables with the
same keys as ``[s3]``.
"""

from rollstream.config import WeightsConfig

__all__ = ["WeightsConfig"]

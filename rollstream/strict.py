"""The one base class of every config section: unknown keys are errors, instances frozen.

Its own module (pydantic only) so the role packages' config modules can share it while
``rollstream.config`` imports them, without an import cycle.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base for config sections: unknown keys are rejected, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

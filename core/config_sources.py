"""Where a configuration comes from, and the errors that say so: the ``--set`` overrides,
``ROLLSTREAM_*`` variables, the well-known Kafka and S3 variables and the TOML file
(earlier ones winning) are each read once (``read_sources``), the result is validated
once, and every refused value is named with its key and source. The sections themselves
are ``core.config``'s."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
)
from pydantic_settings.exceptions import SettingsError

from core.config import ConfigurationError, merge_tables

SettingsT = TypeVar("SettingsT", bound=BaseSettings)


class WellKnownEnvSource(PydanticBaseSettingsSource):
    """Standard variables that users of Kafka and S3 tools already set:
    ``KAFKA_BOOTSTRAP_SERVERS`` and ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # the whole mapping comes from __call__

    def __call__(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        if servers := os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
            found["kafka"] = {"bootstrap_servers": servers}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            found["s3"] = {"endpoint_url": endpoint}
        return found


NOT_SETTINGS = frozenset(
    {
        "ROLLSTREAM_CONFIG",  # the file itself (--config)
        "ROLLSTREAM_TEST_BOOTSTRAP",  # the test suite reuses a running broker
        "ROLLSTREAM_TEST_S3_ENDPOINT",  # ... and S3 server
        "ROLLSTREAM_UP_STEPS",  # infra/dev.sh run
        "ROLLSTREAM_VENV",  # infra/dev.sh
    }
)
"""``ROLLSTREAM_*`` variables that are not settings; every other one must name a setting.
Failpoints (``ROLLSTREAM_<ROLE>_FAILPOINT``) are tests' switches and are allowed too."""


class InvalidConfigError(ConfigurationError):
    """A value refused by the config models, each named by its key and where it came from
    (the file and line, the variable, or ``--set``)."""


class Layer(NamedTuple):
    """One source's explicit values and the name an error gives it."""

    name: str
    values: dict[str, Any]
    text: str | None = None  # a file's text, for the line of a key

    def where(self, key: Sequence[str]) -> str:
        """Where this source sets ``key``: the file and line, or the variable."""
        if self.text is not None:
            line = _toml_line(self.text, list(key))
            return f"{self.name}:{line}" if line else self.name
        if self.name == ENVIRONMENT:
            env = {name.upper(): name for name in os.environ}
            for depth in range(len(key), 0, -1):
                name = "ROLLSTREAM_" + "__".join(key[:depth]).upper()
                if name in env:
                    return env[name]
        return self.name


ENVIRONMENT = "ROLLSTREAM_* variables"
"""The name of the ``ROLLSTREAM_*`` variables' layer."""


@dataclasses.dataclass(frozen=True)
class Sources:
    """A process's configuration sources, each read once (the TOML file parsed once),
    highest precedence first: ``--set`` overrides, ``ROLLSTREAM_*`` variables, the
    well-known Kafka/S3 variables, the file. Kept as layers so a check can tell which
    source set a key (``rollstream.config.shared``) and an error can say where."""

    layers: tuple[Layer, ...]
    path: Path | None = None
    text: str | None = None

    @property
    def overrides(self) -> dict[str, Any]:
        return self.layers[0].values

    def merged(self) -> dict[str, Any]:
        """Every layer's values, higher ones laid over lower ones key by key."""
        values: dict[str, Any] = {}
        for layer in reversed(self.layers):
            values = merge_tables(values, layer.values)
        return values

    def validate(self, model: type[SettingsT], values: Mapping[str, Any]) -> SettingsT:
        """``model`` validated once from ``values`` (these sources' values, maybe with
        more laid under or over them), every refused value named with its key and the
        source it came from (``InvalidConfigError``)."""
        try:
            return from_values(model, values)
        except ValidationError as err:
            lines = [
                _describe(error, self.overrides, self.path, self.text) for error in err.errors()
            ]
            raise InvalidConfigError(
                f"invalid configuration ({len(lines)} error(s)):\n" + "\n".join(lines)
            ) from err


def from_values(model: type[SettingsT], values: Mapping[str, Any]) -> SettingsT:
    """``model`` validated once from ``values`` alone: no environment read again (the
    resolver read it once, in ``read_sources``)."""
    data = dict(values)
    return model(_build_sources=((InitSettingsSource(model, init_kwargs=data),), data))


def read_sources(
    model: type[BaseModel], path: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Sources:
    """Read ``model``'s sources once: explicit ``overrides`` (e.g. ``--set``),
    ``ROLLSTREAM_*`` variables (nested with ``__``), the well-known Kafka/S3 variables,
    the TOML file at ``path``. A TOML syntax error names its file and line, an unknown
    ``ROLLSTREAM_*`` variable its name (and the setting it was probably meant to be)."""
    check_environment(model)
    settings = cast("type[BaseSettings]", model)
    try:
        environment = EnvSettingsSource(settings)()
    except SettingsError as err:  # a variable's value that is not valid JSON for its table
        raise ConfigurationError(f"{err} (check the ROLLSTREAM_* variables)") from None
    layers = [
        Layer("--set", dict(overrides or {})),
        Layer(ENVIRONMENT, environment),
        Layer("KAFKA_BOOTSTRAP_SERVERS / AWS_ENDPOINT_URL", WellKnownEnvSource(settings)()),
    ]
    text = None
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        try:
            layers.append(Layer(str(path), tomllib.loads(text), text))
        except tomllib.TOMLDecodeError as err:
            raise ConfigurationError(f"{path}:{_toml_error_line(err, text)}: {err}") from None
    return Sources(tuple(layers), path, text)


def check_environment(model: type[BaseModel]) -> None:
    """Refuse a ``ROLLSTREAM_*`` variable that names no setting of ``model`` (a misspelt
    one would otherwise be ignored without a word), suggesting the closest that does."""
    exact, open_tables = _env_names(model, "ROLLSTREAM_")
    unknown = []
    for name in os.environ:
        upper = name.upper()
        if not upper.startswith("ROLLSTREAM_") or upper in NOT_SETTINGS:
            continue
        if upper.endswith("_FAILPOINT") or upper in exact:
            continue
        if any(upper.startswith(table) for table in open_tables):
            continue
        close = difflib.get_close_matches(upper, sorted(exact), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        unknown.append(f"{name}{hint}")
    if unknown:
        raise ConfigurationError(
            f"unknown variable(s) {', '.join(unknown)}: ROLLSTREAM_* variables name a "
            "setting, nested with '__' (ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS)"
        )


def _env_names(model: type[BaseModel], prefix: str) -> tuple[set[str], set[str]]:
    """Every variable name that sets a field of ``model`` (a table, or one of its keys),
    and the prefixes under which any key is a setting (``dict`` tables)."""
    exact: set[str] = set()
    open_tables: set[str] = set()
    for name, field in model.model_fields.items():
        env = prefix + name.upper()
        exact.add(env)
        nested = _models_in(field.annotation)
        if nested:
            for sub in nested:
                more, opened = _env_names(sub, env + "__")
                exact |= more
                open_tables |= opened
        elif _is_mapping(field.annotation):
            open_tables.add(env + "__")
    return exact, open_tables


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds (``X | None``, a union of loss tables, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (dict, Mapping):
        return []
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _is_mapping(annotation: Any) -> bool:
    if get_origin(annotation) in (dict, Mapping) or annotation is dict:
        return True
    return any(_is_mapping(arg) for arg in get_args(annotation))


def _toml_error_line(err: tomllib.TOMLDecodeError, text: str) -> int:
    """The line of a syntax error (tomllib says "(at line L, column C)" or "at end of
    document")."""
    found = re.search(r"at line (\d+)", str(err))
    return int(found.group(1)) if found else max(1, text.count("\n") + 1)


def _describe(error: Any, init: Mapping[str, Any], path: Path | None, text: str | None) -> str:
    """One refused value: its key, what is wrong, and the source it came from."""
    loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
    key = ".".join(loc) or "(the whole file)"
    where = _source_of(loc, init, path, text)
    got = f" (got {error['input']!r})" if error["type"] != "missing" and loc else ""
    return f"  {key}: {error['msg']}{got}" + (f" [{where}]" if where else "")


def _source_of(
    loc: list[str], init: Mapping[str, Any], path: Path | None, text: str | None
) -> str | None:
    """Where the value at ``loc`` came from, the winning source first."""
    node: Any = init
    for part in loc:
        if not isinstance(node, Mapping) or part not in node:
            break
        node = node[part]
    else:
        if loc:
            return "--set"
    env = {name.upper(): name for name in os.environ}
    for depth in range(len(loc), 0, -1):
        name = "ROLLSTREAM_" + "__".join(loc[:depth]).upper()
        if name in env:
            return f"from {env[name]}"
    if path is not None and text is not None:
        line = _toml_line(text, loc)
        return f"{path}:{line}" if line else str(path)
    return None


def _toml_line(text: str, loc: list[str]) -> int | None:
    """The line of ``loc``'s key in TOML ``text``: ``key =`` under its ``[table]`` (or a
    dotted key), else its table's header; ``None`` if neither is written there."""
    table: list[str] = []
    header_line = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if header := re.fullmatch(r"\[\[?\s*([^\]]+?)\s*\]\]?", line):
            table = [part.strip().strip('"') for part in header.group(1).split(".")]
            if table == loc[: len(table)] and header_line is None:
                header_line = number
            continue
        assigned = re.match(r"([A-Za-z0-9_.\"' -]+?)\s*=", line)
        if assigned:
            key = [part.strip().strip("\"'") for part in assigned.group(1).split(".")]
            if table + key == loc[: len(table) + len(key)] and len(table) + len(key) <= len(loc):
                return number
    return header_line

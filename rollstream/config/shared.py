"""Settings every role must agree on, declared once in ``[profile]`` and propagated into
the role sections, with a check for disagreement (prime-rl's shared settings):

- the staleness window, ``[profile] staleness_window`` (0 with ``sync``): the producers'
  admission credit and the stream's and the trainer's ``max_staleness``;
- the model spec, ``[profile] model``: the engine, the old-logit service, the trainer;
- the precision, ``[profile] precision`` (``bf16`` or ``fp32``; ``auto`` decides per
  machine): the engine's and the old-logit service's dtype, the trainer's ``bf16``.

A role's key that no source sets takes the declared value. A source that sets a role's key
to another value than a declaration in the same source, or in a source that wins over it,
is refused with both keys named; a role's key set in a source that wins over the
declaration (``--set`` over the file) is an override, as the order of sources says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.config import ConfigurationError, merge_tables
from core.config_sources import Layer
from core.models import canonical_model_spec
from rollstream.config.profiles import ProfileConfig, profile_sections

KeyPath = tuple[str, ...]
"""A key by its parts: ("streams", "staleness", "max_staleness")."""


def _agrees(given: Any, wanted: Any) -> bool:
    """A source's raw value (a variable's is a string) against the declared one."""
    try:
        if isinstance(wanted, bool):
            flag = {"true": True, "false": False}.get(str(given).strip().lower())
            return flag is None or flag == wanted  # not a flag: validation refuses it
        if isinstance(wanted, int):
            return int(given) == wanted
    except (TypeError, ValueError):
        return True  # not a number: validation refuses it, naming its source
    return str(given).strip() == wanted


@dataclass(frozen=True)
class SharedSetting:
    """One shared setting: the ``[profile]`` keys that declare it, and the role keys it
    propagates into, each with the value the declaration gives it."""

    declared_by: tuple[str, ...]  # keys of [profile]
    roles: Mapping[KeyPath, Callable[[ProfileConfig], Any]]
    same: Callable[[Any, Any], bool] = _agrees

    def declared(self, profile: Any) -> bool:
        """Whether a source's ``[profile]`` table declares this setting (a value that is no
        table declares nothing: validation refuses it)."""
        if not isinstance(profile, Mapping):
            return False
        return any(key in profile and profile[key] != "auto" for key in self.declared_by)


def _same_model(given: Any, wanted: Any) -> bool:
    try:
        return canonical_model_spec(str(given)) == wanted
    except ValueError:
        return True  # not a model spec: validation refuses it, naming its source


def _dtype(profile: ProfileConfig) -> str:
    return "bfloat16" if profile.resolved_precision == "bf16" else "float32"


SHARED: dict[str, SharedSetting] = {
    "staleness_window": SharedSetting(
        ("staleness_window", "sync"),
        {
            ("producers", "rollout", "staleness_window"): lambda p: p.window,
            ("streams", "staleness", "max_staleness"): lambda p: p.window,
            ("trainer", "staleness", "max_staleness"): lambda p: p.window,
        },
    ),
    "model": SharedSetting(
        ("model",),
        {
            ("producers", "engine", "model"): lambda p: p.model,
            ("streams", "old_logits", "model"): lambda p: p.model,
            ("trainer", "model", "spec"): lambda p: p.model,
        },
        _same_model,
    ),
    "precision": SharedSetting(
        ("precision",),
        {
            ("producers", "engine", "dtype"): _dtype,
            ("streams", "old_logits", "dtype"): _dtype,
            ("trainer", "engine", "bf16"): lambda p: p.resolved_precision == "bf16",
        },
    ),
}
"""Each shared setting by name; its role keys are what ``rollstream config --role`` shows
each role receiving."""


def shared_sections(profile: ProfileConfig, only_declared: bool = False) -> dict[str, Any]:
    """The role keys of every shared setting, as ``profile`` gives them (``only_declared``:
    of the settings its source declared, as profile ``none`` propagates them)."""
    sections: dict[str, Any] = {}
    for setting in SHARED.values():
        if only_declared and not setting.declared(
            profile.model_dump(include=profile.model_fields_set)
        ):
            continue
        for path, value in setting.roles.items():
            node = sections
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value(profile)
    return sections


def check_shared(layers: Sequence[Layer], profile: ProfileConfig) -> None:
    """Refuse a role key that contradicts a shared setting declared in the same source or
    in one that wins over it (``layers``: highest precedence first; ``profile``: the
    declaration in force)."""
    for name, setting in SHARED.items():
        declared_in = _first(layers, lambda values, s=setting: s.declared(values.get("profile")))
        if declared_in is None:
            continue
        for path, value in setting.roles.items():
            set_in = _first(layers, lambda values, p=path: _get(values, p) is not _MISSING)
            if set_in is None or set_in < declared_in:
                continue  # filled from the declaration, or overridden by a winning source
            given, wanted = _get(layers[set_in].values, path), value(profile)
            if not setting.same(given, wanted):
                declaring = layers[declared_in]
                key = next(k for k in setting.declared_by if k in declaring.values["profile"])
                raise ConfigurationError(
                    f"{'.'.join(path)} = {given!r} ({layers[set_in].where(path)}) contradicts "
                    f"profile.{key} = {declaring.values['profile'][key]!r} "
                    f"({declaring.where(('profile', key))}), which gives every role "
                    f"{name} = {wanted!r}: set one of them, or the same value in both (a "
                    "role's own value may differ only from a source that wins, e.g. --set)"
                )


_MISSING = object()


def _get(values: Mapping[str, Any], path: KeyPath) -> Any:
    node: Any = values
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _first(layers: Sequence[Layer], holds: Callable[[dict[str, Any]], bool]) -> int | None:
    return next((i for i, layer in enumerate(layers) if holds(layer.values)), None)


def derived_sections(profile: ProfileConfig) -> dict[str, Any]:
    """Everything ``profile`` gives the roles: its profile's settings and the shared
    settings (profile ``none``: only the shared settings its source declares)."""
    only_declared = profile.resolved_name == "none"
    return merge_tables(profile_sections(profile), shared_sections(profile, only_declared))

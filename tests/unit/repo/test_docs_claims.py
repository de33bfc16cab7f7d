"""What README.md and docs/*.md name, checked against the code (unit tier: no service).

- every config key a doc names (`[section] key`, `[section]`, a dotted `section.key`,
  `--set key=...`, `ROLLSTREAM_SECTION__KEY`) exists in ``RollstreamConfig``;
- a default a doc states (the `[weights]` settings table, `` `[section] key` (default X`` in
  prose) equals the model's default, and a key a profile changes says so;
- every `rollstream ...` command line (in code spans and code blocks) names commands that
  exist, with options of the command (or group) they follow;
- the claims "every field has a description", the sections table's models, the dead-letter
  reasons and the role shims' options.
- docs/architecture.md's module tables: one per package, naming every module and
  sub-package of the tree and nothing else.

A failure names the doc, the line, the claim and what the code says.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from support.paths import REPO

from rollstream.cli.main import main
from rollstream.config.profiles import ProfileConfig
from rollstream.config.settings import RollstreamConfig
from rollstream.config.shared import derived_sections

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```")


@dataclass(frozen=True)
class Text:
    """One piece of a doc: a code span or a code-block line, where it is."""

    doc: str
    line: int
    text: str
    in_block: bool  # a line of a fenced code block (else a code span in prose)

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _pieces(path: Path) -> list[Text]:
    name = str(path.relative_to(REPO))
    out: list[Text] = []
    in_block = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line.strip()):
            in_block = not in_block
            continue
        if in_block:
            out.append(Text(name, number, line, True))
        else:
            out += [Text(name, number, m.group(1), False) for m in SPAN.finditer(line)]
    return out


PIECES = [piece for path in DOCS for piece in _pieces(path)]
SPANS = [piece for piece in PIECES if not piece.in_block]


# --- the config model ----------------------------------------------------------------------


def _inner(annotation: Any) -> Any:
    """The model (or dict/list of models) behind an annotation: ``X | None`` -> X."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _inner(args[0]) if len(args) == 1 else annotation
    if origin is typing.Annotated:
        return _inner(typing.get_args(annotation)[0])
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds: one, or each member of a union (`[trainer.loss]`)."""
    annotation = _inner(annotation)
    if _is_model(annotation):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [_inner(a) for a in typing.get_args(annotation)]
        if members and all(_is_model(m) for m in members):
            return members
    return []


def resolve(parts: list[str]) -> tuple[list[type[BaseModel]], FieldInfo | None]:
    """The models a dotted config path names (a section) and the field it ends at.

    ``<name>`` (or any word) stands for a key of a table of tables (`weights.regions.eu`),
    an array of tables (`[[streams.operators]]`) is entered as its item's model, a union of
    models (the loss types) as any of them, and a `policies.<name>` table holds the whole
    file's layout again. ``LookupError`` names what does not exist."""
    models: list[type[BaseModel]] = [RollstreamConfig]
    field: FieldInfo | None = None
    index = 0
    while index < len(parts):
        part = parts[index]
        if not models:
            raise LookupError(f"{'.'.join(parts[:index])} is a value, not a table")
        owners = [m for m in models if part in m.model_fields]
        if not owners:
            known = ", ".join(sorted({k for m in models for k in m.model_fields}))
            names = " | ".join(m.__name__ for m in models)
            raise LookupError(
                f"{names} has no key {part!r} (path {'.'.join(parts)}); its keys: {known}"
            )
        field = owners[0].model_fields[part]
        annotation = _inner(field.annotation)
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        index += 1
        if owners[0] is RollstreamConfig and part == "policies":
            index += 1  # the policy's name; its table has the whole file's layout
            models = [RollstreamConfig]
            continue
        if origin is dict and _models(args[1]):
            models = _models(args[1])
            index += 1  # the table's own key (a region's name)
            continue
        if origin is list and args and _models(args[0]):
            models = _models(args[0])
            continue
        models = [m for owner in owners for m in _models(owner.model_fields[part].annotation)]
    return models, field


SECTIONS = {
    name
    for name, field in RollstreamConfig.model_fields.items()
    if _is_model(_inner(field.annotation))
}


def _is_module_path(dotted: str) -> bool:
    """Whether a prefix of ``dotted`` (two names or more) is a module of this repository."""
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        base = REPO.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


SECTION_SPAN = re.compile(
    r"^\[\[?(?P<path>[A-Za-z0-9_.<>-]+)\]\]?(?:\s+(?P<key>[a-z_][a-z0-9_]*))?(?:\s*=.*)?$"
)
DOTTED_SPAN = re.compile(r"^(?P<path>[a-z_][a-z0-9_]*(?:\.[a-z0-9_<>]+)+)(?:\s*=.*)?$")
FILE_NAME = re.compile(r"\.(py|jsonl?|toml|md|png|html|log|lock|parquet)$")
SET_ASSIGNMENT = re.compile(r"--set[ =](?P<path>[a-z_][a-z0-9_.]*)=")
ENV_KEY = re.compile(r"\bROLLSTREAM_(?P<path>[A-Z0-9]+(?:_[A-Z0-9]+)*__[A-Z0-9_]+)\b")


def config_key_claims() -> list[tuple[Text, list[str]]]:
    """Every config key or section the docs name, as a path into ``RollstreamConfig``."""
    claims: list[tuple[Text, list[str]]] = []
    for piece in SPANS:
        text = piece.text.strip()
        if (
            (m := SECTION_SPAN.match(text))
            and not text.startswith("[tool.")  # pyproject's
            and not m.group("path").isupper()  # a model's marker token: [TOOL_CALLS], [INST]
        ):
            path = m.group("path").split(".")
            claims.append((piece, path + ([m.group("key")] if m.group("key") else [])))
        elif (
            (m := DOTTED_SPAN.match(text))
            and text.split(".")[0] in SECTIONS
            and not _is_module_path(m.group("path"))
            and not FILE_NAME.search(m.group("path"))
        ):
            claims.append((piece, m.group("path").split(".")))
    for piece in PIECES:
        for m in SET_ASSIGNMENT.finditer(piece.text):
            claims.append((piece, m.group("path").split(".")))
        for m in ENV_KEY.finditer(piece.text):
            claims.append((piece, m.group("path").lower().split("__")))
    return claims


def test_the_docs_name_config_keys_that_exist() -> None:
    claims = config_key_claims()
    assert len(claims) > 80, "the parser found the docs' config keys"
    wrong = []
    for piece, path in claims:
        try:
            resolve(path)
        except LookupError as err:
            wrong.append(f"{piece.where()}: `{piece.text.strip()}`: {err}")
    assert not wrong, "config keys the docs name but the code lacks:\n" + "\n".join(wrong)


# --- defaults --------------------------------------------------------------------------------


def _profile_keys() -> set[str]:
    """Dotted keys the profiles set (both of them), which then differ from the model."""
    keys: set[str] = set()

    def walk(table: dict[str, Any], prefix: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                keys.add(prefix + key)

    for profile in (ProfileConfig(), ProfileConfig(model="smollm2", precision="fp32")):
        walk(derived_sections(profile), "")
    return keys


PROFILE_KEYS = _profile_keys()


def _same(stated: str, default: Any) -> bool:
    stated = stated.strip().strip("`").strip()
    if stated.lower() in ("none", "empty", "null", "unset"):
        return default in (None, {}, [], "")
    if isinstance(default, bool):
        return stated.lower() == str(default).lower()
    if isinstance(default, int | float):
        try:
            return float(stated.replace(",", "").replace("_", "")) == float(default)
        except ValueError:
            return False
    return stated == str(default)


def _default(field: FieldInfo) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    return field.default_factory() if field.default_factory else PydanticUndefined


def default_claims() -> list[tuple[str, int, list[str], str, str]]:
    """(doc, line, key path, stated default, the rest of the sentence or row)."""
    claims = []
    weights = REPO / "docs" / "weights-format.md"
    lines = weights.read_text().splitlines()
    start = lines.index("## Settings")
    row = re.compile(r"^\| `(?P<key>[a-z_]+)` \| (?P<default>[^|]+) \| (?P<what>[^|]+) \|$")
    for number, line in enumerate(lines[start:], start=start + 1):
        if line.startswith("## ") and number > start + 1:
            break
        if m := row.match(line):
            claims.append(
                (
                    "docs/weights-format.md",
                    number,
                    ["weights", m.group("key")],
                    m.group("default"),
                    m.group("what"),
                )
            )
    prose = re.compile(
        r"`\[(?P<section>[a-z_.]+)\] (?P<key>[a-z_]+)`\s+\(default (?P<rest>[^)]*)\)"
    )
    for path in DOCS:
        text = path.read_text()
        for m in prose.finditer(text):  # the parenthesis may go on to the next line
            rest = " ".join(m.group("rest").split())
            claims.append(
                (
                    str(path.relative_to(REPO)),
                    text.count("\n", 0, m.start()) + 1,
                    [*m.group("section").split("."), m.group("key")],
                    re.split(r"[,;:]", rest)[0].split(" ")[0],
                    rest,
                )
            )
    return claims


def test_stated_defaults_are_the_models_defaults() -> None:
    claims = default_claims()
    assert len(claims) >= 12, "the parser found the [weights] table and prose defaults"
    wrong = []
    for doc, line, path, stated, rest in claims:
        key = ".".join(path)
        _, field = resolve(path)
        assert field is not None
        default = _default(field)
        if not _same(stated, default):
            wrong.append(f"{doc}:{line}: {key} default {stated.strip()!r}; the model: {default!r}")
        elif key in PROFILE_KEYS and "profile" not in rest:
            wrong.append(
                f"{doc}:{line}: {key} default {stated.strip()!r} is the model's, but the "
                "profiles set it: say so where the default is stated"
            )
    assert not wrong, "stated defaults that are not the code's:\n" + "\n".join(wrong)


def test_every_config_field_has_a_description() -> None:
    """docs/configuration.md: every setting (a field that is not a table) has a description."""
    missing = []

    def walk(model: type[BaseModel], prefix: str, seen: set[type]) -> None:
        if model in seen:
            return
        seen = seen | {model}
        for name, field in model.model_fields.items():
            annotation = _inner(field.annotation)
            tables = [a for a in (annotation, *typing.get_args(annotation)) if _models(a)]
            if not tables and not (field.description or "").strip():
                missing.append(f"{prefix}{name} ({model.__name__})")
            for table in tables:
                for inner in _models(table):
                    walk(inner, f"{prefix}{name}.", seen)

    walk(RollstreamConfig, "", set())
    assert not missing, "config fields without a description:\n" + "\n".join(missing)


def test_the_sections_table_names_each_sections_model() -> None:
    doc = REPO / "docs" / "configuration.md"
    row = re.compile(r"^\| (?P<section>`\[[a-z_.]+\]`|top level) \| `(?P<model>[\w.]+)` \|")
    rows = [
        (number, m)
        for number, line in enumerate(doc.read_text().splitlines(), start=1)
        if (m := row.match(line))
    ]
    assert len(rows) >= 10, "the parser found the sections table"
    wrong = []
    for number, m in rows:
        module, _, name = m.group("model").rpartition(".")
        named = getattr(importlib.import_module(module), name)
        section = m.group("section").strip("`[]")
        if section == "top level":
            ok = issubclass(RollstreamConfig, named)
        else:
            models, _ = resolve(section.split("."))
            ok = models == [named]
        if not ok:
            wrong.append(f"docs/configuration.md:{number}: {section} is not {m.group('model')}")
    assert not wrong, "\n".join(wrong)


# --- the command line ------------------------------------------------------------------------


ROOT_VALUE_OPTIONS = {
    opt for param in main.params if isinstance(param, click.Option) for opt in param.opts
}
HELP = {"-h", "--help"}


def _options(command: click.Command) -> set[str]:
    return {
        opt
        for param in command.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
    } | HELP


def _takes_value(command: click.Command, option: str) -> bool:
    for param in command.params:
        if isinstance(param, click.Option) and option in param.opts:
            return not param.is_flag and not param.count
    return False


def _command_lines() -> list[tuple[Text, list[str]]]:
    """Every `rollstream ...` invocation: its words after `rollstream`."""
    found = []
    pending: Text | None = None
    joined = ""
    for piece in PIECES:
        text = piece.text
        if piece.in_block:
            text = text.split(" #", 1)[0].split("\t#", 1)[0]
            if pending is not None:  # a continued line
                joined += " " + text.rstrip("\\ ")
                if not text.rstrip().endswith("\\"):
                    found.append((pending, joined))
                    pending = None
                continue
            if text.lstrip().startswith("#"):
                continue
        m = re.search(r"(?:^|\s|-m )rollstream(?=\s|$)", text)
        if not m:
            continue
        rest = text[m.end() :]
        if piece.in_block and rest.rstrip().endswith("\\"):
            pending, joined = piece, rest.rstrip("\\ ")
            continue
        found.append((piece, rest))
    out = []
    for piece, rest in found:
        rest = rest.split("|", 1)[0] if piece.in_block else rest  # a shell pipe
        try:
            words = shlex.split(rest.replace("…", "..."))
        except ValueError:
            words = rest.split()
        out.append((piece, words))
    return out


def check_command_line(words: list[str]) -> str | None:
    """What is wrong with ``rollstream <words>``, or None."""
    command: click.Command = main
    path = ["rollstream"]
    index = 0
    while index < len(words):
        word = words[index]
        if word.startswith("-"):
            option = word.split("=", 1)[0]
            if option not in _options(command):
                return f"`{option}` is not an option of `{' '.join(path)}`"
            if "=" not in word and _takes_value(command, option):
                index += 1
            index += 1
            continue
        if isinstance(command, click.Group):
            names = word.split("|")  # `infra up|down|status`: each must exist
            if not all(re.fullmatch(r"[a-z][a-z-]*", name) for name in names):
                return None  # a placeholder (ROLE, COMMAND): nothing more to check
            context = click.Context(command)  # the root loads its commands when asked
            known_names = command.list_commands(context)
            unknown = [name for name in names if name not in known_names]
            if unknown:
                known = ", ".join(sorted(known_names))
                return f"`{' '.join(path)}` has no command {unknown[0]!r} (it has: {known})"
            if len(names) > 1:
                return None
            found = command.get_command(context, word)
            assert found is not None
            command = found
            path.append(word)
        index += 1  # a positional argument of a command
    return None


def test_the_docs_name_commands_and_options_that_exist() -> None:
    lines = _command_lines()
    assert len(lines) > 60, "the parser found the docs' command lines"
    wrong = []
    for piece, words in lines:
        problem = check_command_line(words)
        if problem:
            wrong.append(f"{piece.where()}: `rollstream {' '.join(words)}`: {problem}")
    assert not wrong, "command lines the CLI rejects:\n" + "\n".join(wrong)


FIRST_TRY_SHELL = re.compile(
    r"cd [\w./-]+|python examples/\w+\.py( --?[\w-]+( [\w.:/-]+)?)*|wait \$!"
)
"""The lines of a first-try block that are not ``rollstream``'s: entering a directory the
block made, running an example of the repository, waiting for a role started with ``&``."""


def test_first_try_blocks_hold_only_commands_that_run_as_written() -> None:
    """A ```` ```bash first-try ```` block (run by tests/system/rollstream/test_first_try.py) holds
    ``rollstream`` lines the CLI accepts and the few shell lines ``FIRST_TRY_SHELL``
    allows, with no placeholder a reader must fill in."""
    wrong = []
    for path in DOCS:
        tagged, pending = False, ""
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.startswith("```"):
                tagged = line.strip() == "```bash first-try"
                continue
            command = pending + line.split("#", 1)[0].strip()
            if not tagged or not command:
                continue
            if command.endswith("\\"):
                pending = command[:-1]
                continue
            pending = ""
            command = command.removesuffix("&").strip()  # a role left in the background
            where = f"{path.relative_to(REPO)}:{number}"
            words = shlex.split(command)
            if words[0] != "rollstream":
                if not FIRST_TRY_SHELL.fullmatch(command):
                    wrong.append(f"{where}: `{command}` is not a line a first-try block runs")
            elif re.search(r"[<>…$]|\.\.\.", command):
                wrong.append(f"{where}: `{command}` holds a placeholder")
            elif problem := check_command_line(words[1:]):
                wrong.append(f"{where}: `{command}`: {problem}")
    assert not wrong, "\n".join(wrong)


def test_the_role_shims_pass_on_every_root_option() -> None:
    """docs/configuration.md: `python -m producers|streams|consumers` run the same commands."""
    from core.process import ROOT_OPTIONS

    value_options = {
        param.opts[-1]
        for param in main.params
        if isinstance(param, click.Option) and not param.is_flag
    }
    assert value_options <= set(ROOT_OPTIONS), (
        f"the shims move {sorted(ROOT_OPTIONS)} in front of the command; "
        f"`rollstream` takes {sorted(value_options)}"
    )


# --- wire format -----------------------------------------------------------------------------


def _string_constants(path: Path, class_name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                stmt.value.value
                for stmt in node.body
                if isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            }
    raise AssertionError(f"{class_name} not found in {path}")


@pytest.mark.parametrize(
    ("module", "class_name"),
    [
        ("schemas/codec.py", "DecodeReason"),
        ("schemas/validation.py", "Reason"),
        ("streams/processor.py", "DeadLetterReason"),
    ],
)
def test_the_wire_format_lists_every_dead_letter_reason(module: str, class_name: str) -> None:
    doc = REPO / "docs" / "wire-format.md"
    named = {piece.text for piece in SPANS if piece.doc == "docs/wire-format.md"}
    reasons = _string_constants(REPO / module, class_name)
    assert reasons, f"no reasons parsed from {module}"
    missing = sorted(reasons - named)
    assert not missing, f"{doc.name} does not list {class_name} ({module}): {missing}"


# --- the packages' module tables -------------------------------------------------------------

ARCHITECTURE = REPO / "docs" / "architecture.md"
PACKAGE_HEADING = re.compile(r"^### `(?P<package>[a-z_]+)/`")
MODULE_CELL = re.compile(r"`([a-z0-9_/]+\.py)`")


def _root_packages() -> list[str]:
    """The project's packages, as import-linter knows them (``pyproject.toml``)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return pyproject["tool"]["importlinter"]["root_packages"]


def module_tables(text: str) -> dict[str, list[tuple[int, str]]]:
    """The modules each package's ``| module | what |`` table in the chapter "What each
    package holds" lists, as (line, path in the package), by package."""
    tables: dict[str, list[tuple[int, str]]] = {}
    package, in_chapter = None, False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("## "):
            package, in_chapter = None, line == "## What each package holds"
        elif in_chapter and (m := PACKAGE_HEADING.match(line)):
            package = m.group("package")
        elif package and line.startswith("| module |"):
            tables[package] = []
        elif package in tables and line.startswith("| `"):
            cell = line.split("|")[1]
            tables[package] += [(number, name) for name in MODULE_CELL.findall(cell)]
    return tables


def module_table_problems(text: str, root: Path = REPO) -> list[str]:
    """What the module tables of ``text`` (docs/architecture.md) get wrong about the tree
    under ``root``: a package without a table, a listed module that does not exist, a
    module or sub-package of the tree that no row names."""
    tables = module_tables(text)
    wrong = []
    for package in _root_packages():
        if package not in tables:
            wrong.append(f"no module table for `{package}/`")
            continue
        listed = {name for _, name in tables[package]}
        base = root / package
        wrong += [
            f"line {number}: `{package}/{name}` does not exist"
            for number, name in tables[package]
            if not (base / name).is_file()
        ]
        modules = {
            str(path.relative_to(base))
            for path in base.rglob("*.py")
            if path.name not in ("__init__.py", "__main__.py")
        }
        wrong += [f"`{package}/{name}` is listed nowhere" for name in sorted(modules - listed)]
        for init in sorted(base.rglob("*/__init__.py")):
            folder = str(init.parent.relative_to(base))
            if not any(name.startswith(folder + "/") for name in listed):
                wrong.append(f"the sub-package `{package}/{folder}/` is listed nowhere")
    return wrong


def test_the_module_tables_match_the_tree() -> None:
    tables = module_tables(ARCHITECTURE.read_text())
    assert sum(len(rows) for rows in tables.values()) > 100, "the parser found the tables"
    wrong = module_table_problems(ARCHITECTURE.read_text())
    assert not wrong, "docs/architecture.md, What each package holds:\n" + "\n".join(wrong)


def test_the_module_table_check_catches_a_missing_row_a_ghost_and_a_new_room(
    tmp_path: Path,
) -> None:
    text = ARCHITECTURE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `faust/gaps.py`"))
    assert module_table_problems(text.replace(row + "\n", "")) == [
        "`streams/faust/gaps.py` is listed nowhere",
        "`streams/faust/restore.py` is listed nowhere",
    ]
    ghost = text.replace("| `faust/txn.py` |", "| `faust/txn.py`, `faust/warp.py` |")
    assert [p.split(": ", 1)[1] for p in module_table_problems(ghost)] == [
        "`streams/faust/warp.py` does not exist"
    ]
    without_core = re.sub(r"### `core/`.*?(?=### `schemas/`)", "", text, flags=re.S)
    assert module_table_problems(without_core) == ["no module table for `core/`"]

    # a new sub-package in a copy of the tree, with only its __init__.py
    for package in _root_packages():
        for path in (REPO / package).rglob("*.py"):
            target = tmp_path / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
    (tmp_path / "weights" / "cache").mkdir()
    (tmp_path / "weights" / "cache" / "__init__.py").touch()
    assert module_table_problems(text, tmp_path) == [
        "the sub-package `weights/cache/` is listed nowhere"
    ]

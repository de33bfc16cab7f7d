"""``rollstream export``: a trained version out as a Hugging Face model directory.

A version in the weight store is a verified state dict; what a practitioner takes away is
a directory ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` load: config,
generation config, tokenizer (``core.model_files``) and the version's weights as
safetensors, written by ``save_pretrained``. The version is rebuilt and verified as every
follower does (hashes, signature); one that fails is refused and nothing is written. The
directory appears whole or not at all (written beside it, then renamed), and an existing
non-empty directory is never overwritten.

A version of a LoRA run (``[lora]``) is exported merged (W + alpha/rank * B A: a plain
model, no PEFT needed to load it) and, in ``adapter/``, as the adapter PEFT saves, for
``PeftModel.from_pretrained`` on the base model or SGLang's ``/load_lora_adapter``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from core.config import LoraConfig
from rollstream.config.settings import RollstreamConfig
from rollstream.runs.weights import WeightsContext

#: Provenance written beside the model: which run, policy and version it is.
PROVENANCE_NAME = "rollstream_export.json"

#: Where a LoRA version's adapter goes, below the exported directory.
ADAPTER_DIR = "adapter"


class ExportError(Exception):
    """What made an export impossible; nothing was written."""


def refuse_occupied(out: Path) -> None:
    """``ExportError`` unless ``out`` is new or an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory: choose a new one")


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A directory beside ``out`` to fill, renamed to ``out`` when the block ends well and
    removed when it fails: ``out`` appears whole or not at all."""
    refuse_occupied(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        refuse_occupied(out)  # nobody wrote there meanwhile
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Exported:
    """What ``export_version`` wrote."""

    version: int
    directory: Path
    files: list[str]
    dtype: str


def _float_dtype(state: dict[str, Any]) -> str:
    """The dtype of the version's floating-point tensors (the first one's)."""
    for tensor in state.values():
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return "float32"


def export_version(
    weights: WeightsContext,
    spec: str,
    out: Path,
    version: int | None = None,
    dtype: str | None = None,
    lora: LoraConfig | None = None,
) -> Exported:
    """Rebuild ``version`` (default: the newest) of the context's run, verified, and write
    it with ``spec``'s config and tokenizer as a Hugging Face directory at ``out``,
    parameters in ``dtype`` (default: as published). A version holding a LoRA adapter
    needs ``lora``, the run's adapter settings."""
    from core.model_files import write_model_files
    from core.models import (
        cast_parameters,
        is_adapter_tensor,
        load_model,
        merge_lora,
        save_adapter,
        torch_dtype,
    )
    from producers.engine.weights import load_state_dict_checked
    from weights.errors import VersionRefused

    refuse_occupied(out)
    if dtype is not None:
        torch_dtype(dtype)  # a clear error before anything is read
    try:
        snapshot = weights.follower().sync(version)
    except VersionRefused as err:
        raise ExportError(str(err)) from None
    if snapshot is None:
        raise ExportError(f"no versions of run {weights.run!r} in region {weights.region!r}")
    has_adapter = any(is_adapter_tensor(name) for name in snapshot.state)
    if has_adapter and lora is None:
        raise ExportError(
            f"version {snapshot.version} holds a LoRA adapter: export it with the run's "
            "[lora] table in the config"
        )
    adapter = lora if has_adapter else None
    cache_dir = weights.config.cache_dir
    model = load_model(spec, "float32", cache_dir=cache_dir, lora=adapter)
    try:
        load_state_dict_checked(model, snapshot.state)
        if adapter is not None:
            merged = merge_lora(model)
            model = load_model(spec, "float32", cache_dir=cache_dir)
            load_state_dict_checked(model, merged)
    except (ValueError, RuntimeError) as err:  # names, or shapes (torch: size mismatch)
        raise ExportError(
            f"version {snapshot.version} does not fit model {spec!r}: {err}"
        ) from None
    target = dtype or _float_dtype(snapshot.state)
    cast_parameters(model, target)
    with staged_directory(out) as staging:
        write_model_files(spec, staging, cache_dir)
        model.save_pretrained(staging, safe_serialization=True)
        if adapter is not None:
            save_adapter(snapshot.state, adapter, staging / ADAPTER_DIR, base_model=spec)
        provenance: dict[str, Any] = {
            "run_id": weights.run,
            "policy": weights.config.policy,
            "version": snapshot.version,
            "model": spec,
            "dtype": target,
        }
        if adapter is not None:
            provenance["lora"] = adapter.model_dump()
        (staging / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=2) + "\n")
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return Exported(snapshot.version, out, files, target)


OUT_DIRECTORY = click.option(
    "-o",
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory to write (new, or empty).",
)
"""The ``--out`` of the export commands: ``staged_directory`` refuses a used one."""


@click.command("export")
@click.argument("run", required=False)
@OUT_DIRECTORY
@click.option("--version", type=int, help="Version to export (default: the newest).")
@click.option("--region", help="Region to read from (default: the home store, [s3]).")
@click.option("--dtype", help="Parameter dtype, e.g. bfloat16 (default: as published).")
@click.option("--model", "spec", help="Model spec (default: the trainer's, [trainer.model]).")
@click.pass_obj
def export(
    config: RollstreamConfig,
    run: str | None,
    out: Path,
    version: int | None,
    region: str | None,
    dtype: str | None,
    spec: str | None,
) -> None:
    """Write a version of RUN (default: the config's run) as a Hugging Face model
    directory: config, generation config, tokenizer and safetensors weights."""
    config.require_policy()  # each policy's versions are their own lineage
    context = WeightsContext(
        config=config,
        weights=config.weights,
        run=run or config.run_id,
        region=region or config.s3.name,
    )
    try:
        done = export_version(
            context, spec or config.trainer.model.spec, out, version, dtype, lora=config.lora
        )
    except (ExportError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    click.echo(
        f"v{done.version} of run {context.run} -> {done.directory} ({done.dtype}): "
        f"{', '.join(done.files)}"
    )

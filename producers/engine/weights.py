"""Weights on disk for the engine: a state dict written as one safetensors file (the
format ``/update_weights_from_disk`` reads, ours or SGLang's), read back, and loaded into a
model with only the tolerated gap (aliases of tied tensors, which checkpoints store once).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def save_weights(state_dict: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write ``state_dict`` as ``directory/model.safetensors`` (atomically: temp + rename).

    Tensors sharing storage (tied embeddings) are written once, under the first name, as
    Hugging Face checkpoints do; ``load_state_dict_checked`` accepts the missing alias.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    target = directory / "model.safetensors"
    staging = directory / f".model.safetensors.{uuid.uuid4().hex}.tmp"
    save_file(tensors, str(staging), metadata={"format": "pt"})
    staging.replace(target)
    return target


def weights_sha256(directory: Path) -> str:
    """The sha256 of a checkpoint directory's ``*.safetensors`` bytes, files in name
    order (one file: that file's sha256): what ``/update_weights_from_disk`` checks."""
    digest = hashlib.sha256()
    for file in _safetensors_files(directory):
        with file.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _safetensors_files(directory: Path) -> list[Path]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    return files


def read_weights(directory: Path, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in a checkpoint directory. With
    ``sha256`` the bytes are read once, hashed, and only then parsed, so the file that
    was checked is the file that is loaded (a swap between check and load cannot sneak
    other weights in); a mismatch raises ``ValueError`` naming both hashes."""
    from safetensors.torch import load, load_file

    files = _safetensors_files(directory)
    tensors: dict[str, torch.Tensor] = {}
    if sha256 is None:
        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    blobs = [file.read_bytes() for file in files]
    digest = hashlib.sha256()
    for blob in blobs:
        digest.update(blob)
    if not hmac.compare_digest(digest.hexdigest(), sha256.lower()):
        raise ValueError(
            f"weights in {directory} have sha256 {digest.hexdigest()}, the request named "
            f"{sha256}: not loaded"
        )
    for blob in blobs:
        tensors.update(load(blob))
    return tensors


class AppliedTensors:
    """The tensor objects a model was last loaded from, held weakly. A follower's
    snapshots share the objects of the tensors a version left alone (the base under an
    adapter, what a delta did not touch) and never change them in place, so the same
    object holds the same values: only the others need copying. An adapter version thus
    copies its adapter, not the model."""

    def __init__(self) -> None:
        self._refs: dict[str, weakref.ref[torch.Tensor]] = {}

    def changed(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of ``state_dict`` whose object is not the one last loaded."""
        return {
            name: tensor
            for name, tensor in state_dict.items()
            if (ref := self._refs.get(name)) is None or ref() is not tensor
        }

    def record(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._refs = {name: weakref.ref(tensor) for name, tensor in state_dict.items()}

    def forget(self) -> None:
        """After a load this did not see (or one that failed half way)."""
        self._refs = {}


def load_state_dict_checked(
    model: Any, state_dict: Mapping[str, torch.Tensor], applied: AppliedTensors | None = None
) -> int:
    """``model.load_state_dict`` that tolerates only missing aliases of tied tensors; with
    ``applied``, copies only the tensors that changed since the last load it recorded.
    Returns how many tensors were copied."""
    own = model.state_dict()
    unexpected = sorted(set(state_dict) - set(own))
    if unexpected:
        raise ValueError(f"weights have tensors the model lacks: {unexpected[:5]}")
    by_storage: dict[int, list[str]] = collections.defaultdict(list)
    for name, tensor in own.items():
        by_storage[tensor.untyped_storage().data_ptr()].append(name)
    missing = []
    for name in set(own) - set(state_dict):
        aliases = by_storage[own[name].untyped_storage().data_ptr()]
        if not any(alias in state_dict for alias in aliases):
            missing.append(name)
    if missing:
        raise ValueError(f"weights lack tensors of the model: {sorted(missing)[:5]}")
    # torch copies tensor by tensor and reports a mismatch only after copying the rest:
    # refuse before the first copy, so a refused checkpoint leaves the model as it was
    misshapen = sorted(n for n, t in state_dict.items() if tuple(t.shape) != tuple(own[n].shape))
    if misshapen:
        name = misshapen[0]
        raise ValueError(
            f"weights have {len(misshapen)} tensor(s) of another shape than the model's, e.g. "
            f"{name}: {tuple(state_dict[name].shape)} for {tuple(own[name].shape)}"
        )
    if applied is None:
        with torch.no_grad():
            model.load_state_dict(dict(state_dict), strict=False)
        return len(state_dict)
    copy = applied.changed(state_dict)
    applied.forget()
    with torch.no_grad():
        model.load_state_dict(copy, strict=False)
    applied.record(state_dict)
    return len(copy)

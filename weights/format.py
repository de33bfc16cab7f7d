"""Bit-exact encoding of weights: full bases and sparse deltas.

A *base* is a plain safetensors file of the whole state. A *delta* is a safetensors file,
compressed with zstd, holding for every tensor whose bits changed two 1-D entries:

* ``<name>:idx`` (uint8) — the changed flat positions, gap-coded: the first gap is the
  first position, each next gap is ``position - previous - 1`` (so adjacent changes
  cost a zero), every gap written as an unsigned LEB128 varint (7 bits a byte, high
  bit = "more bytes follow");
* ``<name>:val`` (the tensor's own dtype) — the new values at those positions.

Changes are found by comparing raw bits, never float values, so ``-0.0``/``+0.0`` and
NaN payloads survive and applying a chain of deltas reproduces the writer bit for bit.

Why varint gaps: at the 0.4–2% change density of one RL step most gaps are below 16384,
so a gap takes one or two bytes before compression. Measured on SmolLM2-135M (zstd -3),
the index stream is ~5% smaller than byte-shuffled uint32 gaps and ~30% smaller than
plain uint32 gaps, and zstd runs faster on the 3-4x shorter input.

``state_checksums`` (CRC-32 of each tensor's raw bytes) lets a reader check the weights it
rebuilt against the writer's, tensor by tensor; ``state_digest`` condenses them into one
sha256 fingerprint of the whole state. A checksum, not a cryptographic hash, on
purpose: it guards the *application* (a held state that was modified, a bug), which runs
on every version over every byte, so its speed matters (zlib-ng's CRC-32 ~24 GB/s here
against ~1.5 GB/s for sha256). Tampering is stopped by the sha256 of every file and the signed
manifest: together with a deterministic apply they already pin the weights.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import safetensors.torch
import torch
import zstandard
from zlib_ng import zlib_ng

from weights.errors import FormatError, RefusalReason
from weights.manifest import TensorSpec, max_delta_raw_bytes

StateDict = dict[str, torch.Tensor]
T = TypeVar("T")

DELTA_METADATA = {"format": "rollstream.delta", "version": "1"}
BASE_METADATA = {"format": "rollstream.base", "version": "1"}
IDX_SUFFIX = ":idx"
VAL_SUFFIX = ":val"

_BITS_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_VARINT_BYTES = 9  # 63 bits: any position an int64 can hold
SLAB_ELEMENTS = 1 << 20  # elements at a time: the slabs compared stay in a core's cache


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) or 1


def per_tensor(
    fn: Callable[[str], T], names: Iterable[str], workers: int | None = None
) -> dict[str, T]:
    """``{name: fn(name)}``, run on ``workers`` threads (default: every usable core), started
    in the order of ``names``. The tensor work (numpy, CRC-32, zstd) releases the GIL."""
    ordered = list(names)
    with ThreadPoolExecutor(max_workers=workers or usable_cores()) as pool:
        return dict(zip(ordered, pool.map(fn, ordered), strict=True))


def largest_first(names: Iterable[str], state: Mapping[str, torch.Tensor]) -> list[str]:
    """``names`` by decreasing size: on a pool the last task to finish is a small one."""
    return sorted(names, key=lambda name: -state[name].numel())


# --- tensors and specs -------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of the tensor's raw bits (copied only if not contiguous)."""
    flat = tensor.detach().cpu().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    try:
        return flat.view(_BITS_BY_SIZE[flat.element_size()])
    except KeyError:
        raise TypeError(f"unsupported dtype {flat.dtype}") from None


def specs_of(state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Dtype and shape of every tensor, in name order (the manifest's order)."""
    return {
        name: TensorSpec(dtype_name(state[name].dtype), tuple(state[name].shape))
        for name in sorted(state)
    }


def split_aliases(state: Mapping[str, torch.Tensor]) -> tuple[StateDict, dict[str, str]]:
    """Store tied tensors once: ``(unique, {alias: stored name})``.

    Models with tied embeddings list the same tensor under two names; safetensors refuses
    to save both, and storing it twice would double its share of every delta.
    """
    unique: StateDict = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[object, ...], str] = {}
    for name in sorted(state):
        tensor = state[name]
        ident = (
            tensor.device,
            tensor.data_ptr(),
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        if tensor.numel() and ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
            unique[name] = tensor
    return unique, aliases


def join_aliases(unique: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> StateDict:
    """The full state again: every alias is the very same tensor object as its target."""
    state = dict(unique)
    for alias, target in aliases.items():
        state[alias] = unique[target]
    return state


def cast_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> StateDict:
    """Floating-point tensors cast to ``dtype`` (e.g. fp32 master weights to the bf16 copy
    a trainer publishes), other tensors as they are; tied tensors stay tied."""
    unique, aliases = split_aliases(state)
    cast = {
        name: t.detach().to(dtype) if t.is_floating_point() else t.detach()
        for name, t in unique.items()
    }
    return join_aliases(cast, aliases)


def state_checksums(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """CRC-32 of each tensor's raw bytes, in name order.

    Tensor by tensor on threads (zlib-ng's CRC-32: the same numbers as ``zlib``'s, about
    six times faster here, and it releases the GIL).
    """
    return per_tensor(lambda name: zlib_ng.crc32(bits(state[name]).numpy()), sorted(state))


def digest_of_checksums(checksums: Mapping[str, int]) -> str:
    """One fingerprint of a whole state: sha256 over ``name NUL crc32-hex LF`` lines in
    name order. Derived from the checksums, so it costs no second pass over the weights."""
    lines = "".join(f"{name}\0{checksums[name]:08x}\n" for name in sorted(checksums))
    return hashlib.sha256(lines.encode()).hexdigest()


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """``digest_of_checksums(state_checksums(state))``: equal digests, equal weights."""
    return digest_of_checksums(state_checksums(state))


def dense_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the weights themselves (tied tensors counted once)."""
    unique, _ = split_aliases(state)
    return sum(t.numel() * t.element_size() for t in unique.values())


# --- gap-coded positions --------------------------------------------------------------------


def encode_positions(positions: np.ndarray) -> np.ndarray:
    """Strictly increasing int64 positions -> LEB128 varint gaps (uint8)."""
    if positions.size == 0:
        return np.empty(0, dtype=np.uint8)
    gaps = np.diff(positions, prepend=-1).astype(np.uint64) - np.uint64(1)
    longest = int(gaps.max())
    if longest < 0x80:  # every gap fits one byte
        return gaps.astype(np.uint8)
    lengths = np.ones(gaps.size, dtype=np.int64)
    for k in range(1, _MAX_VARINT_BYTES):
        if longest < 1 << (7 * k):
            break  # no gap needs a byte more: skip the remaining passes over all gaps
        lengths += gaps >= np.uint64(1 << (7 * k))
    offsets = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    # the first byte of every gap without an index array over all of them, then the
    # continuation bytes of the (few) longer gaps
    more = lengths > 1
    out[offsets] = (gaps & np.uint64(0x7F)).astype(np.uint8) | (more.astype(np.uint8) << 7)
    sel = np.flatnonzero(more)
    rest = gaps[sel] >> np.uint64(7)
    for k in range(1, int(lengths.max())):
        more = lengths[sel] > k + 1
        out[offsets[sel] + k] = (rest & np.uint64(0x7F)).astype(np.uint8) | (
            more.astype(np.uint8) << 7
        )
        sel, rest = sel[more], rest[more] >> np.uint64(7)
    return out


def decode_positions(data: np.ndarray, numel: int) -> np.ndarray:
    """Inverse of ``encode_positions``; checks the stream is well formed and in range.

    Every gap's first byte in one gather, then the further bytes of the gaps that have
    them (the few long gaps of a sparse delta), instead of passes over every byte."""
    if data.size == 0:
        return np.empty(0, dtype=np.int64)
    if data[-1] & 0x80:
        raise FormatError(RefusalReason.CORRUPT, "varint stream ends inside a number")
    ends = np.flatnonzero(data < 0x80)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    extra = ends - starts  # bytes after each gap's first
    longest = int(extra.max())
    if longest >= _MAX_VARINT_BYTES:
        raise FormatError(RefusalReason.CORRUPT, "varint longer than 9 bytes")
    gaps = (data[starts] & 0x7F).astype(np.uint64)
    longer = np.flatnonzero(extra)
    for k in range(1, longest + 1):
        more = (data[starts[longer] + k] & 0x7F).astype(np.uint64)
        gaps[longer] |= more << np.uint64(7 * k)
        longer = longer[extra[longer] > k]
    if int(gaps.max()) >= numel:
        raise FormatError(RefusalReason.CORRUPT, "position beyond the end of the tensor")
    positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if int(positions[-1]) >= numel:
        raise FormatError(RefusalReason.CORRUPT, "position beyond the end of the tensor")
    return positions


# --- deltas --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorDelta:
    """Changed flat positions (int64, increasing) and their new values (tensor's dtype)."""

    positions: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class EncodedDelta:
    """A compressed delta and what a manifest needs to know about it."""

    blob: bytes  # zstd-compressed safetensors
    raw_bytes: int  # size of the safetensors payload before compression
    changed_elements: int
    changes: dict[str, TensorDelta]  # the same delta, decoded (the writer applies it)
    checksums: dict[str, int]  # ``state_checksums`` of the new state, from the same pass


def delta_compatible(prev: Mapping[str, TensorSpec], curr: Mapping[str, TensorSpec]) -> bool:
    """A delta can only express value changes: same names, dtypes and shapes."""
    return dict(prev) == dict(curr)


def _slabs(numel: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + SLAB_ELEMENTS, numel)) for lo in range(0, numel, SLAB_ELEMENTS)]


def _diff_and_checksum(old: torch.Tensor, new: torch.Tensor) -> tuple[TensorDelta | None, int]:
    """Positions whose bits differ with their new values (None if none), and the CRC-32 of
    ``new``, in one pass a slab at a time: the slab just compared is gathered from and
    checksummed while it is still in cache, and the scratch is ``SLAB_ELEMENTS`` flags, not
    one per element."""
    # numpy, not torch: torch.nonzero is an order of magnitude slower on CPU here.
    old_bits, new_bits = bits(old).numpy(), bits(new).numpy()
    found, gathered, crc = [], [], 0
    for lo, hi in _slabs(new_bits.size):
        slab = new_bits[lo:hi]
        changed = np.flatnonzero(old_bits[lo:hi] != slab)
        if changed.size:
            gathered.append(slab[changed])
            found.append(changed + lo)
        crc = zlib_ng.crc32(slab, crc)
    if not found:
        return None, crc
    positions, values = np.concatenate(found), np.concatenate(gathered)
    return TensorDelta(
        positions=torch.from_numpy(positions), values=torch.from_numpy(values).view(new.dtype)
    ), crc


def diff_tensor(old: torch.Tensor, new: torch.Tensor) -> TensorDelta | None:
    """Positions whose bits differ, with the new values; None if nothing changed."""
    return _diff_and_checksum(old, new)[0]


@dataclass(frozen=True)
class StateDiff:
    """What changed between two states, positions gap-coded, not yet compressed."""

    changes: dict[str, TensorDelta]
    positions: dict[str, np.ndarray]  # ``encode_positions`` of each changed tensor
    checksums: dict[str, int]  # ``state_checksums`` of the new state

    @property
    def value_bytes(self) -> int:
        """Bytes of the changed values: what compression can shrink least."""
        return sum(d.values.nbytes for d in self.changes.values())


def diff_state(
    prev: Mapping[str, torch.Tensor], curr: Mapping[str, torch.Tensor], workers: int | None = None
) -> StateDiff:
    """The changes turning ``prev`` into ``curr`` (same names, dtypes, shapes; no
    aliases), diffed, checksummed and gap-coded on ``workers`` threads (``per_tensor``),
    largest tensor first."""
    if not delta_compatible(specs_of(prev), specs_of(curr)):
        raise ValueError("states differ in names, dtypes or shapes: write a base instead")

    def one(name: str) -> tuple[TensorDelta | None, np.ndarray | None, int]:
        delta, crc = _diff_and_checksum(prev[name], curr[name])
        idx = None if delta is None else encode_positions(delta.positions.numpy())
        return delta, idx, crc

    done = per_tensor(one, largest_first(curr, curr), workers)
    changes: dict[str, TensorDelta] = {}
    positions: dict[str, np.ndarray] = {}
    for name in sorted(curr):
        delta, idx, _ = done[name]
        if delta is not None and idx is not None:
            changes[name], positions[name] = delta, idx
    checksums = {name: done[name][2] for name in sorted(curr)}
    return StateDiff(changes=changes, positions=positions, checksums=checksums)


def compress_diff(diff: StateDiff, level: int = 3, workers: int | None = None) -> EncodedDelta:
    """``diff`` as the delta file: safetensors of positions and values, zstd on
    ``workers`` threads."""
    entries: StateDict = {}
    for name, delta in diff.changes.items():
        entries[name + IDX_SUFFIX] = torch.from_numpy(diff.positions[name])
        entries[name + VAL_SUFFIX] = delta.values
    raw = safetensors.torch.save(entries, metadata=DELTA_METADATA)
    workers = workers or usable_cores()
    threads = workers if workers > 1 else 0  # zstd: 0 is its single-threaded mode
    blob = zstandard.ZstdCompressor(level=level, threads=threads).compress(raw)
    return EncodedDelta(
        blob=blob,
        raw_bytes=len(raw),
        changed_elements=sum(d.positions.numel() for d in diff.changes.values()),
        changes=diff.changes,
        checksums=diff.checksums,
    )


def encode_delta(
    prev: Mapping[str, torch.Tensor],
    curr: Mapping[str, torch.Tensor],
    level: int = 3,
    workers: int | None = None,
) -> EncodedDelta:
    """Delta turning ``prev`` into ``curr``: ``diff_state`` then ``compress_diff``."""
    return compress_diff(diff_state(prev, curr, workers), level, workers)


def decode_delta(
    blob: bytes, raw_bytes: int, specs: Mapping[str, TensorSpec]
) -> dict[str, TensorDelta]:
    """Decompress and validate a delta against the manifest's tensor specs; ``raw_bytes``
    (the manifest's word) is bounded by what the specs allow before anything is
    allocated, so a small zstd frame declaring gigabytes is refused unread."""
    limit = max_delta_raw_bytes(specs)
    if not 0 <= raw_bytes <= limit:
        raise FormatError(
            RefusalReason.CORRUPT,
            f"raw_bytes {raw_bytes} is more than a delta of the manifest's tensors can "
            f"decode to (at most {limit}): refused before decompressing",
        )
    try:
        declared = zstandard.frame_content_size(blob[:18])
    except zstandard.ZstdError:
        declared = -1
    if declared != raw_bytes:
        raise FormatError(
            RefusalReason.CORRUPT,
            f"zstd frame declares {declared} bytes, manifest says {raw_bytes}",
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=raw_bytes)
        entries = safetensors.torch.load(raw)
    except Exception as err:  # zstd and safetensors raise several unrelated types
        raise FormatError(RefusalReason.CORRUPT, f"delta does not decode: {err}") from None
    names = {key.rpartition(":")[0] for key in entries}
    if len(entries) != 2 * len(names):
        raise FormatError(RefusalReason.CORRUPT, "delta entries are not idx/val pairs")

    def one(name: str) -> TensorDelta:
        idx, val = entries.get(name + IDX_SUFFIX), entries.get(name + VAL_SUFFIX)
        spec = specs.get(name)
        if idx is None or val is None or spec is None:
            raise FormatError(RefusalReason.CORRUPT, f"unexpected delta entry for {name!r}")
        if idx.dtype != torch.uint8 or val.dim() != 1 or dtype_name(val.dtype) != spec.dtype:
            raise FormatError(RefusalReason.CORRUPT, f"ill-typed delta entry for {name!r}")
        positions = decode_positions(idx.numpy(), spec.numel)
        if positions.size != val.numel():
            raise FormatError(RefusalReason.CORRUPT, f"{name!r}: positions and values differ")
        return TensorDelta(positions=torch.from_numpy(positions), values=val)

    return per_tensor(one, sorted(names))


def _patched_copy(
    held: torch.Tensor, change: TensorDelta | None, checksum: bool
) -> tuple[torch.Tensor, int | None]:
    """``held`` with ``change`` scattered into a fresh copy (``held`` itself when there is
    no change), and its CRC-32 if asked, a slab at a time: copy, patch and checksum while
    the slab is in cache."""
    if change is None:
        return held, zlib_ng.crc32(bits(held).numpy()) if checksum else None
    source = bits(held).numpy()
    out = np.empty_like(source)
    positions, values = change.positions.numpy(), bits(change.values).numpy()
    crc = 0
    for lo, hi in _slabs(source.size):
        out[lo:hi] = source[lo:hi]
        first, last = np.searchsorted(positions, (lo, hi))
        out[positions[first:last]] = values[first:last]
        if checksum:
            crc = zlib_ng.crc32(out[lo:hi], crc)
    return torch.from_numpy(out).view(held.dtype).reshape(held.shape), crc if checksum else None


def apply_delta_checked(
    state: Mapping[str, torch.Tensor],
    delta: Mapping[str, TensorDelta],
    workers: int | None = None,
) -> tuple[StateDict, dict[str, int]]:
    """``apply_delta``, and ``state_checksums`` of the result from the same pass."""
    return _apply(state, delta, checksum=True, workers=workers)


def apply_delta(
    state: Mapping[str, torch.Tensor], delta: Mapping[str, TensorDelta], workers: int | None = None
) -> StateDict:
    """A new state with the delta applied; ``state`` itself is never modified.

    Unchanged tensors are shared with ``state`` (copy on write), changed ones are fresh
    contiguous copies: whoever still holds the previous snapshot keeps valid weights.
    Tensor by tensor, largest first, on ``workers`` threads (default: every usable core).
    """
    return _apply(state, delta, checksum=False, workers=workers)[0]


def _apply(
    state: Mapping[str, torch.Tensor],
    delta: Mapping[str, TensorDelta],
    checksum: bool,
    workers: int | None,
) -> tuple[StateDict, dict[str, int]]:
    done = per_tensor(
        lambda name: _patched_copy(state[name], delta.get(name), checksum),
        largest_first(state if checksum else delta, state),
        workers,
    )
    out = dict(state)
    out.update((name, tensor) for name, (tensor, _) in done.items())
    crcs = {name: crc for name, (_, crc) in sorted(done.items()) if crc is not None}
    return out, crcs


def apply_delta_inplace(
    state: Mapping[str, torch.Tensor], delta: Mapping[str, TensorDelta]
) -> None:
    """Scatter the delta into ``state``'s own (contiguous, CPU) tensors: for an owner
    that hands its tensors to nobody, such as the writer's copy of what it published."""
    for name in delta:
        target = state[name]
        if not target.is_contiguous() or target.device.type != "cpu":
            raise ValueError(f"{name}: in-place apply needs a contiguous CPU tensor")

    def one(name: str) -> None:
        change = delta[name]
        bits(state[name]).numpy()[change.positions.numpy()] = bits(change.values).numpy()

    per_tensor(one, largest_first(delta, state))


# --- bases ---------------------------------------------------------------------------------


def base_payload(state: Mapping[str, torch.Tensor]) -> StateDict:
    """Tensors ready for safetensors: contiguous, on CPU, no two sharing memory."""
    out: StateDict = {}
    storages: set[tuple[object, int]] = set()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if tensor.numel() and storage in storages:
            tensor = tensor.clone()
        storages.add(storage)
        out[name] = tensor
    return out


def check_base(state: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec]) -> None:
    """A loaded base must hold exactly the stored tensors the manifest lists."""
    found = specs_of(state)
    if found != dict(specs):
        missing = sorted(set(specs) - set(found))
        extra = sorted(set(found) - set(specs))
        raise FormatError(
            RefusalReason.CORRUPT,
            f"base does not match its manifest (missing {missing[:3]}, extra {extra[:3]}, "
            "or dtype/shape differ)",
        )

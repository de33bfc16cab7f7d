"""The manifest: the one small JSON object that makes a version exist.

A version directory holds data files and ``manifest.json``. The manifest is uploaded
last, so its presence means every file it lists is complete; it carries the size and
sha256 of each file, the dtype, shape and CRC-32 of every tensor, and the parent and base
versions, so a reader can verify each file it fetches and each tensor it rebuilds.

Three kinds of version: a ``base`` holds every tensor; a ``delta`` holds the bits that
changed since its parent; an ``adapter`` (a LoRA run's version) holds, whole, the few
tensors it ``overlay``s on its base, every other tensor being the base's, unchanged. An
adapter's parent is its base, so it is a single step from the base whatever came between.

An optional ed25519 signature covers the canonical bytes: the manifest's JSON object
without its ``signature`` field, keys sorted, no whitespace (orjson ``OPT_SORT_KEYS``).
Because the manifest pins every file hash, and applying a chain is deterministic, the
signature covers the weights too: whoever can write to a bucket cannot forge a version
without the key.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from weights.errors import FormatError, RefusalReason

#: Bump when a reader of the previous format could misread a new manifest.
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
"""Largest manifest a reader accepts: a few hundred bytes per tensor, so even a model of
tens of thousands of tensors stays far below it; a bigger object is refused unread."""

Kind = Literal["base", "delta", "adapter"]


@dataclass(frozen=True)
class TensorSpec:
    """Dtype (torch name without the ``torch.`` prefix) and shape of one tensor."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class FileEntry:
    """One data file of a version: stored size, sha256 of the stored bytes, decoded size."""

    name: str
    bytes: int
    sha256: str
    raw_bytes: int  # size after zstd decompression (== bytes for an uncompressed base)


@dataclass(frozen=True)
class Signature:
    """ed25519 signature over the canonical manifest bytes."""

    key_id: str  # first 16 hex digits of sha256(raw public key): says which key to use
    sig: str  # base64 of the 64-byte signature
    alg: str = "ed25519"


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to fetch, verify and rebuild one version."""

    run: str
    version: int
    kind: Kind
    parent: int | None  # the version this one applies on (its base for an adapter); None for a base
    base: int  # the base this version's chain starts from (itself for a base)
    tensors: dict[str, TensorSpec]  # the full state after this version, in name order
    files: tuple[FileEntry, ...]
    checksums: dict[str, int]  # CRC-32 of each stored tensor, see ``format.state_checksums``
    state_sha256: str  # ``format.digest_of_checksums(checksums)``: one id for the weights
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> stored name
    changed_elements: int = 0  # delta only: elements whose bits changed
    overlay: tuple[str, ...] = ()  # adapter only: the tensors its file holds, in name order
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    format: int = FORMAT_VERSION
    signature: Signature | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def stored_tensors(self) -> dict[str, TensorSpec]:
        """The tensors this version's files can hold: an adapter's overlay, else all."""
        if self.kind == "adapter":
            return {name: self.tensors[name] for name in self.overlay if name in self.tensors}
        return self.tensors

    @property
    def total_elements(self) -> int:
        return sum(spec.numel for spec in self.tensors.values())

    def to_dict(self, *, signed: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": self.format,
            "run": self.run,
            "version": self.version,
            "kind": self.kind,
            "parent": self.parent,
            "base": self.base,
            "created_ms": self.created_ms,
            "tensors": {
                name: {"dtype": spec.dtype, "shape": list(spec.shape)}
                for name, spec in self.tensors.items()
            },
            "aliases": dict(self.aliases),
            "files": [
                {"name": f.name, "bytes": f.bytes, "sha256": f.sha256, "raw_bytes": f.raw_bytes}
                for f in self.files
            ],
            "checksums": dict(self.checksums),
            "state_sha256": self.state_sha256,
            "changed_elements": self.changed_elements,
        }
        if self.kind == "adapter":  # older manifests' canonical bytes stay as they were
            data["overlay"] = list(self.overlay)
        if signed and self.signature is not None:
            data["signature"] = {
                "alg": self.signature.alg,
                "key_id": self.signature.key_id,
                "sig": self.signature.sig,
            }
        return data

    def canonical_bytes(self) -> bytes:
        """The bytes a signature covers."""
        return canonical_json(self.to_dict(signed=False))

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)

    def sign(self, key: Ed25519PrivateKey) -> Manifest:
        signature = key.sign(self.canonical_bytes())
        return replace(
            self,
            signature=Signature(
                key_id=key_id(key.public_key()), sig=base64.b64encode(signature).decode()
            ),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse and type-check; raises ``FormatError`` (unknown format, bad manifest)."""
        return parse_manifest(data)[0]


# --- size bounds: what a file of these tensors can need ----------------------------------


_HEADER_SLACK = 4096  # safetensors header: metadata, alignment padding
_ENTRY_SLACK = 160  # per header entry beyond its name: dtype, shape, offsets as JSON


_ITEMSIZE = {
    "float64": 8,
    "int64": 8,
    "uint64": 8,
    "complex64": 8,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "uint16": 2,
}
_MAX_ITEMSIZE = 8  # the widest element the delta format handles


def _itemsize(dtype: str) -> int:
    """Bytes per element; 1-byte types (bool, int8, uint8, float8_*) and the rest by name,
    any other name counted at the widest, so a bound never refuses an honest file."""
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    if dtype in ("bool", "int8", "uint8") or dtype.startswith("float8"):
        return 1
    return _MAX_ITEMSIZE


def _varint_bytes(value: int) -> int:
    return max(1, -(-value.bit_length() // 7))


def max_delta_raw_bytes(specs: Mapping[str, TensorSpec]) -> int:
    """The most bytes a delta of these tensors can decode to: every element changed, each
    position gap taking the longest varint a gap inside its tensor needs, plus headers."""
    total = _HEADER_SLACK
    for name, spec in specs.items():
        n = spec.numel
        per_element = _itemsize(spec.dtype) + _varint_bytes(max(n - 1, 0))
        total += n * per_element + 2 * (len(name.encode()) + _ENTRY_SLACK)
    return total


def max_base_bytes(specs: Mapping[str, TensorSpec]) -> int:
    """The most bytes a base file of these tensors can hold (values plus header)."""
    return _HEADER_SLACK + sum(
        spec.numel * _itemsize(spec.dtype) + len(name.encode()) + _ENTRY_SLACK
        for name, spec in specs.items()
    )


def zstd_bound(raw_bytes: int) -> int:
    """zstd's worst case for ``raw_bytes`` of input (``ZSTD_COMPRESSBOUND``) plus the
    frame header: a compressed file larger than this is not an honest compression."""
    return raw_bytes + (raw_bytes >> 8) + (128 << 10) + 64


def check_file_entry(kind: str, entry: FileEntry, specs: Mapping[str, TensorSpec]) -> None:
    """Refuse a manifest's file entry whose sizes no file of these tensors could have,
    before anything is fetched or decompressed (a reader sizes buffers by them)."""

    def corrupt(problem: str) -> FormatError:
        return FormatError(RefusalReason.CORRUPT, f"{entry.name}: {problem}")

    if entry.bytes < 0 or entry.raw_bytes < 0:
        raise corrupt("negative size")
    if kind == "delta":
        limit = max_delta_raw_bytes(specs)
        if entry.raw_bytes > limit:
            raise corrupt(
                f"raw_bytes {entry.raw_bytes} is more than a delta of the manifest's tensors "
                f"can decode to (at most {limit})"
            )
        if entry.bytes > zstd_bound(entry.raw_bytes):
            raise corrupt(
                f"{entry.bytes} bytes compressed cannot decode to raw_bytes {entry.raw_bytes}"
            )
    else:
        limit = max_base_bytes(specs)
        if entry.bytes > limit:
            raise corrupt(
                f"{entry.bytes} bytes is more than a {kind} of the manifest's tensors can "
                f"hold (at most {limit})"
            )


def canonical_json(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def parse_manifest(data: bytes) -> tuple[Manifest, bytes]:
    """The manifest and the canonical bytes its signature must cover.

    The canonical bytes are rebuilt from the raw JSON object (not from the parsed
    dataclass), so a field this code does not know is still covered by the signature.
    """
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raise FormatError(RefusalReason.BAD_MANIFEST, f"manifest is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise FormatError(RefusalReason.BAD_MANIFEST, "manifest is not a JSON object")
    fmt = raw.get("format")
    if fmt != FORMAT_VERSION:
        raise FormatError(
            RefusalReason.UNKNOWN_FORMAT,
            f"manifest format {fmt!r} is not supported (this reader knows {FORMAT_VERSION})",
        )
    unsigned = {k: v for k, v in raw.items() if k != "signature"}
    try:
        manifest = _from_dict(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(RefusalReason.BAD_MANIFEST, f"malformed manifest: {err!r}") from None
    return manifest, canonical_json(unsigned)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r}")
    return value


def _from_dict(raw: dict[str, Any]) -> Manifest:
    kind = _str(raw["kind"])
    if kind not in ("base", "delta", "adapter"):
        raise ValueError(f"kind must be base, delta or adapter, not {kind!r}")
    parent = raw.get("parent")
    sig = raw.get("signature")
    tensors = {
        _str(name): TensorSpec(
            dtype=_str(spec["dtype"]), shape=tuple(_int(d) for d in spec["shape"])
        )
        for name, spec in raw["tensors"].items()
    }
    files = tuple(
        FileEntry(
            name=_str(f["name"]),
            bytes=_int(f["bytes"]),
            sha256=_str(f["sha256"]),
            raw_bytes=_int(f["raw_bytes"]),
        )
        for f in raw["files"]
    )
    for f in files:
        if "/" in f.name or f.name in ("", ".", "..", MANIFEST_NAME):
            raise ValueError(f"illegal file name {f.name!r}")
    return Manifest(
        format=_int(raw["format"]),
        run=_str(raw["run"]),
        version=_int(raw["version"]),
        kind=kind,  # type: ignore[arg-type]
        parent=None if parent is None else _int(parent),
        base=_int(raw["base"]),
        created_ms=_int(raw["created_ms"]),
        tensors=tensors,
        aliases={_str(k): _str(v) for k, v in raw.get("aliases", {}).items()},
        files=files,
        checksums={_str(k): _int(v) for k, v in raw["checksums"].items()},
        state_sha256=_str(raw["state_sha256"]),
        changed_elements=_int(raw.get("changed_elements", 0)),
        overlay=tuple(_str(name) for name in _list(raw.get("overlay", []))),
        signature=None
        if sig is None
        else Signature(alg=_str(sig["alg"]), key_id=_str(sig["key_id"]), sig=_str(sig["sig"])),
    )


def verify_signature(
    manifest: Manifest, canonical: bytes, public_key: Ed25519PublicKey | None
) -> None:
    """Raise ``FormatError`` unless the manifest is signed by ``public_key``.

    With no key configured every manifest passes: signing is opt-in per deployment, but
    once a follower has a key it refuses unsigned versions outright.
    """
    if public_key is None:
        return
    sig = manifest.signature
    if sig is None:
        raise FormatError(RefusalReason.UNSIGNED, "manifest is not signed")
    if sig.alg != "ed25519":
        raise FormatError(RefusalReason.BAD_SIGNATURE, f"unsupported algorithm {sig.alg!r}")
    try:
        public_key.verify(base64.b64decode(sig.sig, validate=True), canonical)
    except (InvalidSignature, ValueError):
        raise FormatError(
            RefusalReason.BAD_SIGNATURE,
            f"signature (key {sig.key_id}) does not verify with key {key_id(public_key)}",
        ) from None


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keypair(private_path: Path, public_path: Path) -> Ed25519PublicKey:
    """Write a new ed25519 key pair as PEM files (private key readable by the owner only)."""
    key = Ed25519PrivateKey.generate()
    private_path.parent.mkdir(parents=True, exist_ok=True)
    private_path.touch(mode=0o600, exist_ok=False)
    private_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key.public_key()


def load_private_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} is not an ed25519 public key")
    return key


def chain_fields_problem(manifest: Manifest, run: str, version: int) -> str | None:
    """What makes a manifest's run/version/parent/base fields inconsistent, if anything."""
    if manifest.run != run:
        return f"manifest belongs to run {manifest.run!r}"
    if manifest.version != version:
        return f"manifest says version {manifest.version}"
    if manifest.kind == "base" and (manifest.base != version or manifest.parent is not None):
        return "a base must be its own base and have no parent"
    if manifest.kind == "delta" and (
        manifest.parent is None or not manifest.base <= manifest.parent < version
    ):
        return f"delta with parent {manifest.parent} and base {manifest.base}"
    if manifest.kind == "adapter":
        if manifest.parent != manifest.base or not manifest.base < version:
            return f"adapter with parent {manifest.parent} and base {manifest.base}"
        if not manifest.overlay or not set(manifest.overlay) <= manifest.tensors.keys():
            return "an adapter must overlay some of its own tensors"
        if list(manifest.overlay) != sorted(set(manifest.overlay)):
            return "an adapter's overlay must be sorted and without repeats"
    elif manifest.overlay:
        return f"a {manifest.kind} overlays nothing"
    if not manifest.files:
        return "no files"
    return None

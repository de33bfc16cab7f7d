"""The weights format as ``docs/weights-format.md`` documents it, checked against what the
writer really puts in S3: every manifest key is documented, and ``checksums`` /
``state_sha256`` recomputed from a base file by the documented definition (a hand-written
safetensors reader, no rollstream code) match the manifest."""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from pathlib import Path

from support.paths import REPO
from support.weight_states import step, store_for, tiny_state

from core.config import S3Config
from weights.manifest import Manifest, generate_keypair, load_private_key
from weights.writer import DeltaWriter

DOC = REPO / "docs" / "weights-format.md"


def documented_keys() -> dict[str, str]:
    """Each key of the manifest's table, with what its row says it is."""
    text = DOC.read_text()
    table = text[text.index("## The manifest") : text.index("**`checksums`.**")]
    return dict(re.findall(r"^\| `([a-z_0-9]+)` \| ([^|]*)\|", table, re.M))


def raw_tensors(path_bytes: bytes) -> dict[str, bytes]:
    """Tensor name -> raw bytes, read from the safetensors layout (8-byte LE header size,
    JSON header with data_offsets relative to the end of the header)."""
    (size,) = struct.unpack("<Q", path_bytes[:8])
    header = json.loads(path_bytes[8 : 8 + size])
    data = path_bytes[8 + size :]
    return {
        name: data[entry["data_offsets"][0] : entry["data_offsets"][1]]
        for name, entry in header.items()
        if name != "__metadata__"
    }


def test_every_manifest_key_is_documented_and_state_sha256_is_as_defined(
    s3_config: S3Config, tmp_path: Path
) -> None:
    generate_keypair(tmp_path / "key", tmp_path / "key.pub")
    store = store_for(s3_config)
    writer = DeltaWriter(store, signing_key=load_private_key(tmp_path / "key"))
    state = tiny_state()
    writer.publish(state)
    writer.publish(step(state, seed=1))

    # the adapter's manifest: a LoRA run's second version
    adapters = store_for(s3_config)
    key = load_private_key(tmp_path / "key")
    writer = DeltaWriter(adapters, signing_key=key, adapter_tensors=["layers.0.scale"])
    writer.publish(state)
    writer.publish({**state, "layers.0.scale": state["layers.0.scale"] + 1})

    documented = documented_keys()
    adapter_only = {key for key, what in documented.items() if "adapter only" in what}
    assert adapter_only == {"overlay"}
    for got, version, kind in ((store, 0, "base"), (store, 1, "delta"), (adapters, 1, "adapter")):
        raw = json.loads(got.read_manifest(version))
        assert raw["kind"] == kind
        want = set(documented) - (set() if kind == "adapter" else adapter_only)
        assert set(raw) == want, f"undocumented or missing keys in a {kind}"
        assert raw["signature"]["alg"] == "ed25519"

    base = Manifest.from_bytes(store.read_manifest(0))
    blob = store.get_bytes(store.key(0, base.files[0].name))
    tensors = raw_tensors(blob)
    assert set(tensors) == set(base.tensors) == set(base.checksums)
    assert "head.weight" not in tensors and base.aliases == {"head.weight": "embed.weight"}
    checksums = {name: zlib.crc32(data) for name, data in tensors.items()}
    assert checksums == base.checksums
    lines = "".join(f"{name}\0{checksums[name]:08x}\n" for name in sorted(checksums))
    assert hashlib.sha256(lines.encode()).hexdigest() == base.state_sha256

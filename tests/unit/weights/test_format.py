"""Bit-exact weight encoding: property tests over random states and sparse updates.

Everything is compared through integer views of the raw bits, so a -0.0 that became
+0.0 or a NaN whose payload changed is a failure, not a pass.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weights import format as fmt
from weights.errors import FormatError, RefusalReason
from weights.manifest import (
    FileEntry,
    Manifest,
    generate_keypair,
    load_private_key,
    load_public_key,
    parse_manifest,
    verify_signature,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NAMES = ("embed.weight", "layers.0.q.weight", "layers.0.norm", "layers.1.mlp.up", "head.bias")


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Any bit pattern at all: normals, subnormals, infinities, NaNs, both zeros."""
    view = fmt._BITS_BY_SIZE[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(view)
    raw = torch.randint(info.min, info.max, shape, dtype=view, generator=gen)
    return raw.view(dtype)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(fmt.bits(a[k]), fmt.bits(b[k]))
        for k in a
    )


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    shape = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
    return {name: (draw(shape), draw(st.sampled_from(DTYPES))) for name in names}


def mutate(
    state: dict[str, torch.Tensor], fraction: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """A new state where about ``fraction`` of the elements got random new bits."""
    out = {}
    for name, tensor in state.items():
        flat = tensor.clone().reshape(-1)
        mask = torch.rand(flat.shape, generator=gen) < fraction
        fresh = random_bits(tuple(flat.shape), tensor.dtype, gen)
        fmt.bits(flat)[mask] = fmt.bits(fresh)[mask]
        out[name] = flat.reshape(tensor.shape)
    return out


def base_round_trip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    blob = safetensors.torch.save(fmt.base_payload(state), metadata=fmt.BASE_METADATA)
    loaded = safetensors.torch.load(blob)
    fmt.check_base(loaded, fmt.specs_of(state))
    return loaded


def delta_round_trip(
    held: dict[str, torch.Tensor], prev: dict[str, torch.Tensor], curr: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    encoded = fmt.encode_delta(prev, curr)
    changes = fmt.decode_delta(encoded.blob, encoded.raw_bytes, fmt.specs_of(curr))
    return fmt.apply_delta(held, changes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts(),
    seed=st.integers(0, 2**31 - 1),
    base_every=st.integers(1, 8),
    fractions=st.lists(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]), min_size=20, max_size=20),
)
def test_chain_of_20_versions_rebuilds_bit_exact(
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
    seed: int,
    base_every: int,
    fractions: list[float],
) -> None:
    gen = torch.Generator().manual_seed(seed)
    writer = {name: random_bits(shape, dtype, gen) for name, (shape, dtype) in layout.items()}
    reader = base_round_trip(writer)
    for version, fraction in enumerate(fractions, start=1):
        nxt = mutate(writer, fraction, gen)
        if version % base_every == 0:
            reader = base_round_trip(nxt)
        else:
            held, copy = reader, {k: v.clone() for k, v in reader.items()}
            reader = delta_round_trip(held, writer, nxt)
            assert same_bits(held, copy), "applying a delta modified the held state"
        writer = nxt
        assert same_bits(reader, writer), f"v{version} differs"
        assert fmt.state_checksums(reader) == fmt.state_checksums(writer)
        assert fmt.state_digest(reader) == fmt.state_digest(writer)


@pytest.mark.parametrize("slab", [1, 7, 64])
@pytest.mark.parametrize("workers", [1, 3])
def test_slabs_and_threads_give_the_same_delta_checksums_and_state(
    monkeypatch: pytest.MonkeyPatch, slab: int, workers: int
) -> None:
    """Tensors are compared, patched and checksummed a slab at a time on several threads:
    positions at slab edges, untouched and wholly changed tensors come out as one pass."""
    monkeypatch.setattr(fmt, "SLAB_ELEMENTS", slab)
    gen = torch.Generator().manual_seed(slab * 10 + workers)
    prev = {
        name: random_bits((33, 5), dtype, gen)
        for name, dtype in zip(NAMES, DTYPES * 2, strict=False)
    }
    curr = mutate(prev, 0.05, gen)
    curr[NAMES[0]] = prev[NAMES[0]].clone()  # untouched
    curr[NAMES[1]] = mutate({"w": prev[NAMES[1]]}, 1.0, gen)["w"]  # every element new
    held = {k: v.clone() for k, v in prev.items()}

    encoded = fmt.encode_delta(prev, curr, workers=workers)
    assert encoded.checksums == fmt.state_checksums(curr)
    changes = fmt.decode_delta(encoded.blob, encoded.raw_bytes, fmt.specs_of(curr))
    for name in curr:
        differ = np.flatnonzero(fmt.bits(prev[name]).numpy() != fmt.bits(curr[name]).numpy())
        found = changes[name].positions.numpy() if name in changes else np.empty(0)
        assert np.array_equal(found, differ), name
    applied, checksums = fmt.apply_delta_checked(prev, changes, workers=workers)
    assert same_bits(applied, curr) and checksums == fmt.state_checksums(curr)
    assert same_bits(fmt.apply_delta(prev, changes, workers=workers), curr)
    assert same_bits(prev, held), "applying a delta modified the held state"
    inplace = {k: v.clone() for k, v in prev.items()}
    fmt.apply_delta_inplace(inplace, changes)
    assert same_bits(inplace, curr)


def test_checksums_are_zlibs_crc32() -> None:
    """Manifests already published carry zlib's CRC-32: a faster implementation must give
    the same numbers, or every stored version would be refused."""
    gen = torch.Generator().manual_seed(3)
    state = {
        name: random_bits((257, 3), dtype, gen)
        for name, dtype in zip(NAMES, DTYPES * 2, strict=False)
    }
    expected = {name: zlib.crc32(fmt.bits(state[name]).numpy()) for name in sorted(state)}
    assert fmt.state_checksums(state) == expected


def test_signed_zeros_and_nan_payloads_survive() -> None:
    prev = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.float32)}
    curr = {"w": prev["w"].clone()}
    fmt.bits(curr["w"])[0] = fmt.bits(torch.tensor([-0.0]))[0]  # +0.0 -> -0.0 (equal as floats)
    fmt.bits(curr["w"])[2] = 0x7FC00001  # a NaN with another payload
    encoded = fmt.encode_delta(prev, curr)
    assert encoded.changed_elements == 2
    out = fmt.apply_delta(
        prev, fmt.decode_delta(encoded.blob, encoded.raw_bytes, fmt.specs_of(curr))
    )
    assert same_bits(out, curr)


def test_unchanged_state_gives_an_empty_delta() -> None:
    state = {"w": torch.randn(100, dtype=torch.float32).to(torch.bfloat16)}
    encoded = fmt.encode_delta(state, {"w": state["w"].clone()})
    assert encoded.changed_elements == 0
    assert fmt.decode_delta(encoded.blob, encoded.raw_bytes, fmt.specs_of(state)) == {}


@given(st.lists(st.integers(0, 2**40), unique=True, max_size=300).map(sorted))
def test_varint_positions_round_trip(positions: list[int]) -> None:
    array = np.array(positions, dtype=np.int64)
    encoded = fmt.encode_positions(array)
    assert np.array_equal(fmt.decode_positions(encoded, 2**40 + 1), array)


def test_varint_gaps_are_one_byte_when_dense() -> None:
    assert fmt.encode_positions(np.arange(0, 1000, 3, dtype=np.int64)).size == 334
    assert list(fmt.encode_positions(np.array([0, 1, 130], dtype=np.int64))) == [0, 0, 0x80, 1]


@pytest.mark.parametrize(
    ("stream", "numel"),
    [
        (np.array([0x80], dtype=np.uint8), 10),  # ends inside a number
        (np.array([5, 5], dtype=np.uint8), 10),  # positions 5 and 11: past the end
        (np.array([0xFF] * 10 + [1], dtype=np.uint8), 10),  # longer than 9 bytes
    ],
)
def test_corrupt_position_streams_are_rejected(stream: np.ndarray, numel: int) -> None:
    with pytest.raises(FormatError) as err:
        fmt.decode_positions(stream, numel)
    assert err.value.reason is RefusalReason.CORRUPT


def test_delta_with_a_wrong_dtype_is_rejected() -> None:
    prev = {"w": torch.zeros(8, dtype=torch.float16)}
    curr = {"w": torch.ones(8, dtype=torch.float16)}
    encoded = fmt.encode_delta(prev, curr)
    claimed = {"w": fmt.specs_of(curr)["w"].__class__("bfloat16", (8,))}
    with pytest.raises(FormatError, match="ill-typed"):
        fmt.decode_delta(encoded.blob, encoded.raw_bytes, claimed)
    with pytest.raises(FormatError, match="declares"):
        fmt.decode_delta(encoded.blob, encoded.raw_bytes + 1, fmt.specs_of(curr))


def test_delta_refuses_layout_changes() -> None:
    with pytest.raises(ValueError, match="write a base"):
        fmt.encode_delta({"w": torch.zeros(4)}, {"w": torch.zeros(5)})


def test_tied_tensors_are_stored_once_and_rejoined() -> None:
    shared = torch.randn(4, 3)
    state = {"embed": shared, "head": shared, "norm": torch.ones(3)}
    unique, aliases = fmt.split_aliases(state)
    assert set(unique) == {"embed", "norm"} and aliases == {"head": "embed"}
    rejoined = fmt.join_aliases(base_round_trip(unique), aliases)
    assert rejoined["head"] is rejoined["embed"]
    assert same_bits(rejoined, state)


def test_tiny_llama_bf16_step_round_trip() -> None:
    """A real model's tied state through one optimiser step, as the writer sees it."""
    from core.models import build_tiny_llama

    model = build_tiny_llama(seed=1)
    prev = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    curr = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    prev_u, _ = fmt.split_aliases(prev)
    curr_u, aliases = fmt.split_aliases(curr)
    held = base_round_trip(prev_u)
    rebuilt = fmt.join_aliases(delta_round_trip(held, prev_u, curr_u), aliases)
    assert same_bits(rebuilt, curr)


# --- manifests ---------------------------------------------------------------------------


def make_manifest(**overrides: object) -> Manifest:
    fields: dict[str, object] = {
        "run": "r1",
        "version": 3,
        "kind": "delta",
        "parent": 2,
        "base": 0,
        "tensors": fmt.specs_of({"w": torch.zeros(2, 3, dtype=torch.bfloat16)}),
        "files": (FileEntry("abc.delta.safetensors.zst", 10, "0" * 64, 20),),
        "checksums": {"w": 12345},
        "state_sha256": fmt.digest_of_checksums({"w": 12345}),
    }
    fields.update(overrides)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_manifest_round_trip() -> None:
    manifest = make_manifest(aliases={"head": "w"}, changed_elements=4)
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest


def test_manifest_signature(tmp_path) -> None:
    generate_keypair(tmp_path / "k", tmp_path / "k.pub")
    generate_keypair(tmp_path / "other", tmp_path / "other.pub")
    public = load_public_key(tmp_path / "k.pub")
    signed = make_manifest().sign(load_private_key(tmp_path / "k"))

    manifest, canonical = parse_manifest(signed.to_bytes())
    verify_signature(manifest, canonical, public)  # accepted
    verify_signature(*parse_manifest(make_manifest().to_bytes()), None)  # no key: no check

    cases = {
        RefusalReason.UNSIGNED: make_manifest().to_bytes(),
        RefusalReason.BAD_SIGNATURE: signed.to_bytes().replace(b'"version":3', b'"version":4'),
    }
    for reason, data in cases.items():
        with pytest.raises(FormatError) as err:
            verify_signature(*parse_manifest(data), public)
        assert err.value.reason is reason
    with pytest.raises(FormatError) as err:
        verify_signature(
            *parse_manifest(signed.to_bytes()), load_public_key(tmp_path / "other.pub")
        )
    assert err.value.reason is RefusalReason.BAD_SIGNATURE
    # A field this reader does not know is still covered by the signature.
    extra = signed.to_bytes().replace(b'{"aliases"', b'{"zz_injected":1,"aliases"')
    with pytest.raises(FormatError):
        verify_signature(*parse_manifest(extra), public)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"not json", RefusalReason.BAD_MANIFEST),
        (b"[]", RefusalReason.BAD_MANIFEST),
        (b'{"format": 2}', RefusalReason.UNKNOWN_FORMAT),
        (b'{"format": 1, "run": "r"}', RefusalReason.BAD_MANIFEST),
    ],
)
def test_bad_manifests_are_refused(data: bytes, reason: RefusalReason) -> None:
    with pytest.raises(FormatError) as err:
        Manifest.from_bytes(data)
    assert err.value.reason is reason


def test_manifest_rejects_path_like_file_names() -> None:
    data = make_manifest(files=(FileEntry("../x", 1, "0" * 64, 1),)).to_bytes()
    with pytest.raises(FormatError):
        Manifest.from_bytes(data)

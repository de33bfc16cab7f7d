"""The scored-group record: round trips, and every kind of garbage raises ``DecodeError``."""

from __future__ import annotations

import contextlib
import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import DecodeError, DecodeReason, encode, record_checksum
from schemas.group import (
    SampleDiagnostics,
    ScoredGroup,
    decode_group,
    encode_group,
)
from schemas.trajectory import NO_VERSION, Trajectory


def sample(index: int, *, group: str = "g-1", logp_old: bool = True, n: int = 5) -> Trajectory:
    rng = np.random.default_rng(index)
    traj = Trajectory.create(
        run_id="run-a",
        trajectory_id=f"t-{index}",
        group_id=group,
        group_size=4,
        sample_index=index,
        producer_id="p",
        region="r",
        task="copy",
        prompt_ids=rng.integers(0, 16, 3),
        response_ids=rng.integers(0, 16, n),
        logp_infer=-rng.exponential(1.0, n),
        segment_versions=[2, 3],
        segment_lengths=[2, n - 2],
        reward=float(index) / 4,
        reward_details={"ok": True},
        finish_reason="stop",
        created_at_ms=1,
        finished_at_ms=2,
    )
    if logp_old:
        traj = traj.with_old_logits(traj.logp_infer + 0.01)
    return traj.with_advantage(index - 1.5)


def group(n: int = 3, **overrides) -> ScoredGroup:
    samples = tuple(sample(i, logp_old=i != 1) for i in range(n))
    fields = dict(
        run_id="run-a",
        group_id="g-1",
        group_size=4,
        trainer_version_seen=5,
        samples=samples,
        diagnostics=tuple(SampleDiagnostics.of(s, staleness=2) for s in samples),
        reward_mean=0.25,
        reward_std=0.25,
        complete=False,
        emitted_at_ms=1_700_000_000_000,
    )
    fields.update(overrides)
    return ScoredGroup(**fields)


def test_round_trip_is_bit_exact() -> None:
    original = group()
    back = decode_group(encode_group(original))
    assert back == original
    assert back.samples[0].logp_old is not None
    assert back.samples[1].logp_old is None
    assert math.isnan(back.diagnostics[1].k3_kl)
    assert back.diagnostics[0].staleness == 2


def test_empty_group_and_unknown_version_round_trip() -> None:
    original = group(0, trainer_version_seen=NO_VERSION, reward_mean=math.nan)
    back = decode_group(encode_group(original))
    assert back == original and back.samples == ()


def test_diagnostics_of_matching_logits() -> None:
    traj = sample(0)
    traj = traj.with_old_logits(traj.logp_infer)
    diag = SampleDiagnostics.of(traj, staleness=0)
    assert diag.k3_kl == 0 and diag.d_mean == diag.d_min == diag.d_max == 1.0


def test_k3_is_non_negative() -> None:
    diag = SampleDiagnostics.of(sample(2), staleness=1)
    assert diag.k3_kl >= 0 and diag.d_min <= diag.d_mean <= diag.d_max


def test_samples_must_belong_to_the_group() -> None:
    with pytest.raises(ValueError, match="belongs to group"):
        group(
            samples=(sample(0, group="other"),), diagnostics=(SampleDiagnostics.of(sample(0), 0),)
        )
    with pytest.raises(ValueError, match="diagnostics"):
        group(diagnostics=())


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b"", DecodeReason.EMPTY),
        (lambda b: b"XXXX" + b[4:], DecodeReason.BAD_MAGIC),
        (lambda b: b[:4] + bytes([99]) + b[5:], DecodeReason.UNKNOWN_SCHEMA_VERSION),
        (lambda b: b[:5] + bytes([1]) + b[6:], DecodeReason.UNKNOWN_RECORD_KIND),
        (lambda b: b[:20], DecodeReason.TRUNCATED),
        (lambda b: b[:-10], DecodeReason.TRUNCATED),
        (lambda b: b + b"\x00", DecodeReason.TRAILING_BYTES),
        (lambda b: b[:40] + bytes([b[40] ^ 0xFF]) + b[41:], DecodeReason.CHECKSUM_MISMATCH),
    ],
)
def test_garbage_raises_decode_error(mutate, reason) -> None:
    with pytest.raises(DecodeError) as info:
        decode_group(mutate(encode_group(group())))
    assert info.value.reason == reason


def reseal(body: bytes) -> bytes:
    """Fix length and checksum so that the layout checks behind them are reached."""
    total = len(body) + 4
    body = body[:8] + struct.pack("<I", total) + body[12:]
    return body + struct.pack("<I", record_checksum(body))


def test_inconsistent_layout_with_valid_checksum() -> None:
    data = encode_group(group())
    body = data[:-4]
    count_off = 16
    more = body[:count_off] + struct.pack("<I", 7) + body[count_off + 4 :]
    with pytest.raises(DecodeError) as info:
        decode_group(reseal(more))
    assert info.value.reason in (DecodeReason.BAD_LAYOUT, DecodeReason.BAD_JSON)


def test_bad_meta_json_with_valid_checksum() -> None:
    meta = b'{"run_id": 3}'
    body = struct.pack("<6sH I I I I", b"RSTM\x01\x02", 0, 0, len(meta), 0, 0) + meta
    with pytest.raises(DecodeError) as info:
        decode_group(reseal(body))
    assert info.value.reason == DecodeReason.BAD_JSON


def test_a_trajectory_record_is_not_a_group() -> None:
    with pytest.raises(DecodeError) as info:
        decode_group(encode(sample(0)))
    assert info.value.reason == DecodeReason.UNKNOWN_RECORD_KIND


def test_oversize_is_refused_both_ways() -> None:
    data = encode_group(group())
    with pytest.raises(ValueError, match="oversize"):
        encode_group(group(), max_bytes=len(data) - 1)
    with pytest.raises(DecodeError) as info:
        decode_group(data, max_bytes=len(data) - 1)
    assert info.value.reason == DecodeReason.OVERSIZE


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 10_000))
def test_random_bytes_and_flips_never_raise_anything_else(noise: bytes, position: int) -> None:
    for data in (noise, b"RSTM\x01\x02" + noise):
        with pytest.raises(DecodeError):
            decode_group(data)
    good = bytearray(encode_group(group()))
    good[position % len(good)] ^= 0x5A
    with contextlib.suppress(DecodeError):
        decode_group(bytes(good))

"""The binary record codec, Kafka routing headers, the Trajectory helpers and control messages.

Pure unit and property tests: no Kafka, no S3.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.paths import DATA

from schemas.codec import (
    HEADER_SIZE,
    MAGIC,
    DecodeError,
    DecodeReason,
    RoutingHeaders,
    decode,
    encode,
    encoded_size,
    header_disagreements,
    headers_to_dict,
    parse_headers,
    record_checksum,
    routing_headers,
)
from schemas.control import (
    DEAD_LETTER_HEADER,
    DeadLetter,
    StaleRecord,
    VersionAnnouncement,
)
from schemas.trajectory import NO_VERSION, EpisodeEnd, Trajectory, TurnKind

# Bit patterns the codec must carry untouched: quiet/signalling NaNs with payloads, both
# infinities, both zeros, the smallest subnormal, the largest finite value.
SPECIAL_FLOAT32_BITS = np.array(
    [0x7FC00000, 0xFFC00001, 0x7FA00123, 0x7F800000, 0xFF800000, 0x80000000, 0, 1, 0x7F7FFFFF],
    dtype=np.uint32,
)


def realistic_record(**changes: object) -> Trajectory:
    """Prompt 256, response 512 tokens over two versions, like the benchmark's."""
    rng = np.random.default_rng(7)
    record = Trajectory.create(
        run_id="run-7",
        trajectory_id="traj-0001",
        group_id="group-0001",
        group_size=8,
        sample_index=3,
        producer_id="gen-a-0",
        region="region-a",
        task="reverse3",
        prompt_ids=rng.integers(0, 50_000, 256),
        response_ids=rng.integers(0, 50_000, 512),
        logp_infer=-rng.exponential(1.0, 512),
        segment_versions=[41, 42],
        segment_lengths=[300, 212],
        reward=0.75,
        reward_details={"exact": False, "share": 0.75, "judge": "rule"},
        finish_reason="stop",
        created_at_ms=1_700_000_000_000,
        finished_at_ms=1_700_000_000_900,
    )
    return dataclasses.replace(record, **changes)


def random_float32(rng: np.random.Generator, size: int) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included) with the special values mixed in."""
    bits = rng.integers(0, 2**32, size, dtype=np.uint32)
    if size:
        positions = rng.integers(0, size, min(size, len(SPECIAL_FLOAT32_BITS)))
        bits[positions] = SPECIAL_FLOAT32_BITS[: len(positions)]
    return bits.view(np.float32)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)  # orjson writes NaN/inf as null
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
text = st.text(max_size=40)
policy_names = st.sampled_from(["", "alice", "bob"]) | text
int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    """Any record the dataclass can hold with wire dtypes, valid or not."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n_prompt = draw(st.integers(0, 2000))
    n_response = draw(st.integers(0, 2000))
    n_segments = draw(st.integers(0, 8))
    logp_old = None
    if draw(st.booleans()):
        logp_old = random_float32(rng, draw(st.sampled_from([n_response, 0, 3])))
    turn_lengths = turn_kinds = None
    if draw(st.booleans()):  # a multi-turn layout, well-formed or not
        n_turns = draw(st.integers(0, 12))
        turn_lengths = rng.integers(-5, 300, n_turns, dtype=np.int32)
        turn_kinds = rng.integers(0, 256, draw(st.sampled_from([n_turns, 0, 2])), dtype=np.uint8)
    return Trajectory(
        run_id=draw(text),
        trajectory_id=draw(text),
        group_id=draw(text),
        group_size=draw(int32),
        sample_index=draw(int32),
        producer_id=draw(text),
        region=draw(text),
        task=draw(text),
        prompt_ids=rng.integers(-(2**31), 2**31, n_prompt, dtype=np.int32),
        response_ids=rng.integers(-(2**31), 2**31, n_response, dtype=np.int32),
        logp_infer=random_float32(rng, n_response),
        segment_versions=np.sort(rng.integers(-(2**62), 2**62, n_segments, dtype=np.int64)),
        segment_lengths=rng.integers(-5, 2000, n_segments, dtype=np.int32),
        reward=draw(st.floats()),
        reward_details=draw(st.dictionaries(st.text(max_size=8), json_values, max_size=5)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"]) | text),
        created_at_ms=draw(int64),
        finished_at_ms=draw(int64),
        logp_old=logp_old,
        old_logits_status=draw(st.sampled_from(["missing", "exact", "approx", "off"]) | text),
        advantage=draw(st.none() | st.floats()),
        turn_lengths=turn_lengths,
        turn_kinds=turn_kinds,
        tool_calls=draw(int32),
        episode_end=draw(st.sampled_from(["", "done", "max_turns", "tool_timeout"]) | text),
        policy=draw(policy_names),
        # any length, with or without turns: the codec carries what validation refuses
        turn_policies=draw(
            st.none() | st.tuples() | st.lists(policy_names, max_size=14).map(tuple)
        ),
    )


def reseal(data: bytes | bytearray) -> bytes:
    """Recompute the trailing checksum: lets a test forge records the checksum accepts."""
    body = bytes(data[:-4])
    return body + struct.pack("<I", record_checksum(body))


def decode_error(data: bytes) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode(data)
    return info.value


# --- round trip -------------------------------------------------------------------------


def assert_bitwise_equal(a: Trajectory, b: Trajectory) -> None:
    """Field by field, independent of ``Trajectory.__eq__``."""
    for field in dataclasses.fields(Trajectory):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), field.name
            assert x.dtype == y.dtype, field.name
            unsigned = np.dtype(f"u{x.dtype.itemsize}")
            assert np.array_equal(x.view(unsigned), y.view(unsigned)), field.name
        elif isinstance(x, float):
            assert struct.pack("<d", x) == struct.pack("<d", y), field.name
        else:
            assert x == y, field.name
            assert type(x) is type(y), field.name


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories())
def test_encode_decode_is_identity(traj: Trajectory) -> None:
    data = encode(traj)
    assert len(data) == encoded_size(traj)
    decoded = decode(data)
    assert_bitwise_equal(decoded, traj)
    assert decoded == traj


def test_realistic_record_round_trips_and_is_compact() -> None:
    traj = realistic_record().with_old_logits(np.full(512, -0.5)).with_advantage(-1.25)
    data = encode(traj)
    raw = sum(a.nbytes for a in (traj.prompt_ids, traj.response_ids, traj.logp_infer))
    raw += traj.logp_old.nbytes + traj.segment_versions.nbytes + traj.segment_lengths.nbytes
    assert len(data) <= 1.2 * raw
    decoded = decode(data)
    assert_bitwise_equal(decoded, traj)
    assert decoded.advantage == -1.25
    assert decoded.old_logits_status == "exact"


def test_absent_optionals_stay_absent_and_empty_ones_stay_empty() -> None:
    absent = decode(encode(realistic_record()))
    assert absent.logp_old is None
    assert absent.advantage is None
    empty = decode(encode(realistic_record(logp_old=np.empty(0, np.float32), advantage=0.0)))
    assert empty.logp_old is not None and len(empty.logp_old) == 0
    assert empty.advantage == 0.0


def test_equality_is_bitwise() -> None:
    traj = realistic_record()
    assert traj == decode(encode(traj))
    other_nan = traj.logp_infer.copy()
    other_nan.view(np.uint32)[0] = 0x7FC00001
    same_nan = traj.logp_infer.copy()
    same_nan.view(np.uint32)[0] = 0x7FC00001
    assert realistic_record(logp_infer=other_nan) == realistic_record(logp_infer=same_nan)
    assert realistic_record(logp_infer=other_nan) != traj
    assert realistic_record(reward=0.0) != realistic_record(reward=-0.0)
    assert realistic_record(task="x") != traj
    assert realistic_record(advantage=None) != realistic_record(advantage=0.0)


def test_decoded_arrays_are_read_only_views_of_the_message() -> None:
    data = encode(realistic_record())
    decoded = decode(data)
    for array in (decoded.prompt_ids, decoded.response_ids, decoded.logp_infer):
        assert not array.flags.writeable
        assert array.base is data  # zero-copy
    with pytest.raises(ValueError):
        decoded.response_ids[0] = 1


def test_mutable_input_is_copied_before_decoding() -> None:
    traj = realistic_record()
    buffer = bytearray(encode(traj))
    decoded = decode(buffer)
    buffer[HEADER_SIZE : HEADER_SIZE + 64] = bytes(64)  # caller reuses its buffer
    assert decoded == traj


# --- defects ----------------------------------------------------------------------------


@pytest.mark.parametrize("traj", [realistic_record(), realistic_record(task="é" * 3)])
def test_every_truncation_is_reported_with_sizes(traj: Trajectory) -> None:
    data = encode(traj)
    assert decode_error(b"").reason == DecodeReason.EMPTY
    for size in range(1, len(data)):
        error = decode_error(data[:size])
        assert error.reason == DecodeReason.TRUNCATED, size
        assert f"have {size}" in str(error)
    assert f"expected {len(data)} bytes" in str(decode_error(data[:-1]))


def test_every_corrupted_byte_is_detected() -> None:
    data = encode(realistic_record())
    for position in range(len(data)):
        for mask in (0x01, 0xFF):
            corrupted = bytearray(data)
            corrupted[position] ^= mask
            with pytest.raises(DecodeError):
                decode(bytes(corrupted))
    body_position = HEADER_SIZE + 100
    corrupted = bytearray(data)
    corrupted[body_position] ^= 0x10
    assert decode_error(bytes(corrupted)).reason == DecodeReason.CHECKSUM_MISMATCH


def test_trailing_bytes() -> None:
    error = decode_error(encode(realistic_record()) + b"\x00")
    assert error.reason == DecodeReason.TRAILING_BYTES
    assert "1 more" in str(error)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_raises_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER_SIZE + 4, max_size=400))
def test_garbage_behind_a_valid_preamble_raises_decode_error(data: bytes) -> None:
    forged = bytearray(MAGIC + bytes([1, 1, 0, 0]) + data[8:])
    struct.pack_into("<I", forged, 8, len(forged))  # right length: reaches the checksum
    assert decode_error(bytes(forged)).reason == DecodeReason.CHECKSUM_MISMATCH


def test_bad_magic_names_the_bytes() -> None:
    error = decode_error(orjson.dumps({"prompt_ids": [1, 2]}))
    assert error.reason == DecodeReason.BAD_MAGIC
    assert "7b22" in str(error)  # '{"'
    assert decode_error(b"RX").reason == DecodeReason.BAD_MAGIC
    assert decode_error(b"RS").reason == DecodeReason.TRUNCATED  # could still be a record


def test_unknown_schema_version_says_which() -> None:
    data = bytearray(encode(realistic_record()))
    data[4] = 9
    error = decode_error(bytes(data))
    assert error.reason == DecodeReason.UNKNOWN_SCHEMA_VERSION
    assert "schema version 9" in str(error)
    assert "[1, 2, 3]" in str(error)


@pytest.mark.parametrize(("kind", "named"), [(2, "scored_group"), (77, "77")])
def test_unknown_record_kind(kind: int, named: str) -> None:
    data = bytearray(encode(realistic_record()))
    data[5] = kind
    error = decode_error(bytes(data))
    assert error.reason == DecodeReason.UNKNOWN_RECORD_KIND
    assert named in str(error)


def test_bad_utf8_names_the_field() -> None:
    data = bytearray(encode(realistic_record()))
    position = data.index(b"region-a")
    data[position] = 0xFF
    error = decode_error(reseal(data))
    assert error.reason == DecodeReason.BAD_UTF8
    assert "region" in str(error)


@pytest.mark.parametrize("replacement", [b"{not json", b"[1, 2, 3]"])
def test_bad_reward_details_json(replacement: bytes) -> None:
    traj = realistic_record(reward_details={"k": "x" * (len(replacement) - 8)})
    details = orjson.dumps(traj.reward_details)
    assert len(details) == len(replacement)
    data = bytearray(encode(traj))
    position = data.index(details)
    data[position : position + len(details)] = replacement
    error = decode_error(reseal(data))
    assert error.reason == DecodeReason.BAD_JSON
    assert "reward_details" in str(error)


def test_inconsistent_counts_are_a_layout_error() -> None:
    data = bytearray(encode(realistic_record()))
    struct.pack_into("<I", data, 24, 511)  # n_response: 512 -> 511, total length unchanged
    error = decode_error(reseal(data))
    assert error.reason == DecodeReason.BAD_LAYOUT
    assert "imply" in str(error)


def test_unknown_flags_are_a_layout_error() -> None:
    data = bytearray(encode(realistic_record()))
    data[6] |= 0x80
    assert decode_error(reseal(data)).reason == DecodeReason.BAD_LAYOUT


def test_oversize_on_both_sides() -> None:
    traj = realistic_record()
    data = encode(traj)
    with pytest.raises(DecodeError) as info:
        decode(data, max_bytes=len(data) - 1)
    assert info.value.reason == DecodeReason.OVERSIZE
    assert decode(data, max_bytes=len(data)) == traj
    with pytest.raises(ValueError, match="oversize"):
        encode(traj, max_bytes=len(data) - 1)


def test_decode_error_pickles_with_its_reason() -> None:
    error = decode_error(b"nope")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.reason == error.reason
    assert str(copy) == str(error)
    assert isinstance(copy, ValueError)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"prompt_ids": np.arange(4, dtype=np.int64)}, "prompt_ids"),
        ({"response_ids": [1, 2, 3]}, "response_ids"),
        ({"logp_infer": np.zeros((2, 256), np.float32)}, "logp_infer"),
        ({"task": "x" * 70_000}, "task"),
        ({"region": "\ud800"}, "region"),
        ({"reward_details": {"x": object()}}, "reward_details"),
        ({"reward_details": {1: "non-string key"}}, "reward_details"),
        ({"reward_details": ["a list"]}, "reward_details"),
        ({"group_size": 2**31}, "group_size"),
    ],
)
def test_encode_refuses_what_the_format_cannot_carry(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        encode(realistic_record(**changes))


# --- Trajectory helpers -----------------------------------------------------------------


def test_versions_and_token_versions() -> None:
    traj = realistic_record(
        segment_versions=np.array([5, 5, 7], np.int64),
        segment_lengths=np.array([2, 500, 10], np.int32),
    )
    assert (traj.min_version, traj.max_version) == (5, 7)
    versions = traj.token_versions()
    assert versions.dtype == np.int64
    assert len(versions) == traj.num_response_tokens == 512
    assert versions[0] == 5 and versions[501] == 5 and versions[502] == 7 and versions[-1] == 7
    empty = realistic_record(segment_versions=np.empty(0, np.int64))
    assert empty.min_version == empty.max_version == NO_VERSION


def test_later_stages_attach_fields_without_touching_the_original() -> None:
    traj = realistic_record()
    scored = traj.with_old_logits([-0.1] * 512, status="approx").with_advantage(1)
    assert scored.logp_old.dtype == np.float32 and len(scored.logp_old) == 512
    assert scored.old_logits_status == "approx"
    assert scored.advantage == 1.0 and isinstance(scored.advantage, float)
    assert traj.logp_old is None and traj.advantage is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        traj.reward = 1.0  # type: ignore[misc]


def test_create_casts_to_wire_dtypes_but_refuses_lossy_integer_casts() -> None:
    traj = realistic_record()
    fields = {f.name: getattr(traj, f.name) for f in dataclasses.fields(Trajectory)}
    made = Trajectory.create(**{**fields, "prompt_ids": [1, 2, 3], "logp_infer": [-0.5] * 512})
    assert made.prompt_ids.dtype == np.int32
    assert made.logp_infer.dtype == np.float32
    with pytest.raises(ValueError, match="prompt_ids"):
        Trajectory.create(**{**fields, "prompt_ids": np.array([2**40])})
    with pytest.raises(ValueError, match="response_ids"):
        Trajectory.create(**{**fields, "response_ids": [1.5]})


# --- Kafka headers ----------------------------------------------------------------------


def test_routing_headers_round_trip() -> None:
    traj = realistic_record()
    headers = routing_headers(traj)
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in headers)
    parsed = parse_headers([("traceparent", b"00-abc"), *headers])  # foreign headers ignored
    assert parsed == RoutingHeaders(
        schema_version=3,
        run_id="run-7",
        group_id="group-0001",
        trajectory_id="traj-0001",
        min_version=41,
        max_version=42,
        producer_id="gen-a-0",
        region="region-a",
        turns=1,
        policy_tokens=512,
        policy="",
    )
    assert dict(headers)["rs-policy"] == b""  # always sent, empty for the unnamed policy
    assert parse_headers(dict(headers)) == parsed  # Faust hands over a mapping


def test_parse_headers_rejections_name_the_header() -> None:
    headers = routing_headers(realistic_record())
    cases = {
        "rs-region": [h for h in headers if h[0] != "rs-region"],
        "rs-min-version": [(k, b"forty" if k == "rs-min-version" else v) for k, v in headers],
        "rs-run-id": [(k, None if k == "rs-run-id" else v) for k, v in headers],
        "rs-group-id": [*headers, ("rs-group-id", b"other")],
    }
    for key, bad in cases.items():
        with pytest.raises(DecodeError) as info:
            parse_headers(bad)
        assert info.value.reason == DecodeReason.BAD_HEADERS
        assert key in str(info.value)
    with pytest.raises(DecodeError, match="missing"):
        parse_headers(None)
    assert headers_to_dict(None) == {}


# --- control messages -------------------------------------------------------------------

SHA = "ab" * 32


def announcement(**changes: object) -> VersionAnnouncement:
    fields: dict[str, object] = {
        "run": "run-7",
        "version": 12,
        "uri": "s3://rollstream/weights/run-7/v12/",
        "parent": 11,
        "base": 10,
        "sha256": SHA,
        "bytes": 123_456,
        "published_at_ms": 1_700_000_000_000,
    }
    return VersionAnnouncement(**{**fields, **changes})  # type: ignore[arg-type]


def test_version_announcement_round_trip() -> None:
    delta = announcement()
    assert VersionAnnouncement.from_json(delta.to_json()) == delta
    assert not delta.is_base
    base = announcement(version=10, parent=None, base=10)
    assert base.is_base
    assert VersionAnnouncement.from_json(base.to_json().decode()) == base
    assert orjson.loads(base.to_json())["parent"] is None


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.pop("sha256"), "sha256"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.update(version="12"), "version"),
        (lambda d: d.update(version=True), "version"),
        (lambda d: d.update(parent="11"), "parent"),
        (lambda d: d.update(parent=12), "parent"),
        (lambda d: d.update(base=13), "base"),
        (lambda d: d.update(parent=9), "parent"),  # a delta's parent is at or after its base
        (lambda d: d.update(parent=None), "base"),  # a full base must be its own base
        (lambda d: d.update(bytes=-1), "bytes"),
        (lambda d: d.update(sha256="AB" * 32), "sha256"),
        (lambda d: d.update(run=""), "run"),
        (lambda d: d.update(published_at_ms=1.5), "published_at_ms"),
    ],
)
def test_version_announcement_rejections_name_the_field(edit, named: str) -> None:
    obj = orjson.loads(announcement().to_json())
    edit(obj)
    with pytest.raises(ValueError, match=named):
        VersionAnnouncement.from_json(orjson.dumps(obj))


@pytest.mark.parametrize("data", [b"", b"{", b"[1]", b"null", "\xff"])
def test_control_messages_reject_non_objects(data: bytes | str) -> None:
    for cls in (VersionAnnouncement, DeadLetter, StaleRecord):
        with pytest.raises(ValueError, match=cls.__name__):
            cls.from_json(data)


def test_dead_letter_travels_as_a_header_next_to_the_raw_value() -> None:
    raw = b"\x00garbage that did not decode"
    letter = DeadLetter(
        reason="decode_error",
        detail="bad_magic: starts with 00676172",
        source_topic="rollouts.raw",
        partition=3,
        offset=1234,
    )
    headers = [("rs-run-id", b"run-7"), letter.header()]
    assert headers[1][0] == DEAD_LETTER_HEADER
    assert DeadLetter.from_headers(headers) == letter
    assert DeadLetter.from_json(letter.to_json()) == letter
    assert raw not in letter.to_json()  # the raw record is the Kafka value, not in the JSON
    with pytest.raises(ValueError, match=DEAD_LETTER_HEADER):
        DeadLetter.from_headers([("rs-run-id", b"run-7")])
    with pytest.raises(ValueError, match="offset"):
        DeadLetter(reason="x", detail="", source_topic="t", partition=0, offset=-1)


def test_stale_record_round_trip_and_rejections() -> None:
    stale = StaleRecord(trajectory_id="traj-1", staleness=5, trainer_version=47, max_staleness=4)
    assert StaleRecord.from_headers([stale.header()]) == stale
    obj = orjson.loads(stale.to_json())
    with pytest.raises(ValueError, match="trainer_version"):
        StaleRecord.from_json(orjson.dumps({**obj, "trainer_version": None}))
    with pytest.raises(ValueError, match="missing"):
        StaleRecord.from_json(orjson.dumps({"trajectory_id": "t"}))


def test_announcements_carry_the_trainers_pace_and_older_ones_still_parse() -> None:
    paced = announcement(groups_per_step=16, max_staleness=4)
    assert VersionAnnouncement.from_json(paced.to_json()) == paced
    older = orjson.loads(paced.to_json())
    del older["groups_per_step"], older["max_staleness"]  # written before these fields
    parsed = VersionAnnouncement.from_json(orjson.dumps(older))
    assert parsed.groups_per_step is None and parsed.max_staleness is None
    # unset, they are left out: what a parser that predates them reads
    assert set(orjson.loads(parsed.to_json())) == set(older)
    with pytest.raises(ValueError, match="groups_per_step"):
        announcement(groups_per_step=0)
    with pytest.raises(ValueError, match="max_staleness"):
        announcement(max_staleness=-1)


def test_stale_records_say_which_stage_filtered_them() -> None:
    stream = StaleRecord(trajectory_id="t", staleness=5, trainer_version=9, max_staleness=4)
    assert stream.stage == "stream"
    trainer = dataclasses.replace(stream, trajectory_id="group-1", stage="trainer")
    assert StaleRecord.from_headers([trainer.header()]) == trainer
    with pytest.raises(ValueError, match="stage"):
        dataclasses.replace(stream, stage="elsewhere")


# --- schema version 2: multi-turn episodes -----------------------------------------------


def multi_turn_record(**changes: object) -> Trajectory:
    """Policy 5, env 3, policy 4 tokens: the producer's call, spelled as producers spell it."""
    logp = np.array([-0.5] * 5 + [0.0] * 3 + [-0.25] * 4, np.float32)
    record = Trajectory.create(
        **{
            **{f.name: getattr(realistic_record(), f.name) for f in dataclasses.fields(Trajectory)},
            "response_ids": np.arange(100, 112),
            "logp_infer": logp,
            "segment_versions": [41, 42],
            "segment_lengths": [8, 4],
            "turn_lengths": [5, 3, 4],
            "turn_kinds": [TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY],
            "tool_calls": 1,
            "episode_end": "done",
        }
    )
    return dataclasses.replace(record, **changes)


def test_multi_turn_record_properties_and_round_trip() -> None:
    record = multi_turn_record()
    assert record.turn_lengths.dtype == np.int32 and record.turn_kinds.dtype == np.uint8
    assert record.num_turns == 3 and record.num_policy_turns == 2 and record.is_multi_turn
    assert record.num_policy_tokens == 9 and record.num_env_tokens == 3
    assert record.loss_mask.tolist() == [True] * 5 + [False] * 3 + [True] * 4
    assert record.turns() == [
        (TurnKind.POLICY, 0, 5),
        (TurnKind.ENV, 5, 8),
        (TurnKind.POLICY, 8, 12),
    ]
    back = decode(encode(record))
    assert_bitwise_equal(back, record)
    assert back.tool_calls == 1 and back.episode_end == EpisodeEnd.DONE
    assert encoded_size(record) == len(encode(record))


def test_single_turn_has_one_canonical_form() -> None:
    """Omitting turns and naming the one policy turn build equal records."""
    plain = realistic_record()
    spelled = Trajectory.create(
        **{f.name: getattr(plain, f.name) for f in dataclasses.fields(Trajectory)}
        | {"turn_lengths": [512], "turn_kinds": [TurnKind.POLICY]}
    )
    assert plain.turn_lengths is None and spelled == plain
    assert plain.num_turns == 1 and plain.num_policy_tokens == 512 and not plain.is_multi_turn
    assert plain.loss_mask.all() and plain.turns() == [(TurnKind.POLICY, 0, 512)]
    assert decode(encode(spelled)) == plain
    empty = realistic_record(response_ids=np.empty(0, np.int32))
    assert empty.num_turns == 0 and empty.turns() == [] and empty.loss_mask.shape == (0,)


def test_version_1_bytes_still_decode_as_single_turn() -> None:
    """Bytes written by the schema version 1 encoder (committed fixture)."""
    data = (DATA / "trajectory_v1.bin").read_bytes()
    assert data[4] == 1 and len(data) == 234
    record = decode(data)
    assert record.trajectory_id == "traj-v1" and record.response_ids.tolist() == [8, 9, 10, 11]
    assert record.logp_old is not None and record.logp_old.tolist() == [-0.5, -0.25, -1.0, -2.0]
    assert record.advantage == 0.5 and record.segment_versions.tolist() == [3, 4]
    assert record.turn_lengths is None and record.turn_kinds is None
    assert record.tool_calls == 0 and record.episode_end == ""
    assert record.num_turns == 1 and record.num_policy_tokens == 4
    assert record.policy == "" and record.turn_policies is None
    reencoded = encode(record)
    assert reencoded[4] == 3 and decode(reencoded) == record  # re-encoded as version 3


def test_version_1_bytes_are_checked_like_version_2() -> None:
    data = bytearray((DATA / "trajectory_v1.bin").read_bytes())
    assert decode_error(bytes(data[:-1])).reason == DecodeReason.TRUNCATED
    data[6] |= 4  # the turns flag did not exist in version 1
    assert decode_error(reseal(data)).reason == DecodeReason.BAD_LAYOUT


def test_turn_values_without_the_turns_flag_are_a_layout_error() -> None:
    data = bytearray(encode(multi_turn_record()))
    data[6] &= ~4
    assert decode_error(reseal(data)).reason == DecodeReason.BAD_LAYOUT


def test_half_a_turn_layout_cannot_be_encoded() -> None:
    with pytest.raises(ValueError, match="both"):
        encode(multi_turn_record(turn_kinds=None))


def test_routing_headers_carry_turns_and_policy_tokens() -> None:
    record = multi_turn_record()
    headers = dict(routing_headers(record))
    assert headers["rs-turns"] == b"3" and headers["rs-policy-tokens"] == b"9"
    parsed = parse_headers(headers)
    assert parsed.turns == 3 and parsed.policy_tokens == 9
    lying = [(k, b"12" if k == "rs-policy-tokens" else v) for k, v in headers.items()]
    assert header_disagreements(record, lying) == ["rs-policy-tokens='12', body '9'"]
    # a version-1 writer sent neither header
    old = {
        k: v for k, v in headers.items() if k not in ("rs-turns", "rs-policy-tokens", "rs-policy")
    }
    assert parse_headers(old).turns is None and header_disagreements(record, old) == []


# --- schema version 3: multi-policy provenance -------------------------------------------


def multi_policy_record(**changes: object) -> Trajectory:
    """Policy "alice" plays against "bob": alice 3 tokens, bob 2, alice 2, a tool's 2."""
    record = Trajectory.create(
        run_id="run-mp",
        trajectory_id="traj-v3",
        group_id="group-v3",
        group_size=2,
        sample_index=1,
        producer_id="gen-0",
        region="region-a",
        task="debate",
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 13, 14, 15, 16, 17, 18],
        logp_infer=[-0.5, -0.25, -1.0, 0.0, 0.0, -2.0, -0.125, 0.0, 0.0],
        segment_versions=[5],
        segment_lengths=[9],
        reward=1.0,
        reward_details={"winner": "alice"},
        finish_reason="stop",
        created_at_ms=1_700_000_000_000,
        finished_at_ms=1_700_000_000_500,
        logp_old=[-0.5, -0.25, -1.0, 0.0, 0.0, -2.0, -0.125, 0.0, 0.0],
        old_logits_status="exact",
        advantage=0.75,
        turn_lengths=[3, 2, 2, 2],
        turn_kinds=[TurnKind.POLICY, TurnKind.ENV, TurnKind.POLICY, TurnKind.ENV],
        tool_calls=1,
        episode_end="done",
        policy="alice",
        turn_policies=["alice", "bob", "alice", ""],
    )
    return dataclasses.replace(record, **changes)


def test_multi_policy_record_round_trips() -> None:
    record = multi_policy_record()
    assert record.policy == "alice"
    assert record.turn_policies == ("alice", "bob", "alice", "")  # a list is stored as a tuple
    data = encode(record)
    assert data[4] == 3 and len(data) == encoded_size(record)
    back = decode(data)
    assert_bitwise_equal(back, record)
    assert back == record and type(back.turn_policies) is tuple


@pytest.mark.parametrize(
    "changes",
    [
        {"policy": "", "turn_policies": None},  # the v2 defaults, written as version 3
        {"turn_policies": None},  # a policy without per-turn provenance
        {"turn_policies": ()},  # empty, not None
        {"turn_policies": ("", "", "", "")},  # all-default entries are kept, not folded
        {"policy": "p" * 65_535},  # the longest string the u16 length can carry
        {"policy": "élan", "turn_policies": ("élan", "日本", "élan", "")},
    ],
)
def test_policy_fields_round_trip_as_given(changes: dict) -> None:
    record = multi_policy_record(**changes)
    back = decode(encode(record))
    assert_bitwise_equal(back, record)
    assert back.policy == record.policy
    assert back.turn_policies == record.turn_policies
    assert (back.turn_policies is None) == (record.turn_policies is None)


def test_equality_covers_the_policy_fields() -> None:
    record = multi_policy_record()
    assert record == multi_policy_record()
    assert record != multi_policy_record(policy="bob")
    assert record != multi_policy_record(turn_policies=None)
    assert multi_policy_record(turn_policies=()) != multi_policy_record(turn_policies=None)
    assert record != multi_policy_record(turn_policies=("alice", "bob", "alice", "carol"))
    assert record != multi_policy_record(turn_policies=["alice", "bob", "alice", ""])  # a list


def test_create_folds_a_single_turn_only_with_its_own_policy() -> None:
    plain = realistic_record(policy="alice")
    fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(Trajectory)}
    one_turn = {"turn_lengths": [512], "turn_kinds": [TurnKind.POLICY]}
    spelled = Trajectory.create(**fields | one_turn | {"turn_policies": ["alice"]})
    assert spelled == plain and spelled.turn_policies is None
    # another name on the one policy turn is kept as given, for validation to refuse
    odd = Trajectory.create(**fields | one_turn | {"turn_policies": ["bob"]})
    assert odd.turn_lengths is not None and odd.turn_policies == ("bob",)


def test_version_2_bytes_still_decode_with_the_unnamed_policy() -> None:
    """Bytes written by the schema version 2 encoder (committed fixture, multi-turn)."""
    data = (DATA / "trajectory_v2.bin").read_bytes()
    assert data[4] == 2 and len(data) == 311
    record = decode(data)
    assert record.trajectory_id == "traj-v2" and record.task == "echo-digits"
    assert record.response_ids.tolist() == [10, 11, 12, 13, 14, 15]
    assert record.turn_lengths.tolist() == [2, 2, 2] and record.turn_kinds.tolist() == [0, 1, 0]
    assert record.tool_calls == 1 and record.episode_end == "done"
    assert record.logp_old is not None and record.advantage == 0.5
    assert record.reward_details == {"exact": True}
    assert record.policy == "" and record.turn_policies is None
    reencoded = encode(record)
    assert reencoded[4] == 3 and len(reencoded) == len(data) + 8  # the 8 header bytes more
    assert decode(reencoded) == record


def test_version_2_bytes_are_checked_like_version_3() -> None:
    data = bytearray((DATA / "trajectory_v2.bin").read_bytes())
    for size in (1, 50, 112, 115, len(data) - 1):
        assert decode_error(bytes(data[:size])).reason == DecodeReason.TRUNCATED, size
    assert "at least 116 bytes" in str(decode_error(bytes(data[:100])))
    flipped = bytearray(data)
    flipped[200] ^= 1
    assert decode_error(bytes(flipped)).reason == DecodeReason.CHECKSUM_MISMATCH
    data[6] |= 8  # no flag bit 3 in version 2
    assert decode_error(reseal(data)).reason == DecodeReason.BAD_LAYOUT


def test_version_3_bytes_are_pinned() -> None:
    """The committed version 3 record: the encoder still writes exactly these bytes."""
    data = (DATA / "trajectory_v3.bin").read_bytes()
    assert encode(multi_policy_record()) == data
    assert_bitwise_equal(decode(data), multi_policy_record())


def test_version_3_layout_is_as_documented() -> None:
    """Read the fixture by the layout docs/wire-format.md gives, without the codec."""
    data = (DATA / "trajectory_v3.bin").read_bytes()
    header = struct.Struct("<4sBBH I ii 8I qq dd 10H I i I 4s")
    assert header.size == HEADER_SIZE == 120
    fields = header.unpack_from(data)
    magic, version, kind, flags, total, group_size, sample_index = fields[:7]
    counts = fields[7:15]
    string_lengths = fields[19:29]
    n_details, tool_calls, n_owners, padding = fields[29:33]
    assert (magic, version, kind, flags) == (b"RSTM", 3, 1, 1 | 2 | 4)
    assert (total, group_size, sample_index, tool_calls) == (len(data), 2, 1, 1)
    assert counts == (3, 9, 9, 9, 1, 1, 4, 4)
    assert padding == bytes(4)
    arrays = 8 * 1 + 4 * (1 + 3 + 9 + 9 + 9 + 4) + 4  # segment_versions first, turn_kinds u8
    offset = HEADER_SIZE + arrays
    strings = []
    for length in string_lengths:
        strings.append(data[offset : offset + length].decode())
        offset += length
    assert strings == [
        "run-mp",
        "traj-v3",
        "group-v3",
        "gen-0",
        "region-a",
        "debate",
        "stop",
        "exact",
        "done",
        "alice",  # policy: the tenth string
    ]
    assert orjson.loads(data[offset : offset + n_details]) == {"winner": "alice"}
    offset += n_details
    assert orjson.loads(data[offset : offset + n_owners]) == ["alice", "bob", "alice", ""]
    offset += n_owners
    assert offset == len(data) - 4
    assert struct.unpack("<I", data[offset:]) == (record_checksum(data[:offset]),)


def test_absent_turn_policies_take_no_bytes() -> None:
    record = multi_policy_record()
    without = multi_policy_record(turn_policies=None)
    empty = multi_policy_record(turn_policies=())
    assert encoded_size(record) - encoded_size(without) == len(b'["alice","bob","alice",""]')
    assert encoded_size(empty) - encoded_size(without) == len(b"[]")
    assert encode(without)[112:116] == bytes(4)  # the turn_policies length: 0 is None


def with_turn_policies_json(raw: bytes) -> bytes:
    """A sealed version 3 record whose turn_policies bytes are ``raw`` (any garbage)."""
    body = bytearray(encode(multi_policy_record(turn_policies=None))[:-4]) + raw
    struct.pack_into("<I", body, 8, len(body) + 4)  # total length
    struct.pack_into("<I", body, 112, len(raw))  # turn_policies byte length
    return reseal(body + bytes(4))


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b'{"alice": 1}', "got dict"),
        (b"[1, 2, 3, 4]", "turn_policies[0] must be a string, got int 1"),
        (b'["alice", null]', "turn_policies[1] must be a string, got NoneType"),
        (b'["alice", ["bob"]]', "turn_policies[1] must be a string, got list"),
        (b"null", "got NoneType"),
        (b'"alice"', "got str"),
        (b"[not json", "turn_policies"),
        (b'["\xff"]', "turn_policies"),  # not UTF-8 inside the JSON
    ],
)
def test_turn_policies_that_are_not_a_list_of_strings_are_bad_json(raw: bytes, named: str) -> None:
    assert decode(with_turn_policies_json(b'["a"]')).turn_policies == ("a",)  # the forger works
    error = decode_error(with_turn_policies_json(raw))
    assert error.reason == DecodeReason.BAD_JSON
    assert named in str(error)


def test_turn_policies_of_any_length_decode_for_validation_to_judge() -> None:
    """The codec carries what the dataclass holds; the count is validation's business."""
    assert decode(with_turn_policies_json(b'["alice"]')).turn_policies == ("alice",)
    single = realistic_record(turn_policies=("", ""))  # no turns at all
    assert decode(encode(single)) == single


def test_bad_utf8_in_the_policy_names_it() -> None:
    data = bytearray(encode(multi_policy_record(policy="zeta", turn_policies=None)))
    position = data.index(b"zeta")
    data[position + 1] = 0xC3  # a lead byte without its continuation
    error = decode_error(reseal(data))
    assert error.reason == DecodeReason.BAD_UTF8
    assert "policy is not UTF-8" in str(error)


def test_policy_lengths_that_overrun_the_record_are_a_layout_error() -> None:
    data = bytearray(encode(multi_policy_record()))
    struct.pack_into("<H", data, 102, 6)  # policy: 5 bytes -> 6, total length unchanged
    assert decode_error(reseal(data)).reason == DecodeReason.BAD_LAYOUT
    data = bytearray(encode(multi_policy_record()))
    struct.pack_into("<I", data, 112, 1000)  # turn_policies length beyond the record
    assert decode_error(reseal(data)).reason == DecodeReason.BAD_LAYOUT


def test_every_truncation_and_corruption_of_a_multi_policy_record_is_detected() -> None:
    data = encode(multi_policy_record())
    for size in range(1, len(data)):
        assert decode_error(data[:size]).reason == DecodeReason.TRUNCATED, size
    for position in range(len(data)):
        corrupted = bytearray(data)
        corrupted[position] ^= 0x20
        with pytest.raises(DecodeError):
            decode(bytes(corrupted))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"turn_policies": ["alice", "bob", "alice", ""]}, "tuple"),  # a list: would read back
        ({"turn_policies": ("alice", 7, "alice", "")}, r"turn_policies\[1\]"),
        ({"turn_policies": ("alice", "\ud800", "alice", "")}, "turn_policies"),
        ({"turn_policies": "alice"}, "turn_policies"),
        ({"policy": "p" * 65_536}, "policy"),
        ({"policy": "\ud800"}, "policy"),
        ({"policy": None}, "policy"),
    ],
)
def test_encode_refuses_policy_fields_the_format_cannot_carry(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode(multi_policy_record(**changes))
    with pytest.raises(ValueError, match=match):
        encoded_size(multi_policy_record(**changes))


def test_routing_headers_carry_the_policy() -> None:
    record = multi_policy_record()
    headers = routing_headers(record)
    assert dict(headers)["rs-policy"] == b"alice"
    assert dict(headers)["rs-schema-version"] == b"3"
    assert parse_headers(headers).policy == "alice"
    assert header_disagreements(record, headers) == []
    lying = [(k, b"bob" if k == "rs-policy" else v) for k, v in headers]
    assert header_disagreements(record, lying) == ["rs-policy='bob', body 'alice'"]
    twice = [*headers, ("rs-policy", b"alice")]
    assert header_disagreements(record, twice) == ["rs-policy appears more than once"]
    not_utf8 = [(k, b"\xff" if k == "rs-policy" else v) for k, v in headers]
    assert header_disagreements(record, not_utf8) == ["rs-policy=b'\\xff' is not UTF-8"]
    with pytest.raises(DecodeError, match="rs-policy"):
        parse_headers(not_utf8)


def test_a_missing_policy_header_reads_as_the_unnamed_policy() -> None:
    """A writer older than version 3 sent no rs-policy: its records are policy ""."""
    unnamed = multi_policy_record(policy="", turn_policies=None)
    old = [(k, v) for k, v in routing_headers(unnamed) if k != "rs-policy"]
    assert parse_headers(old).policy == ""
    assert header_disagreements(unnamed, old) == []
    # a body naming a policy without the header would be routed to the unnamed policy
    named = multi_policy_record()
    headless = [(k, v) for k, v in routing_headers(named) if k != "rs-policy"]
    assert header_disagreements(named, headless) == ["rs-policy missing (read as ''), body 'alice'"]
    assert header_disagreements(named, None) == ["rs-policy missing (read as ''), body 'alice'"]
    assert header_disagreements(unnamed, None) == []


def test_older_writers_schema_version_header_agrees_when_its_layout_carries_the_body() -> None:
    def saying(record: Trajectory, version: bytes) -> list[tuple[str, bytes]]:
        return [(k, version if k == "rs-schema-version" else v) for k, v in routing_headers(record)]

    single = realistic_record()  # what a version 1 writer could write
    turns = multi_policy_record(policy="", turn_policies=None)  # needs version 2
    for version in (b"1", b"2", b"3"):
        assert header_disagreements(single, saying(single, version)) == []
    assert header_disagreements(turns, saying(turns, b"1")) == [
        "rs-schema-version='1', body needs schema version 2 to 3"
    ]
    assert header_disagreements(turns, saying(turns, b"2")) == []
    named = multi_policy_record()
    assert header_disagreements(named, saying(named, b"2")) == [
        "rs-schema-version='2', body needs schema version 3"
    ]
    assert header_disagreements(single, saying(single, b"4")) != []
    # given the value's own version byte, the header must name exactly that version
    v2_bytes = (DATA / "trajectory_v2.bin").read_bytes()
    old = decode(v2_bytes)
    assert header_disagreements(old, saying(old, b"2"), schema_version=v2_bytes[4]) == []
    assert header_disagreements(old, saying(old, b"3"), schema_version=v2_bytes[4]) == [
        "rs-schema-version='3', value is schema version 2"
    ]

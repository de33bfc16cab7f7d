"""Codec benchmark: rollstream's binary record against orjson, raw bytes and Arrow IPC.

Run from the repository root: ``python -m bench.codec [--rounds N] [--reps N]``.

One realistic record (prompt 256 and response 512 tokens, ``logp_infer``, two version
segments, a small ``reward_details``) is encoded and decoded by each method. A timing is
the median over ``--rounds`` rounds of the mean over ``--reps`` back-to-back calls
(``time.perf_counter_ns``), so a noisy machine moves single rounds, not the median.

Targets (from the foundation issue): encode+decode at least 5x faster than orjson of a
dict of Python lists, and encoded bytes at most 1.2x the raw array bytes.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.ipc as ipc

from schemas.codec import decode, encode, record_checksum
from schemas.trajectory import ARRAY_DTYPES, Trajectory, from_arrow, to_arrow
from schemas.validation import ValidationLimits, validate

SPEEDUP_TARGET = 5.0
BYTES_TARGET = 1.2


def realistic_record(seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed)
    return Trajectory.create(
        run_id="run-2025-11-22-reverse3",
        trajectory_id="6f1d2c3e-8a4b-4c5d-9e6f-0a1b2c3d4e5f",
        group_id="3b2a1c0d-9e8f-4a7b-8c6d-5e4f3a2b1c0d",
        group_size=8,
        sample_index=5,
        producer_id="gen-region-a-03",
        region="region-a",
        task="reverse3",
        prompt_ids=rng.integers(0, 49_152, 256),
        response_ids=rng.integers(0, 49_152, 512),
        logp_infer=-rng.exponential(0.8, 512),
        segment_versions=[41, 42],
        segment_lengths=[384, 128],
        reward=0.6666666666666666,
        reward_details={"exact_match": False, "share_correct": 0.667, "parsed": True},
        finish_reason="stop",
        created_at_ms=1_763_791_200_000,
        finished_at_ms=1_763_791_201_234,
    )


def raw_arrays(traj: Trajectory) -> list[np.ndarray]:
    return [getattr(traj, name) for name in ARRAY_DTYPES if getattr(traj, name) is not None]


def as_python_dict(traj: Trajectory) -> dict[str, Any]:
    """The record as plain JSON-able Python: arrays as lists."""
    out: dict[str, Any] = {}
    for name in Trajectory.__dataclass_fields__:
        value = getattr(traj, name)
        out[name] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


@dataclass(frozen=True)
class Method:
    name: str
    encode: Callable[[], bytes]
    decode: Callable[[bytes], object]


def methods(traj: Trajectory) -> list[Method]:
    as_lists = as_python_dict(traj)
    with_arrays = {**as_lists, **{name: getattr(traj, name) for name in ARRAY_DTYPES}}
    arrays = raw_arrays(traj)

    def orjson_numpy_decode(blob: bytes) -> dict[str, Any]:
        obj = orjson.loads(blob)
        for name, dtype in ARRAY_DTYPES.items():
            if obj.get(name) is not None:
                obj[name] = np.asarray(obj[name], dtype)
        return obj

    def raw_decode(blob: bytes) -> list[np.ndarray]:
        out, offset = [], 0
        for array in arrays:
            out.append(np.frombuffer(blob, array.dtype, len(array), offset))
            offset += array.nbytes
        return out

    def arrow_encode() -> bytes:
        table = to_arrow([traj])
        sink = io.BytesIO()
        with ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue()

    return [
        Method("rollstream codec", lambda: encode(traj), decode),
        Method("orjson, dict of lists", lambda: orjson.dumps(as_lists), orjson.loads),
        Method(
            "orjson, numpy in/out",
            lambda: orjson.dumps(with_arrays, option=orjson.OPT_SERIALIZE_NUMPY),
            orjson_numpy_decode,
        ),
        Method("raw arrays (floor)", lambda: b"".join(arrays), raw_decode),
        Method(
            "Arrow IPC, 1 record",
            arrow_encode,
            lambda blob: from_arrow(ipc.open_stream(pa.py_buffer(blob)).read_all()),
        ),
    ]


def median_ns(fn: Callable[[], object], rounds: int, reps: int) -> float:
    """Median over rounds of the mean time per call within a round."""
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        per_call.append((time.perf_counter_ns() - start) / reps)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()

    traj = realistic_record()
    raw_bytes = sum(a.nbytes for a in raw_arrays(traj))
    rows = []
    for method in methods(traj):
        blob = method.encode()
        method.decode(blob)  # warm up, and fail loudly before timing anything
        reps = max(args.reps // 20, 1) if method.name.startswith("Arrow") else args.reps
        enc = median_ns(method.encode, args.rounds, reps)
        dec = median_ns(lambda m=method, b=blob: m.decode(b), args.rounds, reps)
        rows.append((method.name, enc, dec, len(blob)))
    assert decode(encode(traj)) == traj

    baseline = next(enc + dec for name, enc, dec, _ in rows if name == "orjson, dict of lists")
    print(
        f"record: prompt {traj.num_prompt_tokens}, response {traj.num_response_tokens} tokens, "
        f"{len(traj.segment_versions)} segments; raw array bytes {raw_bytes}; "
        f"median of {args.rounds} rounds x {args.reps} calls"
    )
    header = (
        f"{'method':<24}{'encode us':>11}{'decode us':>11}{'total us':>10}"
        f"{'bytes':>8}{'bytes/raw':>11}{'speedup vs orjson':>19}"
    )
    print(header)
    print("-" * len(header))
    for name, enc, dec, size in rows:
        print(
            f"{name:<24}{enc / 1e3:>11.2f}{dec / 1e3:>11.2f}{(enc + dec) / 1e3:>10.2f}"
            f"{size:>8}{size / raw_bytes:>11.3f}{baseline / (enc + dec):>18.1f}x"
        )

    ours_ns = rows[0][1] + rows[0][2]
    numpy_baseline = next(enc + dec for name, enc, dec, _ in rows if name.endswith("in/out"))
    speedup = baseline / ours_ns
    ratio = rows[0][3] / raw_bytes
    print()
    verdict = "MET" if speedup >= SPEEDUP_TARGET else "NOT MET"
    target = f"target >= {SPEEDUP_TARGET:g}x"
    print(f"speedup vs orjson (dict of lists): {speedup:.1f}x ({target}) {verdict}")
    print(f"speedup vs orjson (numpy in/out):  {numpy_baseline / ours_ns:.1f}x")
    verdict = "MET" if ratio <= BYTES_TARGET else "NOT MET"
    print(f"bytes / raw bytes: {ratio:.3f} (target <= {BYTES_TARGET}) {verdict}")

    # Fixed costs inside our encode+decode, to judge what is left to gain.
    record = encode(traj)
    fields = {name: getattr(traj, name) for name in Trajectory.__dataclass_fields__}
    crc_ns = median_ns(lambda: record_checksum(record), args.rounds, args.reps)
    build_ns = median_ns(lambda: Trajectory(**fields), args.rounds, args.reps)
    limits = ValidationLimits(vocab_size=49_152)
    check_ns = median_ns(lambda: validate(traj, limits), args.rounds, args.reps)
    print(f"  of which the checksum (XXH3) over the record: {crc_ns / 1e3:.2f} us, paid twice")
    print(f"  of which building the frozen Trajectory: {build_ns / 1e3:.2f} us")
    print(f"validate() of the same record: {check_ns / 1e3:.2f} us")


if __name__ == "__main__":
    main()

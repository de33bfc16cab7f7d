"""``rollstream weights`` commands against two real SeaweedFS regions."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
from click.testing import CliRunner
from support.trainer_runs import s3_toml
from support.weight_states import same_bits, step, store_for, tiny_state

from core.config import S3Config
from rollstream.cli.weights import weights
from weights.writer import DeltaWriter


def write_config(tmp_path: Path, home: S3Config, other: S3Config, run: str) -> Path:
    path = tmp_path / "rollstream.toml"
    path.write_text(
        f'run_id = "{run}"\n\n[s3]\n{s3_toml(home)}\n'
        f"[weights]\nkeep_versions = 2\norphan_grace_s = 0\nallow_unsigned = true\n\n"
        f"[weights.regions.{other.name}]\n{s3_toml(other)}"
    )
    return path


def test_weights_cli(s3_config: S3Config, second_s3_config: S3Config, tmp_path: Path) -> None:
    run = "cli"
    config = write_config(tmp_path, s3_config, second_s3_config, run)
    writer = DeltaWriter(store_for(s3_config, run), base_every=3)
    states = [tiny_state()]
    for i in range(1, 6):
        states.append(step(states[-1], seed=i))
    for state in states:
        writer.publish(state)
    cli = CliRunner()

    def invoke(*args: str, code: int = 0) -> str:
        result = cli.invoke(weights, ["--config", str(config), *args])
        assert result.exit_code == code, result.output + repr(result.exception)
        return result.output

    listing = invoke("ls")
    assert len(listing.splitlines()) == 1 + 6
    assert "base" in listing.splitlines()[1] and "delta" in listing.splitlines()[2]
    assert '"kind": "delta"' in invoke("show", "4")

    out = tmp_path / "v4.safetensors"
    assert "v4 ->" in invoke("pull", "4", "-o", str(out))
    pulled = safetensors.torch.load_file(out)
    assert same_bits(pulled, {k: v.contiguous() for k, v in states[4].items()})

    verified = invoke("verify")
    assert verified.count(" ok ") == 6

    assert "copied 3 version(s)" in invoke("mirror", "--from", "region-a", "--to", "region-b")
    assert " ok " in invoke("--region", "region-b", "verify")

    assert "would delete versions [0, 1, 2]" in invoke("gc", "--dry-run")
    assert "deleted versions [0, 1, 2]" in invoke("gc")
    assert store_for(s3_config, run).versions() == [3, 4, 5]

    # A damaged version makes verify fail with the reason.
    store = store_for(s3_config, run)
    store.delete([o.key for o in store.objects(version=5) if o.name != "manifest.json"])
    assert "REFUSED  missing_file" in invoke("verify", code=1)

    keys = tmp_path / "keys"
    assert "key " in invoke("keygen", str(keys / "signing.pem"), str(keys / "signing.pub"))
    assert (keys / "signing.pem").stat().st_mode & 0o077 == 0

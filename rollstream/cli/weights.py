"""``rollstream weights``: list, inspect, pull, verify, mirror and collect versions.

The group takes the ``RollstreamConfig`` its parent command loaded (``ctx.obj``), or loads
one itself from ``--config``. Regions are the home store (``[s3]``) and the stores in
``[weights.regions.<name>]``. torch is imported only by the commands that rebuild
weights (``pull``, ``verify``), so ``--help`` and ``ls`` stay fast.
"""

from __future__ import annotations

import logging
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import click
import orjson

from rollstream.config.settings import RollstreamConfig
from rollstream.runs.weights import WeightsContext, load_settings


@click.group("weights", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="TOML config (default: the one the rollstream command loaded).",
)
@click.option("--run", "run", help="Run id (default: run_id from the config).")
@click.option("--region", help="Region to act on (default: the home store, [s3]).")
@click.option("-v", "--verbose", is_flag=True, help="Log what happens.")
@click.pass_context
def weights(
    ctx: click.Context,
    config_path: Path | None,
    run: str | None,
    region: str | None,
    verbose: bool,
) -> None:
    """Versioned policy weights in S3: bases, sparse deltas, regions."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if config_path is not None or not isinstance(ctx.obj, RollstreamConfig):
        config, weights_config = load_settings(config_path, ctx.find_root().params.get("policy"))
    else:
        config = ctx.obj
        weights_config = config.weights
    config.require_policy()  # each policy's versions are their own lineage in S3
    ctx.obj = WeightsContext(
        config=config,
        weights=weights_config,
        run=run or config.run_id,
        region=region or config.s3.name,
    )


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@weights.command("ls")
@click.pass_obj
def ls(ctx: WeightsContext) -> None:
    """List complete versions with kind, chain and size."""
    from weights.manifest import Manifest

    store = ctx.store()
    versions = store.versions()
    if not versions:
        click.echo(f"no versions of run {ctx.run!r} in {store.uri(store.run_prefix)}")
        return
    click.echo(
        f"{'version':>8}  {'kind':<5}  {'parent':>6}  {'base':>6}  {'size':>10}  "
        f"{'changed':>8}  signed  created"
    )
    for version in versions:
        m = Manifest.from_bytes(store.read_manifest(version))
        changed = f"{100 * m.changed_elements / max(m.total_elements, 1):.2f}%"
        created = datetime.fromtimestamp(m.created_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(
            f"{version:>8}  {m.kind:<5}  {'-' if m.parent is None else m.parent:>6}  "
            f"{m.base:>6}  {_fmt_bytes(m.total_bytes):>10}  "
            f"{changed if m.kind == 'delta' else '-':>8}  {'yes' if m.signature else 'no':<6}  "
            f"{created}"
        )


@weights.command("show")
@click.argument("version", type=int)
@click.pass_obj
def show(ctx: WeightsContext, version: int) -> None:
    """Print a version's manifest."""
    data = ctx.store().read_manifest(version)
    click.echo(orjson.dumps(orjson.loads(data), option=orjson.OPT_INDENT_2).decode())


@weights.command("pull")
@click.argument("version", type=int, required=False)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="safetensors file to write.",
)
@click.pass_obj
def pull(ctx: WeightsContext, version: int | None, output: Path) -> None:
    """Rebuild a version (default: the latest), verified, into a safetensors file."""
    import safetensors.torch

    from weights.errors import VersionRefused
    from weights.format import base_payload

    try:
        snapshot = ctx.follower().sync(version)
    except VersionRefused as err:
        raise click.ClickException(str(err)) from None
    if snapshot is None:
        raise click.ClickException(f"no versions of run {ctx.run!r}")
    metadata = {"rollstream.run": ctx.run, "rollstream.version": str(snapshot.version)}
    safetensors.torch.save_file(base_payload(snapshot.state), output, metadata=metadata)
    click.echo(f"v{snapshot.version} -> {output} ({len(snapshot.state)} tensors)")


@weights.command("verify")
@click.option("--from", "start", type=int, help="First version to check (default: oldest).")
@click.pass_obj
def verify(ctx: WeightsContext, start: int | None) -> None:
    """Rebuild every stored version in order, checking every hash, signature and tensor
    checksum. Exits 1 if any version is refused."""
    from weights.errors import VersionRefused

    store = ctx.store()
    follower = ctx.follower()
    bad = 0
    for version in store.versions():
        if start is not None and version < start:
            continue
        try:
            follower.sync(version)
            click.echo(f"v{version}  ok  ({follower.snapshot.manifest.kind})")
        except VersionRefused as err:
            bad += 1
            click.echo(f"v{version}  REFUSED  {err.reason}: {err}")
    if bad:
        click.echo(f"{bad} version(s) refused")
        sys.exit(1)


@weights.command("mirror")
@click.option("--from", "src", required=True, help="Source region.")
@click.option("--to", "dst", required=True, help="Destination region.")
@click.option("--since", type=int, help="Copy every missing version from this one on.")
@click.option("--watch", is_flag=True, help="Keep mirroring every poll interval.")
@click.pass_obj
def mirror(ctx: WeightsContext, src: str, dst: str, since: int | None, watch: bool) -> None:
    """Copy complete versions between regions (files first, manifest last)."""
    from weights.mirror import mirror_forever, mirror_once
    from weights.trust import Trust

    source, target = ctx.store(src), ctx.store(dst)
    trust = Trust.from_config(ctx.trusted())
    if watch:
        stop = threading.Event()
        try:
            mirror_forever(source, target, stop, ctx.weights.poll_interval_s, trust=trust)
        except KeyboardInterrupt:
            stop.set()
        return
    report = mirror_once(source, target, since, trust=trust)
    click.echo(
        f"copied {len(report.copied)} version(s) ({_fmt_bytes(report.bytes)}): "
        f"{report.copied}; already there: {report.present}"
    )
    for version, reason in report.failed.items():
        click.echo(f"v{version} NOT mirrored: {reason}")
    if report.failed:
        sys.exit(1)


@weights.command("gc")
@click.option("--keep", type=int, help="Versions to keep (default: weights.keep_versions).")
@click.option("--dry-run", is_flag=True, help="Only print what would be deleted.")
@click.pass_obj
def gc(ctx: WeightsContext, keep: int | None, dry_run: bool) -> None:
    """Delete versions outside the retention window (never what a kept one needs)."""
    from weights.retention import collect_garbage
    from weights.trust import Trust

    plan = collect_garbage(
        ctx.store(),
        keep or ctx.weights.keep_versions,
        ctx.weights.orphan_grace_s,
        dry_run,
        trust=Trust.from_config(ctx.trusted()),
    )
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"kept {plan.keep}")
    for version, reason in plan.unverified.items():
        click.echo(f"v{version} does not verify, not counted: {reason}")
    click.echo(f"{verb} versions {plan.delete} and {len(plan.orphans)} orphan file(s)")


@weights.command("keygen")
@click.argument("private_key", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("public_key", type=click.Path(dir_okay=False, path_type=Path))
def keygen(private_key: Path, public_key: Path) -> None:
    """Create an ed25519 key pair for signing manifests (PEM files)."""
    from weights.manifest import generate_keypair, key_id

    public = generate_keypair(private_key, public_key)
    click.echo(f"key {key_id(public)}: private {private_key}, public {public_key}")

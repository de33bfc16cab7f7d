"""DeepSpeed's JIT-compiled C++ ops: built once, cached under the user's home, and safe
against a process killed in the middle of loading them.

DeepSpeed compiles its CPU communication op (``deepspeed_shm_comm``) with torch's
``cpp_extension`` the first time a process initialises ``deepspeed.comm``; every later
process re-checks that build under a *file baton*, a ``lock`` file created with
``O_EXCL`` and deleted when done. A process killed while it holds the baton (kill -9 of
a trainer during start-up, a CI job cut off) leaves the file behind, and every later
trainer waits for it forever. Torch cannot tell a live holder from a dead one; an
``flock`` can, because the kernel drops it with its process. So rollstream loads ops
inside ``op_build_guard``: while it holds an exclusive flock on the extensions root, no
other rollstream process is loading, and any baton it finds is stale and removed.
Trainer ranks rendezvous with each other while they initialise ``deepspeed.comm``, so
none may hold the guard then (the one holding it would wait for a rank waiting for it):
``preload_ops`` builds and loads the op under the guard first, and the ranks initialise
afterwards inside ``extensions_dir`` only, where the op is found built.

The ops live in rollstream's own root (``<cache>/torch_extensions``, unless the user set
``TORCH_EXTENSIONS_DIR``), so no other program's builds share those batons. DeepSpeed's
JIT builder takes no build directory argument: torch reads ``TORCH_EXTENSIONS_DIR`` from
the environment at every build. So ``op_build_guard`` sets it for the guarded block only
and restores what was there when it leaves; nothing outside the block (other libraries,
child processes started later) sees a changed environment.

The block also puts this interpreter's own ``bin`` first on ``PATH`` when a ``ninja`` is
installed there (the lock's): torch runs whichever ``ninja`` ``PATH`` finds, and two ninja
versions read each other's build log as stale, so a shell with the virtualenv activated
and one without rebuilt the op (about 30 s on two cores) each time the other ran last.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
GUARD_FILE = ".rollstream-build.flock"
_ENV_LOCK = threading.Lock()  # one guarded block per process changes the variable at a time


def extensions_root(cache_dir: Path | None = None) -> Path:
    """Where rollstream builds torch extensions: the user's ``TORCH_EXTENSIONS_DIR`` if
    set, else ``<cache>/torch_extensions``. Reads the environment, never changes it."""
    configured = os.environ.get(EXTENSIONS_ENV)
    if configured:
        return Path(configured)
    if cache_dir is None:
        from core.config import default_cache_dir

        cache_dir = default_cache_dir()
    return cache_dir / "torch_extensions"


@contextmanager
def extensions_dir(root: Path) -> Iterator[None]:
    """``TORCH_EXTENSIONS_DIR=root`` (the only way to tell DeepSpeed's builder where to
    build) and the interpreter's own ninja first on ``PATH`` for the block, then the
    previous values (or none) again."""
    with _ENV_LOCK:
        before = {name: os.environ.get(name) for name in (EXTENSIONS_ENV, "PATH")}
        os.environ[EXTENSIONS_ENV] = str(root)
        own_bin = Path(sys.executable).parent
        if (own_bin / "ninja").is_file():
            os.environ["PATH"] = os.pathsep.join([str(own_bin), before["PATH"] or os.defpath])
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def stale_batons(root: Path) -> list[Path]:
    """Torch's build batons under ``root``: ``<root>/<op>/lock`` (``TORCH_EXTENSIONS_DIR``
    set) or ``<root>/<python_cuda>/<op>/lock`` (torch's default layout)."""
    return sorted(p for p in [*root.glob("*/lock"), *root.glob("*/*/lock")] if p.is_file())


@contextmanager
def op_build_guard(root: Path) -> Iterator[None]:
    """Hold rollstream's exclusive build lock on ``root`` and clear batons that dead
    processes left; DeepSpeed ops are loaded inside this block, and built under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    with extensions_dir(root), (root / GUARD_FILE).open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            for baton in stale_batons(root):
                log.warning(
                    "removing a build lock left by a killed process: %s "
                    "(no live rollstream process holds the build guard)",
                    baton,
                )
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def preload_ops(root: Path) -> None:
    """Build (once) and load DeepSpeed's CPU communication op under the guard, so that
    initialising ``deepspeed.comm`` afterwards only finds it."""
    with op_build_guard(root):
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            builder.load(verbose=False)

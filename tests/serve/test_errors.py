"""serve/errors.py: the one map from what the engine raises to the server's HTTP answer."""

from __future__ import annotations

import pytest

from batchkit._errors import BatcherClosed, CircuitOpen, DeadlineExceeded, InvalidBlock, KVCacheExhausted, QueueFull
from batchkit.serve.errors import ANSWERS, answer_for


@pytest.mark.parametrize(
    ("exc", "status", "code", "rejection"),
    [
        (QueueFull("full"), 503, "queue_full", "queue_full"),
        (BatcherClosed("closed"), 503, "shutting_down", None),
        (CircuitOpen("open"), 503, "circuit_open", "circuit_open"),
        (KVCacheExhausted("too long"), 400, "context_length_exceeded", "kv_exhausted"),
        (DeadlineExceeded("late"), 504, "deadline_exceeded", "deadline"),
        (ValueError("bad field"), 400, "invalid_value", None),
        (InvalidBlock("a ValueError too"), 400, "invalid_value", None),
    ],
)
def test_each_engine_error_has_its_status_code_and_rejection(
    exc: Exception, status: int, code: str, rejection: str | None
) -> None:
    """Each of batchkit's errors the engine raises answers one status and code, counted under
    one rejection reason (or none)."""
    answer = answer_for(exc, "generation")
    assert (answer.status, answer.code, answer.rejection) == (status, code, rejection)


def test_a_busy_answer_tells_the_client_when_to_retry() -> None:
    """Every 503 carries ``Retry-After``; no other answer does."""
    for cls, answer in ANSWERS:
        err = answer.error(cls("x"), retry_after_s=7)
        assert (err.headers == {"Retry-After": "7"}) is (err.status == 503), cls


def test_the_message_is_the_exception_after_the_answers_prefix() -> None:
    """The body's message is the exception's own text, after the row's prefix."""
    err = answer_for(QueueFull("no room for 3"), "generation").error(QueueFull("no room for 3"), 1)
    assert err.body()["error"] == {
        "message": "the server is busy: no room for 3",
        "type": "server_error",
        "param": None,
        "code": "queue_full",
    }


def test_anything_else_is_a_failure_of_what_was_served() -> None:
    """An exception no row names is a 500 ``{what}_failed`` naming what was served."""
    exc = RuntimeError("boom")
    err = answer_for(exc, "embedding").error(exc, 1)
    assert (err.status, err.code, err.message, err.headers) == (
        500,
        "embedding_failed",
        "the embedding failed: boom",
        {},
    )


def test_a_type_error_is_a_failure_not_the_clients_fault() -> None:
    """The request's own checks answer a field of the wrong type 400 themselves, so a TypeError
    the engine raises is a bug in batchkit or the model: a 500, not blamed on the client."""
    exc = TypeError("the step function must return a torch.Tensor of logits, got list")
    answer = answer_for(exc, "generation")
    assert (answer.status, answer.code, answer.type, answer.rejection) == (
        500,
        "generation_failed",
        "server_error",
        None,
    )

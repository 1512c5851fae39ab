"""batchkit.demo.mlp, as docs/api.md promises it: the one-by-one baseline server refuses inputs
once closed, and the demo's serving functions refuse a load they cannot run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

import batchkit

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

WAIT = 60.0


def _tiny_mlp() -> Any:
    from batchkit.demo import mlp

    return mlp.make_mlp(d_in=8, d_hidden=16, threads=1)


def test_one_by_one_server_refuses_inputs_after_close_instead_of_hanging() -> None:
    """OneByOneServer.close() "stops the worker once the queue is empty": an input submitted
    afterwards would never be served, so submit() raises BatcherClosed; close() again is harmless."""
    from batchkit.demo import mlp

    server = mlp.OneByOneServer(_tiny_mlp())
    x = torch.zeros(8)
    assert server.submit(x).result(WAIT).shape == (8,)
    server.close()
    with pytest.raises(batchkit.BatcherClosed):
        server.submit(x)
    server.close()


@pytest.mark.parametrize(
    ("which", "args", "name"),
    [
        ("serve_one_by_one", ([], 2, 0.05), "inputs"),
        ("serve_one_by_one", ("x", 0, 0.05), "callers"),
        ("serve_batched", ([], 2, 0.05), "inputs"),
        ("serve_batched", ("x", 0, 0.05), "callers"),
        ("serve_batched", ("x", 2, 0.0), "duration_s"),
        ("ceiling_rps", ("x", 0, 0.05), "batch"),
        ("ceiling_rps", ([], 4, 0.05), "inputs"),
    ],
)
def test_demo_serving_refuses_a_load_it_cannot_run(which: str, args: tuple[Any, ...], name: str) -> None:
    """No inputs, no callers or no time is a ValueError naming it (not a ZeroDivisionError from
    a caller thread, a broken barrier, or a NaN row)."""
    from batchkit.demo import mlp

    inputs, n, seconds = args
    if inputs == "x":
        inputs = [torch.zeros(8)]
    with pytest.raises(ValueError, match=name):
        getattr(mlp, which)(_tiny_mlp(), inputs, n, seconds)

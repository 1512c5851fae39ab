"""The demo workloads behind ``batchkit demo``, public so that benchmarks and notebooks can run
the same ones (needs torch):

- :mod:`batchkit.demo.mlp`: a CPU torch MLP served one request at a time and through a
  :class:`~batchkit.DynamicBatcher` by closed-loop callers;
- :mod:`batchkit.demo.llm`: a random-weight Llama-style model serving mixed-length requests one
  at a time, in static batches and with continuous batching.
"""

from . import llm, mlp

__all__ = ["llm", "mlp"]

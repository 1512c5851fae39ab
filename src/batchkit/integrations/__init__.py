"""Integrations with distributed engines. Each lives in its own module and imports its engine
only when that module is imported (``import batchkit`` imports none of them).

- :mod:`batchkit.integrations.ray`: Ray Serve replicas and Ray Data pipelines
  (``pip install "batchkit[ray]"``).
"""

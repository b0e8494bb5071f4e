"""Every ```python block in README.md and docs/*.md runs as written on the embedded default checkpoint, from the
repository root, in a fresh interpreter, unless its first line marks what it needs that a CPU test cannot have:
`# needs: released checkpoint` or `# needs: GPU` (one per line; several such lines may open a block)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from repo_paths import ROOT

# in the default run (~2 minutes on 2 cores: each block is a fresh interpreter) so that the docs cannot rot
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"^# needs: (released checkpoint|GPU)\b")
TIMEOUT_S = 240


def python_blocks() -> list[tuple[str, str]]:
    """(file:line, code) for every python block of the docs."""
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            blocks.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


def needs(code: str) -> list[str]:
    """What the block's opening marker lines say it needs (empty: runnable here)."""
    found = []
    for line in code.splitlines():
        match = NEEDS.match(line)
        if not match:
            break
        found.append(match.group(1))
    return found


BLOCKS = python_blocks()


def test_the_docs_have_runnable_blocks():
    assert sum(1 for _, code in BLOCKS if not needs(code)) >= 5


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_doc_block_runs(where, code, tmp_path):
    if needs(code):
        pytest.skip(f"{where} needs: {', '.join(needs(code))}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           # tiny matmuls: on a busy 2-core machine two OpenMP threads spin-wait (a 64x128 matmul took 8 ms, not 0.01)
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{where} failed:\n{result.stderr[-3000:]}"

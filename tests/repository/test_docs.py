"""Every ```python block in README.md and docs/*.md runs as written on the embedded default checkpoint, from the
repository root, in a process of its own, unless its first line marks what it needs that a CPU test cannot have:
`# needs: released checkpoint` or `# needs: GPU` (one per line; several such lines may open a block).

On Linux each block runs in a child forked from one interpreter that has imported torch and transformers (5 of a
block's 6-7 seconds; nothing of this repository, so a block that forgets `import modeling_deepseek_v41` still
fails); elsewhere in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from repo_paths import ROOT

# in the default run (about 30 s on 2 cores) so that the docs cannot rot
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


# Reads one script path per line; runs each in a forked child (stdout and stderr to the path + ".log", killed
# after TIMEOUT_S) and answers with its exit code. Imports only third-party modules before forking, and runs no
# torch op, so that no OpenMP thread exists to be lost by fork.
FORK_SERVER = """
import os, runpy, signal, sys, traceback
import torch, transformers, transformers.modeling_utils, transformers.generation.utils, transformers.trainer
import safetensors.torch, PIL.Image
for line in sys.stdin:
    script = line.rstrip("\\n")
    pid = os.fork()
    if pid == 0:
        log = os.open(script + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        signal.alarm(%d)
        sys.argv, code = [script], 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
""" % TIMEOUT_S


def block_environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            # tiny matmuls: on a busy 2-core machine two OpenMP threads spin-wait (a 64x128 matmul took 8 ms, not 0.01)
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


@pytest.fixture(scope="module")
def run_block():
    """A function of a script path returning (exit code, output): through the fork server on Linux."""
    if sys.platform != "linux":
        def fresh(script):
            done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=block_environment(),
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
            return done.returncode, done.stdout + done.stderr
        yield fresh
        return
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=ROOT, env=block_environment(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def forked(script):
        server.stdin.write(f"{script}\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        assert answer, "the fork server stopped"
        return int(answer), Path(f"{script}.log").read_text()
    yield forked
    server.stdin.close()
    server.wait(timeout=60)


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_doc_block_runs(where, code, tmp_path, run_block):
    if needs(code):
        pytest.skip(f"{where} needs: {', '.join(needs(code))}")
    script = tmp_path / "block.py"
    script.write_text(code)
    returncode, output = run_block(script)
    assert returncode == 0, f"{where} failed:\n{output[-3000:]}"

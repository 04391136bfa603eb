"""Runs ``python/examples/thinker_stage.py`` as a user would and checks what it reports."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import EXAMPLES, REPO_ROOT

ROUND = re.compile(
    r"^round (\d+): prompt_len=(\d+) num_cached_tokens=(\d+) expected_cached=(-|\d+) tokens=\[([\d, ]*)\]"
)


@pytest.mark.parametrize("flags", [[], ["--random"]])
def test_thinker_stage_example_reuses_the_history_every_round(flags):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "thinker_stage.py"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # the example finds the fixtures relative to itself
    )
    assert done.returncode == 0, done.stderr
    rounds = [m.groups() for line in done.stdout.splitlines() if (m := ROUND.match(line))]
    assert [int(r[0]) for r in rounds] == [1, 2, 3], done.stdout
    prompt_lens = [int(r[1]) for r in rounds]
    cached = [int(r[2]) for r in rounds]
    tokens = [[int(t) for t in r[4].split(",") if t.strip()] for r in rounds]
    assert cached[0] == 0
    assert cached[1] > 0 and cached[2] > 0, done.stdout
    assert all(tokens), done.stdout
    # Every position the previous round ran (its prompt, all of its reply but the last token) is reused.
    for r in (1, 2):
        assert cached[r] == int(rounds[r][3]) == prompt_lens[r - 1] + len(tokens[r - 1]) - 1, done.stdout
        assert prompt_lens[r] > prompt_lens[r - 1]
    summary = [line for line in done.stdout.splitlines() if line.startswith("summary:")]
    assert summary and "encoder_calls=2" in summary[0], done.stdout  # one call per distinct image


def test_the_docs_example_runs():
    """The first code block of docs/python.md runs as written (from the repository root)."""
    text = (REPO_ROOT / "docs" / "python.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block, "docs/python.md has no python block"
    done = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr

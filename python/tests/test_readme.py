"""The README's Python example runs as written (from the repository root), so it cannot rot."""

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_python_example():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Python section holds one example"
    return blocks[0]


def test_readme_python_example_runs(capsys):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(readme_python_example(), "README.md", "exec"), {"__name__": "readme"})
    finally:
        os.chdir(cwd)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3  # one line per streamed token

"""The README's Python example runs as written (from the repository root), so it cannot rot; its
fleet command lines parse with the fleet's own arguments."""

import os
import pathlib
import re
import shlex

import pytest

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


def fleet_commands(text):
    """The argument lists of every `python -m omniprefix.fleet` line in the text's shell blocks."""
    commands = []
    for block in re.findall(r"```(?:sh|bash|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "omniprefix.fleet" not in line:
                continue
            words = shlex.split(line, comments=True)
            if "omniprefix.fleet" in words and words[words.index("omniprefix.fleet") - 1] == "-m":
                commands.append(words[words.index("omniprefix.fleet") + 1:])
    return commands


def parse_fleet(argv):
    """The fleet's own parser, on a free port: the README's port may be taken where tests run."""
    from omniprefix import fleet

    argv = list(argv)
    if "--port" in argv:
        argv[argv.index("--port") + 1] = "0"
    return fleet.parse_args(argv)


def test_readme_fleet_commands_parse():
    text = (ROOT / "README.md").read_text()
    commands = fleet_commands(text)
    assert commands, "the README shows how to start a fleet"
    cwd = os.getcwd()
    os.chdir(ROOT)  # --model is relative to the repository root
    try:
        for argv in commands:
            parse_fleet(argv)
        planted = fleet_commands(text.replace("--workers", "--wrkers", 1))[0]
        with pytest.raises(SystemExit):  # a misspelled flag
            parse_fleet(planted)
    finally:
        os.chdir(cwd)

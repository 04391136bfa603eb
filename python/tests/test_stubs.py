"""The type stubs say what the extension does: the options `_omniprefix.pyi` declares once
(`EngineOptions` for `Engine.from_dir` / `Engine.random`, `SamplingOptions` for `generate` /
`stream`; `TalkerOptions` is checked in test_speech.py) are the ones it accepts."""

import ast
import pathlib
import re

import pytest

import omniprefix

STUB = pathlib.Path(omniprefix.__file__).parent / "_omniprefix.pyi"


def stub_fields(name: str) -> set:
    tree = ast.parse(STUB.read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    return {field.target.id for field in cls.body if isinstance(field, ast.AnnAssign)}


def test_the_stub_declares_every_engine_option_the_extension_accepts(qwen3_config):
    with pytest.raises(TypeError, match="unknown engine option") as info:
        omniprefix.Engine.random(qwen3_config, 0, no_such_option=1)
    accepted = set(re.search(r"options are (.*)$", str(info.value)).group(1).split(", "))
    assert len(accepted) >= 20
    assert stub_fields("EngineOptions") == accepted


def test_the_stub_declares_the_sampling_keywords_the_extension_accepts(qwen3_config):
    engine = omniprefix.Engine.random(qwen3_config, 0)
    with pytest.raises(omniprefix.RequestError, match="unknown field") as info:
        engine.generate([1, 2, 3], max_tokens=1, no_such_option=1)
    accepted = set(re.findall(r"`(\w+)`", str(info.value).split("expected one of", 1)[1]))
    assert "temperature" in accepted
    assert stub_fields("SamplingOptions") == accepted


def test_the_stub_exports_what_the_extension_exports():
    tree = ast.parse(STUB.read_text())
    exported = next(
        node for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__"
    )
    assert set(ast.literal_eval(exported.value)) == set(omniprefix._omniprefix.__all__)
    assert set(omniprefix.__all__) == set(omniprefix._omniprefix.__all__) | {"AsyncEngine", "AsyncStream"}


def test_docs_python_md_names_every_engine_option(qwen3_config):
    """docs/python.md's option list is held to the extension's own list, like the stub."""
    with pytest.raises(TypeError, match="unknown engine option") as info:
        omniprefix.Engine.random(qwen3_config, 0, no_such_option=1)
    accepted = set(re.search(r"options are (.*)$", str(info.value)).group(1).split(", "))
    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text()
    options = docs.split("\nOptions:\n", 1)[1].split("\nToken ids are", 1)[0]
    missing = sorted(name for name in accepted if f"`{name}`" not in options and f"`{name}=" not in options)
    assert not missing, f"docs/python.md's Options do not name {missing}"

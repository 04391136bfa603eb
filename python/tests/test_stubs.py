"""The type stubs say what the extension does: the engine options `_omniprefix.pyi` declares
(`EngineOptions`, used by `Engine.from_dir` and `Engine.random`) are the ones it accepts."""

import ast
import pathlib
import re

import pytest

import omniprefix

STUB = pathlib.Path(omniprefix.__file__).parent / "_omniprefix.pyi"


def stub_engine_options() -> set:
    tree = ast.parse(STUB.read_text())
    options = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineOptions")
    return {field.target.id for field in options.body if isinstance(field, ast.AnnAssign)}


def test_the_stub_declares_every_engine_option_the_extension_accepts(qwen3_config):
    with pytest.raises(TypeError, match="unknown engine option") as info:
        omniprefix.Engine.random(qwen3_config, 0, no_such_option=1)
    accepted = set(re.search(r"options are (.*)$", str(info.value)).group(1).split(", "))
    assert len(accepted) >= 20
    assert stub_engine_options() == accepted

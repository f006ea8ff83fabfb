"""The verifier core stands alone: no module under ``vllm_univer/core`` imports
vLLM or any other part of this package (integration, sizing, tools), so the
verifiers can be read, tested and reused without an engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vllm_univer.core

pytestmark = pytest.mark.quick

CORE_DIR = Path(vllm_univer.core.__file__).parent


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = ["vllm_univer", *path.parent.relative_to(CORE_DIR.parent).parts]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.append(node.module)
            else:
                base = package[: len(package) - (node.level - 1)]
                names.append(".".join(base + ([node.module] if node.module else [])))
    return names


def test_core_imports_neither_vllm_nor_the_rest_of_the_package():
    files = sorted(CORE_DIR.rglob("*.py"))
    assert len(files) > 20  # the walk found the core
    offending = [
        (str(path.relative_to(CORE_DIR)), name)
        for path in files
        for name in _imported_modules(path)
        if name == "vllm"
        or name.startswith("vllm.")
        or (name.startswith("vllm_univer") and not name.startswith("vllm_univer.core"))
    ]
    assert offending == []


def test_the_check_sees_relative_imports():
    # The walk above resolves ``from ..x import y`` against the file's own package:
    # an import that leaves the core must read as such.
    probe = CORE_DIR / "verifiers" / "univer.py"
    assert "vllm_univer.core.ops" in _imported_modules(probe)

"""The slow tier's list (tests/slow_tests.txt) names tests that exist: a renamed or removed test cannot leave the
list pointing at nothing while its replacement runs in the quick tier unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import slow_test_ids

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_slow_test_exists():
    missing = []
    for node in sorted(slow_test_ids()):
        path, name = node.split("::")[0], node.split("::")[-1].split("[")[0]
        file = ROOT / path
        names = ({n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
                 if file.is_file() else set())
        if name not in names:
            missing.append(node)
    assert not missing, f"tests/slow_tests.txt names tests that do not exist: {missing}"

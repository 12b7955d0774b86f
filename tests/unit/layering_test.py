"""The processes share only neutral modules: no orchestrator module imports the trainer or the
inference server, and none of those imports the orchestrator."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src" / "prime_rl"
FORBIDDEN = {"orchestrator": ("trainer", "inference"), "trainer": ("orchestrator", "inference"),
             "inference": ("orchestrator", "trainer")}  # fmt: skip


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_import_across_layers(layer):
    bad = [
        f"{path.relative_to(SRC)} imports {module}"
        for path in sorted((SRC / layer).rglob("*.py"))
        for module in imports(path)
        if any(module == f"prime_rl.{o}" or module.startswith(f"prime_rl.{o}.") for o in FORBIDDEN[layer])
    ]
    assert not bad, bad

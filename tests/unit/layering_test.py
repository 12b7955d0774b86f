"""The processes share only neutral modules: no orchestrator module imports the trainer or the
inference server, and none of those imports the orchestrator. Inside the orchestrator, the loop and
the env side (which may run in other processes) meet only in the message types: neither imports the
other."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src" / "prime_rl"
FORBIDDEN = {"orchestrator": ("trainer", "inference"), "trainer": ("orchestrator", "inference"),
             "inference": ("orchestrator", "trainer"), "orchestrator/loop": ("orchestrator.envs",),
             "orchestrator/envs": ("orchestrator.loop",)}  # fmt: skip


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


def test_the_layering_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The rule is not vacuous: a loop module importing the env side is reported."""
    (tmp_path / "orchestrator" / "loop").mkdir(parents=True)
    (tmp_path / "orchestrator" / "loop" / "bad.py").write_text(
        "from prime_rl.orchestrator.envs.load import load_env\n"
    )
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    with pytest.raises(AssertionError, match=r"bad\.py imports prime_rl\.orchestrator\.envs\.load"):
        test_no_import_across_layers("orchestrator/loop")

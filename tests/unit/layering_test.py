"""The processes share only neutral modules, and that holds for everything a module loads, not only
for what it names: each rule below is checked over the transitive closure of the module-level
imports of every module of a layer.

- No process reaches another: the orchestrator, the trainer, the inference server and the `rl`
  launcher meet only in the shared modules (configs, the contract, transport, ...); `rl` reads the
  other processes' configs and preflights, never their runtime.
- Inside the orchestrator, the loop and the env side (which may run in other processes) meet only
  in the message types: neither reaches the other. The configs, the advantage functions, the
  preflight and the message types belong to neither half.
- Shared modules reach no process.
- Inside the trainer, components stand in layers (`TRAINER_LAYERS`: the packed batch and
  parallelism at the bottom, then the model, then losses, estimators and the step, then RL, SFT and
  reward-model training, the entry points on top): none reaches a layer above its own, and no two
  components import each other, directly or not.

A module-level import is an `import`/`from` statement run when the module is imported: at the top
level, or inside a top-level `if`, `try`, `with` or class body; not one inside a function, nor one
under `if TYPE_CHECKING:` (neither runs at import). Importing `a.b.c` also runs the packages `a`
and `a.b`. A violation names its chain of imports, e.g. `prime_rl.trainer.main ->
prime_rl.preflight -> prime_rl.orchestrator.config`.

The sources are parsed in a child interpreter (this file run as a script), once per tree: in
CPython 3.11, building `ast` objects is not thread-safe (their recursion counter is one per
interpreter), and any other thread of the test process doing it at the same moment (formatting a
traceback does: it parses each frame's line) made `ast.parse` here fail with `SystemError: AST
constructor recursion depth mismatch`.
"""

import ast
import functools
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src" / "prime_rl"
PROCESSES = ("orchestrator", "trainer", "inference", "rl")
NEITHER_HALF = ("orchestrator.loop", "orchestrator.envs")
SHARED = sorted(
    p.name
    for p in SRC.iterdir()
    if p.name not in PROCESSES and (p.suffix == ".py" or (p / "__init__.py").exists())
)
FORBIDDEN = {
    "orchestrator": ("trainer", "inference", "rl"),
    "trainer": ("orchestrator", "inference", "rl"),
    "inference": ("orchestrator", "trainer", "rl"),
    "rl": (*NEITHER_HALF, "orchestrator.main", "trainer.main", "inference.main"),
    "orchestrator/loop": ("orchestrator.envs",),
    "orchestrator/envs": ("orchestrator.loop",),
    "orchestrator/config.py": NEITHER_HALF,
    "orchestrator/envs_config.py": NEITHER_HALF,
    "orchestrator/advantages": NEITHER_HALF,
    "orchestrator/rewards": NEITHER_HALF,
    "orchestrator/preflight.py": NEITHER_HALF,
    "orchestrator/messages.py": NEITHER_HALF,
    "orchestrator/rollout.py": NEITHER_HALF,
    **{name: PROCESSES for name in SHARED},
}
"""Layer (a folder or file under src/prime_rl) -> the modules (dotted, under prime_rl) it must not reach."""


def module_name(path: Path) -> str:
    parts = (SRC.name, *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TRAINER_LAYERS = (
    ("parallel", "attention", "batch", "stats", "data", "memory", "optim"),
    ("model", "logprobs", "lora", "moe"),
    ("losses", "estimators", "step", "weights", "run", "loop"),
    ("rl", "sft", "reward_model"),
    ("main", "export", "gpu"),
)
"""The trainer's components (its subpackages and top-level modules) in layers, bottom first: a
component reaches no runtime module of a higher layer. Configs (`config.py` files) and package
`__init__`s belong to no layer: they load no torch (tests/unit/config_test.py checks it), so any
module may import them; `preflight` reads configs only."""


def runtime_modules(component: str) -> tuple[str, ...]:
    """A trainer component's modules (dotted, under prime_rl) but its configs and package inits."""
    root = SRC / "trainer" / component
    if root.with_suffix(".py").exists():
        return (f"trainer.{component}",)
    return tuple(
        module_name(p).removeprefix(f"{SRC.name}.")
        for p in sorted(root.rglob("*.py"))
        if p.name not in ("__init__.py", "config.py")
    )


def component_path(component: str) -> str:
    return (
        f"trainer/{component}.py"
        if (SRC / "trainer" / f"{component}.py").exists()
        else f"trainer/{component}"
    )


for _i, _layer in enumerate(TRAINER_LAYERS):
    _above = tuple(m for higher in TRAINER_LAYERS[_i + 1 :] for c in higher for m in runtime_modules(c))
    for _component in _layer:
        FORBIDDEN[component_path(_component)] = _above


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(body: list[ast.stmt]):
    """The import statements that run when a module whose top-level statements are `body` is imported."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not is_type_checking(node.test):
                yield from module_level_imports(node.body)
            yield from module_level_imports(node.orelse)
        elif isinstance(node, ast.Try | ast.TryStar):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from module_level_imports(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from module_level_imports(node.body)


def with_parents(module: str) -> list[str]:
    """`a.b.c` -> `a`, `a.b`, `a.b.c`: importing a module first runs its packages."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` (prime_rl's own) that importing the module at `path` imports directly."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in module_level_imports(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            # `from package import name` imports the submodule `package.name` when there is one.
            targets = [module, *(f"{module}.{a.name}" for a in node.names)]
        found.update(m for t in targets for m in with_parents(t) if m in known and m != name)
    return found


def parsed_import_graph() -> dict[str, set[str]]:
    """The graph parsed in this process: only in the child that `import_graph` starts."""
    paths = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
    known = set(paths)
    return {name: imported_modules(path, known) for name, path in paths.items()}


@functools.cache
def _graph_of(src: Path) -> dict[str, tuple[str, ...]]:
    run = subprocess.run([sys.executable, __file__, str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"parsing {src} failed:\n{run.stderr[-2000:]}"
    return {name: tuple(imports) for name, imports in json.loads(run.stdout).items()}


def import_graph() -> dict[str, set[str]]:
    """Module -> the prime_rl modules it imports at module level, for the tree at `SRC`."""
    return {name: set(imports) for name, imports in _graph_of(SRC).items()}


def chains_to(graph: dict[str, set[str]], start: str, forbidden: tuple[str, ...]) -> list[list[str]]:
    """The shortest import chain from `start` to each forbidden module it reaches (breadth first;
    the search stops at a forbidden module, so that each chain names the first one on its way)."""

    def is_forbidden(m: str) -> bool:
        return any(m == f"{SRC.name}.{o}" or m.startswith(f"{SRC.name}.{o}.") for o in forbidden)

    came_from: dict[str, str | None] = {start: None}
    queue, chains = deque([start]), []
    while queue:
        module = queue.popleft()
        for nxt in sorted(graph[module]):
            if nxt in came_from:
                continue
            came_from[nxt] = module
            if is_forbidden(nxt):
                chain = [nxt]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                chains.append(chain[::-1])
            else:
                queue.append(nxt)
    # Importing `a.b.c` reaches the package `a.b` too: name only the module, not also its package.
    return [c for c in chains if not any(d[:-1] == c[:-1] and d[-1].startswith(f"{c[-1]}.") for d in chains)]


def violations(layer: str) -> list[str]:
    graph = import_graph()
    root = SRC / layer
    paths = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    return [
        " -> ".join(chain)
        for path in paths
        for chain in chains_to(graph, module_name(path), FORBIDDEN[layer])
    ]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_reaches_what_it_must_not(layer):
    assert (SRC / layer).exists(), f"a rule names {layer}, which is not under {SRC}"
    bad = violations(layer)
    assert not bad, "\n".join(bad)


RUNTIME_CHECK = """
import importlib, sys
for entry, forbidden in [
    ("prime_rl.trainer.main", ("prime_rl.orchestrator", "prime_rl.inference")),
    ("prime_rl.rl.main", ("prime_rl.orchestrator.loop", "prime_rl.orchestrator.envs")),
    ("prime_rl.orchestrator.loop.orchestrator", ("prime_rl.orchestrator.envs",)),
]:
    importlib.import_module(entry)
    loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not loaded, f"importing {entry} loaded {loaded}"
"""


def test_the_entry_points_load_what_the_static_check_says():
    """Python agrees with the import graph: starting the trainer loads no orchestrator, `rl` neither
    half of it, and the loop no env side (in one fresh interpreter, in that order)."""
    run = subprocess.run([sys.executable, "-c", RUNTIME_CHECK], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


# ---------------------------------------------------------------- the test of the test


def plant(root: Path, files: dict[str, str]) -> None:
    """A package tree under `root/prime_rl`: each path gets its text, each folder an `__init__.py`."""
    for rel, text in files.items():
        path = root / "prime_rl" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [root / "prime_rl", *(p for p in (root / "prime_rl").rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


@pytest.fixture
def planted(tmp_path, monkeypatch):
    def make(files: dict[str, str]) -> None:
        plant(tmp_path, files)
        monkeypatch.setitem(globals(), "SRC", tmp_path / "prime_rl")

    return make


def test_a_transitive_import_is_reported_with_its_chain(planted):
    """The loop names only a neutral module, which imports the env side: the loop reaches it."""
    planted({
        "orchestrator/loop/step.py": "from prime_rl.orchestrator import settings\n",
        "orchestrator/settings.py": "import json\n\nfrom prime_rl.orchestrator.envs.teacher import TeacherConfig\n",
        "orchestrator/envs/teacher.py": "TeacherConfig = dict\n",
    })  # fmt: skip
    assert violations("orchestrator/loop") == [
        "prime_rl.orchestrator.loop.step -> prime_rl.orchestrator.settings -> prime_rl.orchestrator.envs.teacher"
    ]
    with pytest.raises(AssertionError, match=r"loop\.step -> prime_rl\.orchestrator\.settings -> "):
        test_no_layer_reaches_what_it_must_not("orchestrator/loop")


def test_imports_under_if_and_try_count_and_those_in_functions_or_type_checking_do_not(planted):
    planted({
        "trainer/main.py": (
            "from typing import TYPE_CHECKING\n"
            "try:\n    from prime_rl import shared\nexcept ImportError:\n    shared = None\n"
            "if TYPE_CHECKING:\n    from prime_rl.orchestrator.config import OrchestratorConfig\n"
            "def later():\n    import prime_rl.inference.server\n"
        ),
        "shared.py": "import sys\nif sys.platform:\n    from prime_rl.orchestrator import config\n",
        "orchestrator/config.py": "",
        "inference/server.py": "",
    })  # fmt: skip
    assert violations("trainer") == [
        "prime_rl.trainer.main -> prime_rl.shared -> prime_rl.orchestrator.config"
    ]


def test_the_sources_are_parsed_outside_the_test_process(planted, monkeypatch):
    """No `ast` objects are built here, where another thread may be building some (see above)."""
    planted({"shared.py": "from prime_rl.orchestrator import config\n", "orchestrator/config.py": ""})
    monkeypatch.setattr(ast, "parse", lambda *a, **k: pytest.fail("ast.parse ran in the test process"))
    assert import_graph()["prime_rl.shared"] == {
        "prime_rl",
        "prime_rl.orchestrator",
        "prime_rl.orchestrator.config",
    }


def component_of(module: str) -> str | None:
    """The trainer component a runtime module belongs to (None: not the trainer's, or a config or
    package init, which any component may import)."""
    parts = module.split(".")
    if parts[:2] != [SRC.name, "trainer"] or len(parts) < 3 or parts[-1] == "config":
        return None
    path = SRC.joinpath(*parts[1:])
    return None if path.is_dir() else parts[2]


def trainer_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import loops between the trainer's components: each a list of components that reach each
    other (strongly connected), found by a reachability closure over the component graph."""
    edges: dict[str, set[str]] = {}
    for module, imports in graph.items():
        a = component_of(module)
        if a is None:
            continue
        edges.setdefault(a, set()).update(b for m in imports if (b := component_of(m)) and b != a)
    reach = {}
    for start in edges:
        seen, stack = set(), [start]
        while stack:
            for nxt in edges.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        reach[start] = seen
    loops = {
        tuple(sorted({a} | {b for b in reach[a] if a in reach.get(b, ())})) for a in edges if a in reach[a]
    }
    return [list(loop) for loop in sorted(loops)]


def test_the_trainer_layers_name_every_component():
    found = {p.stem if p.suffix == ".py" else p.name for p in (SRC / "trainer").iterdir()
             if (p.suffix == ".py" and p.stem not in ("__init__", "config", "preflight")) or (p / "__init__.py").exists()}  # fmt: skip
    assert found == {c for layer in TRAINER_LAYERS for c in layer}


def test_the_trainer_has_no_import_loop():
    assert trainer_loops(import_graph()) == []


def test_a_planted_loop_in_the_trainer_is_found(planted):
    planted({
        "trainer/losses/frame.py": "from prime_rl.trainer.rl import credit\n",
        "trainer/rl/credit.py": "from prime_rl.trainer.losses.frame import LossInputs\n",
    })  # fmt: skip
    assert trainer_loops(import_graph()) == [["losses", "rl"]]


def test_a_lower_trainer_layer_reaching_a_higher_one_is_reported(planted):
    """The packed batch is at the bottom: through a neutral module it reaches the step, a layer up."""
    planted({
        "trainer/batch.py": "from prime_rl import shared\n",
        "shared.py": "from prime_rl.trainer.step import train_step\n",
        "trainer/step.py": "",
        "trainer/losses/config.py": "",
    })  # fmt: skip
    assert violations("trainer/batch.py") == [
        "prime_rl.trainer.batch -> prime_rl.shared -> prime_rl.trainer.step"
    ]
    assert violations("trainer/losses") == []  # a config reaches nothing


if __name__ == "__main__":
    SRC = Path(sys.argv[1])
    print(json.dumps({name: sorted(imports) for name, imports in parsed_import_graph().items()}))

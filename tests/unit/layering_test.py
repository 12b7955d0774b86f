"""The processes share only neutral modules, and that holds for everything a module loads, not only
for what it names: each rule below is checked over the transitive closure of the imports of every
module of a layer, whenever they run.

- No process reaches another: the orchestrator, the trainer, the inference server and the
  launcher (`uv run rl`, `prime_rl.launcher`) meet only in the shared modules (configs, the run's
  runtime, transport and its contract, ...); the launcher reads the other processes' configs and
  preflights, never their runtime. One process config is read outside its process
  (`READ_BY_ALL`): the inference server's, which the orchestrator's config holds for its engine
  mode (vLLM's engine in the orchestrator's process); what it imports is checked like everything
  else.
- Inside the orchestrator, the loop and the env side (which may run in other processes) meet only
  in the message types: neither reaches the other. The configs, the advantage functions, the
  preflight and the message types belong to neither half.
- Shared modules reach no process, and two stand below all others (`BOTTOM`): `config/` reaches
  no other package, `runtime/` (what every process uses to run) only `config/`.
- Inside the trainer, components stand in layers (`TRAINER_LAYERS`: the packed batch and
  parallelism at the bottom, then the model, then losses, estimators and the step, then RL, SFT and
  reward-model training, the entry points on top): none reaches a layer above its own, and no two
  components import each other, directly or not.

A module's imports are every `import`/`from` statement it holds, wherever it stands: one inside a
function runs when the function is called, and is a dependency all the same (whether a module pays
for torch at import is tests/unit/config_test.py's check). Only one under `if TYPE_CHECKING:` never
runs. Importing `a.b.c` also runs the packages `a` and `a.b`. Modules loaded by name count too:
`importlib.import_module("prime_rl....")` with a constant; a package's lazy names (its `LAZY`
table, `prime_rl.config.plugins.lazy_names`), as imports of the module that takes them from the package
(`from package import name`; `import package` reaches them all); and a plugin path
('prime_rl.module:function') outside a config. A config's plugin paths are imported by the
runtime module that resolves its registry, in the config's own package (a test below holds them
there), so they are not the config's imports: any module may import a config. A violation names
its chain of imports, e.g. `prime_rl.trainer.main -> prime_rl.preflight ->
prime_rl.orchestrator.config`.

The sources are parsed in a child interpreter (this file run as a script), once per tree: in
CPython 3.11, building `ast` objects is not thread-safe (their recursion counter is one per
interpreter), and any other thread of the test process doing it at the same moment (formatting a
traceback does: it parses each frame's line) made `ast.parse` here fail with `SystemError: AST
constructor recursion depth mismatch`.
"""

import ast
import functools
import json
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src" / "prime_rl"
PROCESSES = ("orchestrator", "trainer", "inference", "launcher")
NEITHER_HALF = ("orchestrator.loop", "orchestrator.envs")
SHARED = sorted(
    p.name
    for p in SRC.iterdir()
    if p.name not in PROCESSES and (p.suffix == ".py" or (p / "__init__.py").exists())
)
FORBIDDEN = {
    "orchestrator": ("trainer", "inference", "launcher"),
    "trainer": ("orchestrator", "inference", "launcher"),
    "inference": ("orchestrator", "trainer", "launcher"),
    "launcher": (*NEITHER_HALF, "orchestrator.main", "trainer.main", "inference.main"),
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

BOTTOM = ("config", "runtime")
"""The shared packages every other one stands on, bottom first: each reaches only those below it."""
_TOP = (*PROCESSES, *(Path(name).stem for name in SHARED))
for _i, _name in enumerate(BOTTOM):
    FORBIDDEN[_name] = tuple(n for n in _TOP if n not in BOTTOM[: _i + 1])

READ_BY_ALL = ("inference.config",)
"""Process configs that any layer may import (with their packages, which importing them runs): the
`[inference]` section, which the orchestrator's config holds for its engine mode. Not a way around
the rules: the search goes on through them, so whatever they import is checked as the importer's
own. (The engine, which turns it into vLLM's arguments, needs it for its annotations only.)"""


def module_name(path: Path) -> str:
    parts = (SRC.name, *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TRAINER_LAYERS = (
    ("parallel", "attention", "batch", "stats", "data", "memory", "optim"),
    ("head", "model", "logprobs", "lora", "moe"),
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


def nodes_that_can_run(node: ast.AST):
    """Every node under `node` but those under `if TYPE_CHECKING:` (its `else` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and is_type_checking(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from nodes_that_can_run(stmt)
            continue
        yield child
        yield from nodes_that_can_run(child)


PLUGIN_PATH = re.compile(r"prime_rl(\.\w+)+:\w+")
"""A function named by its path ('package.module:function'), which `prime_rl.config.plugins` imports."""


def is_import_module(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return name in ("import_module", "__import__")


def lazy_table(tree: ast.Module) -> dict[str, list[str]]:
    """A package's `LAZY` table: module -> the names its `__getattr__` loads from that module."""
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "LAZY":
            return {module: list(names) for module, names in ast.literal_eval(node.value).items()}
    return {}


def read_module(path: Path) -> dict:
    """What the module at `path` can import: its `import` statements wherever they stand (in a
    function too), as (module, names bound from it: None for `import module`), the modules it names
    to `importlib.import_module`, the plugin paths it holds, and its `LAZY` table."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    statements, by_name, plugins = [], [], []
    for node in nodes_that_can_run(tree):
        if isinstance(node, ast.Import):
            statements += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            statements.append((".".join(p for p in (base, node.module) if p), [a.name for a in node.names]))
        elif isinstance(node, ast.Call) and is_import_module(node) and node.args:
            if isinstance(arg := node.args[0], ast.Constant) and isinstance(arg.value, str):
                by_name.append(arg.value)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and PLUGIN_PATH.fullmatch(node.value)
        ):
            plugins.append(node.value.partition(":")[0])
    return {
        "statements": statements,
        "by_name": by_name,
        "plugins": plugins,
        "lazy": lazy_table(tree) if path.name == "__init__.py" else {},
    }


def with_parents(module: str) -> list[str]:
    """`a.b.c` -> `a`, `a.b`, `a.b.c`: importing a module first runs its packages."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def imported_modules(name: str, read: dict, lazy: dict[str, dict[str, str]], known: set[str]) -> set[str]:
    """The modules of `known` (prime_rl's own) that the module `name` imports directly, now or later.

    A package's lazy name (its `LAZY`) is its module's import wherever it is imported by name;
    importing the package itself reaches all of them. A plugin path in a config is not the config's
    import: the runtime module that resolves the registry imports it (see the test of
    `PLUGIN_PATH`)."""
    targets = [*read["by_name"], *([] if is_config(name) else read["plugins"])]
    for module, names in read["statements"]:
        # `from package import name` imports the submodule `package.name` when there is one.
        targets += [module, *(f"{module}.{n}" for n in names or ())]
        table = lazy.get(module, {})
        targets += table.values() if names is None else [table[n] for n in names if n in table]
        for n in names or ():
            targets += lazy.get(f"{module}.{n}", {}).values()
    return {m for t in targets for m in with_parents(t) if m in known and m != name}


def is_config(module: str) -> bool:
    last = module.rpartition(".")[2]
    return last == "config" or last.endswith("_config")


def parsed_import_graph() -> dict[str, set[str]]:
    """The graph parsed in this process: only in the child that `import_graph` starts."""
    paths = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
    read = {name: read_module(path) for name, path in paths.items()}
    lazy = {name: {n: m for m, names in r["lazy"].items() for n in names} for name, r in read.items()}
    return {name: imported_modules(name, r, lazy, set(paths)) for name, r in read.items()}


@functools.cache
def _graph_of(src: Path) -> dict[str, tuple[str, ...]]:
    run = subprocess.run([sys.executable, __file__, str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"parsing {src} failed:\n{run.stderr[-2000:]}"
    return {name: tuple(imports) for name, imports in json.loads(run.stdout).items()}


def import_graph() -> dict[str, set[str]]:
    """Module -> the prime_rl modules it imports, for the tree at `SRC`."""
    return {name: set(imports) for name, imports in _graph_of(SRC).items()}


def chains_to(graph: dict[str, set[str]], start: str, forbidden: tuple[str, ...]) -> list[list[str]]:
    """The shortest import chain from `start` to each forbidden module it reaches (breadth first;
    the search stops at a forbidden module, so that each chain names the first one on its way)."""

    readable = {f"{SRC.name}.{m}" for r in READ_BY_ALL for m in with_parents(r)}

    def is_forbidden(m: str) -> bool:
        return m not in readable and any(
            m == f"{SRC.name}.{o}" or m.startswith(f"{SRC.name}.{o}.") for o in forbidden
        )

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
    ("prime_rl.launcher.main", ("prime_rl.orchestrator.loop", "prime_rl.orchestrator.envs")),
    ("prime_rl.orchestrator.loop.orchestrator", ("prime_rl.orchestrator.envs",)),
]:
    importlib.import_module(entry)
    loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not loaded, f"importing {entry} loaded {loaded}"
"""


def test_the_entry_points_load_what_the_static_check_says():
    """Python agrees with the import graph: starting the trainer loads no orchestrator, the launcher
    neither half of it, and the loop no env side (in one fresh interpreter, in that order)."""
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


def test_imports_count_wherever_they_stand_but_under_type_checking(planted):
    planted({
        "trainer/main.py": (
            "from typing import TYPE_CHECKING\n"
            "try:\n    from prime_rl import shared\nexcept ImportError:\n    shared = None\n"
            "if TYPE_CHECKING:\n    from prime_rl.orchestrator.loop import OrchestratorLoop\n"
            "def later():\n    import prime_rl.inference.server\n"
        ),
        "shared.py": "import sys\nif sys.platform:\n    from prime_rl.orchestrator import config\n",
        "orchestrator/config.py": "",
        "orchestrator/loop.py": "",
        "inference/server.py": "",
    })  # fmt: skip
    assert violations("trainer") == [
        "prime_rl.trainer.main -> prime_rl.inference.server",
        "prime_rl.trainer.main -> prime_rl.shared -> prime_rl.orchestrator.config",
    ]


def test_a_function_level_import_up_the_trainer_layers_fails_the_check(planted):
    """The model places a dry run's weights on a device that it imports, inside a function, from
    the dry-run tools a layer above: the check fails on it."""
    planted({
        "trainer/model.py": "def place(module):\n    from prime_rl.trainer.gpu.dry_run import materialize\n",
        "trainer/gpu/dry_run.py": "",
    })  # fmt: skip
    assert violations("trainer/model.py") == ["prime_rl.trainer.model -> prime_rl.trainer.gpu.dry_run"]
    with pytest.raises(AssertionError, match=r"trainer\.model -> prime_rl\.trainer\.gpu\.dry_run"):
        test_no_layer_reaches_what_it_must_not("trainer/model.py")


def test_the_inference_config_is_read_by_all_but_not_its_runtime(planted):
    """Any layer (here the orchestrator and the engine) may import the inference server's config,
    not its runtime."""
    planted({
        "orchestrator/config.py": "from prime_rl.inference.config import InferenceConfig\n",
        "engine/local.py": "from prime_rl.inference import config\n",
        "engine/server.py": "import prime_rl.inference.member\n",
        "inference/config.py": "",
        "inference/member.py": "",
    })  # fmt: skip
    assert violations("orchestrator") == []
    assert violations("engine") == ["prime_rl.engine.server -> prime_rl.inference.member"]


def test_what_the_inference_config_imports_is_reported_through_it(planted):
    """What that config imports is the importer's import, reported through the config."""
    planted({
        "orchestrator/config.py": "from prime_rl.inference.config import InferenceConfig\n",
        "inference/config.py": "from prime_rl.inference.member import Member\n",
        "inference/member.py": "",
    })  # fmt: skip
    assert violations("orchestrator") == [
        "prime_rl.orchestrator.config -> prime_rl.inference.config -> prime_rl.inference.member"
    ]


def test_the_runtime_reaching_up_is_reported(planted):
    """The runtime stands on the config machinery only: even the transport's config is above it."""
    planted({
        "runtime/monitor.py": "from prime_rl.config import base\n",
        "runtime/layout.py": "from prime_rl.transport import config\n",
        "config/base.py": "",
        "transport/config.py": "from prime_rl.config import base\n",
    })  # fmt: skip
    assert violations("runtime") == ["prime_rl.runtime.layout -> prime_rl.transport.config"]
    assert violations("config") == []


def test_modules_loaded_by_name_count(planted):
    """A package's lazy names are imports of whoever takes them from it; `import_module` with a
    constant and a plugin path outside a config are imports too; a config's plugin path is not."""
    planted({
        "trainer/losses/__init__.py": (
            "from prime_rl.config.plugins import lazy_names\n"
            'LAZY = {"prime_rl.trainer.rl.credit": ("Credit",)}\n'
            "__getattr__ = lazy_names(__name__, LAZY)\n"
        ),
        "trainer/rl/credit.py": "",
        "trainer/step.py": "from prime_rl.trainer.losses import Credit\n",
        "trainer/model.py": "def f():\n    from prime_rl.trainer import losses\n",
        "trainer/batch.py": "import prime_rl.trainer.losses.config\n",
        "trainer/losses/config.py": 'PPO = "prime_rl.trainer.rl.credit:credit"\n',
        "trainer/data.py": "import importlib\ndef f():\n    return importlib.import_module('prime_rl.trainer.step')\n",
        "trainer/optim.py": 'FN = "prime_rl.trainer.step:train_step"\n',
        "config/plugins.py": "",
    })  # fmt: skip
    assert violations("trainer/step.py") == ["prime_rl.trainer.step -> prime_rl.trainer.rl.credit"]
    assert violations("trainer/model.py") == ["prime_rl.trainer.model -> prime_rl.trainer.rl.credit"]
    assert violations("trainer/batch.py") == []  # a submodule's import runs the package, not its lazy names
    assert violations("trainer/data.py") == ["prime_rl.trainer.data -> prime_rl.trainer.step"]
    assert violations("trainer/optim.py") == ["prime_rl.trainer.optim -> prime_rl.trainer.step"]


def test_a_configs_plugin_paths_stay_in_its_own_package():
    """What the graph leaves out of a config (its plugin paths) is imported by its own package's
    runtime, whose modules the layers check in their own right: so leaving them out hides nothing."""
    found = {
        module: module_name(path).rpartition(".")[0]
        for path in SRC.rglob("*.py")
        if is_config(module_name(path))
        for module in re.findall(r"\"(prime_rl(?:\.\w+)+):\w+\"", path.read_text())
    }
    assert "prime_rl.trainer.losses.ppo" in found  # the test reads the registries
    elsewhere = {m: p for m, p in found.items() if m.rpartition(".")[0] != p}
    missing = [m for m in found if not SRC.parent.joinpath(*m.split(".")).with_suffix(".py").exists()]
    assert not elsewhere and not missing, {
        "outside the config's package": elsewhere,
        "no such module": missing,
    }


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

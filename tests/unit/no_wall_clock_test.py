"""No test asserts how long something took. A bound on elapsed wall time fails on a loaded machine
(rl's start-up checks once took 10.2 s against a 10 s bound) and says less than a condition would:
that the error came before the server started, that nothing was spawned, that the answer came while
the slow call still ran. Speed claims belong in benchmarks/.

Every tests/**/*.py is read with `ast`; a finding names file:line. Found, in an assertion (an
`assert`, or an `if` whose body raises or calls `pytest.fail`):

- an elapsed time compared (<, <=, >, >=) with anything, constant or not. An elapsed time is a
  subtraction with a clock reading on both sides (`time.monotonic()`, `time.time()`,
  `time.perf_counter()`, their `_ns` forms, or a name assigned from one, `t0` or a deadline), or
  what is made from one: a name assigned from it, a list it was appended to, a call on it (not
  `len`), what a function of the file returns it as (`took, out = f()` when f returns
  `(took, ...)`);
- a clock reading compared with a deadline set N <= 30 s after a clock reading, N a number or a
  name bound to one (a constant, a parameter's default: `deadline = time.monotonic() + timeout_s`):
  a wait whose expiry is the failure, too short for a loaded machine. A longer one only guards
  against a hang, as `proc.wait(timeout=600)` does.

The one exception: a bound that is the behaviour under test (a collective gives up after its
configured timeout, not torch's 30 minutes), derived from that configured value with a wide margin,
marked `# wall-clock: <why>` on the assertion's lines or in the comment just above it.

Not found (read them by eye): timeouts passed as arguments (`proc.wait(timeout=5)`,
`recv(timeout_s=2)`), and elapsed times that travel through attributes, fixtures or other files.

The sources are parsed in a child interpreter (this file run as a script), as tests/unit/
layering_test.py does: in CPython 3.11 building `ast` objects is not thread-safe.
"""

import ast
import io
import json
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

TESTS = Path(__file__).parents[1]
CLOCKS = {"monotonic", "monotonic_ns", "time", "time_ns", "perf_counter", "perf_counter_ns"}
DEADLINE_MAX_S = 30
"""A deadline this close or closer, whose expiry fails the test, is a wall-clock bound."""
MARK = re.compile(r"#\s*wall-clock:\s*\S")
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
OPAQUE = {"len", "str", "repr", "bool", "print", "isinstance", "type", "id", "hash", "format"}
"""Calls whose result is no time even when their argument is one."""
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
WHOLE = -1
"""The position that stands for a function's whole return value."""


class Scope:
    """What the names of one function (or the module) hold: a clock reading, a deadline (a reading
    plus a constant, in seconds), an elapsed time. Inner functions see their outer scopes' names."""

    def __init__(self, node: ast.AST, parent: "Scope | None"):
        self.node, self.parent = node, parent
        self.clock: set[str] = set()
        self.deadline: dict[str, float] = {}
        self.elapsed: set[str] = set()
        self.numbers: dict[str, float] = {}  # names bound to a number here: a constant, a default
        self.numbers.update((a.arg, n) for a, d in parameters(node) if (n := number(d)) is not None)

    def find(self, name: str, what: str):
        scope = self
        while scope is not None:
            held = getattr(scope, what)
            if name in held:
                return held[name] if isinstance(held, dict) else True
            scope = scope.parent
        return None


def parameters(node: ast.AST) -> list[tuple[ast.arg, ast.expr | None]]:
    """A function's parameters, each with its default (None: none)."""
    args = getattr(node, "args", None)
    if not isinstance(args, ast.arguments):
        return []
    plain = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(plain) - len(args.defaults)) + list(args.defaults)
    return [*zip(plain, defaults, strict=True), *zip(args.kwonlyargs, args.kw_defaults, strict=True)]


def owner(name: str, scope: Scope) -> Scope:
    """The scope whose variable `name` is: the nearest that assigns it (a list an inner function
    appends to is its outer function's)."""
    found = scope
    while found is not None:
        if name in {a.arg for a, _ in parameters(found.node)}:
            return found
        for n in own_nodes(found.node):
            if not isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                continue
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == name for tgt in targets for t in ast.walk(tgt)):
                return found
        found = found.parent
    return scope


def own_nodes(node: ast.AST):
    """The nodes of a scope's body, not those of the functions and classes defined in it."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, SCOPES):
            yield from own_nodes(child)


class Checker:
    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.modules = {"time"}  # names of the time module here
        self.funcs: set[str] = set()  # clocks imported by name: from time import monotonic
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.modules |= {a.asname or a.name for a in node.names if a.name == "time"}
            elif isinstance(node, ast.ImportFrom) and node.module == "time":
                self.funcs |= {a.asname or a.name for a in node.names if a.name in CLOCKS}
        self.scopes: dict[ast.AST, Scope] = {}
        self._make_scopes(tree, None)
        # Function name -> the positions of its returned tuple that are elapsed times (or WHOLE).
        self.returns: dict[str, set[int]] = {}

    def _make_scopes(self, node: ast.AST, parent: Scope | None) -> None:
        scope = self.scopes[node] = Scope(node, parent)
        for child in own_nodes(node):
            if isinstance(child, SCOPES):
                self._make_scopes(child, scope)

    # ------------------------------------------------------------ what an expression holds

    def is_reading(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return f.value.id in self.modules and f.attr in CLOCKS
        return isinstance(f, ast.Name) and f.id in self.funcs

    def is_clock(self, node: ast.AST, scope: Scope) -> bool:
        """A point in time: a reading, a name holding one, or one of those plus or minus something."""
        if self.is_reading(node):
            return True
        if isinstance(node, ast.Name):
            return bool(scope.find(node.id, "clock"))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            left, right = self.is_clock(node.left, scope), self.is_clock(node.right, scope)
            return (left or right) and not (left and right and isinstance(node.op, ast.Sub))
        return False

    def deadline_of(self, node: ast.AST, scope: Scope) -> float | None:
        """N, for a reading (or clock name) plus N: a number, or a name bound to one (a constant, a
        parameter's default)."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for point, offset in ((node.left, node.right), (node.right, node.left)):
                if self.is_clock(point, scope):
                    if number(offset) is not None:
                        return number(offset)
                    if isinstance(offset, ast.Name) and scope.find(offset.id, "numbers") is not None:
                        return scope.find(offset.id, "numbers")
        return None

    def is_elapsed(self, node: ast.AST, scope: Scope) -> bool:
        sub = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
        if sub and self.is_clock(node.left, scope) and self.is_clock(node.right, scope):
            return True
        if isinstance(node, ast.Name):
            return bool(scope.find(node.id, "elapsed"))
        if isinstance(node, (ast.JoinedStr, *SCOPES)):
            return False  # a message about a time is no time
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in OPAQUE:
                return False
            if self.returned_elapsed(node):
                return True
            args = [*node.args, *(k.value for k in node.keywords)]
            return any(self.is_elapsed(a, scope) for a in args) or self.is_elapsed(node.func, scope)
        return any(self.is_elapsed(c, scope) for c in ast.iter_child_nodes(node))

    def returned_elapsed(self, node: ast.AST | None) -> set[int]:
        """The elapsed positions (or WHOLE) of what a call of a function of this file returns, the
        call awaited or run by `asyncio.run`; empty for anything else."""
        while isinstance(node, ast.Await) or (
            isinstance(node, ast.Call) and called(node) == "run" and len(node.args) == 1
        ):
            node = node.value if isinstance(node, ast.Await) else node.args[0]
        return self.returns.get(called(node), set()) if isinstance(node, ast.Call) else set()

    # ------------------------------------------------------------ what the names hold

    def bind(self, target: ast.AST, value: ast.AST | None, scope: Scope) -> bool:
        """Record what `target = value` makes its names hold; whether anything new was learned."""
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                return any([self.bind(t, v, scope) for t, v in zip(target.elts, value.elts, strict=True)])
            positions = self.returned_elapsed(value)
            if positions and WHOLE not in positions:
                return any([self._mark(t, i in positions, scope) for i, t in enumerate(target.elts)])
            elapsed = value is not None and self.is_elapsed(value, scope)
            return any([self._mark(t, elapsed, scope) for t in target.elts])
        if not isinstance(target, ast.Name) or value is None:
            return False
        name, new = target.id, False
        if self.is_clock(value, scope) and name not in scope.clock:
            scope.clock.add(name)
            new = True
        if number(value) is not None:
            scope.numbers.setdefault(name, number(value))
        seconds = self.deadline_of(value, scope)
        if seconds is not None:  # the closest of the deadlines a name is given
            closest = min(seconds, scope.deadline.get(name, seconds))
            new |= scope.deadline.get(name) != closest
            scope.deadline[name] = closest
        return self._mark(target, self.is_elapsed(value, scope), scope) or new

    def _mark(self, target: ast.AST, elapsed: bool, scope: Scope) -> bool:
        if elapsed and isinstance(target, ast.Name) and target.id not in scope.elapsed:
            scope.elapsed.add(target.id)
            return True
        return False

    def learn(self) -> None:
        """Follow assignments, appends and returns until nothing new is learned."""
        changed = True
        while changed:
            changed = False
            for node, scope in self.scopes.items():
                for n in own_nodes(node):
                    if isinstance(n, ast.Assign):
                        changed |= any([self.bind(t, n.value, scope) for t in n.targets])
                    elif isinstance(n, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                        changed |= self.bind(n.target, n.value, scope)
                    elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                        grows = n.func.attr in ("append", "extend", "add", "insert")
                        into = n.func.value
                        if (
                            grows
                            and isinstance(into, ast.Name)
                            and any(self.is_elapsed(a, scope) for a in n.args)
                        ):
                            changed |= self._mark(into, True, owner(into.id, scope))
                    elif isinstance(n, ast.Return) and n.value is not None and hasattr(node, "name"):
                        changed |= self._returns(node.name, n.value, scope)

    def _returns(self, name: str, value: ast.AST, scope: Scope) -> bool:
        if isinstance(value, ast.Tuple):
            positions = {i for i, v in enumerate(value.elts) if self.is_elapsed(v, scope)}
        else:
            positions = {WHOLE} if self.is_elapsed(value, scope) else set()
        known = self.returns.get(name, set())
        if positions <= known:
            return False
        self.returns[name] = known | positions
        return True

    # ------------------------------------------------------------ the assertions

    def assertions(self):
        """(statement, condition, scope) of each assert and each `if` that fails the test."""
        for node, scope in self.scopes.items():
            for n in own_nodes(node):
                if isinstance(n, ast.Assert) or (isinstance(n, ast.If) and any(fails(s) for s in n.body)):
                    yield n, n.test, scope

    def findings(self) -> list[tuple[int, int, str]]:
        self.learn()
        found = []
        for stmt, test, scope in self.assertions():
            for cmp in (c for c in walk_here(test) if isinstance(c, ast.Compare)):
                if not any(isinstance(op, ORDER) for op in cmp.ops):
                    continue
                operands = [cmp.left, *cmp.comparators]
                if any(self.is_elapsed(o, scope) for o in operands):
                    found.append((cmp.lineno, stmt, "an elapsed time compared with a bound"))
                    continue
                if any(self.is_clock(o, scope) for o in operands):
                    for o in operands:
                        seconds = scope.find(o.id, "deadline") if isinstance(o, ast.Name) else None
                        seconds = self.deadline_of(o, scope) if seconds is None else seconds
                        if seconds is not None and seconds <= DEADLINE_MAX_S:
                            found.append((cmp.lineno, stmt, f"a deadline {seconds:g} s away"))
                            break
        return [(line, stmt.lineno, stmt.end_lineno or stmt.lineno, what) for line, stmt, what in found]


def number(node: ast.AST | None) -> float | None:
    value = node.value if isinstance(node, ast.Constant) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def called(node: ast.AST | None) -> str | None:
    """The name a call calls: `f` of `f(...)` and of `x.f(...)`."""
    f = node.func if isinstance(node, ast.Call) else None
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def walk_here(node: ast.AST):
    """The nodes of an expression, not those of the lambdas in it (they run elsewhere)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.Lambda):
            yield from walk_here(child)


def fails(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Raise):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        return isinstance(f, ast.Attribute) and f.attr == "fail"
    return False


def allowed(source: str) -> set[int]:
    """The lines a `# wall-clock: <why>` comment covers: its own, and for a comment on lines of its
    own, the first line of code below them."""
    lines = source.splitlines()
    marks = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and MARK.search(tok.string)
    }
    covered = set(marks)
    for line in marks:
        below = line
        while below < len(lines) and lines[below - 1].lstrip().startswith("#"):
            below += 1
        covered.add(below)
    return covered


def parsed_findings(root: Path) -> list[str]:
    """The findings under `root`, parsed in this process: only in the child `findings` starts."""
    out = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        covered = allowed(source)
        for line, first, last, what in Checker(ast.parse(source, str(path))).findings():
            if not covered.intersection(range(first, last + 1)):
                out.append(f"{path.relative_to(root)}:{line}: {what}")
    return out


def findings(root: Path) -> list[str]:
    run = subprocess.run([sys.executable, __file__, str(root)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"parsing {root} failed:\n{run.stderr[-2000:]}"
    return json.loads(run.stdout)


def test_no_test_asserts_a_wall_clock_bound():
    found = findings(TESTS)
    assert not found, "assert a condition, not how long it took (module docstring):\n" + "\n".join(found)


# ---------------------------------------------------------------- the test of the test

PLANTED = """
import asyncio
import time
from time import perf_counter as pc


def test_direct():
    t0 = time.monotonic()
    work()
    assert time.monotonic() - t0 < 10  # found


def test_through_names():
    t0 = pc()
    took = pc() - t0
    assert ok and took < 600  # found


def test_a_list_of_lags():
    lags, t = [], time.perf_counter()
    lags.append(time.perf_counter() - t - 0.005)
    assert p99(lags) < 0.05  # found


def test_from_a_helper():
    took, out = helper()
    assert "done" in out
    assert took < LIMIT  # found


def helper():
    t0 = time.time()
    return time.time() - t0, "done"


def test_returned_through_asyncio_run():
    async def go():
        t0 = time.monotonic()
        return [1], time.monotonic() - t0
    rows, seconds = asyncio.run(go())
    assert len(rows) == 1 and seconds < 5.0  # found


def test_a_list_an_inner_function_appends_to():
    frozen_for = []

    def scenario():
        t0 = time.monotonic()
        frozen_for.append(time.monotonic() - t0)

    scenario()
    assert frozen_for[0] < 30  # found


def test_a_tight_deadline():
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, "not done"  # found


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:  # found
            raise TimeoutError("not yet")


def test_a_marker_covers_its_statement_only():
    t0 = time.monotonic()
    # wall-clock: about the line below
    work()
    assert time.monotonic() - t0 < 60  # found


def test_what_passes():
    deadline = time.monotonic() + 600  # a hang guard
    while not done():
        assert time.monotonic() < deadline
    t0 = time.monotonic()
    took = time.monotonic() - t0
    assert took < 3 * TIMEOUT_S + 60  # wall-clock: the bound is the timeout under test
    # wall-clock: the bound is the timeout under test, as this comment
    # goes on to say
    assert took < 3 * TIMEOUT_S + 60
    assert len(log(took)) > 3 and f"{took:.1f}" != ""
    took = log.count("x")
    check(lambda: time.monotonic() - t0 < 1)
"""


def test_the_checker_finds_each_planted_bound_and_nothing_else(tmp_path):
    source = textwrap.dedent(PLANTED).lstrip("\n")
    (tmp_path / "planted_test.py").write_text(source)
    expected = [i for i, line in enumerate(source.splitlines(), 1) if line.endswith("# found")]
    found = findings(tmp_path)
    assert [int(f.split(":")[1]) for f in found] == expected, found
    assert found[0] == f"planted_test.py:{expected[0]}: an elapsed time compared with a bound"
    assert found[6] == f"planted_test.py:{expected[6]}: a deadline 10 s away"
    assert found[7] == f"planted_test.py:{expected[7]}: a deadline 10 s away"  # a parameter's default


def test_a_marker_without_a_reason_allows_nothing(tmp_path):
    source = "import time\nt0 = time.monotonic()\nassert time.monotonic() - t0 < 60  # wall-clock:\n"
    (tmp_path / "unmarked_test.py").write_text(source)
    assert findings(tmp_path) == ["unmarked_test.py:3: an elapsed time compared with a bound"]


if __name__ == "__main__":
    print(json.dumps(parsed_findings(Path(sys.argv[1]))))

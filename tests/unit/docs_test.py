"""The README and docs/ stay navigable and true to the tree: the README opens with the two commands,
its map links every page of docs/, its layout map names every package folder and module of
src/prime_rl (and nothing that is gone), and every relative link and anchor resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SRC = ROOT / "src" / "prime_rl"
README = ROOT / "README.md"
COMMANDS = [
    "pip install uv && UV_FIND_LINKS=$(python3 -m pip config get global.find-links) uv run rl @ configs/reverse_text/rl.toml",
    "pip install uv && UV_FIND_LINKS=$(python3 -m pip config get global.find-links) uv run pytest",
]
INDENT = 17  # where an entry's description continues on the layout map's next lines


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def layout_entries(text: str) -> dict[str, str]:
    """The layout map as {path: its description}, e.g. 'src/prime_rl/trainer/rl': 'trainer (the
    step ...), credit ...'. A folder's entries are indented under it by two spaces per level."""
    block = re.search(r"```\n(.*?)\n```", section(text, "Layout"), re.S)
    assert block, "the README's Layout section has no code block"
    entries: dict[str, str] = {}
    parents: list[str] = []
    current = None
    for line in block.group(1).split("\n"):
        match = re.match(r"^( *)(\S+)(.*)$", line)
        if match and len(match.group(1)) < INDENT:
            depth, name = len(match.group(1)) // 2, match.group(2).rstrip(",")
            parents = parents[:depth]
            current = "/".join([*parents, name.rstrip("/")])
            entries[current] = match.group(3).strip()
            if name.endswith("/"):
                parents.append(name.rstrip("/"))
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    found, fenced = set(), False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#+ (.*)", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_the_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)\n```", README.read_text(), re.S)
    assert first_block and first_block.group(1).split("\n") == COMMANDS


def test_the_readme_map_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", section(README.read_text(), "Map")))
    pages = {page.name for page in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages missing from the README's map: {sorted(pages - linked)}"


def test_the_layout_map_names_every_package_and_module():
    entries = layout_entries(README.read_text())
    missing = []
    for folder in sorted(p for p in [SRC, *SRC.rglob("*")] if p.is_dir() and p.name != "__pycache__"):
        key = "src/prime_rl" + ("/" + folder.relative_to(SRC).as_posix() if folder != SRC else "")
        if folder != SRC and key not in entries:
            missing.append(f"{key}/ (a package folder)")
            continue
        for module in sorted(folder.glob("*.py")):
            if module.stem == "__init__":
                continue
            if folder == SRC:
                if f"{key}/{module.name}" not in entries:
                    missing.append(f"{key}/{module.name}")
            elif not re.search(rf"\b{re.escape(module.stem)}\b", entries[key]):
                missing.append(f"{key}/{module.name} (not named in its folder's entry)")
    assert not missing, missing


def test_the_layout_map_names_nothing_that_is_gone():
    gone = [path for path in layout_entries(README.read_text()) if not (ROOT / path).exists()]
    assert not gone, gone


def test_the_layout_parser_reads_nested_entries():
    """The check is not vacuous: a nested folder's entry, and its continuation lines, are read."""
    text = "## Layout\n\n```\nsrc/prime_rl/\n  trainer/       main\n    rl/          trainer, credit\n" + (
        " " * INDENT + "stats\n  plot.py        `plot`\n```\n"
    )
    assert layout_entries(text) == {
        "src/prime_rl": "",
        "src/prime_rl/trainer": "main",
        "src/prime_rl/trainer/rl": "trainer, credit stats",
        "src/prime_rl/plot.py": "`plot`",
    }


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        destination = (page.parent / path) if path else page
        if not destination.exists():
            broken.append(target)
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, broken


# ---------------------------------------------------------------- built-ins, as the registries hold them

PLUGINS = ROOT / "docs" / "plugins.md"
BUILT_IN_LISTS = {
    # a registry's package (under src/prime_rl) -> (its kind's page, the line that starts the list
    # of its built-ins there: a table, whose rows' first cells name them, or a paragraph)
    "orchestrator/advantages": ("advantages.md", "Built-ins (one file each in `orchestrator/advantages/`):"),
    "trainer/estimators": ("advantages.md", "| `[trainer.advantage] type` |"),
    "trainer/losses": ("trainer.md", "| `type` | per-token loss |"),
    "orchestrator/rewards": ("environments.md", "| `type` | scores |"),
}


def registries() -> dict[str, list[str]]:
    """Every registry of built-ins under src/prime_rl, as {its kind's folder: its built-ins' names}
    (the module that defines it may be the folder's `__init__` or a module in it)."""
    import importlib

    from prime_rl.config.plugins import Registry

    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if not re.search(r"^\w+ = Registry\(", path.read_text(), re.M):
            continue
        parts = path.relative_to(SRC).with_suffix("").parts
        module = importlib.import_module(
            ".".join(("prime_rl", *parts[: -1 if parts[-1] == "__init__" else None]))
        )
        (registry,) = [value for value in vars(module).values() if isinstance(value, Registry)]
        found[path.parent.relative_to(SRC).as_posix()] = registry.names
    return found


def plugins_table(text: str) -> dict[str, list[str]]:
    """docs/plugins.md's table of kinds as {package: the built-ins named in its last column}, from
    cells such as '`trainer/losses/`: ppo, cpgd'."""
    rows = re.findall(r"^\|.*\| `([\w/]+)/`: ([\w, ]+) \|$", text, re.M)
    return {package: [name.strip() for name in names.split(",")] for package, names in rows}


def listed_built_ins(text: str, start: str) -> list[str]:
    at = text.find(f"\n{start}")
    assert at >= 0, f"no line starts with {start!r}"
    block = text[at + 1 :].split("\n\n")[0]
    if block.startswith("|"):
        return re.findall(r"^\| `(\w+)`", block.split("\n", 1)[1], re.M)  # past the header row
    return re.findall(r"`(\w+)` \(", block)


def test_the_plugins_page_names_every_built_in_of_every_registry_and_nothing_else():
    documented = {package: sorted(names) for package, names in plugins_table(PLUGINS.read_text()).items()}
    assert documented == {package: sorted(names) for package, names in registries().items()}


@pytest.mark.parametrize("package", sorted(BUILT_IN_LISTS))
def test_each_kinds_page_lists_exactly_its_built_ins(package):
    page, start = BUILT_IN_LISTS[package]
    documented = listed_built_ins((ROOT / "docs" / page).read_text(), start)
    assert sorted(documented) == sorted(registries()[package]), f"docs/{page}: {documented}"


def test_every_registry_has_its_list_checked():
    assert set(BUILT_IN_LISTS) == set(registries())


def test_the_built_in_lists_are_read_as_written():
    """The parsers are not vacuous: a table's rows past its header, a paragraph's `name` (...)
    entries, the plugins table's last column."""
    table = "| `type` | scores |\n|---|---|\n| `a` (default) | x `b` |\n| `'pkg:fn'` | y |\n| `c` | z |\n"
    assert listed_built_ins(f"intro\n{table}\nafter `d` (no)\n", "| `type` | scores |") == ["a", "c"]
    paragraph = "Built-ins: `a` (one; `x = 1` (y)), `b_c` (two).\nstill `d` (three)\n\n`e` (no)"
    assert listed_built_ins(f"\n{paragraph}", "Built-ins:") == ["a", "b_c", "d"]
    assert plugins_table("| k | s | f | `trainer/losses/`: ppo, cpgd |\n") == {
        "trainer/losses": ["ppo", "cpgd"]
    }

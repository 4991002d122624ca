"""The package's layout (README, Layout): imports flow one way through the subpackages, no module
imports itself back through others, modules and classes stay small, constants live in one place."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "epid"
ORDER = ("core", "synthesis", "dicom", "data", "models", "reconstruction", "config", "evaluation", "training")
"""The subpackages from the bottom up: each imports only itself and those before it."""
MAX_MODULE_LINES = 620
MAX_CLASS_LINES = 250
PER_FAMILY_CONSTANTS = {"SIZES"}
"""Constants each model family defines for itself, read qualified (``legacy.SIZES``)."""


def package_modules(package: Path) -> dict[str, Path]:
    """Module name -> file of every module under ``package`` (a package is its ``__init__``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(modules: dict[str, Path], name: str) -> set[str]:
    """Every epid module ``name`` imports, at any depth of its code (function-level and
    TYPE_CHECKING imports too): ``from epid.x import y`` is ``epid.x.y`` where that is a module,
    else ``epid.x``."""
    found = set()
    for node in ast.walk(ast.parse(modules[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "epid")
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "epid"):
            assert node.level == 0, f"{name}: relative import"
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
    return found


def room(name: str) -> str | None:
    """The subpackage of module ``name`` (None for the package itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(modules: dict[str, Path], name: str) -> list[str]:
    """The modules ``name`` imports from rooms above its own in ``ORDER``."""
    level = ORDER.index(room(name)) if room(name) else -1
    return sorted(target for target in imported_modules(modules, name)
                  if room(target) is None or ORDER.index(room(target)) > level)


def import_cycle(modules: dict[str, Path]) -> list[str]:
    """One import cycle (its modules, the first repeated at the end), or [] when there is none."""
    graph = {name: sorted(imported_modules(modules, name)) for name in modules}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str]:
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                return path[path.index(target):] + [name, target] if target in path else [name, target]
            if target not in state and (cycle := visit(target, path + [name])):
                return cycle
        state[name] = "done"
        return []

    for name in graph:
        if name not in state and (cycle := visit(name, [])):
            return cycle
    return []


MODULES = package_modules(PACKAGE)


def test_every_module_lives_in_a_room_of_the_order():
    assert {room(name) for name in MODULES} == {None, *ORDER}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_flow_down_the_order(name):
    if name == "epid":
        assert imported_modules(MODULES, name) == set()
    else:
        assert upward_imports(MODULES, name) == [], f"{name} imports rooms above {room(name)}"


def test_no_import_cycle():
    assert import_cycle(MODULES) == []


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    package = tmp_path / "epid"
    for room_name in ("core", "training"):
        (package / room_name).mkdir(parents=True)
        (package / room_name / "__init__.py").write_text('"""A room."""\n')
    (package / "__init__.py").write_text("")
    (package / "core" / "errors.py").write_text("def f():\n    from epid.training.loop import launch\n")
    (package / "training" / "loop.py").write_text("from epid.core import errors\n")
    modules = package_modules(package)
    assert upward_imports(modules, "epid.core.errors") == ["epid.training.loop"]
    assert upward_imports(modules, "epid.training.loop") == []
    assert import_cycle(modules) == ["epid.core.errors", "epid.training.loop", "epid.core.errors"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_classes_stay_small(name):
    source = MODULES[name].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{name}: {len(source.splitlines())} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno < MAX_CLASS_LINES, f"{name}.{node.name} is too long"


def test_each_constant_is_defined_once():
    """A module-level UPPER_CASE name (GRID_SIZE, NUM_LEAF_PAIRS, ...) is defined in one module."""
    owners: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                constant = target.id.lstrip("_") if isinstance(target, ast.Name) else ""
                if len(constant) > 1 and constant.isupper() and constant not in PER_FAMILY_CONSTANTS:
                    owners.setdefault(constant, []).append(name)
    assert {constant: names for constant, names in owners.items() if len(names) > 1} == {}


@pytest.mark.parametrize("room_name", ORDER)
def test_each_room_says_what_it_is_for(room_name):
    init = PACKAGE / room_name / "__init__.py"
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{init} has no docstring"

"""The package's shape, checked from its source: the folders follow the data path (each stage
imports only earlier ones; planning has no torch.distributed), process-wide state lives only in
``distca_hf/state.py``, no module uses another's private names, the module paths of 0.1 still
import (with a deprecation warning) as their new homes, every package (nested ones too) has a front
door naming its files, the rooms that list an order (planning, tools/bench, training/packing) import
in a straight line, no module outgrows its limit, and setup.cfg installs every package."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import distca_hf
from distca_hf._moved import MOVED

PACKAGE = Path(distca_hf.__file__).parent
REPO = PACKAGE.parent

# What each part of the package may import from the package (besides itself); the data path.
BASE = {"config", "state", "errors"}  # every stage may use the settings, the state and the exceptions
ALLOWED = {
    "errors": set(),
    "state": set(),
    "config": {"state"},
    "planning": BASE,
    "kernels": BASE,
    "runtime": {"planning", "kernels"} | BASE,
    "hf": {"runtime", "planning", "kernels"} | BASE,
    "patches": {"hf", "runtime", "planning", "kernels"} | BASE,
    "training": {"hf", "runtime", "planning"} | BASE,
    "tools": {"training", "hf", "runtime", "planning", "kernels"} | BASE,
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts
    for path in sorted((REPO / "patches").glob("*.py")):
        yield path, ("patches", path.stem)


def _imported(path: Path, parts) -> list[tuple[str, list[str], int]]:
    """``(module of the package, names, line)`` of every import of a package module in ``path``."""
    tree = ast.parse(path.read_text())
    package = list(parts[:-1]) if parts[0] != "patches" else ["patches"]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, node.module] if node.module else base)
                if parts[0] == "patches":
                    target = "patches." + (node.module or "")
            elif node.module and node.module.startswith("distca_hf"):
                target = node.module.removeprefix("distca_hf").lstrip(".")
            else:
                continue
            found.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name.removeprefix("distca_hf").lstrip("."), [], node.lineno) for a in node.names
                      if a.name.startswith("distca_hf")]
    return found


def test_each_stage_imports_only_earlier_stages():
    problems = []
    for path, parts in _modules():
        part = parts[0]
        if part not in ALLOWED:
            continue  # the front door (__init__, __main__, _moved) may import anything
        for target, names, line in _imported(path, parts):
            first = target.split(".")[0] if target else ""
            if not first or first == part:
                continue
            if first not in ALLOWED[part]:
                problems.append(f"{path.relative_to(REPO)}:{line} ({part}) imports {target}")
    assert not problems, "\n".join(problems)


def test_planning_is_pure():
    for path in (PACKAGE / "planning").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("torch.distributed") for n in names), path


def test_state_lives_in_one_place():
    """No ``global`` statement and no module-level mutable container outside ``state.py`` (constant
    tables are tuples or dicts never written; writing one would be caught in review, not here)."""
    problems = []
    for path, parts in _modules():
        if parts == ("state",):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                problems.append(f"{path.relative_to(REPO)}:{node.lineno} global {', '.join(node.names)}")
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(getattr(t, "id", None) == "__all__" for t in targets):
                continue
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            empty = (isinstance(value, (ast.List, ast.Set)) or (isinstance(value, ast.Dict) and not value.keys)
                     or (isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("set", "list", "dict")
                         and not value.args))
            if empty:
                problems.append(f"{path.relative_to(REPO)}:{node.lineno} module-level mutable container")
    assert not problems, "\n".join(problems)


def test_no_module_uses_another_modules_private_names():
    problems = []
    for path, parts in _modules():
        for target, names, line in _imported(path, parts):
            if target == ".".join(parts[:-1]) or (target == "" and len(parts) == 1):
                continue  # a package importing its own (private) submodule
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"{path.relative_to(REPO)}:{line} imports {private} from {target}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_old_module_paths_import_their_new_home(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert old not in {m.__name__ for m in (module,)}  # the new home, not a copy
    if caught:  # the first import in this process warns (later ones find it in sys.modules)
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    attribute = old.removeprefix("distca_hf.")
    if "." not in attribute:
        assert getattr(distca_hf, attribute) is module


def test_old_names_users_imported_still_resolve():
    from distca_hf.data import PackedDataset, load_documents  # noqa: F401
    from distca_hf.planner import DocumentPieces, PlannerConfig, plan_tasks  # noqa: F401
    from distca_hf.step import DistCAPeerError, plan_stats  # noqa: F401
    from distca_hf.trainer import DistCATrainer, StepTableCallback  # noqa: F401

    assert DistCAPeerError is distca_hf.DistCAPeerError


def _subpackages() -> list[str]:
    """Every package inside ``distca_hf`` as a folder path (``"tools/bench"``), nested ones included."""
    return sorted(str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def test_every_subpackage_has_a_front_door_that_names_its_files():
    """Every package of the real tree (subpackages inside subpackages too) has a docstring; each one
    but ``kernels`` and ``hf`` names every file and every subpackage folder it holds."""
    assert {"planning", "runtime", "kernels", "hf", "training", "tools", "tools/bench", "training/packing"} <= \
        set(_subpackages())
    for folder in _subpackages():
        doc = importlib.import_module("distca_hf." + folder.replace("/", ".")).__doc__
        assert doc, folder
        if folder in ("kernels", "hf"):
            continue
        inside = [p.stem for p in (PACKAGE / folder).glob("*.py") if p.stem != "__init__"]
        inside += [p.parent.name for p in (PACKAGE / folder).glob("*/__init__.py")]
        missing = [name for name in inside if name not in doc]
        assert not missing, f"distca_hf/{folder}/__init__.py does not describe {missing}"


LONGEST = {"tools/bench": 300}
"""Lines a module may have, by folder (a folder's subfolders included); elsewhere ``LONGEST_ANYWHERE``."""
LONGEST_ANYWHERE = 650


def test_no_module_is_too_long():
    """A module past the limit holds more than one job: split it by job (as ``tools/bench/`` and
    ``training/packing/`` are)."""
    offenders = []
    for path, parts in _modules():
        limit = next((n for folder, n in LONGEST.items() if "/".join(parts).startswith(folder + "/")),
                     LONGEST_ANYWHERE)
        lines = len(path.read_text().splitlines())
        if lines > limit:
            offenders.append(f"{path.relative_to(REPO)}: {lines} lines (limit {limit})")
    assert not offenders, "modules too long:\n" + "\n".join(offenders)


def test_setup_cfg_installs_every_subpackage():
    """``setup.cfg`` lists its packages one by one: a new subpackage missing there is left out of the wheel."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    missing = [f"distca_hf.{folder.replace('/', '.')}" for folder in _subpackages()]
    missing = [name for name in missing if name not in listed]
    assert not missing, f"setup.cfg [options] packages lacks {missing}"


def _room_order(room: str) -> list[str]:
    """The modules of ``room`` (a folder: ``"planning"``, ``"tools/bench"``) in the order its
    ``__init__``'s docstring lists them (lines ``    name  what it does``)."""
    import re

    doc = importlib.import_module("distca_hf." + room.replace("/", ".")).__doc__
    return re.findall(r"^ {4}(\w+) {2,}\S", doc, flags=re.M)


def _room_imports(room: str) -> dict[str, set[str]]:
    """``{module: modules of the same room it imports}`` for every module of ``room`` (its front door
    ``__init__`` and ``__main__`` aside), counting every import statement wherever it is (module
    level, or inside a function or a class)."""
    here = tuple(room.split("/"))
    dotted = ".".join(here)
    graph = {}
    for path, parts in _modules():
        if parts[:-1] != here or parts[-1] in ("__init__", "__main__"):
            continue
        found = set()
        for target, names, _ in _imported(path, parts):
            if target == dotted:  # ``from . import x``
                found |= {n for n in names if (PACKAGE.joinpath(*here) / f"{n}.py").exists()}
            elif target.startswith(dotted + "."):
                found.add(target.split(".")[len(here)])
        graph[parts[-1]] = found - {parts[-1]}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("room", ["planning", "tools/bench", "training/packing"])
def test_room_is_a_straight_line(room):
    """No import cycle inside the room (function-level imports included), and every module imports
    only modules listed above it in the room's ``__init__`` docstring, which lists them all."""
    graph = _room_imports(room)
    assert _cycle(graph) is None, f"import cycle in {room}/: {' -> '.join(_cycle(graph))}"
    order = _room_order(room)
    assert sorted(order) == sorted(graph), f"{room}/__init__'s docstring must list every module of {room}/ once"
    place = {name: i for i, name in enumerate(order)}
    late = [f"{m} imports {t}" for m, targets in graph.items() for t in sorted(targets) if place[t] > place[m]]
    assert not late, f"{room} modules importing modules listed after them: " + ", ".join(late)

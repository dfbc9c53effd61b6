"""The package's layout holds: no import circles between files (lazy imports count), rooms that
import only what their `__init__` docstring allows (so the docstrings stay true), no file over
400 lines, no flytekit in relax_core and no torch in config/."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "relax_core"
MAX_LINES = 400
SHARED = {"heap", "net", "user_code"}
"""Top-level helper modules any room may use; they import nothing of relax_core."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (functions, TYPE_CHECKING)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    graph = {}
    for name, path in mods.items():
        edges = {resolve(t) for t in _imports(name, path)}
        # A module inside a package may import its own package's __init__ (it runs first anyway).
        graph[name] = {t for t in edges if t and t != name and not name.startswith(t + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _room(module: str) -> str:
    """`relax_core.roles.rollout` -> `roles`; the package itself -> ``."""
    return module.split(".")[1] if "." in module else ""


def _declared() -> dict[str, set[str] | None]:
    """Each room's `May import:` line: a set of rooms, or None for 'every room'."""
    rooms = {}
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        match = re.search(r"^May import: (.+?)(?:\n\n|\Z)", doc, re.M | re.S)
        assert match, f"{init.relative_to(ROOT)}: its docstring needs a 'May import: ...' line"
        text = " ".join(match.group(1).split())
        if text.startswith("every room"):
            rooms[init.parent.name] = None
        elif text.startswith("nothing of relax_core"):
            rooms[init.parent.name] = set()
        else:
            rooms[init.parent.name] = {r.strip() for r in text.rstrip(".").split(",")}
    return rooms


def test_no_import_circles_between_files():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_rooms_import_only_what_their_docstring_allows():
    declared = _declared()
    bad = []
    for module, targets in _graph().items():
        room = _room(module)
        allowed = declared.get(room)
        if room in SHARED or room == "" or allowed is None:
            continue
        for target in targets:
            other = _room(target)
            if other != room and other not in allowed | SHARED:
                bad.append(f"{module} imports {target} ({room} may import: {sorted(allowed)})")
    assert bad == []


def test_declared_rooms_exist_and_form_no_circle():
    declared = _declared()
    for room, allowed in declared.items():
        assert allowed is None or allowed <= set(declared), (room, allowed - set(declared))
    graph = {room: allowed or set() for room, allowed in declared.items() if allowed is not None}
    assert _cycles(graph) == []


def test_shared_modules_import_nothing_of_relax_core():
    graph = _graph()
    for name in SHARED:
        assert graph[f"relax_core.{name}"] == set()


def _third_party(room: str) -> set[str]:
    names = set()
    for path in (PKG / room).rglob("*.py"):
        names |= {i.split(".")[0] for i in _imports(str(path), path) if i}
    return names


def test_config_imports_neither_torch_nor_flytekit_and_algorithms_only_torch():
    assert not {"torch", "flytekit", "transformers"} & _third_party("config")
    stdlib = {"__future__", "collections", "dataclasses", "math", "typing"}
    assert _third_party("algorithms") - stdlib <= {"torch", "relax_core"}


def test_relax_core_never_imports_flytekit():
    users = [
        p for p in PKG.rglob("*.py") if "flytekit" in {i.split(".")[0] for i in _imports("", p)}
    ]
    assert users == []


def test_no_python_file_outside_tests_is_over_400_lines():
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    files += [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")]  # new, not yet committed
    long = {
        f: n
        for f in sorted(set(files))
        if not f.startswith("tests/")
        and (ROOT / f).is_file()
        and (n := len((ROOT / f).read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def _named_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from relax_core... import name`, in functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("relax_core"):
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def test_every_import_of_relax_core_names_something_that_exists():
    """Lazy imports included: a moved function fails here, not in the middle of a run."""
    import importlib

    sources = [
        p
        for d in ("relax_core", "tasks", "workflows", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")
    ]
    missing = []
    for path in sources:
        for line, module, name in _named_imports(path):
            try:
                imported = importlib.import_module(module)
            except ImportError as exc:
                if (exc.name or "").startswith("relax_core"):
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {module} ({exc})")
                continue  # an optional third-party package (megatron, sglang) not installed
            if not hasattr(imported, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {module}.{name}")
    assert missing == []


def test_every_attribute_of_an_imported_relax_core_module_exists():
    """`from relax_core.run import lifecycle` then `lifecycle.start_run(...)`: a function moved
    out of the module fails here (the check above sees only the names imported)."""
    import importlib

    sources = [
        p
        for d in ("relax_core", "tasks", "workflows", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")
    ]
    missing = []
    for path in sources:
        tree = ast.parse(path.read_text())
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("relax_core"):
                for alias in node.names:
                    try:
                        imported = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        continue  # a name, not a module (the check above covers it)
                    modules[alias.asname or alias.name] = imported
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and not hasattr(modules[node.value.id], node.attr)
            ):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                missing.append(f"{where}: {node.value.id}.{node.attr}")
    assert missing == []

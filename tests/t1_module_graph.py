"""Level t1, units: no mount and no engine.
The shape of the code: no import circle among the project's modules, pffs
never imports the engine bridge, no module of pffs past 600 lines, a tree by
role (no two modules of one file name, few modules at pffs's top, one folder
per engine adapter), and test files named by level.

Every import counts: at the top, inside functions, under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pffs", "engine_bridge")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that module *name* imports."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from a import b": the module a.b if there is one, else a.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            # The innermost project module named (importing a.b.c runs a.b.c).
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of *graph*, or None."""
    state: dict[str, int] = {}     # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    """(The check itself: a circle hidden in a function or a TYPE_CHECKING block is found.)"""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import y\n"
                   "def f():\n    from . import z\n")
    assert _imports("pkg.m", src, {"pkg.m": src, "pkg.x": src, "pkg.z": src}) == {"pkg.x", "pkg.z"}


def test_no_import_circle_among_the_projects_modules():
    graph = _graph()
    assert len(graph) > 50
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_pffs_never_imports_the_engine_bridge():
    graph = _graph()
    offenders = sorted(f"{m} imports {t}" for m, ts in graph.items() if m.split(".")[0] == "pffs"
                       for t in ts if t.split(".")[0] == "engine_bridge")
    assert offenders == []


def test_no_module_of_pffs_past_600_lines():
    long = sorted(f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / "pffs").rglob("*.py")
                  if (n := len(p.read_text().splitlines())) >= MAX_LINES)
    assert long == []


def _defined_names() -> tuple[set[str], dict[str, str]]:
    """Every class of the project, and each class's source (methods, attributes)."""
    classes: dict[str, str] = {}
    names: set[str] = set()
    for path in _modules().values():
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = classes.get(node.name, "") + (ast.get_source_segment(src, node) or "")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
    return names, classes


def test_the_architecture_and_concurrency_pages_name_what_exists():
    """docs/architecture.md (one page) and docs/concurrency.md: every file they
    name exists, every class they name is defined, and every `Class.member`
    is in that class."""
    import re
    names, classes = _defined_names()
    wrong = []
    for doc in ("architecture.md", "concurrency.md"):
        text = (ROOT / "docs" / doc).read_text()
        if doc == "architecture.md":
            assert len(text.splitlines()) <= 130, "the architecture is one page"
        for path in re.findall(r"\b((?:pffs|engine_bridge|docs|tests|benchmarks)/[\w/]+\.(?:py|md))", text):
            if not (ROOT / path).exists():
                wrong.append(f"{doc}: no file {path}")
        for token in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", text):
            head, _, member = token.partition(".")
            if head[:1].isupper() and head.isidentifier() and not head.isupper():
                if head not in classes:
                    wrong.append(f"{doc}: no class {head}")
                elif member and member.split(".")[0] not in classes[head]:
                    wrong.append(f"{doc}: {head} has no {member}")
    assert wrong == []


def test_no_two_modules_share_a_file_name():
    """A file name says which module it is: ``__init__.py``, ``__main__.py``
    and a package's ``errors.py`` aside, no name is used twice."""
    seen: dict[str, list[str]] = {}
    for path in _modules().values():
        if path.name not in ("__init__.py", "__main__.py", "errors.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_pffs_keeps_at_most_eight_modules_at_its_top():
    """The rest of pffs sits in folders by role (fs, live, namespace, store,
    daemon, maint, bucket, client)."""
    top = sorted(p.name for p in (ROOT / "pffs").glob("*.py"))
    assert len(top) <= 8, top


def test_each_engine_adapter_sits_in_its_own_folder():
    for adapter in ("reference", "transformers", "vllm"):
        folder = ROOT / "engine_bridge" / adapter
        assert (folder / "__init__.py").is_file(), adapter
    loose = sorted(p.name for p in (ROOT / "engine_bridge").glob("*.py"))
    assert not [n for n in loose if any(a in n for a in ("reference", "transformers", "vllm"))], loose


def test_test_files_are_named_by_level_and_say_it():
    """Test files are named by level, as s3ql's are (t1 units, t2 in process
    without a mount, t3 real mounts, t4 engines, t5 whole workflows), and each
    one's docstring begins with it. pytest collects only those names
    (pyproject's ``python_files``), so a test anywhere else would never run:
    the helper modules beside them define none."""
    import re
    assert 'python_files = ["t[1-5]_*.py"]' in (ROOT / "pyproject.toml").read_text().splitlines()
    wrong = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        level = re.fullmatch(r"t([1-5])_\w+\.py", path.name)
        if level:
            if not (ast.get_docstring(tree) or "").startswith(f"Level t{level.group(1)}"):
                wrong.append(f"{path.name}: its docstring does not begin with 'Level t{level.group(1)}'")
        elif any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name.lower().startswith("test") for n in tree.body):
            wrong.append(f"{path.name}: holds tests, but pytest collects only t[1-5]_*.py")
    assert wrong == []


#: What the engine bridge may import of pffs: the page and manifest model, the
#: names a client sees, the client modules, and the engine's end of the socket.
BRIDGE_MAY_IMPORT = {"pffs", "pffs.codec", "pffs.errors", "pffs.manifest", "pffs.names", "pffs.types",
                     "pffs.live.protocol"}


def test_the_engine_bridge_reaches_pffs_through_its_public_modules_only():
    """engine_bridge imports no module of pffs's store, filesystem, namespace,
    daemon, maintenance or bucket, nor of pffs.live but its wire protocol.

    Its door into a mount's store is pffs.client.access (any pffs.client
    module may be used); pffs.live.protocol stays allowed by name: it is the
    message format both ends of the engine socket speak, standard library
    only, and importing it imports nothing else of pffs.live."""
    graph = _graph()
    offenders = sorted(f"{m} imports {t}" for m, ts in graph.items() if m.split(".")[0] == "engine_bridge"
                       for t in ts if t.split(".")[0] == "pffs"
                       and t not in BRIDGE_MAY_IMPORT and not t.startswith("pffs.client."))
    assert offenders == []
    assert "pffs.client.access" in {t for m, ts in graph.items() if m.startswith("engine_bridge.") for t in ts}


def test_pffs_live_is_made_of_members_and_shares_only_public_names():
    """pffs.live's parts are members of one another, never base classes (the
    engines/ tree is built on the tree protocol, pffs.fs.routing.Tree, alone);
    what one module uses of another is public (no ``_name`` imported across
    modules), and no module imports a name only for others to import it
    from there (``noqa: F401``)."""
    modules = _modules()
    allowed_bases = {("pffs.fs.routing", "Tree")}
    wrong = []
    for name, path in modules.items():
        if not name.startswith("pffs.live"):
            continue
        src = path.read_text()
        if "noqa: F401" in src:
            wrong.append(f"{name}: a name imported for others (noqa: F401)")
        imported: dict[str, tuple[str, str]] = {}
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] in PACKAGES:
                for a in node.names:
                    if a.name.startswith("_"):
                        wrong.append(f"{name}: imports {a.name} from {node.module}")
                    imported[a.asname or a.name] = (node.module, a.name)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                for b in node.bases:
                    origin = imported.get(b.id) if isinstance(b, ast.Name) else None
                    if origin is not None and origin not in allowed_bases:
                        wrong.append(f"{name}: {node.name} is built on {origin[0]}.{origin[1]}")
    assert wrong == []

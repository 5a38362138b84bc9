"""Level t1, units: no mount and no engine.
The shape of the code: no import circle among the project's modules, imports
pointing one way (namespace <- fs <- live <- daemon, none into pffs.client
from below), pffs never imports the engine bridge, no module of pffs past 600 lines, a tree by
role (no two modules of one file name, few modules at pffs's top, one folder
per engine adapter), test files named by level, and no module importing
another's private name.

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


#: pffs's folders from the bottom up: a module of one imports no module of a
#: folder above it.  The chain key (pffs.tokenkeys) sits at pffs's top, below
#: them all; pffs.client re-exports it to engines (pffs.client.chainkeys).
LAYERS = ("namespace", "fs", "live", "daemon")


def _import_points_up(graph: dict[str, set[str]]) -> list[str]:
    """Each import in *graph* that points up: namespace/ or fs/ importing
    pffs.client, or one of LAYERS importing a folder above it (fs/ and live/
    thereby import each other no more: live/ is above fs/)."""
    def folder(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 2 and parts[0] == "pffs" else ""
    found = []
    for m, ts in graph.items():
        low = folder(m)
        for t in ts:
            high = folder(t)
            if low in ("namespace", "fs") and t.startswith("pffs.client"):
                found.append(f"{m} imports {t}")
            elif low in LAYERS and high in LAYERS and LAYERS.index(high) > LAYERS.index(low):
                found.append(f"{m} imports {t}")
    return sorted(found)


def test_imports_point_one_way():
    """namespace/ and fs/ import nothing of pffs.client (the chain key is
    below them), and fs/ imports nothing of live/ (daemon/ builds the
    handlers of both): imports go namespace <- fs <- live <- daemon."""
    assert _import_points_up(_graph()) == []


def test_the_one_way_check_sees_imports_pointing_up():
    """(The check itself: namespace/ importing pffs.client, fs/ importing
    live/ are found; live/ importing fs/ and daemon/ importing both are not.)"""
    graph = {"pffs.namespace.a": {"pffs.client.chainkeys", "pffs.manifest"},
             "pffs.fs.b": {"pffs.live.view", "pffs.namespace.a"},
             "pffs.live.view": {"pffs.fs.b"},
             "pffs.daemon.c": {"pffs.fs.b", "pffs.live.view", "pffs.client.x"}}
    assert _import_points_up(graph) == ["pffs.fs.b imports pffs.live.view",
                                        "pffs.namespace.a imports pffs.client.chainkeys"]


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
    for adapter in ("reference", "transformers", "vllm", "sglang"):
        folder = ROOT / "engine_bridge" / adapter
        assert (folder / "__init__.py").is_file(), adapter
    loose = sorted(p.name for p in (ROOT / "engine_bridge").glob("*.py"))
    assert not [n for n in loose if any(a in n for a in ("reference", "transformers", "vllm", "sglang"))], loose


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
# -- the daemon writes no SQL; parts are built whole ---------------------------------

#: The daemon's modules: every query they run is a function of pffs/namespace/.
NO_SQL = ("pffs/fs", "pffs/live", "pffs/daemon")
SQL_WORDS = ("SELECT", "INSERT", "UPDATE", "DELETE", "CREATE", "PRAGMA")


def _sql_in(path: Path) -> list[tuple[int, str]]:
    """Where module *path* runs SQL: ``.execute``/``.executemany``/``.executescript``
    calls, and string literals (f-strings too) that begin with a statement."""
    import re
    found = []
    statement = re.compile(r"\s*(?:%s)\b" % "|".join(SQL_WORDS))
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("execute", "executemany", "executescript"):
            found.append((node.lineno, f".{node.func.attr}()"))
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text = str(node.values[0].value)
        if text is not None and statement.match(text):
            found.append((node.lineno, repr(text.strip()[:40])))
    return sorted(set(found))


def test_the_daemons_modules_run_no_sql_of_their_own():
    """pffs/fs/, pffs/live/ and pffs/daemon/ run every query through a function
    of pffs/namespace/ (pffs/maint/ and pffs/bucket/ may keep their own)."""
    found = [f"{p.relative_to(ROOT)}:{line}: {what}" for d in NO_SQL
             for p in sorted((ROOT / d).rglob("*.py")) for line, what in _sql_in(p)]
    assert found == []


def test_the_sql_check_sees_calls_and_statements(tmp_path):
    """(The check itself: a query call or a statement is found, a word that only
    looks like one is not.)"""
    src = tmp_path / "m.py"
    src.write_text('def f(c, t):\n    c.execute("x")\n    q = f"DELETE FROM {t}"\n'
                   '    return "Delete the rest", " SELECT 1", q\n')
    assert [what for _line, what in _sql_in(src)] == [".execute()", "'DELETE FROM'", "'SELECT 1'"]


#: The one module that says which blobs are referenced (the gc roots).
REFERENCES = "pffs/namespace/references.py"
#: The tables whose rows reference blobs: a query of all three is that rule.
ROOT_TABLES = ("blocks", "manifest_pages", "cached_keys")


def _reference_rules_in(path: Path) -> list[str]:
    """The functions and module-level assignments of *path* whose SQL (every
    string literal in them that holds a query) names every one of ROOT_TABLES."""
    import re
    tree = ast.parse(path.read_text(), str(path))
    units = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    units += [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))]
    found = []
    for unit in units:
        sql = " ".join(n.value for n in ast.walk(unit) if isinstance(n, ast.Constant)
                       and isinstance(n.value, str) and re.search(r"\b(SELECT|DELETE|UPDATE)\b", n.value))
        if all(re.search(rf"\b{table}\b", sql) for table in ROOT_TABLES):
            found.append(f"{path.relative_to(path.parents[1])}:{unit.lineno}")
    return found


def test_which_blobs_are_referenced_is_written_once():
    """gc, check, du, stats and the bucket's lease ask pffs/namespace/references.py
    which blobs are referenced; no other module writes that rule again."""
    found = [where for p in sorted((ROOT / "pffs").rglob("*.py")) if p != ROOT / REFERENCES
             for where in _reference_rules_in(p)]
    assert found == []
    assert _reference_rules_in(ROOT / REFERENCES)


def test_the_reference_check_sees_a_rule_spread_over_one_function(tmp_path):
    """(The check itself: three lookups in one function are a copy of the rule;
    one table's query alone, or a word in a docstring, is not.)"""
    src = tmp_path / "pkg" / "m.py"
    src.parent.mkdir()
    src.write_text('def named(c, d):\n'
                   '    """Held by blocks, manifest_pages or cached_keys."""\n'
                   '    return (c.execute("SELECT 1 FROM blocks WHERE blob=?", (d,)).fetchone()\n'
                   '            or c.execute("SELECT 1 FROM manifest_pages WHERE digest=?", (d,)).fetchone()\n'
                   '            or c.execute("SELECT 1 FROM cached_keys WHERE digest=?", (d,)).fetchone())\n'
                   'Q = "SELECT digest FROM cached_keys"\n'
                   'def doc():\n'
                   '    """blocks, manifest_pages and cached_keys."""\n')
    assert _reference_rules_in(src) == ["pkg/m.py:1"]


#: Where a part must arrive through constructors only: nothing assigns a
#: collaborator into another object after it was built.
BUILT_WHOLE = ("pffs/fs", "pffs/live", "pffs/daemon", "pffs/bucket/lease.py")

#: Assignments into another object that stay, each with its reason: (module,
#: target) -> why the value is a record its owner fills, not a collaborator.
RECORDS = {
    ("pffs/fs/files.py", "st.staging"):
        "InodeState is the record Files keeps of an open inode; the staged bytes in it"
        " are Files' own, made and closed by it",
    ("pffs/live/view.py", "entry.incoming"):
        "a SessionEntry's session being copied in: a record the live view keeps and fills",
}

#: What a record may hold without it being a collaborator: a trio event or
#: lock its waiters share.
SYNC_OBJECTS = {"trio.Event", "trio.Lock"}


def _is_class(name: str) -> bool:
    return name[:1].isupper() and not name.isupper()


def _constructs(value: ast.expr) -> bool:
    """A call that builds an object: ``Class(...)``, ``mod.Class(...)``, ``Class.make(...)``."""
    if not isinstance(value, ast.Call) or ast.unparse(value.func) in SYNC_OBJECTS:
        return False
    f = value.func
    if isinstance(f, ast.Name):
        return _is_class(f.id)
    if isinstance(f, ast.Attribute):
        return _is_class(f.attr) or (isinstance(f.value, ast.Name) and _is_class(f.value.id))
    return False


def _methods(trees: list[ast.AST]) -> set[str]:
    """The names of the methods of every class in *trees* (properties are data)."""
    out = set()
    for tree in trees:
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                out.update(f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and not any("property" in ast.unparse(d) for d in f.decorator_list))
    return out


def _class_parts(cls: ast.ClassDef | None) -> set[str]:
    """The attributes of *cls* that hold parts: declared with a class as their
    type, or set to a constructed object."""
    out: set[str] = set()
    if cls is None:
        return out
    for node in ast.walk(cls):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and any(_is_class(n.id) for n in ast.walk(node.annotation) if isinstance(n, ast.Name)):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign) and _constructs(node.value):
            out.update(t.attr for t in node.targets if isinstance(t, ast.Attribute)
                       and isinstance(t.value, ast.Name) and t.value.id == "self")
    return out


def _parts_bound(fn: ast.AST) -> set[str]:
    """Names bound in function *fn* to a part: a local function, a lambda, a
    constructed object, or what a ``with`` gives (a nursery)."""
    out = set()
    for node in ast.walk(fn):
        if node is not fn and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign) and (isinstance(node.value, ast.Lambda) or _constructs(node.value)):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            out.add(node.optional_vars.id)
    return out


def _a_part(value: ast.expr, parts: set[str], own_parts: set[str], methods: set[str]) -> bool:
    """Whether *value* is a collaborator rather than data: a lambda, a
    constructed object, a part bound in the function (*parts*), a part of
    ``self``'s (*own_parts*), or a bound method (one of *methods*)."""
    if isinstance(value, ast.Lambda) or _constructs(value):
        return True
    if isinstance(value, ast.Name):
        return value.id in parts
    if isinstance(value, ast.Attribute):
        if value.attr in methods:
            return True
        return isinstance(value.value, ast.Name) and value.value.id in ("self", "cls") \
            and value.attr in own_parts
    return False


def _assigned_parts(path: Path, root: Path = ROOT, methods: set[str] | None = None) -> list[tuple[str, str, int]]:
    """(module, target, line) of each collaborator assigned into an object other
    than ``self``/``cls`` (``x.y = part``) in module *path* (of the tree at
    *root*; *methods*: the project's method names, default those of *path*)."""
    tree = ast.parse(path.read_text(), str(path))
    methods = _methods([tree]) if methods is None else methods
    rel = str(path.relative_to(root))
    classes: dict[ast.AST, ast.ClassDef] = {}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            classes.update((fn, cls) for fn in ast.walk(cls))
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        parts, own = _parts_bound(fn), _class_parts(classes.get(fn))
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple):
                    values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value] * len(target.elts)
                    pairs = list(zip(target.elts, values))
                for t, v in pairs:
                    if not isinstance(t, ast.Attribute):
                        continue
                    if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                        continue
                    if _a_part(v, parts, own, methods):
                        found.append((rel, ast.unparse(t), node.lineno))
    return sorted(set(found))


def _built_whole_offenders(root: Path) -> list[str]:
    """What the check finds in the tree at *root*, but RECORDS and the pending sites."""
    methods = _methods([ast.parse(p.read_text()) for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))])
    paths = []
    for where in BUILT_WHOLE:
        p = root / where
        paths += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return [f"{m}:{line}: {t} = ..." for p in paths for m, t, line in _assigned_parts(p, root, methods)
            if (m, t) not in RECORDS]


def test_parts_are_built_whole():
    """No collaborator is handed to a part by assignment after it was built
    (``x.y = part`` where x is not ``self``): each arrives through its
    constructor.  Plain data (EntryAttributes' ``st_*``, counters, flags, a
    record filled by its owner) is not a collaborator; RECORDS lists the
    assignments of records that stay, each with its reason."""
    assert _built_whole_offenders(ROOT) == []


def test_the_built_whole_check_sees_parts_and_not_data(tmp_path):
    """(The check itself: parts handed over after construction are found, data is not.)"""
    src = tmp_path / "m.py"
    src.write_text(
        "class Reserve:\n"
        "    def release(self): pass\n"
        "class RemoteMount:\n"
        "    def known(self, d): pass\n"
        "    @property\n"
        "    def size(self): pass\n"
        "class Daemon:\n"
        "    reserve: Reserve\n"
        "    def __init__(self):\n"
        "        self.t0 = 0\n"
        "    async def main(self, node, ctx, stored):\n"
        "        a = EntryAttributes()\n"
        "        a.st_ino, a.st_size, a.st_mtime_ns = node.id, stored.size, self.t0\n"
        "        st.writer_uid = ctx.uid\n"
        "        entry.waiting = trio.Event()\n"
        "        inv = Invalidator(x)\n"
        "        def spawn(): pass\n"
        "        async with trio.open_nursery() as nursery:\n"
        "            self.ops.files.nursery = nursery\n"
        "        live.fetch = lambda d: d\n"
        "        live.invalidate = inv\n"
        "        live.spawn = spawn\n"
        "        st.blobs.reserve = self.reserve\n"
        "        self.db.on_full = self.reserve.release\n"
        "        rm = RemoteMount(1)\n"
        "        blobs.likely_stored = rm.known\n"
        "        st.staging = Staging(1)\n"
        "        self.remote = attach(1)\n")
    got = [t for _m, t, _line in _assigned_parts(src, tmp_path)]
    assert sorted(got) == sorted(["self.ops.files.nursery", "live.fetch", "live.invalidate", "live.spawn",
                                  "st.blobs.reserve", "self.db.on_full", "blobs.likely_stored", "st.staging"])


def test_no_module_imports_a_private_name_of_another():
    """A name one module takes from another is public: no ``from pffs.x import
    _y`` (nor relative, nor of engine_bridge) in pffs/ and engine_bridge/; a
    name another module uses loses its underscore."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if not node.level and (node.module or "").split(".")[0] not in PACKAGES:
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__")):
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        found.append(f"{where}: from {'.' * node.level}{node.module or ''} import {a.name}")
    assert found == []

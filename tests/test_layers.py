"""The package's layers, checked from the source alone (ast, nothing imported): no import cycle
between modules, no import upward by the rank table RANKS, no module that imports a module of the
package that does not exist, no file over MAX_FILE_LINES lines and no class over MAX_CLASS_LINES.

Every `import` and `from ... import` of a file counts, wherever it stands (inside a function, under
`if TYPE_CHECKING`, in a try block); relative imports are resolved; `from pkg import name` counts as
importing pkg.name where that is a module, else pkg. Importing a.b.c does not count as importing the
packages a and a.b, although Python runs their __init__ first (every package would be in a cycle).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "andrea"
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400  # end_lineno - lineno of the class statement

# The rank of each module, by the longest prefix of its dotted name that is a key here (a
# package's __init__.py is named <package>.__init__, so that it can have a rank of its own). A
# module may import modules of its own rank or lower; a module no key covers is an error.
RANKS = {
    # 0: leaves every layer may use
    "andrea.paths": (0,),
    "andrea.config": (0,),
    "andrea.util": (0,),
    # 1: data preparation and reading
    "andrea.data": (1,),
    # 2: the backends
    "andrea.backends.interface": (2, 0),
    "andrea.backends.ref": (2, 1),  # the NumPy reference kernels
    "andrea.backends.numpy_backend": (2, 2),
    "andrea.backends.cuda": (2, 3, 3),  # a module of cuda/ not named below: an op's level
    "andrea.backends.cuda.runtime": (2, 3, 0),
    "andrea.backends.cuda.pdl": (2, 3, 0),
    "andrea.backends.cuda.cublas": (2, 3, 0),
    "andrea.backends.cuda.cublaslt": (2, 3, 0),
    "andrea.backends.cuda.graphs": (2, 3, 0),
    "andrea.backends.cuda.graph_edit": (2, 3, 0),  # graphs.py's edit of a captured graph (libcuda only)
    "andrea.backends.cuda.workspace": (2, 3, 0),
    "andrea.backends.cuda.geometry": (2, 3, 1),
    "andrea.backends.cuda.tuning": (2, 3, 1),
    "andrea.backends.cuda.gradpass": (2, 3, 2),
    "andrea.backends.cuda.colsum": (2, 3, 2),  # the deferred column sums gradpass runs
    "andrea.backends.cuda.fp8": (2, 3, 2),
    "andrea.backends.cuda.ops": (2, 3, 3),
    "andrea.backends.cuda.backend": (2, 3, 4),
    "andrea.backends.cuda.__init__": (2, 3, 4),
    "andrea.backends.__init__": (2, 9),  # get_backend: every backend
    # 3 and up
    "andrea.core": (3,),
    "andrea.use": (4,),
    "andrea.run": (5,),
    "andrea.tasks": (5,),  # standard benchmarks: reads andrea.use (locate), read by the pipeline
    "andrea.serve": (5,),  # andrea serve: the HTTP API over andrea.use
    "andrea.pipeline": (6,),
    "andrea.bench": (7,),
    "andrea.cli": (8,),
    "andrea.train": (8,),
    "andrea.__init__": (8,),
}


# ------------------------------------------------------------------ the checks, on any package
def find_modules(root: Path) -> dict:
    """{dotted module name: (path, is_package)} of every .py file under the package folder root
    (a package's __init__.py is the package's name)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        if "__pycache__" in rel.parts:
            continue
        parts = rel.parts
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _resolve(name: str, modules: dict) -> tuple:
    """(module, missing): the module of the package that importing name runs (the longest
    prefix of name that is one), and whether name itself is no module of it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i]), i < len(parts)
    return None, True


def module_imports(name: str, path: Path, is_package: bool, modules: dict) -> tuple:
    """(imported, missing) of one module: the set of modules of the package it imports, and the
    names it imports as modules of the package that are none (sorted)."""
    top = next(iter(modules)).split(".")[0] if modules else name.split(".")[0]
    here = name.split(".") if is_package else name.split(".")[:-1]  # the package relative imports start at
    imported, missing = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == top:
                    mod, absent = _resolve(alias.name, modules)
                    if absent:
                        missing.add(alias.name)
                    if mod is not None:
                        imported.add(mod)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here[:len(here) - (node.level - 1)] if node.level - 1 <= len(here) else []
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != top:
                continue
            if base not in modules:
                missing.add(base)
                mod, _ = _resolve(base, modules)
                if mod is not None:
                    imported.add(mod)
                continue
            names = [f"{base}.{a.name}" for a in node.names if a.name != "*"]
            subs = [n for n in names if n in modules]
            imported.update(subs)
            if len(subs) < len(node.names):  # some name is no module: it comes from base itself
                imported.add(base)
    imported.discard(name)
    return imported, sorted(missing)


def import_graph(root: Path) -> tuple:
    """(graph, missing, modules): {module: set of modules it imports} of the package at root,
    {module: names it imports that are no module of the package}, and find_modules(root)."""
    modules = find_modules(root)
    graph, missing = {}, {}
    for name, (path, is_package) in modules.items():
        graph[name], absent = module_imports(name, path, is_package, modules)
        if absent:
            missing[name] = absent
    return graph, missing, modules


def find_cycles(graph: dict) -> list:
    """One cycle [a, b, ..., a] through each strongly connected component of more than one
    module (Tarjan), sorted."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):  # iterative: a deep package must not hit the recursion limit
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == node:
                            break
                    comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:
        if len(comp) < 2:
            continue
        start = min(comp)
        # the shortest way round from start back to it, inside the component (breadth first)
        prev, frontier, found = {start: None}, [start], None
        while frontier and found is None:
            nxt = []
            for u in frontier:
                for w in sorted(graph.get(u, ())):
                    if w == start:
                        found = u
                        break
                    if w in comp and w not in prev:
                        prev[w] = u
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        u = found
        while u is not None and u != start:
            path.append(u)
            u = prev[u]
        path = [start] + path[1:][::-1] + [start]
        cycles.append(path)
    return sorted(cycles)


def rank_of(name: str, is_package: bool, ranks: dict):
    """The rank of a module by the longest key of ranks that is a dotted prefix of its name
    (<package>.__init__ for a package), or None where no key is."""
    key = name + ".__init__" if is_package else name
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in ranks:
            return ranks[prefix]
    return None


def upward_imports(graph: dict, modules: dict, ranks: dict) -> tuple:
    """(upward, unranked): every import of a module of a higher rank, as (importer, its rank,
    imported, its rank), and the modules no key of ranks covers."""
    rank = {name: rank_of(name, is_package, ranks) for name, (_, is_package) in modules.items()}
    unranked = sorted(n for n, r in rank.items() if r is None)
    upward = sorted((a, rank[a], b, rank[b]) for a, targets in graph.items() for b in targets
                    if rank[a] is not None and rank[b] is not None and rank[b] > rank[a])
    return upward, unranked


def oversized(root: Path, max_file: int = MAX_FILE_LINES, max_class: int = MAX_CLASS_LINES) -> list:
    """Every file of more than max_file lines and every class (nested ones too) of more than
    max_class (end_lineno - lineno), as text."""
    out = []
    for name, (path, _) in find_modules(root).items():
        text = path.read_text()
        n = len(text.splitlines())
        if n > max_file:
            out.append(f"{path.relative_to(root.parent)}: {n} lines (at most {max_file})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > max_class:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: class {node.name}: "
                           f"{node.end_lineno - node.lineno} lines (at most {max_class})")
    return out


# ------------------------------------------------------------------ the package
def test_no_import_cycles():
    graph, _, _ = import_graph(PACKAGE)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_no_upward_imports():
    graph, _, modules = import_graph(PACKAGE)
    upward, unranked = upward_imports(graph, modules, RANKS)
    assert not unranked, f"modules no key of RANKS covers (give them a rank): {unranked}"
    assert not upward, "imports upward (importer rank -> imported rank):\n" + "\n".join(
        f"  {a} {ra} -> {b} {rb}" for a, ra, b, rb in upward)


def test_imports_name_modules():
    _, missing, _ = import_graph(PACKAGE)
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(
        f"  {a}: {', '.join(names)}" for a, names in sorted(missing.items()))


def test_sizes():
    big = oversized(PACKAGE)
    assert not big, "too long:\n" + "\n".join("  " + b for b in big)


# ------------------------------------------------------------------ the checks can fail
def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checks_on_a_synthetic_package(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .top import main\n",
        "pkg/low.py": "import os\n\ndef f():\n    from pkg import top  # upward, inside a function\n",
        "pkg/mid/__init__.py": "VALUE = 1\n",
        "pkg/mid/a.py": "from . import b, VALUE\n",
        "pkg/mid/b.py": "def g():\n    from .a import f\n    from ..low import f\n",
        "pkg/mid/c.py": "import pkg.mid.a\nfrom .. import mid\nfrom .gone import x\nimport pkg.nothing\n",
        "pkg/top.py": "from . import mid\n\ndef main():\n    pass\n",
        "pkg/x.py": "from .y import *\n",
        "pkg/y.py": "try:\n    import pkg.x as x\nexcept ImportError:\n    x = None\n",
    })
    root = tmp_path / "pkg"
    graph, missing, modules = import_graph(root)
    assert graph == {
        "pkg": {"pkg.top"},
        "pkg.low": {"pkg.top"},
        "pkg.mid": set(),
        "pkg.mid.a": {"pkg.mid.b", "pkg.mid"},  # b is a module, VALUE comes from mid's __init__
        "pkg.mid.b": {"pkg.mid.a", "pkg.low"},
        "pkg.mid.c": {"pkg.mid.a", "pkg.mid", "pkg"},  # pkg.nothing: the package pkg is what runs
        "pkg.top": {"pkg.mid"},
        "pkg.x": {"pkg.y"},
        "pkg.y": {"pkg.x"},
    }
    assert missing == {"pkg.mid.c": ["pkg.mid.gone", "pkg.nothing"]}
    assert modules["pkg.mid"][1] and not modules["pkg.mid.a"][1]
    assert find_cycles(graph) == [["pkg.mid.a", "pkg.mid.b", "pkg.mid.a"], ["pkg.x", "pkg.y", "pkg.x"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    ranks = {"pkg.low": (0,), "pkg.mid": (1, 0), "pkg.mid.b": (1, 1), "pkg.top": (2,), "pkg.__init__": (3,),
             "pkg.x": (1, 0), "pkg.y": (1, 0)}
    assert rank_of("pkg.mid.a", False, ranks) == (1, 0)
    assert rank_of("pkg.mid", True, ranks) == (1, 0)  # pkg.mid.__init__, by the prefix pkg.mid
    assert rank_of("pkg", True, ranks) == (3,)
    assert rank_of("pkg.other", False, ranks) is None
    upward, unranked = upward_imports(graph, modules, ranks)
    assert upward == [("pkg.low", (0,), "pkg.top", (2,)), ("pkg.mid.a", (1, 0), "pkg.mid.b", (1, 1)),
                      ("pkg.mid.c", (1, 0), "pkg", (3,))]
    assert unranked == []
    assert upward_imports(graph, modules, {"pkg.low": (0,)})[1] == [
        "pkg", "pkg.mid", "pkg.mid.a", "pkg.mid.b", "pkg.mid.c", "pkg.top", "pkg.x", "pkg.y"]
    # sizes: a long file, a long class (nested in a function), and a file and a class at the limits
    _write(tmp_path, {"pkg/long.py": "x = 1\n" * 21, "pkg/ok.py": "x = 1\n" * 20,
                      "pkg/cls.py": "def f():\n    class Big:\n" + "        x = 1\n" * 12,
                      "pkg/cls_ok.py": "class Fits:\n" + "    x = 1\n" * 10})
    assert oversized(root, max_file=20, max_class=10) == [
        "pkg/cls.py:2: class Big: 12 lines (at most 10)", "pkg/long.py: 21 lines (at most 20)"]

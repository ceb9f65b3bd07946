"""The layer rules of docs/design.md ("Layers"), checked on the import graph of the installed sources.

Every import of every module under ``mla_dispatch/`` is read and resolved to the module it names: ``import``
statements (those inside functions too: a lazy import is still a dependency) and imports by string (a literal that
names one of our modules, ``importlib.import_module("mla_dispatch.x")``, a ``"module:Class"`` path, a table of
command modules). Each is mapped to its layer; a layer may import only the layers listed for it below. Imports may
not form a circle: not at module level (Python would fail to import), and not through lazy imports either (two
modules that need each other are one module, or a third one is missing).

The scanner is a function of the sources, so its own test runs it on small sources that break each rule.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import mla_dispatch

ROOT = pathlib.Path(mla_dispatch.__file__).resolve().parent

#: Layer of each top-level part of the package, top (tools) to bottom (shared layers).
LAYER_OF = {
    "tools": "tools", "__main__": "tools",
    "compat": "adapters", "integrations": "adapters",
    "__init__": "front", "api": "front",
    "backends": "backends",
    "dispatch": "dispatch",
    "kernels": "kernels",
    "kvcache": "kvcache", "metadata": "metadata", "numerics": "numerics", "version": "version",
}

#: What each layer may import besides itself. Tools reach backends only through the registry (dispatch) and the
#: front end; the engines' adapters only through the front end and dispatch's data types; kernels know nothing of
#: dispatch; the shared layers know nothing above them.
ALLOWED = {
    "tools": {"front", "dispatch", "kvcache", "metadata", "numerics", "version"},
    "adapters": {"front", "dispatch", "kvcache", "metadata", "version"},
    "front": {"dispatch", "kvcache", "metadata", "numerics", "version"},
    "backends": {"dispatch", "kernels", "kvcache", "metadata", "numerics"},
    "dispatch": {"kvcache", "numerics", "version"},
    "kernels": {"kvcache", "metadata"},
    "numerics": {"kvcache"},
    "kvcache": set(),
    "metadata": set(),
    "version": set(),
}

#: Dispatch modules the adapters may use (data types and contract), not the registry or selection.
ADAPTER_DISPATCH_MODULES = {"mla_dispatch.dispatch.backend", "mla_dispatch.dispatch.platform",
                            "mla_dispatch.dispatch.problem"}

#: Names by string that are not imports of code above: the registry's table of built-in backends, each a
#: ``"module:Class"`` imported on first use (STYLE 4), and its entry-point group, ``mla_dispatch.backends``.
STRING_ONLY_ALLOWED = {("mla_dispatch.dispatch.registry", "backends")}

#: A literal that names a module of ours: ``pkg.mod``, ``pkg.mod:Attr`` or ``pkg.mod.Attr`` (resolved below).
_MODULE_STRING = re.compile(r"mla_dispatch(\.\w+)+(:[\w.]+)?")


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_sources(root: pathlib.Path = ROOT) -> dict[str, tuple[str, str]]:
    """``{module: (source, file name)}`` of every module under ``root``."""
    return {_module_name(p, root): (p.read_text(), str(p.relative_to(root.parent))) for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is a module of ours (``from pkg import mod`` names a module)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def imports(module: str, source: str, modules, is_package: bool = False) -> list[tuple[str, int, str]]:
    """``(imported module, line, kind)`` for every import of ours in ``source``; kind is ``"top"`` (runs when the
    module is imported), ``"lazy"`` (an import statement inside a function) or ``"string"`` (a module named by a
    literal, imported by ``importlib``, a registry or an engine)."""
    tree = ast.parse(source)
    top = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks and try/except at module level are module level too
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    package = module if is_package else module.rpartition(".")[0]
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names, kind = [], "top" if id(node) in top else "lazy"
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if base else []
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and _MODULE_STRING.fullmatch(node.value)):
            path = node.value.partition(":")[0]
            target = _resolve(path, modules)
            # the module itself, or one attribute of it; never the package root (loggers, the op namespace)
            if target and target != "mla_dispatch" and path.count(".") - target.count(".") <= 1:
                found.append((target, node.lineno, "string"))
            continue
        for n in names:
            if n == "mla_dispatch" or n.startswith("mla_dispatch."):
                target = _resolve(n, modules)
                if target:
                    found.append((target, node.lineno, kind))
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return LAYER_OF["__init__" if len(parts) == 1 else parts[1]]


def import_graph(sources) -> dict[str, list[tuple[str, int, str]]]:
    """``{module: imports(...)}`` for ``sources`` (:func:`package_sources`'s form)."""
    return {m: imports(m, src, sources, is_package=fname.endswith("__init__.py"))
            for m, (src, fname) in sources.items()}


def layer_violations(sources) -> list[str]:
    """``file:line: what`` for every import against the layer rules."""
    bad = []
    for module, found in import_graph(sources).items():
        src, fname = layer(module), sources[module][1]
        for target, line, kind in found:
            dst = layer(target)
            how = " (by string)" if kind == "string" else ""
            if dst == src:
                continue
            if dst not in ALLOWED[src]:
                if kind == "string" and (module, dst) in STRING_ONLY_ALLOWED:
                    continue
                bad.append(f"{fname}:{line}: {src} -> {dst} ({target}){how}")
            elif src == "adapters" and dst == "dispatch" and target not in ADAPTER_DISPATCH_MODULES:
                bad.append(f"{fname}:{line}: adapters reach {target} around the front end{how}")
    return bad


def import_circles(sources, kinds=("top", "lazy", "string")) -> list[list[str]]:
    """The circles (strongly connected components of more than one module) of the graph of imports of ``kinds``.

    Importing a submodule runs its package's ``__init__``; those edges are Python's, not ours, and are left out.
    """
    graph = {m: {t for t, _, kind in found if kind in kinds and t != m and t in sources}
             for m, found in import_graph(sources).items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


SOURCES = package_sources()


def test_every_part_of_the_package_has_a_layer():
    missing = {m.split(".")[1] for m in SOURCES if "." in m and m.split(".")[1] not in LAYER_OF}
    assert not missing, f"add these to LAYER_OF and docs/design.md: {sorted(missing)}"


def test_imports_run_only_downward():
    bad = layer_violations(SOURCES)
    assert not bad, "imports against the layer rules:\n" + "\n".join(bad)


def test_no_import_cycles_at_module_level():
    assert not import_circles(SOURCES, kinds=("top",)), "module-level import cycles"


def test_no_import_circles_through_lazy_or_string_imports():
    circles = import_circles(SOURCES)
    assert not circles, f"modules that import each other (lazily or by string): {circles}"


# -- the scanner on sources that break each rule ----------------------------------------------------------------


def _fake(**modules: str) -> dict[str, tuple[str, str]]:
    """A small package: ``{"mla_dispatch.kernels.a": source}``, each a module (packages implied)."""
    sources = {"mla_dispatch": ("", "mla_dispatch/__init__.py")}
    for name, src in modules.items():
        parts = name.split(".")
        for n in range(2, len(parts)):
            pkg = ".".join(parts[:n])
            sources.setdefault(pkg, ("", pkg.replace(".", "/") + "/__init__.py"))
        sources[name] = (src, name.replace(".", "/") + ".py")
    return sources


@pytest.mark.parametrize("modules, expected", [
    pytest.param({"mla_dispatch.kernels.k": "from mla_dispatch.dispatch.platform import Platform\n",
                  "mla_dispatch.dispatch.platform": ""},
                 ["mla_dispatch/kernels/k.py:1: kernels -> dispatch (mla_dispatch.dispatch.platform)"],
                 id="module-level"),
    pytest.param({"mla_dispatch.tools.t": "def f():\n    from mla_dispatch.backends import reference\n",
                  "mla_dispatch.backends.reference": ""},
                 ["mla_dispatch/tools/t.py:2: tools -> backends (mla_dispatch.backends.reference)"], id="lazy"),
    pytest.param({"mla_dispatch.tools.t": "import importlib\n\ndef f():\n"
                                          "    return importlib.import_module('mla_dispatch.backends.reference')\n",
                  "mla_dispatch.backends.reference": ""},
                 ["mla_dispatch/tools/t.py:4: tools -> backends (mla_dispatch.backends.reference) (by string)"],
                 id="import_module"),
    pytest.param({"mla_dispatch.tools.cli": "COMMANDS = {'build': ('mla_dispatch.kernels.cuda.build', 'compile')}\n",
                  "mla_dispatch.kernels.cuda.build": ""},
                 ["mla_dispatch/tools/cli.py:1: tools -> kernels (mla_dispatch.kernels.cuda.build) (by string)"],
                 id="command-table"),
    pytest.param({"mla_dispatch.integrations.p": "X = 'mla_dispatch.dispatch.select:explain'\n",
                  "mla_dispatch.dispatch.select": ""},
                 ["mla_dispatch/integrations/p.py:1: adapters reach mla_dispatch.dispatch.select around the front end "
                  "(by string)"], id="qualname"),
    pytest.param({"mla_dispatch.backends.b": '"""Uses mla_dispatch.kernels.k and mla_dispatch.tools.t."""\n'
                                             "def f():\n    import mla_dispatch.kernels.k\n",
                  "mla_dispatch.kernels.k": "", "mla_dispatch.tools.t": "",
                  "mla_dispatch.dispatch.registry": "T = {'r': 'mla_dispatch.backends.b:B'}\n"},
                 [], id="allowed-docstring-and-registry"),
])
def test_the_scanner_reports_what_breaks_a_layer_rule(modules, expected):
    assert layer_violations(_fake(**modules)) == expected


def test_the_scanner_finds_circles_through_lazy_imports():
    sources = _fake(**{
        "mla_dispatch.kernels.a": "from mla_dispatch.kernels import b\n",
        "mla_dispatch.kernels.b": "def f():\n    from mla_dispatch.kernels.a import g\n",
        "mla_dispatch.kernels.c": "import importlib\nM = 'mla_dispatch.kernels.d'\n",
        "mla_dispatch.kernels.d": "def f():\n    import mla_dispatch.kernels.c\n",
    })
    assert import_circles(sources, kinds=("top",)) == []
    assert sorted(import_circles(sources)) == [["mla_dispatch.kernels.a", "mla_dispatch.kernels.b"],
                                               ["mla_dispatch.kernels.c", "mla_dispatch.kernels.d"]]

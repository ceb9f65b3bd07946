"""The layer rules of docs/design.md ("Layers"), checked on the import graph of the installed sources.

Every ``import`` statement of every module under ``mla_dispatch/`` is read (those inside functions too: a lazy
import is still a dependency), resolved to the module it names, and mapped to its layer. A layer may import only
the layers listed for it below; module-level imports may not form a cycle.
"""

from __future__ import annotations

import ast
import pathlib

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


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest prefix of ``name`` that is a module of ours (``from pkg import mod`` names a module)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return name


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import of ours in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks and try/except at module level are module level too
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if base else []
        for n in names:
            if n == "mla_dispatch" or n.startswith("mla_dispatch."):
                found.append((_resolve(n), node.lineno, id(node) in top))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return LAYER_OF["__init__" if len(parts) == 1 else parts[1]]


def test_every_part_of_the_package_has_a_layer():
    missing = {m.split(".")[1] for m in MODULES if "." in m and m.split(".")[1] not in LAYER_OF}
    assert not missing, f"add these to LAYER_OF and docs/design.md: {sorted(missing)}"


def test_imports_run_only_downward():
    bad = []
    for module, path in MODULES.items():
        src = _layer(module)
        for target, line, _ in _imports(module, path):
            dst = _layer(target)
            if dst == src:
                continue
            if dst not in ALLOWED[src]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} -> {dst} ({target})")
            elif src == "adapters" and dst == "dispatch" and target not in ADAPTER_DISPATCH_MODULES:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: adapters reach {target} around the front end")
    assert not bad, "imports against the layer rules:\n" + "\n".join(bad)


def test_no_import_cycles_at_module_level():
    graph = {m: {t for t, _, top in _imports(m, p) if top and t != m and t in MODULES} for m, p in MODULES.items()}
    # Importing a submodule runs its package's __init__; those edges are Python's, not ours.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

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
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"module-level import cycles: {cycles}"


@pytest.mark.parametrize("source, target, ok", [
    ("mla_dispatch.kernels.triton.decode", "mla_dispatch.dispatch.platform", False),
    ("mla_dispatch.metadata.schedule", "mla_dispatch.kernels.triton.decode", False),
    ("mla_dispatch.tools.bench", "mla_dispatch.backends.reference", False),
    ("mla_dispatch.tools.bench", "mla_dispatch.numerics.oracle", True),
    ("mla_dispatch.backends.triton", "mla_dispatch.kernels.triton.ops", True),
])
def test_the_rules_catch_what_they_forbid(source, target, ok):
    """The checker itself: the violations the layering removed would be reported again."""
    assert (_layer(target) in ALLOWED[_layer(source)]) == ok

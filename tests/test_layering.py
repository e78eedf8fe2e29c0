"""The package's layers import one way: modules -> ops -> kernels / fp8 (STYLE.md), and no module imports itself
through others (no import cycle). Read from the source with ``ast`` (nothing is imported), so an import hidden
inside a function counts too."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "fp8engine"

#: package -> the packages (and top-level modules) of fp8engine it must never import from
FORBIDDEN = {
    "fp8": ("modules", "parallel", "models", "train", "training", "ops", "bench", "jax"),
    "kernels": ("modules", "parallel", "models", "train", "training", "ops", "bench", "jax"),
    "ops": ("modules", "parallel", "models", "train", "training", "bench", "jax"),
}


def _imported(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``path`` (relative imports resolved)."""
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.append((node.lineno, base))
            # ``from fp8engine import parallel`` names the sub-package in the alias
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if base == "fp8engine"]
    return out


def _violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((PKG / layer).rglob("*.py")):
        for line, name in _imported(path):
            parts = name.split(".")
            if parts[0] == "fp8engine" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_import_runs_up_the_layers(layer):
    assert (PKG / layer).is_dir()
    assert _violations(layer) == []


def test_the_check_sees_an_upward_import(tmp_path):
    # the scanner itself: a file in fp8/ importing parallel/ (relatively and absolutely) is reported
    fake = tmp_path / "fp8engine"
    (fake / "fp8").mkdir(parents=True)
    (fake / "fp8" / "x.py").write_text("from ..parallel.amax import f\n\ndef g():\n    import fp8engine.modules.base\n")
    global PKG
    saved, PKG = PKG, fake
    try:
        found = _violations("fp8")
    finally:
        PKG = saved
    assert found == ["fp8engine/fp8/x.py:1 imports fp8engine.parallel.amax",
                     "fp8engine/fp8/x.py:4 imports fp8engine.modules.base"]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (function-level imports too). ``from fp8engine.fp8 import x``
    depends on the package ``fp8engine.fp8`` (its ``__init__``) and, where ``x`` is a module, on ``x``."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = {imported for _, imported in _imported(path) if imported in modules}
        for node in ast.walk(ast.parse(path.read_text())):  # ``from package import submodule``
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = _import_graph()
    assert "fp8engine.ops.gemm" in graph and "fp8engine.ops.gemm_ops" in graph["fp8engine.ops.mlp"]
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]

"""The package's layout: no import circle (imports inside functions included), imports only downward between
sub-packages, relative imports only among its own files, and no file over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import ROOT

PACKAGE = ROOT / "modeling_deepseek_v41"
NAME = PACKAGE.name
MAX_LINES = 400
# bottom to top: a sub-package imports only from itself and those before it
LAYERS = ("config", "kernels", "layers", "cache", "loading", "model", "tools")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports anywhere in its file (module level and inside functions)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            prefix = ".".join(base + ([node.module] if node.module else []))
            names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    # a package's __init__ re-exporting its own children is not a circle
    return {m: {t for t in ts if not (modules[m].name == "__init__.py" and t.startswith(m + "."))}
            for m, ts in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_detection_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_sub_packages_import_only_downward():
    def layer(module: str) -> int | None:
        parts = module.split(".")
        return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None

    upward = [f"{m} -> {t}" for m, targets in _graph().items() for t in targets
              if layer(m) is not None and layer(t) is not None and layer(t) > layer(m)]
    assert not upward, "imports going up the layers " + " < ".join(LAYERS) + ":\n" + "\n".join(sorted(upward))


def test_only_relative_imports_inside_the_package():
    absolute = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            absolute += [f"{module}: {n}" for n in names if n == NAME or n.startswith(NAME + ".")]
    assert not absolute, "absolute imports of the package inside it (a remote-code checkpoint needs relative):\n" \
        + "\n".join(absolute)


def test_no_file_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


DEVICE_TESTS = ("kernel_path", "fast_path", "is_cuda", "dispatch", "gpu_linear", "triton")


def test_layers_never_test_the_device():
    """The layers call ops; which implementation runs (exact, compiled, Triton) is chosen behind the op boundary in
    kernels/, so no module under layers/ names a device predicate or imports the dispatch or the kernels."""
    offenders = []
    for path in sorted((PACKAGE / "layers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [getattr(node, "module", None) or ""] + [alias.name for alias in node.names]
            elif isinstance(node, (ast.Name, ast.Attribute)):
                names = [node.id if isinstance(node, ast.Name) else node.attr]
            hits = [n for n in names if any(part in DEVICE_TESTS for part in n.split("."))]
            if hits:
                offenders.append(f"{path.name}:{node.lineno} {hits}")
    assert not offenders, offenders


def _dotted(node: ast.expr) -> str:
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def test_kernels_define_no_modules():
    """kernels/ holds ops (functions); the nn.Modules that hold weights and call them live in layers/."""
    modules = []
    for path in sorted((PACKAGE / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [_dotted(base) for base in node.bases]
                if any(b == "Module" or b.startswith(("nn.", "torch.nn.")) for b in bases):
                    modules.append(f"{path.relative_to(PACKAGE)}: {node.name}({', '.join(bases)})")
    assert not modules, "nn.Module subclasses under kernels/:\n" + "\n".join(modules)

"""Every Triton kernel is safe to launch programmatically (PDL, `kernels/triton/launch.py`): it waits for the
kernels before it (`wait_for_inputs()`, its first statement) before touching memory, and every launch passes
`launch_options()`. A kernel scheduled early without the wait could read what its predecessor has not written.
Gluon kernels (fp4_mma.py, fp8_mma.py, dense_mma.py) follow the same rules, with mma_common's wait_for_inputs."""

from __future__ import annotations

import ast

from repo_paths import ROOT

TRITON = ROOT / "modeling_deepseek_v41" / "kernels" / "triton"


def _kernels_and_launches():
    for path in sorted(TRITON.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            if function.name.endswith("_kernel") and any(
                    isinstance(d, ast.Attribute) and d.attr == "jit" for d in function.decorator_list):
                yield "kernel", path.name, function
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                        isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("_kernel"):
                    yield "launch", path.name, (function, node)


def _first_statement(function: ast.FunctionDef) -> ast.stmt:
    body = function.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if docstring else body[0]


def _passes_launch_options(function: ast.FunctionDef, call: ast.Call) -> bool:
    """launch_options() unpacked into the call, or a dict built from it in the same function unpacked."""
    built = {target.id for node in ast.walk(function) if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)
             and "launch_options()" in ast.unparse(node.value)}
    for keyword in call.keywords:
        if keyword.arg is None:
            value = keyword.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "launch_options":
                return True
            if isinstance(value, ast.Name) and value.id in built:
                return True
    return False


def test_every_kernel_waits_for_its_inputs_first():
    kernels = [(name, fn) for kind, name, fn in _kernels_and_launches() if kind == "kernel"]
    assert len(kernels) >= 20
    late = [f"{name}:{fn.name}" for name, fn in kernels if ast.unparse(_first_statement(fn)) != "wait_for_inputs()"]
    assert not late, f"kernels that touch memory before wait_for_inputs(): {late}"


def test_every_launch_passes_the_launch_options():
    launches = [(name, fn, call) for kind, name, item in _kernels_and_launches() if kind == "launch"
                for fn, call in [item]]
    assert len(launches) >= 20
    missing = [f"{name}:{fn.name}:{call.lineno}" for name, fn, call in launches if not _passes_launch_options(fn, call)]
    assert not missing, f"launches without launch_options(): {missing}"


"""The package's layers (docs/architecture.md): no import runs up the stack, none hides inside a function to dodge
a cycle, and the module-level imports form no cycle. Read from the sources (ast), so it needs no device."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jax_dwdp"

# Lowest first. A module may import its own layer or any layer below it, never one above.
LAYERS = [
    ("base", ["jax_dwdp", "jax_dwdp.config", "jax_dwdp.nemotron_h_config", "jax_dwdp.families", "jax_dwdp.timing",
              "jax_dwdp.watchdog", "jax_dwdp.native", "jax_dwdp.distributed", "jax_dwdp.outputs",
              "jax_dwdp.options"]),
    ("devices and kernels", ["jax_dwdp.devices", "jax_dwdp.kernels"]),
    ("model", ["jax_dwdp.model"]),
    ("weights, programs, expert sources", ["jax_dwdp.weights", "jax_dwdp.programs", "jax_dwdp.sources"]),
    ("one-device engine", ["jax_dwdp.runner", "jax_dwdp.prefill", "jax_dwdp.scan"]),
    ("parallel", ["jax_dwdp.parallel"]),
    ("drivers", ["jax_dwdp.driver", "jax_dwdp.request", "jax_dwdp.plan", "jax_dwdp.planner", "jax_dwdp.report"]),
    ("command line", ["jax_dwdp.cli", "jax_dwdp.entry"]),
]

# Imported inside functions on purpose: CUDA-only code, loaded when a GPU path is chosen (importing jax_dwdp must
# work without CUDA), and the Pallas Triton kernels (GPU kernels that the CPU runs only in the tests' interpret mode).
LAZY = {"jax_dwdp.kernels.gdn_pallas", "jax_dwdp.kernels.ssd_pallas", "jax_dwdp.kernels._cutlass", "jax_dwdp.parallel.dwdp_ffi",
        "jax_dwdp.parallel.cuda_vmm"}
# The command line answers --help and bad input before jax (a second to import) is loaded: its imports of the
# library are deferred to the command that needs them.
DEFERRING = {"jax_dwdp.cli", "jax_dwdp.entry"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it to LAYERS")
    return best


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported jax_dwdp module, line, inside a function) for every import statement of `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names if a.name.startswith("jax_dwdp"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base else []))
                if base.startswith("jax_dwdp"):
                    for a in child.names:  # `from pkg import submodule` imports the submodule
                        target = f"{base}.{a.name}"
                        found.append((target if target in MODULES else base, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_up_the_stack_or_hides_in_a_function(module):
    mine = layer_of(module)
    for target, line, in_function in imports(module):
        where = f"{MODULES[module].relative_to(ROOT.parent)}:{line}"
        assert layer_of(target) <= mine, (f"{where}: {module} ({LAYERS[mine][0]}) imports {target} "
                                          f"({LAYERS[layer_of(target)][0]}), a layer above it")
        if in_function:
            assert target in LAZY or module in DEFERRING, (
                f"{where}: {module} imports {target} inside a function; import it at the top (a cycle it would "
                f"dodge is a layering error), unless it is CUDA-only code (LAZY)")


def test_module_level_imports_form_no_cycle():
    graph = {m: {t for t, _, f in imports(m) if not f and t != m} for m in MODULES}
    state: dict[str, int] = {}

    def walk(m, stack):
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t in graph and not state.get(t):
                walk(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            walk(m, [m])


def test_the_checker_catches_what_it_is_for(tmp_path, monkeypatch):
    """An upward import, a hidden one and a cycle, in a throwaway package, each fail."""
    pkg = tmp_path / "jax_dwdp"
    (pkg / "parallel").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("import jax_dwdp.devices\n")  # base -> devices: up the stack
    (pkg / "devices.py").write_text("def f():\n    from jax_dwdp import config\n")  # hidden in a function
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "a.py").write_text("from jax_dwdp.parallel import b\n")
    (pkg / "parallel" / "b.py").write_text("import jax_dwdp.parallel.a\n")  # a cycle
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {module_name(p): p for p in sorted(pkg.rglob("*.py"))})
    with pytest.raises(AssertionError, match="a layer above it"):
        test_no_import_runs_up_the_stack_or_hides_in_a_function("jax_dwdp.config")
    with pytest.raises(AssertionError, match="inside a function"):
        test_no_import_runs_up_the_stack_or_hides_in_a_function("jax_dwdp.devices")
    with pytest.raises(AssertionError, match="import cycle"):
        test_module_level_imports_form_no_cycle()

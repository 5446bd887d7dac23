"""The package layering (docs/ARCHITECTURE.md): kernels -> model -> parallel -> trainer -> inference -> scripts -> tests,
each importing only the layers below it, kernels only torch, triton and the standard library (fla looked
up inside a function), and no import cycle between modules. Function-local imports count: a cycle hidden
inside a function is still a cycle."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "model", "parallel", "trainer", "inference", "scripts", "tests")
KERNEL_DEPENDENCIES = {"torch", "triton", *sys.stdlib_module_names}
KERNEL_LAZY_DEPENDENCIES = {"fla"}  # optional: imported inside the function that uses it


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (the longest known prefix of each imported name)."""
    found = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from package import submodule` depends on the submodule (and the package's __init__ only
            # for names that are not submodules).
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [path for layer in LAYERS for path in (ROOT / layer).rglob("*.py")]
    modules = {module_name(path) for path in files}
    return {module_name(path): project_imports(path, modules) - {module_name(path)} for path in files}


def outside_imports(path: Path, top_level_only: bool) -> set[str]:
    """The top-level packages outside the project that `path` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - set(LAYERS)


def kernel_dependency_violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "kernels").rglob("*.py")):
        anywhere = outside_imports(path, top_level_only=False) - KERNEL_DEPENDENCIES
        at_import = outside_imports(path, top_level_only=True) - KERNEL_DEPENDENCIES
        found += [f"{path.relative_to(root)}: {name}" for name in sorted(anywhere - KERNEL_LAZY_DEPENDENCIES | at_import)]
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def part_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The imports between the parts of `package` (its subpackages and modules, each taken whole), from the
    module graph: a loop between parts is a loop between jobs even where no two modules import each other."""
    depth = package.count(".") + 2
    inside = [name for name in graph if name.startswith(package + ".")]
    parts: dict[str, set[str]] = {}
    for source in inside:
        part = ".".join(source.split(".")[:depth])
        targets = {".".join(target.split(".")[:depth]) for target in graph[source] if target.startswith(package + ".")}
        parts.setdefault(part, set()).update(targets - {part})
    return parts


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{source} -> {target}" for source, targets in sorted(graph.items()) for target in sorted(targets)
            if LAYERS.index(target.split(".")[0]) > LAYERS.index(source.split(".")[0])]


def test_no_layer_imports_a_layer_above_it():
    assert upward_imports(import_graph()) == []


def test_kernels_import_only_torch_triton_and_the_standard_library():
    assert kernel_dependency_violations() == []


def test_the_kernel_check_finds_a_foreign_import(tmp_path):
    """Negative control: numpy at module level and fla at module level are both violations; fla in a function is not."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "bad.py").write_text("import numpy\nimport fla\n\ndef f():\n    import fla.ops\n")
    (tmp_path / "kernels" / "good.py").write_text("import torch\nimport math\n\ndef f():\n    from fla.ops import kda\n")
    assert kernel_dependency_violations(tmp_path) == ["kernels/bad.py: fla", "kernels/bad.py: numpy"]


def test_no_import_cycle_between_modules():
    assert find_cycle(import_graph()) is None


def test_no_import_cycle_between_the_parts_of_trainer():
    assert find_cycle(part_graph(import_graph(), "trainer")) is None


def test_the_graph_holds_known_imports_of_every_form():
    """`from x import y`, `from x.y import z` and a function-local import are all edges."""
    graph = import_graph()
    assert {"parallel.fsdp", "parallel.tensor", "model.decoder"} <= graph["parallel.parallelize"]
    assert "parallel.pipeline.runner" in graph["parallel.engine"]  # imported inside PipelineEngine
    assert set(LAYERS) == {name.split(".")[0] for name in graph}
    assert {"parallel.dims", "trainer.config"} <= graph["tests.parallel.test_layout_rules"]


def test_the_checks_find_an_upward_import_and_a_cycle():
    """Negative control on a made-up graph: both checks can fail."""
    graph = {"parallel.a": {"parallel.b"}, "parallel.b": {"trainer.c"}, "trainer.c": {"parallel.a"}}
    assert find_cycle(graph) == ["parallel.a", "parallel.b", "trainer.c", "parallel.a"]
    assert upward_imports(graph) == ["parallel.b -> trainer.c"]


def test_the_part_check_finds_a_loop_no_two_modules_close():
    """Negative control: config -> data.samples, data.format -> run_dir.lock, run_dir.checkpoint -> config is a loop
    of parts though no module imports one that imports it back; a module's imports within its own part are no edge."""
    graph = {"trainer.config": {"trainer.data.samples"}, "trainer.data.samples": {"trainer.data.format"},
             "trainer.data.format": {"trainer.run_dir.lock"}, "trainer.run_dir.lock": set(),
             "trainer.run_dir.checkpoint": {"trainer.config", "trainer.run_dir.lock"}, "model.decoder": set()}
    assert find_cycle(graph) is None
    assert part_graph(graph, "trainer") == {"trainer.config": {"trainer.data"}, "trainer.data": {"trainer.run_dir"},
                                            "trainer.run_dir": {"trainer.config"}}
    assert find_cycle(part_graph(graph, "trainer")) == ["trainer.config", "trainer.data", "trainer.run_dir",
                                                        "trainer.config"]

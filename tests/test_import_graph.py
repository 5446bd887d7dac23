"""The package layering (docs/ARCHITECTURE.md): kernels -> model -> parallel -> trainer -> scripts, each
importing only the layers below it (and kernels only torch and triton), and no import cycle between
modules. Function-local imports count: a cycle hidden inside a function is still a cycle."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "model", "parallel", "trainer", "scripts")


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


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{source} -> {target}" for source, targets in sorted(graph.items()) for target in sorted(targets)
            if LAYERS.index(target.split(".")[0]) > LAYERS.index(source.split(".")[0])]


def test_no_layer_imports_a_layer_above_it():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle_between_modules():
    assert find_cycle(import_graph()) is None


def test_the_graph_holds_known_imports_of_every_form():
    """`from x import y`, `from x.y import z` and a function-local import are all edges."""
    graph = import_graph()
    assert {"parallel.fsdp", "parallel.tensor", "model.decoder"} <= graph["parallel.parallelize"]
    assert "parallel.pipeline.runner" in graph["parallel.engine"]  # imported inside PipelineEngine
    assert {"kernels", "model", "parallel", "trainer", "scripts"} == {name.split(".")[0] for name in graph}


def test_the_checks_find_an_upward_import_and_a_cycle():
    """Negative control on a made-up graph: both checks can fail."""
    graph = {"parallel.a": {"parallel.b"}, "parallel.b": {"trainer.c"}, "trainer.c": {"parallel.a"}}
    assert find_cycle(graph) == ["parallel.a", "parallel.b", "trainer.c", "parallel.a"]
    assert upward_imports(graph) == ["parallel.b -> trainer.c"]

"""The exported model's code: our own sources, flattened into one directory, with imports made relative.

transformers loads remote code from one flat directory and copies a module's relative imports
(`from .NAME import ...`) beside it, so every module the HF classes need from `model`, `kernels` and
`inference.hf` is written as one file (`model/residual/attnres.py` -> `model_residual_attnres.py`,
`inference.hf.X` -> `X.py`) whose imports of our modules become `from .FLAT import NAMES`. One source of
truth: the exported model runs the code the trainer ran, never a copy kept by hand.

Left out: the Triton kernels and fla (the export runs plain torch, with `kernel_impl="torch"`). Their
imports are lazy, inside the dispatchers' fast-path branches, and become `raise ImportError(...)` there;
an import of them at module level, a relative import, or `from PACKAGE import SUBMODULE` is refused
(BundleError), since the flattened copy could not keep it.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRY_MODULES = ("inference.hf.configuration_attnres", "inference.hf.modeling_attnres")
OUR_PACKAGES = ("model", "kernels", "trainer", "inference")
HF_PACKAGE = "inference.hf"
# Our modules that never go into an export: the fused kernels and what only they use.
LEFT_OUT = ("kernels.launch", "kernels.aot")
THIRD_PARTY = ("torch", "transformers")


class BundleError(ValueError):
    """Our source holds an import the flattened export cannot keep; the message names the file and line."""


def module_file(module: str) -> Path | None:
    path = REPO.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def flat_name(module: str) -> str:
    if module.startswith(HF_PACKAGE + "."):
        return module[len(HF_PACKAGE) + 1:]
    return module.replace(".", "_")


def is_ours(module: str) -> bool:
    return module.split(".")[0] in OUR_PACKAGES


def is_left_out(module: str) -> bool:
    return module in LEFT_OUT or module.split(".")[-1] == "triton"


def _function_level_imports(tree: ast.Module) -> set[int]:
    """ids of the import statements inside a function body (lazy imports)."""
    lazy = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy.update(id(inner) for inner in ast.walk(node) if isinstance(inner, (ast.Import, ast.ImportFrom)))
    return lazy


def _replacement(node: ast.stmt, where: str, lazy: bool) -> tuple[str | None, str | None]:
    """(the statement that replaces `node`, or None to keep it; the bundled module it imports, if any)."""
    if isinstance(node, ast.ImportFrom) and node.level:
        raise BundleError(f"{where}: relative import; write `from PACKAGE.MODULE import NAME`")
    module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
    top = module.split(".")[0]
    if top == "__future__" or top in sys.stdlib_module_names or top in THIRD_PARTY:
        return None, None
    if is_ours(module) and isinstance(node, ast.Import):
        raise BundleError(f"{where}: `import {module}`; write `from {module} import NAME`")
    submodules = [alias.name for alias in getattr(node, "names", []) if module_file(f"{module}.{alias.name}")]
    wanted = f"{module}.{submodules[0]}" if submodules else module
    if is_ours(wanted) and not is_left_out(wanted):
        if submodules:
            raise BundleError(f"{where}: `from {module} import {submodules[0]}` imports a module; import its names")
        names = ", ".join(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"
                          for alias in node.names)
        return f"from .{flat_name(module)} import {names}", module
    if not lazy:
        raise BundleError(f"{where}: module-level import of {wanted}, which an export does not carry; import it "
                          "inside the function that needs it")
    return f"raise ImportError({f'an exported model runs plain torch: {wanted} is not part of it'!r})", None


def rewrite_source(source: str, origin: str) -> tuple[str, set[str]]:
    """`source` (the file `origin`, relative to the repo) with its imports flattened, and the bundled modules
    it imports."""
    lines = source.splitlines()
    tree = ast.parse(source, filename=origin)
    lazy = _function_level_imports(tree)
    imported, edits = set(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        where = f"{origin}:{node.lineno}"
        replacement, dependency = _replacement(node, where, id(node) in lazy)
        if dependency is not None:
            imported.add(dependency)
        if replacement is None:
            continue
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        if first[:node.col_offset].strip() or last[node.end_col_offset:].strip():
            raise BundleError(f"{where}: an import sharing its line with other code; give it its own line")
        edits.append((node.lineno - 1, node.end_lineno, first[:node.col_offset] + replacement))
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    header = f"# Written by `python -m inference.export format=hf` from {origin}; do not edit."
    return "\n".join([header, *lines]) + "\n", imported


def bundle_sources() -> dict[str, str]:
    """File name -> source of every module the HF classes need, starting from ENTRY_MODULES."""
    files, pending, seen = {}, list(ENTRY_MODULES), set()
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(module)
        source, imported = rewrite_source(path.read_text(), str(path.relative_to(REPO)))
        files[flat_name(module) + ".py"] = source
        pending.extend(sorted(imported - seen))
    return files


def write_bundle(out: Path) -> list[str]:
    """Write the flattened sources into `out`; returns their file names."""
    files = bundle_sources()
    for name, source in files.items():
        (out / name).write_text(source)
    return sorted(files)

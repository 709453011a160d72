"""Check fullshard's package layout: layers, import cycles, file and function sizes.

Usage: ``python tools/check_layers.py [--graph]`` from the repository root (``make test`` runs
it). Exit status 1 with one line per violation, 0 when the layout holds.

Package-level cycles are checked too: each module belongs to its package (the folder it is in;
``__init__`` to the package it opens), and the graph of imports between packages must have no
cycle either (``jobs.train`` importing ``jobs.bench`` while ``jobs.bench`` imports ``jobs.train``
is a cycle even when no two modules import each other).

Every import in ``src/fullshard`` counts: module level, inside functions, and under
``if TYPE_CHECKING:``. Each module belongs to a layer (below); a module may import modules of
its own layer or lower ones, never a higher one, and the graph of imports between modules must
have no cycle. Sizes are a smell detector, not a gate: a file over ``WARN_FILE_LINES`` lines or a
function (or method) over ``WARN_FUNCTION_LINES`` lines, counted from the ``def`` line to the last
line of the body, is printed as a warning and does not fail the check (split it by job, never by
line count). ``--graph`` prints each module's imports.

torch's private names: only ``fullshard/compat.py`` may touch them (see its docstring). Elsewhere
these are flagged: an import of a torch module path with a ``_private`` part or of a ``_private``
name from a torch module; an attribute ``_x`` read through a name the file bound to torch (``torch``,
``dist``, ``from torch.autograd import Variable``, ...); an attribute in ``TORCH_PRIVATE_ATTRS``
(torch's private attributes met on objects of any name: a DTensor's ``_local_tensor``, a module's
``_parameters``) read, written or named to ``getattr`` / ``hasattr`` / ``setattr``. Dunder names
and fullshard's own ``_private`` attributes (``_fullshard_param``) are not torch's and pass.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
WARN_FILE_LINES = 500  # above: a warning (printed), not a failure
WARN_FUNCTION_LINES = 80

# Layer of each package (or single module), lowest first. The longest matching prefix decides.
LAYERS: dict[str, int] = {
    "fullshard.probes": 0,  # opt-in test and benchmark probes: imports nothing of fullshard
    "fullshard.compat": 0,  # torch's private names and version differences: imports nothing of fullshard
    "fullshard.deferred_import": 0,  # work run when a module is first imported: imports nothing of fullshard
    "fullshard.comm": 1,  # collectives and buffers: the only code that calls torch.distributed
    "fullshard.engine": 2,  # sharded parameter, unit, reduction, hooks, build, configs
    "fullshard.state": 3,  # state dicts, optimizer state, checkpoints (work from units)
    "fullshard.frontend": 4,  # FSDP1 wrapper, fully_shard, wrap policies, checkpointing, clipping
    "fullshard.plan": 5,  # memory and step-time estimates, the planner, memory measurement
    "fullshard": 6,  # the public API: __init__, api, wrap, checkpoint, distributed, planning, ...
    "fullshard.jobs": 7,  # launcher, models, data, training commands, estimate/plan commands, benchmark
    "fullshard.cli": 8,  # the `fullshard` command: runs the jobs
    "fullshard.train": 8,  # `python -m fullshard.train`: the training jobs' entry point
}
# Modules that count as a package of their own in the package-level cycle check.
OWN_PACKAGE = {
    "fullshard.probes",
    "fullshard.compat",
    "fullshard.deferred_import",
    "fullshard.cli",
}  # fullshard.train is a package
# The training jobs are recipes written against the public API alone (they double as examples):
# they may import these modules, torch, and the jobs' own modules (models, data, launcher).
TRAIN_JOBS = "fullshard.jobs.train"
PUBLIC_MODULES = frozenset(
    {
        "fullshard",
        "fullshard.api",
        "fullshard.checkpoint",
        "fullshard.distributed",
        "fullshard.fully_sharded_data_parallel",
        "fullshard.planning",
        "fullshard.sharded_grad_scaler",
        "fullshard.wrap",
    }
)


COMPAT = "fullshard.compat"
# torch's private attributes that fullshard met on objects of any name (not only through a torch
# module): each is reached through fullshard.compat instead.
TORCH_PRIVATE_ATTRS = frozenset(
    {
        "_apply",
        "_base",
        "_buffers",
        "_cdata",
        "_concatenate",
        "_execution_engine",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_get_backend",
        "_local_tensor",
        "_modules",
        "_non_persistent_buffers_set",
        "_parameters",
        "_register_load_state_dict_pre_hook",
        "_register_state_dict_hook",
        "_spec",
        "_swap_data_ptr_",
        "_timeout",
        "_version",
    }
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_path(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def private_torch_uses(path: Path, tree: ast.Module) -> list[str]:
    """Each private torch access in ``path`` (see the module docstring), one line each."""
    rel = path.relative_to(ROOT.parent)
    roots: set[str] = set()  # names this file bound to torch modules or torch objects
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _torch_path(alias.name):
                    roots.add(alias.asname or alias.name.split(".")[0])
                    if any(map(_private, alias.name.split("."))):
                        found.append(f"{rel}:{node.lineno}: imports torch's private {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and _torch_path(node.module or ""):
            module = node.module or ""
            roots.update(alias.asname or alias.name for alias in node.names)
            for alias in node.names:
                if any(map(_private, module.split("."))) or _private(alias.name):
                    found.append(f"{rel}:{node.lineno}: imports torch's private {module}.{alias.name}")
    for node in ast.walk(tree):  # aliases: aten = torch.ops.aten
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(node.value, ast.Attribute) and isinstance(root, ast.Name) and root.id in roots:
                roots.add(node.targets[0].id)
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if node.attr in TORCH_PRIVATE_ATTRS or (isinstance(root, ast.Name) and root.id in roots):
                name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            target = node.args[0]
            while isinstance(target, ast.Attribute):
                target = target.value
            torch_object = isinstance(target, ast.Name) and target.id in roots
            if node.args[1].value in TORCH_PRIVATE_ATTRS or torch_object:
                name = node.args[1].value
        if name is not None:
            found.append(f"{rel}:{node.lineno}: torch's private {name} outside fullshard.compat")
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The fullshard modules ``path`` imports (any import statement anywhere in the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` imports the module pkg.mod when there is one
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected set of two or more modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str, path: Path) -> str:
    """The package ``module`` belongs to for the package-level cycle check."""
    if module in OWN_PACKAGE or path.name == "__init__.py":
        return module
    return module.rpartition(".")[0]


def package_graph(graph: dict[str, set[str]], paths: dict[str, Path]) -> dict[str, set[str]]:
    """Imports between packages: an edge for every module import that crosses packages."""
    packages: dict[str, set[str]] = {package_of(m, p): set() for m, p in paths.items()}
    for name, deps in graph.items():
        src = package_of(name, paths[name])
        packages[src].update(d for d in (package_of(dep, paths[dep]) for dep in deps) if d != src)
    return packages


def size_warnings(path: Path) -> list[str]:
    """One line per file or function of ``path`` over the size at which it is worth a look."""
    text = path.read_text()
    rel = path.relative_to(ROOT.parent)
    warnings = []
    if (n := len(text.splitlines())) > WARN_FILE_LINES:
        warnings.append(f"{rel}: {n} lines (warn above {WARN_FILE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > WARN_FUNCTION_LINES:
                warnings.append(
                    f"{rel}:{node.lineno}: function {node.name} is {length} lines (warn above {WARN_FUNCTION_LINES})"
                )
    return warnings


def main(argv: list[str]) -> int:
    paths = {module_name(p): p for p in sorted((ROOT / "fullshard").rglob("*.py"))}
    graph = {name: imports_of(path, name, set(paths)) for name, path in paths.items()}
    problems: list[str] = []
    warnings: list[str] = []
    for name, deps in sorted(graph.items()):
        if "--graph" in argv:
            print(f"{name} (layer {layer_of(name)}) -> {', '.join(sorted(deps)) or '-'}")
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(name):
                problems.append(f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)}): upward")
    problems.extend("import cycle among: " + ", ".join(c) for c in cycles(graph))
    problems.extend("package import cycle among: " + ", ".join(c) for c in cycles(package_graph(graph, paths)))
    for name, deps in sorted(graph.items()):
        if name == TRAIN_JOBS or name.startswith(TRAIN_JOBS + "."):
            for dep in sorted(deps - PUBLIC_MODULES):
                if layer_of(dep) < LAYERS["fullshard.jobs"]:
                    problems.append(f"{name} imports {dep}: a training job uses only fullshard's public API")
    for name, path in paths.items():
        warnings.extend(size_warnings(path))
        if name != COMPAT:
            problems.extend(private_torch_uses(path, ast.parse(path.read_text(), str(path))))
    for w in warnings:
        print("warning:", w)
    for p in problems:
        print(p)
    print(
        f"check_layers: {len(paths)} modules, {sum(map(len, graph.values()))} imports, "
        f"{len(problems)} problems, {len(warnings)} size warnings"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The import layering of python/pagedrs (docs/ARCHITECTURE.md), checked by parsing every module.

Every ``import`` counts, at module level and inside functions alike (an import that runs back
up is usually a function-local one), except those under ``if TYPE_CHECKING:``, which never
run. Three rules:

- a module imports only modules of its own layer or lower ones (``LAYERS``);
- no import cycle between modules, of any length (a package's ``__init__`` counts as a module);
- an implementation behind an interface (``INTERNAL``) is imported only inside its own package:
  the others go through the interface (the runner holds a ``models.interface.KvModel``, not a
  Llama).

A module gets the layer of the longest prefix of its dotted name in ``LAYERS``; a module that
matches no entry fails the test until someone places it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "pagedrs"
ROOT = Path(__file__).resolve().parents[1] / "python" / PACKAGE

# Lowest first. Keep in step with the table in docs/ARCHITECTURE.md.
LAYER_NAMES = ["base", "model", "runner", "executor", "core", "frontend", "api", "app"]
LAYERS: dict[str, int] = {
    # 0 base: plain values, errors and process-wide primitives every layer may use
    "_core": 0, "errors": 0, "sampling_params": 0, "beam_search": 0, "outputs": 0, "step_input": 0,
    "tokenizer": 0, "rollback": 0, "net": 0, "engine_args": 0,
    "huge_pages": 0,  # CPU tensors in 2 MiB pages: a hint over _core, no engine knowledge
    "gc_heap": 0,  # the imports' objects out of full collections, once per process: no engine knowledge
    "gguf_reader": 0,  # gguf-py's reader with the header parsed from memory: a file format, no engine knowledge
    "gguf_tokenizer": 0,  # a GGUF's tokenizer section checked by key, beside the tokenizer that reads it
    "structured_params": 0,  # StructuredOutputsParams, a plain value beside the sampling_params that carry it
    "distributed.parallel_state": 0,  # this process's tensor-parallel rank: the model layers size their shards by it
    "distributed.step_codec": 0,  # StepInput <-> bytes, beside step_input
    "spec": 0,  # speculative decoding's config (engine_args validates it) and the pure n-gram proposer
    "spec.draft_runner": 2,  # the draft model's weights, KV pages and forward passes (a second runner)
    "spec.draft": 4,  # the draft_model proposer on the core's side (a Speculator)
    # 1 model: the model, its kernels and attention, the KV tiers' storage, memory planning
    "models": 1, "kernels": 1, "attention": 1, "kv_tiers": 1, "memory": 1,
    # 2 runner: one step on one device, and the sampler
    "model_runner": 2, "sampling": 2, "decode_graphs": 2,
    # 3 executor: where the runner runs (this process, or tensor-parallel workers)
    "executor": 3, "distributed": 3,
    # 4 core: scheduling, requests and their continuation (token ids only)
    "core": 4, "request": 4, "continuation": 4, "stats": 4,
    # 5 frontend: text in and out
    "frontend": 5, "inputs": 5,
    # 6 api: the public Python API
    "": 6, "engine": 6, "llm": 6,
    # 7 app: programs built on the API
    "server": 7, "cli": 7, "cli_args": 7, "bench": 7, "demo": 7, "chat_repl": 7, "kv_size": 7, "ray": 7,
    "kernels.__main__": 7,
}

# module -> the packages that may import it; everyone else uses the package's interface.
INTERNAL: dict[str, tuple[str, ...]] = {
    "models.llama": ("models",),  # models.interface.KvModel; pagedrs.models.load_model builds it
    "models.llama_layer": ("models",),  # one layer of models.llama
    "models.rotary": ("models",),
}


def module_name(path: Path, root: Path = ROOT) -> str:
    """Dotted name under the package ('' for the package's own __init__)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix of ``module`` in LAYERS; None when nothing matches."""
    parts = module.split(".") if module else []
    for n in range(len(parts), -1, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS and (n > 0 or not parts):
            return LAYERS[prefix]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, outside ``if TYPE_CHECKING:`` bodies."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str, tree: ast.AST, modules: set[str], is_package: bool) -> dict[str, int]:
    """The package's modules that ``module`` imports -> the line of the first such import."""
    found: dict[str, int] = {}

    def resolve(dotted: str) -> str | None:
        """The longest prefix of ``dotted`` (relative to the package) that is one of its modules."""
        parts = dotted.split(".") if dotted else []
        for n in range(len(parts), -1, -1):
            candidate = ".".join(parts[:n])
            if candidate in modules:
                return candidate
        return None

    def note(target: str | None, line: int) -> None:
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    note(resolve(alias.name.removeprefix(PACKAGE).lstrip(".")), node.lineno)
            continue
        if node.level:  # relative: from the module's package, up level - 1 more
            base_parts = module.split(".") if module else []
            if not is_package:
                base_parts = base_parts[:-1]
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
            base = (node.module or "").removeprefix(PACKAGE).lstrip(".")
        else:
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}" if base else alias.name
            # `from pkg import submodule` imports the submodule; `from pkg import name`, the package.
            note(sub if sub in modules else resolve(base), node.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    # the native module: _core.abi3.so (or _core.cpython-311-x86_64-linux-gnu.so) is pagedrs._core
    modules = set(paths) | {module_name(p.with_name(p.name.split(".")[0] + ".py"), root) for p in root.rglob("*.so")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = imports_of(name, tree, modules, path.name == "__init__.py")
    return graph


def _dotted(module: str) -> str:
    return f"{PACKAGE}.{module}" if module else PACKAGE


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        low = layer_of(module)
        if low is None:
            problems.append(f"{_dotted(module)} has no layer: add it (or its package) to LAYERS and docs/ARCHITECTURE.md")
            continue
        for target, line in sorted(targets.items()):
            high = layer_of(target)
            if high is not None and high > low:
                problems.append(
                    f"{_dotted(module)} (layer {low} {LAYER_NAMES[low]}) imports {_dotted(target)} "
                    f"(layer {high} {LAYER_NAMES[high]}) at line {line}: a lower layer may not import a higher one"
                )
    return problems


def internal_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            owners = INTERNAL.get(target)
            if owners is not None and not any(module == o or module.startswith(o + ".") for o in owners):
                problems.append(
                    f"{_dotted(module)} imports {_dotted(target)} at line {line}: it is internal to "
                    f"{', '.join(_dotted(o) for o in owners)}; use its interface"
                )
    return problems


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # Tarjan; the graph is a few hundred nodes, recursion is fine
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_through(graph, set(c), c[0]) for c in sorted(components)]


def _cycle_through(graph: dict[str, dict[str, int]], component: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside the component (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in component:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def test_every_module_imports_only_its_layer_or_lower():
    problems = layer_violations(import_graph())
    assert not problems, "\n".join(problems)


def test_implementations_are_reached_through_their_interfaces():
    problems = internal_violations(import_graph())
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    graph = import_graph()
    cycles = import_cycles(graph)
    lines = []
    for cycle in cycles:
        hops = [f"{_dotted(a)} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        lines.append(" -> ".join([*hops, _dotted(cycle[-1])]))
    assert not cycles, "import cycles:\n" + "\n".join(lines)


# ---- the checker itself -------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_function_local_relative_and_submodule_imports(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "errors.py": "def f():\n    from pagedrs.engine import Engine\n",
        "engine.py": "from . import errors\nfrom .models import llama\n",
        "models/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedrs import engine\n",
        "models/llama.py": "import pagedrs.models.config\nfrom ..errors import X\n",
        "models/config.py": "",
    })
    graph = import_graph(root)
    assert graph["errors"] == {"engine": 2}
    assert graph["engine"] == {"errors": 1, "models.llama": 2}
    assert graph["models"] == {}  # TYPE_CHECKING imports never run
    assert graph["models.llama"] == {"models.config": 1, "errors": 2}
    assert layer_violations(graph) == [
        "pagedrs.errors (layer 0 base) imports pagedrs.engine (layer 6 api) at line 2: "
        "a lower layer may not import a higher one"
    ]
    assert import_cycles(graph) == [["engine", "errors", "engine"]]
    assert internal_violations({"model_runner": {"models.llama": 20}, "models.loader": {"models.llama": 3}}) == [
        "pagedrs.model_runner imports pagedrs.models.llama at line 20: it is internal to pagedrs.models; "
        "use its interface"
    ]


def test_unknown_modules_take_their_package_layer_or_fail():
    assert layer_of("core.step") == 4 and layer_of("frontend.client") == 5 and layer_of("core") == 4
    assert layer_of("kernels.__main__") == 7 and layer_of("kernels.ops") == 1 and layer_of("") == 6
    assert layer_of("distributed.parallel_state") == 0 and layer_of("distributed.tp_executor") == 3
    assert layer_of("brand_new_module") is None
    assert layer_violations({"brand_new_module": {}}) == [
        "pagedrs.brand_new_module has no layer: add it (or its package) to LAYERS and docs/ARCHITECTURE.md"
    ]

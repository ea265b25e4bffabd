"""Import rules: the contracts of pyproject.toml's [tool.importlinter] hold, no two
files of ours import each other (directly or around a loop), and replica/ stays small at its top.

The cycle check builds its own file-level graph with `ast`: every `import` and `from ... import`
anywhere in a module counts, inside functions and under `if TYPE_CHECKING:` included, since a
loop hidden in a function is still a loop between the two files.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "router", "replica", "loadtest")
REPLICA_TOP_LEVEL_MAX = 12


def test_import_contracts_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    assert lint_imports.exists(), f"{lint_imports} missing: pip install -e '.[test]' (import-linter)"
    proc = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"lint-imports exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


# ---- the file-level import graph ----------------------------------------------------------------
def module_files() -> dict[str, Path]:
    """Dotted name -> file, for every module of our packages (a package's __init__.py is its own file)."""
    files = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that `import name` loads last: its longest prefix that is a module."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of ours that this file imports, wherever the statement is."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(m for alias in node.names if (m := _known(alias.name, modules)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1 packages
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                target = submodule if submodule in modules else _known(source, modules)
                if target:
                    out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: imports_of(m, path, modules) for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) per strongly connected component that has one, self-imports included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(start: str) -> None:  # Tarjan, iterative (no recursion limit on deep chains)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    if len(component) > 1 or v in graph[v]:
                        components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first back to it)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in {component}")


def test_the_graph_sees_every_kind_of_import():
    """The graph is what the cycle check relies on: function-level and TYPE_CHECKING imports count,
    `from pkg import mod` is an edge to the module, a package's __init__.py is a node."""
    modules = module_files()
    assert "replica" in modules and "replica.kernels.attention" in modules
    graph = import_graph()
    assert "replica.kernels.triton_attention" in graph["replica.kernels.attention"]  # inside set_backend
    assert "replica.kvcache.block_manager" in graph["replica.kv_io.kv_transfer"]  # under TYPE_CHECKING
    assert "router.policy" in graph["router.registry"]  # `import router.policy`
    assert "loadtest.bench.vllm_bench" in graph["loadtest.bench.engine_bench"]  # from loadtest.bench import vllm_bench
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}) == [["a", "b", "c", "a"], ["d", "d"]]


def test_no_import_cycles_between_files():
    found = cycles(import_graph())
    assert not found, "import cycles between files:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_replica_keeps_few_top_level_modules():
    top = sorted(p.stem for p in (REPO / "replica").glob("*.py") if p.name != "__init__.py")
    top += sorted(p.name for p in (REPO / "replica").iterdir() if (p / "__init__.py").is_file())
    assert len(top) <= REPLICA_TOP_LEVEL_MAX, f"replica/ has {len(top)} top-level modules: {', '.join(top)}"

"""The worker's packages import one way: cli -> http -> engine -> memory and models, engine and models ->
kernels; no cycles."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Higher layers may import lower ones, never the reverse. config is plain settings: anyone may read it.
LAYERS = {"worker.cli": 3, "worker.__main__": 4, "worker.http": 2, "worker.engine": 1,
          "worker.memory": 0, "worker.models": 0, "worker.kernels": -1,
          # a top-level command beside serve: it starts worker and exporter processes, imports only
          # memory, and is imported by cli (a command's package sits just below the cli that names it)
          "worker.selfcheck": 2.5}
SHARED = {"worker.config"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every project module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("worker", "exporter")}


def project_modules() -> dict[str, set[str]]:
    paths = [p for pkg in ("worker", "exporter") for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): imports(p) for p in paths}
    # "from worker.http import server" names a module, "from worker.config import X" a symbol: keep modules.
    return {name: {i for i in deps if i in modules} for name, deps in modules.items()}


def layer(module: str) -> str | None:
    return next((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), None)


def test_worker_imports_flow_one_way():
    wrong = []
    for module, deps in project_modules().items():
        if not module.startswith("worker.") or module in SHARED:
            continue
        for dep in deps:
            if dep in SHARED or dep == "worker":
                continue
            mine, theirs = layer(module), layer(dep)
            if mine is None or theirs is None:
                wrong.append(f"{module} -> {dep}: module outside the known packages")
            elif mine != theirs and LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_config_and_memory_import_nothing_above_them():
    modules = project_modules()
    assert {d for d in modules["worker.config"] if d.startswith("worker.")} == set()
    for module, deps in modules.items():
        if layer(module) == "worker.memory":
            assert all(layer(d) == "worker.memory" for d in deps), (module, deps)


def test_kernels_import_nothing_of_the_worker_but_themselves():
    kernels = {name: deps for name, deps in project_modules().items() if layer(name) == "worker.kernels"}
    assert "worker.kernels.native" in kernels
    for module, deps in kernels.items():
        assert all(layer(d) == "worker.kernels" for d in deps), (module, deps)


def test_no_import_cycles():
    graph = project_modules()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path + [node, dep]
            if dep not in state and (cycle := visit(dep, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            assert (cycle := visit(start, [])) is None, " -> ".join(cycle)


def test_nothing_test_only_in_the_product():
    for path in [*(ROOT / "worker").rglob("*.py"), *(ROOT / "exporter").rglob("*.py"),
                 *(ROOT / "vramledger").rglob("*.py")]:
        assert "test" not in path.stem, path
        assert "VRAMLEDGER_TEST" not in path.read_text(), path


def test_the_shared_package_imports_neither_side():
    """vramledger/ is what the worker, the exporter and vLLM's processes share: it must load in any of
    them, so it imports neither side, and its shared modules (not its plug-ins) not even torch."""
    for path in (ROOT / "vramledger").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        forbidden = {"worker", "exporter"} | ({"torch"} if path.parent == ROOT / "vramledger" else set())
        assert not {n.split(".")[0] for n in names} & forbidden, path


# The engine's parts that its thread changes mid-step; the server reads the engine's snapshot instead.
ENGINE_PARTS = {"scheduler", "runner", "blocks", "stats", "speculation", "ledger"}
ENGINE_PART_MODULES = {"worker.engine.scheduler", "worker.engine.block_manager", "worker.engine.model_runner",
                       "worker.engine.speculation"}


def test_the_server_never_reads_the_engines_parts():
    """worker/http reads the engine's published snapshot (worker/engine/snapshot.py), never its
    scheduler, block pool, runner or counters, which the engine thread changes while others read."""
    wrong = []
    for path in (ROOT / "worker" / "http").rglob("*.py"):
        tree = ast.parse(path.read_text())
        wrong += [f"{path.name}:{node.lineno} .{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS]
        wrong += [f"{path.name} imports {name}" for name in imports(path) if name in ENGINE_PART_MODULES]
    assert wrong == []

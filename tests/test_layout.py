"""The worker's packages import one way: cli -> http -> engine -> memory and models, engine and models ->
kernels; no cycles."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Higher layers may import lower ones, never the reverse. config is plain settings: anyone may read it.
W = "vramledger.worker"
LAYERS = {f"{W}.cli": 3, f"{W}.__main__": 4, f"{W}.http": 2, f"{W}.engine": 1, f"{W}.memory": 0, f"{W}.models": 0,
          f"{W}.kernels": -1,
          # a top-level command beside serve: it starts worker and exporter processes, imports only
          # memory, and is imported by cli (a command's package sits just below the cli that names it)
          f"{W}.selfcheck": 2.5}
SHARED = {f"{W}.config"}
# worker/ and exporter/ are installed as vramledger.worker and vramledger.exporter (vramledger/ links them).
SIDES = ("worker", "exporter")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return "vramledger." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every absolute import of a file, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def shared_modules() -> list[Path]:
    """vramledger/'s own files, not the sides it links."""
    return [p for p in (ROOT / "vramledger").rglob("*.py") if p.relative_to(ROOT / "vramledger").parts[0] not in SIDES]


def is_side(name: str) -> bool:
    return name.split(".")[:2] in (["vramledger", side] for side in SIDES)


def imports(path: Path) -> set[str]:
    """Every worker or exporter module a file imports, at the top or inside a function."""
    return {name for name in imported_names(path) if is_side(name)}


def project_modules() -> dict[str, set[str]]:
    paths = [p for pkg in SIDES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): imports(p) for p in paths}
    # "from worker.http import server" names a module, "from worker.config import X" a symbol: keep modules.
    return {name: {i for i in deps if i in modules} for name, deps in modules.items()}


def layer(module: str) -> str | None:
    return next((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), None)


def test_worker_imports_flow_one_way():
    wrong = []
    for module, deps in project_modules().items():
        if not module.startswith(f"{W}.") or module in SHARED:
            continue
        for dep in deps:
            if dep in SHARED or dep == W:
                continue
            mine, theirs = layer(module), layer(dep)
            if mine is None or theirs is None:
                wrong.append(f"{module} -> {dep}: module outside the known packages")
            elif mine != theirs and LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_config_and_memory_import_nothing_above_them():
    modules = project_modules()
    assert {d for d in modules[f"{W}.config"] if d.startswith(f"{W}.")} == set()
    for module, deps in modules.items():
        if layer(module) == "vramledger.worker.memory":
            assert all(layer(d) == "vramledger.worker.memory" for d in deps), (module, deps)


def test_kernels_import_nothing_of_the_worker_but_themselves():
    kernels = {name: deps for name, deps in project_modules().items() if layer(name) == "vramledger.worker.kernels"}
    assert "vramledger.worker.kernels.native" in kernels
    for module, deps in kernels.items():
        assert all(layer(d) == "vramledger.worker.kernels" for d in deps), (module, deps)


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
    shared = shared_modules()
    assert ROOT / "vramledger" / "vllm_plugin" / "__init__.py" in shared
    for path in shared:
        names = imported_names(path)
        torch_free = path.parent == ROOT / "vramledger"
        assert not [n for n in names if is_side(n) or (torch_free and n.split(".")[0] == "torch")], path


def test_the_installed_names_are_the_projects_own():
    """worker/ and exporter/ install as vramledger.worker and vramledger.exporter (vramledger/ links
    them): nothing imports them by the generic top-level names, which an install does not provide."""
    for side in SIDES:
        assert (ROOT / "vramledger" / side).resolve() == ROOT / side
    paths = [p for folder in (*SIDES, "tests", "bench", "scripts") for p in (ROOT / folder).rglob("*.py")]
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in paths + shared_modules()
             for name in imported_names(path) if name.split(".")[0] in SIDES]
    assert wrong == []


# The engine's parts that its thread changes mid-step; the server reads the engine's snapshot instead.
ENGINE_PARTS = {"scheduler", "runner", "blocks", "stats", "speculation", "ledger"}
ENGINE_PART_MODULES = {f"{W}.engine.{name}" for name in ("scheduler", "block_manager", "model_runner", "speculation")}


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

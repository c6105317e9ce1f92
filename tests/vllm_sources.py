"""A vLLM version's sources, read without importing them: from an installed package or a wheel.

check(names, sources) lists every name a version's module of vramledger/vllm_plugin/versions/
declares (VllmNames.source) that those sources lack or write otherwise; empty when all are there.
"""
from __future__ import annotations

import ast
import zipfile
from pathlib import Path

from vramledger.vllm_plugin.versions import VllmNames
from vramledger.vllm_plugin.versions.source import Attributes, Function, Imported


class Sources:
    """The `vllm` package's files, under a folder holding it (site-packages) or in a wheel."""

    def __init__(self, where: Path):
        self.where = where
        self._zip = zipfile.ZipFile(where) if where.suffix == ".whl" else None
        self._trees: dict[str, ast.Module | None] = {}

    def text(self, path: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(path).decode()
            except KeyError:
                return None
        file = self.where / path
        return file.read_text() if file.is_file() else None

    def tree(self, module: str) -> ast.Module | None:
        """The module's syntax tree; None where the version has no such module."""
        if module not in self._trees:
            text = self.text(module.replace(".", "/") + ".py")
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    def version(self) -> str:
        """The version the package says it is (the wheel's name, else vllm/_version.py's)."""
        if self._zip is not None:
            return self.where.name.split("-")[1]
        tree = ast.parse(self.text("vllm/_version.py") or "")
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("__version__", "version")
                                                    for t in node.targets):
                return str(ast.literal_eval(node.value))
        raise LookupError(f"no version in {self.where}/vllm/_version.py")


def _find(tree: ast.AST, qualname: str) -> ast.AST | None:
    node: ast.AST | None = tree
    for part in qualname.split("."):
        node = next((c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                               ast.ClassDef)) and c.name == part), None)
        if node is None:
            return None
    return node


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    """Annotated fields, and attributes its methods assign to self."""
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def _imports(tree: ast.Module, module: str, name: str, origin: str) -> bool:
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None for a in node.names):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(p for p in (base, node.module or "") if p) if node.level else node.module
            if source == origin:
                return True
    return False


def check(names: VllmNames, sources: Sources) -> list[str]:
    problems = []
    for declared in names.source:
        tree = sources.tree(declared.module)
        if tree is None:
            problems.append(f"{declared}: no module {declared.module}")
        elif isinstance(declared, Function):
            node = _find(tree, declared.qualname)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems.append(f"{declared}: no such function")
            elif f"({ast.unparse(node.args)})" != declared.signature:
                problems.append(f"{declared}: its parameters are ({ast.unparse(node.args)})")
        elif isinstance(declared, Attributes):
            cls = _find(tree, declared.cls)
            if not isinstance(cls, ast.ClassDef):
                problems.append(f"{declared}: no such class")
            else:
                missing = set(declared.names) - _instance_attributes(cls)
                if missing:
                    problems.append(f"{declared}: lacks {sorted(missing)}")
        elif isinstance(declared, Imported):
            if not _imports(tree, declared.module, declared.name, declared.origin):
                problems.append(f"{declared}: not imported there")
        else:
            problems.append(f"{declared}: a kind of name this check does not know")
    return problems

"""Builds the vLLM plugin's wheel: only what vLLM's processes import (the vramledger package) and the
plugin's two vLLM entry points; none of the worker, the exporter, their model assets or commands.

    python3 scripts/plugin_wheel.py [OUT]      (default: dist/; prints the wheel's path)

Its name, vramledger-vllm-plugin, is its own, so it never stands in for the whole project. Version
and entry points are the project's (pyproject.toml); the package is staged apart and built there,
so nothing outside it can reach the wheel. It depends on nothing: what the plugin imports (torch,
psutil, FastAPI, NVML's bindings, typing_extensions) comes with vLLM.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "vramledger-vllm-plugin"
PACKAGE = "vramledger"
LINKED_SIDES = ("worker", "exporter")
SCHEMA_FILE = "ledger.schema.json"  # the ledger document's JSON Schema, shipped beside its definition


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip vendors a reader of the same format
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


def plugin_pyproject() -> str:
    project = _toml().loads((ROOT / "pyproject.toml").read_text())["project"]
    points = {group: names for group, names in project["entry-points"].items() if group.startswith("vllm.")}
    lines = ['[build-system]', 'requires = ["setuptools>=61"]', 'build-backend = "setuptools.build_meta"', '',
             '[project]', f'name = "{NAME}"', f'version = "{project["version"]}"',
             'description = "The vramledger vLLM plugin: vLLM\'s memory ledger, served by vLLM"',
             f'requires-python = "{project["requires-python"]}"', 'dependencies = []', '']
    for group, names in points.items():
        lines += [f'[project.entry-points."{group}"]', *(f'{n} = "{v}"' for n, v in names.items()), '']
    lines += ['[tool.setuptools.packages.find]', f'include = ["{PACKAGE}", "{PACKAGE}.*"]', '',
              '[tool.setuptools.package-data]', f'{PACKAGE} = ["{SCHEMA_FILE}"]', '']
    return "\n".join(lines)


def _can_build_wheels() -> bool:
    """setuptools with a bdist_wheel: its own (70.1 on) or the wheel package's."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    return importlib.util.find_spec("setuptools.command.bdist_wheel") is not None or \
        importlib.util.find_spec("wheel") is not None


def build(out: Path) -> Path:
    out = out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        stage = Path(staging)
        (stage / "pyproject.toml").write_text(plugin_pyproject())
        # Without the worker and the exporter that the package links in (pyproject.toml installs those).
        shutil.copytree(ROOT / PACKAGE, stage / PACKAGE,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", *LINKED_SIDES))
        # Offline where this Python can build it; else pip fetches setuptools into an isolated build.
        isolation = ["--no-build-isolation"] if _can_build_wheels() else []
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                               "-w", str(stage / "dist"), str(stage)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the plugin's wheel did not build:\n{done.stderr[-3000:]}")
        [wheel] = (stage / "dist").glob("*.whl")
        return Path(shutil.copy2(wheel, out / wheel.name))


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dist"))

"""The vLLM plugin's own wheel (scripts/plugin_wheel.py, `make plugin-wheel`): only what vLLM's
processes import, and the plugin imports from it alone, the worker and the exporter nowhere to be found."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vramledger.ledger_document import SCHEMA_FILE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import plugin_wheel  # noqa: E402
import vllm_peer  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    from pip._vendor import tomli as tomllib


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return plugin_wheel.build(tmp_path_factory.mktemp("dist"))


def test_the_wheel_holds_the_vramledger_package_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    metadata = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    ours = {p.relative_to(ROOT).as_posix() for p in (ROOT / "vramledger").rglob("*.py")}
    ours.add(f"vramledger/{SCHEMA_FILE}")  # the ledger's schema, for engines that publish it
    assert set(names) - metadata == ours  # every module of the package and its schema, nothing else
    assert {n.split("/")[0] for n in metadata} == {"vramledger_vllm_plugin-" + wheel.name.split("-")[1] + ".dist-info"}


def test_the_wheel_declares_the_plugin_and_no_commands_or_dependencies(wheel):
    dist_info = wheel.name.split("-py3")[0] + ".dist-info"
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        metadata = z.read(f"{dist_info}/METADATA").decode()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    sections = [line for line in entry_points.splitlines() if line.startswith("[")]
    assert sections == ["[vllm.endpoint_plugins]", "[vllm.general_plugins]"]  # no console_scripts
    for group in ("vllm.general_plugins", "vllm.endpoint_plugins"):
        for name, value in project["entry-points"][group].items():
            assert f"{name} = {value}" in entry_points
    assert "Requires-Dist" not in metadata
    assert f"Name: {plugin_wheel.NAME}\n" in metadata and f"Version: {project['version']}\n" in metadata


# In vLLM's interpreter: the installed plugin, with the project's other packages made unimportable.
IMPORT_ALONE = """
import importlib, importlib.metadata as md, json, pkgutil, sys
target = sys.argv[1]
sys.path.insert(0, target)
sys.modules["vramledger.worker"] = sys.modules["vramledger.exporter"] = None  # imported anywhere: ImportError
import vramledger
modules = [m.name for m in pkgutil.walk_packages(vramledger.__path__, "vramledger.")]
for name in modules:
    importlib.import_module(name)
points = {e.group: e.value for d in md.distributions(path=[target]) for e in d.entry_points}
for value in points.values():
    module, attr = value.split(":")
    getattr(importlib.import_module(module), attr)
print(json.dumps({"file": vramledger.__file__, "modules": modules, "points": points}))
"""


def test_the_installed_wheel_imports_without_the_worker_or_the_exporter(wheel, tmp_path):
    python = vllm_peer.vllm_python()
    if python is None:
        pytest.skip("no vLLM venv (VLLM_VENV or .venv-vllm): the plugin imports what vLLM brings (FastAPI)")
    target = tmp_path / "site"
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["vramledger"]
    out = subprocess.run([str(python), "-I", "-c", IMPORT_ALONE, str(target)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(found["file"]).parent == target / "vramledger"
    assert "vramledger.vllm_plugin.hooks" in found["modules"] and "vramledger.vllm_plugin.versions.v0_33" in found[
        "modules"]
    assert found["points"] == {"vllm.general_plugins": "vramledger.vllm_plugin:register",
                               "vllm.endpoint_plugins": "vramledger.vllm_plugin:make_endpoint"}

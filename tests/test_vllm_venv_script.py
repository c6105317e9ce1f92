"""scripts/vllm_peer.py's install check, as scripts/vllm_venv.sh calls it (`make vllm-venv`): this
checkout's plugin, from its own wheel, and nothing else declaring its entry points."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import plugin_wheel  # noqa: E402
import vllm_peer  # noqa: E402

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)


@pytest.mark.skipif(vllm_peer.vllm_python() is None, reason="no vLLM venv (VLLM_VENV or .venv-vllm)")
def test_the_install_check_takes_the_venv_relative_to_the_checkout():
    venv = Path(vllm_peer.vllm_python()).parent.parent
    if not vllm_peer.plugin_installed(venv / "bin" / "python"):
        pytest.skip("the vLLM venv holds another checkout's plugin: `make vllm-venv` installs this one")
    relative = os.path.relpath(venv, ROOT)  # as vllm_venv.sh passes its default, .venv-vllm
    check = subprocess.run([sys.executable, "scripts/vllm_peer.py", "plugin-installed", relative], cwd=ROOT)
    assert check.returncode == 0


def venv_with(tmp_path: Path, name: str, *installs: str) -> Path:
    """A venv (no pip, no vLLM: the check needs neither) holding what pip installs there, in order."""
    venv = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    [site] = (venv / "lib").glob("python3*/site-packages")
    for install in installs:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                              str(site), install], capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert pip.returncode == 0, pip.stderr[-3000:]
    return venv / "bin" / "python"


def whole_project(tmp_path: Path) -> str:
    """This checkout's project, copied without its model assets: setuptools builds in the source tree."""
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    for package in ("worker", "exporter", "vramledger"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    return str(copy)


def test_the_install_check_wants_the_plugin_wheel_and_not_the_whole_project(tmp_path):
    wheel, project = str(plugin_wheel.build(tmp_path / "dist")), whole_project(tmp_path)
    assert vllm_peer.plugin_installed(venv_with(tmp_path, "plugin", wheel))
    # The whole project's distribution holds the same package and entry points, and the worker beside them.
    assert not vllm_peer.plugin_installed(venv_with(tmp_path, "project-only", project))
    assert not vllm_peer.plugin_installed(venv_with(tmp_path, "both", wheel, project))

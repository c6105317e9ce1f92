"""This project installed for vLLM's venv as docs/vllm.md tells users (`pip install --no-deps`).

`make test` installs this checkout into vLLM's venv (scripts/vllm_venv.sh); the tests use that install
when it is this checkout's, file for file. Otherwise (a venv shared with another checkout, or built
before the last change) they install it into a folder of their own, put on PYTHONPATH, and leave the
venv as it is.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402


def plugin_path(python: Path, target: Path) -> list[str]:
    """The PYTHONPATH entries that give vLLM this checkout's plugin: none when its venv has it installed."""
    if vllm_peer.plugin_installed(python):
        return []
    return [str(install_plugin(python, target))]


def install_plugin(python: Path, target: Path) -> Path:
    """pip-install this checkout (no dependencies: vLLM's venv has what the plugin imports) into target."""
    setuptools = subprocess.run([str(python), "-c", "import setuptools"], capture_output=True).returncode == 0
    isolation = ["--no-build-isolation"] if setuptools else []  # offline when the venv can build it
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target",
                          str(target), str(ROOT)], capture_output=True, text=True, cwd=target.parent)
    if pip.returncode != 0:
        raise RuntimeError(f"pip could not install the plugin into {target}:\n{pip.stderr[-3000:]}")
    return target

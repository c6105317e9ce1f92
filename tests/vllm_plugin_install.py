"""This project installed for vLLM's venv as docs/vllm.md tells users (`pip install --no-deps`).

Into a folder of the test's own (then on PYTHONPATH), not into the venv: the venv may be shared, and
the folder holds this checkout's plugin, never one installed from an older one.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def install_plugin(python: Path, target: Path) -> Path:
    """pip-install this checkout (no dependencies: vLLM's venv has what the plugin imports) into target."""
    setuptools = subprocess.run([str(python), "-c", "import setuptools"], capture_output=True).returncode == 0
    isolation = ["--no-build-isolation"] if setuptools else []  # offline when the venv can build it
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target",
                          str(target), str(ROOT)], capture_output=True, text=True, cwd=target.parent)
    if pip.returncode != 0:
        raise RuntimeError(f"pip could not install the plugin into {target}:\n{pip.stderr[-3000:]}")
    return target

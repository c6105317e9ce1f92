"""The vLLM plugin installed for vLLM's venv as docs/vllm.md tells users: its own wheel (scripts/plugin_wheel.py).

`make test` installs this checkout's plugin into vLLM's venv (scripts/vllm_venv.sh); the tests use that
install when it is this checkout's, file for file. Otherwise (a venv shared with another checkout, or
built before the last change) they install the wheel into a folder of their own, put on PYTHONPATH,
and leave the venv as it is.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import plugin_wheel  # noqa: E402
import vllm_peer  # noqa: E402

_found: dict[Path, list[str]] = {}  # per vLLM interpreter, once a test session: the checkout stays as it is


def plugin_path(python: Path, target: Path) -> list[str]:
    """The PYTHONPATH entries that give vLLM this checkout's plugin: none when its venv has it installed.
    The first call installs it where needed (into target); the later ones of the session use that install."""
    if python not in _found:
        _found[python] = [] if vllm_peer.plugin_installed(python) else [str(install_plugin(python, target))]
    return _found[python]


def install_plugin(python: Path, target: Path) -> Path:
    """pip-install this checkout's plugin wheel (no dependencies: vLLM's venv has what it imports) into target."""
    wheel = plugin_wheel.build(target.parent / "wheel")
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(wheel)], capture_output=True, text=True, cwd=target.parent)
    if pip.returncode != 0:
        raise RuntimeError(f"pip could not install the plugin into {target}:\n{pip.stderr[-3000:]}")
    return target

"""scripts/vllm_peer.py's install check, as scripts/vllm_venv.sh calls it (`make vllm-venv`)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402


@pytest.mark.skipif(vllm_peer.vllm_python() is None, reason="no vLLM venv (VLLM_VENV or .venv-vllm)")
def test_the_install_check_takes_the_venv_relative_to_the_checkout():
    venv = Path(vllm_peer.vllm_python()).parent.parent
    if not vllm_peer.plugin_installed(venv / "bin" / "python"):
        pytest.skip("the vLLM venv holds another checkout's plugin: `make vllm-venv` installs this one")
    relative = os.path.relpath(venv, ROOT)  # as vllm_venv.sh passes its default, .venv-vllm
    check = subprocess.run([sys.executable, "scripts/vllm_peer.py", "plugin-installed", relative], cwd=ROOT)
    assert check.returncode == 0

"""What an install brings: the two console scripts, and the Kubernetes client only as an extra."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.kubernetes import PodDirectory

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("script, says", [("vramledger-worker", "serve"), ("vramledger-exporter", "--vllm")])
def test_console_scripts_are_installed_and_answer(script, says):
    done = subprocess.run([str(BIN / script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert says in done.stdout


def test_kubernetes_without_its_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if the extra were not installed
    with pytest.raises(RuntimeError, match=r"pip install 'vramledger\[kubernetes\]'"):
        PodDirectory.connect("gpu-node-1", ErrorLog())

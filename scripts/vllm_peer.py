"""vLLM's CPU build as a peer process: where its venv is, whether this checkout's vLLM plugin is
installed in it, and how to start its OpenAI server.

Used by bench/, scripts/vllm_venv.sh and the tests that need a real vLLM (skipped when no venv
exists; `make vllm-venv` builds one).

    python3 scripts/vllm_peer.py plugin-installed VENV   # exit 0 when VENV has this checkout's plugin
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import plugin_wheel

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 300  # about 40 s on an idle 2-core machine; far more when the machine is shared


def vllm_python() -> Path | None:
    """The vLLM venv's interpreter: $VLLM_VENV, else .venv-vllm in the repository; None if absent or half-built."""
    venv = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
    return venv / "bin" / "python" if (venv / ".ready").exists() else None


# What the venv's interpreter finds, isolated (-I: no PYTHONPATH, no current directory) from wherever it runs.
_INSTALLED = """
import importlib.metadata as md, importlib.util, json
spec = importlib.util.find_spec("vramledger")
groups = ("vllm.general_plugins", "vllm.endpoint_plugins")
owners = {g: {} for g in groups}  # each entry point's distributions: two where another also declares it
for g in groups:
    for e in md.entry_points(group=g):
        owners[g].setdefault(e.name, []).append(e.dist and e.dist.name)
print(json.dumps({"package": list(spec.submodule_search_locations) if spec else [],
                  "entry_points": {g: {e.name: e.value for e in md.entry_points(group=g)} for g in groups},
                  "owners": owners}))
"""


def plugin_installed(python: Path) -> bool:
    """Whether vLLM's venv holds this checkout's plugin, alone: the same vramledger package, file for
    file, and the same vLLM entry points, from the plugin's own wheel (an install from another
    checkout, an older one, or the whole project's distribution is not)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the entry points cannot be compared, so the install is not trusted
        return False
    with tempfile.TemporaryDirectory() as away:
        # Absolute: the venv's path may be relative to this directory, and the probe runs away from it.
        out = subprocess.run([str(python.absolute()), "-I", "-c", _INSTALLED], capture_output=True, text=True,
                             cwd=away, timeout=120)
    if out.returncode != 0:
        return False
    found = json.loads(out.stdout)
    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    ours = {(group, name): value for group, points in wanted.items() if group.startswith("vllm.")
            for name, value in points.items()}
    if any(found["entry_points"].get(group, {}).get(name) != value for (group, name), value in ours.items()):
        return False
    if any(found["owners"][group][name] != [plugin_wheel.NAME] for group, name in ours):
        return False  # declared by another distribution (the whole project): not the plugin alone
    if len(found["package"]) != 1:
        return False
    installed, ours = Path(found["package"][0]), ROOT / "vramledger"
    if installed.resolve() == ours.resolve():
        return False  # the checkout itself (an editable install): not what users install
    files = {p.relative_to(ours) for p in ours.rglob("*.py")}
    return files == {p.relative_to(installed) for p in installed.rglob("*.py")} and all(
        (installed / f).read_bytes() == (ours / f).read_bytes() for f in files)


def vllm_command(model: str | Path, port: int, draft: str | Path | None = None, k: int = 4,
                 max_model_len: int = 2048, extra: list[str] = ()) -> list[str]:
    python = vllm_python()
    if python is None:
        raise FileNotFoundError("no vLLM venv: run `make vllm-venv` (or set VLLM_VENV)")
    # Its `vllm` console script looks up a distribution named `vllm` and fails: start the module.
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--dtype", "float32", "--max-model-len", str(max_model_len),
           "--host", "127.0.0.1", "--port", str(port), *extra]
    if draft is not None:
        cmd += ["--speculative-config", json.dumps(
            {"model": str(draft), "num_speculative_tokens": k, "method": "draft_model"})]
    return cmd


def start_vllm(model: str | Path, port: int, log: Path, kv_cache_gib: int = 1, env: dict | None = None,
               cwd: Path = ROOT, **kwargs) -> subprocess.Popen:
    """Starts the server in its own session (so its engine-core children can be stopped together).

    env: variables added to ours (None: removed). cwd is first on the server's sys.path (`python -m`).
    """
    env = {k: v for k, v in dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), **(env or {})).items()
           if v is not None}
    return subprocess.Popen(vllm_command(model, port, **kwargs), env=env, cwd=cwd, start_new_session=True,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "plugin-installed":
        sys.exit(f"usage: {sys.argv[0]} plugin-installed VENV")
    sys.exit(0 if plugin_installed(Path(sys.argv[2]) / "bin" / "python") else 1)

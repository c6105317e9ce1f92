"""vLLM's CPU build as a peer process: where its venv is, and how to start its OpenAI server.

Used by bench/ and by the tests that need a real vLLM (skipped when no venv exists;
`make vllm-venv` builds one).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 300  # about 40 s on an idle 2-core machine; far more when the machine is shared


def vllm_python() -> Path | None:
    """The vLLM venv's interpreter: $VLLM_VENV, else .venv-vllm in the repository; None if absent or half-built."""
    venv = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
    return venv / "bin" / "python" if (venv / ".ready").exists() else None


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

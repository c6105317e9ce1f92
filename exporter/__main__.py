"""python -m vramledger.exporter: the vramledger sidecar."""
from vramledger.exporter.cli import run

run()

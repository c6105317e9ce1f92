"""python -m exporter: the vramledger sidecar."""
from exporter.cli import run

run()

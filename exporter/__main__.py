"""python -m exporter: the vramledger sidecar."""
from exporter.cli import main

raise SystemExit(main())

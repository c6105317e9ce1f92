"""python -m exporter: the vramledger sidecar."""
import logging
import os
import sys

from exporter.cli import main

code = main()
# Exit now rather than after joining the ledger readers' threads: one stuck on a worker that never
# answers would hold a stopping exporter for its whole --worker-timeout.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)

"""scripts/local_stack.py's helpers for tests (scripts/ is not a package)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from local_stack import LocalStack, free_port, wait_http  # noqa: F401

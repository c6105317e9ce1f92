"""scripts/local_stack.py's LocalStack and its Prometheus config for tests (scripts/ is not a package)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from local_stack import LocalStack, with_vllm_job  # noqa: F401

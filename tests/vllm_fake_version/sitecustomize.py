"""Makes every Python process started with this folder on PYTHONPATH see vLLM as FAKE_VLLM_VERSION.

The test of a vLLM version the plugin was not built for; vllm.version is rewritten as it loads,
so `vllm.__version__` (which vllm/__init__.py copies from it) says the same.
"""
import importlib.abc
import importlib.machinery
import os
import sys


class _FakeVersion(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.version":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.__version__ = os.environ["FAKE_VLLM_VERSION"]

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FAKE_VLLM_VERSION"):
    sys.meta_path.insert(0, _FakeVersion())

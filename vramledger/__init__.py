"""The torch-free vocabulary and plug-ins shared by the worker, the exporter and vLLM."""

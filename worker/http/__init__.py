"""The OpenAI-compatible HTTP API, the engine loop that feeds it, and the Prometheus metrics."""

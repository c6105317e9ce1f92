"""`python -m vramledger.worker selfcheck`: replay the scenarios that break a ledger on this device and say whether it held.

One concept a file: options (the flags), scale (sizes per device), checkpoints (sizes read from a
checkpoint, the large random pair), processes (everything started, always cleaned up), workers (a
worker process and how to launch it), view (the device's own per-process view), load (requests that
fill the KV cache), the five scenarios, report (table, JSON, exit code) and run (the order).
"""

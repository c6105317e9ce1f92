"""Measuring and budgeting bytes: the device, the profiler, the memory plan and the ledger."""

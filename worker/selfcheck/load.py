"""Load through the worker's HTTP API: max_num_seqs requests taken to max_model_len, with the KV
cache's fill sampled from GET /v1/memory while they run."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from vramledger.worker.selfcheck.workers import WorkerProcess, read_ledger


@dataclass
class LoadResult:
    """What a load did: requests sent and completed, tokens generated, the KV cache's highest fill."""

    requests: int
    completed: int
    tokens: int
    max_blocks_used: int
    blocks_total: int
    seconds: float
    errors: list[str]

    @property
    def max_fill(self) -> float:
        return self.max_blocks_used / self.blocks_total if self.blocks_total else 0.0


def fill_load(worker: WorkerProcess, num_requests: int, max_model_len: int, vocab_size: int,
              timeout: float, new_tokens: int | None = None, seed: int = 0) -> LoadResult:
    """num_requests concurrent completions, each a prompt of random token ids continued (ignore_eos)
    until prompt + new tokens = max_model_len. By default a quarter of the length is new tokens, so
    that the prompts arrive as a prefill batch as large as the profile run's."""
    new_tokens = new_tokens or max(1, max_model_len // 4)
    prompt_len = max_model_len - new_tokens
    rng = random.Random(seed)
    model = worker.model_id()
    prompts = [[rng.randrange(1, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    blocks_total = worker.ledger()["kv_cache"]["blocks_total"]
    stop = threading.Event()
    peak = {"blocks": 0}

    # The fill is at its peak for the last step or two only (every request near max_model_len at once):
    # watched every 2 ms (a step of a small load takes a few) so that its last steps are not missed.
    def watch() -> None:
        with httpx.Client(timeout=10, trust_env=False) as client:
            while not stop.is_set():
                try:
                    ledger = read_ledger(worker.name, client.get(worker.url + "/v1/memory").json())
                    used = ledger["kv_cache"]["blocks_used"]
                    peak["blocks"] = max(peak["blocks"], used)
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                stop.wait(0.002)

    def complete(client: httpx.Client, prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True}
        response = client.post(worker.url + "/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    start = time.monotonic()
    watcher = threading.Thread(target=watch, name="kv-fill", daemon=True)
    watcher.start()
    errors, tokens, completed = [], 0, 0
    limits = httpx.Limits(max_connections=num_requests + 1)
    try:
        with httpx.Client(timeout=timeout, trust_env=False, limits=limits) as client, \
                ThreadPoolExecutor(num_requests) as pool:
            for future in [pool.submit(complete, client, p) for p in prompts]:
                try:
                    tokens += future.result()
                    completed += 1
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        watcher.join()
    return LoadResult(num_requests, completed, tokens, peak["blocks"], blocks_total,
                      time.monotonic() - start, errors)

"""What the server holds for the requests it may have in flight: the ledger's `server` entry.

Admission bounds them: max_num_seqs running and at most --max-waiting queued (preempted ones
queue again). Each holds its parsed body, its job and output queue, and the completion collected
so far; each queued one also holds the engine's per-request state, which `sequence_state` counts
only for the running ones. Built at the longest sequence, then measured by the profiler.
"""
from __future__ import annotations

import asyncio
import json

import torch

from worker.config import EngineConfig
from worker.engine.outputs import RequestOutput
from worker.engine.profile_run import request_states
from worker.http.choices import Job
from worker.http.renderer import ResponseRenderer
from worker.http.request_models import CompletionRequest


def requests_in_flight(config: EngineConfig, max_waiting: int, tokenizer, device: torch.device) -> list:
    """The server's state for max_num_seqs + max_waiting requests of max_model_len tokens.

    The completions grow as serving grows them, a step's output for every request in turn: the
    short-lived outputs between the long-lived lists leave the heap as fragmented as serving does.
    """
    vocab = max(2, getattr(tokenizer, "vocab_size", 0) or 2)
    prompt_len = config.max_model_len // 2
    requests = []
    for i in range(config.max_num_seqs + max_waiting):
        ids = torch.randint(1, vocab, (config.max_model_len,), generator=torch.Generator().manual_seed(i))
        prompt, output = ids[:prompt_len].tolist(), ids[prompt_len:].tolist()
        body = CompletionRequest.model_validate({"model": "m", "prompt": prompt, "max_tokens": len(output)})
        request_id = f"cmpl-{i:032x}"
        job = Job(request_id, [request_id], [asyncio.Queue()], ResponseRenderer(request_id, False, "m", False),
                  prompt_len)
        texts = tokenizer.convert_ids_to_tokens(output) if tokenizer is not None else [""] * len(output)
        requests.append((body, list(prompt), job, output, texts, [], []))
    for step in range(config.max_model_len - prompt_len):
        for _, _, job, output, texts, collected_text, collected_ids in requests:
            out = RequestOutput(job.request_id, [output[step]], texts[step], False, None, prompt_len, step + 1, 0, 0)
            collected_text.append(out.text)
            collected_ids.extend(out.new_token_ids)
    for _, _, job, _, _, collected_text, collected_ids in requests:  # rendered, sent and dropped
        json.dumps(job.render.response([("".join(collected_text), collected_ids, "length", None)], prompt_len))
    return [requests, request_states(config, tokenizer, device, count=max_waiting)]

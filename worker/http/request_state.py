"""What the server holds for the requests it may have in flight: the ledger's `server` entry.

Admission bounds them: max_num_seqs running and at most --max-waiting queued, counting the ones
being tokenized (preempted ones queue again). Each holds its parsed body without its prompt text
(its token ids say the same), its stop strings, its job and output queue, and the completion
collected so far; each queued one also holds the engine's per-request state, which
`sequence_state` counts only for the running ones. Meanwhile IN_STAGE requests with small bodies
and as many with large ones are parsed and tokenized, one more body is being parsed, both
encoder lanes tokenize the longest texts they take, and --max-receiving-bodies bodies at the body
limit are received or wait to be parsed (body_slots.py).
Built at the longest sequence and the costliest texts, and measured by the profiler at its peak.
"""
from __future__ import annotations

import asyncio
import json

import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.outputs import RequestOutput
from vramledger.worker.engine.profile_run import request_states
from vramledger.worker.http.choices import Job
from vramledger.worker.http.prompt_bounds import body_limit, costliest_text, ledger_texts
from vramledger.worker.http.prompt_encoder import IN_STAGE, SHORT_CHARS, PromptEncoder
from vramledger.worker.http.renderer import ResponseRenderer
from vramledger.worker.http.request_models import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
)
from vramledger.worker.http.settings import ServerSettings

READ_BYTES = 64 << 10  # the pieces a body arrives in: uvicorn stops reading at 64 KiB until the app takes them


def requests_in_flight(settings: ServerSettings, encoder: PromptEncoder, config: EngineConfig, tokenizer,
                       device: torch.device) -> list:
    """The server's state for max_num_seqs + max_waiting requests of max_model_len tokens, with the
    prompt stage full (see the module's doc). config: the engine's, its lengths resolved.

    The completions grow as serving grows them, a step's output for every request in turn: the
    short-lived outputs between the long-lived lists leave the heap as fragmented as serving does.
    """
    vocab = max(2, getattr(tokenizer, "vocab_size", 0) or 2)
    prompt_len, max_model_len = config.max_model_len // 2, config.max_model_len
    stop = costliest_text(MAX_STOP_CHARS)
    requests: list[tuple] = []
    for i in range(config.max_num_seqs + settings.max_waiting):
        ids = torch.randint(1, vocab, (max_model_len,), generator=torch.Generator().manual_seed(i))
        prompt, output = ids[:prompt_len].tolist(), ids[prompt_len:].tolist()
        body = CompletionRequest.model_validate({"model": "m", "prompt": "", "max_tokens": len(output),
                                                 "stop": [own_copy(stop) for _ in range(MAX_STOP_STRINGS)]})
        request_id = f"cmpl-{i:032x}"
        job = Job(request_id, [request_id], [asyncio.Queue()], ResponseRenderer(request_id, False, "m", False),
                  prompt_len)
        texts = tokenizer.convert_ids_to_tokens(output) if tokenizer is not None else [""] * len(output)
        requests.append((body, list(prompt), job, output, texts, [], []))
    for step in range(max_model_len - prompt_len):
        for _, _, job, output, texts, collected_text, collected_ids in requests:
            out = RequestOutput(job.request_id, [output[step]], texts[step], False, None, prompt_len, step + 1, 0, 0)
            collected_text.append(out.text)
            collected_ids.extend(out.new_token_ids)
    for _, _, job, _, _, collected_text, collected_ids in requests:  # rendered, sent and dropped
        json.dumps(job.render.response([("".join(collected_text), collected_ids, "length", None)], prompt_len))
    limit = body_limit(encoder.bound, max_model_len, settings.max_body_bytes)
    return [requests, request_states(config, tokenizer, device, count=settings.max_waiting),
            *prompt_stage(encoder, max_model_len, settings.max_body_bytes),
            bodies_received(settings.max_receiving_bodies, limit)]


def prompt_stage(encoder: PromptEncoder, max_model_len: int, max_body_bytes: int) -> list:
    """The requests being parsed and tokenized: IN_STAGE with large bodies, each a conversation of
    max_model_len - 1 messages whose texts are the longest a prompt may have, IN_STAGE with small
    ones, one body at the limit being parsed (small and large bodies at their costliest: empty
    messages, the most objects per byte), and the ledger's texts (prompt_bounds.ledger_texts), each
    tokenized on both lanes at once."""
    texts = ledger_texts(encoder.bound, max_model_len, max_body_bytes)
    text = texts[0]  # longest_text: the most tokens, and the most bytes a Python string holds for them
    count = max_model_len - 1
    piece = max(1, len(text) // count)
    conversations = [ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": own_copy(text[j * piece:(j + 1) * piece])} for j in range(count)]})
        for _ in range(IN_STAGE)]
    small = [parsed_empty_messages(SHORT_CHARS) for _ in range(IN_STAGE)]
    parsing = parsed_empty_messages(body_limit(encoder.bound, max_model_len, max_body_bytes))
    tokenizing: list[list[int]] = []
    if encoder.tokenizer is not None:  # one after another: the peak measured is the costlier's
        for candidate in texts:
            tokenizing = []  # the earlier text's token ids go first: a lane holds one prompt's at a time
            tokenizing = encoder.tokenize_on_both_lanes(candidate)
    return [conversations, small, parsing, tokenizing]


def bodies_received(count: int, body_bytes: int) -> list[bytes]:
    """`count` bodies of `body_bytes` held unparsed, each received in pieces of a socket read and
    joined, one after another (a join holds its pieces and its copy at once)."""
    bodies = []
    for i in range(count):
        fill = bytes([ord("a") + i % 26])  # written, so every page is resident
        pieces = [fill * min(READ_BYTES, body_bytes - start) for start in range(0, body_bytes, READ_BYTES)]
        bodies.append(b"".join(pieces))
    return bodies


def parsed_empty_messages(body_bytes: int) -> ChatCompletionRequest:
    """A body of about this many bytes, parsed: as many empty messages as fit."""
    empty = b'{"role":"user","content":""}'
    count = max(1, (body_bytes - 32) // (len(empty) + 1))
    messages = b",".join([empty] * count)
    return ChatCompletionRequest.model_validate_json(b'{"model":"m","messages":[' + messages + b"]}")


def own_copy(text: str) -> str:
    """The same text rotated: a string of its own, as each request's body has (`text[:]` is `text`)."""
    return text[1:] + text[:1]

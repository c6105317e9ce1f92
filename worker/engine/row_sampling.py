"""A batch's rows as the sampler sees them: their settings as tensors (RowParams) with each seeded
request's own generator, and the target's log-probabilities of the tokens the rows asked them for."""
from __future__ import annotations

import torch

from vramledger.worker.engine.detokenizer import TokenTexts
from vramledger.worker.engine.outputs import TokenLogprob
from vramledger.worker.engine.penalties import History
from vramledger.worker.engine.sampler import RowParams, top_logprobs
from vramledger.worker.engine.sequence import Sequence


class RowSampling:
    """Per-row sampling state across steps: the generators of seeded requests, one shared generator
    for the others, and the last step's RowParams while its rows stay the same requests."""

    def __init__(self, device: torch.device, seed: int, eos_token_ids: set[int], vocab_size: int, tokenizer=None):
        """`tokenizer` gives each logprob's token its text (None: no row asks for logprobs)."""
        self.device = device
        self.eos_token_ids = eos_token_ids  # min_tokens holds them back (History)
        self.vocab_size = vocab_size
        self.generators: dict[str, torch.Generator] = {}  # a seeded request's own
        self._shared = torch.Generator(device).manual_seed(seed)
        self._token_texts = TokenTexts(tokenizer)
        self._last_rows: tuple[list[Sequence], RowParams] | None = None

    def add(self, seq: Sequence) -> None:
        if seq.params.seed is not None:  # its own generator: its draws do not depend on its batch
            self.generators[seq.request_id] = torch.Generator(self.device).manual_seed(seq.params.seed)

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def rows(self, seqs: list[Sequence]) -> RowParams:
        """The batch's sampling settings; those of the last step when its rows are the same requests
        and no row has a history (a request's settings never change; a history does every step)."""
        params, outputs = [s.params for s in seqs], [s.output_token_ids for s in seqs]
        if History.needed(params, outputs):
            history = History(params, [s.prompt_token_ids for s in seqs], outputs, self.eos_token_ids,
                              self.vocab_size, self.device)
            return RowParams(params, self._row_generators(seqs), self.device, history, self._shared)
        last = self._last_rows
        if last is None or len(last[0]) != len(seqs) or any(a is not b for a, b in zip(last[0], seqs)):
            # The rows are held, so that an identity compared next step is never another request's.
            last = self._last_rows = (list(seqs), RowParams(params, self._row_generators(seqs),
                                                            self.device, None, self._shared))
        return last[1]

    def _row_generators(self, seqs: list[Sequence]) -> list[torch.Generator | None]:
        return [self.generators.get(s.request_id) for s in seqs]

    def logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> list:
        """Per row, the target's log-probabilities of tokens [B, P] under logits [B, P, V] (None: not asked)."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if not want:
            return out
        P, text = tokens.shape[1], self._token_texts
        rows = torch.tensor(want, device=logits.device)
        asked = {i: seqs[i].params.logprobs or 0 for i in want}
        chosen, ids, values = top_logprobs(logits[rows].flatten(0, 1), tokens[rows].flatten(), max(asked.values()))
        for r, i in enumerate(want):
            n = asked[i]
            out[i] = [TokenLogprob(t, text(t), chosen[r * P + j],
                                   [(a, text(a), v) for a, v in zip(ids[r * P + j][:n], values[r * P + j][:n])])
                      for j, t in enumerate(tokens[i].tolist())]
        return out

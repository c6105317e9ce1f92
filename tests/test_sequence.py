"""A request's tokens as the engine reads them."""
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.sequence import Sequence


def test_tokens_from_equals_slicing_every_token_id():
    seq = Sequence("r", [1, 2, 3, 4], SamplingParams())
    for output in ([], [5], [5, 6, 7]):
        seq.output_token_ids = list(output)
        ids = seq.prompt_token_ids + seq.output_token_ids
        for start in range(len(ids) + 1):
            assert seq.tokens_from(start) == ids[start:]
            for end in range(start, len(ids) + 1):
                assert seq.tokens_from(start, end) == ids[start:end]
        assert seq.last_token_id == ids[-1]

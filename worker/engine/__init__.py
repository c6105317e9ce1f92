"""Request in, tokens out: scheduling, speculative decoding, sampling, and sizing its own KV cache."""

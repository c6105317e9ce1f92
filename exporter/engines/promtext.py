"""A few series read out of an engine's Prometheus text, without parsing all of it.

An engine's /metrics is tens of KB, mostly histograms, and only a few of its series are read: their lines
are found with bytes.find (a tenth of the cost of splitting the text), and only those are parsed.
"""
from __future__ import annotations

import math
from functools import lru_cache

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vramledger.exporter.engines.bounds import OutOfBounds, shown

# The longest of those lines parsed (vLLM's config line is about 1 KB): the text parser reads a
# character at a time, so a megabyte label would cost the exporter seconds of CPU each scrape.
MAX_LINE = 16 << 10


def sample_lines(text: bytes, names: tuple[str, ...]) -> list[str]:
    """The sample lines of the named series in a Prometheus text, without splitting all of it."""
    text = b"\n" + text
    found = []
    for name in names:
        start_of = b"\n" + name.encode()
        start = text.find(start_of)
        while start >= 0:
            end = text.find(b"\n", start + 1)
            line = text[start + 1:None if end < 0 else end]
            if line[len(start_of) - 1:len(start_of)] in (b"{", b" "):  # not a longer name
                if len(line) > MAX_LINE:
                    raise OutOfBounds(f"a {name} line of {len(line)} bytes, beyond {MAX_LINE}")
                found.append(line.decode("utf-8", "replace"))
            start = text.find(start_of, start + 1)
    return found


@lru_cache(maxsize=1024)
def line_samples(line: str) -> tuple[Sample, ...]:
    """One sample line, parsed (raises ValueError where it is none); parsed once while unchanged."""
    return tuple(s for family in text_string_to_metric_families(line + "\n") for s in family.samples)


def samples(text: bytes, names: tuple[str, ...]) -> list[Sample]:
    """Every sample of the named series; raises OutOfBounds for a value that is no finite number."""
    found = [s for line in sample_lines(text, names) for s in line_samples(line)]
    for sample in found:
        if not math.isfinite(sample.value):
            raise OutOfBounds(f"{sample.name} {shown(sample.value)} is no finite number")
    return found

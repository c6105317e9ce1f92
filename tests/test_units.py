"""Sizes: one parser for every size flag of the worker and the exporter, one formatter for people."""
from __future__ import annotations

import argparse

import pytest

from vramledger.units import GiB, KiB, MiB, SizeError, format_bytes, parse_size


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * GiB), ("512MiB", 512 * MiB), ("512 kib", 512 * KiB), ("0.5GiB", GiB // 2), ("1073741824", GiB),
    (" 64 mi ", 64 * MiB), ("1.5G", 3 * GiB // 2), ("2k", 2 * KiB), ("64M", 64 * MiB),  # bare letters: 1024
    ("1GB", 10**9), ("100MB", 10**8), ("2kB", 2000), (4096, 4096)])  # with B: powers of 1000
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "2X", "-1G", "1.5", "1e9", "two GiB", -5])
def test_parse_size_errors(text):
    with pytest.raises(SizeError, match="size"):
        parse_size(text)
    assert issubclass(SizeError, ValueError) and issubclass(SizeError, argparse.ArgumentTypeError)


@pytest.mark.parametrize("n, text", [(None, "?"), (0, "0 B"), (512, "512 B"), (4 * KiB, "4.0 KiB"),
                                     (12.34 * MiB, "12.3 MiB"), (3 * GiB // 2, "1.50 GiB"), (-2 * MiB, "-2.0 MiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text

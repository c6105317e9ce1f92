"""One exporter watching an engine of each kind that cannot run here at once (fakes in their own shapes,
tests/fake_engines.py), over a fake NVML: each serves, each is given its own processes and none of
another's, and only the kinds that give bytes declare (so only they can have unaccounted memory)."""
from __future__ import annotations

from fake_engines import every_kind, of_engine, owned
from fake_pynvml import FakeGpu, GiB, proc
from test_exporter_host import spawn  # noqa: F401
from test_exporter_nvml import exporter, scrape

from vramledger.exporter.engines.fetch import HttpClient

DECLARING = {"sglang", "ollama"}  # the kinds that give bytes


def test_every_kind_at_once(monkeypatch, spawn, tmp_path):  # noqa: F811
    watched = every_kind(spawn, tmp_path)
    assert sorted(kind.name for kind, _ in watched) == ["llamacpp", "ollama", "sglang", "tgi", "triton"]
    # Each engine's child holds memory on a GPU of its own (a MIG node's slices, say).
    gpus = [FakeGpu(f"GPU-{i}", allocated=10 * GiB, processes=[proc(fake.children[0], kind.name, 9)])
            for i, (kind, fake) in enumerate(watched)]
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, gpus, {}, engines=[
        (lambda errors, kind=kind, fake=fake: kind.adapter(fake.url, client, errors, None)) for kind, fake in watched])
    values, errors = scrape(registry)
    for i, (kind, fake) in enumerate(watched):
        series = of_engine(values, fake.url)
        assert series[("up", ())] == 1, kind.name
        assert owned(values, fake.url) == {fake.children[0]: 9 * GiB}, kind.name
        assert series[("observed_memory_bytes", (("device", str(i)),))] == 9 * GiB
        declares = ("declared_memory_bytes", ()) in series
        assert declares == (kind.name in DECLARING), kind.name
        assert (("unaccounted_memory_bytes", (("device", str(i)),)) in series) == declares, kind.name
        assert errors[kind.source] == 0
    client.close()

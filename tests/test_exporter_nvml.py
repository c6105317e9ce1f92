"""The exporter over a fake NVML (no GPU here): every metric, exactly, in each scenario."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).parent))  # the fake library sits beside the tests
from fake_pynvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    FakeGpu,
    FakePynvml,
    GiB,
    NVMLError,
    proc,
)

from vramledger.exporter.collector import ExporterCollector
from vramledger.exporter.engines import Engines, Status, VramledgerEngine
from vramledger.exporter.engines.base import Unreachable
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.vramledger import worker_ledger
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import HostPidResolver
from vramledger.exporter.sources import HostSource, NvmlSource, SourceUnavailable, open_source

WORKER = "http://worker-0:8000"
NO_ERRORS = {"nvml": 0, "worker": 0, "exporter": 0}


def ledger_doc(pid: int, declared: int, container_id: str | None = None) -> dict:
    return {"version": 1, "worker": {"pid": pid, "host_pid": None, "container_id": container_id,
                                     "hostname": "gpu-7"},
            "device": {"kind": "cuda", "index": 0, "uuid": None, "name": "NVIDIA H100"},
            "declared_bytes": declared}


class LedgerEngine(VramledgerEngine):
    """Our adapter over a fixed ledger document, None = unreachable (its HTTP reads: over sockets)."""

    def __init__(self, url: str, doc: dict | None, errors: ErrorLog, resolver: HostPidResolver | None):
        super().__init__(url, HttpClient(1), errors, resolver)
        self.doc = doc

    def read(self):
        if self.doc is None:
            raise Unreachable(f"{self.url}: down")
        return self.state(worker_ledger(self.url, self.doc))


def exporter(monkeypatch, gpus, docs, max_processes=32, resolver=None, engines=()):
    fake = FakePynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    errors = ErrorLog()
    watched = [LedgerEngine(url, doc, errors, resolver) for url, doc in docs.items()]
    watched += [make(errors) for make in engines]
    registry = CollectorRegistry()
    registry.register(ExporterCollector(NvmlSource.open(errors), Engines(watched, errors), errors,
                                        max_processes=max_processes))
    return registry, fake


def scrape(registry) -> tuple[dict, dict]:
    """One scrape: ({(metric, labels): value} without the exporter's own health, {source: errors})."""
    return split_samples(registry.collect())


def split_samples(families) -> tuple[dict, dict]:
    """Metric families as ({(metric, labels): value} without the exporter's own health, {source: errors})."""
    values, errors = {}, {}
    for family in families:
        for s in family.samples:
            if s.name == "vramledger_exporter_errors_total":
                errors[s.labels["source"]] = s.value
            elif not s.name.startswith("vramledger_exporter_"):
                values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values, errors


def m(name: str, value: float, **labels) -> tuple:
    return ("vramledger_" + name, tuple(sorted(labels.items()))), value


def device(dev, uuid, total, used, reserved=None, foreign=None, unattributed=None):
    out = [m("device_memory_total_bytes", total, device=dev, uuid=uuid),
           m("device_memory_used_bytes", used, device=dev, uuid=uuid)]
    for name, value in (("memory_reserved", reserved), ("foreign_memory", foreign),
                        ("unattributed_memory", unattributed)):
        if value is not None:
            out.append(m(f"device_{name}_bytes", value, device=dev, uuid=uuid))
    return out


def process(dev, uuid, pid, name, value, engine=""):
    return [m("device_process_memory_bytes", value, device=dev, uuid=uuid, pid=str(pid), process=name,
              owner="engine" if engine else "foreign", engine=engine, measure="nvml")]


def state(url: str, now: str) -> list:
    """vramledger_engine_state: 1 for the engine's state, 0 for each other."""
    return [m("engine_state", int(s.value == now), engine=url, state=s.value) for s in Status]


def worker(url, declared, up=1, observed=None, kind="vramledger", version="", model="", kv=None):
    """A worker's series; declared None = declares nothing (then no unaccounted either)."""
    out = [m("engine_up", up, engine=url), *state(url, "serving" if up else "unreachable")]
    if up:
        out.append(m("engine_info", 1, engine=url, kind=kind, version=version, model=model))
    if up and declared is not None:
        out.append(m("engine_declared_memory_bytes", declared, engine=url))
    if up and kv is not None:
        out.append(m("engine_kv_cache_usage_ratio", kv, engine=url))
    for dev, value in (observed or {}).items():
        out.append(m("engine_observed_memory_bytes", value, engine=url, device=dev))
        if declared is not None:
            out.append(m("engine_unaccounted_memory_bytes", max(0, value - declared), engine=url, device=dev))
    return out


def test_foreign_process_beside_a_worker(monkeypatch):
    gpu = FakeGpu("GPU-0", allocated=30 * GiB, reserved=GiB // 2,
                  processes=[proc(4242, "python3", 20), proc(999, "trainer", 8)])
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 20 * GiB)})
    values, errors = scrape(registry)
    assert values == dict(device("0", "GPU-0", 80 * GiB, 30 * GiB, reserved=GiB // 2, foreign=8 * GiB,
                                 unattributed=2 * GiB)
                          + process("0", "GPU-0", 4242, "python3", 20 * GiB, engine=WORKER)
                          + process("0", "GPU-0", 999, "trainer", 8 * GiB)
                          + worker(WORKER, 20 * GiB, observed={"0": 20 * GiB}))
    assert errors == NO_ERRORS


def test_worker_using_more_than_it_declares(monkeypatch):
    gpu = FakeGpu("GPU-0", allocated=25 * GiB, processes=[proc(4242, "python3", 24)])
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 20 * GiB)})
    values, errors = scrape(registry)
    assert values == dict(device("0", "GPU-0", 80 * GiB, 25 * GiB, reserved=0, foreign=0, unattributed=GiB)
                          + process("0", "GPU-0", 4242, "python3", 24 * GiB, engine=WORKER)
                          + worker(WORKER, 20 * GiB, observed={"0": 24 * GiB}))
    assert values[m("engine_unaccounted_memory_bytes", 0, engine=WORKER, device="0")[0]] == 4 * GiB
    assert errors == NO_ERRORS


def test_used_gpu_memory_not_available_gives_no_made_up_numbers(monkeypatch):
    gpu = FakeGpu("GPU-0", allocated=30 * GiB,
                  processes=[proc(4242, "python3", None), proc(999, "trainer", None)])
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 20 * GiB)})
    values, errors = scrape(registry)
    # The processes are seen but not sized: no process, foreign, unattributed or observed series.
    assert values == dict(device("0", "GPU-0", 80 * GiB, 30 * GiB, reserved=0) + worker(WORKER, 20 * GiB))
    assert errors == NO_ERRORS


def test_foreign_usage_unknown_leaves_the_worker_observed(monkeypatch):
    gpu = FakeGpu("GPU-0", allocated=30 * GiB,
                  processes=[proc(4242, "python3", 21), proc(999, "trainer", None)])
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 20 * GiB)})
    values, _ = scrape(registry)
    assert values == dict(device("0", "GPU-0", 80 * GiB, 30 * GiB, reserved=0)
                          + process("0", "GPU-0", 4242, "python3", 21 * GiB, engine=WORKER)
                          + worker(WORKER, 20 * GiB, observed={"0": 21 * GiB}))


def test_gpu_lost_between_scrapes(monkeypatch, caplog):
    gpus = [FakeGpu("GPU-0", allocated=9 * GiB, processes=[proc(999, "trainer", 8)]),
            FakeGpu("GPU-1", allocated=21 * GiB, processes=[proc(4242, "python3", 20)])]
    registry, _ = exporter(monkeypatch, gpus, {WORKER: ledger_doc(4242, 20 * GiB)})
    gpu0 = (device("0", "GPU-0", 80 * GiB, 9 * GiB, reserved=0, foreign=8 * GiB, unattributed=GiB)
            + process("0", "GPU-0", 999, "trainer", 8 * GiB))
    values, errors = scrape(registry)
    assert values == dict(gpu0 + device("1", "GPU-1", 80 * GiB, 21 * GiB, reserved=0, foreign=0,
                                        unattributed=GiB)
                          + process("1", "GPU-1", 4242, "python3", 20 * GiB, engine=WORKER)
                          + worker(WORKER, 20 * GiB, observed={"1": 20 * GiB}))
    assert errors == NO_ERRORS

    gpus[1].lost = True
    with caplog.at_level(logging.WARNING):
        values, errors = scrape(registry)
        again, errors_again = scrape(registry)
    # GPU 1 and everything observed on it are gone; GPU 0 is untouched.
    assert values == again == dict(gpu0 + worker(WORKER, 20 * GiB))
    assert errors == NO_ERRORS | {"nvml": 1}
    assert errors_again == NO_ERRORS | {"nvml": 2}
    assert [r.getMessage() for r in caplog.records].count(
        "nvml error (NVMLError_GpuIsLost): GPU 1: GPU is lost [logged once]") == 1


@pytest.mark.parametrize("code, message", [(NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
                                           (NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
                                           (NVML_ERROR_NO_PERMISSION, "Insufficient Permissions")])
def test_nvml_absent(monkeypatch, caplog, code, message):
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvml([], init_error=code))
    with pytest.raises(SourceUnavailable, match=message):
        open_source("nvml", ErrorLog())
    with caplog.at_level(logging.WARNING):
        source = open_source("auto", ErrorLog())
    assert isinstance(source, HostSource)
    assert "falling back to the host reader" in caplog.text and message in caplog.text


def test_nvml_library_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(SourceUnavailable, match="nvidia-ml-py is not installed"):
        open_source("nvml", ErrorLog())
    assert isinstance(open_source("auto", ErrorLog()), HostSource)


def test_mig_instances_are_the_devices(monkeypatch):
    mig0 = FakeGpu("MIG-aaaa", total=40 * GiB, allocated=21 * GiB, processes=[proc(4242, "python3", 20)],
                   name="NVIDIA H100 MIG 3g.40gb")
    mig2 = FakeGpu("MIG-bbbb", total=20 * GiB, allocated=6 * GiB, processes=[proc(999, "trainer", 5)],
                   name="NVIDIA H100 MIG 2g.20gb")
    gpus = [FakeGpu("GPU-0", mig=[mig0, None, mig2, None, None, None, None]),
            FakeGpu("GPU-1", allocated=GiB)]
    registry, _ = exporter(monkeypatch, gpus, {WORKER: ledger_doc(4242, 19 * GiB)})
    values, errors = scrape(registry)
    # The MIG parent is not a device of its own: its memory is the instances' memory.
    assert values == dict(
        device("0/0", "MIG-aaaa", 40 * GiB, 21 * GiB, reserved=0, foreign=0, unattributed=GiB)
        + process("0/0", "MIG-aaaa", 4242, "python3", 20 * GiB, engine=WORKER)
        + device("0/2", "MIG-bbbb", 20 * GiB, 6 * GiB, reserved=0, foreign=5 * GiB, unattributed=GiB)
        + process("0/2", "MIG-bbbb", 999, "trainer", 5 * GiB)
        + device("1", "GPU-1", 80 * GiB, GiB, reserved=0, foreign=0, unattributed=GiB)
        + worker(WORKER, 19 * GiB, observed={"0/0": 20 * GiB}))
    assert errors == NO_ERRORS


def test_process_list_refused(monkeypatch):
    gpu = FakeGpu("GPU-0", allocated=30 * GiB, processes=[proc(4242, "python3", 20)],
                  process_error=NVML_ERROR_NO_PERMISSION)
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 20 * GiB)})
    values, errors = scrape(registry)
    assert values == dict(device("0", "GPU-0", 80 * GiB, 30 * GiB, reserved=0) + worker(WORKER, 20 * GiB))
    assert errors == NO_ERRORS | {"nvml": 1}


def test_driver_without_memory_v2_reports_no_reserved(monkeypatch):
    gpu = FakeGpu("GPU-0", allocated=29 * GiB, reserved=GiB, processes=[proc(4242, "python3", 20)],
                  memory_v2=False)
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 20 * GiB)})
    values, errors = scrape(registry)
    # v1 "used" includes the reserved memory, which the driver does not report apart.
    assert values == dict(device("0", "GPU-0", 80 * GiB, 30 * GiB, foreign=0, unattributed=10 * GiB)
                          + process("0", "GPU-0", 4242, "python3", 20 * GiB, engine=WORKER)
                          + worker(WORKER, 20 * GiB, observed={"0": 20 * GiB}))
    assert errors == NO_ERRORS | {"nvml": 1}
    assert scrape(registry)[1] == NO_ERRORS | {"nvml": 1}  # known unsupported: not asked again


def test_exited_process_series_disappear(monkeypatch):
    gpu = FakeGpu("GPU-0", allocated=30 * GiB, processes=[proc(4242, "python3", 20), proc(999, "trainer", 8)])
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 20 * GiB)})
    assert process("0", "GPU-0", 999, "trainer", 0)[0][0] in scrape(registry)[0]
    gpu.processes.pop()
    gpu.allocated = 22 * GiB
    values, _ = scrape(registry)
    assert values == dict(device("0", "GPU-0", 80 * GiB, 22 * GiB, reserved=0, foreign=0,
                                 unattributed=2 * GiB)
                          + process("0", "GPU-0", 4242, "python3", 20 * GiB, engine=WORKER)
                          + worker(WORKER, 20 * GiB, observed={"0": 20 * GiB}))


def test_process_series_are_capped_per_device(monkeypatch):
    foreign = [proc(1000 + i, f"job{i}", i + 1) for i in range(6)]  # 1..6 GiB
    gpu = FakeGpu("GPU-0", allocated=40 * GiB, processes=[proc(4242, "python3", 10)] + foreign)
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(4242, 10 * GiB)}, max_processes=3)
    values, _ = scrape(registry)
    assert values == dict(device("0", "GPU-0", 80 * GiB, 40 * GiB, reserved=0, foreign=21 * GiB,
                                 unattributed=9 * GiB)
                          + process("0", "GPU-0", 4242, "python3", 10 * GiB, engine=WORKER)
                          + process("0", "GPU-0", 1005, "job5", 6 * GiB)
                          + process("0", "GPU-0", 1004, "job4", 5 * GiB)
                          + process("0", "GPU-0", "other", "other", (1 + 2 + 3 + 4) * GiB)
                          + worker(WORKER, 10 * GiB, observed={"0": 10 * GiB}))


def test_worker_down_and_worker_in_a_container(monkeypatch, tmp_path):
    # A container worker knows only its own pid (7); the host pid namespace maps it to 31337.
    write_proc(tmp_path, 31337, nspid=(31337, 7), cgroup="0::/system.slice/docker-c0ffee1234.scope\n")
    write_proc(tmp_path, 555, nspid=(555, 7), cgroup="0::/system.slice/docker-0ther.scope\n")
    gpu = FakeGpu("GPU-0", allocated=30 * GiB,
                  processes=[proc(31337, "python3", 20), proc(555, "python3", 9)])
    down = "http://worker-1:8000"
    registry, _ = exporter(monkeypatch, [gpu], {WORKER: ledger_doc(7, 20 * GiB, container_id="c0ffee1234"),
                                                down: None},
                           resolver=HostPidResolver(tmp_path))
    values, errors = scrape(registry)
    assert values == dict(device("0", "GPU-0", 80 * GiB, 30 * GiB, reserved=0, foreign=9 * GiB,
                                 unattributed=GiB)
                          + process("0", "GPU-0", 31337, "python3", 20 * GiB, engine=WORKER)
                          + process("0", "GPU-0", 555, "python3", 9 * GiB)
                          + worker(WORKER, 20 * GiB, observed={"0": 20 * GiB})
                          + worker(down, 0, up=0))
    assert errors == NO_ERRORS


def write_proc(root: Path, pid: int, nspid: tuple[int, ...], cgroup: str) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "status").write_text(f"Name:\tpython3\nPid:\t{pid}\nNSpid:\t"
                                            + "\t".join(map(str, nspid)) + "\n")
    (root / str(pid) / "cgroup").write_text(cgroup)


def test_the_fake_matches_the_real_library():
    import pynvml  # the real nvidia-ml-py: importable without a GPU, its calls fail without a driver

    fake = FakePynvml([])
    names = [n for n in dir(FakePynvml) if n.startswith(("nvml", "NVML"))]
    assert {"nvmlInit", "nvmlDeviceGetComputeRunningProcesses", "NVMLError"} <= set(names)
    for name in names:
        real = getattr(pynvml, name)
        if isinstance(real, int):
            assert getattr(fake, name) == real, name
        else:
            assert callable(real), name
    assert pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST).__class__.__name__ == "NVMLError_GpuIsLost"
    assert str(pynvml.NVMLError_GpuIsLost()) == "GPU is lost" == str(NVMLError(NVML_ERROR_GPU_IS_LOST))

"""The C kernels are compiled once per source into the cache, and where they cannot be built or run
the worker says why and keeps torch's ops."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from vramledger.worker.kernels import native


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> tuple[Path, list[Path]]:
    """Every kernel built for both instruction sets, as an image ships them: once for the module, since
    these compiles are most of its time and two tests read the same libraries."""
    if not shutil.which("cc") or native.isa() is None:
        pytest.skip("no C compiler, or not an x86 CPU with AVX2")
    into = tmp_path_factory.mktemp("prebuilt")
    return into, native.build_all(into)


@pytest.fixture
def fresh_loads():
    native.load.cache_clear()
    yield
    native.load.cache_clear()


def test_the_kernel_loads_wherever_it_can_run():
    can_run = native.isa() is not None and shutil.which("cc")
    assert (native.load("blocked_linear") is not None) == bool(can_run)


def test_a_library_is_built_once_per_source_and_reused(tmp_path):
    if not shutil.which("cc"):
        pytest.skip("no C compiler")
    first = native.build(native.HERE / "blocked_linear.c", into=tmp_path)
    built_at = first.stat().st_mtime_ns
    assert native.build(native.HERE / "blocked_linear.c", into=tmp_path) == first
    assert first.stat().st_mtime_ns == built_at
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left behind


def test_a_changed_source_gets_a_library_of_its_own(tmp_path):
    if not shutil.which("cc"):
        pytest.skip("no C compiler")
    source = tmp_path / "k.c"
    source.write_text("int k(void) { return 1; }\n")
    one = native.build(source, into=tmp_path / "cache")
    source.write_text("int k(void) { return 2; }\n")
    assert native.build(source, into=tmp_path / "cache") != one


def test_a_changed_header_beside_the_source_gets_a_library_of_its_own(tmp_path):
    if not shutil.which("cc"):
        pytest.skip("no C compiler")
    source, header = tmp_path / "k.c", tmp_path / "k.h"
    source.write_text('#include "k.h"\nint k(void) { return K; }\n')
    header.write_text("#define K 1\n")
    one = native.build(source, into=tmp_path / "cache")
    header.write_text("#define K 2\n")
    assert native.build(source, into=tmp_path / "cache") != one


def test_every_kernel_also_builds_for_the_instruction_set_this_cpu_does_not_use(prebuilt):
    """The tests run each kernel as built for this CPU; the other build must not rot unseen."""
    into, built = prebuilt
    other = next(name for name in native.ISA_FLAGS if name != native.isa())
    for source in sorted(native.HERE.glob("*.c")):
        library = into / native.library_name(source, other)
        assert library in built and library.stat().st_size > 0


def test_without_a_compiler_torch_ops_run_and_the_log_says_why(monkeypatch, tmp_path, caplog, fresh_loads):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load("blocked_linear") is None
    assert "blocked_linear kernel could not be built" in caplog.text
    assert not list((tmp_path / "vramledger" / "kernels").iterdir())  # the failed build left nothing


def test_without_avx512_or_avx2_nothing_is_built(monkeypatch, fresh_loads):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(native, "build", lambda *a, **k: pytest.fail("built for a CPU that cannot run it"))
    assert native.load("blocked_linear") is None
    assert native.function("blocked_linear", "blocked_linear") is None


def test_prebuilt_kernels_load_where_no_compiler_runs(monkeypatch, tmp_path, fresh_loads, prebuilt):
    """An image ships every kernel built for both instruction sets; at run time nothing compiles."""
    into, built = prebuilt
    assert len(set(built)) == len(list(native.HERE.glob("*.c"))) * len(native.ISA_FLAGS)
    assert all(library.parent == into and library.is_file() for library in built)
    monkeypatch.setenv(native.PREBUILT_ENV, str(into))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "build", lambda *a, **k: pytest.fail("compiled although a prebuilt library exists"))
    assert native.load("blocked_linear") is not None
    assert not (tmp_path / "cache").exists()

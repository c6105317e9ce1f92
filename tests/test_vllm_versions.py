"""Each vLLM version the plugin supports against its own sources: every name its module of
vramledger/vllm_plugin/versions/ declares is there, written as declared.

0.32's sources are the vLLM venv's (its CPU build, the one the end-to-end tests run). 0.33.0 exists
only as a CUDA build, which cannot be imported here: its wheel is fetched once with pip (pinned by
hash, about 340 MB, kept under $XDG_CACHE_HOME/vramledger/vllm-wheels) and read, not installed.
Either test is skipped, saying why, where its sources cannot be had.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from vllm_sources import Sources, check

from vramledger.vllm_plugin.gate import unsupported_reason
from vramledger.vllm_plugin.versions import MODULES, names_for
from vramledger.vllm_plugin.versions.source import Attributes, Function, Imported

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402

# Versions read from a wheel: the release checked, and its wheel's sha256 (pip refuses any other file).
WHEELS = {"0.33": ("0.33.0", "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa")}
FROM_VENV = {"0.32"}  # the vLLM venv's build: the version its tests run


def wheel_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vramledger" / "vllm-wheels"


def wheel(release: str, sha256: str) -> Path:
    """vLLM's wheel for one release, downloaded once (pip checks the hash of one already there)."""
    cache = wheel_cache()
    cache.mkdir(parents=True, exist_ok=True)
    requirement = cache / f"vllm-{release}.txt"
    requirement.write_text(f"vllm=={release} --hash=sha256:{sha256}\n")
    # The Linux x86-64 build whatever this machine is: only its Python sources are read.
    pip = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                          "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
                          "--implementation", "cp", "--require-hashes", "-r", str(requirement), "-d", str(cache)],
                         capture_output=True, text=True, timeout=1800)
    found = sorted(cache.glob(f"vllm-{release}-*.whl"))
    if pip.returncode != 0 or not found:
        pytest.skip(f"vLLM {release}'s wheel could not be downloaded (no package registry reachable?): "
                    f"{pip.stderr.strip()[-500:]}")
    return found[0]


def venv_sources() -> Path:
    python = vllm_peer.vllm_python()
    if python is None:
        pytest.skip("no vLLM venv (VLLM_VENV or .venv-vllm): run `make vllm-venv`")
    found = subprocess.run([str(python), "-I", "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm').submodule_search_locations[0])"],
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    return Path(found.stdout.strip()).parent


def test_every_supported_version_has_sources_to_be_checked_against():
    assert set(MODULES) == set(WHEELS) | FROM_VENV


@pytest.mark.parametrize("version", sorted(MODULES))
def test_the_names_a_version_hooks_are_in_its_sources(version):
    sources = Sources(wheel(*WHEELS[version]) if version in WHEELS else venv_sources())
    release = sources.version()
    assert release.startswith(version + "."), release
    names = names_for(release)
    assert names is not None and names.version == version
    assert check(names, sources) == []


@pytest.mark.parametrize("version", sorted(MODULES))
def test_what_the_hooks_reach_is_among_the_names_checked(version):
    # The hooks look these up by name: each must be one the sources check above covers.
    names = names_for(version + ".0")
    assert names is not None
    functions = {(d.module, d.qualname) for d in names.source if isinstance(d, Function)}
    imported = {(d.module, d.name) for d in names.source if isinstance(d, Imported)}
    attributes = {(d.module, d.cls, n) for d in names.source if isinstance(d, Attributes) for n in d.names}
    assert (names.worker_base[0], f"{names.worker_base[1]}.__init__") in functions
    for method in (names.init_device, names.size_kv_cache, names.allocate_kv_cache):
        assert (names.gpu_worker, f"Worker.{method}") in functions
    assert {(names.gpu_worker, names.start_snapshot), (names.gpu_worker, names.profile)} <= imported
    assert {m for m, q in functions if q == f"GPUModelRunner.{names.capture}"} == {
        "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"}  # both model runners
    assert {(names.cpu_memory, f) for f in ("get_memory_node_info", "get_allowed_cpu_list")} <= functions
    result = {n for m, c, n in attributes if c == "MemoryProfilingResult"}
    assert {"total_consumed", "non_torch_increase", "transient_peak_headroom", "non_kv_cache_memory"} <= result


def test_only_the_supported_versions_pass_the_gate():
    for version in MODULES:
        assert unsupported_reason(f"{version}.1+cpu") is None
    reason = unsupported_reason("0.99.0")
    assert reason is not None and all(f"{v}.x" in reason for v in MODULES)
    assert names_for("0.99.0") is None


def test_profile_only_captures_are_told_apart():
    # vllm/v1/worker/gpu/cudagraph_utils.py: the graph estimate calls capture_model(profile_only=True).
    for version in MODULES:
        names = names_for(version + ".0")
        assert names is not None
        assert names.profile_only((), {"profile_only": True})
        assert not names.profile_only((), {}) and not names.profile_only((), {"profile_only": False})


@pytest.fixture
def fake_vllm(tmp_path) -> Sources:
    """A two-module stand-in for vLLM's sources, to see the check refuse what moved."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "util.py").write_text("def helper(a, b=1):\n    pass\n")
    (tmp_path / "vllm" / "worker.py").write_text(
        "from .util import helper\n"
        "class Result:\n    kept: int = 0\n    def __post_init__(self):\n        self.after = 1\n"
        "class W:\n    def run(self, *, only: bool=False):\n        pass\n")
    return Sources(tmp_path)


@pytest.mark.parametrize("declared, problem", [
    (Function("vllm.worker", "W.run", "(self, *, only: bool=False)"), None),
    (Function("vllm.worker", "W.run", "(self)"), "its parameters are (self, *, only: bool=False)"),
    (Function("vllm.worker", "W.gone", "(self)"), "no such function"),
    (Function("vllm.elsewhere", "f", "()"), "no module vllm.elsewhere"),
    (Attributes("vllm.worker", "Result", ("kept", "after")), None),
    (Attributes("vllm.worker", "Result", ("kept", "non_torch_memory")), "lacks ['non_torch_memory']"),
    (Imported("vllm.worker", "helper", "vllm.util"), None),
    (Imported("vllm.worker", "helper", "vllm.other"), "not imported there"),
])
def test_the_check_refuses_a_name_that_moved(fake_vllm, declared, problem):
    names = names_for("0.32.0")
    assert names is not None
    problems = check(replace(names, source=(declared,)), fake_vllm)
    assert problems == ([] if problem is None else [f"{declared}: {problem}"])

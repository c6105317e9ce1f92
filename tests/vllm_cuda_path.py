"""vLLM's CUDA worker (vllm/v1/worker/gpu_worker.py Worker) started here on a faked device, with the plugin.

    PYTHONPATH=.:tests <vLLM venv>/bin/python tests/vllm_cuda_path.py SCENARIO [--utilization U]
                                                                        [--peer DIR --slot 0|1]

No GPU here, so the device is faked, and only the device: torch.accelerator's memory calls, the
platform's "is this CUDA" answers, the kernel warm-up and NVML (tests/fake_pynvml.py) all act on
FakeCuda, a device shared by this process and a neighbour. The model runner is a stand-in for vLLM's
GPU runner that does its device work as allocations on FakeCuda (it loads the models, runs the
profile step, allocates the KV cache, captures graphs). Between them runs vLLM's own worker code:
Worker.__init__, init_device (the CUDA branch), load_model, determine_available_memory (its start
snapshot, request_memory, memory_profiling and the budget arithmetic), initialize_from_config and
compile_or_warm_up_model.
Prints {"ledger": <the rank's ledger>, "device": <what FakeCuda saw>, "ledger_before_capture": <the
ledger once the KV cache exists, before the graph capture>, ...} as JSON.
The tests run it through tests/vllm_fork_server.py: the same, in a child forked once vLLM is imported.

Scenarios (VRAMLEDGER_VLLM_SIZING in the environment picks the plugin's sizing):
- "alone": nothing else moves on the device while vLLM starts;
- "neighbour": another process allocates 256 MiB during vLLM's profile run (vLLM's arithmetic
  counts it as its own non-torch memory);
- "neighbour_frees": another process frees 256 MiB during the profile run (vLLM's check that free
  memory did not grow);
- "unseen": as "neighbour", but NVML lists this process under a pid it does not know as its own
  (another pid namespace);
- "draft_after_profile": the draft loads only after vLLM sized its KV cache: its weights are
  outside the budget, as in vLLM V0;
- "v2_runner": as "alone", with the stand-in runner estimating graph memory as vLLM's V2 runner
  does (vllm/v1/worker/gpu/cudagraph_utils.py: a capture_model(profile_only=True) whose graphs are
  thrown away); the other scenarios' runner estimates as the V1 runner, without capture_model;
- "pair": one of two vLLM instances on one 8 GiB device, started at the same moment: the other is
  a second process of this script (--peer DIR, the directory they share; --slot, which one this
  is). Each publishes its memory there, so each one's free memory and NVML see the other's, and
  they wait for each other at each start-up step, so their profile runs overlap: both hold their
  activation peaks at once, and neither measures after its profile before both have run theirs
  nor allocates its KV cache before both have measured. "pair_alone": the same device, no peer.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fake_pynvml import FakeGpu, FakeProcess, FakePynvml
from torch import nn

MiB, GiB = 1 << 20, 1 << 30
NEIGHBOUR_PID = 999_999
ELSEWHERE_PID = 4_000_001  # this process as NVML lists it from another pid namespace: not a pid it knows
PEER_WAIT_S = 300.0
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "assets")
TARGET, DRAFT = os.path.join(ASSETS, "tiny-coder-target"), os.path.join(ASSETS, "tiny-coder-draft")
os.environ["VLLM_NO_USAGE_STATS"] = "1"  # its report reads the (absent) GPU's properties


class Peer:
    """The other instance of a pair, through a directory both share: what it holds, and meeting points."""

    def __init__(self, directory: str, slot: int):
        self.dir, self.slot = Path(directory), slot

    def publish(self, held: int) -> None:
        path, staged = self.dir / f"held.{self.slot}", self.dir / f"held.{self.slot}.tmp"
        staged.write_text(f"{os.getpid()} {held}")
        staged.replace(path)  # whole, never half-written

    def held(self) -> tuple[int, int]:
        """(pid, bytes) the other instance holds on the device; (0, 0) before it has a context."""
        try:
            pid, held = (self.dir / f"held.{1 - self.slot}").read_text().split()
        except FileNotFoundError:
            return 0, 0
        return int(pid), int(held)

    def meet(self, step: str) -> None:
        """Wait here until the other instance reaches the same step."""
        (self.dir / f"{step}.{self.slot}").touch()
        deadline = time.monotonic() + PEER_WAIT_S
        while not (self.dir / f"{step}.{1 - self.slot}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other instance did not reach {step!r}")
            time.sleep(0.01)


@dataclass
class FakeCuda:
    """One device: this process's CUDA context, torch's allocator and other memory, a neighbour's, and
    (in a pair) the other instance's."""

    total: int = 4 * GiB
    neighbour: int = 512 * MiB
    context: int = 0  # created when the process selects the device
    torch_allocated: int = 0
    torch_reserved: int = 0
    torch_peak: int = 0
    non_torch: int = 0  # this process's, outside torch's allocator (cuBLAS workspaces, NCCL)
    peer: Peer | None = field(default=None, repr=False)
    meet_after_empty: str | None = None  # the pair's meeting point at the next empty_cache

    def ours(self) -> int:
        return self.context + self.torch_reserved + self.non_torch

    def others(self) -> int:
        return self.neighbour + (self.peer.held()[1] if self.peer else 0)

    def free(self) -> int:
        return self.total - self.others() - self.ours()

    def moved(self) -> None:  # the other instance reads what this one holds
        if self.peer is not None:
            self.peer.publish(self.ours())

    def create_context(self) -> None:
        self.context = 300 * MiB
        self.moved()
        if self.peer is not None:
            self.peer.meet("contexts")  # both contexts exist before either takes its start snapshot

    def allocate(self, nbytes: int) -> None:
        self.torch_allocated += nbytes
        self.torch_reserved = max(self.torch_reserved, self.torch_allocated)
        self.torch_peak = max(self.torch_peak, self.torch_allocated)
        self.moved()

    def release(self, nbytes: int) -> None:  # the allocator keeps it cached until empty_cache
        self.torch_allocated -= nbytes

    def empty_cache(self) -> None:
        self.torch_reserved = self.torch_allocated
        self.moved()
        if self.meet_after_empty is not None and self.peer is not None:
            step, self.meet_after_empty = self.meet_after_empty, None
            self.peer.meet(step)


def fake_the_device(cuda: FakeCuda, nvml_sees_pid: bool = True) -> None:
    """torch.accelerator, the platform's CUDA answers and NVML, all reading cuda."""
    from vllm.platforms import current_platform
    from vllm.v1.worker import gpu_worker

    acc = torch.accelerator
    acc.get_memory_info = lambda device=None: (cuda.free(), cuda.total)
    acc.memory_stats = lambda device=None: {"allocated_bytes.all.peak": cuda.torch_peak,
                                            "allocated_bytes.all.current": cuda.torch_allocated}
    acc.memory_reserved = lambda device=None: cuda.torch_reserved
    acc.empty_cache = cuda.empty_cache
    acc.reset_peak_memory_stats = lambda device=None: setattr(cuda, "torch_peak", cuda.torch_allocated)
    acc.synchronize = lambda device=None: None
    acc.device_count = lambda: 1
    acc.set_device_index = lambda device: cuda.create_context()
    torch.cuda.memory.get_allocator_backend = lambda: "cudaMallocAsync"  # no split settings to scope
    # The kernel warm-up is device work too (and its imports need torchvision, which vLLM's CPU venv lacks).
    gpu_worker.kernel_warmup = lambda worker, **kwargs: None
    platform = type(current_platform)
    platform.is_cuda_alike = lambda self=None: True
    platform.is_integrated_gpu = lambda self=None, index=None: False
    platform.logical_device_id_to_visible_device_id = lambda self=None, index=0: index
    platform.check_if_supports_dtype = lambda self=None, dtype=None: None

    class Nvml(FakePynvml):
        def nvmlDeviceGetComputeRunningProcesses(self, handle):
            handle.processes = [FakeProcess(os.getpid() if nvml_sees_pid else ELSEWHERE_PID, "python", cuda.ours()),
                                FakeProcess(NEIGHBOUR_PID, "neighbour", cuda.neighbour)]
            peer_pid, peer_held = cuda.peer.held() if cuda.peer is not None else (0, 0)
            if peer_pid:
                handle.processes.append(FakeProcess(peer_pid, "python", peer_held))
            return super().nvmlDeviceGetComputeRunningProcesses(handle)

    sys.modules["pynvml"] = Nvml([FakeGpu("GPU-fake", total=cuda.total)])


class StandInRunner:
    """A GPU model runner's device work, done as allocations on FakeCuda; vLLM's Worker drives it."""

    is_pooling_model = False
    lora_config = None

    def __init__(self, cuda: FakeCuda, draft_after_profile: bool, neighbour_growth: int, v2: bool = False):
        self.cuda, self.draft_after_profile, self.v2 = cuda, draft_after_profile, v2
        self.neighbour_growth = neighbour_growth
        self.model = self.draft = None
        self.kv_caches: list[torch.Tensor] = []

    def _load(self, nbytes: int) -> nn.Module:
        model = nn.Linear(nbytes // 4096, 1024, bias=False)  # float32: nbytes of weights
        self.cuda.allocate(nbytes)
        return model

    def _meet(self, step: str) -> None:
        if self.cuda.peer is not None:
            self.cuda.peer.meet(step)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        self._meet("snapshots")  # both took their start snapshot before either loads
        self.model = self._load(8 * MiB)
        if not self.draft_after_profile:
            self.draft = self._load(2 * MiB)
        self.model_memory_usage = self.cuda.torch_allocated

    def get_model(self) -> nn.Module:
        return self.model

    def get_draft_model(self) -> nn.Module | None:
        return self.draft

    def profile_run(self, randomize_inputs: bool = False) -> None:
        self.cuda.allocate(64 * MiB)  # the largest step's activations
        self.cuda.non_torch += 32 * MiB  # cuBLAS workspaces, created on the first matmul
        self.cuda.moved()
        self._meet("peaks")  # both hold their activation peaks at once
        self.cuda.release(64 * MiB)
        self.cuda.neighbour += self.neighbour_growth  # another process allocates (or frees) meanwhile
        self.cuda.meet_after_empty = "profiled"  # neither measures before both emptied their caches

    def initialize_kv_cache(self, kv_cache_config, kv_cache_allocation_context=None) -> None:
        self._meet("measured")  # both measured after their profile runs before either allocates
        for tensor in kv_cache_config.kv_cache_tensors:
            self.kv_caches.append(torch.empty(tensor.size, dtype=torch.uint8))  # untouched: no host RSS
            self.cuda.allocate(tensor.size)
        if self.draft_after_profile:
            self.draft = self._load(2 * MiB)

    def profile_cudagraph_memory(self) -> int:
        if self.v2:
            measured = self.capture_model(profile_only=True)
        else:
            free = self.cuda.free()
            self.cuda.allocate(16 * MiB)  # graphs captured into a pool, measured, then released
            measured = free - self.cuda.free()
        self.cuda.release(16 * MiB)
        self.cuda.empty_cache()
        return measured

    def capture_model(self, *, profile_only: bool = False) -> int:
        free = self.cuda.free()
        self.cuda.allocate(16 * MiB)  # the graph pool, kept unless only measuring
        return free - self.cuda.free()

    def _dummy_run(self, num_tokens: int, **kwargs):
        return None, None

    def _dummy_sampler_run(self, hidden_states) -> None:
        pass

    def maybe_remove_all_loras(self, lora_config) -> None:
        pass


def kv_cache_config(available: int):
    """The engine core's answer to the worker's available memory: as many 16-token blocks as fit."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=32, dtype=torch.float32)
    page = spec.page_size_bytes
    blocks = available // page
    size = blocks * page
    tensor = KVCacheTensor(size=size, layers=["layers.0"], layer_stride=size, block_stride=page)
    return KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)])


# scenario: (device total, neighbour at start, neighbour's growth during the profile, NVML sees our pid)
SCENARIOS = {
    "alone": (4 * GiB, 512 * MiB, 0, True),
    "neighbour": (4 * GiB, 512 * MiB, 256 * MiB, True),
    "neighbour_frees": (4 * GiB, 512 * MiB, -256 * MiB, True),
    "unseen": (4 * GiB, 512 * MiB, 256 * MiB, False),
    "draft_after_profile": (4 * GiB, 512 * MiB, 0, True),
    "v2_runner": (4 * GiB, 512 * MiB, 0, True),
    "pair": (8 * GiB, 0, 0, True),
    "pair_alone": (8 * GiB, 0, 0, True),
}


def run(scenario: str, utilization: float = 0.5, peer: Peer | None = None) -> dict:
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_worker import Worker

    from vramledger.vllm_plugin.hooks import RPC_METHOD, install

    total, neighbour, growth, sees_pid = SCENARIOS[scenario]
    cuda = FakeCuda(total=total, neighbour=neighbour, peer=peer)
    fake_the_device(cuda, nvml_sees_pid=sees_pid)
    install()  # what the general plugin does when VLLM_PLUGINS names it
    speculative = {"model": DRAFT, "num_speculative_tokens": 4, "method": "draft_model"}
    paired = scenario.startswith("pair")  # eager: the graph estimate reads free memory too, the pair's
    config = EngineArgs(model=TARGET, dtype="float32", max_model_len=256, gpu_memory_utilization=utilization,
                        speculative_config=speculative, enforce_eager=paired).create_engine_config()
    config.device_config.device_type = "cuda"
    if not paired:
        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL  # graphs, estimated in the budget
    config.kernel_config.enable_jit_warmup = False

    class FakeDeviceWorker(Worker):
        def _make_model_runner(self):
            return StandInRunner(cuda, scenario == "draft_after_profile", neighbour_growth=growth,
                                 v2=scenario == "v2_runner")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):  # as vLLM's WorkerWrapperBase calls its worker
        worker = FakeDeviceWorker(vllm_config=config, local_rank=0, rank=0,
                                  distributed_init_method=f"tcp://127.0.0.1:{port}", is_driver_worker=True)
        worker.init_device()
        worker.load_model()
        available = worker.determine_available_memory()
        worker.initialize_from_config(kv_cache_config(available))
        before_capture = getattr(worker, RPC_METHOD)()
        worker.compile_or_warm_up_model()
    return {"ledger": getattr(worker, RPC_METHOD)(), "ledger_before_capture": before_capture, "device": {k: v for k, v in vars(cuda).items() if k != "peer"}, "available": available,
            "requested_memory": worker.requested_memory}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--utilization", type=float, default=0.5)
    parser.add_argument("--peer", help="the directory a pair shares")
    parser.add_argument("--slot", type=int, choices=(0, 1), default=0)
    args = parser.parse_args(argv)
    peer = Peer(args.peer, args.slot) if args.peer else None
    print(json.dumps(run(args.scenario, args.utilization, peer)))  # the last line of stdout (vLLM logs there too)


if __name__ == "__main__":
    main(sys.argv[1:])

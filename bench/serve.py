"""Serving benchmark: our worker against `transformers serve` on the same target model, in one run.

    python bench/serve.py [--model DIR] [--draft-model DIR] [--clients 16] [--tokens 128] [--rounds 3]

Part 1, throughput: N concurrent streaming clients, fixed prompts, greedy, T tokens each, against
our server with and without the draft model and `transformers serve` with and without
--continuous-batching. Prints output tokens/s and TTFT p50/p99 per peer and ours / best transformers.
Target: ours at least 2x the best transformers figure.

Part 2, the cost of observing: the same load against two of our servers (draft on), one with metrics
on and scraped every 0.1 s, one with VRAMLEDGER_METRICS=off, rounds alternating. Prints the
throughput ratio (target >= 0.99), the same ratio in tokens per CPU-second of the server process
(robust when other processes share the CPU) and the p99 latency of /metrics under that load.
Ratios, never timed assertions: both sides are measured in the same run on the same machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from local_stack import free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "worker" / "assets"
PROMPTS = [f"def {name}:\n" for name in (
    "fibonacci(n)", "is_prime(n)", "reverse_string(s)", "merge_sorted(a, b)", "binary_search(xs, x)",
    "flatten(nested)", "word_count(text)", "gcd(a, b)", "transpose(matrix)", "parse_csv_line(line)",
    "moving_average(xs, k)", "unique(items)", "to_snake_case(name)", "factorial(n)", "chunks(xs, n)",
    "read_lines(path)")]


@dataclass
class Round:
    """One load round: tokens generated, wall time and each request's time to first token."""

    tokens: int
    seconds: float
    ttfts: list[float]
    cpu_seconds: float = 0.0  # the server process's CPU time during the round, where measured

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Peer:
    """One server under test: how to start it and what its requests carry."""

    name: str
    command: list[str]
    extra: dict  # request fields that make it generate exactly T tokens greedily
    env: dict = field(default_factory=dict)
    model: str = ""
    port: int = 0
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, logdir: Path) -> None:
        self.log = logdir / f"{self.name.replace(' ', '_')}.log"
        with open(self.log, "w") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen([*self.command, "--port", str(self.port)], cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, env={**os.environ, **self.env})

    def wait_ready(self, timeout: float = 300) -> None:
        try:
            wait_http(self.url + "/health", timeout, self.process)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{self.name}: {exc}: {self.log.read_text()[-1500:]}") from exc

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()


# --- load ------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, peer: Peer, prompt: str, tokens: int) -> tuple[float, int]:
    """Stream one completion; return (time to first token, completion tokens)."""
    body = {"model": peer.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **peer.extra}
    sent, ttft, usage = time.perf_counter(), None, None
    async with client.stream("POST", peer.url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if ttft is None and doc.get("choices"):
                ttft = time.perf_counter() - sent
            usage = doc.get("usage") or usage
    return ttft, usage["completion_tokens"]


async def load_round(peer: Peer, clients: int, tokens: int) -> Round:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
    server = psutil.Process(peer.process.pid)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        start, cpu = time.perf_counter(), sum(server.cpu_times()[:2])
        results = await asyncio.gather(*(one_request(client, peer, p, tokens) for p in prompts))
        seconds, cpu = time.perf_counter() - start, sum(server.cpu_times()[:2]) - cpu
    return Round(sum(n for _, n in results), seconds, [t for t, _ in results], cpu)


async def scrape_while(peer: Peer, work, interval: float = 0.1) -> tuple[Round, list[float]]:
    """Run `work` while scraping /metrics every `interval` s; return its result and the scrape latencies."""
    latencies: list[float] = []
    done = asyncio.Event()

    async def scraper():
        async with httpx.AsyncClient(timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                (await client.get(peer.url + "/metrics")).raise_for_status()
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(interval)

    task = asyncio.create_task(scraper())
    try:
        result = await work
    finally:
        done.set()
        await task
    return result, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# --- peers -----------------------------------------------------------------------------------
def our_peer(name: str, args, draft: bool, metrics: bool = True) -> Peer:
    command = [sys.executable, "-m", "worker", "serve", "--model", args.model, "--device", args.device,
               "--max-num-seqs", str(args.clients), "--log-level", "warning"]
    command += ["--draft-model", args.draft_model] if draft else ["--no-draft"]
    return Peer(name, command, {"ignore_eos": True}, env={} if metrics else {"VRAMLEDGER_METRICS": "off"},
                model=Path(args.model).name)


def transformers_peer(name: str, args, continuous_batching: bool) -> Peer | str:
    """A `transformers serve` peer, or why it cannot run here."""
    cli = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if cli is None:
        return "the `transformers` command is not installed"
    try:
        import accelerate  # noqa: F401 - transformers serve loads models with a device_map
    except ImportError:
        return "`transformers serve` needs the accelerate package (pip install accelerate)"
    device = args.device if args.device != "auto" else ("cuda" if _cuda() else "cpu")
    command = [cli, "serve", args.model, "--host", "127.0.0.1", "--log-level", "warning", "--device", device]
    command.append("--continuous-batching" if continuous_batching else "--no-continuous-batching")
    # min_new_tokens: transformers has no ignore_eos; this keeps it from stopping before T tokens.
    config = json.dumps({"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "do_sample": False})
    return Peer(name, command, {"generation_config": config}, env={"HF_HUB_OFFLINE": "1"}, model=args.model)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def measure(peer: Peer, args, logdir: Path) -> list[Round] | str:
    """Start a peer, warm it up, run the rounds, stop it; a failure is reported, not raised."""
    peer.port = free_port()
    try:
        peer.start(logdir)
        peer.wait_ready()
        asyncio.run(load_round(peer, 2, 8))  # warm-up: first-request costs are not throughput
        return [asyncio.run(load_round(peer, args.clients, args.tokens)) for _ in range(args.rounds)]
    except Exception as exc:  # noqa: BLE001 - one peer failing must not hide the others
        return f"failed: {exc}"
    finally:
        peer.stop()


def observing_cost(args, logdir: Path) -> dict | str:
    """Alternate rounds against a metrics-on (scraped) and a metrics-off server, both with the draft."""
    on, off = our_peer("metrics on", args, draft=True), our_peer("metrics off", args, draft=True, metrics=False)
    try:
        for peer in (on, off):
            peer.port = free_port()
            peer.start(logdir)
        for peer in (on, off):
            peer.wait_ready()
            asyncio.run(load_round(peer, 2, 8))
        on_rounds, off_rounds, scrapes = [], [], []
        for i in range(2 * args.rounds):
            if (i + i // 2) % 2 == 0:  # on, off, off, on, on, off, ...: neither side always goes first
                result, latencies = asyncio.run(scrape_while(on, load_round(on, args.clients, args.tokens)))
                on_rounds.append(result)
                scrapes += latencies
            else:
                off_rounds.append(asyncio.run(load_round(off, args.clients, args.tokens)))
        return {"on": statistics.median(r.tokens_per_s for r in on_rounds),
                "off": statistics.median(r.tokens_per_s for r in off_rounds),
                "on_cpu": statistics.median(r.tokens / r.cpu_seconds for r in on_rounds),
                "off_cpu": statistics.median(r.tokens / r.cpu_seconds for r in off_rounds),
                "scrape_p99": percentile(scrapes, 99), "scrapes": len(scrapes)}
    except Exception as exc:  # noqa: BLE001
        return f"failed: {exc}"
    finally:
        on.stop()
        off.stop()


# --- report ----------------------------------------------------------------------------------
def summarize(rounds: list[Round]) -> dict:
    ttfts = [t for r in rounds for t in r.ttfts]
    return {"tokens_per_s": statistics.median(r.tokens_per_s for r in rounds),
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "tokens": rounds[0].tokens}


def print_report(results: dict[str, dict | str], observing: dict | str, args) -> None:
    print(f"\n{args.clients} concurrent streaming clients x {args.tokens} tokens, greedy, "
          f"median of {args.rounds} rounds; model {args.model}")
    print(f"{'peer':<34} {'output tok/s':>12} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'tokens':>7}")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:<34} {'n/a':>12} {'n/a':>11} {'n/a':>11}   ({r})")
        else:
            print(f"{name:<34} {r['tokens_per_s']:>12.1f} {r['ttft_p50']:>11.3f} {r['ttft_p99']:>11.3f} "
                  f"{r['tokens']:>7}")
    theirs = [r for name, r in results.items() if name.startswith("transformers") and isinstance(r, dict)]
    print("\nratios against the best transformers figure (throughput: higher is better, target >= 2.0; "
          "TTFT: theirs / ours, higher is better)")
    for name, r in results.items():
        if not name.startswith("ours"):
            continue
        if isinstance(r, str) or not theirs:
            print(f"  {name:<32} n/a")
            continue
        best_tps = max(t["tokens_per_s"] for t in theirs)
        best_p50 = min(t["ttft_p50"] for t in theirs)
        best_p99 = min(t["ttft_p99"] for t in theirs)
        print(f"  {name:<32} throughput x{r['tokens_per_s'] / best_tps:.2f}   TTFT p50 x{best_p50 / r['ttft_p50']:.2f}"
              f"   TTFT p99 x{best_p99 / r['ttft_p99']:.2f}")
    print("\ncost of observing (ours, draft on; metrics on and scraped every 0.1 s vs VRAMLEDGER_METRICS=off)")
    if isinstance(observing, str):
        print(f"  n/a ({observing})")
    else:
        print(f"  throughput on {observing['on']:.1f} tok/s, off {observing['off']:.1f} tok/s: ratio "
              f"{observing['on'] / observing['off']:.3f} (target >= 0.99)")
        print(f"  per CPU-second of the server: on {observing['on_cpu']:.1f} tok, off {observing['off_cpu']:.1f} "
              f"tok: ratio {observing['on_cpu'] / observing['off_cpu']:.3f}")
        print(f"  /metrics latency p99 under load: {observing['scrape_p99'] * 1000:.1f} ms "
              f"({observing['scrapes']} scrapes)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ASSETS / "tiny-coder-target"))
    parser.add_argument("--draft-model", default=str(ASSETS / "tiny-coder-draft"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--part", choices=["all", "throughput", "observing"], default="all")
    args = parser.parse_args()
    for path in (args.model, args.draft_model):
        if not Path(path, "config.json").is_file():
            print(f"error: no checkpoint at {path} (pass --model/--draft-model)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        logdir = Path(tmp)
        results: dict[str, dict | str] = {}
        peers: list[tuple[str, Peer | str]] = [("ours, draft on", our_peer("ours draft on", args, True)),
                                               ("ours, draft off", our_peer("ours draft off", args, False))]
        for name, cb in (("transformers serve", False), ("transformers serve --continuous-batching", True)):
            peers.append((name, "skipped (--skip-transformers)" if args.skip_transformers
                          else transformers_peer(name, args, cb)))
        for name, peer in peers:
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            rounds = "skipped (--part)" if args.part == "observing" else \
                peer if isinstance(peer, str) else measure(peer, args, logdir)
            results[name] = rounds if isinstance(rounds, str) else summarize(rounds)
        print("measuring the cost of observing ...", file=sys.stderr, flush=True)
        observing = "skipped (--part)" if args.part == "throughput" else observing_cost(args, logdir)
        print_report(results, observing, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

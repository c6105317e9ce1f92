"""Serving benchmark: vLLM's own benchmark client (guidellm) against vLLM's CPU build, `transformers
serve` and our worker, on the shipped pair, one server at a time, in one run.

    python bench/serve.py [--concurrency 1,4,16,32] [--requests-per-stream 3] [--servers NAME,...]
                          [--loads short,shared-prefix,long-prompt] [--prompt-tokens 32] [--output-tokens 128]
                          [--rounds 1] [--no-build-vllm] [--observing]

Servers: vLLM plain and with our draft (k=4, `--speculative-config`), `transformers serve` in both of
its modes (the table keeps the better one per concurrency), ours plain and with the draft (k=4, and
adaptive k up to 4: `ours-draft-adaptive`), and both again with `--compile` (`ours-compiled`,
`ours-draft-adaptive-compiled`: minutes of compiling at startup).

Loads (guidellm's synthetic data, chat completions, temperature 1.0, `ignore_eos` so every request
makes the same number of tokens):
  short          --prompt-tokens prompts, --output-tokens each, at every --concurrency;
  shared-prefix  one 1024-token prefix shared by every request (a system prompt) + 32-token prompts,
                 32 output tokens, 8 streams: what prefix caching saves;
  long-prompt    unique 1024-token prompts, 32 output tokens, 4 streams: the prefill itself.
Each server is started, warmed up with two requests, driven by one guidellm run per load, and
stopped before the next one starts. Prints guidellm's mean output tokens/s (and TTFT median), the
errored requests, the speculative acceptance rate read from each server's /metrics, and every
figure's ratio to vLLM plain.

--rounds N measures every server N times, each round in a rotated order (no server always goes
first), and prints each round's figures, then each ratio's min/median/max over the rounds (taken
round by round: a ratio only ever compares two servers measured minutes apart) and in how many
rounds each goal held. Short prompts: ours plain >= 1.0x at every concurrency; ours with the draft
>= 1.6x at 1 stream, >= 1.2x at 16 and never below ours plain. Shared prefix: output tokens/s
>= 1.5x and TTFT median <= 0.5x. Long prompts: output tokens/s >= 1.0x.
Where ours plain and ours with the draft both run, it also prints, per load and concurrency, the two
side by side each round, their ratio's min/median/max over the rounds and its goals: median >= 1.0x
and min >= 0.93x at every load, >= 1.25x in every round at 1 stream of short prompts. Only our two:
  python bench/serve.py --servers ours,ours-draft-adaptive --concurrency 1,16 --rounds 5

vLLM's CPU build lives in a venv of its own (scripts/vllm_venv.sh, `make vllm-venv`); this script
builds it when it is missing (unless --no-build-vllm) and says so when it cannot. guidellm is taken
from this venv (`pip install -e '.[bench]'`) or else from the vLLM venv; `transformers serve` needs
accelerate (the bench extra).

--observing adds the cost of observing: ours with the draft, metrics on and scraped every 0.1 s vs
VRAMLEDGER_METRICS=off, under guidellm at the highest concurrency, runs alternating.
Ratios, never timed assertions: every peer is measured in the same run on the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # run as a plain script
from vllm_peer import STARTUP_TIMEOUT, vllm_command, vllm_python  # noqa: E402

from vramledger.worker.selfcheck.processes import free_port, wait_http  # noqa: E402

ASSETS = ROOT / "worker" / "assets"
SERVERS = ("vllm", "vllm-draft", "transformers", "transformers-cb", "ours", "ours-draft", "ours-draft-adaptive",
           "ours-compiled", "ours-draft-adaptive-compiled")
LABELS = {"vllm": "vLLM plain", "vllm-draft": "vLLM with our draft, k=4",
          "transformers": "transformers serve", "ours": "ours plain", "ours-draft": "ours with the draft, k=4",
          "ours-draft-adaptive": "ours with the draft, adaptive k <= 4", "ours-compiled": "ours plain, --compile",
          "ours-draft-adaptive-compiled": "ours with the draft, adaptive k <= 4, --compile"}
ACCEPTANCE_METRICS = {  # (accepted, proposed) counters in each server's /metrics
    "vllm": ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "ours": ("vramledger_spec_decode_accepted_tokens_total", "vramledger_spec_decode_draft_tokens_total"),
}


@dataclass(frozen=True)
class Load:
    """One kind of traffic: guidellm's synthetic prompts of a size, at some concurrencies."""

    name: str
    label: str
    prompt_tokens: int
    output_tokens: int
    streams: tuple[int, ...]
    prefix_tokens: int = 0  # a prefix every request starts with (guidellm's prefix_tokens, prefix_count=1)

    def data(self, with_output: bool) -> str:
        data = f"kind=synthetic_text,prompt_tokens={self.prompt_tokens}"
        if self.prefix_tokens:
            data += f",prefix_tokens={self.prefix_tokens},prefix_count=1"
        return data + (f",output_tokens={self.output_tokens}" if with_output else "")


LOADS = ("short", "shared-prefix", "long-prompt")


def build_loads(args, names: list[str]) -> dict[str, Load]:
    known = {
        "short": Load("short", f"synthetic {args.prompt_tokens}-token prompts, {args.output_tokens} output "
                      "tokens", args.prompt_tokens, args.output_tokens, tuple(args.concurrency)),
        "shared-prefix": Load("shared-prefix", "a shared 1024-token prefix + 32-token prompts, 32 output "
                              "tokens", 32, 32, (8,), prefix_tokens=1024),
        "long-prompt": Load("long-prompt", "unique 1024-token prompts, 32 output tokens", 1024, 32, (4,)),
    }
    return {name: known[name] for name in names}


@dataclass
class Server:
    """One server under test: how to start it, the model name it answers to, where it logs."""

    name: str
    command: list[str]
    model: str
    env: dict = field(default_factory=dict)
    metrics: str | None = None  # key of ACCEPTANCE_METRICS
    ignore_eos: bool = True  # False: the server refuses the field (transformers), min_new_tokens instead
    port: int = 0
    startup_timeout: float = STARTUP_TIMEOUT
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, logdir: Path) -> None:
        self.log = logdir / f"{self.name}.log"
        with open(self.log, "wb") as log:  # its own session: a server's children stop with it
            self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env}, start_new_session=True)

    def wait_ready(self) -> None:
        wait_http(self.url + "/health", self.startup_timeout, self.process, self.log)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


# --- the servers -----------------------------------------------------------------------------
def build_servers(args, port_for) -> dict[str, Server | str]:
    """Every server asked for, or why it cannot run here."""
    out: dict[str, Server | str] = {}
    for name in args.servers:
        port = port_for()
        if name.startswith("vllm"):
            why = vllm_ready(args)
            draft = args.draft_model if name == "vllm-draft" else None
            out[name] = why or Server(name, vllm_command(args.model, port, draft=draft, k=args.k), args.model,
                                      env={"VLLM_CPU_KVCACHE_SPACE": "1"}, metrics="vllm" if draft else None,
                                      port=port)
        elif name.startswith("transformers"):
            out[name] = transformers_server(name, args, port)
        else:
            out[name] = our_server(name, args, port, draft=name.startswith("ours-draft"),
                                   speculation="adaptive" if "adaptive" in name else "fixed",
                                   compiled=name.endswith("-compiled"))
    return out


def our_server(name: str, args, port: int, draft: bool, env: dict | None = None,
               speculation: str = "fixed", compiled: bool = False) -> Server:
    command = [sys.executable, "-m", "vramledger.worker", "serve", "--model", args.model, "--device", "cpu",
               "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "2048",
               "--log-level", "warning", "--port", str(port)]
    command += ["--draft-model", args.draft_model, "--num-speculative-tokens", str(args.k),
                "--speculation", speculation] if draft else ["--no-draft"]
    command += ["--compile"] * compiled
    command += ["--cpu-threads", str(args.ours_cpu_threads)] if args.ours_cpu_threads else []
    return Server(name, command, Path(args.model).name, env=env or {}, metrics="ours" if draft else None,
                  port=port, startup_timeout=STARTUP_TIMEOUT + 900 * compiled)  # compiling: 4-5 min idle


_vllm_state: dict[str, str | None] = {}


def vllm_ready(args) -> str | None:
    """None when vLLM's venv is there (built now if it was missing and may be built); else why not."""
    if "why" not in _vllm_state:
        why = None
        if vllm_python() is None:
            if args.no_build_vllm:
                why = "no vLLM venv (make vllm-venv, or set VLLM_VENV); --no-build-vllm given"
            else:
                print("no vLLM venv: building it with scripts/vllm_venv.sh (several minutes) ...",
                      file=sys.stderr, flush=True)
                built = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_venv.sh")], cwd=ROOT, check=False)
                if built.returncode != 0 or vllm_python() is None:
                    why = f"could not build the vLLM venv (scripts/vllm_venv.sh exited {built.returncode})"
        _vllm_state["why"] = why
    return _vllm_state["why"]


def transformers_server(name: str, args, port: int) -> Server | str:
    cli = Path(sys.executable).parent / "transformers"
    if not cli.exists():
        return "the `transformers` command is not installed"
    try:
        import accelerate  # noqa: F401 - transformers serve loads models with a device_map
    except ImportError:
        return "`transformers serve` needs accelerate: pip install -e '.[bench]'"
    mode = "--continuous-batching" if name.endswith("-cb") else "--no-continuous-batching"
    return Server(name, [str(cli), "serve", args.model, mode, "--device", "cpu", "--host", "127.0.0.1",
                         "--port", str(port), "--log-level", "warning"], args.model,
                  env={"HF_HUB_OFFLINE": "1"}, port=port, ignore_eos=False)


# --- guidellm ----------------------------------------------------------------------------------
def guidellm_command() -> str | None:
    for python in (Path(sys.executable), vllm_python()):
        if python is not None and (python.parent / "guidellm").exists():
            return str(python.parent / "guidellm")
    return None


def run_guidellm(guidellm: str, server: Server, args, load: Load, report: Path,
                 streams: list[int] | None = None) -> list[dict]:
    """One guidellm run through the load's streams; per concurrency: output tok/s, requests, errors, TTFT."""
    streams = list(streams or load.streams)
    body: dict = {"temperature": 1.0}
    data = load.data(with_output=server.ignore_eos)  # output_tokens: guidellm sends max_tokens and ignore_eos
    if not server.ignore_eos:  # transformers refuses ignore_eos; its own generation_config does the same
        body["generation_config"] = json.dumps({"min_new_tokens": load.output_tokens,
                                                "max_new_tokens": load.output_tokens})
    backend = {"kind": "openai_http", "target": server.url, "model": server.model, "extras": {"body": body}}
    if not server.ignore_eos:
        backend["max_tokens"] = load.output_tokens
    counts = [max(args.min_requests, args.requests_per_stream * c) for c in streams]
    command = [guidellm, "run", "--backend", json.dumps(backend),
               "--profile", json.dumps({"kind": "concurrent", "streams": streams}),
               "--constraint", json.dumps({"kind": "max_requests", "count": counts}),
               *(["--constraint", json.dumps({"kind": "max_duration", "seconds": args.max_seconds})]
                 if args.max_seconds else []),
               "--data", data,
               "--tokenizer", f"kind=hf_auto,model={args.model}",
               "--output", f"kind=json,path={report}", "--disable-console"]
    result = subprocess.run(command, capture_output=True, text=True, check=False,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"guidellm exited {result.returncode}: {(result.stdout + result.stderr)[-1500:]}")
    rows = []
    for b in json.loads(report.read_text())["benchmarks"]:
        m = b["metrics"]
        for failed in b["requests"]["errored"][:3]:  # the report goes with its temporary directory: say why here
            info = failed.get("info") or {}
            print(f"  {server.name}, {load.name} at {b['config']['strategy']['streams']} streams, a request "
                  f"errored: {info.get('error')}", file=sys.stderr, flush=True)
        rows.append({"streams": b["config"]["strategy"]["streams"],
                     "tok_s": m["output_tokens_per_second"]["successful"]["mean"],
                     "ok": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"],
                     "incomplete": m["request_totals"]["incomplete"],
                     "ttft_ms": m["time_to_first_token_ms"]["successful"]["median"]})
    return rows


def warm_up(server: Server) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    with httpx.Client(timeout=120) as client:
        for _ in range(2):
            client.post(server.url + "/v1/chat/completions", json=body).raise_for_status()


def metric_sums(url: str, names) -> dict[str, float]:
    """Each named series of a server's /metrics, summed over its labels (0 where it has none)."""
    sums = dict.fromkeys(names, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0]
        if name in sums:
            sums[name] += float(value.split()[0])
    return sums


def counters(server: Server) -> tuple[float, float] | None:
    if server.metrics is None:
        return None
    accepted, proposed = ACCEPTANCE_METRICS[server.metrics]
    sums = metric_sums(server.url, (accepted, proposed))
    return sums[accepted], sums[proposed]


def measure(server: Server, guidellm: str, args, loads: dict[str, Load], logdir: Path) -> dict | str:
    """Start, warm up, drive through every load, stop; a failure is reported, never raised (the
    others still run)."""
    print(f"measuring {server.name} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        server.start(logdir)
        server.wait_ready()
        ready = time.monotonic() - started
        warm_up(server)
        before = counters(server)
        results = {}
        for name, load in loads.items():
            rows = run_guidellm(guidellm, server, args, load, logdir / f"{server.name}-{name}.json")
            results[name] = {r["streams"]: r for r in rows}
        after = counters(server)
        acceptance = None
        if before is not None and after[1] > before[1]:
            acceptance = (after[0] - before[0]) / (after[1] - before[1])
        return {"loads": results, "acceptance": acceptance, "startup_s": ready}
    except Exception as exc:  # noqa: BLE001 - one server failing must not hide the others
        return f"failed: {exc}"
    finally:
        server.stop()


# --- the cost of observing -------------------------------------------------------------------
def observing_cost(args, guidellm: str, load: Load, logdir: Path) -> dict | str:
    """Ours with the draft, metrics on (scraped every 0.1 s) vs off, alternating guidellm runs."""
    c = max(args.concurrency)
    on = our_server("metrics-on", args, free_port(), draft=True)
    off = our_server("metrics-off", args, free_port(), draft=True, env={"VRAMLEDGER_METRICS": "off"})
    figures: dict[str, list[float]] = {"on": [], "off": []}
    scrapes: list[float] = []
    try:
        for server in (on, off):
            server.start(logdir)
        for server in (on, off):
            server.wait_ready()
            warm_up(server)
        for i in range(4):  # on, off, off, on: neither side always goes first
            side = "on" if i in (0, 3) else "off"
            server = on if side == "on" else off
            stop = threading.Event()
            scraper = threading.Thread(target=scrape, args=(on, stop, scrapes)) if side == "on" else None
            if scraper:
                scraper.start()
            try:
                (row,) = run_guidellm(guidellm, server, args, load, logdir / f"observing-{i}.json", [c])
            finally:
                stop.set()
                if scraper:
                    scraper.join()
            figures[side].append(row["tok_s"])
        scrapes.sort()
        return {"streams": c, "on": statistics.median(figures["on"]), "off": statistics.median(figures["off"]),
                "scrape_p99": scrapes[min(len(scrapes) - 1, round(0.99 * (len(scrapes) - 1)))],
                "scrapes": len(scrapes)}
    except Exception as exc:  # noqa: BLE001
        return f"failed: {exc}"
    finally:
        on.stop()
        off.stop()


def scrape(server: Server, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(server.url + "/metrics").raise_for_status()
            latencies.append(time.perf_counter() - start)
            stop.wait(0.1)


# --- the report --------------------------------------------------------------------------------
def best_transformers(results: dict) -> dict | str | None:
    """The better of transformers serve's two modes at each load and concurrency, the mode named."""
    modes = {n: r for n, r in results.items() if n.startswith("transformers")}
    if not modes:
        return None
    measured = {n: r for n, r in modes.items() if isinstance(r, dict)}
    if not measured:
        return "; ".join(f"{n}: {r}" for n, r in modes.items())
    loads: dict[str, dict] = {}
    for name, r in measured.items():
        tag = "cb" if name.endswith("-cb") else "no cb"
        for load, rows in r["loads"].items():
            best = loads.setdefault(load, {})
            for c, row in rows.items():
                if c not in best or row["tok_s"] > best[c]["tok_s"]:
                    best[c] = {**row, "mode": tag}
    return {"loads": loads, "acceptance": None}


def figure(result, load: str, c: int, key: str = "tok_s") -> float | None:
    """One server's figure (tok_s or ttft_ms) for a load at c streams in one round; None when it
    failed or lacks that row."""
    row = result["loads"].get(load, {}).get(c) if isinstance(result, dict) else None
    return row[key] if row else None


def print_report(results: dict, observing, args, loads: dict[str, Load]) -> None:
    table = {n: r for n, r in results.items() if not n.startswith("transformers")}
    best = best_transformers(results)
    order = [n for n in ("vllm", "vllm-draft") if n in table]
    if best is not None:
        table["transformers"] = best
        order.append("transformers")
    order += [n for n in SERVERS if n.startswith("ours") and n in table]
    print(f"\nguidellm {guidellm_version()}: chat completions, synthetic prompts, ignore_eos, temperature "
          f"1.0, float32, CPU; {args.requests_per_stream} requests per stream (at least {args.min_requests})"
          + (f", at most {args.max_seconds:.0f} s" if args.max_seconds else "") + "; one server at a time")
    ref = table.get("vllm")
    for load in loads.values():
        cs = list(load.streams)
        print(f"\n{load.label}: mean output tokens/s (guidellm), by concurrent streams\n")
        print("| server | " + " | ".join(f"{c} stream{'s' * (c > 1)}" for c in cs)
              + " | draft acceptance | errored |")
        print("|---" * (len(cs) + 3) + "|")
        for name in order:
            r = table[name]
            if isinstance(r, str):
                print(f"| {LABELS[name]} | " + " | ".join("n/a" for _ in cs) + f" | n/a | {r} |")
                continue
            rows = r["loads"].get(load.name, {})
            cells = ["n/a" if rows.get(c) is None else f"{rows[c]['tok_s']:.0f}"
                     + (f" ({rows[c]['mode']})" if "mode" in rows[c] else "") for c in cs]
            errored = str(sum(row["errored"] for row in rows.values()))
            incomplete = sum(row["incomplete"] for row in rows.values())
            if incomplete:  # cut by --max-seconds, not failed
                errored += f" ({incomplete} cut by --max-seconds)"
            acceptance = "" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
            print(f"| {LABELS[name]} | " + " | ".join(cells) + f" | {acceptance} | {errored} |")
        print("\nratio to vLLM plain: output tokens/s (higher is better), TTFT median (lower is better)\n")
        print("| server | " + " | ".join(f"{c}: tok/s, TTFT" for c in cs) + " |")
        print("|---" * (len(cs) + 1) + "|")
        for name in order:
            cells = []
            for c in cs:
                ratios = []
                for key in ("tok_s", "ttft_ms"):
                    ours, base = figure(table[name], load.name, c, key), figure(ref, load.name, c, key)
                    ratios.append(f"{ours / base:.2f}x" if ours is not None and base else "n/a")
                cells.append(", ".join(ratios))
            print(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
        measured = [(n, table[n]) for n in order if isinstance(table[n], dict)]
        if measured:
            print("\nTTFT median ms (guidellm): " + "; ".join(
                f"{LABELS[n]}: " + "/".join("n/a" if figure(r, load.name, c, "ttft_ms") is None
                                             else f"{figure(r, load.name, c, 'ttft_ms'):.0f}" for c in cs)
                for n, r in measured))
    if observing is not None:
        print("\ncost of observing (ours with the draft; metrics on and scraped every 0.1 s vs VRAMLEDGER_METRICS=off)")
        if isinstance(observing, str):
            print(f"  n/a ({observing})")
        else:
            print(f"  {observing['streams']} streams: on {observing['on']:.1f} tok/s, off {observing['off']:.1f} tok/s:"
                  f" ratio {observing['on'] / observing['off']:.3f} (target >= 0.99); /metrics p99 under load "
                  f"{observing['scrape_p99'] * 1000:.1f} ms ({observing['scrapes']} scrapes)")


def goals(round_results: dict, loads: dict[str, Load]) -> dict[str, bool | None]:
    """The goals of the loads measured, in one round; None where a figure a goal needs is missing."""
    def at(name: str, load: str, c: int, key: str = "tok_s") -> float | None:
        return figure(round_results.get(name), load, c, key)

    def holds(pairs: list[tuple[float | None, float | None, float]]) -> bool | None:
        """Each (a, b, factor): a >= factor * b."""
        if any(a is None or b is None for a, b, _ in pairs):
            return None
        return all(a >= factor * b for a, b, factor in pairs)

    draft = next((n for n in ("ours-draft-adaptive", "ours-draft") if n in round_results), None)
    out = {}
    if "short" in loads:
        cs = list(loads["short"].streams)
        out["short prompts: ours plain >= 1.0x vLLM at every concurrency"] = \
            holds([(at("ours", "short", c), at("vllm", "short", c), 1.0) for c in cs])
        if draft is not None:
            label = f"short prompts: {LABELS[draft]}"
            vllm_at = {c: at("vllm", "short", c) for c in cs}
            out[f"{label} >= 1.6x at 1 stream"] = holds([(at(draft, "short", 1), vllm_at.get(1), 1.6)])
            out[f"{label} >= 1.2x at 16 streams"] = holds([(at(draft, "short", 16), vllm_at.get(16), 1.2)])
            out[f"{label} never below ours plain"] = holds([(at(draft, "short", c), at("ours", "short", c),
                                                             1.0) for c in cs])
    if "shared-prefix" in loads:
        c = loads["shared-prefix"].streams[0]
        for name in ["ours"] + [draft] * (draft is not None):
            label = f"shared prefix, {c} streams: {LABELS[name]}"
            out[f"{label}, output tok/s >= 1.5x"] = holds([(at(name, "shared-prefix", c),
                                                              at("vllm", "shared-prefix", c), 1.5)])
            out[f"{label}, TTFT median <= 0.5x"] = holds([(at("vllm", "shared-prefix", c, "ttft_ms"),
                                                             at(name, "shared-prefix", c, "ttft_ms"), 2.0)])
    if "long-prompt" in loads:
        c = loads["long-prompt"].streams[0]
        out[f"long prompts, {c} streams: ours plain, output tok/s >= 1.0x"] = \
            holds([(at("ours", "long-prompt", c), at("vllm", "long-prompt", c), 1.0)])
    return out


def print_spread(rounds: list[dict], loads: dict[str, Load]) -> None:
    """Each round's figures, each ratio to vLLM plain as min/median/max over rounds, the goals' tally."""
    names = [n for n in SERVERS if any(n in r for r in rounds)]
    for load in loads.values():
        cs = list(load.streams)
        keys = ("tok_s",) if load.name == "short" else ("tok_s", "ttft_ms")
        print(f"\n{load.label}: {len(rounds)} rounds, servers in a rotated order each round; tok/s"
              + (", TTFT median ms" if len(keys) > 1 else "") + " at " + "/".join(map(str, cs))
              + " streams\n")
        print("| server | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " |")
        print("|---" * (len(rounds) + 1) + "|")
        for name in names:
            cells = [", ".join("/".join("n/a" if figure(r.get(name), load.name, c, key) is None
                                        else f"{figure(r.get(name), load.name, c, key):.0f}" for c in cs)
                               for key in keys) if isinstance(r.get(name), dict) else "n/a" for r in rounds]
            print(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
        for key in keys:
            what = "output tok/s" if key == "tok_s" else "TTFT median"
            print(f"\n{load.label}: {what} as a ratio to vLLM plain in the same round, min / median / max "
                  "over the rounds\n")
            print("| server | " + " | ".join(f"{c}" for c in cs) + " |")
            print("|---" * (len(cs) + 1) + "|")
            for name in names:
                cells = []
                for c in cs:
                    pairs = [(figure(r.get(name), load.name, c, key),
                              figure(r.get("vllm"), load.name, c, key)) for r in rounds]
                    ratios = [a / b for a, b in pairs if a is not None and b]
                    cells.append(f"{min(ratios):.2f} / {statistics.median(ratios):.2f} / {max(ratios):.2f}"
                                 if ratios else "n/a")
                print(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
    tallies: dict[str, list[bool | None]] = {}
    for r in rounds:
        for goal, held in goals(r, loads).items():
            tallies.setdefault(goal, []).append(held)
    print("\ngoals, rounds where each held")
    for goal, held in tallies.items():
        measured = [h for h in held if h is not None]
        print(f"  {goal}: {sum(measured)} of {len(measured)}"
              + (f" ({len(held) - len(measured)} without a figure)" if len(measured) < len(held) else ""))


DRAFT_FLOOR = (1.0, 0.93)  # with the draft against ours plain at every load: median and min over rounds
DRAFT_AT_ONE_STREAM = 1.25  # ... and at 1 stream of short prompts, in every round


def draft_server(rounds: list[dict]) -> str | None:
    return next((n for n in ("ours-draft-adaptive", "ours-draft") if any(n in r for r in rounds)), None)


def draft_vs_plain(rounds: list[dict], loads: dict[str, Load]) -> dict[tuple[str, int], list[float]]:
    """Per load and concurrency, ours with the draft over ours plain, one ratio a round where both
    have the figure (each round measures both minutes apart, in a rotated order)."""
    draft = draft_server(rounds)
    out: dict[tuple[str, int], list[float]] = {}
    if draft is None:
        return out
    for load in loads.values():
        for c in load.streams:
            pairs = [(figure(r.get(draft), load.name, c), figure(r.get("ours"), load.name, c)) for r in rounds]
            out[(load.name, c)] = [a / b for a, b in pairs if a is not None and b]
    return out


def draft_goals(ratios: dict[tuple[str, int], list[float]]) -> dict[str, bool | None]:
    """With the draft at least as fast as plain at every load (median, and min within noise), and well
    ahead at 1 stream of short prompts in every round; None where no round has both figures."""
    out: dict[str, bool | None] = {}
    median_floor, min_floor = DRAFT_FLOOR
    for (load, c), values in ratios.items():
        out[f"{load}, {c} streams: with the draft, median >= {median_floor:.2f}x ours plain and min >= "
            f"{min_floor:.2f}x"] = (statistics.median(values) >= median_floor and min(values) >= min_floor) \
            if values else None
        if load == "short" and c == 1:
            out[f"short, 1 stream: with the draft >= {DRAFT_AT_ONE_STREAM:.2f}x ours plain in every round"] = \
                min(values) >= DRAFT_AT_ONE_STREAM if values else None
    return out


def print_draft_vs_plain(rounds: list[dict], loads: dict[str, Load]) -> None:
    ratios = draft_vs_plain(rounds, loads)
    if not ratios:
        return
    draft = draft_server(rounds)
    print(f"\n{LABELS[draft]} against ours plain, output tok/s, {len(rounds)} round(s), servers in a rotated "
          "order each round\n")
    print("| load | streams | ours plain, per round | with the draft, per round | ratio per round | "
          "ratio min / median / max |")
    print("|---|---|---|---|---|---|")
    for (load, c), values in ratios.items():
        plain = "/".join("n/a" if (f := figure(r.get("ours"), load, c)) is None else f"{f:.0f}" for r in rounds)
        drafted = "/".join("n/a" if (f := figure(r.get(draft), load, c)) is None else f"{f:.0f}" for r in rounds)
        spread = f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}" if values else "n/a"
        print(f"| {load} | {c} | {plain} | {drafted} | " + "/".join(f"{v:.2f}" for v in values)
              + f" | {spread} |")
    print("\ngoals, with the draft against ours plain")
    for goal, held in draft_goals(ratios).items():
        print(f"  {goal}: {'n/a' if held is None else 'holds' if held else 'MISSED'}")


def guidellm_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("guidellm")
    except metadata.PackageNotFoundError:
        return "(from the vLLM venv)"


def options() -> argparse.ArgumentParser:
    """This script's options; bench/served_steps.py parses its own fixed ones with it, so that every
    option the servers and loads read has its default."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ASSETS / "tiny-coder-target"))
    parser.add_argument("--draft-model", default=str(ASSETS / "tiny-coder-draft"))
    parser.add_argument("--k", type=int, default=4, help="speculative tokens per step (vLLM and ours)")
    parser.add_argument("--concurrency", default="1,4,16,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--ours-cpu-threads", type=int, default=None, metavar="N",
                        help="our servers' --cpu-threads (default: theirs, every core but one)")
    parser.add_argument("--min-requests", type=int, default=8, help="at least this many at each concurrency")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="also end each concurrency's run after this long (in-flight requests are cut)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="the short load's prompts")
    parser.add_argument("--output-tokens", type=int, default=128, help="the short load's completions")
    parser.add_argument("--loads", default=",".join(LOADS), type=lambda s: s.split(","),
                        help=f"a subset of {','.join(LOADS)}")
    parser.add_argument("--servers", default=",".join(SERVERS), type=lambda s: s.split(","),
                        help=f"a subset of {','.join(SERVERS)}")
    parser.add_argument("--no-build-vllm", action="store_true", help="skip vLLM when its venv is missing")
    parser.add_argument("--observing", action="store_true", help="also measure the cost of observing")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every server this many times, order rotated each round; print the spread")
    parser.add_argument("--json", metavar="FILE", help="also write the raw results here")
    return parser


def main() -> int:
    parser = options()
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; choose from {','.join(SERVERS)}")
    unknown = set(args.loads) - set(LOADS)
    if unknown:
        parser.error(f"unknown loads {sorted(unknown)}; choose from {','.join(LOADS)}")
    loads = build_loads(args, args.loads)
    for path in (args.model, args.draft_model):
        if not Path(path, "config.json").is_file():
            print(f"error: no checkpoint at {path} (pass --model/--draft-model)", file=sys.stderr)
            return 2
    guidellm = guidellm_command()
    if guidellm is None:
        print("error: guidellm is not installed: pip install -e '.[bench]' (or make vllm-venv)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        logdir = Path(tmp)
        servers = build_servers(args, free_port)
        rounds = []
        for i in range(args.rounds):
            names = list(servers)[i % len(servers):] + list(servers)[:i % len(servers)]
            results = {}
            for name in names:
                server = servers[name]
                results[name] = server if isinstance(server, str) else \
                    measure(server, guidellm, args, loads, logdir)
                print(f"  round {i + 1} {name}: {json.dumps(results[name], default=str)}", file=sys.stderr,
                      flush=True)
            rounds.append(results)
        observing = observing_cost(args, guidellm, build_loads(args, ["short"])["short"], logdir) \
            if args.observing else None
        print_report(rounds[-1], observing, args, loads)
        if args.rounds > 1:
            print_spread(rounds, loads)
        print_draft_vs_plain(rounds, loads)
        if args.json:
            Path(args.json).write_text(json.dumps({"rounds": rounds, "observing": observing}, indent=1,
                                                  default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m vramledger.worker serve | profile | generate | selfcheck`."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from typing import Any, TypedDict

from vramledger.worker.config import EngineConfig, Flag, usable_cores
from vramledger.worker.http.settings import SHUTDOWN_MARGIN
from vramledger.worker.selfcheck.options import add_flags as add_selfcheck_flags

# The README's first request: the shipped toy pair writes Python-shaped text from it.
EXAMPLE_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
# libgomp's busy-wait checks before a waiting thread sleeps (GOMP_SPINCOUNT): enough for the barriers
# inside a step's forward, far less than the time between steps.
SPIN_BEFORE_SLEEP = 3000


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """EngineConfig's flags, one per field that declares one (worker/config.py: its help, default and
    choices), then --log-level."""
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if "flag" in field.metadata:
            add_field_flag(p, field, field.metadata["flag"], hints[field.name])
    p.add_argument("--log-level", default="INFO")


def add_field_flag(p: argparse.ArgumentParser, field: dataclasses.Field, how: Flag, hint: Any) -> None:
    """One field's flag, `--field-name`: a switch for a bool, else a value of the field's type; a field
    with an `off` flag gets that one beside it (--no-draft: None; --no-prefix-caching: False)."""
    names = (how.name or "--" + field.name.replace("_", "-"), *how.aliases)
    kind = next(a for a in typing.get_args(hint) if a is not type(None)) if typing.get_args(hint) else hint
    if kind is bool:
        if field.default:  # on unless switched off
            if how.off is None:
                raise TypeError(f"EngineConfig.{field.name} is on by default: its flag needs `off`")
            p.add_argument(how.off, dest=field.name, action="store_false", help=how.off_help)
        else:
            p.add_argument(*names, dest=field.name, action="store_true", help=how.help)
        return
    target: Any = p if how.off is None else p.add_mutually_exclusive_group()
    target.add_argument(*names, dest=field.name, type=how.parse or kind, default=field.default, choices=how.choices,
                        metavar=how.metavar, help=how.help)
    if how.off is not None:  # after the value's flag, whose default the field's is
        target.add_argument(how.off, dest=field.name, action="store_const", const=None, default=argparse.SUPPRESS,
                            help=how.off_help)


def add_waiting_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="queued requests beyond this are refused with 503 and Retry-After; the ledger's "
                        "`server` entry holds max-num-seqs + N requests in flight")
    p.add_argument("--max-receiving-bodies", type=int, default=8, metavar="N",
                   help="request bodies being received or waiting to be parsed at once (default 8); a "
                        "request beyond them waits for one to be parsed, up to --body-timeout, then gets "
                        "503. The ledger's `server` entry holds N bodies at the body size limit")


def add_intake_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="close a connection with no request in progress after this long, a new one "
                        "included (default 5)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this long of its first byte, else 408 and "
                        "the connection closed (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's body must arrive within this long once the server reads it, else 408 "
                        "(default 30)")


def default_prompt_threads(cores: int | None = None) -> int | None:
    """The threads of a step of one prompt alone (ModelRunner.prompt_alone) when --cpu-threads is not
    given: every core, None (torch's own) where OMP_NUM_THREADS is set."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return usable_cores() if cores is None else cores


def default_cpu_threads(cores: int | None = None) -> int | None:
    """A step's threads when --cpu-threads is not given: None (torch's own) where OMP_NUM_THREADS is
    set, else every core but one. The server's own threads (HTTP, tokenizers) and a client on the
    host need a core; one that preempts a step's thread stalls the others at its next barrier, so
    on 2 cores one thread served as fast as two or faster (docs/engine.md). vLLM's CPU build
    reserves a core too."""
    every = default_prompt_threads(cores)
    return None if every is None else max(1, every - 1)


class ThreadSettings(TypedDict):
    """EngineConfig's thread fields."""

    cpu_threads: int | None
    cpu_prompt_threads: int | None


def thread_settings(cpu_threads: int | None) -> ThreadSettings:
    """EngineConfig's cpu_threads and cpu_prompt_threads for --cpu-threads (None: the defaults; a
    number sets every step's threads, a prompt alone's too)."""
    if cpu_threads is not None:
        return {"cpu_threads": cpu_threads, "cpu_prompt_threads": None}
    return {"cpu_threads": default_cpu_threads(), "cpu_prompt_threads": default_prompt_threads()}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config of add_engine_flags' flags; the threads' defaults from thread_settings."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata}
    return EngineConfig(**{**flags, **thread_settings(args.cpu_threads)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vramledger.worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require this Bearer token on /v1/* (or set VRAMLEDGER_API_KEY)")
    add_waiting_flag(serve)
    add_intake_flags(serve)
    serve.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, running requests get this long to finish before they are "
                            f"aborted (default 30); the process then exits within {SHUTDOWN_MARGIN:.0f} s "
                            "more, so give the pod a terminationGracePeriodSeconds of at least this + "
                            f"{SHUTDOWN_MARGIN:.0f} (docs/kubernetes.md)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model name the API answers to and reports (default: the model directory's name)")
    serve.add_argument("--log-probes", action="store_true",
                       help="write GET /health and GET /metrics to the access log too (left out by default: "
                            "a probe every few seconds buries the requests)")
    serve.set_defaults(run=run_serve)

    prof = sub.add_parser("profile", help="load, profile, print the memory ledger, exit")
    add_engine_flags(prof)
    add_waiting_flag(prof)
    prof.add_argument("--json", action="store_true", help="print the ledger JSON of GET /v1/memory")
    prof.add_argument("--plot", metavar="FILE.png", help="draw the ledger against budget and device total")
    prof.set_defaults(run=run_profile)

    gen = sub.add_parser("generate", help="complete one prompt and print it")
    add_engine_flags(gen)
    gen.add_argument("--prompt", default=EXAMPLE_PROMPT)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", dest="request_seed", type=int, default=None, help="sampling seed")
    gen.set_defaults(run=run_generate)

    check = sub.add_parser("selfcheck", help="prove the ledger on this device: start workers and neighbours, "
                                             "replay the scenarios that break a ledger, print pass/fail")
    add_selfcheck_flags(check)
    check.set_defaults(run=run_selfcheck)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from vramledger.worker.http.server import run_server
    return run_server(engine_config(args), args)


def run_profile(args: argparse.Namespace) -> int:
    import json

    from vramledger.worker.engine.startup import StartupPhases
    from vramledger.worker.http.prompt_encoder import PromptEncoder
    from vramledger.worker.http.settings import ServerSettings
    from vramledger.worker.http.state import load_engine

    config = engine_config(args)  # the ledger `serve` would declare, its requests in flight included
    encoder = PromptEncoder()
    settings = ServerSettings(max_waiting=args.max_waiting, max_receiving_bodies=args.max_receiving_bodies)
    engine = load_engine(config, settings, encoder, None, StartupPhases())
    encoder.shutdown()
    from vramledger.worker.memory.ledger import format_table, plot  # after the timed imports: it loads torch

    if args.json:
        print(json.dumps(engine.memory_report(), indent=2))
    else:
        print(format_table(engine.ledger))
    if args.plot:
        plot(engine.ledger, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from vramledger.worker.engine.llm_engine import LLMEngine
    from vramledger.worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed)
    (tokens, text, reason), = engine.generate([args.prompt], params)
    print(args.prompt + text)
    print(f"-- {len(tokens)} tokens, finish_reason={reason}", file=sys.stderr)
    if engine.max_k:
        s = engine.stats
        print(f"-- acceptance rate {s.acceptance_rate:.3f}, mean acceptance length "
              f"{s.mean_acceptance_length:.2f} (k={s.current_speculative_tokens} of at most {engine.max_k}, "
              f"{engine.config.speculation})", file=sys.stderr)
    return 0


def run_selfcheck(args: argparse.Namespace) -> int:
    from vramledger.worker.selfcheck.run import main as selfcheck

    return selfcheck(args)


def main(argv: list[str] | None = None) -> int:
    # Before torch loads its OpenMP runtime: threads waiting at a step's barriers spin briefly, then
    # sleep. A stage's wait ends within the spin; between steps the server's own threads and a
    # client on the same cores get the core (docs/engine.md). The operator's own setting wins.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_BEFORE_SLEEP))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ValueError, RuntimeError) as exc:  # configuration and memory-plan errors are for the user
        print(f"error: {exc}", file=sys.stderr)
        return 2

"""/metrics and /v1/memory of the real server: promtool, values that follow requests (names and types:
test_metrics_catalogue.py)."""
import json
import re
import socket
import subprocess
import time

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import metric_value

GREEDY = {"model": "llama-chat", "temperature": 0, "ignore_eos": True}
CANARY = "zebra canary 7781"


def scrape(server) -> str:
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200
    return response.text


def complete(server, **body) -> dict:
    response = httpx.post(server.url + "/v1/completions", json={**GREEDY, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def served(spec_server):
    """The spec server after some traffic, so every histogram and counter has samples."""
    complete(spec_server, prompt=CANARY, max_tokens=8)
    streamed = httpx.post(spec_server.url + "/v1/completions", timeout=60,
                          json={**GREEDY, "prompt": "hello", "max_tokens": 3, "stream": True})
    assert streamed.text.endswith("data: [DONE]\n\n")
    return spec_server


def test_promtool_check_metrics_reports_nothing(served):
    result = subprocess.run(["promtool", "check", "metrics"], input=scrape(served), capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result.stdout + result.stderr


def test_openmetrics_when_asked(served):
    response = httpx.get(served.url + "/metrics",
                         headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    names = {f.name for f in parse_openmetrics(response.text)}
    assert "vramledger_requests" in names and "vramledger_memory_bytes" in names
    assert httpx.get(served.url + "/metrics").headers["content-type"].startswith("text/plain")


def test_request_metrics_follow_a_request(spec_server):
    before = scrape(spec_server)
    out = complete(spec_server, prompt="the quick brown fox", max_tokens=10)
    after = scrape(spec_server)

    def delta(name, labels=""):
        return metric_value(after, name, labels) - (metric_value(before, name, labels) or 0)

    assert delta("vramledger_requests_total", 'finish_reason="length"') == 1
    assert delta("vramledger_generation_tokens_total") == 10
    assert delta("vramledger_prompt_tokens_total") == out["usage"]["prompt_tokens"]
    for histogram in ("time_to_first_token_seconds", "request_latency_seconds", "request_queue_seconds",
                      "spec_decode_request_acceptance_ratio"):
        assert delta(f"vramledger_{histogram}_count") == 1, histogram
    assert delta("vramledger_inter_token_latency_seconds_count") == 9  # the gaps between 10 tokens
    drafts = delta("vramledger_spec_decode_drafts_total")
    assert drafts >= 3 and delta("vramledger_spec_decode_draft_tokens_total") == 4 * drafts
    assert metric_value(after, "vramledger_spec_decode_num_speculative_tokens") == 4  # --speculation fixed
    accepted = delta("vramledger_spec_decode_accepted_tokens_total")
    assert accepted == delta("vramledger_spec_decode_accepted_tokens_per_position_total", 'position="0"') + \
        sum(delta("vramledger_spec_decode_accepted_tokens_per_position_total", f'position="{i}"')
            for i in (1, 2, 3))


def test_a_repeated_prompt_is_served_from_the_prefix_cache(spec_server):
    prompt = "def cached_prefix(values):\n" + "    total = sum(v * v for v in values)\n" * 12
    before = scrape(spec_server)
    first = complete(spec_server, prompt=prompt, max_tokens=4)
    second = complete(spec_server, prompt=prompt, max_tokens=4)
    after = scrape(spec_server)

    def delta(name):
        return metric_value(after, name) - (metric_value(before, name) or 0)

    n = first["usage"]["prompt_tokens"]
    assert n > 32 and second["choices"][0]["text"] == first["choices"][0]["text"]
    assert delta("vramledger_prefix_cache_queries_total") == 2 * n
    hits = delta("vramledger_prefix_cache_hits_total")
    assert hits == (n - 1) // 16 * 16  # every full block but the one of the last prompt token
    assert delta("vramledger_prompt_tokens_total") == 2 * n - hits
    kv = httpx.get(spec_server.url + "/v1/memory").json()["kv_cache"]
    text = scrape(spec_server)
    assert kv["blocks_used"] == 0 and kv["blocks_cached"] >= hits // 16
    assert kv["blocks_used"] + kv["blocks_cached"] + kv["blocks_free"] == kv["blocks_total"]
    for field in ("used", "cached", "free"):
        assert metric_value(text, f"vramledger_kv_cache_blocks_{field}") == kv[f"blocks_{field}"]


def test_ledger_metrics_match_v1_memory(served):
    ledger = httpx.get(served.url + "/v1/memory").json()
    text = scrape(served)
    assert ledger["version"] == 1 and ledger["models"]["draft"]
    assert {e["component"] for e in ledger["entries"]} >= {"runtime", "weights", "kv_cache"}
    for entry in ledger["entries"]:
        labels = f'component="{entry["component"]}",model="{entry["model"]}"'
        assert metric_value(text, "vramledger_memory_bytes", labels) == entry["bytes"]
    assert metric_value(text, "vramledger_memory_budget_bytes") == ledger["budget"]["bytes"]
    assert metric_value(text, "vramledger_memory_device_total_bytes") == ledger["device"]["total_bytes"]
    assert metric_value(text, "vramledger_foreign_memory_at_start_bytes") == ledger["foreign_at_start"]["bytes"]
    assert metric_value(text, "vramledger_kv_cache_blocks") == ledger["kv_cache"]["blocks_total"]
    assert metric_value(text, "vramledger_process_memory_bytes") > 0
    assert metric_value(text, "vramledger_unaccounted_memory_bytes") >= 0
    assert ledger["live"]["unaccounted_bytes"] == max(0, ledger["live"]["process_bytes"] - ledger["declared_bytes"])


def test_serving_info(served):
    info = [line for line in scrape(served).splitlines() if line.startswith("vramledger_serving_info{")]
    expected = ('vramledger_serving_info{device="cpu",draft_model="llama-draft",model="llama-chat",'
                'num_speculative_tokens="4",version="0.1.0"} 1.0')
    assert info == [expected]


def test_no_prompt_text_in_metrics_or_default_logs(served):
    complete(served, prompt=CANARY, max_tokens=8)
    complete(served, prompt="x", max_tokens=4, stop=[CANARY])
    exposed = scrape(served) + httpx.get(served.url + "/v1/memory").text
    assert CANARY not in exposed and CANARY not in served.log()
    assert "POST /v1/completions" in served.log()  # the log is there, at the default level


def test_client_disconnect_mid_stream_frees_its_kv_blocks(spec_server):
    aborted_before = metric_value(scrape(spec_server), "vramledger_requests_total", 'finish_reason="abort"')
    body = {**GREEDY, "prompt": "hello " * 40, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", spec_server.url + "/v1/completions",
                                                           json=body) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric_value(scrape(spec_server), "vramledger_kv_cache_blocks_used") > 0
        assert metric_value(scrape(spec_server), "vramledger_requests_running") == 1
    # the client has closed the connection after a few tokens of 400
    deadline = time.monotonic() + 15
    while metric_value(text := scrape(spec_server), "vramledger_kv_cache_blocks_used") != 0:
        assert time.monotonic() < deadline, "KV blocks were not freed after the client left"
        time.sleep(0.1)
    assert metric_value(text, "vramledger_requests_running") == 0
    assert metric_value(text, "vramledger_kv_cache_usage_ratio") == 0
    assert metric_value(text, "vramledger_requests_total", 'finish_reason="abort"') == aborted_before + 1


def test_client_disconnect_while_waiting_for_a_whole_completion_frees_blocks(spec_server):
    aborted_before = metric_value(scrape(spec_server), "vramledger_requests_total", 'finish_reason="abort"')
    # Sampled, four choices of 400 tokens: seconds of work, where the client leaves after its first
    # step (a client timeout would race the tiny model, which can finish first on a fast machine).
    body = json.dumps({**GREEDY, "temperature": 1.0, "n": 4, "prompt": "hello " * 40, "max_tokens": 400})
    with socket.create_connection(("127.0.0.1", spec_server.port)) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 30
        while metric_value(scrape(spec_server), "vramledger_kv_cache_blocks_used") == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    # the client has closed the connection without reading a byte of the answer
    deadline = time.monotonic() + 15
    while metric_value(text := scrape(spec_server), "vramledger_kv_cache_blocks_used") != 0:
        assert time.monotonic() < deadline, "KV blocks were not freed after the client left"
        time.sleep(0.1)
    assert metric_value(text, "vramledger_requests_total", 'finish_reason="abort"') == aborted_before + 4


def test_start_up_phases_are_logged_and_published(spec_server):
    """Each phase the log shows ending is published with the seconds the log gives (a phase logged twice,
    the server's and the engine's tokenizer, adds up), and no phase is published that the log lacks."""
    published = {s.labels["phase"]: s.value for f in text_string_to_metric_families(scrape(spec_server))
                 for s in f.samples if s.name == "vramledger_startup_seconds"}
    log = spec_server.log_path.read_text()
    logged: dict[str, float] = {}
    for phase, seconds in re.findall(r"start-up: (\w+) done in ([0-9.]+) s", log):
        assert f"start-up: {phase} ..." in log
        logged[phase] = logged.get(phase, 0.0) + float(seconds)
    assert set(published) == set(logged) == {"server", "imports", "tokenizer", "weights_target", "weights_draft",
                                             "kernels", "memory_profile", "kv_cache"}
    for phase, seconds in logged.items():
        assert published[phase] == pytest.approx(seconds, abs=0.02), phase
    # The engine's phases run one after another, in the order the engine needs them.
    order = [phase for phase in re.findall(r"start-up: (\w+) \.\.\.", log) if phase != "server"]
    assert order == ["imports", "tokenizer", "tokenizer", "weights_target", "weights_draft", "kernels",
                     "memory_profile", "kv_cache"]

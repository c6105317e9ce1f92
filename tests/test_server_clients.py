"""Clients written against vLLM and OpenAI, unchanged, against a worker with --served-model-name:
guidellm (vLLM's benchmark client) and langchain-openai's ChatOpenAI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_fixtures import Server, with_chat_template

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_peer import vllm_python  # noqa: E402

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)

NAME = "tiny-served"
GUIDELLM_STREAMS = (1, 4)
GUIDELLM_REQUESTS = 4  # per concurrency: the run stays short


def guidellm_command() -> str | None:
    """guidellm from this venv (the bench extra) or from the vLLM venv; None when neither has it."""
    mine = Path(sys.executable).parent / "guidellm"
    if mine.exists():
        return str(mine)
    python = vllm_python()
    theirs = python.parent / "guidellm" if python is not None else None
    return str(theirs) if theirs is not None and theirs.exists() else None


@pytest.fixture(scope="module")
def named_server(checkpoints, tmp_path_factory):
    """The random llama with a chat template and its draft, served under another name."""
    work = tmp_path_factory.mktemp("named")
    target = with_chat_template(checkpoints["llama"], work / "llama-chat")
    server = Server("named", ["--model", target, "--draft-model", checkpoints["llama-draft"],
                              "--served-model-name", NAME], work / "named.log")
    server.start()
    try:
        server.wait_ready()
        server.checkpoint = target
        yield server
    finally:
        server.stop()


def test_served_model_name_is_the_name_listed_and_answered(named_server):
    models = httpx.get(named_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [NAME]
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    out = httpx.post(named_server.url + "/v1/completions", json=body).json()
    assert out["model"] == NAME and out["usage"]["completion_tokens"] <= 2
    wrong = httpx.post(named_server.url + "/v1/completions", json={**body, "model": "llama-chat"})
    assert wrong.status_code == 404 and NAME in wrong.json()["error"]["message"]


def test_langchain_chat_openai_invoke_and_stream(named_server):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=named_server.url + "/v1", api_key="unused", model=NAME, temperature=0,
                      max_tokens=10, max_retries=0, extra_body={"ignore_eos": True}, stream_usage=True)
    messages = [SystemMessage("be brief"), HumanMessage("hello")]
    reply = chat.invoke(messages)
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata["output_tokens"] == 10 and reply.response_metadata["model_name"] == NAME
    assert reply.response_metadata["finish_reason"] == "length"
    chunks = list(chat.stream(messages))
    assert "".join(c.content for c in chunks) == reply.content
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.usage_metadata["output_tokens"] == 10
    with_logprobs = chat.bind(logprobs=True, top_logprobs=2).invoke(messages)
    content = with_logprobs.response_metadata["logprobs"]["content"]
    assert len(content) == 10 and all(len(e["top_logprobs"]) == 2 for e in content)


def test_guidellm_unpatched_reports_no_errored_request(named_server, tmp_path):
    guidellm = guidellm_command()
    if guidellm is None:
        pytest.skip("guidellm is not installed: `pip install -e '.[bench]'` or `make vllm-venv` brings it")
    report = tmp_path / "guidellm.json"
    result = subprocess.run(
        [guidellm, "run", "--backend", f"kind=openai_http,target={named_server.url}",
         "--profile", json.dumps({"kind": "concurrent", "streams": list(GUIDELLM_STREAMS)}),
         "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
         "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=16",
         "--tokenizer", f"kind=hf_auto,model={named_server.checkpoint}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert [b["config"]["strategy"]["streams"] for b in benchmarks] == list(GUIDELLM_STREAMS)
    for b in benchmarks:
        assert b["config"]["backend"]["model"] == NAME
        totals = b["metrics"]["request_totals"]
        assert totals["errored"] == 0 and totals["incomplete"] == 0
        # guidellm's max_requests constraint once stopped at 3 of 4 at 4 streams (CI, nothing errored
        # or cut): its scheduler's race, not a lost request, which would count as errored or incomplete
        assert GUIDELLM_REQUESTS - 1 <= totals["successful"] <= GUIDELLM_REQUESTS
        # guidellm read the token counts from our usage: exactly the 16 tokens it asked for
        assert b["metrics"]["output_token_count"]["successful"]["total_sum"] == 16 * totals["successful"]

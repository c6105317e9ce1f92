"""schemathesis against the real server's OpenAPI schema: no generated request gets a 5xx."""
import subprocess
import sys

import httpx
from server_fixtures import API_KEY

MAX_EXAMPLES = 25  # per operation and phase; the whole run stays well under a minute


def test_openapi_schema_documents_the_api(plain_server):
    schema = httpx.get(plain_server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/memory", "/health"} <= set(schema["paths"])
    request = schema["components"]["schemas"]["CompletionRequest"]
    assert request["properties"]["model"]["enum"] == ["llama-chat"]  # so fuzzing reaches generation
    assert request["additionalProperties"] is False


def test_schemathesis_finds_no_server_error(plain_server):
    # The plain server: a short context keeps generated requests quick; its key opens /v1/*.
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", plain_server.url + "/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", str(MAX_EXAMPLES), "--seed", "7",
         "--request-timeout", "60", "--header", f"Authorization: Bearer {API_KEY}", "--no-color"],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "passed" in result.stdout
    assert httpx.get(plain_server.url + "/health").status_code == 200

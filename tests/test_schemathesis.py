"""Property-based API tests from the OpenAPI schema: no 5xx, and every response matches the schema.

Every route is in the run, the protocol adapters' too: the OpenAI chat completions route
declares its request body's schema for this (it reads the body itself), and the AI SDK
chat's comes from its model.

Schemathesis calls the ASGI app in-process. It runs the app's lifespan itself, once, on
its own event-loop thread (`schemathesis.python.asgi`), so the app's database pool and
background loops live on that loop, not on pytest's; the module fixture shuts that
lifespan down at the end. Requests carry a valid bearer token, so the generated inputs
reach the handlers instead of stopping at 401.

Streaming endpoints stay in: the demo model runs at 5,000 tokens/s so a reply ends in
well under a second, and schemathesis reads at most 20 SSE events of a stream (its default).

Three passes per operation, each bounded in examples: schema-valid inputs with real ids
in the path; schema-valid inputs with the generated path parameters kept (random ids,
odd tool-call ids); and schema-violating inputs (negative mode: bad headers, queries,
bodies). Then every declared header (`Last-Event-ID`, `Idempotency-Key`) gets a fixed
set of edge values that random generation rarely reaches (2^31, 32 nines, "²").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import response_schema_conformance

from chat_api.app import create_app
from memory.config import get_settings
from memory.recall.embeddings import HashEmbedder
from tests.conftest import TEST_SECRET, auth


@pytest.fixture(scope="module")
def api_schema(pg_url: str) -> Iterator[Any]:
    app = create_app(
        get_settings(
            database_url=pg_url,
            jwt_secret=TEST_SECRET,
            llm_provider="demo",
            demo_tokens_per_second=5000.0,
            checkpoint_interval_ms=50,
            stop_wait_seconds=2.0,
            rate_limit_per_minute=0,  # schemathesis sends hundreds of requests as one user
        ),
        embedder=HashEmbedder(),
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    try:
        yield schema
    finally:
        asgi.shutdown_lifespans()


# Each operation gets its own Hypothesis run; failures are gathered so one run reports them all.
# (schemathesis.pytest.from_fixture would give one test per operation, but its lazy loader
# reads a pytest internal that pytest 9 renamed.)
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


class Fixtures:
    """Real ids for path parameters, made through the same in-process client.

    Random UUIDs only ever reach the 404 branch; each case that names a conversation or a
    turn gets a fresh one of its own (a case may delete it), so the handlers run for real.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        with asgi.get_client(self.app) as client:
            response = client.request(method, f"http://{asgi.HOST}{path}", headers=auth(), **kwargs)
        assert response.status_code < 300, (method, path, response.status_code, response.text)
        return response.json()

    def conversation(self) -> str:
        return str(self._request("POST", "/v1/conversations", json={"title": "fuzz"})["id"])

    def turn(self) -> str:
        conversation = self.conversation()
        reply = self._request(
            "POST", f"/v1/conversations/{conversation}/messages", json={"content": "hello", "stream": False}
        )
        return str(reply["turns"][-1]["id"])

    def fill(self, case: Any) -> None:
        params = case.path_parameters or {}
        if "conversation_id" in params:
            params["conversation_id"] = self.conversation()
        if "turn_id" in params:
            params["turn_id"] = self.turn()


FEWER = settings(SETTINGS, max_examples=4)

# Values of declared headers that random strings rarely hit: past int32, non-ASCII digits, edges.
HEADER_EDGES: dict[str, list[str]] = {
    "Last-Event-ID": ["2147483648", "2147483647", "9" * 32, "-1", "\u00b2", "7 ", "1e3", "0x10", ""],
    "Idempotency-Key": ["k" * 200, "k" * 201, "\u00e9\u00e8", "a b", ""],
}


def run_pass(
    operation: Any,
    fixtures: Fixtures,
    statuses: dict[str, set[int]],
    pass_settings: Any,
    mode: GenerationMode,
    real_ids: bool,
) -> None:
    """One Hypothesis run of `operation`; raises on the first failing check."""
    checks = [not_a_server_error] + ([response_schema_conformance] if mode.is_positive else [])

    @pass_settings
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        if real_ids:
            fixtures.fill(case)
        response = case.call_and_validate(headers=auth(), checks=checks)
        statuses.setdefault(case.operation.label, set()).add(response.status_code)

    check()


def test_api_conforms_to_its_schema(api_schema: Any) -> None:
    failures: list[str] = []
    fixtures = Fixtures(api_schema.app)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10, "the schema lost its operations"
    statuses: dict[str, set[int]] = {}
    passes = (
        ("real ids", SETTINGS, GenerationMode.POSITIVE, True),
        ("generated path parameters", FEWER, GenerationMode.POSITIVE, False),
        ("negative", FEWER, GenerationMode.NEGATIVE, True),
    )
    for operation in operations:
        for name, pass_settings, mode, real_ids in passes:
            if not real_ids and not operation.path_parameters:
                continue
            try:
                run_pass(operation, fixtures, statuses, pass_settings, mode, real_ids)
            except Unsatisfiable:
                pass  # negative mode, and the operation takes no input that could be wrong
            except Exception as exc:
                failures.append(f"{operation.label} ({name}):\n{exc}")
    assert not failures, "\n\n".join(failures)
    # The protocol adapters' schemas are in the run (their bodies are fuzzed per adapter in
    # test_adapter_fuzz.py too).
    for adapter in ("POST /openai/v1/chat/completions", "POST /v1/ai-sdk/chat"):
        assert adapter in statuses, sorted(statuses)
    # The real ids got past the ownership checks: handlers ran, not only the 404 branch.
    reached = [label for label, codes in statuses.items() if "{" in label and any(c < 300 for c in codes)]
    assert len(reached) >= 5, statuses


def test_declared_headers_at_their_edges_never_answer_5xx(api_schema: Any) -> None:
    fixtures = Fixtures(api_schema.app)
    failures: list[str] = []
    for operation in (result.ok() for result in api_schema.get_all_operations()):
        declared = [p.name for p in operation.headers if p.name in HEADER_EDGES]
        for header in declared:
            for value in HEADER_EDGES[header]:
                body: Any = None
                if operation.body:
                    regenerate = operation.label.endswith("/regenerate")
                    body = {"stream": False} if regenerate else {"content": "hi", "stream": False}
                case = operation.Case(
                    path_parameters={p.name: "x" for p in operation.path_parameters},
                    headers={header: value},
                    **({"body": body, "media_type": "application/json"} if body is not None else {}),
                )
                fixtures.fill(case)
                response = case.call(headers=auth())
                if response.status_code >= 500:
                    failures.append(f"{operation.label} {header}={value!r}: {response.status_code}")
    assert not failures, failures

"""Property-based requests over the directory's OpenAPI document (schemathesis) against the
directory in this process over real HTTP, with credentials on: every operation, as a caller with
no token, an engine token and an admin token, with bodies that follow the schema and bodies that
break it. No answer may be a 5xx, and every answer must have a documented status, content type
and body schema. `python -m pytest tests/fuzz -s` prints the counts."""

from __future__ import annotations

import os

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from kvstore.directory.http.auth import ROUTES
from tests.stacks import directory_stack, make_settings

RANDOM = bool(os.environ.get("KVSTORE_FUZZ_RANDOM"))  # explore new inputs instead of the fixed ones
EXAMPLES = 25  # per operation and caller, bodies that follow the schema and bodies that break it
# not_a_server_error is asserted in `run`: /readyz answers 503 when it cannot serve, as documented
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
CALLS: Counter = Counter()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    database = tmp_path_factory.mktemp("fuzz") / "directory.db"
    with directory_stack(make_settings(f"sqlite:///{database}", require_auth=True, engine_rate=0)) as s:
        s.callers = {"nobody": None, "engine": s.token("engine", tenants=("",)), "admin": s.token("admin")}
        yield s
    print(f"\nfuzz: {sum(CALLS.values())} requests over {len({k[:2] for k in CALLS})} operations; "
          f"by status: {dict(sorted(Counter(k[3] for k in CALLS.elements()).items()))}")


def operations(fuzzed) -> list:
    api = schemathesis.openapi.from_dict(fuzzed.app.fastapi.openapi())
    return [result.ok() for result in api.get_all_operations()]


@pytest.mark.parametrize("caller", ["nobody", "engine", "admin"])
def test_no_5xx_and_every_answer_follows_the_schema(fuzzed, caller):
    token = fuzzed.callers[caller]
    headers = {"authorization": f"Bearer {token}"} if token else {}
    ops = operations(fuzzed)
    assert len(ops) == len(ROUTES) - 1  # every route but /openapi.json itself
    for operation in ops:
        @given(case=operation.as_strategy() | operation.as_strategy(GenerationMode.NEGATIVE))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            response = case.call_and_validate(base_url=fuzzed.url, headers=headers, checks=CHECKS)
            CALLS[(case.method, case.path, caller, response.status_code)] += 1
            unready = case.path == "/readyz" and response.status_code == 503 and \
                response.json()["error"] == "unavailable"
            assert response.status_code < 500 or unready, (case.method, case.path, response.text)
            if caller == "nobody" and case.path not in ("/healthz", "/readyz"):
                assert response.status_code == 401, (case.method, case.path, response.text)
        run()

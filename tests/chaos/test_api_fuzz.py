"""Schemathesis over every route of a real edge (real nats-server, scripted SGLang engine), driven by
the edge's own ``GET /openapi.json`` (:mod:`rollbus.testing.api_fuzz`): a few hundred cases, most of
them with a real session's id and key so that they reach the body parsers and the engine. No answer
is a 5xx, and every one has a status, content type and body the document gives its operation.
Afterwards every session the fuzzing touched is finalized and the whole log replays and verifies
(``rollbus replay --verify --all``), a normal SDK session still works, and the process' RSS (the edge
runs in it) is back near where it was after a warm-up. ``ops/chaos/fuzz.py`` is the long run."""

from __future__ import annotations

import gc
import os
import time

from rollbus.testing.api_fuzz import ApiFuzz
from tests.e2e.conftest import make_stack, stack, tokenizer  # noqa: F401 (the e2e fixtures)
from tests.e2e.test_fuzz import engine, finalize_all, still_works_and_replays  # noqa: F401 (engine: a fixture)
from tests.stack import StackThread

WARM_UP = 60
CASES = int(os.environ.get("ROLLBUS_API_FUZZ_CASES", "400"))
RSS_SLACK = 1.25  # after / baseline


def rss() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_schemathesis_finds_no_5xx_and_no_undocumented_answer_and_the_log_still_verifies(
        stack: StackThread) -> None:  # noqa: F811 (the e2e fixture)
    fuzz = ApiFuzz(stack.url, stack.options.admin_token)
    fuzz.examples()  # each operation's example with a real session: every wire reaches the engine
    fuzz.run(WARM_UP, seed_value=1)  # the code paths, caches and schemathesis' own state loaded
    gc.collect()
    baseline = rss()
    report = fuzz.run(CASES)
    shown = "\n".join(report.lines())
    assert report.server_errors == 0 and not report.failures, \
        f"{shown}\n\n" + "\n\n".join(report.failures[:5])
    assert report.cases >= (WARM_UP + CASES) * 0.9, shown
    # every operation was reached; past the key check to the engine on each model route (the examples
    # make sure of it), and a fair share of the random cases carry a session's key
    reached = {key.rsplit(" ", 1)[0] for key in report.by_operation}
    assert len(reached) == len(fuzz.operations), (sorted(reached), shown)
    counts = "\n".join(f"{k}: {v}" for k, v in sorted(report.by_operation.items()))
    for wire in ("chat/completions", "messages", "responses"):
        assert report.by_operation[f"POST /sessions/{{session_id}}/v1/{wire} 200"] > 0, counts
    assert report.statuses[400] > 0 and report.statuses[401] > 0, shown
    model = [n for key, n in report.by_operation.items() if "/v1/" in key]
    assert sum(n for key, n in report.by_operation.items() if "/v1/" in key and key.endswith(" 401")) \
        < 0.45 * sum(model), counts

    finalize_all(stack, sorted(report.sessions))
    still_works_and_replays(stack, sorted(report.sessions))
    gc.collect()
    time.sleep(1)
    after = rss()
    assert after <= RSS_SLACK * baseline, f"RSS {baseline / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB\n{shown}"

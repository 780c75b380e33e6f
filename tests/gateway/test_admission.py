"""Admission by estimated wait on the running pipeline (the folder's ``pipeline``: streams, one inference
worker with a batch of 8, a gateway): a request whose first token cannot come before its deadline gets
429 at once, with a Retry-After that a second attempt at that time meets.

The deadline is the client's own (``X-Chatpipe-Timeout-S``: seconds to the first token), so a short one
meets a queue of a few seconds; the gateway's own 300 s would need minutes of queued work. The queue is
16 text completions of a counting prompt with 96 tokens each: 8 of them wait for the worker's 8 slots,
and their budgets with those of the 8 running (16 × 96 tokens) are the work the estimate sees ahead: some
8-10 s at this worker's rate on a quiet machine, up to ~80 s on a loaded one. It must stay well above the
5 s deadline on a quiet machine, or the estimate admits the probe and no 429 comes.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
TIMEOUT_S = 5  # the probe's deadline to its first token
QUEUED_TOKENS = 96  # the budget of each of the 16 queued completions


def auth() -> dict[str, str]:
    from chatpipe.testing.gateway import API_KEY

    return {"Authorization": f"Bearer {API_KEY}"}


async def long_completion(http: httpx.AsyncClient) -> int:
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": QUEUED_TOKENS, "temperature": 0}
    response = await http.post("/v1/completions", json=body, headers=auth())
    return response.status_code


async def probe(http: httpx.AsyncClient) -> tuple[httpx.Response, bytes, float, float | None]:
    """A one-token chat with a 5 s deadline: (response, its body when not 200, seconds to the status line,
    seconds to the first token)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "stream": True}
    started = time.perf_counter()
    first_token, content = None, b""
    async with http.stream("POST", "/v1/chat/completions", json=body,
                           headers={**auth(), "X-Chatpipe-Timeout-S": str(TIMEOUT_S)}) as response:
        status_at = time.perf_counter() - started
        if response.status_code != 200:
            content = await response.aread()
        else:
            async for line in response.aiter_lines():
                if first_token is None and line.startswith("data: {"):
                    first_token = time.perf_counter() - started
    return response, content, status_at, first_token


async def test_a_request_whose_deadline_cannot_be_met_gets_429_at_once_and_its_retry_after_is_met(pipeline):
    async with httpx.AsyncClient(base_url=pipeline.url, timeout=300) as http:
        queue = [asyncio.create_task(long_completion(http)) for _ in range(16)]
        refusals: list[tuple[float, int]] = []  # (seconds to the 429, Retry-After)
        deadline, settled = time.monotonic() + 120, None
        # Until the worker's reports show the queue and the rate it drains at, then 3 s more: the rate of a
        # wave's first steps (its prompts) is a fraction of the rate a heartbeat or two later.
        while (settled is None or time.monotonic() < settled) and time.monotonic() < deadline:
            response, content, took, _ = await probe(http)
            if response.status_code == 429:
                error = json.loads(content)["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "deadline_unreachable"), error
                refusals.append((took, int(response.headers["Retry-After"])))
                settled = settled or time.monotonic() + 3
            await asyncio.sleep(0.3)
        assert refusals, f"no 429 while 8 requests of {QUEUED_TOKENS} tokens each waited for a batch slot"
        # Decided from memory, no I/O: the status line within 100 ms (the fastest of the refusals:
        # a loaded 2-core machine may hold any one HTTP round trip up)
        assert min(took for took, _ in refusals) < 0.1, refusals
        assert all(took < 1 for took, _ in refusals), refusals
        retry_after = refusals[-1][1]
        assert 1 <= retry_after <= 120, refusals  # bounds the test
        await asyncio.sleep(retry_after)
        response, content, _, first_token = await probe(http)
        assert response.status_code == 200, content.decode()
        assert first_token is not None and first_token < TIMEOUT_S, \
            f"first token after {first_token} s; the deadline was {TIMEOUT_S} s"
        assert sorted(await asyncio.gather(*queue)) == [200] * 16  # the queue itself was served

"""What chatmem adds to a real model: time to first token and between tokens, and its CPU.

One run against one llama-server (the local model on its shared install, started if it is not
running and never installed twice, or `--url` of a running one): each round asks a question
straight to llama-server with the official `openai` client, then through chatmem (`chatmem
serve` in its own process, SSE), with memory off (`memory_scope: none`) and on (`user`: embed
the query, search, and put the memories found in the prompt). The user has 12 stated facts in
memory. Every request asks a different question, so the server cannot answer a prompt from its
cache and the memory block's real cost shows. Direct and chatmem requests alternate, so both
see the same machine load; the direct request carries the same system prompt (and the tools,
when chatmem offers any) but no memory. chatmem runs with the settings `chatmem local-model`
prints. Reported: p50 time to the first delta (text or tool call) and p50 gap between deltas,
the ratio and the difference to direct, prompt tokens the server processed per request
(llama-server's `/metrics`), and chatmem's CPU seconds per second of streaming (its
process's utime+stime from /proc), i.e. the share of one core. JSON goes to the system's
temp directory unless `--out` says otherwise: nothing is written into the checkout. It records
the model server's default sampling (llama-server's `/props`): no answer is judged here, and
direct and chatmem requests both get the server's defaults.

    python bench/real_model.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from common import ModelServer, Server, database, headers, local_model, print_table, write_json

from chat_api.tools import default_registry

FACTS = (
    "My sister Mara lives in Porto.",
    "My car is a 2009 Volvo.",
    "I'm allergic to peanuts.",
    "My dog is called Biscuit.",
    "I work as a nurse at St. Mary's hospital.",
    "I was born in 1987.",
    "I play the cello.",
    "My wife's name is Ines.",
    "My favourite colour is teal.",
    "I live in Leeds.",
    "I've been learning Japanese for two years.",
    "My favourite food is ramen.",
)
# One question per round and setting, never asked twice in a run.
QUESTIONS = (
    "Where does my sister live?",
    "What car do I drive?",
    "What am I allergic to?",
    "What is my dog called?",
    "What do I do for a living?",
    "What year was I born?",
    "Which instrument do I play?",
    "What is my wife's name?",
    "What is my favourite colour?",
    "Which city do I live in?",
    "Which language am I learning?",
    "What is my favourite food?",
    "Write four short lines about the sea.",
    "Name three rivers in Europe.",
    "How do I boil an egg?",
    "Suggest a name for a grey cat.",
    "What is a good stretch for the back?",
    "Give me two tips for a job interview.",
    "How far is the Moon, roughly?",
    "Write a haiku about autumn rain.",
    "What should I pack for a beach day?",
    "Explain what a prime number is.",
    "Which tea is good in the evening?",
    "Describe a sunrise in one sentence.",
)
T = TypeVar("T")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct(
    sdk: openai.AsyncOpenAI, model: str, system: str, message: str, tools: list[Any] | None
) -> tuple[float, list[float]]:
    """Seconds to the first delta and the gaps between deltas, straight to llama-server."""
    started = time.perf_counter()
    stamps: list[float] = []
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    stream = await sdk.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": message}],
        stream=True,
        **extra,
    )
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and (delta.content or delta.tool_calls):
            stamps.append(time.perf_counter())
    return _timings(started, stamps)


async def through_chatmem(
    client: httpx.AsyncClient, message: str, scope: str, pid: int
) -> tuple[float, list[float], float]:
    """The same through chatmem: first `message.delta`, gaps, and chatmem's CPU share while streaming."""
    cid = (await client.post("/v1/conversations", json={"title": "bench"})).json()["id"]
    cpu_before = cpu_seconds(pid)
    started = time.perf_counter()
    stamps: list[float] = []
    async with client.stream(
        "POST", f"/v1/conversations/{cid}/messages", json={"content": message, "memory_scope": scope}
    ) as response:
        async for line in response.aiter_lines():
            if line in ("event: message.delta", "event: tool_call.delta"):
                stamps.append(time.perf_counter())
    share = (cpu_seconds(pid) - cpu_before) / (time.perf_counter() - started)
    first, gaps = _timings(started, stamps)
    return first, gaps, share


def _timings(started: float, stamps: list[float]) -> tuple[float, list[float]]:
    if not stamps:
        raise RuntimeError("the model streamed nothing")
    return stamps[0] - started, [b - a for a, b in itertools.pairwise(stamps)]


async def counted(model_server: ModelServer, request: Awaitable[T]) -> tuple[T, float | None]:
    """A request's result and the prompt tokens the server processed for it (None: not reported)."""
    await model_server.wait_idle()
    before = await model_server.prompt_tokens()
    result = await request
    await model_server.wait_idle()
    after = await model_server.prompt_tokens()
    return result, None if before is None or after is None else after - before


def _median_or_na(values: list[float | None]) -> float | str:
    known = [v for v in values if v is not None]
    return round(statistics.median(known)) if known else "n/a"


async def measure(settings: dict[str, str], rounds: int, database_url: str) -> list[dict[str, Any]]:
    base_url, model = settings["LLM_BASE_URL"], settings["LLM_MODEL"]
    key = settings.get("LLM_API_KEY")
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key=key or "not-needed", max_retries=0, timeout=300)
    model_server = ModelServer(base_url, key)
    # The tools chatmem offers with these settings (none for the small local model).
    offers_tools = settings.get("MAX_TOOL_STEPS", "5") != "0"
    tools: list[Any] | None = list(default_registry().schemas()) if offers_tools else None
    questions = iter(QUESTIONS)
    rows = []
    env: dict[str, Any] = {"LLM_TIMEOUT_SECONDS": 300, **settings}
    async with Server(database_url, **env) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=300) as client:
            for fact in FACTS:
                stated = await client.post("/v1/memory/items", json={"text": fact})
                stated.raise_for_status()
            cid = (await client.post("/v1/conversations", json={})).json()["id"]
            system = (await client.get(f"/v1/conversations/{cid}/context")).json()["messages"][0]["content"]
            # Warm the server's cache of the system prompt and chatmem's connections and encoder.
            await direct(sdk, model, system, next(questions), tools)
            await through_chatmem(client, next(questions), "user", server.pid)
            for scope in ("none", "user"):
                d_first, d_gaps, d_tokens, c_first, c_gaps, c_tokens, shares = [], [], [], [], [], [], []
                for _ in range(rounds):
                    message = next(questions)
                    (first, gaps), tokens = await counted(
                        model_server, direct(sdk, model, system, message, tools)
                    )
                    d_first.append(first)
                    d_gaps.append(statistics.median(gaps) if gaps else 0.0)
                    d_tokens.append(tokens)
                    (first, gaps, share), tokens = await counted(
                        model_server, through_chatmem(client, message, scope, server.pid)
                    )
                    c_first.append(first)
                    c_gaps.append(statistics.median(gaps) if gaps else 0.0)
                    c_tokens.append(tokens)
                    shares.append(share)
                df, cf = statistics.median(d_first), statistics.median(c_first)
                dg, cg = statistics.median(d_gaps), statistics.median(c_gaps)
                rows.append(
                    {
                        "memory": "on" if scope == "user" else "off",
                        "rounds": rounds,
                        "direct_ttft_ms": round(df * 1000, 1),
                        "chatmem_ttft_ms": round(cf * 1000, 1),
                        "ttft_added_ms": round((cf - df) * 1000, 1),
                        "ttft_ratio": round(cf / df, 3),
                        "direct_gap_ms": round(dg * 1000, 1),
                        "chatmem_gap_ms": round(cg * 1000, 1),
                        "gap_ratio": round(cg / dg, 3) if dg else "n/a",
                        "direct_prompt_tokens": _median_or_na(d_tokens),
                        "chatmem_prompt_tokens": _median_or_na(c_tokens),
                        "chatmem_cpu_share": round(statistics.median(shares), 3),
                    }
                )
    await sdk.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    most = (len(QUESTIONS) - 2) // 2
    parser.add_argument(
        "--rounds", type=int, default=5, help=f"requests per path and memory setting (≤ {most})"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="reply cap of a local model this starts")
    parser.add_argument("--dir", type=Path, help="the local model's directory (default: its shared install)")
    parser.add_argument("--url", help="a running llama-server's OpenAI base URL (…/v1) instead")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="model name with --url")
    parser.add_argument("--api-key", help="API key with --url")
    parser.add_argument("--database-url")
    parser.add_argument(
        "--out", type=Path, default=Path(tempfile.gettempdir()) / "chatmem-bench" / "real_model.json"
    )
    args = parser.parse_args()
    if not 1 <= args.rounds <= most:
        parser.error(f"--rounds must be between 1 and {most}: every request asks a new question")
    with ExitStack() as stack:
        if args.url:
            settings = {"LLM_PROVIDER": "openai", "LLM_BASE_URL": args.url, "LLM_MODEL": args.model}
            settings |= {"LLM_API_KEY": args.api_key} if args.api_key else {}
        else:
            settings = stack.enter_context(local_model(args.max_tokens, args.dir))
        # No answer is judged here, and direct and chatmem requests share the server's defaults;
        # its sampling is recorded, since it sets how long the replies run.
        sampling = await ModelServer(settings["LLM_BASE_URL"], settings.get("LLM_API_KEY")).sampling()
        print(f"model server sampling: {sampling or 'not reported'}", file=sys.stderr)
        url = stack.enter_context(database(args.database_url))
        rows = await measure(settings, args.rounds, url)
    model = settings["LLM_MODEL"]
    print_table(f"chatmem vs llama-server direct ({model}, p50 of {args.rounds} rounds)", rows, list(rows[0]))
    shown = {k: v for k, v in settings.items() if k != "LLM_API_KEY"}
    payload = {"benchmark": "real_model", "model": model, "settings": shown, "model_sampling": sampling}
    write_json(args.out, payload | {"results": rows})


if __name__ == "__main__":
    asyncio.run(main())

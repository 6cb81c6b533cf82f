"""What chatmem adds to a real model: time to first token and between tokens, and its CPU.

One run against one llama-server (started with `chatmem local-model start`, or `--url` of a
running one): each round sends the same message straight to llama-server with the official
`openai` client, then through chatmem (`chatmem serve` in its own process, SSE), with memory
off (`memory_scope: none`) and on (`user`: embed the query and search). Direct and chatmem
requests alternate, so both see the same machine load. The direct request carries the same
system prompt and tools chatmem sends. Reported: p50 time to the first delta (text or tool call) and
p50 gap between deltas, the ratio and the difference to direct, and chatmem's CPU seconds per
second of streaming (its process's utime+stime from /proc), i.e. the share of one core.

    python bench/real_model.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from common import ROOT, Server, database, free_port, headers, print_table, write_json

from chat_api.cli.local_model import default_dir
from chat_api.tools import default_registry

MESSAGE = "Write four short lines about the sea."


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct(sdk: openai.AsyncOpenAI, model: str, system: str) -> tuple[float, list[float]]:
    """Seconds to the first text delta and the gaps between text deltas, straight to llama-server."""
    started = time.perf_counter()
    stamps: list[float] = []
    stream = await sdk.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": MESSAGE}],
        tools=default_registry().schemas(),  # type: ignore[arg-type]
        stream=True,
    )
    async for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and (delta.content or delta.tool_calls):
            stamps.append(time.perf_counter())
    return _timings(started, stamps)


async def through_chatmem(
    client: httpx.AsyncClient, scope: str, pid: int
) -> tuple[float, list[float], float]:
    """The same through chatmem: first `message.delta`, gaps, and chatmem's CPU share while streaming."""
    cid = (await client.post("/v1/conversations", json={"title": "bench"})).json()["id"]
    cpu_before = cpu_seconds(pid)
    started = time.perf_counter()
    stamps: list[float] = []
    async with client.stream(
        "POST", f"/v1/conversations/{cid}/messages", json={"content": MESSAGE, "memory_scope": scope}
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


def start_model(max_tokens: int) -> tuple[str, str, Path]:
    """Start llama-server with the project's command; its base URL, model and directory."""
    home = default_dir().with_name("local-model-bench")  # its own: never stops the tests' server
    done = subprocess.run(
        [
            sys.executable, "-m", "chat_api.cli", "local-model", "start", "--dir", str(home),
            "--port", str(free_port()), "--threads", "1", "--max-tokens", str(max_tokens),
            "--temperature", "0", "--wait", "300",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"chatmem local-model start failed: {done.stderr.strip()[-500:]}")
    values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return values["LLM_BASE_URL"], values["LLM_MODEL"], home


async def measure(base_url: str, model: str, rounds: int, database_url: str) -> list[dict[str, Any]]:
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=300)
    rows = []
    async with Server(
        database_url, llm_provider="openai", llm_base_url=base_url, llm_model=model, llm_timeout_seconds=300
    ) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=300) as client:
            cid = (await client.post("/v1/conversations", json={})).json()["id"]
            system = (await client.get(f"/v1/conversations/{cid}/context")).json()["messages"][0]["content"]
            await direct(sdk, model, system)  # warm the server's prompt cache and connections
            await through_chatmem(client, "none", server.pid)
            for scope in ("none", "user"):
                d_first, d_gaps, c_first, c_gaps, shares = [], [], [], [], []
                for _ in range(rounds):
                    first, gaps = await direct(sdk, model, system)
                    d_first.append(first)
                    d_gaps.append(statistics.median(gaps))
                    first, gaps, share = await through_chatmem(client, scope, server.pid)
                    c_first.append(first)
                    c_gaps.append(statistics.median(gaps))
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
                        "gap_ratio": round(cg / dg, 3),
                        "chatmem_cpu_share": round(statistics.median(shares), 3),
                    }
                )
    await sdk.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="requests per path and memory setting")
    parser.add_argument("--max-tokens", type=int, default=48, help="reply cap of the server this starts")
    parser.add_argument("--url", help="a running llama-server's OpenAI base URL (…/v1) instead")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="model name with --url")
    parser.add_argument("--database-url")
    parser.add_argument("--out", type=Path, default=Path("bench/results/real_model.json"))
    args = parser.parse_args()
    home = None
    if args.url:
        base_url, model = args.url, args.model
    else:
        base_url, model, home = start_model(args.max_tokens)
    try:
        with database(args.database_url) as url:
            rows = await measure(base_url, model, args.rounds, url)
    finally:
        if home is not None:
            subprocess.run(
                [sys.executable, "-m", "chat_api.cli", "local-model", "stop", "--dir", str(home)],
                cwd=ROOT, timeout=60, check=False,
            )  # fmt: skip
    print_table(
        f"chatmem vs llama-server direct ({model}, p50 of {args.rounds} rounds)",
        rows,
        list(rows[0]),
    )
    write_json(args.out, {"benchmark": "real_model", "model": model, "results": rows})


if __name__ == "__main__":
    asyncio.run(main())

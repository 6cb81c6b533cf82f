"""Does memory make a real model answer right, and what does it cost? The fact-then-question test.

A person states 12 facts about themselves over 4 messages in one conversation; then each of
12 questions (4 with a follow-up: 16 in all) is asked in a new conversation, with memory on
(`memory_scope: user`) and off (`none`). Everything goes through chatmem's own API
(`chatmem serve --with-workers` in its own process, SSE) to any OpenAI-compatible model:
by default the local model (`chatmem local-model` on its shared install: nothing is installed
again, a server already running is used, one this run started is stopped at the end), or
`--url` of any server.

Reported per memory setting: facts answered (the first question of each group: the reply
contains the fact's key word), follow-ups answered, median time to the first text or tool
delta, prompt tokens the model server processed per reply (llama-server's own
`prompt_tokens_total` from `/metrics`, read with the server idle before and after each
reply; "n/a" for servers without it), and replies whose text was a tool call. Memory-off
questions run last, in conversations that are not remembered, so their answers never reach
the memory the memory-on questions read. The prompt is bounded by the server's reply cap
and chatmem's context settings; no answer is ever judged by anything but its key word.
Answers are only counted from a model server that answers greedily: chatmem passes no
temperature or seed to the model, so a running server that samples by default (plain
`chatmem local-model start`) is refused with the command that restarts it at temperature 0;
the server's default sampling (llama-server's `/props`) goes into the JSON.

The chatmem server runs with the settings `chatmem local-model start` prints for its model
(no tools offered, no memory tool), or, with `--url`, chatmem's defaults; `--set KEY=VALUE`
overrides any setting (e.g. `--set MAX_TOOL_STEPS=5` to offer tools).

    python bench/memory_qa.py                       # the local model, memory on and off
    python bench/memory_qa.py --url http://host:8080/v1 --model NAME --api-key KEY
    python bench/memory_qa.py --dir DIR --port 8093 # the local model from its own directory
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import ModelServer, Server, database, headers, local_model, print_table, write_json

# One statement message per row; three facts each.
STATEMENTS = (
    "Some things about me. My sister Mara lives in Porto. My car is a 2009 Volvo. I'm allergic to peanuts.",
    "More about me: my dog is called Biscuit. I work as a nurse at St. Mary's hospital. I was born in 1987.",
    "Also, I play the cello. My wife's name is Ines. My favourite colour is teal.",
    "Last few: I live in Leeds. I've been learning Japanese for two years. My favourite food is ramen.",
)
# Each group is one new conversation: the fact's question, then its follow-ups (key words, any of).
# Consecutive groups ask about facts of different statement messages: two questions in a row
# that recall the same memories would let the model server read the second block from its
# prompt cache, which hides what a memory block costs.
GROUPS: tuple[tuple[tuple[str, tuple[str, ...]], ...], ...] = (
    (("Where does my sister live?", ("porto",)), ("What is her name?", ("mara",))),
    (("What is my dog called?", ("biscuit",)),),
    (("Which instrument do I play?", ("cello",)),),
    (("Which city do I live in?", ("leeds",)),),
    (("What car do I drive?", ("volvo",)), ("What year is it from?", ("2009",))),
    (("What do I do for a living?", ("nurse",)), ("At which hospital?", ("mary",))),
    (("What is my wife's name?", ("ines",)),),
    (
        ("Which language am I learning?", ("japanese",)),
        ("For how long have I been learning it?", ("two", "2 ")),
    ),
    (("What am I allergic to?", ("peanut",)),),
    (("What year was I born?", ("1987",)),),
    (("What is my favourite colour?", ("teal",)),),
    (("What is my favourite food?", ("ramen",)),),
)
# A reply that is a tool call written as text (what the issue saw shown as answers).
TOOL_TEXT = re.compile(r'```json|\{\s*"name"\s*:|"arguments"\s*:|<tool_call>')


@dataclass
class Answer:
    """One question's reply and what it cost."""

    question: str
    memory: str
    follow_up: bool
    correct: bool
    ttft_s: float | None
    prompt_tokens: float | None
    tool_text: bool
    tool_calls: int
    text: str
    memories: list[str] = field(default_factory=list)


async def ask(
    client: httpx.AsyncClient, model: ModelServer, cid: str, content: str, scope: str
) -> dict[str, Any]:
    """Send one message; its reply's text, first-delta time, server prompt tokens, tool calls."""
    await model.wait_idle()
    before = await model.prompt_tokens()
    started = time.perf_counter()
    first: float | None = None
    texts: dict[str, str] = {}
    calls: set[tuple[str, int]] = set()  # (turn, index): each call once, not each of its deltas
    memories: list[str] = []
    event = ""
    async with client.stream(
        "POST", f"/v1/conversations/{cid}/messages", json={"content": content, "memory_scope": scope}
    ) as response:
        if response.status_code != 200:
            raise SystemExit(f"chatmem answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
                continue
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if event in ("message.delta", "tool_call.delta") and first is None:
                first = time.perf_counter() - started
            if event == "message.delta":
                texts[data["turn_id"]] = texts.get(data["turn_id"], "") + data["text"]
            elif event == "tool_call.delta":
                calls.add((data["turn_id"], data["index"]))
            elif event == "memory.retrieved":
                memories = [item["text"] for item in data.get("items", [])]
    await model.wait_idle()
    after = await model.prompt_tokens()
    final = list(texts.values())[-1] if texts else ""
    return {
        "text": final,
        "ttft_s": first,
        "prompt_tokens": None if before is None or after is None else after - before,
        "tool_text": any(TOOL_TEXT.search(t) for t in texts.values()),
        "tool_calls": len(calls),
        "memories": memories,
    }


async def wait_indexed(client: httpx.AsyncClient, count: int, within: float = 120) -> None:
    """Until the indexer holds at least `count` user memories (recall also sees unindexed turns)."""
    async with asyncio.timeout(within):
        while True:
            items = (await client.get("/v1/memory/items", params={"limit": 200})).json()["items"]
            if sum(1 for item in items if item.get("role") == "user") >= count:
                return
            await asyncio.sleep(0.5)


async def run(settings: dict[str, str], database_url: str) -> list[Answer]:
    model = ModelServer(settings["LLM_BASE_URL"], settings.get("LLM_API_KEY"))
    env: dict[str, Any] = {"LLM_TIMEOUT_SECONDS": 600, **settings}
    answers: list[Answer] = []
    async with Server(database_url, with_workers=True, **env) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=900) as client:
            facts = (await client.post("/v1/conversations", json={"title": "about me"})).json()["id"]
            for statement in STATEMENTS:
                await ask(client, model, facts, statement, "user")
            await wait_indexed(client, len(STATEMENTS))
            for scope in ("user", "none"):
                # Memory-off answers are never remembered: they would feed later runs' memory.
                mode = "persistent" if scope == "user" else "none"
                for group in GROUPS:
                    body = {"title": "question", "memory_mode": mode}
                    cid = (await client.post("/v1/conversations", json=body)).json()["id"]
                    for position, (question, keys) in enumerate(group):
                        got = await ask(client, model, cid, question, scope)
                        answers.append(
                            Answer(
                                question=question,
                                memory="on" if scope == "user" else "off",
                                follow_up=position > 0,
                                correct=any(key in got["text"].lower() for key in keys),
                                ttft_s=got["ttft_s"],
                                prompt_tokens=got["prompt_tokens"],
                                tool_text=got["tool_text"],
                                tool_calls=got["tool_calls"],
                                text=got["text"],
                                memories=got["memories"],
                            )
                        )
    return answers


def summarise(answers: list[Answer], load: str) -> list[dict[str, Any]]:
    rows = []
    for memory in ("on", "off"):
        mine = [a for a in answers if a.memory == memory]
        facts = [a for a in mine if not a.follow_up]
        follow = [a for a in mine if a.follow_up]
        ttft = [a.ttft_s for a in mine if a.ttft_s is not None]
        tokens = [a.prompt_tokens for a in mine if a.prompt_tokens is not None]
        rows.append(
            {
                "memory": memory,
                "facts": f"{sum(a.correct for a in facts)}/{len(facts)}",
                "follow_ups": f"{sum(a.correct for a in follow)}/{len(follow)}",
                "ttft_p50_s": round(statistics.median(ttft), 2) if ttft else "n/a",
                "prompt_tokens_p50": round(statistics.median(tokens)) if tokens else "n/a",
                "tool_call_text": sum(a.tool_text for a in mine),
                "tool_calls": sum(a.tool_calls for a in mine),
                "load_1min": load,
            }
        )
    on, off = rows
    if isinstance(on["ttft_p50_s"], float) and isinstance(off["ttft_p50_s"], float) and off["ttft_p50_s"]:
        on["ttft_vs_off"] = round(on["ttft_p50_s"] / off["ttft_p50_s"], 2)
    return rows


def require_greedy(sampling: dict[str, Any] | None, restart: str) -> None:
    """Refuse to count answers from a model server that samples: the counts would be noise.

    chatmem's message API passes no temperature or seed to the model, so the server's own
    default decides; at temperature 0 the same prompt gets the same reply. A server that does
    not report its sampling (no llama-server `/props`) is measured with a warning.
    """
    temperature = sampling.get("temperature") if sampling else None
    if temperature is None:
        print("memory_qa: the model server does not report its sampling; answers may vary run to run",
              file=sys.stderr)  # fmt: skip
        return
    if temperature > 0:
        raise SystemExit(
            f"memory_qa: the model server samples at temperature {temperature:g} (its default), so the "
            f"answer counts would change from run to run. Restart it at temperature 0: {restart}"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="an OpenAI-compatible base URL (…/v1); default: the local model")
    parser.add_argument("--model", help="model name with --url")
    parser.add_argument("--api-key", help="API key with --url")
    parser.add_argument(
        "--max-tokens", type=int, default=200, help="reply cap of the local model this starts"
    )
    parser.add_argument("--dir", type=Path, help="the local model's directory (default: its shared install)")
    parser.add_argument("--port", type=int, help="the local model's port")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a chatmem setting")
    parser.add_argument("--database-url")
    parser.add_argument(
        "--out", type=Path, default=Path(tempfile.gettempdir()) / "chatmem-bench" / "memory_qa.json"
    )
    args = parser.parse_args()
    settings: dict[str, str] = {}
    if args.url:
        settings = {"LLM_PROVIDER": "openai", "LLM_BASE_URL": args.url, "LLM_MODEL": args.model or "default"}
        settings |= {"REWRITE_MODEL": settings["LLM_MODEL"]} | (
            {"LLM_API_KEY": args.api_key} if args.api_key else {}
        )
    with ExitStack() as stack:
        if not args.url:
            settings = stack.enter_context(local_model(args.max_tokens, args.dir, args.port))
        settings |= dict(item.split("=", 1) for item in args.set)
        model_name = settings["LLM_MODEL"]
        sampling = await ModelServer(settings["LLM_BASE_URL"], settings.get("LLM_API_KEY")).sampling()
        where = f" --dir {args.dir}" if args.dir else ""
        require_greedy(
            sampling,
            "start the server with `--temp 0`" if args.url else
            f"chatmem local-model stop{where} && chatmem local-model start{where} --temperature 0 "
            f"--max-tokens {args.max_tokens}",
        )  # fmt: skip
        url = stack.enter_context(database(args.database_url))
        answers = await run(settings, url)
    load = Path("/proc/loadavg").read_text().split()[0]
    rows = summarise(answers, load)
    print_table(f"memory_qa: {model_name}, 12 facts, 16 questions", rows, list(rows[0]))
    shown = {k: v for k, v in settings.items() if k != "LLM_API_KEY"}
    write_json(args.out, {"benchmark": "memory_qa", "model": model_name, "settings": shown,
                          "model_sampling": sampling, "results": rows,
                          "answers": [asdict(a) for a in answers]})  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

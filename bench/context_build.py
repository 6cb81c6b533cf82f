"""Time to build a prompt from a long conversation with `build_context` (target: p50 under 5 ms).

The conversation is synthetic but shaped like real use: user questions of a sentence or
a paragraph, assistant answers of a few paragraphs, about one reply in five calling
tools (some results tens of kilobytes, some calls left unanswered), stopped and failed
replies, partial tool-call arguments, and some Chinese. Memory items are passed too, so
the memory block is part of the cost.

Two timings: *warm*, the same conversation built again and again as a replica does for
successive replies (token counts of unchanged turns come from the cache), and *cold*,
with the token-count cache emptied before every build (a replica that never saw the
conversation). The first build of the process, which loads the tokenizer, is reported
on its own.

    .venv/bin/python bench/context_build.py --turns 1000 --iterations 2000
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from common import print_table, summary_ms, write_json

from memory.prompt.context import ContextBudget, TurnView, build_context
from memory.prompt.templates import load_prompts
from memory.prompt.tokens import clear_count_cache
from memory.recall.found import FoundMemory

WORDS = (
    "the a to of and in that is for it with as on be this was are by at from or have an not but can "
    "database query index latency memory turn prompt model token budget stream result call tool user "
    "deploy cluster replica kafka postgres vector search answer question error retry timeout config"
).split()
CHINESE = [
    "我们明天去北京开会。",
    "这个接口的延迟太高了。",
    "请帮我总结一下上周的讨论。",
    "数据库索引需要重建。",
]


def sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    if rng.random() < 0.1:
        text += " " + rng.choice(CHINESE)
    return text.capitalize() + "."


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng, rng.randint(6, 20)) for _ in range(sentences))


def synthetic_conversation(turns: int, seed: int = 7) -> list[TurnView]:
    """About `turns` turns of a conversation with tools, stops and failures, oldest first."""
    rng = random.Random(seed)
    conversation = uuid.uuid4()
    start = datetime(2025, 1, 1, tzinfo=UTC)
    views: list[TurnView] = []
    calls = 0

    def add(**fields: Any) -> None:
        seq = len(views) + 1
        views.append(
            TurnView(
                seq=seq,
                id=uuid.uuid4(),
                conversation_id=conversation,
                created_at=start + timedelta(minutes=seq),
                **fields,
            )
        )

    while len(views) < turns - 1:
        add(role="user", status="completed", content=paragraph(rng, rng.randint(1, 4)))
        roll = rng.random()
        if roll < 0.2:
            made: list[dict[str, Any]] = []
            for _ in range(rng.randint(1, 2)):
                calls += 1
                state = "streaming" if rng.random() < 0.1 else "succeeded"
                arguments = json.dumps({"query": sentence(rng, 5), "limit": 10})
                if state == "streaming":
                    arguments = arguments[: rng.randint(1, len(arguments) - 1)]
                made.append(
                    {
                        "index": len(made),
                        "id": f"call_{calls}",
                        "name": "search",
                        "arguments": arguments,
                        "state": state,
                    }
                )
            add(role="assistant", status="completed", content="", tool_calls=tuple(made))
            for entry in made:
                if entry["state"] == "succeeded" and rng.random() < 0.9:
                    size = rng.choice([2, 10, 80])
                    add(
                        role="tool",
                        status="completed",
                        tool_call_id=entry["id"],
                        name="search",
                        content=paragraph(rng, size),
                    )
            add(role="assistant", status="completed", content=paragraph(rng, rng.randint(2, 6)))
        elif roll < 0.3:
            add(
                role="assistant",
                status="interrupted_by_user",
                content=paragraph(rng, 1)[: rng.randint(0, 80)],
            )
        elif roll < 0.33:
            add(role="assistant", status="failed", content="")
        elif roll < 0.35:
            add(role="assistant", status="interrupted_by_error", content=paragraph(rng, 2))
        else:
            add(role="assistant", status="completed", content=paragraph(rng, rng.randint(2, 8)))
    add(role="user", status="completed", content=paragraph(rng, 2))
    return views[-turns:] if len(views) > turns else views


def synthetic_memory(count: int, seed: int = 11) -> list[FoundMemory]:
    rng = random.Random(seed)
    return [
        FoundMemory(
            turn_id=uuid.uuid4(),
            text=paragraph(rng, 3),
            created_at=datetime(2024, 6, 1, tzinfo=UTC) + timedelta(days=i),
            conversation_id=uuid.uuid4(),
            conversation_title=rng.choice([None, "Trip planning", "数据库迁移"]),
            role=rng.choice(["user", "assistant"]),
            score=rng.random(),
        )
        for i in range(count)
    ]


def time_builds(turns: list[TurnView], memory: list[FoundMemory], iterations: int, cold: bool) -> list[float]:
    prompts = load_prompts("en")
    budget = ContextBudget()
    samples = []
    for _ in range(iterations):
        if cold:
            clear_count_cache()
        begin = time.perf_counter()
        build_context(turns, prompts=prompts, budget=budget, memory=memory)
        samples.append(time.perf_counter() - begin)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1000, help="turns in the conversation")
    parser.add_argument("--iterations", type=int, default=2000, help="timed builds per mode")
    parser.add_argument("--memory-items", type=int, default=6, help="retrieved memories passed in")
    parser.add_argument("--out", type=Path, default=Path("bench/results/context_build.json"))
    args = parser.parse_args()

    turns = synthetic_conversation(args.turns)
    memory = synthetic_memory(args.memory_items)
    begin = time.perf_counter()
    built = build_context(turns, prompts=load_prompts("en"), budget=ContextBudget(), memory=memory)
    first = time.perf_counter() - begin

    rows = []
    for mode, cold in (("warm", False), ("cold cache", True)):
        time_builds(turns, memory, min(50, args.iterations), cold)
        rows.append({"mode": mode, **summary_ms(time_builds(turns, memory, args.iterations, cold))})
    out = f"{len(built.messages)} messages, {built.token_count} tokens"
    print_table(
        f"build_context on {len(turns)} turns (prompt: {out})",
        rows,
        ["mode", "n", "p50_ms", "p99_ms", "mean_ms"],
    )
    print(f"first build in the process (loads the tokenizer): {first * 1000:.1f} ms")
    write_json(
        args.out,
        {
            "benchmark": "context_build",
            "turns": len(turns),
            "iterations": args.iterations,
            "memory_items": len(memory),
            "prompt_messages": len(built.messages),
            "prompt_tokens": built.token_count,
            "dropped": built.dropped,
            "first_build_ms": round(first * 1000, 2),
            "results": rows,
            "target_p50_ms": 5.0,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    )


if __name__ == "__main__":
    main()

"""Time the backend adds before the first token, at 1 and at N concurrent streams.

The demo model emits its first token immediately, so the time from sending the message
to receiving the first `message.delta` is what chatmem adds: auth, validation, storing
the user and assistant turns, building the prompt, starting the stream. Each of the N
clients sends its next message shortly after its previous reply has ended, so about N
replies are always streaming at once (each ~1.5 s at the default demo rate).

The demo's replies all have the same length, so clients that started together would
stay in lockstep and send in bursts of N at the same instant. The clients' starts are
spread over one reply's duration and each waits a random 0–100 ms before its next
message, so arrivals are spread as real users' are. Replies are `--reply-words` long with
memory on and off alike (DEMO_REPLY_WORDS): left to itself the demo model quotes the
memories it was given, which makes a memory-on reply two to three times as long and so
the server busier during memory-on cells than during memory-off ones.

With memory on, recall searches the user's memory. Empty, that flatters memory's cost:
`--memory-rows N` first imports N turns of varied text into each measuring user's memory
(through the import API, indexed by the server's indexer before the clock starts), and
every message asks something different, so neither the search nor a cache sees the same
question twice.

Every such question stands alone, and a message that stands alone has its query encoded
while its reply is accepted (memory/recall/prepared_queries.py), which hides most of the
encode. A follow-up ("What about her?") leans on earlier turns: its query is rewritten
after the window is read and encoded then, as before. `--follow-ups F` makes that share
of each client's messages follow-ups and reports them in rows of their own
(`messages`: standalone / follow-up), so the table shows both costs.

    python bench/ttft.py --concurrency 1 32 --requests 200 --memory-rows 0 2000
    python bench/ttft.py --concurrency 1 --requests 120 --follow-ups 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path

import httpx
from common import Server, database, headers, print_table, summary_ms, write_json

from chat_api.cli.imports import create_conversation, post_turns, wait_until_indexed

REPLY_WORDS = 60  # the demo model's replies, with memory on and off alike
REPLY_SECONDS = 1.5  # a demo reply of REPLY_WORDS at 40 tokens/s

# Words the memory's turns and the messages are made of: varied enough that no two texts
# are alike, so that neither the keyword nor the dense search finds the same rows each time.
PLACES = ("Lisbon", "Kyoto", "Leeds", "Porto", "Oslo", "Quito", "Hanoi", "Tunis", "Perth", "Cork")
PEOPLE = ("my sister", "Mara", "my neighbour", "our coach", "Ines", "my boss", "Tomas", "grandma")
THINGS = (
    "the bike",
    "a sourdough starter",
    "the tax form",
    "a violin",
    "the garden shed",
    "my Volvo",
    "the night shift",
    "a Japanese course",
    "the marathon",
    "a rescue dog",
)
TURNS_PER_IMPORT = 500


def remembered_text(rng: random.Random) -> str:
    """One turn of a user's past chats: a statement about their life, never the same twice."""
    return (
        f"In {rng.choice(('March', 'June', 'October', 'December'))} {rng.randint(2015, 2025)} "
        f"{rng.choice(PEOPLE)} and I took {rng.choice(THINGS)} to {rng.choice(PLACES)}; "
        f"it cost {rng.randint(10, 900)} euros and took {rng.randint(2, 60)} days."
    )


def question(rng: random.Random, i: int) -> str:
    """A message that makes recall search: a different question each time."""
    return (
        f"What did {rng.choice(PEOPLE)} say about {rng.choice(THINGS)} in "
        f"{rng.choice(PLACES)}? (question {i})"
    )


PRONOUNS = ("her", "him", "them", "it", "that")


def follow_up(rng: random.Random, i: int) -> str:
    """A message that leans on the earlier turns (a reference word): recall rewrites it first."""
    return f"And what about {rng.choice(PRONOUNS)} in {rng.choice(PLACES)}? ({i})"


async def fill_memory(url: str, users: list[str], rows: int) -> None:
    """Import `rows` varied turns into each user's memory and wait until they are indexed."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        targets: dict[str, dict[str, int]] = {}
        for user in users:
            rng = random.Random(f"memory-{user}")
            auth = headers(user=user)
            cid = await create_conversation(client, auth, "past chats")
            for start in range(0, rows, TURNS_PER_IMPORT):
                turns = [
                    {"role": "user" if i % 2 == 0 else "assistant", "content": remembered_text(rng)}
                    for i in range(start, min(rows, start + TURNS_PER_IMPORT))
                ]
                answer = await post_turns(client, auth, cid, turns)
            targets[user] = {cid: int(answer["last_seq"])}
        for user, target in targets.items():
            if not await wait_until_indexed(client, headers(user=user), target, timeout=3600):
                raise RuntimeError(f"{user}'s memory was not indexed within an hour")


async def one_client(
    url: str,
    user: str,
    count: int,
    samples: dict[str, list[float]],
    start_delay: float,
    scope: str,
    follow_ups: float = 0.0,
) -> None:
    rng = random.Random(user)
    kinds = random.Random(f"{user}-kinds")  # apart, so that the questions stay those of --follow-ups 0
    async with httpx.AsyncClient(base_url=url, headers=headers(user=user), timeout=60) as client:
        cid = (await client.post("/v1/conversations", json={"title": "ttft", "memory_mode": "none"})).json()[
            "id"
        ]
        await asyncio.sleep(start_delay)
        for i in range(count):
            await asyncio.sleep(rng.uniform(0, 0.1))
            kind = "follow-up" if i > 0 and kinds.random() < follow_ups else "standalone"
            content = follow_up(rng, i) if kind == "follow-up" else question(rng, i)
            started = time.perf_counter()
            first = None
            async with client.stream(
                "POST",
                f"/v1/conversations/{cid}/messages",
                json={"content": content, "memory_scope": scope},
            ) as response:
                async for line in response.aiter_lines():
                    if first is None and line == "event: message.delta":
                        first = time.perf_counter() - started
                # read to the end: the next message may only be sent once this reply is over
            if first is not None and i > 0:  # the first request of a client warms its connection
                samples.setdefault(kind, []).append(first)


def client_users(scope: str, concurrency: int, memory_rows: int, workers: int = 1) -> list[str]:
    """The measuring users of one cell: fresh ones per cell, so no user's memory is filled twice."""
    return [f"{scope}-rows{memory_rows}-w{workers}-c{concurrency}-user{c}" for c in range(concurrency)]


async def measure(
    url: str,
    concurrency: int,
    requests: int,
    scope: str,
    memory_rows: int = 0,
    workers: int = 1,
    follow_ups: float = 0.0,
) -> list[dict]:
    """One row per kind of message sent (standalone, and follow-up with ``follow_ups`` > 0)."""
    samples: dict[str, list[float]] = {}
    per_client = max(2, requests // concurrency + 1)
    spread = REPLY_SECONDS / concurrency
    users = client_users(scope, concurrency, memory_rows, workers)
    await asyncio.gather(
        *(
            one_client(url, user, per_client, samples, c * spread, scope, follow_ups)
            for c, user in enumerate(users)
        )
    )
    return [
        {
            "memory": scope,
            "memory_rows": memory_rows,
            "concurrency": concurrency,
            "messages": kind,
            **summary_ms(samples[kind]),
        }
        for kind in ("standalone", "follow-up")
        if samples.get(kind)
    ]


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, default=200, help="measured requests per concurrency level")
    parser.add_argument(
        "--memory",
        nargs="+",
        default=["none", "user"],
        choices=["none", "user"],
        help="memory_scope of the messages: none skips recall; user embeds the query and searches",
    )
    parser.add_argument(
        "--memory-rows",
        type=int,
        nargs="+",
        default=[0],
        help="turns imported into each measuring user's memory first (memory 'user' only; 0: empty)",
    )
    parser.add_argument(
        "--follow-ups",
        type=float,
        default=0.0,
        help="share of messages that lean on earlier turns (not encoded ahead); reported apart",
    )
    parser.add_argument("--rate", type=float, default=40.0, help="demo tokens per second per stream")
    parser.add_argument(
        "--reply-words",
        type=int,
        default=REPLY_WORDS,
        help="the demo model's reply length, the same with memory on and off (DEMO_REPLY_WORDS)",
    )
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="API processes (serve --workers N)"
    )
    parser.add_argument("--database-url")
    parser.add_argument("--url", help="measure an already running server (JWT_SECRET as in bench/common.py)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/ttft.json"))
    args = parser.parse_args()
    # (memory scope, rows in each user's memory): memory off never searches, so it runs once.
    cells = [(m, n) for m in args.memory for n in (args.memory_rows if m == "user" else [0])]
    filling = max(args.memory_rows) > 0
    if args.url:
        rows = []
        for m, n in cells:
            for c in args.concurrency:
                if n:
                    await fill_memory(args.url, client_users(m, c, n), n)
                rows.extend(await measure(args.url, c, args.requests, m, n, follow_ups=args.follow_ups))
    else:
        rows = []
        with database(args.database_url) as url:
            for workers in args.workers:
                # --workers N: N API processes on one port; each client's connection stays on one.
                extra = ["--workers", str(workers)] if workers > 1 else []
                async with Server(
                    url,
                    # The indexer indexes the imported memory before the clock starts.
                    with_workers=filling,
                    args=extra,
                    demo_first_token_delay_seconds=0,
                    demo_tokens_per_second=args.rate,
                    demo_reply_words=args.reply_words,
                    IMPORT_TURNS_PER_HOUR=0,  # no import quota for the filling
                ) as server:
                    for m, n in cells:
                        for c in args.concurrency:
                            if n:
                                await fill_memory(server.url, client_users(m, c, n, workers), n)
                            load = os.getloadavg()[0]
                            measured = await measure(
                                server.url, c, args.requests, m, n, workers, args.follow_ups
                            )
                            after = os.getloadavg()[0]
                            rows.extend(
                                {
                                    "workers": workers,
                                    **row,
                                    "load_1m": [round(load, 1), round(after, 1)],
                                }
                                for row in measured
                            )
    print_table(
        "Time added before the first token (demo model, first token immediate)",
        rows,
        [
            "workers",
            "memory",
            "memory_rows",
            "concurrency",
            "messages",
            "n",
            "p50_ms",
            "p95_ms",
            "p99_ms",
            "mean_ms",
            "load_1m",
        ],
    )
    write_json(
        args.out, {"benchmark": "ttft", "targets": {"32": {"p50_ms": 15, "p99_ms": 60}}, "results": rows}
    )


if __name__ == "__main__":
    asyncio.run(main())

"""Retrieval quality on the LongMemEval slice (assistant-style chats) as a user gets it.

A real `chatmem serve --with-workers` process (its own embedded Postgres) receives every
session of the slice through the import API, pooled in ONE user: one chatmem conversation
per session, its turns imported with the session's date (30 seconds apart, so their order
survives), no speaker names, each turn's ``external_id`` = ``<session id>:<turn index>``.
Once everything is indexed, every question goes to ``POST /v1/memory/search`` (k = 20) one
at a time. Printed and written as JSON:

- turn recall@1/5/10/20 (the share of the question's ``has_answer`` turns in the top k),
  overall and per question type; session hit@k (any top-k turn from an answer session);
- search latency p50/p95 as the client sees it;
- the baselines of the slice's README computed in the same run on the same pool: BM25
  (k1 1.2, b 0.75, lower-cased word tokens) and dense all-MiniLM-L6-v2 cosine (the
  packaged encoder), each over the turns' own text.

    python bench/longmemeval_eval.py --data ../shared/bench/longmemeval_dev.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import SECRET, Server, database, percentile, write_json

from chat_api.auth import issue_token
from chat_api.cli.imports import create_conversation, post_turns, wait_until_indexed
from memory.config import default_embedding_model
from memory.recall.embeddings import SentenceTransformerEmbedder

ROOT = Path(__file__).resolve().parent.parent
KS = (1, 5, 10, 20)
TENANT = "longmemeval"
USER = "pooled"
DATE_FORMAT = "%Y/%m/%d (%a) %H:%M"
TURN_SPACING = timedelta(seconds=30)
RATE_LIMIT_PER_MINUTE = 1_000_000
BM25_K1 = 1.2
BM25_B = 0.75
_WORD = re.compile(r"\w+")


@dataclass
class Question:
    question_id: str
    type: str
    text: str
    evidence: set[str]  # external ids of its has_answer turns
    answer_sessions: set[str]


@dataclass
class Pool:
    """Every distinct session of the slice, in file order, and the questions."""

    sessions: dict[str, tuple[datetime, list[dict[str, Any]]]]
    questions: list[Question]

    def turns(self) -> list[tuple[str, str]]:
        """(external id, text) of every pooled turn."""
        return [
            (f"{sid}:{i}", turn["content"])
            for sid, (_, turns) in self.sessions.items()
            for i, turn in enumerate(turns)
        ]


def load_pool(path: Path, limit: int = 0, picked: Sequence[int] = ()) -> Pool:
    """The slice's sessions (each once) and questions; ``limit``: the first questions only;
    ``picked``: these questions (positions in the file) only."""
    raw = json.loads(path.read_text())
    if picked:
        raw = [raw[i] for i in picked]
    if limit:
        raw = raw[:limit]
    sessions: dict[str, tuple[datetime, list[dict[str, Any]]]] = {}
    questions = []
    for q in raw:
        evidence = set()
        for sid, date, turns in zip(
            q["haystack_session_ids"], q["haystack_dates"], q["haystack_sessions"], strict=True
        ):
            sessions.setdefault(sid, (datetime.strptime(date, DATE_FORMAT).replace(tzinfo=UTC), turns))
            evidence |= {f"{sid}:{i}" for i, t in enumerate(turns) if t.get("has_answer")}
        if evidence:
            questions.append(
                Question(
                    q["question_id"],
                    q["question_type"],
                    q["question"],
                    evidence,
                    set(q["answer_session_ids"]),
                )
            )
    return Pool(sessions, questions)


def session_of(external_id: str) -> str:
    return external_id.rsplit(":", 1)[0]


def token() -> str:
    return issue_token(SECRET, TENANT, USER)


async def load(server_url: str, pool: Pool) -> float:
    """Import every session as its own conversation of the one user; wait until indexed."""
    headers = {"Authorization": f"Bearer {token()}"}
    started = time.perf_counter()
    targets: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=server_url, timeout=300) as client:
        for sid, (date, turns) in pool.sessions.items():
            conversation_id = await create_conversation(client, headers, f"session {sid}")
            body = [
                {
                    "role": turn["role"],
                    "content": turn["content"],
                    "created_at": (date + TURN_SPACING * i).isoformat(),
                    "external_id": f"{sid}:{i}",
                }
                for i, turn in enumerate(turns)
            ]
            answer = await post_turns(client, headers, conversation_id, body)
            targets[conversation_id] = answer["last_seq"]
        if not await wait_until_indexed(client, headers, targets, timeout=3600):
            raise TimeoutError("the pool was not indexed within an hour")
    seconds = round(time.perf_counter() - started, 1)
    print(f"{len(pool.turns())} turns in {len(pool.sessions)} sessions imported and indexed in {seconds} s")
    return seconds


async def ask_all(server_url: str, questions: Sequence[Question]) -> tuple[list[list[str]], list[float]]:
    headers = {"Authorization": f"Bearer {token()}"}
    found, seconds = [], []
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
        for q in questions:
            started = time.perf_counter()
            response = await client.post(
                "/v1/memory/search", json={"query": q.text, "k": max(KS)}, headers=headers
            )
            seconds.append(time.perf_counter() - started)
            response.raise_for_status()
            found.append([str(item["external_id"]) for item in response.json()["items"]])
    return found, seconds


def bm25_rankings(pool: Pool, questions: Sequence[Question]) -> list[list[str]]:
    ids, texts = zip(*pool.turns(), strict=True)
    docs = [Counter(_WORD.findall(t.lower())) for t in texts]
    lengths = np.array([sum(d.values()) for d in docs], dtype=float)
    average = lengths.mean()
    df: Counter[str] = Counter(w for d in docs for w in d)
    n = len(docs)
    out = []
    for q in questions:
        scores = np.zeros(n)
        for word in set(_WORD.findall(q.text.lower())):
            if word not in df:
                continue
            idf = math.log(1 + (n - df[word] + 0.5) / (df[word] + 0.5))
            tf = np.array([d.get(word, 0) for d in docs], dtype=float)
            scores += idf * tf * (BM25_K1 + 1) / (tf + BM25_K1 * (1 - BM25_B + BM25_B * lengths / average))
        out.append([ids[i] for i in np.argsort(-scores, kind="stable")[: max(KS)]])
    return out


def dense_rankings(pool: Pool, questions: Sequence[Question]) -> list[list[str]]:
    ids, texts = zip(*pool.turns(), strict=True)
    embedder = SentenceTransformerEmbedder(default_embedding_model())
    embedder.load(threads=1)
    docs = np.asarray(embedder.encode_sync(list(texts)))
    queries = np.asarray(embedder.encode_sync([q.text for q in questions]))
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return [[ids[i] for i in np.argsort(-row, kind="stable")[: max(KS)]] for row in queries @ docs.T]


def recall_table(questions: Sequence[Question], rankings: Sequence[list[str]]) -> dict[str, dict[str, float]]:
    groups: dict[str, list[tuple[Question, list[str]]]] = defaultdict(list)
    for q, found in zip(questions, rankings, strict=True):
        groups["overall"].append((q, found))
        groups[q.type].append((q, found))
    out = {}
    for name in ["overall", *sorted(k for k in groups if k != "overall")]:
        members = groups[name]
        row: dict[str, float] = {
            f"R@{k}": round(
                statistics.fmean(len(set(f[:k]) & q.evidence) / len(q.evidence) for q, f in members), 3
            )
            for k in KS
        }
        for k in (5, 10):
            row[f"S@{k}"] = round(
                statistics.fmean(any(session_of(x) in q.answer_sessions for x in f[:k]) for q, f in members),
                3,
            )
        row["n"] = len(members)
        out[name] = row
    return out


def print_table(title: str, table: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    columns = [*(f"R@{k}" for k in KS), "S@5", "S@10"]
    print(f"{'set':<27}{'n':>4}" + "".join(f"{c:>7}" for c in columns))
    for name, row in table.items():
        print(f"{name:<27}{row['n']:>4}" + "".join(f"{row[c]:>7.3f}" for c in columns))


async def run(args: argparse.Namespace, database_url: str) -> dict[str, Any]:
    pool = load_pool(args.data, args.limit_questions, getattr(args, "questions", None) or ())
    questions = pool.questions
    async with Server(
        database_url, with_workers=not args.no_load, rate_limit_per_minute=RATE_LIMIT_PER_MINUTE
    ) as server:
        load_seconds = 0.0 if args.no_load else await load(server.url, pool)
        found, seconds = await ask_all(server.url, questions)
    ms = [s * 1000 for s in seconds]
    result: dict[str, Any] = {
        "benchmark": "longmemeval_eval",
        "data": str(args.data),
        "sessions": len(pool.sessions),
        "turns": len(pool.turns()),
        "questions": len(questions),
        "k": max(KS),
        "load_seconds": load_seconds,
        "chatmem": recall_table(questions, found),
        "search_latency": {
            "n": len(ms),
            "p50_ms": round(percentile(ms, 50), 2),
            "p95_ms": round(percentile(ms, 95), 2),
        },
        "found": {q.question_id: f for q, f in zip(questions, found, strict=True)},
    }
    if not args.no_baselines:
        result["baselines"] = {
            "bm25": recall_table(questions, bm25_rankings(pool, questions)),
            "dense": recall_table(questions, await asyncio.to_thread(dense_rankings, pool, questions)),
        }
    return result


def print_report(result: dict[str, Any]) -> None:
    print_table("chatmem (POST /v1/memory/search)", result["chatmem"])
    for name, table in result.get("baselines", {}).items():
        print_table(f"baseline {name}, same pool", table)
    lat = result["search_latency"]
    print(f"\nsearch latency p50 {lat['p50_ms']} ms, p95 {lat['p95_ms']} ms (n={lat['n']})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", type=Path, default=ROOT.parent / "shared" / "bench" / "longmemeval_dev.json"
    )
    parser.add_argument(
        "--limit-questions", type=int, default=0, help="the first N questions and their sessions"
    )
    parser.add_argument(
        "--questions", type=int, nargs="*", default=[], help="only these questions (0-based positions)"
    )
    parser.add_argument(
        "--no-load", action="store_true", help="the pool is already in --database-url: only ask (latency A/B)"
    )
    parser.add_argument("--no-baselines", action="store_true", help="skip BM25 and dense over the same pool")
    parser.add_argument("--out", type=Path, default=Path("bench/results/longmemeval_eval.json"))
    parser.add_argument(
        "--database-url", help="an empty Postgres with pgvector; default: a private embedded one"
    )
    args = parser.parse_args()
    with database(args.database_url) as url:
        result = asyncio.run(run(args, url))
    print_report(result)
    write_json(args.out, result)


if __name__ == "__main__":
    main()

"""Retrieval quality on the LoCoMo slice as a user gets it: a real server, its HTTP API only.

A real `chatmem serve --with-workers` process (its own embedded Postgres, a rate limit set
explicitly and generously so that it never answers 429 here) receives every LoCoMo
conversation through the import API, one chatmem user per LoCoMo conversation, in two
layouts, each its own tenant:

- ``conversation``: one chatmem conversation holding all sessions of a LoCoMo conversation;
- ``session``: one chatmem conversation per session.

Once every conversation's ``indexed_seq`` reached its last turn (the server's own
indexer did the work), every question goes to ``POST /v1/memory/search`` (k = 20, the
user's whole memory) one at a time, and the items' ``external_id`` (the LoCoMo dia id)
is compared with the evidence. Printed and written as JSON: recall@1/5/10/20 overall
(categories 1-4) and per category, adversarial questions (category 5) on their own,
search latency p50/p95 as the client sees it, and the baselines of the slice's README.

``--cv`` adds a cross-validation: the data is loaded once, then one server per
configuration of ``--grid NAME=v1,v2`` (settings as environment variables; query-time
settings only, since the index is built once) answers every question; for each split
the configuration best on three conversations (mean recall@10, categories 1-4, both
layouts) is measured on the other two, beside the default configuration.

    python bench/memory_eval.py --data ../shared/bench/locomo_dev.json
    python bench/memory_eval.py --cv --grid MEMORY_KEYWORD_WEIGHT=1,1.5,2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from common import SECRET, Server, database, percentile, write_json
from locomo_import import Layout, import_locomo, wait_until_searchable

from chat_api.auth import issue_token

ROOT = Path(__file__).resolve().parent.parent
KS = (1, 5, 10, 20)
LAYOUTS: tuple[Layout, ...] = ("conversation", "session")
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
ADVERSARIAL = 5
# Far above what the benchmark sends (one request at a time): a 429 would void a question.
RATE_LIMIT_PER_MINUTE = 1_000_000
# The slice's README: best single baseline overall, and per category (R@5, R@10).
BASELINE_OVERALL = {
    "BM25 dated": {"R@1": 0.323, "R@5": 0.537, "R@10": 0.609},
    "hybrid dated": {"R@1": 0.293, "R@5": 0.524, "R@10": 0.606},
}
BASELINE_CATEGORY = {
    "multi-hop": {"R@5": 0.240, "R@10": 0.320},
    "temporal": {"R@5": 0.720, "R@10": 0.804},
    "open-domain": {"R@5": 0.239, "R@10": 0.305},
    "single-hop": {"R@5": 0.618, "R@10": 0.693},
}
# Tune on three conversations, measure on the other two; the second split the other way round.
CV_SPLITS = ((0, 1, 2), (2, 3, 4))
_EVIDENCE_ID = re.compile(r"D:?(\d+):0*(\d+)$")


@dataclass
class Question:
    sample_id: str
    text: str
    category: int
    evidence: list[str]


@dataclass
class Answer:
    """One question's outcome in one layout under one configuration."""

    question: Question
    layout: str
    found: list[str]
    seconds: float

    def recall(self, k: int) -> float:
        return len(set(self.found[:k]) & set(self.question.evidence)) / len(self.question.evidence)


@dataclass
class Slice:
    sample_ids: list[str]
    questions: list[Question] = field(default_factory=list)
    skipped: int = 0


def normalise_evidence(raw: Iterable[str], known: set[str]) -> list[str]:
    """Evidence ids as ``D<session>:<turn>``, split, repaired, and dropped when they name no turn."""
    ids: list[str] = []
    for entry in raw:
        for part in re.split(r"[;,\s]+", str(entry)):
            match = _EVIDENCE_ID.match(part.strip())
            if match:
                dia_id = f"D{int(match.group(1))}:{int(match.group(2))}"
                if dia_id in known and dia_id not in ids:
                    ids.append(dia_id)
    return ids


def load_questions(path: Path, limit: int = 0) -> Slice:
    """The slice's questions with normalised evidence (annotations are never read)."""
    raw_samples = json.loads(path.read_text())
    if limit:
        raw_samples = raw_samples[:limit]
    data = Slice([str(s["sample_id"]) for s in raw_samples])
    for raw in raw_samples:
        conv = raw["conversation"]
        known = {
            t["dia_id"] for key, turns in conv.items() if re.fullmatch(r"session_\d+", key) for t in turns
        }
        for qa in raw["qa"]:
            evidence = normalise_evidence(qa.get("evidence", []), known)
            if not evidence:
                data.skipped += 1
                continue
            data.questions.append(Question(str(raw["sample_id"]), qa["question"], qa["category"], evidence))
    return data


def tenant_of(layout: str) -> str:
    return f"locomo-{layout}"


async def load(server_url: str, data_path: Path, sample_ids: list[str]) -> dict[str, float]:
    """Import every sample in both layouts and wait until indexed; seconds per layout."""
    token_for = partial(issue_token, SECRET)
    seconds = {}
    async with httpx.AsyncClient(base_url=server_url, timeout=300) as client:
        for layout in LAYOUTS:
            started = time.perf_counter()
            imported = await import_locomo(
                client,
                data_path,
                token_for=token_for,
                tenant=tenant_of(layout),
                sample_ids=sample_ids,
                layout=layout,
            )
            if not await wait_until_searchable(client, imported, token_for=token_for, timeout=3600):
                raise TimeoutError(f"the {layout} layout was not indexed within an hour")
            seconds[layout] = round(time.perf_counter() - started, 1)
            print(
                f"{layout} layout: {sum(i.created for i in imported)} turns imported"
                f" and indexed in {seconds[layout]} s"
            )
    return seconds


async def ask_all(server_url: str, questions: Sequence[Question]) -> list[Answer]:
    """Every question through `POST /v1/memory/search` in both layouts, one request at a time."""
    answers = []
    async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
        for layout in LAYOUTS:
            for question in questions:
                headers = {
                    "Authorization": f"Bearer {issue_token(SECRET, tenant_of(layout), question.sample_id)}"
                }
                started = time.perf_counter()
                response = await client.post(
                    "/v1/memory/search", json={"query": question.text, "k": max(KS)}, headers=headers
                )
                seconds = time.perf_counter() - started
                response.raise_for_status()
                found = [str(item["external_id"]) for item in response.json()["items"]]
                answers.append(Answer(question, layout, found, seconds))
    return answers


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 3) if values else float("nan")


def recall_table(answers: Sequence[Answer]) -> dict[str, dict[str, float]]:
    """Recall@k overall (categories 1-4), per category and adversarial, with counts."""
    groups: dict[str, list[Answer]] = defaultdict(list)
    for answer in answers:
        category = answer.question.category
        if category == ADVERSARIAL:
            groups["adversarial"].append(answer)
        else:
            groups["overall"].append(answer)
            groups[CATEGORIES[category]].append(answer)
    order = ["overall", *CATEGORIES.values(), "adversarial"]
    return {
        name: {f"R@{k}": _mean([a.recall(k) for a in groups[name]]) for k in KS} | {"n": len(groups[name])}
        for name in order
        if groups[name]
    }


def latency(answers: Sequence[Answer]) -> dict[str, float]:
    ms = [a.seconds * 1000 for a in answers]
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p95_ms": round(percentile(ms, 95), 2)}


def summarise(answers: Sequence[Answer]) -> dict[str, Any]:
    """Per layout: the recall table and latency; plus both layouts together."""
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        mine = [a for a in answers if a.layout == layout]
        out[layout] = {"recall": recall_table(mine), "search_latency": latency(mine)}
    out["both_layouts_search_latency"] = latency(answers)
    return out


def score(answers: Iterable[Answer], samples: Iterable[str], k: int = 10) -> float:
    """Mean recall@k over categories 1-4 of the given samples, both layouts."""
    wanted = set(samples)
    values = [
        a.recall(k) for a in answers if a.question.sample_id in wanted and a.question.category != ADVERSARIAL
    ]
    return statistics.fmean(values) if values else float("nan")


def cross_validate(
    runs: dict[str, list[Answer]], sample_ids: list[str], default: str
) -> list[dict[str, Any]]:
    """For each split: the configuration best on the tune conversations, measured on the others."""
    out = []
    for tune_idx in CV_SPLITS:
        tune = [sample_ids[i] for i in tune_idx if i < len(sample_ids)]
        test = [s for s in sample_ids if s not in tune]
        if not tune or not test:
            continue
        best = max(runs, key=lambda name: score(runs[name], tune))
        out.append(
            {
                "tune": tune,
                "test": test,
                "chosen": best,
                "tune_R@10": {name: round(score(answers, tune), 3) for name, answers in runs.items()},
                "test_chosen": {f"R@{k}": round(score(runs[best], test, k), 3) for k in (5, 10)},
                "test_default": {f"R@{k}": round(score(runs[default], test, k), 3) for k in (5, 10)},
            }
        )
    return out


def grid_configs(grid: list[str]) -> dict[str, dict[str, str]]:
    """``NAME=v1,v2`` options as named environment sets: the default first, then every combination."""
    axes = []
    for option in grid:
        name, _, values = option.partition("=")
        if not name or not values:
            raise SystemExit(f"--grid takes NAME=v1,v2 (got {option!r})")
        axes.append([(name.upper(), v) for v in values.split(",")])
    configs: dict[str, dict[str, str]] = {"default": {}}
    for combination in itertools.product(*axes) if axes else []:
        configs[" ".join(f"{n}={v}" for n, v in combination)] = dict(combination)
    return configs


def print_report(result: dict[str, Any]) -> None:
    print_layouts(result["layouts"])
    for name, config in result.get("configs", {}).items():
        if name != "default":
            print(f"\nconfiguration {name}:")
            print_layouts(config["layouts"])
    for split in result.get("cross_validation", []):
        print(
            f"\ncv: tune on {', '.join(split['tune'])} -> chose {split['chosen']!r};"
            f" on {', '.join(split['test'])}:"
            f" chosen R@5 {split['test_chosen']['R@5']:.3f} R@10 {split['test_chosen']['R@10']:.3f},"
            f" default R@5 {split['test_default']['R@5']:.3f} R@10 {split['test_default']['R@10']:.3f}"
        )


def print_layouts(layouts: dict[str, Any]) -> None:
    for layout in LAYOUTS:
        table = layouts[layout]["recall"]
        lat = layouts[layout]["search_latency"]
        print(f"\nlayout: {layout} (one chatmem conversation per LoCoMo {layout})")
        print(f"{'set':<13}{'n':>5}" + "".join(f"{'R@' + str(k):>8}" for k in KS) + "   baseline R@5/R@10")
        for name, row in table.items():
            base = BASELINE_CATEGORY.get(name) or (
                BASELINE_OVERALL["BM25 dated"] if name == "overall" else None
            )
            tail = f"   {base['R@5']:.3f}/{base['R@10']:.3f}" if base else ""
            print(f"{name:<13}{row['n']:>5}" + "".join(f"{row[f'R@{k}']:>8.3f}" for k in KS) + tail)
        print(f"search latency p50 {lat['p50_ms']} ms, p95 {lat['p95_ms']} ms (n={lat['n']})")


async def run(args: argparse.Namespace, database_url: str) -> dict[str, Any]:
    data = load_questions(args.data, args.limit_conversations)
    configs = grid_configs(args.grid) if args.cv else {"default": {}}
    env = {"rate_limit_per_minute": RATE_LIMIT_PER_MINUTE}
    runs: dict[str, list[Answer]] = {}
    loading: dict[str, float] = {}
    for index, (name, overrides) in enumerate(configs.items()):
        # The first server also runs the indexer that loads the data; later ones only answer.
        async with Server(database_url, with_workers=index == 0, **env, **overrides) as server:
            if index == 0 and not args.no_load:
                loading = await load(server.url, args.data, data.sample_ids)
            runs[name] = await ask_all(server.url, data.questions)
        if args.cv:
            print(f"config {name!r}: R@10 {score(runs[name], data.sample_ids):.3f}")
    result: dict[str, Any] = {
        "benchmark": "memory_eval",
        "data": str(args.data),
        "conversations": data.sample_ids,
        "skipped_questions": data.skipped,
        "k": max(KS),
        "rate_limit_per_minute": RATE_LIMIT_PER_MINUTE,
        "load_seconds": loading,
        "layouts": summarise(runs["default"]),
        "baselines": {"overall": BASELINE_OVERALL, "per_category": BASELINE_CATEGORY},
    }
    if args.cv:
        result["configs"] = {
            name: {
                "env": configs[name],
                **{
                    layout: recall_table([a for a in answers if a.layout == layout])["overall"]
                    for layout in LAYOUTS
                },
                # Per category and latency too: configurations are compared on all of it.
                "layouts": summarise(answers),
            }
            for name, answers in runs.items()
        }
        result["cross_validation"] = cross_validate(runs, data.sample_ids, "default")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "bench" / "locomo_dev.json")
    parser.add_argument("--limit-conversations", type=int, default=0)
    parser.add_argument("--cv", action="store_true", help="cross-validate the --grid configurations")
    parser.add_argument(
        "--grid", nargs="*", default=[], help="NAME=v1,v2: query-time settings to try with --cv"
    )
    parser.add_argument(
        "--no-load",
        action="store_true",
        help="the slice is already in --database-url: only ask (latency A/B)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/memory_eval.json"))
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

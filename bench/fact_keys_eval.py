"""Fact keys on LongMemEval questions: recall with and without them on one pool, and their cost.

A real `chatmem serve --with-workers` with ``FACT_KEYS=model``, pointed at an OpenAI-compatible
model server (the local one: `chatmem local-model start` prints its settings), loads the
chosen questions' sessions pooled in one user through the import API (as
bench/longmemeval_eval.py does); its indexer asks the model for the facts of every user turn
of at least 100 characters. Every question is asked through `POST /v1/memory/search`; then the
fact rows are deleted and the same questions asked again on the same pool (the chunks and
sentence keys stay exactly as they were). Printed and written as JSON: R@1/5/10/20 with and
without, how many turns were asked and got facts, and the cost per asked turn read from
llama-server's own timing lines (``--server-log``; prompt and generated tokens, seconds;
p50/p95), since the product's metrics count requests, not tokens.

    python bench/fact_keys_eval.py --data ../shared/bench/longmemeval_dev.json \\
        --questions 0 17 22 25 30 38 --model-url http://127.0.0.1:PORT/v1 --model NAME \\
        --api-key-file MODEL_DIR/api-key --server-log MODEL_DIR/server.log

Slow on a CPU: a 0.5B model on two shared cores takes tens of seconds per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from pathlib import Path
from typing import Any

import asyncpg
from common import database, percentile, write_json
from longmemeval_eval import print_table, run

ROOT = Path(__file__).resolve().parent.parent
# llama-server's per-request lines: "prompt eval time = X ms / N tokens", "eval time = X ms / N tokens".
_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_GENERATED = re.compile(r"\|\s+eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def fact_rows(url: str, *, delete: bool) -> dict[str, int]:
    """How many fact keys and turns with facts the pool holds (and delete them if asked)."""
    connection = await asyncpg.connect(_dsn(url))
    try:
        row = await connection.fetchrow(
            "SELECT count(*) AS facts, count(DISTINCT turn_id) AS turns FROM memory_items WHERE kind = 'fact'"
        )
        asked = await connection.fetchval(
            "SELECT count(*) FROM memory_items WHERE kind = 'chunk' AND chunk_index = 0 AND role = 'user'"
            " AND char_length(text) >= 100"
        )
        if delete:
            await connection.execute("DELETE FROM memory_items WHERE kind = 'fact'")
    finally:
        await connection.close()
    return {"facts": int(row["facts"]), "turns_with_facts": int(row["turns"]), "user_turns_asked": int(asked)}


def model_cost(log_text: str) -> dict[str, Any]:
    """Per request: prompt tokens, generated tokens, seconds; p50/p95 of each."""
    prompt = [(float(ms), int(n)) for ms, n in _PROMPT.findall(log_text)]
    generated = [(float(ms), int(n)) for ms, n in _GENERATED.findall(log_text)]
    seconds = [(p[0] + g[0]) / 1000 for p, g in zip(prompt, generated, strict=False)]

    def summary(values: list[float]) -> dict[str, float]:
        return {"p50": round(percentile(values, 50), 2), "p95": round(percentile(values, 95), 2)}

    return {
        "requests": len(generated),
        "seconds": summary(seconds),
        "prompt_tokens_processed": summary([float(n) for _, n in prompt]),
        "generated_tokens": summary([float(n) for _, n in generated]),
        "total_seconds": round(sum(seconds), 1),
    }


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    offset = args.server_log.stat().st_size if args.server_log else 0
    common = {"data": args.data, "limit_questions": 0, "questions": args.questions, "database_url": url}
    with_facts = await run(argparse.Namespace(**common, no_load=False, no_baselines=True), url)
    counts = await fact_rows(url, delete=True)
    without = await run(argparse.Namespace(**common, no_load=True, no_baselines=True), url)
    result: dict[str, Any] = {
        "benchmark": "fact_keys_eval",
        "questions": with_facts["questions"],
        "question_positions": args.questions,
        "turns": with_facts["turns"],
        "model": args.model,
        "timeout_seconds": args.timeout,
        "load_seconds": with_facts["load_seconds"],
        **counts,
        "with_facts": with_facts["chatmem"],
        "without_facts": without["chatmem"],
    }
    if args.server_log:
        with args.server_log.open("rb") as log:
            log.seek(offset)
            result["model_cost"] = model_cost(log.read().decode(errors="replace"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--questions", type=int, nargs="+", required=True, help="0-based positions in --data")
    parser.add_argument("--model-url", required=True, help="an OpenAI-compatible base URL (…/v1)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key-file", type=Path)
    parser.add_argument("--server-log", type=Path, help="llama-server's log: per-request tokens and time")
    parser.add_argument("--timeout", type=float, default=120.0, help="FACT_KEYS_TIMEOUT_SECONDS")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fact_keys_eval.json"))
    args = parser.parse_args()
    # The server bench/longmemeval_eval.py starts takes its settings from this environment.
    os.environ.update(
        {
            "LLM_PROVIDER": "openai",
            "LLM_BASE_URL": args.model_url,
            "LLM_MODEL": args.model,
            "REWRITE_MODEL": args.model,
            "LLM_API_KEY": args.api_key_file.read_text().strip() if args.api_key_file else "not-needed",
            "LLM_MAX_RETRIES": "0",
            "FACT_KEYS": "model",
            "FACT_KEYS_TIMEOUT_SECONDS": str(args.timeout),
            # Every user turn asked: the figure is what facts do, not what one batch's budget allows.
            "FACT_KEYS_BATCH_SECONDS": "1000000",
        }
    )
    with database(None) as url:
        result = asyncio.run(measure(args, url))
    print_table("with fact keys", result["with_facts"])
    print_table("without fact keys (same pool)", result["without_facts"])
    print(
        f"\n{result['user_turns_asked']} user turns asked, {result['turns_with_facts']} got facts, "
        f"{result['facts']} fact keys"
    )
    if "model_cost" in result:
        cost = result["model_cost"]
        print(
            f"per request: {cost['seconds']['p50']} / {cost['seconds']['p95']} s, prompt tokens processed "
            f"{cost['prompt_tokens_processed']['p50']} / {cost['prompt_tokens_processed']['p95']}, generated "
            f"{cost['generated_tokens']['p50']} / {cost['generated_tokens']['p95']} (p50 / p95; "
            f"{cost['requests']} requests)"
        )
    write_json(args.out, result)


if __name__ == "__main__":
    main()

"""Run every benchmark small, to prove each one works end to end (not to measure).

    python bench/run_small.py [--out-dir DIR]

Each benchmark runs in its own process with tiny parameters and must exit 0 and write
its JSON. Figures from these runs mean nothing; full runs are the commands in each
script's docstring.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCOMO = ROOT.parent / "shared" / "bench" / "locomo_dev.json"
LONGMEMEVAL = ROOT.parent / "shared" / "bench" / "longmemeval_dev.json"

SMALL_RUNS: dict[str, list[str]] = {
    "context_build": ["--turns", "200", "--iterations", "20"],
    # Replies of 0.15 s (400 tokens/s) instead of 1.5 s: every cell still streams, recalls and
    # prints, in about half the time.
    "ttft": ["--concurrency", "1", "2", "--requests", "4", "--memory-rows", "0", "20", "--rate", "400"],
    "stop_latency": ["--stops", "4"],
    "retrieval_latency": ["--small", "--locomo", str(LOCOMO), "--longmemeval", str(LONGMEMEVAL)],
    "indexer_throughput": ["--turns", "32", "--lag-seconds", "2"],
    "indexer_fairness": ["--import-turns", "40", "--probes", "2"],
    # 40-word replies: the streams still run at the labelled 20 tokens/s, for 2 s instead of ~8.
    "load_streams": ["--streams", "4", "--server-env", "demo_reply_words=40"],
    "capacity": ["--rates", "2", "--seconds", "2", "--warmup-seconds", "1", "--users", "2", "--all-rates"],
    "memory_eval": ["--limit-conversations", "1", "--data", str(LOCOMO)],
    "longmemeval_eval": ["--limit-questions", "4", "--data", str(LONGMEMEVAL)],
    "fit_fusion": [
        "--limit-conversations",
        "2",
        "--data",
        str(LOCOMO),
        "--lme-limit-questions",
        "3",
        "--lme-data",
        str(LONGMEMEVAL),
    ],
    "diversify_eval": [
        "--limit-conversations",
        "2",
        "--data",
        str(LOCOMO),
        "--lme-limit-questions",
        "3",
        "--lme-data",
        str(LONGMEMEVAL),
    ],
}
# The benchmarks that read the LoCoMo and LongMemEval slices (skipped where they are not).
NEEDS_LOCOMO = (
    "memory_eval",
    "fit_fusion",
    "diversify_eval",
    "longmemeval_eval",
    "retrieval_latency",
)


def run_small(out_dir: Path, only: list[str] | None = None) -> dict[str, float]:
    """Run each benchmark small; returns seconds per benchmark; raises on the first failure."""
    timings: dict[str, float] = {}
    for name, args in SMALL_RUNS.items():
        if only and name not in only:
            continue
        if name in NEEDS_LOCOMO and not (LOCOMO.exists() and LONGMEMEVAL.exists()):
            print(f"skip {name}: the benchmark slices are not there")
            continue
        out = out_dir / f"{name}.json"
        started = time.monotonic()
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args, "--out", str(out)],
            cwd=ROOT,
            check=True,
            timeout=900,
        )
        if not out.exists():
            raise RuntimeError(f"{name} wrote no results to {out}")
        timings[name] = round(time.monotonic() - started, 1)
        print(f"ok {name} ({timings[name]} s)", flush=True)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, default=Path(tempfile.mkdtemp(prefix="chatmem-bench-small-")))
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    run_small(args.out_dir, args.only)


if __name__ == "__main__":
    main()

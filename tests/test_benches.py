"""Every benchmark runs end to end (small): it exits 0 and writes its JSON.

Figures are not asserted: speed is measured by the full runs, not by CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from run_small import NEEDS_LOCOMO, SMALL_RUNS, run_small


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALL_RUNS))
def test_benchmark_runs_small(name: str, tmp_path: Path) -> None:
    timings = run_small(tmp_path, [name])
    if name in NEEDS_LOCOMO and not timings:
        pytest.skip("the LoCoMo slice (../shared/bench) is not on this machine")
    assert (tmp_path / f"{name}.json").read_text().strip().startswith("{")

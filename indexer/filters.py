"""The low-information rule now lives in `memory/remembering.py` (one rule for the indexer and recall).

This name stays only for `indexer/pipeline.py`, which imports it, until that module imports
`memory.remembering` directly.
"""

from memory.remembering import is_low_information

__all__ = ["is_low_information"]

"""Where the tests find the repository's other folders, whatever folder a test module is in."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
EXAMPLES = REPO / "examples"

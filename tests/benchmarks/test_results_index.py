"""benchmarks/results_index.py: INDEX.md and the benchmark tables of README.md
and docs/benchmarks.md are what the generator makes of the result files now,
every result carries the provenance keys, and a changed number reaches the
tables."""

from __future__ import annotations

import json
import re
import shutil
import sys

from helpers.paths import BENCHMARKS  # noqa: E402

sys.path.insert(0, str(BENCHMARKS))
import results_index  # noqa: E402


def test_index_and_readme_tables_are_up_to_date():
    assert results_index.main(["--check"]) == 0, "run: python benchmarks/results_index.py"


def test_every_result_records_its_provenance():
    runs = results_index.load()
    assert len(runs) > 50
    for stem, result in runs.items():
        missing = [k for k in results_index.PROVENANCE if k not in result]
        assert not missing, f"{stem} lacks {missing}"
        assert isinstance(result["command"], str) and result["command"], stem
        assert result["date"] is None or re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["date"]), stem
        assert result.get("git_commit", result["commit"]) == result["commit"], f"{stem}: git_commit != commit"


def test_superseding_runs_exist():
    runs = results_index.load()
    for old, s in results_index.SUPERSEDED.items():
        assert old in runs and s.by in runs and s.by != old, old


def test_a_changed_number_changes_the_index_and_the_readme(tmp_path):
    folder = tmp_path / "results"
    shutil.copytree(results_index.RESULTS, folder)
    readme = tmp_path / "README.md"
    shutil.copy(results_index.README, readme)
    page = tmp_path / "benchmarks.md"
    shutil.copy(results_index.BENCHMARKS, page)
    before = results_index.outputs(folder, readme, page)
    assert results_index.main(["--check"], folder, readme, page) == 0

    path = folder / "depth_bench_x_h200.json"
    result = json.loads(path.read_text())
    assert round(result["runs"][0]["peak_gb"], 1) == 117.6
    result["runs"][0]["peak_gb"] = 120.04
    path.write_text(json.dumps(result, indent=1))
    after = results_index.outputs(folder, readme, page)
    assert results_index.main(["--check"], folder, readme, page) == 1

    assert after[folder / "INDEX.md"] != before[folder / "INDEX.md"]
    for text in (before[readme], before[page]):
        assert "| 393,216 | 117.6 GB |" in depth_table(text)
    for text in (after[readme], after[page]):
        assert "| 393,216 | 120.0 GB |" in depth_table(text)


def depth_table(page: str) -> str:
    return page.split("<!-- results:depth:start -->")[1].split("<!-- results:depth:end -->")[0]

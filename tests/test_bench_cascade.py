"""benchmarks/bench_cascade.py runs: its ``--smoke`` mode (tiny shapes, torch backend, CPU)
writes every output with cascade equal to plain, and ``--replot`` redraws the plot."""

import csv
import importlib.util

import pytest

from benchmarks import bench_cascade

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_smoke_run_writes_every_output_and_checks_cascade_against_plain(tmp_path):
    assert bench_cascade.main(["--smoke", "--eager-calls", "2", "--out", str(tmp_path),
                               "--log-level", "WARNING"]) == 0
    for name in ("cascade.json", "cascade.csv", "cascade.md") + ("cascade.png",) * HAS_MATPLOTLIB:
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "cascade.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["case"] for r in rows] == [c.name for c in bench_cascade.SMOKE_CASES]
    for r in rows:
        assert r["check"] == "PASS" and float(r["max_abs_err"]) <= 1e-5, r
        assert float(r["plain_us"]) > 0 and float(r["cascade_eager_us"]) > 0
    assert "max_abs_err" in (tmp_path / "cascade.md").read_text()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="plots need matplotlib (the bench extra)")
def test_replot_redraws_beside_the_results(tmp_path):
    assert bench_cascade.main(["--smoke", "--cases", "no share", "--eager-calls", "1",
                               "--out", str(tmp_path), "--log-level", "WARNING"]) == 0
    (tmp_path / "cascade.png").unlink()
    assert bench_cascade.main(["--replot", str(tmp_path / "cascade.json")]) == 0
    assert (tmp_path / "cascade.png").stat().st_size > 0


def test_cases_share_whole_prefix_blocks():
    # The plain tables reuse the prefix blocks, which needs prefixes of whole blocks.
    for shape, cases in ((bench_cascade.GPU_SHAPE, bench_cascade.GPU_CASES),
                         (bench_cascade.SMOKE_SHAPE, bench_cascade.SMOKE_CASES)):
        assert all(c.prefix % shape.block_size == 0 for c in cases)
    assert bench_cascade.TARGET_CASE in [c.name for c in bench_cascade.GPU_CASES]

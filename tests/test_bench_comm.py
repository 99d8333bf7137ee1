"""``shardline bench comm``: real worlds of gloo and MPI side by side, a table with ratios and
JSON rows with bandwidths; bad options are one clear error."""

import json

import pytest

from support.cli import shardline


@pytest.mark.timeout(300)
def test_bench_comm_compares_communicators(tmp_path):
    out = tmp_path / "bench.json"
    result = shardline(
        "bench",
        "comm",
        "-c",
        "gloo,mpi",
        "-b",
        "4",
        "-e",
        "4K",
        "-f",
        "32",
        "-i",
        "3",
        "--json",
        str(out),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "mpi/gloo" in result.stdout and "all_reduce" in result.stdout
    rows = json.loads(out.read_text())["results"]
    keys = {(r["communicator"], r["operation"], r["bytes"]) for r in rows}
    assert keys == {
        (c, op, size)
        for c in ("gloo", "mpi")
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
        for size in (4, 128, 4096)
    }
    for row in rows:
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"]
        factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}.get(
            row["operation"], 1.0
        )
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor)


@pytest.mark.timeout(120)
def test_bench_comm_back_to_back_beside_the_python_fallback(tmp_path):
    out = tmp_path / "bench.json"
    result = shardline(
        "bench",
        "comm",
        "-c",
        "custom_ar",
        "--python-fallback",
        "custom_ar",
        "--back-to-back",
        "--ops",
        "all_reduce",
        "-b",
        "4",
        "-e",
        "4",
        "-i",
        "50",
        "--json",
        str(out),
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    assert "back to back" in result.stdout and "custom_ar/py/custom_ar" in result.stdout
    rows = json.loads(out.read_text())["results"]
    assert [r["communicator"] for r in rows] == ["custom_ar", "custom_ar/py"]
    assert all(0 < r["min_us"] <= r["median_us"] for r in rows)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--python-fallback", "mpi"], "--python-fallback = 'mpi': allowed: names given to -c"),
        (["--ops", "all_reduce,scan"], "--ops = 'all_reduce,scan': allowed: all_reduce"),
        (["-b", "1M", "-e", "4K"], "-e 4K is below -b 1M"),
        (["-e", "lots"], "-e = 'lots': expected a positive size"),
        (["-c", "nccl2"], "nccl2"),
    ],
)
def test_bench_comm_bad_options(options, message):
    result = shardline("bench", "comm", *options)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr

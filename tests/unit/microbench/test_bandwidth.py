"""microbench/bandwidth.py (layouts, CPU lists, the placed probe on the real engine)
and microbench/push's write-efficiency report."""

import os

import pytest

from microbench.bandwidth import WriteLayout, parse_cpus, placed_write_bandwidth
from microbench.push.__main__ import (
    WRITE_EFFICIENCY_TARGET,
    efficiency_lines,
    write_efficiency,
    write_of,
)

MiB = 2**20


def test_layout_of_a_push_write_keeps_count_and_volume():
    lay = WriteLayout.of_write(256 * MiB, 16)
    assert (lay.entries, lay.entry_bytes, lay.total_bytes) == (16, 16 * MiB, 256 * MiB)
    assert lay.describe() == "16 x 16.00 MiB"


@pytest.mark.parametrize("args", [(0, 1), (10, 0), (-1, 1)])
def test_layout_refuses_empty_writes(args):
    with pytest.raises(ValueError, match="layout"):
        WriteLayout.of_write(*args)


@pytest.mark.parametrize(
    "spec,cpus",
    [("0", {0}), ("0-1", {0, 1}), ("0,2-3", {0, 2, 3}), ("", None), (None, None)],
)
def test_cpu_lists(spec, cpus):
    assert parse_cpus(spec) == (frozenset(cpus) if cpus is not None else None)


@pytest.mark.parametrize("spec", ["a", "2-1", "0-x"])
def test_bad_cpu_lists_name_the_part(spec):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpus(spec)


def test_write_efficiency_is_c_write_over_the_engine_with_that_layout():
    before = {"bytes": 100, "entries": 3, "write_seconds": 1.0}
    writes = [
        write_of(
            before, {"bytes": 100 + 256 * MiB, "entries": 19, "write_seconds": 1.0 + s}
        )
        for s in (0.2, 0.25, 0.4)
    ]
    assert writes[0] == {
        "bytes": 256 * MiB,
        "entries": 16,
        "seconds": pytest.approx(0.2),
    }
    engine = {"gb_per_s": 256 * MiB / 0.2 / 1e9}
    eff = write_efficiency(
        writes + [{"bytes": 0, "entries": 0, "seconds": 0.0}], engine
    )
    assert eff["write_s"] == pytest.approx(
        0.25
    )  # medians over the writes that moved bytes
    assert eff["write_entries"] == 16 and eff["write_entry_kib"] == 16 * 1024
    assert eff["write_over_engine"] == pytest.approx(0.2 / 0.25)
    rows = [{"prefix_len": 8192, **eff}]
    met, lines = efficiency_lines(rows)
    assert met is (WRITE_EFFICIENCY_TARGET <= 0.8) and "0.80" in lines[0]
    met, lines = efficiency_lines([{**rows[0], "write_over_engine": 0.5}])
    assert not met and "NOT met" in lines[0]


def test_no_write_measured_is_not_met():
    eff = write_efficiency([{"bytes": 0, "entries": 0, "seconds": 0.0}], None)
    assert eff["write_over_engine"] is None
    met, lines = efficiency_lines([{"prefix_len": 2048, **eff}])
    assert not met and "no write measured" in lines[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_placed_probe_moves_the_layout_between_two_pinned_processes():
    pytest.importorskip("mooncake.engine")
    r = placed_write_bandwidth(
        WriteLayout(256 * 1024, 8), src_cpus="0", dst_cpus="1", reps=2
    )
    assert (r["bytes"], r["entries"], r["entry_bytes"]) == (2 * MiB, 8, 256 * 1024)
    assert len(r["seconds"]) == 2 and r["gb_per_s"] > 0 and r["poller_nice"] == 19

"""microbench/push's table of push against recompute by prefix length."""

from microbench.push.__main__ import condition_lines, crossover


def row(n, push, cold, cond="idle"):
    return {
        "prefix_len": n,
        "ttft_push_s": push,
        "ttft_cold_s": cold,
        "push_over_cold": push / cold,
        "condition": cond,
    }


def test_the_crossover_is_where_push_wins_at_that_length_and_every_longer_one():
    assert (
        crossover([row(2048, 0.3, 0.2), row(8192, 0.3, 1.0), row(4096, 0.3, 0.4)])
        == 4096
    )
    # a win at a short length followed by a loss is noise, not a crossover
    assert (
        crossover([row(2048, 0.1, 0.2), row(4096, 0.5, 0.4), row(8192, 0.3, 1.0)])
        == 8192
    )
    assert crossover([row(2048, 0.3, 0.2), row(8192, 1.1, 1.0)]) is None
    assert crossover([row(2048, 0.1, 0.2), {"prefix_len": 4096, "error": "x"}]) == 2048


def test_each_condition_has_its_crossover_and_its_16k_target():
    rows = [
        row(8192, 0.3, 1.0),
        row(16384, 0.4, 4.0),
        row(8192, 0.9, 1.5, "4 streams"),
        row(16384, 1.5, 6.0, "4 streams"),
    ]
    targets, lines = condition_lines(rows)
    assert [t["met"] for t in targets] == [True, False]
    assert lines[0].startswith("idle: push beats recompute from 8192 tokens on")


def test_prefill_over_transfer_sets_this_machine_beside_an_h100():
    from microbench.push.__main__ import prefill_over_transfer

    got = prefill_over_transfer(
        {"ttft_cold_s": 8.192, "turn2_len": 8192},
        bw_gb_per_s=1.0,
        kv_bytes_per_token=8192,
    )
    assert got["prefill_us_per_token"] == 1000.0
    assert abs(got["transfer_us_per_token"] - 8.192) < 1e-9
    assert abs(got["ratio"] - 1000 / 8.192) < 1e-6
    low, high = got["h100_8b_ratio"]
    assert 5 < low < high < 40  # 40-80 us prefill against 2.6-5.2 us transfer

"""microbench/mb7: ABBA plan, progress/ETA, rows and target verdicts from samples."""

import io

from microbench.mb7.measure import where_the_tail_goes
from microbench.mb7.plan import (
    LAYERWISE,
    POSTHOC,
    PREFILL_ONLY,
    Progress,
    Step,
    arm_order,
    plan,
)
from microbench.mb7.report import build_rows, summary_lines, targets

FACTS = {"kv_bytes_per_token": 1024, "layers": 4}


def test_abba_order_alternates_per_repetition_and_covers_every_arm():
    steps = plan(
        [512, 1024], reps=3, load=0, modes=(LAYERWISE, POSTHOC), prefill_only=True
    )
    assert len(steps) == 3 * 2 * 3
    by_rep = [
        [s.arm for s in steps if s.rep == r and s.kv_tokens == 512] for r in range(3)
    ]
    assert by_rep[0] == [PREFILL_ONLY, LAYERWISE, POSTHOC]
    assert by_rep[1] == [POSTHOC, LAYERWISE, PREFILL_ONLY]
    assert by_rep[2] == by_rep[0]
    assert arm_order(1, ("a", "b")) == ("b", "a")
    # under load: no prefill-only arm
    assert {s.arm for s in plan([512], 2, 8, (LAYERWISE, POSTHOC), False)} == {
        LAYERWISE,
        POSTHOC,
    }


def test_progress_prints_a_line_per_step_with_an_eta():
    t = [0.0]
    out = io.StringIO()
    steps = [Step(0, 512, 0, LAYERWISE), Step(0, 512, 0, POSTHOC)]
    p = Progress(steps, clock=lambda: t[0], out=out)
    t[0] = 10.0
    p.step_done(steps[0], "ok")
    assert p.eta_s() == 10.0  # same weight left as done
    line = out.getvalue()
    assert "1/2" in line and "ETA 0:10" in line and "layerwise" in line


def sample(
    arm, n, rep, tail=None, p=1.0, hit=0.05, load=0, correct=True, error=None, cpu=None
):
    return {
        "p_forward_cpu_s": p if cpu is None else cpu,
        "load": load,
        "kv_tokens": n,
        "rep": rep,
        "arm": arm,
        "error": error,
        "p_latency_s": p,
        "total_s": None if tail is None else p + tail,
        "tail_s": tail,
        "local_hit_s": None if arm == PREFILL_ONLY else hit,
        "correct": correct if arm != PREFILL_ONLY else None,
        "problems": [],
        "share_before_prefill_end": 0.9 if arm == LAYERWISE else None,
    }


def samples_for(sizes, lw_tail, ph_tail, reps=3, p_lw=1.02, hit=0.05):
    out = []
    for rep in range(reps):
        for n in sizes:
            out += [
                sample(PREFILL_ONLY, n, rep, p=1.0),
                sample(LAYERWISE, n, rep, tail=lw_tail(n, rep), p=p_lw, hit=hit),
                sample(POSTHOC, n, rep, tail=ph_tail(n, rep), p=1.0, hit=hit),
            ]
    return out


def test_rows_pair_by_repetition_and_targets_are_judged():
    sizes = [512, 1024, 2048]
    s = samples_for(
        sizes, lambda n, r: 0.055 + 0.001 * r, lambda n, r: 0.5 * n / 2048 + 0.01 * r
    )
    layer = {n: 0.001 for n in sizes}
    rows = build_rows(s, layer, FACTS)
    lw = next(r for r in rows if r["mode"] == LAYERWISE and r["kv_tokens"] == 2048)
    ph = next(r for r in rows if r["mode"] == POSTHOC and r["kv_tokens"] == 2048)
    assert abs(lw["floor_s"] - 0.051) < 1e-9
    assert abs(lw["tail_over_floor"]["median"] - 0.056 / 0.051) < 1e-9
    assert abs(lw["prefill_slowdown"]["median"] - 0.02) < 1e-9
    # rep r: posthoc (0.5 + 0.01 r) / layerwise (0.055 + 0.001 r)
    assert abs(ph["posthoc_over_layerwise"]["min"] - 0.5 / 0.055) < 1e-9
    assert abs(ph["posthoc_over_layerwise"]["max"] - 0.52 / 0.057) < 1e-9
    assert lw["share_before_prefill_end"]["median"] == 0.9
    assert lw["correct"] and lw["bytes"] == 2048 * 1024
    verdicts = {t["target"].split(":")[1].strip()[:20]: t["met"] for t in targets(rows)}
    assert verdicts == {
        "layer-wise tail/floo": True,
        "layer-wise tail max/": True,
        "P's prefill slowdown": True,
        "post-hoc/layer-wise ": True,
    }


def test_targets_fail_when_values_miss_and_failures_are_reported():
    sizes = [512, 2048]
    s = samples_for(sizes, lambda n, r: 0.1 * n / 512, lambda n, r: 0.2, p_lw=1.2)
    s.append(sample(LAYERWISE, 512, 3, error="POST failed", correct=False))
    s.append(sample(POSTHOC, 512, 3, tail=0.2, correct=False))
    rows = build_rows(s, {n: 0.001 for n in sizes}, FACTS)
    tg = targets(rows)
    assert [t["met"] for t in tg] == [False, False, False, False]
    lw512 = next(r for r in rows if r["mode"] == LAYERWISE and r["kv_tokens"] == 512)
    assert lw512["correct"] and lw512["errors"] == ["POST failed"]  # failed, not wrong
    ph512 = next(r for r in rows if r["mode"] == POSTHOC and r["kv_tokens"] == 512)
    assert (
        not ph512["correct"] and not ph512["errors"]
    )  # a completed request with wrong KV
    lines = summary_lines(
        rows,
        tg,
        [
            {
                "mode": LAYERWISE,
                "phase": "idle",
                "p_usage": 0.0,
                "d_usage": 0.016,
                "returned": False,
                "seconds": 30.0,
            }
        ],
    )
    assert any("FAILED" in ln for ln in lines)
    assert sum("NOT MET" in ln for ln in lines) == 4
    assert any("D 1.6% still after 30.0 s" in ln for ln in lines)


def test_a_negative_or_missing_measure_is_not_judged_met():
    sizes = [512, 1024]  # spans 2x only: flatness cannot be judged
    s = samples_for(sizes, lambda n, r: 0.05, lambda n, r: 0.4)
    rows = build_rows(s, {n: 0.001 for n in sizes}, FACTS)
    flat = next(t for t in targets(rows) if "max/min" in t["target"])
    ratio = next(t for t in targets(rows) if "post-hoc" in t["target"])
    assert flat["met"] is None and ratio["met"] is None  # 2048 not measured


def _timed_sample(p_latency_s: float) -> dict:
    """P's last layer at 10.0, P answers D at 10.010; D's request runnable at
    10.030, scheduled at 10.080, its first token at 10.180; the client sent both
    requests at 9.0 and got D's response at 10.200."""
    return {
        "started_monotonic": 9.0,
        "p_latency_s": p_latency_s,
        "total_s": 1.2,
        "client_tail_s": 1.2 - p_latency_s,
        "d_timeline": {
            "allocated": 9.05,
            "kv_arrived": 10.03,
            "scheduled": 10.08,
            "finished": 10.18,
        },
    }


P_TIMELINE = {
    "bytes_written": 100,
    "bytes_before_prefill_end": 90,
    "prefill_end": 10.0,
    "last_write_end": 10.002,
    "ended_at": 10.01,
}


def test_the_engine_clock_tail_does_not_move_with_p_http_response():
    # P's HTTP response 5 ms after its answer to D, then 300 ms later (a busy
    # API server): the client's tail moves by 295 ms, the engines' tail not at all
    quick = _timed_sample(p_latency_s=1.015)
    slow = _timed_sample(p_latency_s=1.310)
    a = where_the_tail_goes(quick, P_TIMELINE)
    b = where_the_tail_goes(slow, P_TIMELINE)
    assert abs((quick["client_tail_s"] - slow["client_tail_s"]) - 0.295) < 1e-9
    assert a["tail_s"] == b["tail_s"] and abs(a["tail_s"] - 0.18) < 1e-9
    assert abs(a["end_to_d_runnable_ms"] - 20) < 1e-6
    assert abs(a["d_runnable_to_scheduled_ms"] - 50) < 1e-6
    assert abs(a["d_scheduled_to_first_token_ms"] - 100) < 1e-6
    assert abs(a["d_first_token_to_client_ms"] - 20) < 1e-6


def test_without_d_timeline_there_is_no_engine_tail():
    s = _timed_sample(1.015)
    s["d_timeline"] = None
    out = where_the_tail_goes(s, P_TIMELINE)
    assert out["tail_s"] is None and out["share_before_prefill_end"] == 0.9


def test_under_load_d_noticing_the_end_is_judged_against_its_local_hit():
    sizes = [512, 1024]
    s = [x for x in samples_for(sizes, lambda n, r: 0.2, lambda n, r: 0.3) if x]
    for x in s:
        x["load"] = 8
        if x["arm"] == LAYERWISE:  # local hit 50 ms; D took 55 ms, 70 ms at 1024
            x["end_to_d_first_token_ms"] = 55.0 if x["kv_tokens"] == 512 else 70.0
    rows = build_rows(s, {n: 0.001 for n in sizes}, FACTS)
    (notice,) = [t for t in targets(rows) if "D's first token" in t["target"]]
    assert abs(notice["value"] - 1.4) < 1e-9 and notice["met"] is False
    assert notice["detail"] == "512: 1.10, 1024: 1.40"
    # idle, the target is not judged
    for x in s:
        x["load"] = 0
    rows = build_rows(s, {n: 0.001 for n in sizes}, FACTS)
    assert not [t for t in targets(rows) if "D's first token" in t["target"]]


def test_the_layer_hook_share_is_its_cpu_time_over_p_prefill():
    s = samples_for([512], lambda n, r: 0.06, lambda n, r: 0.3, p_lw=2.0)
    for x in s:
        if x["arm"] == LAYERWISE:
            x["layer_hook_cpu_s"] = 0.01 * (x["rep"] + 1)  # 10, 20, 30 ms
    rows = build_rows(s, {512: 0.001}, FACTS)
    lw = next(r for r in rows if r["mode"] == LAYERWISE)
    assert abs(lw["layer_hook_cpu_share"]["median"] - 0.01) < 1e-12  # 20 ms / 2 s
    ph = next(r for r in rows if r["mode"] == POSTHOC)
    assert ph["layer_hook_cpu_share"] is None
    lines = summary_lines(rows, targets(rows), [])
    assert any("per-layer hook" in ln and "512: 1.00%" in ln for ln in lines)


def test_p_slowdown_is_taken_on_ps_own_cpu_clock_not_moved_by_another_process():
    """Another process takes P's core during the layer-wise reps: P's wall time at
    the client grows 40%, its forward thread's CPU time 1%. The target's slowdown
    is the CPU figure; the wall figure stays in the row."""
    sizes = [512, 2048]
    s = []
    for rep in range(3):
        for n in sizes:
            s += [
                sample(PREFILL_ONLY, n, rep, p=1.0, cpu=0.9),
                sample(LAYERWISE, n, rep, tail=0.055, p=1.4, cpu=0.909),
                sample(POSTHOC, n, rep, tail=0.3, p=1.0, cpu=0.9),
            ]
    rows = build_rows(s, {n: 0.001 for n in sizes}, FACTS)
    lw = next(r for r in rows if r["mode"] == LAYERWISE and r["kv_tokens"] == 2048)
    assert abs(lw["prefill_slowdown"]["median"] - 0.01) < 1e-9
    assert abs(lw["prefill_slowdown_wall"]["median"] - 0.4) < 1e-9
    slow = next(t for t in targets(rows) if "slowdown" in t["target"])
    assert slow["met"] is True and abs(slow["value"] - 0.01) < 1e-9


def test_the_figure_names_its_machine_commit_and_run(tmp_path, monkeypatch):
    """mb7's figure is the main job's: its title carries where it was made,
    and no figure can be saved without that (``origin`` has no default)."""
    import microbench.mb7.report as report
    from microbench.common import provenance, save_figure

    titled = []

    def keep(fig, path, title, origin, **kw):
        out = save_figure(fig, path, title, origin, **kw)
        titled.append(fig._suptitle.get_text())
        return out

    monkeypatch.setattr(report, "save_figure", keep)
    sizes = [512, 2048]
    rows = build_rows(
        samples_for(sizes, lambda n, r: 0.06, lambda n, r: 0.5),
        dict.fromkeys(sizes, 0.001),
        FACTS,
    )
    origin = provenance(
        {"cores": 2, "model_name": "Intel Xeon", "avx512": True},
        {"commit": "abc1234", "changed": False},
        "20261205-101500",
    )
    png = report.plot(rows, tmp_path / "mb7.png", FACTS, origin)
    assert png is not None and png.stat().st_size > 0
    (title,) = titled
    assert title.startswith("mb7: 4-layer model")
    assert title.endswith(
        "(2-core Intel Xeon, AVX-512; commit abc1234; run 20261205-101500)"
    )

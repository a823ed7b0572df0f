"""This series' connector as subclasses of upstream's: routing, hooks and guards.

The subclasses (ext/connector.py) are exercised without an engine: objects are
made with ``__new__`` and given only the upstream state the method under test
reads, so each test names the upstream fields an override relies on. The
two-instance integration tests run the same classes with real engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import queue
import re
from pathlib import Path
from types import SimpleNamespace

from harness.vllm_series import selected
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as up,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext import (
    connector as ext_connector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.connector import (
    ExtMooncakeConnector,
    ExtMooncakeConnectorScheduler,
    ExtMooncakeConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.hooks import (
    UPSTREAM,
    hooks_of,
)

ROOT = Path(__file__).resolve().parents[3]
SERIES = selected()  # the vLLM release under test

# sha256 of upstream's MooncakeConnector.__init__ source at each supported release:
# ExtMooncakeConnector.__init__ repeats its body with this series' halves (0.32.0's
# adds only an assertion that the scheduler gets kv_cache_config, which it does).
UPSTREAM_FACADE_INIT_SHA256 = {
    "0.18.1": "1a3dac3262e1c3f8606ee41946ffa4224491346b3e41ada2cf2f4b546751b71f",
    "0.32.0": "d530f62bd210da27e0baeabc1af7fe530203cf5a164cc2178e731b1de588ec98",
}


def test_the_name_users_write_resolves_to_the_subclass():
    cls = KVConnectorFactory.get_connector_class_by_name("MooncakeConnector")
    assert cls is ExtMooncakeConnector and issubclass(cls, up.MooncakeConnector)


def test_upstreams_facade_init_is_the_one_the_subclass_repeats():
    source = inspect.getsource(up.MooncakeConnector.__init__)
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == UPSTREAM_FACADE_INIT_SHA256.get(SERIES.version), (
        "upstream's MooncakeConnector.__init__ changed: bring ExtMooncakeConnector.__init__ "
        f"(ext/connector.py) in line with it, then record its new sha256 {digest}"
    )


def test_the_hook_patch_adds_only_one_line_calls_of_one_shape():
    [patch] = SERIES.patches.glob("*-mooncake-five-one-line-hooks-*.patch")
    added = [
        ln[1:].strip()
        for ln in patch.read_text().splitlines()
        if ln.startswith("+") and not ln.startswith("+++")
    ]
    allowed = re.compile(
        r"(.*\bhooks_of\(self\)\.\w+\(.*|from .*\.ext\.hooks import hooks_of"
        r"|self\.engine, remote_session, .*"
        # the formatter's wrap of a hook call's arguments (0.32.0's longer line)
        r'|vllm_config, "0\.0\.0\.0", port|\)|)$'
    )
    assert [ln for ln in added if not allowed.fullmatch(ln)] == []
    assert sum("hooks_of(self)." in ln for ln in added) == 5


class _Engine:
    def __init__(self):
        self.calls = []

    def batch_transfer_sync_write(self, *args):
        self.calls.append(args)
        return 0


def test_upstream_hooks_do_what_upstream_did():
    engine = _Engine()
    assert UPSTREAM.write_blocks(engine, "s:1", [1], [2], [3]) == 0
    assert engine.calls == [("s:1", [1], [2], [3])]
    assert UPSTREAM.registration_host("127.0.0.1") == "127.0.0.1"
    meta = object()
    assert UPSTREAM.xfer_metadata(meta) is meta
    assert UPSTREAM.send_failed(SimpleNamespace()) is None
    # upstream's class, and upstream's tests' stand-ins for self, have no ext
    assert not hasattr(up.MooncakeConnectorWorker, "ext")
    assert hooks_of(SimpleNamespace()) is UPSTREAM
    mine = object()
    assert hooks_of(SimpleNamespace(ext=mine)) is mine


# ---- scheduler -----------------------------------------------------------------------
class _SchedulerExt:
    def __init__(self, owns=False, takes=False, delay=None, timeline=None):
        self._owns, self._takes, self._delay = owns, takes, delay
        self._timeline = timeline
        self.calls = []

    def owns(self, request):
        return self._owns

    def takes_send(self, request, transfer_id):
        self.calls.append(("takes_send", transfer_id))
        return self._takes

    def send_finished(self, request, block_ids, transfer_id):
        self.calls.append(("send_finished", transfer_id))
        return self._delay

    def request_finished(self, request):
        return "ours", None

    def seen_alloc(self, request, num_external_tokens):
        pass

    def seen_finished(self, request):
        pass

    def finished_params(self, request, params):
        return (
            params if self._timeline is None else {**(params or {}), **self._timeline}
        )


def _scheduler(ext) -> ExtMooncakeConnectorScheduler:
    s = ExtMooncakeConnectorScheduler.__new__(ExtMooncakeConnectorScheduler)
    s.ext = ext
    s.is_kv_producer, s.is_kv_consumer = True, False
    s._reqs_need_send, s._reqs_need_recv, s._reqs_not_processed = {}, {}, set()
    return s


def _request(**params):
    return SimpleNamespace(
        request_id="r1",
        kv_transfer_params=params,
        status=up.RequestStatus.FINISHED_LENGTH_CAPPED,
    )


def test_layer_wise_takes_a_send_upstream_queued():
    s = _scheduler(_SchedulerExt(takes=True))
    s.update_state_after_alloc(
        _request(do_remote_decode=True, transfer_id="t1"), None, 0
    )
    assert s._reqs_need_send == {} and s.ext.calls == [("takes_send", "t1")]


def test_without_layer_wise_upstream_keeps_the_send():
    s = _scheduler(_SchedulerExt(takes=False))
    s.update_state_after_alloc(
        _request(do_remote_decode=True, transfer_id="t1"), None, 0
    )
    assert list(s._reqs_need_send) == ["r1"]


def test_a_request_the_series_owns_never_reaches_upstream():
    s = _scheduler(_SchedulerExt(owns=True))
    assert s.request_finished(
        _request(do_remote_decode=True, transfer_id="t1"), [1]
    ) == ("ours", None)
    assert s._reqs_need_send == {}


def test_a_layer_wise_send_decides_its_own_delay():
    s = _scheduler(_SchedulerExt(delay=True))
    assert s.request_finished(
        _request(do_remote_decode=True, transfer_id="t1"), [1]
    ) == (True, None)
    assert s._reqs_need_send == {}  # upstream's post-hoc send never saw it


def test_an_unscheduled_pull_is_left_to_upstream():
    s = _scheduler(_SchedulerExt())
    s.is_kv_producer, s.is_kv_consumer = False, True
    params = {"do_remote_prefill": True, "transfer_id": "t1"}
    assert s.request_finished(
        SimpleNamespace(request_id="r1", kv_transfer_params=params, status=None), []
    ) == (False, None)
    # a cleanup-only pull without blocks (its end is never reported: decode_pulls.py)
    assert s._reqs_need_recv["r1"][1] == [] and params["do_remote_prefill"] is False
    assert s.ext.calls == []


def test_a_finished_pull_carries_its_timeline_in_the_output_params():
    timeline = {"mooncake_timeline": {"kv_arrived": 1.0}}
    s = _scheduler(_SchedulerExt(timeline=timeline))
    s.is_kv_producer, s.is_kv_consumer = False, True
    # upstream cleared do_remote_prefill when the request's blocks were allocated
    params = {"do_remote_prefill": False, "transfer_id": "t1"}
    assert s.request_finished(_request(**params), [1]) == (False, timeline)


# ---- worker --------------------------------------------------------------------------
class _WorkerExt:
    def __init__(self, completed=True):
        self._completed = completed
        self.failed = []

    def pull_completed(self, d_req_id, block_ids):
        return self._completed

    def pulls_failed(self, pull_metas, req_ids, reason):
        self.failed.append(sorted(req_ids))


class _Worker(ExtMooncakeConnectorWorker):
    def __del__(self):  # upstream's shuts down an engine these objects never had
        pass


def _worker(ext) -> ExtMooncakeConnectorWorker:
    w = _Worker.__new__(_Worker)
    w.ext = ext
    w.finished_recving_reqs = set()
    w.reqs_need_send, w.finished_sending_reqs = {}, set()
    w.device_kv_caches = {}
    w.kv_topo = SimpleNamespace(split_k_and_v=True)
    # what upstream's own failed-load reporting uses from 0.32.0 on (vllm#50984)
    w.xfer_stats = SimpleNamespace(record_failed_recv=lambda: None)
    w._is_hma_required = False
    w._invalid_block_ids, w._failed_recv_reqs = queue.Queue(), queue.Queue()
    return w


# a request's block ids: one list (0.18.1) or one list per KV cache group (0.32.0)
PER_GROUP = "list[list[int]]" in str(up.PullReqMeta.__annotations__["local_block_ids"])


def _pull(d_req_id, count=1):
    return up.PullReqMeta(
        d_req_id=d_req_id,
        transfer_id="t",
        local_block_ids=[[1]] if PER_GROUP else [1],
        remote_engine_id="e",
        remote_bootstrap_addr="http://p",
        pull_tasks_count=count,
    )


def _answer(ok=None, err=None):
    return up.MooncakeXferResponse(
        status=up.MooncakeXferResponseStatus.FINISH,
        ok_reqs=ok,
        err_reqs=err,
        err_msg="boom" if err else None,
    )


def test_a_completed_pull_is_reported_once_the_extension_agrees():
    w = _worker(_WorkerExt(completed=True))
    w.process_pulling_result(_answer(ok=["a"]), {"a": _pull("d-a")})
    assert w.finished_recving_reqs == {"d-a"}


def test_a_pull_the_extension_does_not_count_is_not_reported():
    w = _worker(_WorkerExt(completed=False))
    w.process_pulling_result(_answer(ok=["a"]), {"a": _pull("d-a")})
    assert w.finished_recving_reqs == set()


def test_pulls_p_refused_are_failed():
    w = _worker(_WorkerExt())
    w.process_pulling_result(_answer(err=["a"]), {"a": _pull("d-a")})
    assert w.ext.failed == [["a"]]


def test_a_pull_without_a_complete_answer_fails_when_upstream_returns(monkeypatch):
    async def upstream_returns(self, worker_addr, pull_metas):
        pull_metas["a"].pull_tasks_count = 0  # answered
        return None  # "b" never answered: P's ERROR, a broken socket, shutdown

    monkeypatch.setattr(
        up.MooncakeConnectorWorker, "receive_kv_from_single_worker", upstream_returns
    )
    w = _worker(_WorkerExt())
    asyncio.run(
        w.receive_kv_from_single_worker(
            "tcp://p:1", {"a": _pull("d-a"), "b": _pull("d-b")}
        )
    )
    assert w.ext.failed == [["b"]]


def test_a_failed_terminal_send_frees_ps_blocks_once_nothing_is_in_flight():
    w = _worker(_WorkerExt())
    meta = up.SendBlockMeta(
        p_req_id="p-1", transfer_id="t1", local_block_ids=[1], ready=None, sending=1
    )  # type: ignore[arg-type]
    w.reqs_need_send["t1"] = meta
    w._free_failed_send(meta)
    assert w.finished_sending_reqs == set()  # another write of it still in flight
    meta.sending = 0
    w._free_failed_send(meta)
    assert w.finished_sending_reqs == {"p-1"} and w.reqs_need_send == {}


def test_registration_gives_up_naming_what_to_check(monkeypatch):
    async def never(self):
        await asyncio.sleep(3600)

    monkeypatch.setattr(
        up.MooncakeConnectorWorker, "register_worker_with_bootstrap", never
    )
    monkeypatch.setattr(ext_connector, "REGISTRATION_DEADLINE_S", 0.05)
    w = _worker(_WorkerExt())
    try:
        asyncio.run(w.register_worker_with_bootstrap())
    except RuntimeError as e:
        assert "MOONCAKE_BOOTSTRAP_HOST" in str(e)
    else:
        raise AssertionError("registration did not give up")


def test_a_listener_that_fails_at_start_ends_the_wait_with_its_error(monkeypatch):
    async def fails(self, ready_event):
        raise RuntimeError("cannot register")

    monkeypatch.setattr(up.MooncakeConnectorWorker, "_mooncake_sender_listener", fails)
    w = _worker(_WorkerExt())
    w._listener_error = None
    ready = __import__("threading").Event()
    with contextlib.suppress(RuntimeError):
        asyncio.run(w._mooncake_sender_listener(ready))
    assert ready.is_set() and "cannot register" in str(w._listener_error)

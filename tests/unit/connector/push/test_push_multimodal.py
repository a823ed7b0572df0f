"""connector/push/decode_scheduler.py: which requests D may take a prefix push for.

C matches a prompt by the hashes of its token ids alone (no image, audio or
prompt embeddings, no LoRA weights), so a request whose KV depends on more than
its token ids is prefilled locally on D, and a request of upstream's P/D path
(do_remote_decode / do_remote_prefill) is never taken over by the push path.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from helpers import Blocks

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ExtConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.scheduler_extension import (
    SchedulerExtension,
)

BS = 16
SRC = "http://c:9000"
FP = KVFingerprint(
    model="Arch:0123456789abcdef", dtype="bfloat16/auto", block_size=BS, tp_size=1
)


def scheduler() -> tuple[PushScheduler, list[str]]:
    """D's push scheduler whose source is never asked: each /match_blocks it would
    post is recorded and answered with a transport error."""
    s = PushScheduler(
        BS,
        ExtConfig(push_min_tokens=0, push_match_timeout_s=1, push_sources=(SRC,)),
        FP,
    )
    asked: list[str] = []

    def post(source, path, content, headers, deadline):
        asked.append(source + path)
        raise ConnectionError("not reachable in this test")

    s._lanes.post = post
    return s, asked


def request(rid="r1", params=None, **fields):
    """A stand-in of vllm.v1.request.Request with the attributes the push path reads."""
    r = SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(5 * BS + 3)),
        kv_transfer_params={"push_from": SRC} if params is None else params,
        cache_salt=None,
        lora_request=None,
        mm_features=[],
        prompt_embeds=None,
        num_computed_tokens=0,
        num_external_computed_tokens=0,
    )
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def image_feature():
    """What vLLM 0.18.1 keeps of an image in Request.mm_features."""
    return SimpleNamespace(
        data=None,
        modality="image",
        identifier="img-0123",
        mm_position=SimpleNamespace(offset=4, length=32),
    )


def wait_asked(s: PushScheduler, r, timeout=5.0):
    fut = s._matches.get(r.request_id)
    end = time.monotonic() + timeout
    while fut is not None and not fut.done() and time.monotonic() < end:
        time.sleep(0.005)


def warnings_of(caplog) -> list[str]:
    return [
        rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING
    ]


KINDS = {
    "image": dict(mm_features=[image_feature()]),
    "prompt embeddings": dict(prompt_embeds=object()),
    "LoRA adapter": dict(
        lora_request=SimpleNamespace(
            lora_name="sql-adapter", lora_int_id=1, lora_path="/adapters/sql"
        )
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_request_whose_kv_depends_on_more_than_its_tokens_is_prefilled_locally(
    kind, caplog
):
    s, asked = scheduler()
    r = request(**KINDS[kind])
    with caplog.at_level(logging.WARNING):
        first = s.get_num_new_matched_tokens(r, 0)
        wait_asked(s, r)
        again = s.get_num_new_matched_tokens(r, 0)
    assert first == (0, False) and again == (0, False)
    assert asked == [], f"D asked the source to match a request with a {kind}"
    s.update_state_after_alloc(r, Blocks([1, 2, 3]), 0)
    assert s.take_jobs() == []
    assert s.request_finished(r) is False
    (warning,) = [w for w in warnings_of(caplog) if "prefilling locally" in w]
    assert kind.split()[0].lower() in warning.lower(), warning


def test_the_refusal_is_warned_about_once_not_for_every_request(caplog):
    s, _ = scheduler()
    with caplog.at_level(logging.WARNING):
        for i in range(50):
            assert s.get_num_new_matched_tokens(
                request(f"r{i}", mm_features=[image_feature()]), 0
            ) == (0, False)
    assert len([w for w in warnings_of(caplog) if "prefilling locally" in w]) == 1


def test_a_text_request_still_asks_its_source():
    s, asked = scheduler()
    r = request()
    assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    wait_asked(s, r)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # the source did not answer
    assert asked == [SRC + "/match_blocks"]


@pytest.mark.parametrize("flag", ["do_remote_decode", "do_remote_prefill"])
def test_a_request_of_upstreams_pd_path_is_never_owned_even_with_push_from(flag):
    """Owning it would skip upstream's send (P) or pull (D) bookkeeping."""
    s, _ = scheduler()
    r = request(params={"push_from": SRC, flag: True, "transfer_id": "x1"})
    assert not s.handles(r)
    assert not SchedulerExtension.owns(SimpleNamespace(push=s), r)
    assert s.handles(request(params={"push_from": SRC, flag: False}))

"""connector/push/protocol.py: /push_blocks request validation names the field."""

import json

import pytest
from helpers import C_SOURCE, required_fields

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.protocol import (
    KVFingerprint,
    MatchBlocksResponse,
    PushBlocksRequest,
    PushBlocksResponse,
    PushRequestError,
    parse_push_request,
    validate,
)

BS = 16
NT = 4  # KV tensors registered by the serving instance
NBLK = 64  # the destination's KV cache: blocks per tensor
FP = KVFingerprint(
    model="Arch:0123456789abcdef", dtype="bfloat16/auto", block_size=BS, tp_size=1
)


def body(**over):
    b = {
        "token_ids": list(range(3 * BS + 5)),  # 3 full blocks
        "cache_salt": None,
        "lora_name": None,
        "block_size": BS,
        "dst_session": "10.0.0.2:17777",
        # one KV tensor every 4 GiB: disjoint for any block_len used here
        "dst_kv_base_addrs": [(i + 1) << 32 for i in range(NT)],
        "dst_block_ids": [7, 8, 9],
        "request_id": "req-1",
        "deadline_unix_ms": 1_700_000_000_000,
        "dst_num_blocks": NBLK,
        "source_id": C_SOURCE,
        "fingerprint": FP.model_dump(),
    }
    b.update(over)
    return b


def check(payload):
    validate(parse_push_request(payload), block_size=BS, num_kv_tensors=NT)


def test_valid_request():
    req = parse_push_request(body())
    validate(req, block_size=BS, num_kv_tensors=NT)
    assert req.dst_block_ids == [7, 8, 9]
    # the HTTP route hands over the raw body: JSON bytes parse to the same request
    assert parse_push_request(json.dumps(body()).encode()) == req
    # Fewer destination blocks than full blocks is fine (D may want a shorter prefix).
    check(body(dst_block_ids=[3]))
    check(body(dst_session="[::1]:5000", cache_salt="s", lora_name="l"))
    minimal = {
        k: v
        for k, v in body().items()
        if k not in ("cache_salt", "lora_name", "request_id")
    }
    check(minimal)
    check(body(budget_ms=30_000))  # the relative budget beside the deadline (optional)


@pytest.mark.parametrize(
    "over, field",
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2] * BS}, "token_ids"),
        ({"token_ids": list(range(BS - 1)), "dst_block_ids": [1]}, "token_ids"),
        ({"token_ids": "1 2 3"}, "token_ids"),
        ({"token_ids": [1.5] * BS}, "token_ids"),
        ({"block_size": 32}, "block_size"),
        ({"block_size": "16"}, "block_size"),
        ({"dst_session": "10.0.0.2"}, "dst_session"),
        ({"dst_session": ":17777"}, "dst_session"),
        ({"dst_session": "h:0"}, "dst_session"),
        ({"dst_session": "h:70000"}, "dst_session"),
        ({"dst_session": "h:abc"}, "dst_session"),
        ({"dst_kv_base_addrs": [1, 2, 3]}, "dst_kv_base_addrs"),
        ({"dst_kv_base_addrs": [1, 2, 3, 4, 5]}, "dst_kv_base_addrs"),
        ({"dst_kv_base_addrs": [1, 2, 0, 4]}, "dst_kv_base_addrs"),
        ({"dst_block_ids": []}, "dst_block_ids"),
        ({"dst_block_ids": [1, 2, 3, 4]}, "dst_block_ids"),
        ({"dst_block_ids": [1, -1]}, "dst_block_ids"),
        ({"dst_block_ids": [5, 5]}, "dst_block_ids"),
        ({"dst_block_ids": [True, 2]}, "dst_block_ids"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"lora_name": ["x"]}, "lora_name"),
        ({"request_id": 12}, "request_id"),
        ({"unexpected": 1}, "unexpected"),
        ({"budget_ms": 0}, "budget_ms"),
        ({"budget_ms": -5}, "budget_ms"),
        ({"budget_ms": "5000"}, "budget_ms"),
        ({"budget_ms": 5000.0}, "budget_ms"),
    ],
)
def test_invalid_names_field(over, field):
    with pytest.raises(PushRequestError) as ei:
        check(body(**over))
    assert ei.value.field == field
    assert ei.value.detail()["field"] == field
    assert ei.value.message


@pytest.mark.parametrize("missing", required_fields(PushBlocksRequest))
def test_missing_required_field(missing):
    b = body()
    del b[missing]
    with pytest.raises(PushRequestError) as ei:
        check(b)
    assert ei.value.field == missing


def test_body_not_an_object():
    with pytest.raises(PushRequestError):
        parse_push_request([1, 2, 3])


def test_response_model():
    r = PushBlocksResponse(
        status="ok",
        matched_blocks=3,
        matched_tokens=48,
        total_full_blocks=3,
        message="",
    )
    assert r.model_dump() == {
        "status": "ok",
        "matched_blocks": 3,
        "matched_tokens": 48,
        "pushed_blocks": 0,
        "total_full_blocks": 3,
        "bytes": 0,
        "seconds": 0.0,
        "message": "",
        "push_id": None,
    }
    with pytest.raises(ValueError):
        PushBlocksResponse(status="maybe")
    assert PushBlocksRequest.model_json_schema()["required"]


def test_first_block_offsets_the_destination_range():
    check(body(first_block=1, dst_block_ids=[8, 9]))
    with pytest.raises(PushRequestError) as e:
        check(body(first_block=2, dst_block_ids=[8, 9]))
    assert e.value.field == "dst_block_ids"
    with pytest.raises(PushRequestError) as e:
        check(body(first_block=-1))
    assert e.value.field == "first_block"


def test_block_len_must_match_when_given():
    req = parse_push_request(body(block_len=4096))
    validate(req, block_size=BS, num_kv_tensors=NT, block_len=4096)
    with pytest.raises(PushRequestError) as e:
        validate(req, block_size=BS, num_kv_tensors=NT, block_len=8192)
    assert e.value.field == "block_len"


def test_match_answer_must_carry_what_the_hold_needs():
    answer = {
        "matched_blocks": 3,
        "matched_tokens": 48,
        "total_full_blocks": 3,
        "fingerprint": FP.model_dump(),
        "engine_timeout_s": 30,
        "source_id": C_SOURCE,
        "now_unix_ms": 1_700_000_000_000,
    }
    assert MatchBlocksResponse.model_validate(answer).engine_timeout_s == 30
    for missing in ("engine_timeout_s", "now_unix_ms"):
        with pytest.raises(ValueError):
            MatchBlocksResponse.model_validate(
                {k: v for k, v in answer.items() if k != missing}
            )
    with pytest.raises(ValueError):
        MatchBlocksResponse.model_validate({**answer, "engine_timeout_s": 30.0})

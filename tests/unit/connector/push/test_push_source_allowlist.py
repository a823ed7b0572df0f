"""D's allowlist of push sources: a source outside it is refused without a call,
and the allowlist and D's HTTP client agree on what a source's host is.
"""

from __future__ import annotations

import time

import httpx
import pytest
from helpers import (
    BS,
    SCHED_FP,
    ask,
    d_request,
    fresh,
    match_answer,
)

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.config import (
    ConfigError,
    ExtConfig,
    normalize_source,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.common.peer_client import (
    Answer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.push.decode_scheduler import (
    PushScheduler,
)

ALLOWED = "http://c:9000"


def allowlist_scheduler(sources=(ALLOWED,)):
    sched = PushScheduler(
        BS,
        ExtConfig(
            push_min_tokens=0, push_match_timeout_s=2, push_sources=tuple(sources)
        ),
        SCHED_FP,
    )
    calls = []

    def post(source, path, content, headers, deadline):
        calls.append(source + path)
        return Answer(200, fresh(match_answer()))

    sched._lanes.post = post
    return sched, calls


@pytest.mark.parametrize(
    "source",
    [
        "http://evil:9000",
        "http://c:9001",
        "https://c:9000",
        "http://c.evil:9000",
        "http://c:9000@evil:80",
        "http://evil:80#@c:9000",
        "http://evil:80?@c:9000",
        "http://evil:80/@c:9000",
        "http://c:9000 @evil:80",
        "c:9000",
        "http://c",
        "file:///etc/passwd",
        "gopher://c:9000",
        "//c:9000",
        "http://:9000",
        "http://c:9000\n@evil",
        12345,
        ["http://c:9000"],
        "http://user:pw@c:9000",
        "http://c:9000/push_blocks?",
        "http://c:9000/x",
    ],
)
def test_push_from_outside_the_allowlist_is_refused_without_a_call(source):
    sched, calls = allowlist_scheduler()
    r = d_request(source=source)
    assert sched.handles(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(r, 0) == (
        0,
        False,
    )  # asked again: still nothing
    time.sleep(0.05)
    assert calls == [] and sched._lanes.sources() == []  # no thread, no connection made
    assert sched.stats["refused_sources"] == 1 and sched.take_jobs() == []


def test_empty_allowlist_refuses_every_source():
    sched, calls = allowlist_scheduler(())
    assert ask(sched, d_request(source=ALLOWED)) == (0, False)
    assert calls == [] and sched.stats["refused_sources"] == 1


@pytest.mark.parametrize(
    "source",
    [
        "http://c:9000:1",
        "http://c:99999",
        "http://c:abc",
        "http://[::1:9000",
        "http://[zz]:9000",
    ],
)
def test_unparsable_push_from_is_refused_not_raised(source):
    """A client names push_from; whatever it writes must end in local prefill,
    never in an exception out of the scheduler's get_num_new_matched_tokens."""
    sched, calls = allowlist_scheduler()
    r = d_request(source=source)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert calls == [] and sched.stats["refused_sources"] == 1


@pytest.mark.parametrize(
    "source", ["http://c:9000", "HTTP://C:9000/", "http://c:9000//", "Http://c:9000"]
)
def test_push_from_equivalent_to_an_allowed_source_is_queried(source):
    sched, calls = allowlist_scheduler()
    assert ask(sched, d_request(source=source)) == (4 * BS, True)
    (url,) = calls
    u = httpx.URL(url)  # where httpx really connects: the allowed host and port
    assert (u.scheme, u.host, u.port) == (
        "http",
        "c",
        9000,
    ) and u.path == "/match_blocks"
    assert sched.stats["refused_sources"] == 0


@pytest.mark.parametrize(
    "text,normalized",
    [
        ("HTTP://Host:9000/", "http://host:9000"),
        ("http://host:9000", "http://host:9000"),
        ("  http://HOST:9000/path?q=1#f ", "http://host:9000"),
        ("https://h.example:443/", "https://h.example:443"),
        ("http://user:pw@Host:9000", "http://host:9000"),
        ("http://[::1]:8000/", "http://[::1]:8000"),
        ("http://[FE80::1]:8000", "http://[fe80::1]:8000"),
    ],
)
def test_normalize_source(text, normalized):
    assert normalize_source(text) == normalized
    assert normalize_source(normalized) == normalized


@pytest.mark.parametrize(
    "text",
    [
        "host:9000",
        "http://host",
        "ftp://host:21",
        "http://:9000",
        "",
        "9000",
        "http://host:",
        "http://host:99999",
        "http://host:abc",
        "http://[::1:80",
    ],
)
def test_normalize_source_refuses_with_config_error(text):
    with pytest.raises(ConfigError, match="MOONCAKE_PUSH_SOURCES"):
        normalize_source(text)


def test_push_sources_from_the_environment():
    cfg = ExtConfig.from_env({"MOONCAKE_PUSH_SOURCES": " HTTP://A:1/ ,http://b:2,, "})
    assert cfg.push_sources == ("http://a:1", "http://b:2")
    assert ExtConfig.from_env({}).push_sources == ()
    with pytest.raises(ConfigError, match="MOONCAKE_PUSH_SOURCES"):
        ExtConfig.from_env({"MOONCAKE_PUSH_SOURCES": "http://a:1,b:2"})


@pytest.mark.parametrize(
    "source",
    [
        "http://evil:80\\@c:9000",
        "http://evil%40:80@c:9000",
        "http://evil:80;@c:9000",
        "http://c:9000@evil:80",
        "http://evil:80#@c:9000",
        "http://c:9000%2f@evil:80",
        "http://evil\t:80@c:9000",
        "http://c:9000\\\\evil:80",
    ],
)
def test_allowlist_and_http_client_agree_on_the_host(source):
    """A source the allowlist accepts is one httpx connects to: no parser differential."""
    try:
        accepted = normalize_source(source) == ALLOWED
    except ValueError:
        accepted = False
    if not accepted:
        return
    try:
        u = httpx.URL(f"{source}/match_blocks")
    except httpx.InvalidURL:
        return  # D cannot send it: the match fails, D prefills locally
    assert (u.host, u.port) == ("c", 9000), (
        f"{source!r} is allowed but httpx goes to {u.host}"
    )

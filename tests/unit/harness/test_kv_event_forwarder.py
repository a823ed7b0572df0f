"""harness/routers.py's KVEventForwarder: the loopback ZMQ forwarder between an
instance's KV-event publisher and vllm-router passes frames both ways, and a port
it cannot bind leaves nothing open behind its error."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest
import zmq

from harness.launcher import free_port
from harness.routers import KVEventForwarder


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_frames_pass_from_publisher_to_subscriber():
    port = free_port()
    ctx = zmq.Context()
    try:
        with KVEventForwarder(port) as fwd:
            pub = ctx.socket(zmq.PUB)
            sub = ctx.socket(zmq.SUB)
            pub.connect(f"tcp://127.0.0.1:{port}")
            sub.connect(fwd.outbound)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 200)
            deadline = time.monotonic() + 10
            got = None
            while got is None and time.monotonic() < deadline:
                pub.send_multipart([b"topic", b"\x01", b"payload"])
                with contextlib.suppress(zmq.Again):
                    got = sub.recv_multipart()
            pub.close(linger=0)
            sub.close(linger=0)
        assert got == [b"topic", b"\x01", b"payload"]
    finally:
        ctx.term()


def test_a_taken_port_raises_and_leaves_nothing_open():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        before = open_fds()
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            KVEventForwarder(port)
        assert open_fds() == before
    finally:
        taken.close()

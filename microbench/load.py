"""Background decode load: N concurrent decode streams kept running on an instance."""

from __future__ import annotations

import threading
import time

import httpx

from harness.prompts import PromptSource


class DecodeLoad:
    """Keeps `streams` requests decoding on `url` (short prompts, long outputs) until stopped.

    Each stream is a thread that sends one completion after another, so the
    instance always has about `streams` running decode requests. Bounded: every
    request has a timeout and the whole load stops with the context.
    """

    def __init__(
        self,
        url: str,
        model: str,
        streams: int,
        vocab_size: int,
        prompt_len: int = 32,
        max_tokens: int = 512,
        seed: int = 99,
    ):
        self.url, self.model, self.streams = url, model, streams
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.prompts = PromptSource(vocab_size, seed=seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.completed = 0
        self.errors: list[str] = []

    def _run(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self._stop.is_set():
                with self._lock:
                    prompt = self.prompts(self.prompt_len)
                try:
                    r = client.post(
                        self.url + "/v1/completions",
                        json={
                            "model": self.model,
                            "prompt": prompt,
                            "max_tokens": self.max_tokens,
                            "temperature": 0.0,
                            "ignore_eos": True,
                        },
                    )
                    r.raise_for_status()
                    with self._lock:
                        self.completed += 1
                except httpx.HTTPError as e:
                    with self._lock:
                        self.errors.append(repr(e))
                    if self._stop.wait(1.0):
                        return

    def __enter__(self) -> DecodeLoad:
        for i in range(self.streams):
            t = threading.Thread(target=self._run, name=f"decode-load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        time.sleep(2.0)  # let the streams get past their prefill
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        # Requests in flight finish on their own (bounded by max_tokens); the
        # threads are daemons, and the cluster is torn down right after.
        for t in self._threads:
            t.join(timeout=0.1)

"""harness/metrics.py's samples(): a metric's values from a /metrics text, all
label sets or only those holding given label pairs."""

from __future__ import annotations

from harness.metrics import samples

TEXT = """\
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{model_name="m,1",source="local_compute"} 5.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 7.0
vllm:prompt_tokens_by_source_total{source="local_cache_hit_old"} 2.0
vllm:prompt_tokens_total 12.0
"""


def test_every_label_set_without_a_filter():
    assert samples(TEXT, "vllm:prompt_tokens_by_source_total") == [5.0, 7.0, 2.0]
    assert samples(TEXT, "vllm:prompt_tokens_total") == [12.0]


def test_only_the_label_sets_holding_the_pairs():
    name = "vllm:prompt_tokens_by_source_total"
    assert samples(TEXT, name, {"source": "local_compute"}) == [5.0]
    assert samples(TEXT, name, {"source": "local_cache_hit"}) == [7.0]
    assert samples(TEXT, name, {"source": "local_cache_hit", "engine": "0"}) == [7.0]
    assert samples(TEXT, name, {"source": "local"}) == []
    assert samples(TEXT, "vllm:prompt_tokens_total", {"source": "local_compute"}) == []

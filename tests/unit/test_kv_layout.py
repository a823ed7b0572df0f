"""connector/kv_layout.py against the attention backends' own KV cache shapes."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.ext.kv_layout import kernel_block_dim


def test_cpu_backend_block_dim_is_minus_two():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    # CPU layout: (2, num_blocks, num_kv_heads, block_size, head_size)
    assert kernel_block_dim(CPUAttentionBackend, 128, 64) == -2
    shape = CPUAttentionBackend.get_kv_cache_shape(7, 128, 3, 64)
    assert shape[kernel_block_dim(CPUAttentionBackend, 128, 64)] == 128


def test_flash_attn_layout_matches_upstream_hardcoded_index():
    fa = pytest.importorskip("vllm.v1.attention.backends.flash_attn")
    # Upstream hard-codes -3 for (2, num_blocks, block_size, num_kv_heads, head_size).
    assert kernel_block_dim(fa.FlashAttentionBackend, 16, 128) == -3


def test_mla_layout_matches_upstream_hardcoded_index():
    class MLALike:  # the MLA backends' layout: (num_blocks, block_size, head_size)
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return (num_blocks, block_size, head_size)

    assert kernel_block_dim(MLALike, 64, 576) == -2


def test_ambiguous_layout_is_refused_with_a_clear_error():
    class Weird:
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
            return (num_blocks * block_size, block_size, head_size)

    with pytest.raises(ValueError, match="block dimension"):
        kernel_block_dim(Weird, 16, 64)

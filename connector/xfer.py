# SPDX-License-Identifier: Apache-2.0
"""D's pull request to P (upstream's MooncakeXferMetadata) with this series' fields.

``ext`` carries what P checks before it writes into D layer by layer: D's give-up
time and limits (ExtConfig.decode_limits) and KV fingerprint. Optional and last: an
instance without it ignores the field (msgspec), an upstream D's request has ``ext=None``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeXferMetadata,
)


class ExtXferMetadata(MooncakeXferMetadata):
    ext: dict[str, Any] | None = None


def with_ext(metadata: MooncakeXferMetadata, ext: dict[str, Any]) -> ExtXferMetadata:
    """The same request with this series' fields."""
    fields = {n: getattr(metadata, n) for n in metadata.__struct_fields__ if n != "ext"}
    return ExtXferMetadata(**fields, ext=ext)

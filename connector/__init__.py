# SPDX-License-Identifier: Apache-2.0
"""This series' MooncakeConnector (placed into the tree by build.py as ``.../mooncake/ext``).

What upstream calls: connector.py (the subclasses vLLM builds for
"MooncakeConnector"), hooks.py (the hook points in upstream's worker), xfer.py
(D's pull request with this series' fields). Each side's additions:
scheduler_extension.py, worker_extension.py, with metadata.py between them and
routes.py for the bootstrap server. The capabilities: layerwise/, push/,
hashsync/; what they share: common/.
"""

# SPDX-License-Identifier: Apache-2.0
"""This series' MooncakeConnector (placed into the tree by build.py as ``.../mooncake/ext``).

Upstream calls connector.py, hooks.py and xfer.py; each side's additions are in
scheduler_extension.py and worker_extension.py, with metadata.py between them.
"""

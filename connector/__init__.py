# SPDX-License-Identifier: Apache-2.0
"""Extensions to vLLM's MooncakeConnector (placed into the tree by build.py).

Upstream files only carry small hooks into these modules; the logic lives here
so the patch series stays small and rebaseable.
"""

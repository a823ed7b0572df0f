# SPDX-License-Identifier: Apache-2.0
"""Scheduler -> worker prefix-cache block-hash sync (placed into the tree by build.py)."""

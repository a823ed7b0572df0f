# SPDX-License-Identifier: Apache-2.0
"""Block-hash sync: the scheduler's prefix cache mirrored in its workers.

hash_config.py, hashing.py   how a prompt's blocks are hashed (as the scheduler does)
scheduler_recorder.py        scheduler: BlockPool's cache/evict events, in order
scheduler_sync.py            scheduler: the per-step delta sent to the workers
worker_table.py              worker: hash -> block id, matchable once computed
worker_sync.py               worker: the mirror and its lookups (prefix push's source)
"""

# SPDX-License-Identifier: Apache-2.0
"""What every capability of this series shares: configuration (read once), the
endpoint guard, bounded calls to a peer's HTTP server, terminal engine writes
and how long they can still land, the KV fingerprint, KV reads for proof of
write, GPU ordering, I/O-thread placement, transport defaults, test-only fault
injection."""

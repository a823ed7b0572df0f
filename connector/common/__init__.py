# SPDX-License-Identifier: Apache-2.0
"""What every capability of this series shares: configuration (read once), the
endpoint guard, terminal engine writes, the KV fingerprint, KV reads for proof
of write, GPU ordering, I/O-thread placement, transport defaults, test-only
fault injection."""

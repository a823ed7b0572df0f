# SPDX-License-Identifier: Apache-2.0
"""What every capability of this series shares: configuration, the endpoint guard,
bounded peer calls, terminal engine writes, the KV fingerprint, proof-of-write
reads, GPU ordering, I/O-thread placement, transport defaults, fault injection."""

"""Point-to-point: the transport contract (contract), the matching engine over
any transport (engine), shared memory (shm, segment) and TCP (tcp)."""

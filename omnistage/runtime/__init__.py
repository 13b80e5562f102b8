"""Inter-process transport for stages: a pickle-free codec, shared-memory arenas, duplex channels."""

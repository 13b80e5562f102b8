"""User-facing APIs: Omni (offline, blocking) and AsyncOmni (streaming)."""

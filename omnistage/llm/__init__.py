"""The autoregressive engine: paged KV blocks, a token-budget scheduler, a model runner."""

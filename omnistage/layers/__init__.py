"""Building blocks below both the AR engine (`llm/`) and the model files (`models/`,
`diffusion/`): linear layer kinds and their packing, oneDNN's GEMM, RMSNorm and RoPE, the
paged-attention module the models call, and reading HF-format checkpoints."""

"""KV memory: the block-major tensors of each tier, their layouts, and block copies."""

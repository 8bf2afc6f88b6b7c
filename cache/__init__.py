"""KV-cache bookkeeping: block hashing, block pools, prefix index, fences, storage.

Handles block ids, hashes and sequence numbers only, never tensors.
"""

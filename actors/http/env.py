"""The environment variables that carry the HTTP edge's API keys.

Keys are secrets: they travel in the environment, never in a config file or the run dir
(:mod:`ringfence.runtime.secrets`). This module holds only the names, so that the ``[server]``
section, which declares its key setting with one of them, can name them from below the edge.
"""

from __future__ import annotations

API_KEY_ENV = "RINGFENCE_API_KEY"  # vLLM's VLLM_API_KEY: keys, comma-separated
# The key ringfence router presents to its instances (theirs, not its clients').
INSTANCE_KEY_ENV = "RINGFENCE_INSTANCE_API_KEY"

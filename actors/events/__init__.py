"""KV events on the wire: vLLM's format, a ZMQ publisher with replay (see README.md)."""

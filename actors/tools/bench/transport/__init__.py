"""The runtime's own benchmarks (``ringfence bench ring`` and ``hop``, the link figures) and
the demo topology they and the runtime's tests run. Never imported by the runtime."""

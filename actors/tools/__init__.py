"""The tools: what is built on the product to measure and test it. The product never
imports a tool (``tests/project/test_imports.py`` checks it); actors/commands.py names
the benchmarks and actors/config.py the tools' config sections by import path only.

- ``bench/``: every ``ringfence bench NAME``, the launcher they share, plots, the fault
  matrix (``faults/``), the HTTP serving benchmarks (``serving/``) and the transport
  benchmarks of the runtime's rings and links (``transport/``: ``ring``, ``link``, ``hop``).
- ``testing/``: what tests run against: the in-process runner (the plain-loop reference),
  random programs and their sequential oracle, the protocol harness, the demo pipeline
  (the runtime's own workload), the shared-memory builders and leak checks (``shm.py``),
  the storage helpers (``storage.py``) and a throwaway redis-server (``redis_server.py``).

A new benchmark is a module in actors/tools/bench/ with ``add_arguments`` and ``main``,
plus one entry in actors/commands.py's table. A new test helper is a
module in actors/tools/testing/; a tool with its own config section adds one line to
actors/config.py's ``Config.TOOLS``.
"""

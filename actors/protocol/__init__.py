"""The messages between actors: one module per channel direction, each with its registries.

- ``worker``: engine -> worker (``TO_WORKER``), worker -> engine (``FROM_WORKER``);
- ``transfer``: engine -> swap lane (``TO_SWAP``), engine -> store lane (``TO_STORE``),
  either lane -> engine (``FROM_TRANSFER``);
- ``client``: client -> engine (``CLIENT_TO_ENGINE``), engine -> client (``ENGINE_TO_CLIENT``);
- ``resync``: :class:`Resync`, which every executor's inbox takes.

And the shared memory the messages' fences name: ``lanes``, the layout of the ``lanes``
counter block (every rank's watermarks, epochs and step gate).
"""

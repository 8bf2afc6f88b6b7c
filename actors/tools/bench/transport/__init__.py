"""The transport benchmarks: the runtime's rings and links (``ringfence bench ring`` and
``hop``, the link figures). ``hop`` launches the demo pipeline of
:mod:`ringfence.actors.tools.testing.demo`. Never imported by the runtime."""

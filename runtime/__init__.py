"""Actor runtime: the wire codec, the ``Actor`` base and its run loop (the driver), config
loading, structured logs, topologies, the supervisor and the ``ringfence`` command line."""

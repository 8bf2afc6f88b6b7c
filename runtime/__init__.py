"""Actor runtime: wire codec, command line, benchmarks, and (later) the run loop and supervisor."""

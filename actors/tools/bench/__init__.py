"""``ringfence bench NAME``: the benchmarks above the runtime, each against its baseline in
the same run, the one launcher they share, plots, and the fault matrix. Never imported by
the product."""

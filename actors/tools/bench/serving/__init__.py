"""``ringfence bench serve``: load over HTTP against ``ringfence serve``, beside the same
requests through ``ringfence launch``. ``stats`` holds the arithmetic (arrivals, TTFT, ITL,
TPOT, percentiles), ``client`` the streaming load generator, ``server`` the ``ringfence
serve`` subprocess, ``cli`` the command."""

"""``ringfence replay``: a run checked, explained and re-driven from its logs alone.

``log`` reads and merges the logs, ``checks`` checks I1-I4 and the rest, ``redrive``
repeats the scheduler's calls, ``request`` tells one request's life, ``trace`` writes
a Chrome trace; ``cli`` is the command. Never imported by the product.
"""

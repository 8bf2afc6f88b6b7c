"""Tools that prove the protocol, never imported by the product: the in-process runner
(the plain-loop reference), the sequential oracle and random programs, the harness."""

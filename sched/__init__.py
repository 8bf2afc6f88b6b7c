"""Continuous-batching scheduler: pure and deterministic, no I/O, no clock, no torch."""

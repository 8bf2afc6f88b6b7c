"""The executors of the three lanes: the Worker (step) and the Transfer lanes (swap, store)."""

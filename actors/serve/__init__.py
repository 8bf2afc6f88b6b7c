"""``ringfence serve``: the OpenAI-compatible HTTP front end of an instance (an actor)."""

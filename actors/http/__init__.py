"""The HTTP edge ``ringfence serve`` and ``ringfence router`` share: OpenAI's error body, API
keys and their tenants, TLS, body limits and deadlines, and an instance's load."""

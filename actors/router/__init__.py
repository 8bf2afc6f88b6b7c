"""``ringfence router``: runs each OpenAI request over a prefill and a decode instance."""

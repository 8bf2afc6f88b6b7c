"""The serving side's events: the HTTP front end of ``ringfence serve`` and
``ringfence router``.
"""

from __future__ import annotations

from typing import Final

from ringfence.runtime.events.event import Event, event

SERVING_EVENTS: Final[dict[str, Event]] = {
    # The HTTP front end of ringfence serve (actor "frontend", actors/serve/frontend.py);
    # ``request`` is its own request id (the engine's key is "frontend-0/<inc>/<request>").
    "server.listening": event(
        "info",
        "host port tls client_certificates",
        "the HTTP server accepts connections here; tls: HTTPS, client_certificates: every "
        "client must present a certificate the server.ssl_ca_certs CA issued",
    ),
    "server.ready": event(
        "info", "", "every actor is live and the engine began: requests are served"
    ),
    "server.abort": event(
        "info",
        "request output_tokens",
        "the client went away or a stop string ended it: the request's Abort went to the engine "
        "after output_tokens tokens (its request.finish says how many the engine made)",
    ),
    "server.unsendable": event(
        "warning", "request error", "the codec refused a request's Submit: it ends with a 400"
    ),
    "server.fields_ignored": event(
        "warning",
        "path fields",
        "a request held fields the API does not know (escaped to printable ASCII): ignored, "
        "as vLLM does, and named in its answer's X-Ringfence-Ignored-Fields header",
    ),
    "server.requests_lost": event(
        "warning",
        "requests error",
        "the engine died or was replaced: its requests end with an error event",
    ),
    # ringfence router (actors/router/; no actor of a run: its lines go to its stderr, with
    # "actor": "router"). ``request`` is the router's own id, sent to the prefill instance.
    "router.started": event(
        "info",
        "host port tls client_certificates instances",
        "every instance answered and the pool was checked; tls, client_certificates: as "
        "server.listening's",
    ),
    "router.instance_down": event(
        "warning",
        "request instance error",
        "an aggregated instance could not be reached: the request goes to the next choice, "
        "and the policy routes around the instance and forgets what its index held",
    ),
    "router.instance_up": event(
        "info",
        "instance",
        "an aggregated instance found dead answers again as the same model, serving: it is "
        "followed afresh and routed to again",
    ),
    "router.instance_refused": event(
        "warning",
        "instance why",
        "an aggregated instance found dead answered again, but not as the pool's instance "
        "(another role or model) or not serving yet: it stays routed around, asked again",
    ),
    "router.no_load": event(
        "warning",
        "instance",
        "an aggregated instance has no GET /ringfence/load: the policy weighs it by the "
        "router's own count of requests in flight there alone",
    ),
    "router.no_events": event(
        "warning",
        "instance",
        "an aggregated instance publishes no KV events (events.enabled false): the cache "
        "policy scores it as holding nothing",
    ),
    "router.routed": event(
        "info",
        "request kind outcome status total_s instance policy prompt_blocks cached_blocks "
        "first_byte_s",
        "a request sent to an aggregated instance ended: the instance the policy chose, the "
        "prompt's full blocks and the weighted blocks of it the instance held",
    ),
    "router.answered": event(
        "info",
        "request kind outcome status total_s decode prefill retries claims fallback prefill_s "
        "stored_blocks first_byte_s prompt_blocks decode_cached prefill_cached prefill_skipped",
        "a request ended (outcome as the requests metric counts it: ok, relayed_error, "
        "no_room, decode_failed, client_closed, error); retries: reserve calls after the "
        "first; claims: 1 unless a reservation expired; fallback: why the prefill failed; "
        "under the cache policy, the prompt's full blocks and the weighted blocks of them the "
        "chosen decode and prefill instances held (prefill_skipped: the decode instance held "
        "them all)",
    ),
    "router.reserve_failed": event(
        "warning",
        "request decode error",
        "a decode instance failed a reserve call (unreachable, a bad answer, an unexpected "
        "status): the request tries the other decode instances, then again",
    ),
    "router.gave_up": event(
        "warning",
        "request waited_s last retries",
        "no decode instance had room within reserve_timeout_s: the client got a 503",
    ),
    "router.fell_back": event(
        "warning",
        "request why error prefill decode prompt_tokens",
        "the prefill failed or was not tried (why: no_instance, refused, timeout, "
        "http_error, bad_answer, transport): the decode instance computes the prompt itself",
    ),
    "router.expired": event(
        "info",
        "request decode reservation",
        "a claim found its reservation expired: reserving again",
    ),
    "router.decode_lost": event(
        "error",
        "request decode error",
        "the decode instance failed during the claim: a 502, or a stream's last error event",
    ),
}

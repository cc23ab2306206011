"""What the router and the hosts both speak: the messages between them, their errors, the HTTP
that carries them, the shared secret that guards it, and the /v1/sweeps envelope that carries
several sweeps at once.

    serving_errors  ServingError and its kinds, their HTTP status and OpenAI-shaped JSON
    wire            the router <-> host message: one safetensors body with a JSON header
    requests        reading a host's request: every malformed body, header or tensor a 400
    auth            the shared secret: loaded, presented and checked before a body is read
    transport       HTTP between router and hosts: URLs, timeouts, hop latency, errors
    batching        the batcher: jobs that arrive together and share a key run as one batch
    coalesce        /v1/sweeps: several sweeps bound for one host in one request, and back
    declared        the settings' flags, `--set` keys and docs/serving.md table, derived

Imports nothing of serving/ outside shared/ (tests/test_layers.py).
"""

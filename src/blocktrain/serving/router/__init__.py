"""The router in front of a chain of hosts: which hosts serve which model, one traversal of
them (failing over between replicas), the generation loops over it, the admission limits, and
the router's request-level work (`Router`).

    replicas          `URL|URL` positions of the chain and the scores that choose a replica
    directory         which hosts serve which model, from their /v1/info
    traversal         one message along a model's route: failover, pinning, traces, stats
    chain             the messages of a traversal: a sweep, a verify sweep, a stage step
    streams           the generation loops over a chain, yielding the new bytes as they come
    generate_schemas  the sampling parameters every request shares; /v1/generate's models
    limits            admission: requests per client a minute, work per request and in flight
    client_tokens     the clients' tokens (--set tokens_file=PATH), checked before the body is read
    router_settings   how the router runs: its hosts, the wire, every limit, each checked
    chain_router      the router's work: a request made a validated job, and its bytes
    readiness         /readyz: a 1-byte sweep through every replica of every hop

Of serving/ it imports only shared/: the router reaches the hosts over HTTP, never their code,
and knows nothing of the OpenAI routes above it (tests/test_layers.py).
"""

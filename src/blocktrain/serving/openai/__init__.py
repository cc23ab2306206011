"""The router's HTTP face: the OpenAI-compatible API (completions and chat, plain or streamed)
and the app that serves it beside BlockTrain's own /v1/generate.

    schemas      the request and response models of /v1/completions
    chat         /v1/chat/completions: its models and the byte-level chat template
    choices      the `n` choices of one request over the chain: stops, logprobs, finish
    openai_api   the OpenAI routes, plain or as server-sent events
    router_app   the router's FastAPI app: every route, every error in OpenAI's shape

Of serving/ it imports shared/ and router/: it runs over `router.chain_router.Router`, and the
router imports nothing of it (tests/test_layers.py).
"""

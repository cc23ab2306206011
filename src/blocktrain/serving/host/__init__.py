"""A block host: the blocks (or reference stages) of a run it loads, the sweeps and stages it
runs on them, the caches it keeps per generation, and its HTTP app.

    loading        what a host loads: only its blocks or stages of a run folder
    sessions       the caches kept per generation: KV per stage, clean streams per block
    sweeps         a batch of sweeps at one grid point as one pass, and the last host's answer
    host_settings  how one host runs: its runs and blocks, --next, its bounds, each checked
    block_host     the work behind the routes: one sweep, one autoregressive stage, passed on
    host_app       the host's FastAPI app: the routes, the shared secret, body limits
    shapes         logical shapes: what a host would hold of a model far larger than this one

Of serving/ it imports only shared/: a host knows nothing of the router (tests/test_layers.py).
"""

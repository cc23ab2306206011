"""The protocol's service: the round engine on the wall clock, every event persisted; what the
HTTP routes call, with no FastAPI here.

    aggregator_service  AggregatorService: identity, registration, pulls, pushes, ticks
    admission           who may call and push: token, rate, worker, block; refusal rows
    pushes              the push path: an update's six steps to accepted or refused (a mixin)
    drift_jobs          each commit's drift observation on a thread of its own, outside the lock
    streams             relayed streams (route = relay): who may push one, which is taken (a mixin)
    identity            who is calling: the bearer token and the worker it speaks for
    access              what a client may cost: AccessLimits and the per-token rate limit
    placement           which blocks this aggregator serves, and where the others live
    updates             what the push and pull paths carry: context, reply, ledger columns
    live_eval           the validation CE of the assembled model every live_eval_every rounds, in a
                        background thread (the evaluator injected); STATE/evals.jsonl

Imports core/ and store/ only of protocol/ (tests/test_layers.py).
"""

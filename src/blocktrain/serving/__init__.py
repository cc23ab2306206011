"""Serving the assembled model across hosts (docs/serving.md).

- `host`: a block host (FastAPI app) that runs its blocks' sampler steps, or its stages of the
  reference with KV caches, and answers the state for the next host (or forwards it to its
  own --next); it takes work only with the shared secret (`auth`). `batching` and `sweeps` run
  concurrent sweeps at the same point as one batch.
- `router`: the router (FastAPI app) with `/v1/generate` and the OpenAI-compatible
  `/v1/completions` and `/v1/chat/completions` (`openai_api`, `choices`, `chat`); `limits` caps
  its requests per client and the work per request and in flight.
- `chain`: one traversal of the hosts (failing over between replicas); `streams`: the
  generation loops over it; `directory`: which hosts serve which model; `replicas`: `URL|URL`
  positions and health scores; `readiness`: `/readyz`, a 1-byte sweep through every host.
- `wire`, `transport`, `errors`: the message format, HTTP with emulated hop latency, the errors.
- `loading`, `shapes`: what a host loads; logical shapes for planning and throughput runs.

See docs/serving.md.
"""

from blocktrain.serving.errors import (
    BadRequest,
    HostError,
    HostRefused,
    HostTimeout,
    HostUnavailable,
    ServingError,
)
from blocktrain.serving.host import HostSettings
from blocktrain.serving.host_app import create_app as create_host_app
from blocktrain.serving.loading import HostedModel, ModelSource, load_hosted_model
from blocktrain.serving.router import RouterSettings
from blocktrain.serving.router_app import create_app as create_router_app

__all__ = [
    "BadRequest",
    "HostError",
    "HostRefused",
    "HostSettings",
    "HostTimeout",
    "HostUnavailable",
    "HostedModel",
    "ModelSource",
    "RouterSettings",
    "ServingError",
    "create_host_app",
    "create_router_app",
    "load_hosted_model",
]

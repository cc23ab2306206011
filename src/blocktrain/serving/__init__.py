"""Serving the assembled model across hosts (docs/serving.md). The package is in rooms, each a
subpackage whose `__init__.py` lists its modules; a room imports only the rooms the table in
docs/architecture.md allows (tests/test_layers.py):

    shared/   what the router and the hosts both speak: wire, errors, transport, secret
    host/     a block host: what it loads, the sweeps and stages it runs, its caches, its app
    router/   the router in front of a chain: directory, replicas, traversals, streams, limits
    openai/   the router's HTTP face: the OpenAI-compatible API and the app that serves it

The names below are the public entry points, re-exported from their rooms.
"""

from blocktrain.serving.host.host_app import create_app as create_host_app
from blocktrain.serving.host.host_settings import HostSettings
from blocktrain.serving.host.loading import HostedModel, ModelSource, load_hosted_model
from blocktrain.serving.openai.router_app import create_app as create_router_app
from blocktrain.serving.router.router_settings import RouterSettings
from blocktrain.serving.shared.serving_errors import (
    BadRequest,
    HostError,
    HostRefused,
    HostTimeout,
    HostUnavailable,
    ServingError,
)

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

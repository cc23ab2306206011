"""Moved to `blocktrain.httpserve` (the bottom layer, so that protocol/ can use it too); these
names stay importable from here until the serving modules import them from there."""

from __future__ import annotations

from blocktrain.httpserve import ThreadedServer, bind, run, url_of

__all__ = ["ThreadedServer", "bind", "run", "url_of"]

"""The one exception tree of BlockTrain.

    BlockTrainError            anything the user can fix; the CLI prints it as one line, exit 2
    ├── ConfigError            a bad setting: names the field and the allowed values
    ├── DataError              a missing, empty or non-text corpus, or a split that is not there
    ├── CheckpointError        a missing, corrupt or foreign run folder or weights file
    └── ProtocolError          the aggregator/worker protocol cannot proceed
        ├── Refused            the aggregator answered 4xx: carries the reason code
        └── Unreachable        no answer from the aggregator within the retry budget

Library code raises these with a message that says what was wrong and what to do; it never
prints. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class BlockTrainError(Exception):
    """Base of every error a user can act on."""


class ConfigError(BlockTrainError):
    """A configuration value is invalid or unknown."""


class DataError(BlockTrainError):
    """The training or evaluation text cannot be used."""


class CheckpointError(BlockTrainError):
    """A run folder or weights file is missing, corrupt or not BlockTrain's."""


class ProtocolError(BlockTrainError):
    """The decentralised-training protocol cannot proceed (state folder, token, aggregator)."""


class Refused(ProtocolError):
    """The aggregator refused a request; `reason` is the machine-readable code of
    docs/protocol.md, `status` the HTTP status."""

    def __init__(self, reason: str, detail: str = "", status: int = 400) -> None:
        super().__init__(f"refused ({reason}): {detail}" if detail else f"refused ({reason})")
        self.reason = reason
        self.detail = detail
        self.status = status


class Unreachable(ProtocolError):
    """The aggregator did not answer (connection refused, timeouts, 5xx) within the retry
    budget."""

"""One exception root for the pipeline and the reason codes of dead-letter records."""
from __future__ import annotations


class PipelineError(Exception):
    """Root of every error the pipeline raises on purpose."""


class ConfigError(PipelineError):
    """A setting is missing or invalid; the message says how to fix it."""


class DecodeError(PipelineError):
    """Bytes that are not a valid event of a known schema.

    `reason` is a dead-letter reason code, `where` says which record or position.
    """

    def __init__(self, reason: str, detail: str, where: str = "") -> None:
        self.reason = reason
        self.detail = detail
        self.where = where
        super().__init__(f"{reason}: {detail}" + (f" (at {where})" if where else ""))


class EncodeError(PipelineError):
    """A record that does not fit its schema."""


class ValidationError(PipelineError):
    """A decoded event whose content breaks an invariant (lengths, NaN, ordering)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class ManifestError(PipelineError):
    """A checkpoint or batch manifest that is malformed."""


class IntegrityError(PipelineError):
    """Bytes whose sha256 differs from the one recorded for them."""


class ObjectStoreError(PipelineError):
    """The object store failed (after retries)."""


class ObjectNotFound(ObjectStoreError):
    """The object does not exist."""


class InfraError(PipelineError):
    """The local platform cannot start or reach a server."""


class CheckpointError(PipelineError):
    """A checkpoint cannot be stored, found or verified."""


class RewardError(PipelineError):
    """A reward function raised; the trajectory goes to the dead-letter topic."""


# Dead-letter reason codes. Every rejected record carries exactly one.
REASONS = (
    "bad_magic",
    "truncated",
    "unknown_schema",
    "schema_mismatch",
    "missing_field",
    "bad_id",  # an episode or group id with a control character
    "unknown_domain",
    "unknown_environment",  # domain env/<name> whose package is not installed where it is read
    "length_mismatch",
    "bad_logprob",
    "bad_step",
    "oversize",
    "unknown_episode",
    "claim_unavailable",
    "reward_error",
    "processing_error",  # an unexpected failure on this record (a bug): it is set aside, the worker goes on
)

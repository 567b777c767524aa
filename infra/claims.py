"""Claim checks: token payloads too large for the log go to the object store; the event keeps key and sha256."""
from __future__ import annotations

from dataclasses import replace

from infra.objectstore import ObjectStore
from schemas.errors import IntegrityError, ObjectNotFound, ValidationError
from schemas.keys import claim_key
from schemas.packing import CLAIM_THRESHOLD, join_payload, split_payload, turn_payload_size
from schemas.records import PolicyTurn, RolloutEvent


def offload(event: RolloutEvent, store: ObjectStore, ns: str, threshold: int = CLAIM_THRESHOLD) -> RolloutEvent:
    """The event as it should be published: large PolicyTurn payloads replaced by a claim check."""
    body = event.body
    if not isinstance(body, PolicyTurn) or turn_payload_size(body) <= threshold:
        return event
    slim, payload = split_payload(body, claim_key(ns, event.episode_id, event.event_id))
    store.put_verified(slim.claim.key, payload)  # type: ignore[union-attr]
    return replace(event, body=slim)


def resolve(event: RolloutEvent, store: ObjectStore) -> RolloutEvent:
    """The event with its claimed payload restored; ValidationError('claim_unavailable') if it cannot be."""
    body = event.body
    if not isinstance(body, PolicyTurn) or body.claim is None:
        return event
    try:
        return replace(event, body=join_payload(body, store.get(body.claim.key)))
    except (ObjectNotFound, IntegrityError) as exc:
        raise ValidationError("claim_unavailable", f"{body.claim.key}: {exc}") from exc

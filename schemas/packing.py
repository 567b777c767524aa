"""Token ids and log-probs as packed little-endian bytes (int32 / float32), and the claim-check split."""
from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import replace
from typing import Iterable

from schemas.errors import IntegrityError
from schemas.records import ClaimCheck, PolicyTurn

# Payloads above this size travel through the object store; the event carries key and sha256.
CLAIM_THRESHOLD = 512 * 1024
_SWAP = sys.byteorder != "little"


def _pack(kind: str, values: Iterable[float] | Iterable[int]) -> bytes:
    arr = array(kind, values)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


def _unpack(kind: str, data: bytes) -> array:
    arr = array(kind)
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr


def pack_ids(ids: Iterable[int]) -> bytes:
    return _pack("i", ids)


def unpack_ids(data: bytes) -> list[int]:
    return _unpack("i", data).tolist()


def pack_floats(values: Iterable[float]) -> bytes:
    return _pack("f", values)


def unpack_floats(data: bytes) -> list[float]:
    return _unpack("f", data).tolist()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def turn_payload_size(turn: PolicyTurn) -> int:
    return len(turn.tokens) + len(turn.logprobs) + len(turn.obs_tokens)


def split_payload(turn: PolicyTurn, key: str) -> tuple[PolicyTurn, bytes]:
    """The turn without its token payload, and the payload to store under `key`."""
    header = pack_ids([len(turn.obs_tokens), len(turn.tokens), len(turn.logprobs)])
    payload = header + turn.obs_tokens + turn.tokens + turn.logprobs
    claim = ClaimCheck(key=key, sha256=sha256_hex(payload), size=len(payload))
    return replace(turn, obs_tokens=b"", tokens=b"", logprobs=b"", claim=claim), payload


def join_payload(turn: PolicyTurn, payload: bytes) -> PolicyTurn:
    """The turn with its payload restored; raises IntegrityError if the payload is not the claimed one."""
    assert turn.claim is not None, "join_payload needs a turn with a claim"
    if sha256_hex(payload) != turn.claim.sha256 or len(payload) != turn.claim.size:
        raise IntegrityError(f"claim {turn.claim.key}: sha256 or size differs from the event")
    n_obs, n_tok, n_lp = unpack_ids(payload[:12])
    body = payload[12:]
    return replace(
        turn,
        obs_tokens=body[:n_obs],
        tokens=body[n_obs:n_obs + n_tok],
        logprobs=body[n_obs + n_tok:n_obs + n_tok + n_lp],
        claim=None,
    )

"""Loads the .avsc files, expands named references and computes CRC-64-AVRO fingerprints."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

AVRO_DIR = Path(__file__).with_name("avro")
# Named types that other schemas reference, in the order they must be defined.
LOAD_ORDER = (
    "ClaimCheck", "EpisodeStarted", "PolicyTurn", "SandboxResult", "EpisodeEnded", "RolloutEvent",
    "Trajectory", "BatchManifest", "CheckpointPublished", "DeadLetter", "PipelineMetric", "TaskStats",
)
PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


@dataclass(frozen=True)
class SchemaEntry:
    name: str  # full name, e.g. trajpipe.RolloutEvent
    version: int
    expanded: dict[str, Any]  # self-contained JSON schema (logical types removed)
    parsed: Any  # fastavro parsed schema
    fingerprint: bytes  # 8 bytes, little-endian CRC-64-AVRO of the canonical form


def _full_name(node: dict[str, Any]) -> str:
    name = node["name"]
    return name if "." in name else f"{node.get('namespace', '')}.{name}".lstrip(".")


def _expand(node: Any, defs: dict[str, Any], seen: set[str], namespace: str) -> Any:
    """Inline each named type at its first use, as the Avro spec's canonical form requires."""
    if isinstance(node, str):
        if node in PRIMITIVES:
            return node
        full = node if "." in node else f"{namespace}.{node}"
        if full in seen:
            return full
        seen.add(full)
        return _expand_named(defs[full], defs, seen)
    if isinstance(node, list):
        return [_expand(branch, defs, seen, namespace) for branch in node]
    kind = node["type"]
    out = {k: v for k, v in node.items() if k != "logicalType"}
    if kind in ("record", "error", "enum", "fixed"):
        full = _full_name({**node, "namespace": node.get("namespace", namespace)})
        seen.add(full)
        return _expand_named({**node, "namespace": node.get("namespace", namespace)}, defs, seen)
    if kind == "array":
        out["items"] = _expand(node["items"], defs, seen, namespace)
    elif kind == "map":
        out["values"] = _expand(node["values"], defs, seen, namespace)
    elif isinstance(kind, (dict, list)) or kind not in PRIMITIVES:
        out["type"] = _expand(kind, defs, seen, namespace)
    if len(out) == 1:
        return out["type"]
    return out


def _expand_named(node: dict[str, Any], defs: dict[str, Any], seen: set[str]) -> dict[str, Any]:
    namespace = node.get("namespace", "")
    out = {k: v for k, v in node.items() if k != "logicalType"}
    if node["type"] in ("record", "error"):
        out["fields"] = [
            {**f, "type": _expand(f["type"], defs, seen, namespace)} for f in node["fields"]
        ]
    return out


def _collect_named(node: Any, namespace: str, defs: dict[str, Any]) -> None:
    if isinstance(node, list):
        for branch in node:
            _collect_named(branch, namespace, defs)
    elif isinstance(node, dict):
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            ns = node.get("namespace", namespace)
            defs[_full_name({**node, "namespace": ns})] = {**node, "namespace": ns}
            for f in node.get("fields", []):
                _collect_named(f["type"], ns, defs)
        elif kind == "array":
            _collect_named(node["items"], namespace, defs)
        elif kind == "map":
            _collect_named(node["values"], namespace, defs)
        elif isinstance(kind, (dict, list)):
            _collect_named(kind, namespace, defs)


def crc64_fingerprint(expanded: dict[str, Any]) -> bytes:
    canonical = to_parsing_canonical_form(expanded)
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))  # already little-endian byte order


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def build_entry(name: str, version: int, defs: dict[str, Any]) -> SchemaEntry:
    expanded = _expand(name, defs, set(), "trajpipe")
    return SchemaEntry(name, version, expanded, parse_schema(expanded), crc64_fingerprint(expanded))


def load_registry(avro_dir: Path = AVRO_DIR) -> tuple[dict[str, SchemaEntry], dict[bytes, SchemaEntry]]:
    """Current schemas by full name, and every known schema (history included) by fingerprint."""
    defs: dict[str, Any] = {}
    for stem in LOAD_ORDER:
        _collect_named(load_json(avro_dir / f"{stem}.avsc"), "trajpipe", defs)
    current = {f"trajpipe.{stem}": build_entry(f"trajpipe.{stem}", 0, defs) for stem in LOAD_ORDER}
    by_fp = {e.fingerprint: e for e in current.values()}
    for path in sorted((avro_dir / "history").glob("*.v*.avsc")):
        old_defs = dict(defs)
        doc = load_json(path)
        _collect_named(doc, "trajpipe", old_defs)
        version = int(path.name.split(".v")[1].split(".")[0])
        entry = build_entry(_full_name({**doc, "namespace": doc.get("namespace", "trajpipe")}), version, old_defs)
        by_fp.setdefault(entry.fingerprint, entry)
    return current, by_fp

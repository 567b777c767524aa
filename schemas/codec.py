"""Avro single-object encoding of the pipeline's records: C3 01, 8-byte CRC-64-AVRO fingerprint, body.

    from schemas import encode, decode
    data = encode(event)          # bytes for Kafka or a file
    event = decode(data)          # the record, upcast to the current schema
    decode(b"garbage")            # raises DecodeError(reason="bad_magic", ...)
"""
from __future__ import annotations

import io
from typing import Any, Callable, Optional, TypeVar

from fastavro import schemaless_reader, schemaless_writer

from schemas import avrobin
from schemas import records as r
from schemas.errors import DecodeError, EncodeError
from schemas.registry import SchemaEntry, load_registry

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
T = TypeVar("T")

CLASSES: dict[str, type] = {cls.SCHEMA: cls for cls in (*r.TOP_LEVEL, *r.BODY_TYPES, r.ClaimCheck)}


def _claim_from(value: Optional[dict[str, Any]]) -> Optional[r.ClaimCheck]:
    return None if value is None else r.ClaimCheck(**value)


def _body_from(value: tuple[str, dict[str, Any]]) -> r.Body:
    name, fields = value
    if name == r.PolicyTurn.SCHEMA:
        fields["claim"] = _claim_from(fields["claim"])
    return CLASSES[name](**fields)  # type: ignore[no-any-return]


def _turns_from(value: list[dict[str, Any]]) -> tuple[r.TrajectoryTurn, ...]:
    return tuple(r.TrajectoryTurn(**t) for t in value)


def _positions_from(value: list[dict[str, Any]]) -> tuple[r.SourcePosition, ...]:
    return tuple(r.SourcePosition(**p) for p in value)


# Fields holding nested records, and how to rebuild them from fastavro's dicts.
READERS: dict[type, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    r.RolloutEvent: (("body", _body_from),),
    r.Trajectory: (("turns", _turns_from), ("source_offsets", _positions_from)),
    r.BatchManifest: (("trajectory_ids", tuple),),
    r.CheckpointPublished: (("batch_ids", tuple),),
}


def to_avro(obj: Any) -> dict[str, Any]:
    """A record as the dict fastavro writes; unions of records become (name, dict) tuples."""
    out = dict(obj.__dict__)
    if isinstance(obj, r.RolloutEvent):
        body = obj.body
        fields = dict(body.__dict__)
        if isinstance(body, r.PolicyTurn) and body.claim is not None:
            fields["claim"] = dict(body.claim.__dict__)
        out["body"] = (body.SCHEMA, fields)
    elif isinstance(obj, r.Trajectory):
        out["turns"] = [t.__dict__ for t in obj.turns]
        out["source_offsets"] = [p.__dict__ for p in obj.source_offsets]
    return out


# The nested records that to_avro gives fastavro as dicts and READERS builds back: the C path takes and gives
# these classes (and the top-level one), every other nested record as a dict, as fastavro does.
NESTED: dict[type, tuple[type, ...]] = {r.RolloutEvent: (*r.BODY_TYPES, r.ClaimCheck),
                                        r.Trajectory: (r.TrajectoryTurn, r.SourcePosition)}
TUPLE_ARRAYS = (r.Trajectory, r.BatchManifest, r.CheckpointPublished)  # whose arrays READERS makes tuples


def program(cls: type, entry: SchemaEntry) -> avrobin.Program:
    """The C reader/writer's program of a top-level record, giving what the fastavro path gives."""
    classes = {c.SCHEMA: c for c in (cls, *NESTED.get(cls, ()))}  # type: ignore[attr-defined]
    return avrobin.compile_schema(entry.expanded, classes, tuple_arrays=cls in TUPLE_ARRAYS)


def from_avro(cls: type[T], fields: dict[str, Any]) -> T:
    for name, convert in READERS.get(cls, ()):
        fields[name] = convert(fields[name])
    return cls(**fields)


class Codec:
    """Encodes and decodes every top-level record; knows every historical schema by fingerprint."""

    def __init__(self) -> None:
        self.current, self.by_fingerprint = load_registry()
        self.programs: dict[type, avrobin.Program] = {cls: program(cls, self.current[cls.SCHEMA])  # type: ignore[attr-defined]
                                                      for cls in r.TOP_LEVEL}

    def entry(self, cls: type) -> SchemaEntry:
        return self.current[cls.SCHEMA]  # type: ignore[attr-defined]

    def header(self, cls: type) -> bytes:
        return MAGIC + self.entry(cls).fingerprint

    def encode(self, record: Any) -> bytes:
        entry = self.current.get(getattr(record, "SCHEMA", ""))
        if entry is None or type(record) not in r.TOP_LEVEL:
            raise EncodeError(f"{type(record).__name__} is not a top-level record of the pipeline")
        fast = avrobin.write(self.programs[type(record)], record, MAGIC + entry.fingerprint)
        return fast if fast is not None else self.encode_with_fastavro(record, entry)

    def encode_with_fastavro(self, record: Any, entry: SchemaEntry) -> bytes:
        """The encoding without the C writer: what it must equal, and what says why a record does not fit."""
        buf = io.BytesIO()
        buf.write(MAGIC + entry.fingerprint)
        try:
            schemaless_writer(buf, entry.parsed, to_avro(record))
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise EncodeError(f"{entry.name}: {exc}") from exc
        return buf.getvalue()

    def writer_entry(self, data: bytes) -> SchemaEntry:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DecodeError("bad_magic", f"expected bytes, got {type(data).__name__}")
        if len(data) < HEADER_LEN:
            raise DecodeError("truncated", f"{len(data)} bytes, a header needs {HEADER_LEN}", "header")
        if bytes(data[:2]) != MAGIC:
            raise DecodeError("bad_magic", f"first bytes {bytes(data[:2]).hex()} are not c301", "byte 0")
        fp = bytes(data[2:HEADER_LEN])
        entry = self.by_fingerprint.get(fp)
        if entry is None:
            raise DecodeError("unknown_schema", f"no schema has fingerprint {fp.hex()}", "bytes 2-9")
        return entry

    def decode(self, data: bytes, expect: Optional[type[T]] = None) -> Any:
        """The record in `data`, read with the current version of its schema."""
        writer = self.writer_entry(data)
        reader = self.current[writer.name]
        cls = CLASSES[writer.name]
        if expect is not None and cls is not expect:
            raise DecodeError("schema_mismatch", f"expected {expect.__name__}, found {cls.__name__}", "header")
        if writer is reader:  # the current schema: the C reader, when it reads the whole body
            found = avrobin.read(self.programs[cls], data, HEADER_LEN)
            if found is not None and found[1] == len(data):
                return found[0]
        return self.decode_with_fastavro(data, writer, reader, cls)

    def decode_with_fastavro(self, data: bytes, writer: SchemaEntry, reader: SchemaEntry, cls: type) -> Any:
        """The record without the C reader: any schema version, and the DecodeError for bad bytes."""
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            fields = schemaless_reader(
                buf, writer.parsed, reader.parsed, return_record_name=True, return_record_name_override=True
            )
        except (EOFError, StopIteration, IndexError) as exc:
            raise DecodeError("truncated", f"{writer.name} body ends early: {exc!r}", f"byte {buf.tell()}") from exc
        except Exception as exc:  # fastavro raises many types on corrupt bodies
            raise DecodeError("schema_mismatch", f"{writer.name}: {exc!r}", f"byte {buf.tell()}") from exc
        if buf.tell() != len(data):
            raise DecodeError("schema_mismatch", f"{len(data) - buf.tell()} bytes left after {writer.name}", f"byte {buf.tell()}")
        try:
            return from_avro(cls, fields)  # type: ignore[arg-type]
        except (TypeError, KeyError, ValueError) as exc:
            raise DecodeError("schema_mismatch", f"{writer.name}: {exc}") from exc


codec = Codec()


def encode(record: Any) -> bytes:
    return codec.encode(record)


def decode(data: bytes, expect: Optional[type[T]] = None) -> Any:
    return codec.decode(data, expect)

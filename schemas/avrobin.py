"""Avro bodies read and written in C (`schemas/_avrobin.c`): the same bytes and values as fastavro, cheaper.

    program = compile_schema(entry.expanded, CLASSES_BY_NAME)     # once per schema
    data = write(program, record, header)    # header + body; None: take fastavro's path
    found = read(program, data, HEADER_LEN)  # (value, end); None: take fastavro's path

A program is the schema as nested tuples of opcodes, which the C code walks without dict lookups. Records
named in `classes` are read as those (frozen) classes, built without their __init__ as the hot paths here
always have; the rest as dicts. `keep` reads only some fields of the top record and skips the others.

The C code handles only what it does exactly as fastavro does. For anything else (a type fastavro would
coerce, a field left to its default, a malformed body) it raises, and `read`/`write` return None: the
caller's fastavro path then gives the value or raises the error the codec reports. Without the compiled
module (built with the package when a C compiler is there) both always return None.
"""
from __future__ import annotations

import dataclasses
import sys
from types import ModuleType
from typing import Any, Mapping, Optional

from schemas import records

_avrobin: Optional[ModuleType]
try:
    from schemas import _avrobin
except ImportError:  # no C compiler when the package was installed: fastavro's path everywhere
    _avrobin = None

AVAILABLE = _avrobin is not None

(OP_NULL, OP_BOOLEAN, OP_INT, OP_LONG, OP_FLOAT, OP_DOUBLE, OP_BYTES, OP_STRING,
 OP_RECORD, OP_ENUM, OP_ARRAY, OP_MAP, OP_UNION, OP_FIXED) = range(14)
PRIMITIVES = {"null": OP_NULL, "boolean": OP_BOOLEAN, "int": OP_INT, "long": OP_LONG, "float": OP_FLOAT,
              "double": OP_DOUBLE, "bytes": OP_BYTES, "string": OP_STRING}
Program = tuple[Any, ...]

# Every record class of the contracts by its schema's full name.
CLASSES_BY_NAME: dict[str, type] = {getattr(cls, "SCHEMA"): cls for cls in vars(records).values()
                                    if isinstance(cls, type) and dataclasses.is_dataclass(cls)
                                    and isinstance(getattr(cls, "SCHEMA", None), str)}


def compile_schema(schema: Any, classes: Mapping[str, type], keep: Optional[frozenset[str]] = None,
                   tuple_arrays: bool = False, namespace: str = "") -> Program:
    """The program of an expanded schema (named types inlined, no logical types). `keep`: the top record's
    fields to read (None: all). `tuple_arrays`: arrays read as tuples (the records' form) not lists."""
    if isinstance(schema, str):
        if schema not in PRIMITIVES:
            raise ValueError(f"named type {schema!r}: compile the expanded schema")
        return (PRIMITIVES[schema],)
    if isinstance(schema, list):
        return (OP_UNION, tuple(compile_schema(s, classes, None, tuple_arrays, namespace) for s in schema))
    kind = schema["type"]
    if "logicalType" in schema:
        raise ValueError(f"logical type {schema['logicalType']!r} is read as fastavro converts it")
    if kind in PRIMITIVES:
        return (PRIMITIVES[kind],)
    if kind == "record":
        name = schema["name"] if "." in schema["name"] else f"{schema.get('namespace', namespace)}.{schema['name']}"
        inner = name.rpartition(".")[0]
        fields = schema["fields"]
        names = tuple(sys.intern(f["name"]) for f in fields)
        if keep is not None and not keep <= set(names):
            raise ValueError(f"{name} has no fields {sorted(keep - set(names))}")
        return (OP_RECORD, classes.get(name), names,
                tuple(compile_schema(f["type"], classes, None, tuple_arrays, inner) for f in fields),
                None if keep is None else tuple(n in keep for n in names))
    if kind == "enum":
        return (OP_ENUM, tuple(schema["symbols"]))
    if kind == "array":
        return (OP_ARRAY, compile_schema(schema["items"], classes, None, tuple_arrays, namespace), tuple_arrays)
    if kind == "map":
        return (OP_MAP, compile_schema(schema["values"], classes, None, tuple_arrays, namespace), (OP_STRING,))
    if kind == "fixed":
        return (OP_FIXED, int(schema["size"]))
    raise ValueError(f"unknown Avro type {kind!r}")


def write(program: Program, value: Any, prefix: bytes) -> Optional[bytes]:
    """`prefix` and the value's Avro body, or None where fastavro's path must write it (or say why not)."""
    if _avrobin is None:
        return None
    try:
        return _avrobin.write(program, value, prefix)  # type: ignore[no-any-return]
    except _avrobin.Unsupported:
        return None


def read(program: Program, data: bytes, pos: int) -> Optional[tuple[Any, int]]:
    """The value at `pos` and where it ends, or None where fastavro's path must read it (or say why not)."""
    if _avrobin is None:
        return None
    try:
        return _avrobin.read(program, data, pos)  # type: ignore[no-any-return]
    except _avrobin.Unsupported:
        return None

"""The tool-call contract of the terminal domain: what a policy turn says, parsed the same way where it is
executed (producers/) and where it is re-scored from the log (streams/).

A turn is one JSON function call, in the style chat models use:

    {"name": "run", "arguments": {"command": "python -m unittest -q"}}
    {"name": "read_file", "arguments": {"path": "shapes.py"}}
    {"name": "write_file", "arguments": {"path": "shapes.py", "content": "..."}}
    {"name": "run_tests", "arguments": {}}
    {"name": "submit", "arguments": {}}

Text before or after the object is ignored (a model may think aloud); the first JSON object that has a
"name" is the call. Anything else is a tool error: the policy is told why, and the step counts.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

TOOLS: dict[str, tuple[str, ...]] = {  # name -> required string arguments
    "run": ("command",),
    "read_file": ("path",),
    "write_file": ("path", "content"),
    "run_tests": (),
    "submit": (),
}
MAX_PATH = 200


class ToolCallError(ValueError):
    """A turn that is no valid tool call; the message is what the policy is shown."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        return json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)


def parse_call(text: str) -> ToolCall:
    """The turn's tool call; ToolCallError (with a message for the policy) when there is none."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict) and "name" in value:
            return _checked(value)
        start = text.find("{", start + 1)
    raise ToolCallError('no tool call: answer with one JSON object {"name": ..., "arguments": {...}}; tools: '
                        + ", ".join(TOOLS))


def _checked(value: dict[str, Any]) -> ToolCall:
    name = value["name"]
    if name not in TOOLS:
        raise ToolCallError(f"unknown tool {name!r}; tools: {', '.join(TOOLS)}")
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{name}: arguments must be an object")
    for key in TOOLS[name]:
        if not isinstance(arguments.get(key), str):
            raise ToolCallError(f"{name}: argument {key!r} (a string) is required")
    args = {k: arguments[k] for k in TOOLS[name]}
    if "path" in args:
        args["path"] = repo_path(args["path"])
    return ToolCall(name, args)


def repo_path(path: str) -> str:
    """A path inside the repository, normalised; ToolCallError for one that leaves it."""
    clean = posixpath.normpath(path.strip()) if path.strip() else ""
    if not clean or clean == "." or clean.startswith(("/", "..")) or len(clean) > MAX_PATH or "\x00" in clean:
        raise ToolCallError(f"path {path!r} is not a file inside the repository")
    return clean

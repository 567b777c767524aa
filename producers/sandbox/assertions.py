"""Rewrites a HumanEval-style check() so that each assertion is counted and reported on its own.

    tests = instrument_tests(problem["test"])
    tests.source        # check() now records every assert through the harness's recorder
    tests.assert_count  # assert statements in check(): the total when the run never finishes
    tests.helpers       # names the tests use but do not define (poly, encode_cyclic): the solution's

Each `assert TEST, MSG` directly inside check() (loops and ifs included) becomes

    try:
        assert TEST, MSG
    except BaseException as __trajpipe_exc:
        __trajpipe_rec.fail(LINE, "assert TEST, MSG", __trajpipe_exc)
    else:
        __trajpipe_rec.ok()

so a failing assertion no longer hides the ones after it. The recorder is bound as a keyword-only
default of check(), evaluated when check() is defined (after the solution ran), so the solution cannot
swap it by assigning a global of the same name. Asserts in functions nested inside check() keep their
plain meaning: an AssertionError there stops check() and is reported as such.
"""
from __future__ import annotations

import ast
import builtins
import functools
import threading
from dataclasses import dataclass

RECORDER_GLOBAL = "__trajpipe_recorder"
_RECORDER_LOCAL = "__trajpipe_rec"
_EXC_NAME = "__trajpipe_exc"
SOURCE_CLIP = 300  # characters of an assert quoted back in the failure message
# CPython 3.11's parser keeps its AST recursion depth in shared state: parsing from two threads at once
# raises "SystemError: AST constructor recursion depth mismatch" (gh-106905). Pool workers share this.
_PARSE_LOCK = threading.Lock()


@dataclass(frozen=True)
class InstrumentedTests:
    """The rewritten test module and how many assert statements its check() holds."""

    source: str
    assert_count: int
    helpers: tuple[str, ...] = ()
    function: str = "check"


@functools.lru_cache(maxsize=1024)  # the same tests come back for every sample and turn of a task
def instrument_tests(test_code: str, function: str = "check") -> InstrumentedTests:
    """Rewrite `function` in `test_code`; raises SyntaxError or ValueError when the tests are malformed."""
    with _PARSE_LOCK:
        tree = ast.parse(test_code)
    target = _find_function(tree, function)
    rewriter = _AssertRewriter(test_code)
    target.body = [rewriter.visit(stmt) for stmt in target.body]
    _bind_recorder(target)
    source = ast.unparse(ast.fix_missing_locations(tree))
    return InstrumentedTests(source, rewriter.count, _free_names(tree), function)


def _free_names(tree: ast.Module) -> tuple[str, ...]:
    """Global names the tests read but never bind, builtins excepted: what the solution must provide.

    Builtins are excluded on purpose: a solution defining `abs` must not change what the tests compute.
    """
    read: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return tuple(sorted(read - bound - set(dir(builtins))))


def _find_function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ValueError(f"the test code defines no top-level function {name}()")


def _bind_recorder(func: ast.FunctionDef) -> None:
    func.args.kwonlyargs.append(ast.arg(arg=_RECORDER_LOCAL))
    func.args.kw_defaults.append(ast.Name(id=RECORDER_GLOBAL, ctx=ast.Load()))


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SOURCE_CLIP else text[: SOURCE_CLIP - 3] + "..."


def _recorder_call(method: str, args: list[ast.expr]) -> ast.Expr:
    func = ast.Attribute(value=ast.Name(id=_RECORDER_LOCAL, ctx=ast.Load()), attr=method, ctx=ast.Load())
    return ast.Expr(value=ast.Call(func=func, args=args, keywords=[]))


class _AssertRewriter(ast.NodeTransformer):
    """Wraps every assert of one function body; leaves nested scopes alone."""

    def __init__(self, source: str) -> None:
        self._source = source
        self.count = 0

    def visit_Assert(self, node: ast.Assert) -> ast.Try:
        self.count += 1
        quoted = _clip(ast.get_source_segment(self._source, node) or ast.unparse(node))
        failed = _recorder_call("fail", [ast.Constant(node.lineno), ast.Constant(quoted),
                                         ast.Name(id=_EXC_NAME, ctx=ast.Load())])
        handler = ast.ExceptHandler(type=ast.Name(id="BaseException", ctx=ast.Load()), name=_EXC_NAME,
                                    body=[failed])
        wrapped = ast.Try(body=[node], handlers=[handler], orelse=[_recorder_call("ok", [])], finalbody=[])
        return ast.copy_location(wrapped, node)

    # The recorder is a parameter of check() only: nested scopes cannot see it.
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        return node

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AsyncFunctionDef:
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.Lambda:
        return node

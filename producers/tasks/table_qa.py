"""Table QA tasks: seeded financial documents as text, with questions needing lookup and arithmetic.

Each task shows three documents of one company: an income statement and a balance sheet (two fiscal years
each) and a letter to shareholders that quotes a few figures (sometimes wrongly). Questions read one
statement (margins, growth between the two periods, liquidity), combine both statements (return on assets,
return on equity, asset turnover), or check one document against another (the letter's figure against the
statement's). The spec names every cell the answer needs, in whichever document it is, and the
demonstration shows the cells and the calculation before the answer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from math import floor
from typing import Any, Callable

from producers.tasks.task import Task
from schemas.tasks import make_spec

INCOME = "Income statement"
BALANCE = "Balance sheet"
LETTER = "Letter to shareholders"
_PREFIXES = ("Norvex", "Aldera", "Brightwater", "Calder", "Dunmore", "Everline", "Fairholt", "Greystone",
             "Harrow", "Ironvale", "Juniper", "Kestrel", "Lumen", "Meridian", "Northgate", "Oakridge")
_SUFFIXES = ("Industries", "Holdings", "Systems", "Foods", "Logistics", "Energy", "Retail", "Labs")


@dataclass(frozen=True)
class Statement:
    """A two-year statement: rows of (label, (value in the first year, value in the second year))."""

    title: str
    years: tuple[str, str]
    rows: tuple[tuple[str, tuple[int, int]], ...]

    def value(self, row: str, year: str) -> int:
        return dict(self.rows)[row][self.years.index(year)]

    def render(self, subtitle: str) -> str:
        lines = [f"{self.title} ({subtitle})", f"| Line item | {self.years[0]} | {self.years[1]} |",
                 "| --- | ---: | ---: |"]
        lines += [f"| {label} | {a:,} | {b:,} |" for label, (a, b) in self.rows]
        return "\n".join(lines)


def _income_year(rng: random.Random, revenue: int) -> list[int]:
    cogs = round(revenue * rng.uniform(0.35, 0.75))
    gross = revenue - cogs
    opex = round(gross * rng.uniform(0.3, 0.8))
    operating = gross - opex
    interest = round(operating * rng.uniform(0.02, 0.15))
    pretax = operating - interest
    tax = round(pretax * rng.uniform(0.15, 0.3))
    return [revenue, cogs, gross, opex, operating, interest, pretax, tax, pretax - tax]


def _balance_year(rng: random.Random, revenue: int) -> list[int]:
    # Scaled to revenue so the two statements of a company look consistent; equity stays positive.
    cash, receivable, inventory = (round(revenue * rng.uniform(lo, hi)) for lo, hi in
                                   ((0.05, 0.3), (0.05, 0.25), (0.02, 0.2)))
    current_assets = cash + receivable + inventory
    ppe = round(revenue * rng.uniform(0.2, 1.0))
    payable, short_debt = round(current_assets * rng.uniform(0.1, 0.4)), round(current_assets * rng.uniform(0.05, 0.3))
    current_liabilities = payable + short_debt
    long_debt = round(ppe * rng.uniform(0.1, 0.6))
    liabilities = current_liabilities + long_debt
    assets = current_assets + ppe
    return [cash, receivable, inventory, current_assets, ppe, assets, payable, short_debt,
            current_liabilities, long_debt, liabilities, assets - liabilities]


INCOME_ROWS = ("Revenue", "Cost of revenue", "Gross profit", "Operating expenses", "Operating income",
               "Interest expense", "Income before tax", "Income tax", "Net income")
BALANCE_ROWS = ("Cash and equivalents", "Accounts receivable", "Inventory", "Total current assets",
                "Property, plant and equipment", "Total assets", "Accounts payable", "Short-term debt",
                "Total current liabilities", "Long-term debt", "Total liabilities", "Shareholders' equity")


def _statement(title: str, labels: tuple[str, ...], years: tuple[str, str], columns: list[list[int]]) -> Statement:
    return Statement(title, years, tuple((label, (columns[0][i], columns[1][i])) for i, label in enumerate(labels)))


@dataclass(frozen=True)
class QuestionKind:
    """A question: the cells it needs as (document, row, year offset: 0 the asked year, -1 the year before),
    how they combine, and how the calculation reads (`calc`, formatted with the values v0, v1, ...)."""

    name: str
    cells: tuple[tuple[str, str, int], ...]
    formula: Callable[[list[Fraction]], Fraction]
    unit: str
    decimals: int
    text: str
    calc: str


def _ratio(v: list[Fraction]) -> Fraction:
    return v[0] / v[1]


def _percent(v: list[Fraction]) -> Fraction:
    return v[0] / v[1] * 100


def _growth(v: list[Fraction]) -> Fraction:
    return (v[0] - v[1]) / v[1] * 100


KINDS = (
    QuestionKind("gross_margin", ((INCOME, "Gross profit", 0), (INCOME, "Revenue", 0)), _percent, "percent", 2,
                 "What was the gross margin in {year}?", "{v0:,} / {v1:,} x 100"),
    QuestionKind("operating_margin", ((INCOME, "Operating income", 0), (INCOME, "Revenue", 0)), _percent,
                 "percent", 2, "What was the operating margin in {year}?", "{v0:,} / {v1:,} x 100"),
    QuestionKind("net_margin", ((INCOME, "Net income", 0), (INCOME, "Revenue", 0)), _percent, "percent", 2,
                 "What was the net profit margin in {year}?", "{v0:,} / {v1:,} x 100"),
    QuestionKind("net_income_growth", ((INCOME, "Net income", 0), (INCOME, "Net income", -1)), _growth,
                 "percent", 2, "By what percentage did net income change from {prev} to {year}?",
                 "({v0:,} - {v1:,}) / {v1:,} x 100"),
    QuestionKind("revenue_growth", ((INCOME, "Revenue", 0), (INCOME, "Revenue", -1)), _growth, "percent", 2,
                 "By what percentage did revenue change from {prev} to {year}?", "({v0:,} - {v1:,}) / {v1:,} x 100"),
    QuestionKind("current_ratio", ((BALANCE, "Total current assets", 0), (BALANCE, "Total current liabilities", 0)),
                 _ratio, "ratio", 2, "What was the current ratio at the end of {year}?", "{v0:,} / {v1:,}"),
    QuestionKind("debt_to_equity",
                 ((BALANCE, "Short-term debt", 0), (BALANCE, "Long-term debt", 0), (BALANCE, "Shareholders' equity", 0)),
                 lambda v: (v[0] + v[1]) / v[2], "ratio", 2,
                 "What was the debt-to-equity ratio (short-term plus long-term debt over equity)"
                 " at the end of {year}?", "({v0:,} + {v1:,}) / {v2:,}"),
    QuestionKind("working_capital", ((BALANCE, "Total current assets", 0), (BALANCE, "Total current liabilities", 0)),
                 lambda v: v[0] - v[1], "usd_thousands", 0,
                 "What was the working capital (current assets minus current liabilities) at the end of {year}?",
                 "{v0:,} - {v1:,}"),
    # across the two statements
    QuestionKind("return_on_assets", ((INCOME, "Net income", 0), (BALANCE, "Total assets", 0)), _percent,
                 "percent", 2, "What was the return on assets (net income over total assets at year end) in {year}?",
                 "{v0:,} / {v1:,} x 100"),
    QuestionKind("return_on_equity", ((INCOME, "Net income", 0), (BALANCE, "Shareholders' equity", 0)), _percent,
                 "percent", 2, "What was the return on equity (net income over shareholders' equity at year end) in "
                 "{year}?", "{v0:,} / {v1:,} x 100"),
    QuestionKind("asset_turnover", ((INCOME, "Revenue", 0), (BALANCE, "Total assets", 0)), _ratio, "ratio", 2,
                 "What was the asset turnover (revenue over total assets at year end) in {year}?", "{v0:,} / {v1:,}"),
    # a consistency check of one document against another
    QuestionKind("letter_net_income_check", ((LETTER, "Net income", 0), (INCOME, "Net income", 0)),
                 lambda v: v[0] - v[1], "usd_thousands", 0,
                 "The letter to shareholders quotes net income for {year}. By how much does its figure differ from "
                 "the income statement's (letter minus statement; 0 if they agree)?", "{v0:,} - {v1:,}"),
    QuestionKind("letter_assets_check", ((LETTER, "Total assets", 0), (BALANCE, "Total assets", 0)),
                 lambda v: v[0] - v[1], "usd_thousands", 0,
                 "The letter to shareholders quotes total assets at the end of {year}. By how much does its figure "
                 "differ from the balance sheet's (letter minus balance sheet; 0 if they agree)?", "{v0:,} - {v1:,}"),
)
_UNIT_TEXT = {"percent": "Answer as a percentage rounded to {d} decimal places.",
              "ratio": "Answer as a number rounded to {d} decimal places.",
              "usd_thousands": "Answer in USD thousands as a whole number."}


def round_half_up(value: Fraction, decimals: int) -> str:
    """Exact decimal rounding, ties away from zero, as the text a correct answer shows."""
    scaled = abs(value) * 10 ** decimals
    digits = floor(scaled + Fraction(1, 2)) * (1 if value >= 0 else -1)
    return f"{Decimal(digits).scaleb(-decimals):.{decimals}f}"


def _company(rng: random.Random) -> tuple[str, tuple[str, str], Statement, Statement, Statement]:
    name = f"{rng.choice(_PREFIXES)} {rng.choice(_SUFFIXES)}"
    first = rng.randint(2012, 2023)
    years = (f"FY{first}", f"FY{first + 1}")
    revenue = rng.randint(5_000, 900_000)
    revenues = [revenue, round(revenue * rng.uniform(0.8, 1.4))]
    income = _statement(INCOME, INCOME_ROWS, years, [_income_year(rng, r) for r in revenues])
    balance = _statement(BALANCE, BALANCE_ROWS, years, [_balance_year(rng, r) for r in revenues])
    quoted = []  # the letter quotes both figures of both years; a third of the quotes are misstated
    for label, source in (("Net income", income), ("Total assets", balance)):
        values = [source.value(label, y) for y in years]
        quoted.append([v if rng.random() < 2 / 3 else v + rng.choice((-1, 1)) * rng.randint(1, max(1, v // 10))
                       for v in values])
    letter = _statement(LETTER, ("Net income", "Total assets"), years, [[q[0] for q in quoted], [q[1] for q in quoted]])
    return name, years, income, balance, letter


def _letter_text(name: str, letter: Statement) -> str:
    lines = [f"{LETTER} of {name}"]
    for year in letter.years:
        lines.append(f"In {year} we earned net income of USD {letter.value('Net income', year):,} thousand and "
                     f"ended the year with total assets of USD {letter.value('Total assets', year):,} thousand.")
    return "\n".join(lines)


def _prompt(name: str, income: Statement, balance: Statement, letter: Statement, question: str) -> str:
    return (f"Financial documents of {name}.\n\nDocument 1. {income.render('USD thousands')}\n\n"
            f"Document 2. {balance.render('USD thousands, at fiscal year end')}\n\n"
            f"Document 3. {_letter_text(name, letter)}\n\nQuestion: {question}\nAnswer:")


def _cells(documents: dict[str, Statement], kind: QuestionKind, year: str) -> list[dict[str, Any]]:
    cells = []
    for title, row, off in kind.cells:
        document = documents[title]
        column = document.years[document.years.index(year) + off]
        cells.append({"statement": title, "row": row, "column": column, "value": document.value(row, column)})
    return cells


def make_table_task(seed: int, index: int) -> Task:
    """The task at `index` of the seed's sequence: a pure function of (seed, index)."""
    rng = random.Random(f"table:{seed}:{index}")
    name, years, income, balance, letter = _company(rng)
    kind = rng.choice(KINDS)
    year = years[1] if any(off == -1 for _, _, off in kind.cells) else rng.choice(years)
    cells = _cells({INCOME: income, BALANCE: balance, LETTER: letter}, kind, year)
    values = [int(c["value"]) for c in cells]
    exact = kind.formula([Fraction(v) for v in values])
    question = kind.text.format(year=year, prev=years[0]) + " " + _UNIT_TEXT[kind.unit].format(d=kind.decimals)
    spec = make_spec("table", answer=round_half_up(exact, kind.decimals), decimals=kind.decimals,
                     tolerance=0.5 * 10 ** -kind.decimals, unit=kind.unit, kind=kind.name, cells=cells)
    shown = "; ".join(f"{c['statement']}: {c['row']} {c['column']} = {c['value']:,}" for c in cells)
    calculation = kind.calc.format(**{f"v{i}": v for i, v in enumerate(values)})
    return Task(task_id=f"table/{seed}/{index}", domain="table",
                prompt=_prompt(name, income, balance, letter, question), spec=spec,
                demonstration=f"{shown}. {calculation} = {spec['answer']}. Answer: {spec['answer']}")


class TableQASource:
    """`size` generated statements and questions; the same seed gives the same tasks."""

    name = "table"
    domain = "table"

    def __init__(self, seed: int = 0, size: int = 1000) -> None:
        self.seed, self.size = seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"table task index {index} out of range 0..{self.size - 1}")
        return make_table_task(self.seed, index)

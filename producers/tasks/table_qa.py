"""Table QA tasks: seeded financial statements as text tables, with questions needing lookup and arithmetic."""
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
    """A question: the cells it needs as (row, year offset: 0 the asked year, -1 the year before)."""

    name: str
    statement: str
    cells: tuple[tuple[str, int], ...]
    formula: Callable[[list[Fraction]], Fraction]
    unit: str
    decimals: int
    text: str


def _ratio(v: list[Fraction]) -> Fraction:
    return v[0] / v[1]


def _percent(v: list[Fraction]) -> Fraction:
    return v[0] / v[1] * 100


def _growth(v: list[Fraction]) -> Fraction:
    return (v[0] - v[1]) / v[1] * 100


KINDS = (
    QuestionKind("gross_margin", INCOME, (("Gross profit", 0), ("Revenue", 0)), _percent, "percent", 2,
                 "What was the gross margin in {year}?"),
    QuestionKind("operating_margin", INCOME, (("Operating income", 0), ("Revenue", 0)), _percent, "percent", 2,
                 "What was the operating margin in {year}?"),
    QuestionKind("net_margin", INCOME, (("Net income", 0), ("Revenue", 0)), _percent, "percent", 2,
                 "What was the net profit margin in {year}?"),
    QuestionKind("net_income_growth", INCOME, (("Net income", 0), ("Net income", -1)), _growth, "percent", 2,
                 "By what percentage did net income change from {prev} to {year}?"),
    QuestionKind("revenue_growth", INCOME, (("Revenue", 0), ("Revenue", -1)), _growth, "percent", 2,
                 "By what percentage did revenue change from {prev} to {year}?"),
    QuestionKind("current_ratio", BALANCE, (("Total current assets", 0), ("Total current liabilities", 0)),
                 _ratio, "ratio", 2, "What was the current ratio at the end of {year}?"),
    QuestionKind("debt_to_equity", BALANCE,
                 (("Short-term debt", 0), ("Long-term debt", 0), ("Shareholders' equity", 0)),
                 lambda v: (v[0] + v[1]) / v[2], "ratio", 2,
                 "What was the debt-to-equity ratio (short-term plus long-term debt over equity)"
                 " at the end of {year}?"),
    QuestionKind("working_capital", BALANCE, (("Total current assets", 0), ("Total current liabilities", 0)),
                 lambda v: v[0] - v[1], "usd_thousands", 0,
                 "What was the working capital (current assets minus current liabilities) at the end of {year}?"),
)
_UNIT_TEXT = {"percent": "Answer as a percentage rounded to {d} decimal places.",
              "ratio": "Answer as a number rounded to {d} decimal places.",
              "usd_thousands": "Answer in USD thousands as a whole number."}


def round_half_up(value: Fraction, decimals: int) -> str:
    """Exact decimal rounding, ties away from zero, as the text a correct answer shows."""
    scaled = abs(value) * 10 ** decimals
    digits = floor(scaled + Fraction(1, 2)) * (1 if value >= 0 else -1)
    return f"{Decimal(digits).scaleb(-decimals):.{decimals}f}"


def _company(rng: random.Random) -> tuple[str, tuple[str, str], Statement, Statement]:
    name = f"{rng.choice(_PREFIXES)} {rng.choice(_SUFFIXES)}"
    first = rng.randint(2012, 2023)
    years = (f"FY{first}", f"FY{first + 1}")
    revenue = rng.randint(5_000, 900_000)
    revenues = [revenue, round(revenue * rng.uniform(0.8, 1.4))]
    income = _statement(INCOME, INCOME_ROWS, years, [_income_year(rng, r) for r in revenues])
    balance = _statement(BALANCE, BALANCE_ROWS, years, [_balance_year(rng, r) for r in revenues])
    return name, years, income, balance


def _prompt(name: str, income: Statement, balance: Statement, question: str) -> str:
    return (f"Financial statements of {name}.\n\n{income.render('USD thousands')}\n\n"
            f"{balance.render('USD thousands, at fiscal year end')}\n\nQuestion: {question}\nAnswer:")


def _cells(statement: Statement, kind: QuestionKind, year: str) -> list[dict[str, Any]]:
    at = statement.years.index(year)
    return [{"statement": statement.title, "row": row, "column": statement.years[at + off],
             "value": statement.value(row, statement.years[at + off])} for row, off in kind.cells]


def make_table_task(seed: int, index: int) -> Task:
    """The task at `index` of the seed's sequence: a pure function of (seed, index)."""
    rng = random.Random(f"table:{seed}:{index}")
    name, years, income, balance = _company(rng)
    kind = rng.choice(KINDS)
    year = years[1] if any(off == -1 for _, off in kind.cells) else rng.choice(years)
    cells = _cells(income if kind.statement == INCOME else balance, kind, year)
    exact = kind.formula([Fraction(int(c["value"])) for c in cells])
    question = kind.text.format(year=year, prev=years[0]) + " " + _UNIT_TEXT[kind.unit].format(d=kind.decimals)
    spec = make_spec("table", answer=round_half_up(exact, kind.decimals), decimals=kind.decimals,
                     tolerance=0.5 * 10 ** -kind.decimals, unit=kind.unit, kind=kind.name, cells=cells)
    return Task(task_id=f"table/{seed}/{index}", domain="table",
                prompt=_prompt(name, income, balance, question), spec=spec)


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

"""Every number a reproduction page quotes from its tables is the table's number.

The reproduction pages (docs/coverage-report.md, granularity.md, mismatch.md, fork.md, and credit.md,
which quotes the coverage report) hold the markdown tables a run wrote and prose that reads them.
These tests read each page as text and check the prose against the page's own tables:

* every interval ``mean [lo, hi]`` in prose, or in a table of predictions, verdicts or claims, is the
  (mean, lo, hi) of one row of a data table of the page (or of the page it quotes): columns
  ``mean``/``lo``/``hi`` (or the column before ``lo``), ``X``/``X_lo``/``X_hi``, or a cell printed as
  ``m [lo, hi]``. A prose number may be the table's number rounded to fewer decimals, never more;
* every ``k of n`` where ``n`` is the seed count of a table row with per-seed counts (``positive``,
  ``pairs_positive``, ``zero_grad``, ``reached``) is one of that row's counts, and of a row stating
  the interval quoted next to it, if any;
* the shares the coverage report derives from its single-update table (``gain_share``, the share over
  binary) and credit.md's open shares (``open_fraction`` of the V_d sweep) are what the tables give;
* granularity.md shows both full runs of ``multi``: the earlier one (M3 falsified) and the rerun.

An interval quoted from a table the page does not show is in ``NOT_ON_THE_PAGE`` with where it comes
from; where it is a paired difference of two arms the page does show, its mean is checked against the
difference of the two means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# page -> the pages whose tables its prose may quote (itself first)
PAGES = {
    "coverage-report.md": ("coverage-report.md",),
    "granularity.md": ("granularity.md",),
    "mismatch.md": ("mismatch.md",),
    "fork.md": ("fork.md",),
    "credit.md": ("credit.md", "coverage-report.md"),
}
NUM = r"[+\-−]?\d+(?:\.\d+)?"
INTERVAL = re.compile(rf"(?<![\w.])({NUM})\s*(?:[a-z]+\s*)?\[\s*({NUM})\s*,\s*({NUM})\s*\]")
K_OF_N = re.compile(r"(?<![\w.])(\d+) of (\d+)(?![\w.])")
COUNT_COLUMNS = ("positive", "pairs_positive", "zero_grad", "reached")
SUMMARY_COLUMNS = ("prediction", "verdict", "claim")  # a table that reads the data tables

# Intervals quoted from a table that is not on the page. (page, where they come from) -> each quote,
# with (arm, other arm, column) of the page's table whose difference is the quote's mean, or None.
NOT_ON_THE_PAGE: dict[tuple[str, str], list[tuple[str, tuple[str, str, str] | None]]] = {
    ("coverage-report.md", "the paper's figure (per-turn − shuffled), quoted to compare"): [
        ("+0.014 [−0.07, +0.10]", None)],
    ("granularity.md", "the five-arm run's paired differences with GRPO (its report's paired table)"): [
        ("-0.03 [-0.12, 0.06]", ("PRM fixed λ = 0.5", "GRPO", "short: success")),
        ("-0.00 [-0.08, 0.08]", ("PRM fixed λ = 0.5", "GRPO", "long: success")),
        ("-0.04 [-0.08, -0.00]", ("PRM decayed λ", "GRPO", "short: success")),
        ("-0.02 [-0.08, 0.05]", ("PRM decayed λ", "GRPO", "long: success"))],
    ("mismatch.md", "the previous default's paired differences (its report's paired table)"): [
        ("+0.007 [-0.046, 0.061]", ("QAT+InterQ", "QAT", "final")),
        ("-0.000 [-0.053, 0.052]", ("QAT+TIS", "QAT", "final")),
        ("-0.008 [-0.057, 0.040]", ("QAT+MIS", "QAT", "final")),
        ("-0.004 [-0.092, 0.083]", ("QAT+prefix (alpha 1)", "QAT", "final")),
        ("-0.001 [-0.041, 0.038]", ("QAT+global", "QAT", "final")),
        ("-0.052 [-0.184, 0.081]", ("naive", "QAT", "final")),
        ("-0.019 [-0.034, -0.003]", ("QAT", "fp32", "AULC"))],
    ("fork.md", "the train experiment's paired differences (fork_paired.md, not copied)"): [
        ("−12.38 [−12.49, −12.27]", ("FORK (F1)", "recall-only", "length")),
        ("+0.777 [+0.755, +0.800]", ("FORK (F1)", "recall-only", "precision")),
        ("−0.229 [−0.243, −0.214]", ("FORK (F1)", "recall-only", "recall")),
        ("+0.028 [+0.013, +0.043]", ("FORK (F1)", "mean", "recall")),
        ("−0.033 [−0.053, −0.013]", ("FORK (F1)", "mean", "precision")),
        ("+0.27 [+0.12, +0.43]", ("FORK (F1)", "mean", "length"))],
    ("fork.md", "the train experiment's --quick run (3 seeds, 100 updates), whose tables are not shown"): [
        ("−0.008 [−0.051, +0.035]", None),
        ("+0.026 [−0.038, +0.091]", None)],
}


@dataclass(frozen=True)
class Table:
    line: int
    header: tuple[str, ...]
    rows: tuple[tuple[int, tuple[str, ...]], ...]

    @property
    def summary(self) -> bool:
        return any(h.lower() in SUMMARY_COLUMNS for h in self.header)

    def cell(self, row: tuple[str, ...], name: str) -> str | None:
        return row[self.header.index(name)] if name in self.header and self.header.index(name) < len(row) else None


@dataclass(frozen=True)
class Page:
    name: str
    tables: tuple[Table, ...]
    paragraphs: tuple[tuple[int, str], ...]  # (first line, text with its lines joined)


def _cells(line: str) -> tuple[str, ...]:
    cells, cur, code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cur)
            cur = ""
        else:
            cur += ch
    cells.append(cur)
    return tuple(c.strip().replace("**", "").strip() for c in cells)


@cache
def page(name: str) -> Page:
    tables, paragraphs, fenced = [], [], False
    head = rows = None
    para: list[str] = []
    start = 0

    def end_para():
        if para:
            paragraphs.append((start, " ".join(para)))
            para.clear()

    def end_table():
        nonlocal head, rows
        if head is not None:
            tables.append(Table(head[0], head[1], tuple(rows)))
        head = rows = None

    for i, raw in enumerate((DOCS / name).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if line.startswith("```"):
            fenced = not fenced
            end_para(), end_table()
            continue
        if fenced:
            continue
        if line.startswith("|"):
            end_para()
            cells = _cells(line)
            if head is None:
                head, rows = (i, cells), []
            elif not all(set(c) <= set("-: ") for c in cells):
                rows.append((i, cells))
            continue
        end_table()
        if not line:
            end_para()
            continue
        if not para:
            start = i
        para.append(line)
    end_para(), end_table()
    return Page(name, tuple(tables), tuple(paragraphs))


def _dec(s: str) -> Decimal:
    return Decimal(s.replace("−", "-").replace("+", ""))


def _places(s: str) -> int:
    return len(s.split(".")[1]) if "." in s else 0


def same(quoted: str, table: str) -> bool:
    """``quoted`` is ``table`` rounded to ``quoted``'s decimals (never more decimals than the table's,
    except for a table value printed as an integer)."""
    q, t = _dec(quoted), _dec(table)
    if _places(quoted) > _places(table):
        return _places(table) == 0 and q == t
    unit = Decimal(1).scaleb(-_places(quoted))
    return any(t.quantize(unit, rounding=r) == q for r in (ROUND_HALF_UP, ROUND_HALF_EVEN))


def _number(cell: str | None) -> str | None:
    m = re.match(rf"\s*({NUM})(?![\d.])", cell or "")
    return m.group(1) if m else None


def table_intervals(t: Table) -> list[tuple[str, str, str, int]]:
    """The (mean, lo, hi, line) a data table states."""
    out = []
    h = t.header
    columns = [(x, f"{x}_lo", f"{x}_hi") for x in h if f"{x}_lo" in h and f"{x}_hi" in h]
    if "lo" in h and "hi" in h:
        mean = "mean" if "mean" in h else h[h.index("lo") - 1]
        columns.append((mean, "lo", "hi"))
    for line, row in t.rows:
        for cols in columns:
            vals = [_number(t.cell(row, c)) for c in cols]
            if all(vals):
                out.append((*vals, line))
        for c in row:
            out += [(*m.groups(), line) for m in INTERVAL.finditer(c)]
    return out


def quoted_intervals(p: Page) -> list[tuple[int, str, tuple[str, str, str]]]:
    """(line, as printed, (mean, lo, hi)) of every interval in the page's prose and summary tables."""
    out = [(line, m.group(0), m.groups()) for line, text in p.paragraphs for m in INTERVAL.finditer(text)]
    for t in p.tables:
        if t.summary:
            out += [(line, m.group(0), m.groups()) for line, row in t.rows for c in row
                    for m in INTERVAL.finditer(c)]
    return out


def sources(name: str) -> list[tuple[str, int, tuple[str, str, str]]]:
    return [(src, line, (m, lo, hi)) for src in PAGES[name] for t in page(src).tables if not t.summary
            for m, lo, hi, line in table_intervals(t)]


def _allowed(name: str) -> dict[str, tuple[str, tuple[str, str, str] | None]]:
    return {q: (why, diff) for (p, why), quotes in NOT_ON_THE_PAGE.items() if p == name for q, diff in quotes}


@pytest.mark.parametrize("name", list(PAGES))
def test_each_quoted_interval_is_a_row_of_a_table(name):
    p = page(name)
    quotes = quoted_intervals(p)
    assert quotes, f"{name}: no interval found; has the page's format changed?"
    rows = sources(name)
    allowed = _allowed(name)
    bad = []
    for line, text, (m, lo, hi) in quotes:
        if not _dec(lo) <= _dec(m) <= _dec(hi):
            bad.append(f"{name}:{line}: {text!r}: the mean is outside its own interval")
        elif text not in allowed and not any(
                same(m, r[0]) and same(lo, r[1]) and same(hi, r[2]) for _, _, r in rows):
            near = [f"{src}:{ln} {r}" for src, ln, r in rows if same(m, r[0])][:3]
            bad.append(f"{name}:{line}: {text!r} is in no table row of {', '.join(PAGES[name])}"
                       + (f" (rows with that mean: {'; '.join(near)})" if near else ""))
    assert not bad, "\n".join(bad)


def _value(name: str, arm: str, column: str) -> str:
    for t in page(name).tables:
        for _, row in t.rows:
            if row and row[0] == arm and t.cell(row, column) is not None:
                v = _number(t.cell(row, column))
                assert v is not None, f"{name}: {arm!r}, {column!r} is not a number"
                return v
    raise AssertionError(f"{name}: no table row {arm!r} with a column {column!r}")


@pytest.mark.parametrize("name", sorted({p for p, _ in NOT_ON_THE_PAGE}))
def test_intervals_from_elsewhere_are_on_the_page_and_agree_with_its_arms(name):
    """Each allowed quote is still on the page (else its entry goes), and a paired difference's mean
    is the difference of the two arms' means in the page's table, to the printed precision."""
    printed = {text for _, text, _ in quoted_intervals(page(name))}
    bad = []
    for text, (why, diff) in _allowed(name).items():
        if text not in printed:
            bad.append(f"{name}: {text!r} ({why}) is no longer on the page: remove it from NOT_ON_THE_PAGE")
            continue
        if diff is None:
            continue
        a, b = (_value(name, arm, diff[2]) for arm in diff[:2])
        mean = INTERVAL.match(text).group(1)
        slack = sum(Decimal(5).scaleb(-_places(v) - 1) for v in (a, b, mean))
        if abs(_dec(a) - _dec(b) - _dec(mean)) > slack:
            bad.append(f"{name}: {text!r}: mean is not {diff[0]} − {diff[1]} in {diff[2]} ({a} − {b})")
    assert not bad, "\n".join(bad)


def _states(t: Table, row: tuple[str, ...], interval: tuple[str, str, str]) -> bool:
    """The row of ``t`` states ``interval`` (mean, lo, hi)."""
    one_row = Table(t.line, t.header, ((0, row),))
    return any(all(same(q, v) for q, v in zip(interval, r[:3], strict=True)) for r in table_intervals(one_row))


@pytest.mark.parametrize("name", list(PAGES))
def test_seed_counts_are_a_rows_counts(name):
    """'k of n' where n is the seed count of a row with per-seed counts names one of its counts; when an
    interval is quoted next to it (within 60 characters), one of that interval's rows."""
    rows = [(t, row) for src in PAGES[name] for t in page(src).tables for _, row in t.rows
            if "n" in t.header and any(c in t.header for c in COUNT_COLUMNS)]
    seeds = {t.cell(row, "n") for t, row in rows}
    bad, checked = [], 0
    for line, text in page(name).paragraphs:
        intervals = list(INTERVAL.finditer(text))
        for m in K_OF_N.finditer(text):
            k, n = m.groups()
            if n not in seeds:
                continue
            checked += 1
            near = min(intervals, default=None,
                       key=lambda i: max(i.start() - m.end(), m.start() - i.end()))
            if near is not None and max(near.start() - m.end(), m.start() - near.end()) > 60:
                near = None
            if not any(t.cell(row, "n") == n and k in (t.cell(row, c) for c in COUNT_COLUMNS)
                       and (near is None or _states(t, row, near.groups())) for t, row in rows):
                bad.append(f"{name}:{line}: {m.group(0)!r}: no row with n = {n} counts {k} "
                           f"({', '.join(COUNT_COLUMNS)})"
                           + (f" and states {near.group(0)!r}" if near is not None else ""))
    assert not bad, "\n".join(bad)
    if name == "coverage-report.md":
        assert checked >= 6, checked  # the single-update and capability readings quote seed counts


def _single_update(exposure: str, c: str, arm: str, column: str) -> Decimal:
    t = next(t for t in page("coverage-report.md").tables if "gain_share" in t.header)
    for _, row in t.rows:
        if (t.cell(row, "exposure"), t.cell(row, "C"), t.cell(row, "arm")) == (exposure, c, arm):
            return _dec(t.cell(row, column))
    raise AssertionError(f"single-update table: no row {exposure}, C = {c}, {arm}")


def _share_over_binary(c: str) -> Decimal:
    d, b = (_single_update("final", c, arm, "gain_share") for arm in ("discretized", "binary"))
    return (d - b) / (1 - b)


# (a sentence of the coverage report's single-update reading, the share it prints, from the table)
SHARES = [
    (r"keeps (\d+)% of uniform's gain at C = 6", lambda: _single_update("final", "6", "discretized", "gain_share")),
    (r"of uniform's gain at C = 6 \((\d+)% at C = 8\)",
     lambda: _single_update("final", "8", "discretized", "gain_share")),
    (r"keeps about\s+(\d+)% at C = 6", lambda: _share_over_binary("6")),
    (r"and about (\d+)% at C = 8, still not", lambda: _share_over_binary("8")),
    (r"The binary reward keeps (\d+)% of uniform's", lambda: _single_update("final", "6", "binary", "gain_share")),
    (r"visible progress keeps\s+(\d+)% at C = 6", lambda: _single_update("final", "6", "reward_to_go", "gain_share")),
    (r"\((\d+)% with every causal step visible\)",
     lambda: _single_update("independent", "6", "reward_to_go", "gain_share")),
]


@pytest.mark.parametrize("sentence, share", SHARES, ids=[s for s, _ in SHARES])
def test_coverage_shares_are_the_single_update_tables(sentence, share):
    text = " ".join(t for _, t in page("coverage-report.md").paragraphs)
    m = re.search(sentence, text)
    assert m, f"coverage-report.md no longer says {sentence!r}: update SHARES with the new sentence"
    assert same(m.group(1), str(100 * share())), f"{m.group(0)!r}: the table gives {100 * share():.1f}%"


def test_granularity_reports_both_multi_runs():
    """The earlier complete multi run (M3 falsified: long -0.10) is shown beside the rerun (not resolved)."""
    m3 = [(t.line, row) for t in page("granularity.md").tables if t.summary for _, row in t.rows
          if row and row[0] == "M3" and "verdict" in t.header]
    verdicts = [row[-1] for _, row in m3]
    assert any("falsified" in v for v in verdicts) and any("not resolved" in v for v in verdicts), verdicts
    cells = [c for t in page("granularity.md").tables for _, row in t.rows for c in row]
    assert "-0.10 [-1, +1]" in cells and "+0.03 [-0.52, +0.57]" in cells


def test_the_parser_reads_what_the_pages_hold():
    """The checks above can fail: a made-up quote is in no row, a rounded one is, a finer one is not."""
    assert same("0.19", "0.187") and same("-0.000", "0.000") and same("1", "1.000") and same("1.000", "1")
    assert not same("0.188", "0.187") and not same("0.1870", "0.187") and not same("0.18", "0.187")
    rows = [r for _, _, r in sources("credit.md")]
    assert ("-0.187", "-0.348", "-0.026") in rows  # coverage-report.md's paired shuffle table
    assert not any(same("-0.187", m) and same("-0.348", lo) and same("-0.025", hi) for m, lo, hi in rows)
    fork = {r for _, _, r in sources("fork.md")}
    assert ("0.861", "0.824", "0.897") in fork  # win_rate / win_rate_lo / win_rate_hi columns
    assert ("16.00", "15.99", "16.00") in fork  # a cell printed as 'mean [lo, hi]'


def test_credit_open_shares_are_the_coverage_tables():
    """credit.md's 'E[L] / C at q' figures are the coverage report's open_fraction (C = 10, independent)."""
    text = " ".join(t for _, t in page("credit.md").paragraphs)
    quotes = re.findall(r"(\d\.\d+) at `q = (\d(?:\.\d+)?)`", text)
    assert len(quotes) >= 3, quotes
    t = next(t for t in page("coverage-report.md").tables if "open_fraction" in t.header)
    for share, q in quotes:
        rows = [row for _, row in t.rows if t.cell(row, "exposure") == "independent" and same(q, t.cell(row, "vd"))]
        assert rows, f"credit.md quotes q = {q}, which the coverage report's V_d sweep does not hold"
        assert all(same(share, t.cell(row, "open_fraction")) for row in rows), (share, q, rows[0])

"""Text search over a run's answers through a word index: ``q=`` over a million rollouts in
tens of milliseconds, with exactly the answers a scan gives.

The rollouts table's search is a case-insensitive substring match (``task ILIKE '%q%' OR
answer ILIKE '%q%'``; DuckDB's ILIKE lower-cases both sides). A scan of every answer reads
the run's text (about 340 MB for the generated million-rollout run) at each search, about a
second here. :class:`WordIndex` keeps, beside the run's flat index (in its DuckDB file):

- ``vocab(h, w)``: every word of the answers (lower-cased, split at every character that is
  not a letter, a mark, a digit or ``_``: :data:`SPLIT`), with ``h`` a 32-bit hash of it;
- ``words(h, r)``: for each answer, its distinct words' hashes (``r``: the flat index's
  ``_row`` of the rollout).

A search lower-cases the query and splits it the same way (in DuckDB, so both sides use
the same ``lower`` and the same classes). If the answer contains the query, every word of
the query is in the answer: a word between two separators of the query is a word of the
answer, the query's first word ends one (or is one, when the query starts with a separator),
its last word starts one, and a query that is one word is inside one. So the vocabulary is
searched for the words that qualify (a few milliseconds: it is small next to the text), the
rollouts holding a qualifying word for every word of the query are intersected, and only
those are checked with the scan's own ILIKE, unless the query is a single word that no
other word shares a hash with (then the candidates are the answer). A query without a word
character (``%``, ``!?``) scans. Prompts are not indexed: rollouts of a group share theirs,
and prompts recur across steps, so DuckDB stores them dictionary-compressed and matches each
distinct prompt once (a few milliseconds for a million rollouts).

The index is built in slices (:meth:`WordIndex.build`, about half a second of work each, on
the refresh thread), from the oldest rows up: ``upto`` is the last ``_row`` indexed, and a
search scans the rows past it, so a search is always whole, and fast once the build has
caught up. The flat index numbers rows by file and position in the file (``_row``), so a
rebuild of the flat table keeps their numbers; rows of files a compaction replaced stay in
``words`` until the postings are compacted (a search only returns rows still in the table).
"""

from __future__ import annotations

import re
import time
from typing import Any, Sequence

__all__ = ["WordIndex", "SPLIT", "WORD"]

#: a word's characters (RE2 classes, DuckDB's regular expressions): letters, marks, digits, ``_``
WORD = r"[\p{L}\p{M}\p{N}_]"
#: what separates words
SPLIT = r"[^\p{L}\p{M}\p{N}_]+"
#: a word's hash in ``vocab`` and ``words`` (32 bits: collisions are found and checked, see predicate)
HASH = "CAST(hash(w) >> 32 AS UINTEGER)"
_HEX = re.compile(r"[0-9a-f]{6,32}")


def like_pattern(text: str) -> str:
    """``%text%`` for ILIKE with ``ESCAPE '\\'``: ``%`` and ``_`` are characters."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


class WordIndex:
    """The answers' words of one run's flat index (``alias``: its attached database)."""

    #: aim of one :meth:`build` slice, seconds; and its fewest rows
    SLICE_S = 0.5
    MIN_SLICE_ROWS = 5_000

    def __init__(self, alias: str) -> None:
        self.words, self.vocab = f"{alias}.words", f"{alias}.vocab"
        self._tokens = f"{alias}.tokens"
        #: every row of the flat table with ``_row <= upto`` has its words in ``words``
        self.upto = -1
        #: rows indexed (some since replaced by a compaction), against the rows of the table:
        #: when the dead ones dominate, ``words`` is rewritten without them
        self.posted = 0
        self.rows_per_s = 50_000.0
        #: seconds spent building, rows indexed (the benchmark and the docs quote them)
        self.build_s = 0.0
        self._created = False

    def _create(self, cursor: Any) -> None:
        if not self._created:
            cursor.execute(f"CREATE TABLE IF NOT EXISTS {self.words} (h UINTEGER, r BIGINT)")
            cursor.execute(f"CREATE TABLE IF NOT EXISTS {self.vocab} (h UINTEGER, w VARCHAR)")
            self._created = True

    def pending(self, cursor: Any, table: str) -> int:
        """Rows of ``table`` not indexed yet."""
        return int(cursor.execute(f"SELECT count(*) FROM {table} WHERE _row > ?", [self.upto]).fetchall()[0][0])

    def build(self, cursor: Any, table: str, budget_s: float | None = None) -> int:
        """Index the next rows of ``table`` (past ``upto``), about ``budget_s`` seconds of
        work (default :attr:`SLICE_S`); returns how many. One transaction: a search reads
        the words of a slice whole or not at all, and ``upto`` moves after it commits."""
        self._create(cursor)
        budget = max(self.MIN_SLICE_ROWS, int(self.rows_per_s * (budget_s if budget_s is not None else self.SLICE_S)))
        hi, n = cursor.execute(f"SELECT max(_row), count(*) FROM (SELECT _row FROM {table} WHERE _row > ? "
                               f"ORDER BY _row LIMIT {budget})", [self.upto]).fetchall()[0]
        if not n:
            return 0
        t0 = time.perf_counter()
        cursor.execute("BEGIN TRANSACTION")
        try:
            cursor.execute(f"CREATE OR REPLACE TABLE {self._tokens} AS SELECT r, w, {HASH} AS h FROM ("
                           f"SELECT _row AS r, unnest(list_distinct(string_split_regex(lower(answer), '{SPLIT}'))) AS w "
                           f"FROM {table} WHERE _row > ? AND _row <= ?) WHERE w <> ''", [self.upto, hi])
            cursor.execute(f"INSERT INTO {self.vocab} SELECT DISTINCT h, w FROM {self._tokens} t WHERE NOT EXISTS "
                           f"(SELECT 1 FROM {self.vocab} v WHERE v.h = t.h AND v.w = t.w)")
            cursor.execute(f"INSERT INTO {self.words} SELECT h, r FROM {self._tokens} ORDER BY h, r")
            cursor.execute(f"DROP TABLE {self._tokens}")
            cursor.execute("COMMIT")
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
        dt = time.perf_counter() - t0
        self.build_s += dt
        self.upto = int(hi)
        self.posted += int(n)
        if dt > 0.01:
            self.rows_per_s = 0.5 * self.rows_per_s + 0.5 * n / dt
        return int(n)

    def compact(self, cursor: Any, table: str, force: bool = False) -> bool:
        """Rewrite ``words`` without the rows no longer in ``table`` (a compaction's inputs)
        when they are most of it (``force``: when there are any); True when it did."""
        self._create(cursor)
        live = int(cursor.execute(f"SELECT count(*) FROM {table} WHERE _row <= ?", [self.upto]).fetchall()[0][0])
        if self.posted <= (live if force else 2 * live + 50_000):
            return False
        cursor.execute(f"CREATE OR REPLACE TABLE {self.words} AS SELECT h, r FROM {self.words} "
                       f"WHERE r IN (SELECT _row FROM {table}) ORDER BY h, r")
        self.posted = live
        return True

    def reset(self, cursor: Any) -> None:
        """Forget every word (the flat table's rows were renumbered)."""
        cursor.execute(f"DROP TABLE IF EXISTS {self.words}")
        cursor.execute(f"DROP TABLE IF EXISTS {self.vocab}")
        self._created = False
        self.upto, self.posted = -1, 0

    # ----------------------------------------------------------------- searching
    def predicate(self, db: Any, table: str, q: str, columns: Sequence[str] = ("task", "answer"),
                  trace_ids: bool = False) -> tuple[str, list[Any]]:
        """SQL true for the rows of ``table`` (the flat index) whose ``columns`` contain
        ``q`` (case-insensitive), or whose trace id starts with it (``trace_ids``), and its
        parameters; ``db`` runs the few small queries that plan it (``rows(sql, params)``)."""
        pattern = like_pattern(q)
        _, found = db.rows(f"SELECT lower(?), string_split_regex(lower(?), '{SPLIT}'), "
                           f"regexp_matches(lower(?), '^{WORD}'), regexp_matches(lower(?), '{WORD}$')", [q] * 4)
        lowered, parts, starts_word, ends_word = found[0]
        tokens = [p for p in parts if p]
        upto = int(self.upto)
        terms: list[str] = []  # OR-ed (a filter each, not one IN over a union: DuckDB joins less)
        term_params: list[Any] = []
        selects: list[str] = []  # the answers' side: _row IN (their union)
        params: list[Any] = []
        if "task" in columns:
            # prompts: a scan, but each distinct prompt of a column segment is lower-cased once (DuckDB
            # keeps them dictionary-compressed: a group's rollouts share one, and prompts recur across
            # steps); contains(lower(x), lower(q)) is ILIKE '%q%' (DuckDB's ILIKE lower-cases both sides)
            terms.append("contains(lower(task), ?)")
            term_params.append(lowered)
        if "answer" in columns:
            if not tokens or upto < 0:
                selects.append(f"SELECT _row FROM {table} WHERE answer ILIKE ? ESCAPE '\\'")
                params.append(pattern)
            else:
                conds, cond_params = [], []
                for i, tok in enumerate(tokens):
                    left = i > 0 or not starts_word  # a separator before it in the query
                    right = i < len(tokens) - 1 or not ends_word
                    op = "w = ?" if left and right else ("starts_with(w, ?)" if left else
                                                          ("ends_with(w, ?)" if right else "contains(w, ?)"))
                    conds.append(op)
                    cond_params.append(tok)
                postings = [f"SELECT r FROM {self.words} WHERE h IN (SELECT h FROM {self.vocab} WHERE {c})"
                            for c in conds]
                if len(tokens) == 1 and tokens[0] == lowered and not self._collides(db, conds[0], tokens[0]):
                    # the query is one word, shared by no other word's hash: the candidates are the answer
                    selects.append(postings[0])
                    params += cond_params
                else:
                    sql, args = self._checked(db, table, postings, cond_params, pattern)
                    selects.append(sql)
                    params += args
                # the rows not indexed yet: scanned (past upto: their row groups only)
                selects.append(f"SELECT _row FROM {table} WHERE _row > {upto} AND answer ILIKE ? ESCAPE '\\'")
                params.append(pattern)
        if selects:
            terms.append(f"_row IN ({' UNION ALL '.join(selects)})")
            term_params += params
        if trace_ids and _HEX.fullmatch(q):
            terms.append("starts_with(trace_id, ?)")
            term_params.append(q)
        return " OR ".join(terms), term_params

    #: candidates checked against their answers once, here, and given to the page's queries as
    #: a list; a word in more answers than this narrows nothing worth it and is left out
    CHECK_MAX = 20_000

    def _checked(self, db: Any, table: str, postings: list[str], cond_params: list[Any], pattern: str
                 ) -> tuple[str, list[Any]]:
        """The rows whose answer has the query (ILIKE), found from the rows holding each of its
        rare words (in at most :attr:`CHECK_MAX` answers; the intersection of a few small
        sets), checked against their answers once here (DuckDB reads a column segment of the
        answers whole: a check costs about a scan of the segments that hold a candidate): a
        constant list. A query whose every word is common (``the answer is``) scans the answers."""
        rare = []
        for sql, arg in zip(postings, cond_params):
            _, n = db.rows(f"SELECT count(*) FROM (SELECT 1 FROM ({sql}) LIMIT {self.CHECK_MAX + 1})", [arg])
            if n[0][0] <= self.CHECK_MAX:
                rare.append((sql, arg))
        if not rare:
            return f"SELECT _row FROM {table} WHERE answer ILIKE ? ESCAPE '\\'", [pattern]
        _, rows = db.rows(" INTERSECT ".join(sql for sql, _ in rare), [arg for _, arg in rare])
        found = []
        if rows:
            listed = ", ".join(str(int(r[0])) for r in rows)
            # a materialized CTE: the ILIKE is evaluated on the candidates only (pushed into the
            # scan, DuckDB would evaluate it on every answer before the IN)
            _, found = db.rows(f"WITH c AS MATERIALIZED (SELECT _row, answer FROM {table} WHERE _row IN ({listed})) "
                               "SELECT _row FROM c WHERE answer ILIKE ? ESCAPE '\\'", [pattern])
        if not found:
            return "SELECT NULL::BIGINT WHERE false", []
        return f"SELECT unnest([{', '.join(str(int(r[0])) for r in found)}]::BIGINT[])", []

    def _collides(self, db: Any, cond: str, token: str) -> bool:
        """A word that does not qualify shares a hash with one that does (its rollouts would be
        candidates too: the candidates are then checked)."""
        _, rows = db.rows(f"SELECT count(*) FROM {self.vocab} WHERE h IN (SELECT h FROM {self.vocab} WHERE {cond}) "
                          f"AND NOT ({cond})", [token, token])
        return bool(rows[0][0])

"""The text search's word index (rtrace/serve/search.py) finds exactly the rows a scan finds:
``task ILIKE '%q%' OR answer ILIKE '%q%'`` (or a trace id's start), for words, parts of words,
phrases, punctuation, case, Unicode, ``%`` and ``_``; while it is built (rows past ``upto``
are scanned), after rows are replaced (a compaction's inputs), and when word hashes collide."""

from __future__ import annotations

import random

import pytest

duckdb = pytest.importorskip("duckdb")

from rtrace.report.queries import RelationDb  # noqa: E402
from rtrace.serve import search  # noqa: E402
from rtrace.serve.search import WordIndex, like_pattern  # noqa: E402

WORDS = ["apple", "apples", "pineapple", "Question", "1999", "19", "the", "answer", "is", "42", "4.2", "x_y",
         "snake_case", "100%", "Ça", "va", "naïve", "ÉTÉ", "straße", "数学题", "😀", "boxed{7}", "<b>bold</b>",
         "onerror=alert(1)", "a", "ab", "abc", "İstanbul", "e\u0301t\u00e9", "--", "...", "\\n", "tab\tsep"]


def _text(rng: random.Random) -> str:
    seps = [" ", " ", " ", ", ", ": ", "-", "\n", "", "!", "(", ")"]
    return "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(rng.randint(0, 12)))


def _queries(rng: random.Random, texts: list[str], n: int) -> list[str]:
    out = ["apple", "APPLES", "pple", "appl", "Question 1999:", "question 19", "uestion 1", "is 42", "4.2", "x_y",
           "_", "%", "100%", "e_c", "ça va", "ÇA", "straße", "STRASSE", "数学", "😀", "{7}", "<b>", "onerror=",
           "a", " a ", "the answer is", "istanbul", "nowhere", "", "  ", "é", "\t", "--", "..", "\\"]
    for _ in range(n):
        text = rng.choice(texts) or "x"
        i = rng.randrange(len(text))
        q = text[i:i + rng.randint(1, 14)]
        out.append(q.upper() if rng.random() < 0.2 else q)
    return [q for q in out if q.strip()]


def _db(texts: list[tuple[str, str, str]], alias: str = "idx") -> tuple[object, RelationDb, str]:
    con = duckdb.connect()
    con.execute(f"ATTACH ':memory:' AS {alias}")
    table = f"{alias}.t"
    con.execute(f"CREATE TABLE {table} (_row BIGINT, trace_id VARCHAR, task VARCHAR, answer VARCHAR)")
    con.executemany(f"INSERT INTO {table} VALUES (?, ?, ?, ?)",
                    [(i, tid, task, answer) for i, (tid, task, answer) in enumerate(texts)])
    return con, RelationDb(con), table


def _scan(con, table: str, q: str, columns=("task", "answer"), trace_ids=False) -> list[int]:
    p = like_pattern(q)
    where = " OR ".join(f"{c} ILIKE ? ESCAPE '\\'" for c in columns)
    params = [p] * len(columns)
    if trace_ids:
        where += " OR starts_with(trace_id, ?)"
        params.append(q)
    return sorted(r[0] for r in con.execute(f"SELECT _row FROM {table} WHERE {where}", params).fetchall())


def _found(con, db, index: WordIndex, table: str, q: str, columns=("task", "answer"), trace_ids=False) -> list[int]:
    sql, params = index.predicate(db, table, q, columns, trace_ids)
    return sorted(r[0] for r in con.execute(f"SELECT _row FROM {table} WHERE {sql}", params).fetchall())


def _rows(seed: int, n: int) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    return [(rng.getrandbits(128).to_bytes(16, "big").hex(), _text(rng), _text(rng) if rng.random() > 0.05 else None)
            for _ in range(n)]


@pytest.mark.integration  # builds a large index (~6 s): make test-integration
def test_the_index_finds_what_a_scan_finds():
    rows = _rows(1, 400)
    con, db, table = _db(rows)
    index = WordIndex("idx")
    while index.build(con, table, budget_s=0.001):  # slices: several transactions
        pass
    assert index.upto == len(rows) - 1
    rng = random.Random(2)
    queries = _queries(rng, [r[1] for r in rows] + [r[2] or "" for r in rows], 100)
    some = 0
    for q in queries:
        assert _found(con, db, index, table, q) == _scan(con, table, q), q
        some += bool(_scan(con, table, q))
    assert some > 100  # most queries find something: the comparison is not between empty sets
    for q in queries[::3]:
        assert _found(con, db, index, table, q, ("answer",)) == _scan(con, table, q, ("answer",)), q
    tid = rows[5][0][:8]
    assert _found(con, db, index, table, tid, trace_ids=True) == _scan(con, table, tid, trace_ids=True) == [5]


def test_rows_not_indexed_yet_are_scanned(monkeypatch):
    """Half the rows indexed: a search still finds every row (the rest is scanned)."""
    rows = _rows(3, 300)
    con, db, table = _db(rows)
    index = WordIndex("idx")
    monkeypatch.setattr(WordIndex, "MIN_SLICE_ROWS", 1)
    index.rows_per_s = 150 / WordIndex.SLICE_S  # one slice: 150 rows
    index.build(con, table)
    assert index.upto == 149
    for q in _queries(random.Random(4), [r[2] or "" for r in rows], 40):
        assert _found(con, db, index, table, q) == _scan(con, table, q), q


@pytest.mark.integration  # builds a large index (~5 s): make test-integration
def test_replaced_rows_and_their_new_numbers():
    """Rows deleted (a compaction's inputs) and inserted again under new numbers (the merged file):
    their old words stay until compacted, and never show; the new rows are found."""
    rows = _rows(5, 200)
    con, db, table = _db(rows)
    index = WordIndex("idx")
    index.build(con, table, budget_s=10)
    con.execute(f"DELETE FROM {table} WHERE _row < 100")
    con.executemany(f"INSERT INTO {table} VALUES (?, ?, ?, ?)",
                    [(1000 + i, tid, task, answer) for i, (tid, task, answer) in enumerate(rows[:100])])
    queries = _queries(random.Random(6), [r[2] or "" for r in rows], 30)
    for q in queries:  # the replaced rows not indexed yet: scanned
        assert _found(con, db, index, table, q) == _scan(con, table, q), q
    index.build(con, table, budget_s=10)
    assert index.upto == 1099 and index.posted == 300
    for q in queries:
        assert _found(con, db, index, table, q) == _scan(con, table, q), q
    assert not index.compact(con, table)  # the dead rows are not most of it yet
    assert index.compact(con, table, force=True)  # 300 rows indexed, 200 in the table: rewritten without the dead
    assert con.execute(f"SELECT count(DISTINCT r) FROM {index.words}").fetchall()[0][0] <= 200
    for q in queries:
        assert _found(con, db, index, table, q) == _scan(con, table, q), q


def test_colliding_word_hashes_are_checked(monkeypatch):
    """Hashes of 3 values: every word shares its hash with others; a one-word search then checks
    its candidates with the scan's ILIKE, and still finds exactly the scan's rows."""
    monkeypatch.setattr(search, "HASH", "CAST(hash(w) % 3 AS UINTEGER)")
    rows = _rows(7, 200)
    con, db, table = _db(rows)
    index = WordIndex("idx")
    index.build(con, table, budget_s=10)
    assert con.execute(f"SELECT count(DISTINCT h) FROM {index.vocab}").fetchall()[0][0] == 3
    for q in ["apple", "pple", "42", "ab", "straße"] + _queries(random.Random(8), [r[2] or "" for r in rows], 30):
        assert _found(con, db, index, table, q) == _scan(con, table, q), q


def test_common_words_are_left_out_or_scanned(monkeypatch):
    """Words in more than CHECK_MAX answers narrow nothing worth it: a phrase is found from its rare
    words only, or by a scan when all are common; the rows are the scan's either way."""
    monkeypatch.setattr(WordIndex, "CHECK_MAX", 5)
    rows = _rows(11, 200)
    con, db, table = _db(rows)
    index = WordIndex("idx")
    index.build(con, table, budget_s=10)
    for q in ["the answer is", "apple 1999", "is 42", "x_y, va"] + _queries(random.Random(12), [r[2] or "" for r in rows],
                                                                           40):
        assert _found(con, db, index, table, q) == _scan(con, table, q), q


def test_what_a_search_reads():
    """One word (no colliding hash) is answered from the words alone: its SQL reads no answer but
    the rows past upto. A phrase's candidates (from its rare words) are checked once, and the page's
    queries get the rows that have it as a list; a phrase of common words scans the answers."""
    rows = [("ab" * 16, "q", "so the answer is 42"), ("cd" * 16, "q", "The Answers: 42"), ("ef" * 16, "q", "no answer")]
    con, db, table = _db(rows + _rows(9, 100))
    index = WordIndex("idx")
    index.build(con, table, budget_s=10)
    assert _scan(con, table, "the answer", ("answer",))[:1] == [0]
    tail = f"_row > {index.upto} AND answer ILIKE"
    word, _ = index.predicate(db, table, "apple", ("answer",))
    assert f"FROM {index.words}" in word and word.count("answer ILIKE") == word.count(tail) == 1
    phrase, params = index.predicate(db, table, "the answer", ("answer",))
    assert "unnest([" in phrase and phrase.count("answer ILIKE") == 1 and len(params) == 1
    assert _found(con, db, index, table, "the answer", ("answer",)) == _scan(con, table, "the answer", ("answer",))
    WordIndex.CHECK_MAX, saved = 0, WordIndex.CHECK_MAX
    try:
        common, _ = index.predicate(db, table, "the answer", ("answer",))
    finally:
        WordIndex.CHECK_MAX = saved
    assert f"SELECT _row FROM {table} WHERE answer ILIKE" in common

"""What differs between PostgreSQL and SQLite, asked in one place."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from psycopg import adapters
from psycopg.types.array import ListBinaryDumper
from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Dialect,
    Float,
    String,
    Text,
    any_,
    bindparam,
    func,
    select,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeDecorator, TypeEngine

from torchyard.store.models import utcnow


def is_postgres(db: Session | Connection) -> bool:
    bind = db.get_bind() if isinstance(db, Session) else db
    return bind.dialect.name == "postgresql"


def db_now(session: Session) -> datetime:
    """The database's clock, for liveness: heartbeats and the reaper's cutoff are both
    read from it, so clock skew between worker hosts and the scheduler cannot reap a live
    worker. SQLite is local to one host, whose clock is the database's."""
    if not is_postgres(session):
        return utcnow()
    now = session.scalar(select(func.clock_timestamp()))
    assert isinstance(now, datetime)
    return now.astimezone(UTC)


def db_now_value(session: Session) -> Any:
    """The database's clock as a value to write (no extra round trip on PostgreSQL)."""
    return func.now() if is_postgres(session) else utcnow()


# Batches on PostgreSQL travel as one array per column: a statement with thousands of
# placeholders costs more to build and parse than to run. The arrays go in psycopg's binary
# format: its text format escapes every element with a regex, which cost a scheduling pass
# over 1,000 workers ~25 ms of CPU (bench/scheduler_bench.py), the binary one ~3 ms.


class _BinaryList(list[Any]):
    """A list psycopg sends as a binary array (registered below; plain lists keep text)."""


adapters.register_dumper(_BinaryList, ListBinaryDumper)


class BinaryArray(TypeDecorator[Sequence[Any]]):
    """ARRAY(item type) bound in binary; each element through the item type's own bind
    processing. An empty or all-NULL list stays text (binary needs an element's type)."""

    impl = ARRAY
    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Any:
        item_type = self.impl_instance.item_type  # type: ignore[attr-defined]
        item = item_type.dialect_impl(dialect).bind_processor(dialect)

        def process(value: Sequence[Any] | None) -> list[Any] | None:
            if value is None:
                return None
            out = list(value) if item is None else [None if v is None else item(v) for v in value]
            return _BinaryList(out) if any(v is not None for v in out) else out

        return process


def in_list(session: Session, column: Any, values: Sequence[Any]) -> ColumnElement[bool]:
    """`column IN values`: `= ANY(array)` on PostgreSQL (one parameter), IN elsewhere."""
    if is_postgres(session):
        return column == any_(bindparam(None, list(values), type_=BinaryArray(column.type)))
    return column.in_(values)


def unnest(
    name: str, ordinality: str | None = None, **columns: tuple[Sequence[Any], TypeEngine[Any]]
) -> TableValuedAlias:
    """PostgreSQL: the rows of parallel arrays, `unnest(a, b, …) AS name(col, …)`, in
    order (numbered in `ordinality` when given); one parameter per column."""
    arrays = [bindparam(None, list(v), type_=BinaryArray(t)) for v, t in columns.values()]
    fn = func.unnest(*arrays)
    if ordinality:
        return fn.table_valued(*columns, with_ordinality=ordinality).render_derived(name=name)
    return fn.table_valued(*columns).render_derived(name=name)


class _JsonMember(FunctionElement[Any]):
    """`column[outer][name]` read in SQL, `outer` and `name` as bound parameters."""

    inherit_cache = True

    def __init__(self, column: Any, outer: str, member: str) -> None:
        super().__init__(column, bindparam(None, outer, String), bindparam(None, member, String))


class json_member_text(_JsonMember):
    """`json_member_text(column, outer, name)`: the JSON text of `column[outer][name]` as it
    was written (`0.1`, `"adam"`, `true`; NULL when absent), for comparing stored JSON values
    with `json.dumps` of a value. `outer` and `name` travel as bound parameters. PostgreSQL's
    `json` (not `jsonb`) keeps the text it was given, and SQLite's `->` (3.38+) answers the
    member's text as stored; both read `->` with a key as the object's member."""

    type = Text()
    inherit_cache = True
    name = "json_member_text"


@compiles(json_member_text)
def _json_member_text(element: json_member_text, compiler: SQLCompiler, **kw: Any) -> str:
    column, outer, member = (compiler.process(c, **kw) for c in element.clauses)
    return f"(({column} -> {outer}) -> {member})"


@compiles(json_member_text, "postgresql")
def _json_member_text_pg(element: json_member_text, compiler: SQLCompiler, **kw: Any) -> str:
    column, outer, member = (compiler.process(c, **kw) for c in element.clauses)
    return f"CAST(({column} -> CAST({outer} AS TEXT)) -> CAST({member} AS TEXT) AS TEXT)"


class json_member_number(_JsonMember):
    """`json_member_number(column, outer, name)`: `column[outer][name]` as a float when it is
    a JSON number, else NULL (a string, a boolean, absent): the numeric sort key of a
    param column. `outer` and `name` travel as bound parameters, as `json_member_text`'s."""

    type = Float()
    inherit_cache = True
    name = "json_member_number"


@compiles(json_member_number)
def _json_member_number(element: json_member_number, compiler: SQLCompiler, **kw: Any) -> str:
    column, outer, member = (compiler.process(c, **kw) for c in element.clauses)
    value = f"(({column} -> {outer}) ->> {member})"  # SQLite: the member as an SQL value
    kind = f"json_type(({column} -> {outer}) -> {member})"  # of the member's JSON text
    return f"(CASE WHEN {kind} IN ('integer', 'real') THEN CAST({value} AS REAL) END)"


@compiles(json_member_number, "postgresql")
def _json_member_number_pg(element: json_member_number, compiler: SQLCompiler, **kw: Any) -> str:
    column, outer, member = (compiler.process(c, **kw) for c in element.clauses)
    value = f"(({column} -> CAST({outer} AS TEXT)) -> CAST({member} AS TEXT))"
    return (
        f"(CASE WHEN json_typeof({value}) = 'number' "
        f"THEN CAST(CAST({value} AS TEXT) AS DOUBLE PRECISION) END)"
    )

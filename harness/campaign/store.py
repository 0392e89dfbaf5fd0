"""The example database of a campaign, and the failure records kept in it.

A campaign's database is a directory (Hypothesis' ``DirectoryBasedExampleDatabase``) or a Redis
server (``redis://HOST:PORT/N``: Hypothesis' ``RedisExampleDatabase``), the same database for
every worker of one machine and for every machine of one campaign. Beside Hypothesis' examples
(keyed by the digest of each state machine) it holds one :class:`FailureRecord` per distinct
failure under :data:`FAILURES_KEY`: what failed (property, machine, message, the shrunk program)
and how to replay it. A record is written only after its shrunk example is in the database, and
before anyone prints it: what was reported survives a kill -9 of the campaign.

A database that cannot be used (an unreachable Redis, a directory that cannot be written) is a
:class:`~harness.errors.UsageError` (one line, exit 2) before any work starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from datetime import timedelta
from urllib.parse import urlparse

import redis
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.extra.redis import RedisExampleDatabase

from harness.errors import UsageError

__all__ = ["FAILURES_KEY", "FailureRecord", "failure_id", "failures", "open_db", "save_failure"]

FAILURES_KEY = b"prompt-cache-harness:campaign:failures"
# Redis: examples live this long after their last save (Hypothesis' default is 8 days)
REDIS_EXPIRY = timedelta(days=365)


@dataclass(frozen=True)
class FailureRecord:
    """One distinct failure: ``id`` hashes property, machine and the message with its numbers masked."""

    id: str
    backend: str
    machine: str
    property: str
    kind: str  # "violation" | "crash" | "error"
    message: str
    program: str
    semantics: str
    mutant: str | None
    found: str  # ISO time, UTC
    where: str  # host:pid of the worker that found it

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> FailureRecord:
        return cls(**json.loads(raw))

    def replay(self, db: str) -> str:
        return f"python -m harness replay --db {db} --id {self.id}"


def failure_id(prop: str, machine: str, message: str) -> str:
    """The signature of a failure: the same bug seen twice (other sizes, other ids) has one id."""
    masked = re.sub(r"0x[0-9a-f]+|\d+", "N", message)
    return hashlib.sha256(f"{prop}\0{machine}\0{masked}".encode()).hexdigest()[:10]


def open_db(spec: str) -> ExampleDatabase:
    """The database ``spec`` names, checked usable now (Redis answers, the directory is writable)."""
    if spec.startswith("redis://"):
        return _redis(spec)
    if "://" in spec:
        raise UsageError(f"--db {spec!r}: give a directory or redis://HOST:PORT/N")
    try:
        os.makedirs(spec, exist_ok=True)
        probe = os.path.join(spec, f".probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("")
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"example database {spec!r} is not writable: {e.strerror or e}") from None
    return DirectoryBasedExampleDatabase(spec)


def _redis(url: str) -> ExampleDatabase:
    u = urlparse(url)
    if not u.hostname:
        raise UsageError(f"--db {url!r}: expected redis://HOST:PORT/N")
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=30)
    try:
        client.ping()
    except (redis.exceptions.RedisError, OSError, ValueError) as e:
        raise UsageError(f"Redis at {url} is not reachable: {e}") from None
    return RedisExampleDatabase(client, expire_after=REDIS_EXPIRY)


def save_failure(db: ExampleDatabase, record: FailureRecord) -> None:
    db.save(FAILURES_KEY, record.to_bytes())


def failures(db: ExampleDatabase) -> list[FailureRecord]:
    """Every failure record, oldest first, one per id (two workers may record the same id at once)."""
    seen: dict[str, FailureRecord] = {}
    for raw in db.fetch(FAILURES_KEY):
        try:
            r = FailureRecord.from_bytes(raw)
        except (ValueError, TypeError):
            continue  # a record of another version of the harness: not ours to judge
        if r.id not in seen or r.found < seen[r.id].found:
            seen[r.id] = r
    return sorted(seen.values(), key=lambda r: r.found)

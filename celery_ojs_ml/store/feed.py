"""Change feeds: the leader re-reads only the workers and leases that changed.

Key decision: a heartbeat or a lease keeps its whole record in one key and its
expiry or deadline as its score in a sorted-set index. A refresh that only moves
the score rewrites the key but changes nothing else; every other write also appends
the record's name to a capped stream, `<prefix>:{ml}:feed:<kind>`, in the same
transaction. A `FeedReader` keeps the records it read and a cursor (the last
stream id it saw); one script returns the index's live members with their scores,
and the values of only those named in the stream after the cursor. Scores are
exact on every pass (they are the index), values are read once per change. A new
reader, a cursor older than the stream's first entry (trimmed, or the store
restarted) and every `resync_s` read every value again, so a writer that lost its
stream entry is stale for `resync_s` at most. A value without `FED` (a writer of an
earlier version, which appends to no feed) is read on every pass, as before.

With `changes_only` (leases: no TTL, and their writers announce deletions too) a read
between full ones reads no index at all, only the values named in the stream since the
cursor, and returns each member as last read (no score: a lease's `deadline` is then
that of its last write). A reader holding a value without `FED` scans the index.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

MAXLEN = 100_000
"""A feed's approximate cap (`XADD MAXLEN ~`): a reader that falls this far behind
reads every value again."""
FED = "fed"
"""The field a writer that appends to the feed sets in each value it writes."""
RESYNC_S = 60.0
"""How often a reader reads every value again, whatever the feed says."""
READ = """
if ARGV[1] ~= '' then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1]) end
local function id(s)
  local ms, seq = string.match(s, '^(%d+)-(%d+)$')
  return ms, tonumber(ms), tonumber(seq)
end
local full = ARGV[3] == ''
local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local changed = {}
for i = 5, #ARGV do changed[ARGV[i]] = true end
if not full then
  local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
  local ctext, cms, cseq = id(ARGV[3])
  if #first == 0 then
    full = ARGV[3] ~= '0-0'
  else
    local _, fms, fseq = id(first[1][1])
    full = fms > cms or (fms == cms and fseq > cseq + 1)
  end
  if not full and #top > 0 then
    local start = ctext .. '-' .. string.format('%d', cseq + 1)
    for _, entry in ipairs(redis.call('XRANGE', KEYS[2], start, '+')) do
      changed[entry[2][2]] = true
    end
  end
end
local names, scores, out = {}, {}, {'0-0', full and 1 or 0, '', ''}
if #top > 0 then out[1] = top[1][1] end
if ARGV[4] == '1' and not full then
  out[3] = redis.call('ZCARD', KEYS[1])
  for name in pairs(changed) do
    out[#out + 1] = name
    out[#out + 1] = redis.call('GET', ARGV[2] .. name)
  end
  return out
end
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #members, 2 do
  local key = ARGV[2] .. members[i]
  local live = false
  if full or changed[members[i]] then
    local value = redis.call('GET', key)
    if value then
      live = true
      out[#out + 1] = members[i]
      out[#out + 1] = value
    end
  else
    live = redis.call('EXISTS', key) == 1
  end
  if live then
    names[#names + 1] = members[i]
    scores[#scores + 1] = members[i + 1]
  end
end
out[3] = table.concat(names, '\0')
out[4] = table.concat(scores, '\0')
return out
"""
"""KEYS: index, feed. ARGV: prune cutoff ('' none), key prefix, cursor ('' every
value), '1' for changes only, then the members to read whatever the feed says. Reply:
cursor, whether every value was read, the names and the scores of the index's members
whose key exists, in index order, each joined by NUL (one string each: 20,000 members
parse in a few milliseconds, not tens), then (member, value) of each member that
changed after the cursor. Changes only (not a full read): the index's size in place of
the names, no scores, and (member, value or nil where it is gone) of each change."""

Stamp = Callable[[Any, float, float], Any]
"""`(value, score now, score when the value was read)` -> the record a pass gets; a new
object wherever it differs from the value (the reader keeps the value)."""


def feed_key(base: str, kind: str) -> str:
    """The feed of `kind` under a store's key base (`<prefix>:{ml}`)."""
    return f"{base}:feed:{kind}"


def append(feed: str, name: str) -> tuple[str | int, ...]:
    """The command that records a change of `name` in `feed`, capped at `MAXLEN`."""
    return ("XADD", feed, "MAXLEN", "~", MAXLEN, "*", "n", name)


@dataclass(slots=True)
class _Kept:
    """A member's value as read, its score then, and its last record and score."""

    value: Any
    read_at: float
    record: Any = None
    score: float = float("nan")


class FeedReader:
    """One reader's records of an index and its feed (see module doc).

    `stamp` turns a kept value and its score into the record a pass gets
    (`heartbeat`, `lease`).
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: tuple[str, str, str],
        stamp: Stamp,
        *,
        changes_only: bool = False,
        resync_s: float = RESYNC_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index, self.feed, self.prefix = keys
        self._r = client
        self._script: Any = client.register_script(READ)
        self._stamp = stamp
        self._changes_only = changes_only
        """Read no index between full reads (see `arguments`)."""
        self._asked_changes = False
        self._resync_s, self._clock = resync_s, clock
        self.cursor = ""
        """The last stream id read; '' reads every value next time."""
        self._values: dict[str, _Kept] = {}
        self._full_at = -float("inf")
        self._unfed: set[str] = set()
        """Members whose value lacks `FED`: read on every pass."""
        self.read_values = 0
        """How many values the last read parsed (what changed, or everything)."""

    @property
    def sha(self) -> str:
        """The read script's SHA1, for a caller's pipeline (`evalsha`)."""
        return str(self._script.sha)

    def arguments(self, cutoff_ms: int | None = None) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the read script for this reader's next read."""
        if self._clock() - self._full_at >= self._resync_s:
            self.cursor = ""
        cutoff: Any = "" if cutoff_ms is None else cutoff_ms
        self._asked_changes = self._changes_only and not self._unfed
        mode = "1" if self._asked_changes else "0"
        return [self.index, self.feed], [cutoff, self.prefix, self.cursor, mode, *self._unfed]

    def read(self, cutoff_ms: int | None = None) -> dict[str, Any]:
        """`{name: record}` of every live member, in index order (one round trip)."""
        keys, args = self.arguments(cutoff_ms)
        return self.apply(self._script(keys=keys, args=args))

    def reset(self) -> None:
        """Read every value next time (a store failover, a new leadership)."""
        self.cursor = ""

    def apply(self, reply: list[Any]) -> dict[str, Any]:
        """The records after the read script's `reply` (`arguments`' script)."""
        cursor, full, names, scores, *changed = reply
        if full:
            self._values.clear()
            self._unfed.clear()
            self._full_at = self._clock()
        self.cursor = _text(cursor)
        if self._asked_changes and not full:
            return self._changes(int(names), changed)
        members = _split(_bytes(names))
        joined = _bytes(scores)
        at = dict(zip(members, map(float, joined.split(b"\0")), strict=True)) if members else {}
        self.read_values = 0
        for i in range(0, len(changed), 2):
            name = _text(changed[i])
            self._keep(name, changed[i + 1], at[name])
        values = self._values
        missing = [name for name in members if name not in values]
        if missing:
            self._fill([(name, at[name]) for name in missing])
        found = {name: self._stamped(name, at[name]) for name in members if name in values}
        for name in [n for n in values if n not in found]:
            del values[name]
            self._unfed.discard(name)
        return found

    def _changes(self, size: int, changed: list[Any]) -> dict[str, Any]:
        """The values after a changes-only read: every member as last read, with no
        score. Where the index's size differs from the members held (a writer that
        keeps no feed, or a change that missed it), the next read is a full one."""
        self.read_values = 0
        for i in range(0, len(changed), 2):
            name, raw = _text(changed[i]), changed[i + 1]
            if raw is None:
                self._values.pop(name, None)
                self._unfed.discard(name)
            else:
                self._keep(name, raw, float("nan"))
        if len(self._values) != size:
            self.cursor = ""
        return {name: kept.value for name, kept in self._values.items()}

    def _stamped(self, name: str, score: float) -> Any:
        """The record of `name` at `score`: the last one made while its score stays."""
        kept = self._values[name]
        if kept.score != score or kept.record is None:
            kept.record, kept.score = self._stamp(kept.value, score, kept.read_at), score
        return kept.record

    def _fill(self, missing: list[tuple[str, float]]) -> None:
        """Members this reader never read (live again without a change): read now."""
        raws = self._r.mget([self.prefix + name for name, _ in missing])
        for (name, score), raw in zip(missing, raws, strict=True):
            if raw is not None:
                self._keep(name, raw, score)

    def _keep(self, name: str, raw: bytes | str, score: float) -> None:
        value = json.loads(raw)
        self._values[name] = _Kept(value, score)
        self.read_values += 1
        if isinstance(value, dict) and value.get(FED):
            self._unfed.discard(name)
        else:
            self._unfed.add(name)


def heartbeat(value: dict[str, Any], score: float, read_at: float) -> dict[str, Any]:
    """A heartbeat as last written: its index score is its expiry, so it was written
    `score - read_at` ms after the one read (same TTL: the same worker process)."""
    return {**value, "ts": float(value.get("ts") or 0.0) + (score - read_at) / 1000}


def lease(value: dict[str, Any], score: float, read_at: float) -> dict[str, Any]:
    """A lease with its current deadline (its index score; a refresh moves only that)."""
    return {**value, "deadline": score}


def _split(joined: bytes) -> list[str]:
    """NUL-joined names as text."""
    return list(map(bytes.decode, joined.split(b"\0"))) if joined else []


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""How a fleet of replicas pools its evidence: the merge of decayed sums, and one key's sync.

Both estimators of a (tenant, model) are decayed sums of samples: the breaker's rolling alpha is
(sum d^i alpha_i) / (sum d^i), an arm's speed is (decayed tokens) / (decayed seconds), where d is the
per-sample decay (and, for arms, a time decay too). Such sums merge exactly: feeding samples
a1..an and then b1..bm to one estimator gives

    fold(A, B) = A * d^m * timedecay(B.at - A.at) + B

where A and B are the sums of each run fed alone from zero. So every replica keeps its new samples
since its last sync as a small `Evidence` (O(arms) numbers, however many samples), pushes it, and
Redis folds it into the fleet's sums (the Lua script below, one hash per key); replicas' pushes
interleave as whole batches, which is the only order a fleet has. The script answers with the
fleet's sums after the fold, which already hold this replica's push exactly once; the replica's
local state becomes fold(fleet, samples recorded while the push was on the wire). No evidence is
counted twice, and none is lost: a failed push is folded back into the pending samples.

Breaker transitions are not evidence: a trip or a close starts a new episode (epoch + 1, estimate
restarted). A replica pushes its transition with the epoch it last saw; the first transition from
an epoch wins and every other replica adopts the result. Samples of an episode that has ended are
dropped, like the responses of requests admitted before a trip on one process.

Times never cross machines: the script stamps with Redis's clock, and replicas send ages and
remaining durations, which they map back to their own clock with the offset the reply gives.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .gate import CLOSED, OPEN

NO_TIME_DECAY = math.inf  # the breaker's EMA decays per sample only


@dataclass
class Evidence:
    """Decayed sums of samples, with the decayed sample weight, the raw count and the time of the
    last sample (the estimator's clock). `sums` is (alpha,) for a breaker, (tokens, seconds) for an arm."""

    sums: tuple[float, ...]
    weight: float = 0.0
    count: int = 0
    at: float = 0.0

    @classmethod
    def empty(cls, width: int) -> Evidence:
        return cls((0.0,) * width)

    def add(self, values: tuple[float, ...], decay: float, half_life_s: float, now: float) -> None:
        """One sample, exactly as the estimators add it (Breaker._add, ArmEstimate.add)."""
        keep = decay * time_decay(now - self.at, half_life_s) if self.weight else 0.0
        self.sums = tuple(s * keep + v for s, v in zip(self.sums, values, strict=True))
        self.weight = self.weight * keep + 1.0
        self.count += 1
        self.at = max(now, self.at)


def fold(old: Evidence, new: Evidence, decay: float, half_life_s: float) -> Evidence:
    """The evidence of `old`'s samples followed by `new`'s (see the module docstring)."""
    if not new.count:
        return old
    if not old.weight:
        return Evidence(new.sums, new.weight, old.count + new.count, max(old.at, new.at))
    keep = decay**new.count * time_decay(new.at - old.at, half_life_s)
    sums = tuple(s * keep + n for s, n in zip(old.sums, new.sums, strict=True))
    return Evidence(sums, old.weight * keep + new.weight, old.count + new.count, max(old.at, new.at))


def time_decay(elapsed: float, half_life_s: float) -> float:
    return float(0.5 ** (max(0.0, elapsed) / half_life_s))


def redis_key(prefix: str, tenant: str, model: str) -> str:
    """The Redis hash of one (tenant, model): the tenant is already a hash of the developer key;
    the model name is hashed too, so no client-chosen text lands in a key name."""
    digest = hashlib.blake2b(model.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{prefix}:s:{tenant}:{digest}"


# -- one key's sync: what a replica pushes, and the fleet state it gets back ---------------------


@dataclass
class Push:
    """One key's share of a sync, taken from its local state under the store's lock."""

    base: int  # the fleet epoch the local state derives from (-1: never synced)
    event: bool  # a trip or close happened here since: `state`..`open_in` describe the new episode
    state: str  # "closed" | "open" (half-open is open whose time is up)
    trips: int
    cooldown: float
    open_in: float  # open_until - now, in seconds
    breaker_full: Evidence  # the local episode, to seed a key Redis lost (restart, expiry)
    breaker_new: Evidence  # samples since the last push
    arms: list[tuple[str, Evidence, Evidence]]  # (label, samples since the last push, local estimate: seeds)
    want: int  # probe slots wanted (0: release)
    local_epoch: int  # the local breaker's epoch counter when this was taken
    refused: int = 0  # probe-eligible requests turned away for want of a slot, in the interval

    def args(self, now: float, replica: str, gate_args: Sequence[float], lease_s: float, ttl_s: float) -> list[str]:
        """ARGV of SYNC_SCRIPT; `now` is the local clock at send time (ages are relative to it)."""
        out = [_num(ttl_s), _num(lease_s), replica, *(_num(x) for x in gate_args)]
        out += [str(self.base), "1" if self.event else "0", self.state, str(self.trips), _num(self.cooldown)]
        out += [_num(self.open_in), *_sums(self.breaker_full), *_sums(self.breaker_new), str(self.want)]
        out.append(str(len(self.arms)))
        for label, new, full in self.arms:
            out += [label, *_sums(new, now), *_sums(full, now, count=False)]
        return out


def gate_args(decay: float, speed_decay: float, speed_half_life_s: float, max_probes: int) -> tuple[float, ...]:
    return (decay, speed_decay, speed_half_life_s, float(max_probes))


class FleetView(NamedTuple):
    """A key's fleet state as the script returned it, times already on the local clock."""

    accepted: bool  # this push's event won
    grant: int  # probe slots this replica holds
    epoch: int
    state: str
    trips: int
    cooldown: float
    open_until: float
    breaker: Evidence
    arms: dict[str, Evidence]


def parse_reply(reply: Sequence[bytes | str], local_now: float) -> tuple[FleetView, float]:
    """(the view, the offset local - redis clock) from the script's flat reply."""
    words = [w.decode() if isinstance(w, bytes) else str(w) for w in reply]
    redis_now, accepted, grant = float(words[0]), words[1] == "1", int(words[2])
    offset = local_now - redis_now
    hash_: dict[str, str] = dict(zip(words[3::2], words[4::2], strict=True))
    arms: dict[str, Evidence] = {}
    for name, value in hash_.items():
        if name.startswith("w:"):
            label = name[2:]
            arms[label] = Evidence(
                (float(hash_["t:" + label]), float(hash_["s:" + label])),
                float(value),
                int(hash_.get("n:" + label, "0")),
                float(hash_["u:" + label]) + offset,
            )
    breaker = Evidence((float(hash_.get("bs", "0")),), float(hash_.get("bw", "0")), int(hash_.get("bn", "0")))
    view = FleetView(
        accepted,
        grant,
        int(hash_.get("e", "0")),
        OPEN if hash_.get("st") == OPEN else CLOSED,
        int(hash_.get("tr", "0")),
        float(hash_.get("cd", "0")),
        float(hash_.get("ou", "0")) + offset,
        breaker,
        arms,
    )
    return view, offset


def event_fields(view: FleetView, offset: float) -> Mapping[str, str]:
    """A won transition as published on the events stream (open_until on the Redis clock)."""
    return {
        "e": str(view.epoch),
        "st": view.state,
        "tr": str(view.trips),
        "cd": _num(view.cooldown),
        "ou": _num(view.open_until - offset),
    }


def _sums(evidence: Evidence, now: float | None = None, count: bool = True) -> list[str]:
    """sums..., weight[, count][, age of the last sample]: the script's layout of one Evidence."""
    out = [*(_num(s) for s in evidence.sums), _num(evidence.weight)]
    if count:
        out.append(str(evidence.count))
    if now is not None:
        out.append(_num(max(0.0, now - evidence.at)))
    return out


def _num(x: float) -> str:
    return repr(float(x)) if math.isfinite(x) else "0.0"


# KEYS[1]: the (tenant, model) hash. Single key: safe on Redis Cluster, atomic everywhere.
# Fields: e epoch, st state, tr trips, cd cooldown, ou open-until (Redis clock), bs/bw/bn the
# episode's alpha sum, weight and count; per arm label L: t:L, s:L, w:L, n:L, u:L (tokens,
# seconds, weight, count, last sample on the Redis clock); p:R probe slots leased to replica R as
# "count expiry". Replies {now, accepted, grant, field, value, ...}: all strings (Lua numbers
# would come back truncated to integers).
SYNC_SCRIPT = """
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function fmt(x) return string.format('%.17g', x) end
local ttl, lease, me = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local decay, sdecay, half, cap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local base, event, st = tonumber(ARGV[8]), ARGV[9] == '1', ARGV[10]
local tr, cd, ou = ARGV[11], ARGV[12], fmt(now + tonumber(ARGV[13]))
local fs, fw, fn = ARGV[14], ARGV[15], ARGV[16]
local ds, dw, dn = tonumber(ARGV[17]), tonumber(ARGV[18]), tonumber(ARGV[19])
local want, narms = tonumber(ARGV[20]), tonumber(ARGV[21])
local accepted = 0

local cur = redis.call('HMGET', key, 'e', 'st', 'bs', 'bw', 'bn')
if not cur[1] then
  -- new, expired or lost with a restart: this replica's whole state seeds it
  local e = math.max(base, 0)
  if event then e = e + 1; accepted = 1 end
  redis.call('HSET', key, 'e', e, 'st', st, 'tr', tr, 'cd', cd, 'ou', ou, 'bs', fs, 'bw', fw, 'bn', fn)
else
  local e = tonumber(cur[1])
  -- a replica that never synced this key joins a closed episode only
  local same = base == e or (base < 0 and cur[2] == 'closed')
  if event and same then
    accepted = 1
    redis.call('HSET', key, 'e', e + 1, 'st', st, 'tr', tr, 'cd', cd, 'ou', ou, 'bs', fs, 'bw', fw, 'bn', fn)
    if st == 'closed' then
      for i, f in ipairs(redis.call('HKEYS', key)) do
        if string.sub(f, 1, 2) == 'p:' then redis.call('HDEL', key, f) end
      end
    end
  elseif same and dn > 0 then
    local k = decay ^ dn
    redis.call('HSET', key, 'bs', fmt(tonumber(cur[3]) * k + ds), 'bw', fmt(tonumber(cur[4]) * k + dw),
      'bn', tonumber(cur[5]) + dn)
  end
end

for i = 0, narms - 1 do
  local o = 22 + i * 10
  local label = ARGV[o]
  local nt, ns, nw = tonumber(ARGV[o+1]), tonumber(ARGV[o+2]), tonumber(ARGV[o+3])
  local nn, nage = tonumber(ARGV[o+4]), tonumber(ARGV[o+5])
  local tf, sf, wf, nf, uf = 't:' .. label, 's:' .. label, 'w:' .. label, 'n:' .. label, 'u:' .. label
  local a = redis.call('HMGET', key, tf, sf, wf, nf, uf)
  if not a[3] then
    if tonumber(ARGV[o+8]) > 0 then  -- seeded from this replica's estimate; n counts pooled samples from here on
      redis.call('HSET', key, tf, ARGV[o+6], sf, ARGV[o+7], wf, ARGV[o+8], nf, nn, uf, fmt(now - tonumber(ARGV[o+9])))
    end
  elseif nn > 0 then
    local u0, u = tonumber(a[5]), now - nage
    local keep = 0
    if tonumber(a[3]) > 0 then keep = sdecay ^ nn * 0.5 ^ (math.max(0, u - u0) / half) end
    redis.call('HSET', key, tf, fmt(tonumber(a[1]) * keep + nt), sf, fmt(tonumber(a[2]) * keep + ns),
      wf, fmt(tonumber(a[3]) * keep + nw), nf, tonumber(a[4]) + nn, uf, fmt(math.max(u0, u)))
  end
end

-- probe slots: at most `cap` leased across the fleet; a lease lapses unless renewed
local mine, others = 'p:' .. me, 0
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local f = all[i]
  if string.sub(f, 1, 2) == 'p:' and f ~= mine then
    local c, x = string.match(all[i + 1], '^(%d+) (%S+)$')
    if tonumber(x) < now then redis.call('HDEL', key, f) else others = others + tonumber(c) end
  end
end
local grant = math.max(0, math.min(want, cap - others))
if grant > 0 then redis.call('HSET', key, mine, grant .. ' ' .. fmt(now + lease)) else redis.call('HDEL', key, mine) end

redis.call('EXPIRE', key, math.ceil(ttl))
local out = {fmt(now), tostring(accepted), tostring(grant)}
for i, v in ipairs(redis.call('HGETALL', key)) do out[#out + 1] = v end
return out
"""

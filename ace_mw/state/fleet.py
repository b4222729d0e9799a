"""How a fleet of replicas pools its evidence: the merge of decayed sums, and one key's sync.

Both estimators of a (tenant, model) are decayed sums of samples: the breaker's rolling alpha is
(sum d^i alpha_i) / (sum d^i), an arm's speed is (decayed tokens) / (decayed seconds) and its noise
comes from the decayed sums of log rates and their squares, where d is the per-sample decay (and,
for arms, a time decay too). Such sums merge exactly: feeding samples
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
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ..config import GateConfig
from ..decide.gate import CLOSED, OPEN

NO_TIME_DECAY = math.inf  # the breaker's EMA decays per sample only
ARM_SUMS = 4  # an arm's decayed sums: tokens, seconds, log rates, squared log rates (ArmEstimate.sums)
ARM_FIELDS = ("t:", "s:", "l:", "q:")  # their fields in a key's hash, in that order


@dataclass
class Evidence:
    """Decayed sums of samples, with the decayed sample weight, the raw count and the time of the
    last sample (the estimator's clock). `sums` is (alpha,) for a breaker, ArmEstimate.sums for an arm."""

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

    def payload(self, now: float, common: Mapping[str, object]) -> str:
        """The script's one argument (JSON); `now` is the local clock at send time (ages are
        relative to it), `common` the replica's fields shared by every key (see `common_fields`)."""
        return json.dumps(
            {
                **common,
                "base": self.base,
                "event": self.event,
                "st": self.state,
                "tr": self.trips,
                "cd": _finite(self.cooldown),
                "open_in": _finite(self.open_in),
                "full": _sums(self.breaker_full),
                "new": _sums(self.breaker_new),
                "want": self.want,
                "arms": [[label, _sums(new, now), _sums(full, now)] for label, new, full in self.arms],
            }
        )


def common_fields(replica: str, gate: GateConfig, lease_s: float, ttl_s: float) -> dict[str, object]:
    """What every key's push of one sync shares: who pushes, the decays to fold with, the probe cap."""
    return {
        "me": replica,
        "ttl": int(math.ceil(ttl_s)),
        "lease": lease_s,
        "decay": gate.decay,
        "sdecay": gate.speed_decay,
        "half": gate.speed_half_life_s,
        "cap": gate.max_concurrent_probes,
    }


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


def parse_reply(reply: str | bytes, local_now: float) -> FleetView:
    """The view from the script's JSON reply, its times on the local clock."""
    redis_now, accepted, grant, flat = json.loads(reply)
    offset = local_now - float(redis_now)
    hash_: dict[str, str] = dict(zip(flat[0::2], flat[1::2], strict=True)) if flat else {}
    arms: dict[str, Evidence] = {}
    for name, value in hash_.items():
        if name.startswith("w:"):
            label = name[2:]
            arms[label] = Evidence(
                tuple(float(hash_.get(field + label, "0")) for field in ARM_FIELDS),
                float(value),
                int(hash_.get("n:" + label, "0")),
                float(hash_["u:" + label]) + offset,
            )
    breaker = Evidence((float(hash_.get("bs", "0")),), float(hash_.get("bw", "0")), int(hash_.get("bn", "0")))
    view = FleetView(
        bool(accepted),
        int(grant),
        int(hash_.get("e", "0")),
        OPEN if hash_.get("st") == OPEN else CLOSED,
        int(hash_.get("tr", "0")),
        float(hash_.get("cd", "0")),
        float(hash_.get("ou", "0")) + offset,
        breaker,
        arms,
    )
    return view


def _sums(evidence: Evidence, now: float | None = None) -> list[float]:
    """[sums..., weight, count] (and with `now`, the age of the last sample): one Evidence."""
    out = [*(_finite(x) for x in evidence.sums), _finite(evidence.weight), evidence.count]
    if now is not None:
        out.append(max(0.0, _finite(now - evidence.at)))
    return out


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else 0.0


# KEYS[1]: the (tenant, model) hash; ARGV[1]: Push.payload. Single key: safe on Redis Cluster,
# atomic everywhere. One HGETALL, the merge in Lua, one HSET (and HDEL for lapsed leases).
# Fields: e epoch, st state, tr trips, cd cooldown, ou open-until (Redis clock), bs/bw/bn the
# episode's alpha sum, weight and count; per arm label L: t:L, s:L, l:L, q:L, w:L, n:L, u:L (tokens,
# seconds, log rates, squared log rates, weight, samples pooled, last sample on the Redis clock); p:R
# probe slots leased to replica R as "count expiry". Numbers are stored as %.17g strings (exact
# doubles). Replies one JSON string: [now, accepted, grant, [field, value, ...]] (a table of Lua
# numbers would come back as integers).
SYNC_SCRIPT = """
local key, p = KEYS[1], cjson.decode(ARGV[1])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local function fmt(x) return string.format('%.17g', x) end
local h, set, del = {}, {}, {}
local flat = redis.call('HGETALL', key)
for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
local function put(f, v) h[f] = v; set[f] = v end
local function num(f) return tonumber(h[f] or '0') end

local accepted, base = 0, p.base
local function episode(e)  -- this push's transition (or seed) becomes the fleet's episode
  put('e', fmt(e)); put('st', p.st); put('tr', fmt(p.tr)); put('cd', fmt(p.cd)); put('ou', fmt(now + p.open_in))
  put('bs', fmt(p.full[1])); put('bw', fmt(p.full[2])); put('bn', fmt(p.full[3]))
end
if not h['e'] then
  -- new, expired or lost with a restart: this replica's whole state seeds it
  local e = math.max(base, 0)
  if p.event then e = e + 1; accepted = 1 end
  episode(e)
else
  local e = num('e')
  -- a replica that never synced this key joins a closed episode only
  local same = base == e or (base < 0 and h['st'] == 'closed')
  if p.event and same then
    accepted = 1
    episode(e + 1)
    if p.st == 'closed' then
      for f in pairs(h) do if string.sub(f, 1, 2) == 'p:' then del[#del + 1] = f end end
    end
  elseif same and p.new[3] > 0 then
    local k = p.decay ^ p.new[3]
    put('bs', fmt(num('bs') * k + p.new[1])); put('bw', fmt(num('bw') * k + p.new[2]))
    put('bn', fmt(num('bn') + p.new[3]))
  end
end

local sums = {'t:', 's:', 'l:', 'q:'}  -- fleet.ARM_FIELDS; then weight, count, age
for _, arm in ipairs(p.arms) do
  local label, new, full = arm[1], arm[2], arm[3]
  local wf, nf, uf = 'w:' .. label, 'n:' .. label, 'u:' .. label
  if not h[wf] then
    if full[5] > 0 then  -- seeded with this replica's estimate; n counts samples pooled from here on
      for i, f in ipairs(sums) do put(f .. label, fmt(full[i])) end
      put(wf, fmt(full[5])); put(nf, fmt(new[6])); put(uf, fmt(now - full[7]))
    end
  elseif new[6] > 0 then
    local u0, u = num(uf), now - new[7]
    local keep = 0
    if num(wf) > 0 then keep = p.sdecay ^ new[6] * 0.5 ^ (math.max(0, u - u0) / p.half) end
    for i, f in ipairs(sums) do put(f .. label, fmt(num(f .. label) * keep + new[i])) end
    put(wf, fmt(num(wf) * keep + new[5])); put(nf, fmt(num(nf) + new[6])); put(uf, fmt(math.max(u0, u)))
  end
end

-- probe slots: at most `cap` leased across the fleet; a lease lapses unless renewed
local mine, others = 'p:' .. p.me, 0
for _, f in ipairs(del) do h[f] = nil end
for f, v in pairs(h) do
  if string.sub(f, 1, 2) == 'p:' and f ~= mine then
    local c, x = string.match(v, '^(%d+) (%S+)$')
    if tonumber(x) < now then del[#del + 1] = f; h[f] = nil else others = others + tonumber(c) end
  end
end
local grant = math.max(0, math.min(p.want, p.cap - others))
if grant > 0 then put(mine, grant .. ' ' .. fmt(now + p.lease))
elseif h[mine] then del[#del + 1] = mine; h[mine] = nil; set[mine] = nil end

local args = {}
for f, v in pairs(set) do if h[f] then args[#args + 1] = f; args[#args + 1] = v end end
if #args > 0 then redis.call('HSET', key, unpack(args)) end
if #del > 0 then redis.call('HDEL', key, unpack(del)) end
redis.call('EXPIRE', key, p.ttl)
local out = {}
for f, v in pairs(h) do out[#out + 1] = f; out[#out + 1] = v end
return cjson.encode({fmt(now), accepted, grant, out})
"""

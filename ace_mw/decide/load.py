"""How busy each pool is, and the speed policy's arms at that load.

An arm's decode speed depends on how busy its pool is: vLLM's prompt-lookup pool beats its plain one
for a lone request and loses to it at four in flight (docs/concepts.md, "Speed under load"). So the
speed policy keeps its estimates per arm and load band, and a request is placed by the arms' speeds
at the bands their pools are in now.

The middleware sees every request it routes: `InFlight` counts them per pool, from the decision to
the end of the response (a request whose end never comes is dropped after `MAX_AGE_S`). Pools on
hardware of their own load each other not at all; pools that share a machine's cores do, and there
(`upstream.load_scope = "shared"`) an arm's load is every pool's requests. The band of
a pool is that count in powers of two: 0, 1, 2-3, 4-7, 8+. An arm at band 0 keeps its plain label
(a lone request is what an unloaded estimate always measured), an arm at a higher band is labelled
`<arm>|load <band>`: every part of the loop that keys by arm label (the estimates, the plans, the
pooled priors across tenants, the fleet's sync, the status page) then keys by arm and load alike.

On shared cores a request joins the batch that runs (`Joining`), and where requests pinned to a
pool (the temperature gate's) keep coming, a request that arrives at idle starts there unless its
arm's gain outweighs the chance that one cuts the cores in two (`InFlight.cut_share`).
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from typing import Any, NamedTuple

from ..config import GateConfig
from ..directive import PLAIN_ARM

BANDS = ("0", "1", "2-3", "4-7", "8+")
MAX_AGE_S = 900.0  # a request in flight longer than this is presumed lost (its end was never seen)
SEPARATOR = "|load "
CUT_WEIGHT = 0.5  # the weight of the latest opening in `InFlight.cut_share`


class Joining(NamedTuple):
    """Where a request on pools that share their cores should run, and what running elsewhere
    costs: `pools[i]`, arm i's pool runs the batch to join; `cost`, the share of its speed a
    request expects to lose on another arm (ArmPlan.joined). `now`: that batch runs now, and
    the cost is `split_cost`'s; else the pools are idle and `pools` is where the temperature
    gate's requests go, cost the chance that one comes and starts a batch beside this one,
    counted for both batches (`InFlight.cut_share`)."""

    pools: tuple[bool, ...]
    cost: float
    now: bool = True

    def only(self, arms: tuple[int, ...]) -> Joining:
        """The same, over some of the arms (by index, in that order)."""
        return self._replace(pools=tuple(self.pools[i] for i in arms))


def split_cost(in_flight: int) -> float:
    """The share of its speed a request must gain elsewhere to start a second batch beside
    `in_flight` requests on shared cores: the second batch halves the step rate of both, its
    own request's and every one of theirs, so it pays where the best arm at half speed beats
    the busy arm by their loss too: s_best / 2 > s_busy + in_flight * s_busy / 2, i.e. where
    the busy arm runs at under 1 / (2 + in_flight) of the best arm's speed."""
    return 1.0 - 1.0 / (2 + in_flight)


def band(in_flight: int) -> int:
    """The load band of a pool with `in_flight` requests: 0, 1, 2-3, 4-7, 8 or more."""
    return min(in_flight.bit_length(), len(BANDS) - 1)


@lru_cache(maxsize=4096)
def at_load(arms: tuple[str, ...], bands: tuple[int, ...]) -> tuple[str, ...]:
    """The arms' labels at these bands; the same tuple object for the same arguments, so a tenant's
    plan for them is found again by identity."""
    if not any(bands):
        return arms
    return tuple(arm if b == 0 else f"{arm}{SEPARATOR}{BANDS[b]}" for arm, b in zip(arms, bands, strict=True))


def exploiting(gate: GateConfig) -> GateConfig:
    """The gate of a request to pools that share their cores (`load_scope = "shared"`) while other
    requests are in flight: no exploration. An explored arm's pool steps on its own, so the request
    splits the core between two batches and slows every request in flight, not only itself; the
    loop explores when the pools are idle, where a sample costs one request. One per gate object,
    found by identity (hashing a gate's thirty fields on every request would cost more than the
    decision's own arithmetic); an entry holds its gate, so its id is not reused while cached."""
    found = _EXPLOITING.get(id(gate))
    if found is None or found[0] is not gate:
        if len(_EXPLOITING) >= 64:  # gates change only with the config
            _EXPLOITING.clear()
        found = _EXPLOITING[id(gate)] = (gate, replace(gate, explore_fraction=0.0, explore_fraction_unmeasured=0.0))
    return found[1]


_EXPLOITING: dict[int, tuple[GateConfig, GateConfig]] = {}


def plain_at(label: str) -> str:
    """Plain decoding's label at the load of `label`."""
    _, _, load = label.partition(SEPARATOR)
    return f"{PLAIN_ARM}{SEPARATOR}{load}" if load else PLAIN_ARM


def base_arm(label: str) -> tuple[str, str]:
    """(the arm, its band's name) of a label `at_load` made."""
    arm, _, load = label.partition(SEPARATOR)
    return arm, load or BANDS[0]


class Peaks:
    """The most requests in flight at once since a given start, asked at a request's end: the
    starts' (number, count after it), kept with counts falling from the oldest to the latest (a
    start pops the entries it equals or tops), so the first entry at or after a request's own
    start holds the peak of its life. Amortised O(1) a start, O(log n) a question; never more
    entries than the most requests ever in flight at once."""

    __slots__ = ("numbers", "counts")

    def __init__(self) -> None:
        self.numbers: list[int] = []
        self.counts: list[int] = []

    def rise(self, number: int, count: int) -> None:
        while self.counts and self.counts[-1] <= count:
            self.counts.pop()
            self.numbers.pop()
        self.numbers.append(number)
        self.counts.append(count)

    def since(self, number: int) -> int:
        at = bisect_left(self.numbers, number)
        return self.counts[at] if at < len(self.counts) else 0


class InFlight:
    """Requests in flight per pool: counted from the decision to the end of the response. Those
    that lead (the tenant's own choice, not an exploration or a breaker probe) are counted apart:
    a request joins a pool that serves choices, not one trying an arm on the side. So are those
    pinned to their pool (the temperature gate's, held to plain decoding): their batch runs
    whatever the others do.

    `cut_share`: of the times the cores were busy, from a request that found them idle (not
    pinned) until they were idle again, the recent share during which a pinned request came
    (weighted CUT_WEIGHT the latest). Had the opener run on another pool than the pinned one's,
    its batch (with the requests that joined it, which may outlive it) was cut in two by the
    pinned request's; a burst of mixed traffic does that at its start.

    `follow_share`: the same, of the openings that follow a lone request at once (the cores'
    last busy time held one request at a time, and they have been idle for less than it lasted):
    a client that sends its requests one after the other. Kept apart because nothing cuts into
    such a client's requests however often bursts of mixed traffic came before it, and a burst
    that arrives after a pause is no follow-up: an idle request is priced by the share of the
    openings like it (`opening_cost`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # token -> (started, leads, pinned, its start's number)
        self._pools: dict[str, OrderedDict[Any, tuple[float, bool, bool, int]]] = {}
        self._total = 0  # requests in flight on every pool
        self._starts = 0  # starts so far: their numbers
        self._peaks: dict[str, Peaks] = {"": Peaks()}  # per pool, and "" for every pool's together
        self._leading: dict[str, int] = {}
        self._pinned: dict[str, int] = {}
        self._opened = False  # the cores are busy since a request (not pinned) found them idle
        self._opened_cut = False  # and a pinned request came since
        self._opened_following = False  # and it followed a lone request at once
        self._pinned_pool: str | None = None  # where pinned requests went, the latest
        self._busy_since = self._idle_since = -math.inf  # when the cores last went busy, idle
        self._busy_for = 0.0  # how long their last busy time lasted
        self._peak = 0  # the most requests in flight at once since they went busy
        self._lone = False  # their last busy time held one request at a time
        self.cut_share = 0.0
        self.follow_share = 0.0

    def count(self, pool: str) -> int:
        found = self._pools.get(pool)
        return len(found) if found is not None else 0

    def bands(self, pools: tuple[str, ...], scope: str = "pool") -> tuple[int, ...]:
        """The band of each pool's arm: its own pool's requests, or with `scope` "shared" every
        pool's (pools on shared cores, where any request slows every arm)."""
        if scope == "shared":
            return (band(self._load("", scope)),) * len(pools)
        return tuple(band(self.count(pool)) for pool in pools)

    def _load(self, pool: str, scope: str) -> int:
        """The requests in flight that load `pool`: its own, or with `scope` "shared" every pool's."""
        if scope == "shared":
            return self._total
        return self.count(pool)

    def arms_now(
        self, arms: tuple[str, ...], pools: tuple[str, ...], gate: GateConfig, scope: str
    ) -> tuple[tuple[str, ...], GateConfig, Joining | None]:
        """(the arms' labels at their pools' load now, the gate to decide with, where a request
        should join or None). Pools that share their cores (`scope` "shared") while requests are
        in flight: no exploration (`exploiting`), and where some of the arms' pools serve leading
        requests, the request joins one of them (ArmPlan.joined): each pool steps its own batch,
        so a second batch on the same cores halves the step rate of the first, and the request
        that started it runs no faster (docs/concepts.md, "Speed under load"). Where some pool
        serves pinned requests, the request joins that one: its batch runs as long as they come,
        and the others drain. At idle, where pinned requests have been coming to one of the
        arms' pools: that pool at the price of `cut_share`."""
        bands = self.bands(pools, scope)
        if scope != "shared":
            return at_load(arms, bands), gate, None
        if not bands[0]:
            pinned, cost = self._pinned_pool, self.opening_cost()
            if not cost or pinned not in pools:
                return arms, gate, None
            return arms, gate, Joining(tuple(pool == pinned for pool in pools), cost, now=False)
        busy = tuple(self._pinned.get(pool, 0) > 0 for pool in pools)
        if not any(busy):
            busy = tuple(self._leading.get(pool, 0) > 0 for pool in pools)
        joining = Joining(busy, split_cost(self._total)) if any(busy) else None
        return at_load(arms, bands), exploiting(gate), joining

    def opening_cost(self) -> float:
        """The chance that a pinned request cuts into the busy time a request opening the idle
        cores now would start: `follow_share` for a follow-up of a lone request, else `cut_share`."""
        return self.follow_share if self._follows(self._clock()) else self.cut_share

    def _follows(self, now: float) -> bool:
        return self._lone and now - self._idle_since < self._busy_for

    def start(self, pool: str, token: Any, leads: bool = True, pinned: bool = False) -> None:
        now = self._clock()
        with self._lock:
            requests = self._pools.get(pool)
            if requests is None:
                if len(self._pools) >= 64:  # pools come from the config: a handful
                    return
                requests = self._pools[pool] = OrderedDict()
            self._drop(pool, token)
            if pinned:
                self._pinned_pool = pool
                self._opened_cut = True
            if not self._total:  # the cores go busy
                self._busy_since, self._peak = now, 0
                if not pinned:
                    self._opened, self._opened_cut, self._opened_following = True, False, self._follows(now)
            self._starts += 1
            self._total += 1
            self._peak = max(self._peak, self._total)
            requests[token] = (now, leads, pinned, self._starts)
            self._peaks.setdefault(pool, Peaks()).rise(self._starts, len(requests))
            self._peaks[""].rise(self._starts, self._total)
            self._leading[pool] = self._leading.get(pool, 0) + leads
            self._pinned[pool] = self._pinned.get(pool, 0) + pinned
            while requests and next(iter(requests.values()))[0] < now - MAX_AGE_S:
                self._drop(pool, next(iter(requests)))

    def end(self, pool: str, token: Any) -> None:
        with self._lock:
            self._drop(pool, token)

    def finished(self, pool: str, token: Any, label: str, scope: str = "pool") -> str:
        """End a request and give the label its speed sample belongs under: `label` (the arm at
        its load when decided) at the higher of that band and the most others in flight beside
        it during its life (`Peaks`). A request decided alone that a burst then joined, or that
        a hot request cut in two and left, ran loaded: its sample must not teach the arm's idle
        estimate that the arm is slow alone."""
        with self._lock:
            requests = self._pools.get(pool)
            found = requests.get(token) if requests is not None else None
            if found is None:  # ended before (or never counted): the load now
                others = self._load(pool, scope)
            else:
                others = self._peaks["" if scope == "shared" else pool].since(found[3]) - 1
            self._drop(pool, token)
        arm, name = base_arm(label)
        later = band(others)
        if later <= BANDS.index(name):
            return label
        return f"{arm}{SEPARATOR}{BANDS[later]}"

    def _drop(self, pool: str, token: Any) -> None:
        requests = self._pools.get(pool)
        found = requests.pop(token, None) if requests is not None else None
        if found is not None:
            self._total -= 1
            self._leading[pool] -= found[1]
            self._pinned[pool] -= found[2]
            if not self._total:
                self._went_idle()

    def _went_idle(self) -> None:
        now = self._clock()
        if self._opened:
            if self._opened_following:
                self.follow_share += CUT_WEIGHT * (self._opened_cut - self.follow_share)
            else:
                self.cut_share += CUT_WEIGHT * (self._opened_cut - self.cut_share)
            self._opened = False
        self._lone, self._idle_since, self._busy_for = self._peak == 1, now, now - self._busy_since

    def report(self) -> dict[str, Any]:
        """The status page's view: requests in flight per pool, `cut_share` and `follow_share`."""
        with self._lock:
            in_flight = {pool: len(requests) for pool, requests in self._pools.items()}
        return {
            "in_flight": in_flight,
            "cut_share": round(self.cut_share, 3),
            "follow_share": round(self.follow_share, 3),
        }

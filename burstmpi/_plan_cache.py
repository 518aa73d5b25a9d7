"""The plans behind the functional API: ``burstmpi.attention`` and ``attention_backward``
reuse one ``BurstAttention`` per communicator and plan-shaping arguments.

A plan made for every call would pay, every call, for what a plan keeps: node discovery and
the CPU backend's set-up (collectives), a cold workspace, new ring buffers. Here a call
looks its plan up by

* the communicator: the cache of each belongs to the state burstmpi keeps for it
  (``_transport.lifetime``: an MPI attribute of the communicator), so a communicator the
  user frees takes its plans with it, their buffers and its shared window freed in the
  state's order, and a new communicator that MPI gives the freed one's handle starts empty,
  never reusing a stale plan; a freed communicator (``MPI.COMM_NULL``), or anything that is
  not an intracommunicator, makes a plan for the call as before, which raises what it raises;
* every argument that shapes the plan: ``causal``, ``window``, ``softmax_scale``,
  ``layout``, ``bwd_comm``, the mask's type and ``digest()``, ``head_parallel``,
  ``topology``, ``timeout``, and the ``BURSTMPI_*`` settings in force (a plan reads them
  once, when it is made). ``cu_seqlens`` is per call. ``attention`` and
  ``attention_backward`` with the same arguments share a plan; each call names its
  function in the plan's errors (``plan.caller``).

Bounds, per communicator, kept after each call that returned (``run``): at most
``MAX_PLANS`` plans (8), the least recently used evicted (``release()``d); then, while the
ring buffers of its plans (``buffer_bytes``; a shared window that several plans use counted
once) pass ``MAX_BYTES`` (1 GiB) and the other plans hold some of them, the least recently
used other plan is evicted; then, while those buffers and the CPU backends' working arrays
(``held_bytes``) together pass ``MAX_BYTES``, the least recently used other plans' working
arrays are freed (they stay cached; their next call allocates them again). The plan the
call used is never evicted nor trimmed: alone, it may hold more (as a ``BurstAttention``
would). Both bounds are module attributes, read at every call.

Evicting a plan frees its own buffers, locally; the node's shared window (the "shm"
transport) belongs to the communicator's state, which every plan on it uses, and stays:
plans evicted and made again in turn map no window per call. Every rank must still make
the same choices, as a plan evicted on one rank but not on another would make the next
call's collectives differ (a plan made again runs its set-up collectives). Eviction is therefore decided from
what every rank of the communicator sees alike: the order of its calls (collective, so the
same everywhere), the keys, and ``buffer_bytes``, which every rank sizes alike (the ring's
buffers hold the largest packet, the same for all, and a shared window is grown to one size
collectively); never from timing or from the working arrays, whose size follows each rank's
own number of tokens: those are only freed locally, which needs no agreement.
"""

import collections
from typing import NamedTuple

from mpi4py import MPI

from ._config import settings
from ._plan import BurstAttention
from ._transport import lifetime
from ._validate import check_mask

__all__ = ["MAX_PLANS", "MAX_BYTES", "CacheStats", "Released", "run", "release_cached", "stats", "cached_plans"]

MAX_PLANS = 8          # plans kept per communicator
MAX_BYTES = 1 << 30    # bytes of buffers and working arrays kept per communicator (see above)

# The constructor's arguments that the functional API never changes (an adapter may: the
# JAX one runs on the host backend): part of every key, so that a default changed here
# would not hand out plans made with the old one.
_FIXED = (("backend", "auto"), ("transport", "auto"), ("device", None))

Released = lifetime.Released


class CacheStats(NamedTuple):
    """The plan cache of one communicator (``stats``), or of all (sums); the counts run
    from the last ``release_cached``."""

    plans: int
    hits: int
    misses: int
    evictions: int
    buffer_bytes: int   # ring buffers, a shared window once (what eviction counts)
    held_bytes: int     # the CPU backends' working arrays on this rank


class _Cache:
    """The plans of one communicator, least recently used first; attached to its state
    (``lifetime.CommState.attach``), which tears it down first when the state goes."""

    def __init__(self, state):
        self.state = state
        self.plans = collections.OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def _drop(self, plan, release):
        """Forget ``plan``, its buffers freed (``release``: its own, not the shared window;
        ``"all"``: the window too, collectively)."""
        if release == "all":
            plan.release()
        elif release:
            plan.runtime.release(window=False)

    def evict_oldest(self, keep=None):
        """Drop the least recently used plan other than ``keep``, its own buffers freed
        (local: the shared window stays, the state's)."""
        for key, plan in self.plans.items():
            if plan is not keep:
                del self.plans[key]
                self.evictions += 1
                self._drop(plan, True)
                return True
        return False

    def buffer_bytes(self, plans=None):
        """Ring buffers of ``plans`` (default: all): the same on every rank."""
        return _ring_bytes(self.plans.values() if plans is None else plans)

    def held_bytes(self):
        return sum(_held(p) for p in self.plans.values())

    def trim(self, used):
        """After a call on ``used``: keep the buffers and working arrays within ``MAX_BYTES``
        (the module's docstring). Other plans are evicted only while that frees something:
        a window ``used`` shares stays, since its next call would map it again."""
        while len(self.plans) > max(1, MAX_PLANS):
            self.evict_oldest(keep=used)
        while len(self.plans) > 1 and self.buffer_bytes() > MAX_BYTES \
                and self.buffer_bytes() > self.buffer_bytes([used]):
            self.evict_oldest(keep=used)
        over = self.buffer_bytes() + self.held_bytes() - MAX_BYTES
        for plan in list(self.plans.values()):
            if over <= 0:
                break
            held = _held(plan)
            if plan is not used and held:
                plan.backend.release()  # local: the working arrays and pooled results only
                over -= held

    def teardown(self, collective):
        """Drop every plan (``collective``: their buffers and the shared window freed, every
        rank alike) and reset the counts: the state goes, or ``release_cached``. Returns
        how many plans were dropped."""
        plans = list(self.plans.values())
        self.plans.clear()
        self.hits = self.misses = self.evictions = 0
        for plan in plans:
            self._drop(plan, "all" if collective else False)
        return len(plans)


def _ring_bytes(plans):
    """``buffer_bytes`` summed over ``plans``, except that plans whose transport is a shared
    window ("shm": one per communicator, every plan on it reads and writes the same) count it
    once: the largest they report."""
    own, shared = 0, {}
    for plan in plans:
        if getattr(plan.transport, "arena", None) is not None:
            shared[id(plan.transport)] = max(shared.get(id(plan.transport), 0), plan.buffer_bytes)
        else:
            own += plan.buffer_bytes
    return own + sum(shared.values())


def _held(plan):
    """Bytes of working arrays the plan's backend keeps between calls (the CPU backend's)."""
    return int(getattr(plan.backend, "held_bytes", 0) or 0)


def _cache_of(comm, create=True):
    """The cache of ``comm`` (made with ``create``), or None where ``comm`` cannot hold one."""
    state = lifetime.state_of(comm, create)
    if state is None:
        return None
    return state.attach("plans", lambda: _Cache(state)) if create else state.attached("plans")


def _environment():
    """The ``BURSTMPI_*`` settings in force (``config.Settings``: frozen, hashable); a plan
    reads them when it is made."""
    return settings()


def _key(options):
    """The plan's key, or None when an argument cannot be hashed (the plan made for the
    call then checks it as before)."""
    mask = options["mask"]
    try:
        check_mask("", mask)
    except TypeError:
        return None
    window = options["window"]
    try:
        window = None if window is None else tuple(window)
        key = (tuple((name, value) for name, value in options.items() if name not in ("mask", "window", "causal"))
               + (("causal", bool(options["causal"])), ("window", window),
                  ("mask", None if mask is None else (type(mask).__qualname__, mask.digest())))
               + tuple((n, v) for n, v in _FIXED if n not in options) + (("environment", _environment()),))
        hash(key)
    except TypeError:
        return None
    return key


def run(caller, comm, options, call):
    """``call(plan)`` on the cached plan for ``options`` (``BurstAttention``'s keywords) on
    ``comm``; ``caller`` names the public function in the plan's errors.

    The cache changes only once the call has returned (its plan added or made the most
    recent, then the bounds kept): a call that raises leaves it as it was. An error that the
    call's agreement raises on every rank (wrong or mismatched arguments) thus leaves every
    rank's cache as before, even where the ranks' arguments differed and one rank found a
    plan that another had to make."""
    comm = MPI.COMM_WORLD if comm is None else comm
    cache = _cache_of(comm)
    key = None if cache is None else _key(options)
    plan = None if key is None else cache.plans.get(key)
    made = plan is None
    if made:
        plan = BurstAttention(comm, **options)  # wrong arguments raise here, on every rank
    if made and cache is not None:
        cache.state.independent(plan.runtime)  # the cache's own: not a plan the caller holds
    plan.caller = caller  # a plan may serve attention and attention_backward
    result = call(plan)
    if key is not None:
        if made:
            cache.plans[key] = plan
            cache.misses += 1
        else:
            cache.plans.move_to_end(key)
            cache.hits += 1
        cache.trim(plan)
    return result


def _selected(comm):
    if comm is None:
        return [c for c in (s.attached("plans") for s in lifetime.states()) if c is not None]
    cache = _cache_of(comm, create=False)
    return [] if cache is None else [cache]


def release_cached(comm=None):
    """Free what burstmpi keeps for ``comm``, or with None for every communicator it was
    used on, in the order they were first used; returns what went (``Released``: plans,
    communicators, windows, NCCL communicators, and ``kept``: what stayed, and why).

    The functional API's plans (``attention``, ``attention_backward``, the adapters) are
    dropped, their ring buffers, the CPU backend's working arrays and the communicator's
    shared window freed: the next call makes a plan again (its first call is collective
    set-up). Where no plan that the caller made on the communicator (a ``BurstAttention``
    or ``KVCache``) is alive on any rank, burstmpi's own communicators for it (its private
    duplicate, splits, NCCL communicators) are freed too; else they stay, and ``kept`` says
    so. Freeing the communicator itself (``comm.Free()``) frees all of it in any case.

    Collective over each communicator, as ``BurstAttention.release``: call it on every rank
    of ``comm``; with None, where every rank has used its communicators in the same order
    (else pass each communicator). Arrays the calls returned stay valid: they are the
    caller's. The cache keeps at most 8 plans per communicator and about 1 GiB of their
    buffers and working arrays (``burstmpi._plan_cache``); at exit its plans are dropped
    without any MPI call (``_transport.lifetime``).
    """
    if comm is not None:
        return lifetime.release(comm, settings().timeout)
    done = [r for _, r in lifetime.release_all(settings().timeout)]
    return Released(*(sum(getattr(r, f) for r in done) for f in Released._fields[:-1]),
                    "; ".join(r.kept for r in done if r.kept))


def stats(comm=None):
    """``CacheStats`` of ``comm``'s cache, or summed over every communicator's with None."""
    caches = _selected(comm)
    return CacheStats(sum(len(c.plans) for c in caches), sum(c.hits for c in caches),
                      sum(c.misses for c in caches), sum(c.evictions for c in caches),
                      sum(c.buffer_bytes() for c in caches), sum(c.held_bytes() for c in caches))


def cached_plans(comm=None):
    """The cached plans of ``comm`` (or of every communicator), least recently used first."""
    return [p for c in _selected(comm) for p in c.plans.values()]

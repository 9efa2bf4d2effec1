"""The bounded, thread-safe map from call keys to plans that every cached path uses (``_api``'s
forward and backward, ``_inference``, ``_varlen``)."""

from __future__ import annotations

import collections
import threading


class PlanCache:
    """A bounded map from call keys to plans, safe to use from many threads; when full, the
    oldest entry goes (a lookup does not reorder, to stay cheap).

    ``get_or_build(key, build)`` returns the cached plan or builds it (outside the lock, so a
    slow compilation in one thread does not stall the others; if two threads build the same
    plan at once, both results are correct and the first stored wins)."""

    def __init__(self, maxsize: int = 512):
        self.maxsize = maxsize
        self._d: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        try:
            plan = self._d[key]
        except KeyError:
            return None
        self.hits += 1
        return plan

    def get_or_build(self, key, build):
        plan = self.get(key)
        if plan is not None:
            return plan
        self.misses += 1
        return self.put(key, build())

    def put(self, key, value):
        """Store ``value`` under ``key`` unless a value is there already; return the stored
        one. The oldest entries go when the cache is over its size."""
        with self._lock:
            value = self._d.setdefault(key, value)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._d)

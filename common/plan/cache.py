"""Plans kept by what determines them, in one kind of cache for every process that plans (both
controllers and every worker): the key is (source fingerprint, destination fingerprint, bucket
bytes, relays, tensors of a partial update), so the same two layouts and options find the same
plan whoever asks."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from reshard.common.layout.core import Layout
from reshard.common.layout.wire import layout_fingerprint
from reshard.common.plan.planner import Plan, PlanOptions, make_plan

V = TypeVar("V")


class BuildOnceLRU(Generic[V]):
    """A small thread-safe LRU whose values are built once, even when several threads (colocated
    workers of one process, tests) ask for the same key at the same time; a build that fails is
    not kept."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[Hashable, concurrent.futures.Future] = collections.OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: Hashable, build: Callable[[], V]) -> V:
        with self._lock:
            fut = self._entries.get(key)
            owner = fut is None
            if owner:
                fut = self._entries[key] = concurrent.futures.Future()
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        if owner:
            try:
                fut.set_result(build())
            except BaseException as e:
                with self._lock:
                    if self._entries.get(key) is fut:
                        del self._entries[key]
                fut.set_exception(e)
        return fut.result()


def plan_key(src: Layout, dst: Layout, opts: PlanOptions, tensors=None) -> tuple:
    """What a plan depends on (every process derives the same key from the same layouts)."""
    return (layout_fingerprint(src), layout_fingerprint(dst), opts.bucket_bytes, opts.relay, tuple(sorted(tensors or ())))


class PlanCache(BuildOnceLRU[Plan]):
    def plan(self, src: Layout, dst: Layout, opts: PlanOptions, tensors: set[str] | None = None) -> Plan:
        """The plan of (src, dst, opts, tensors), made once (blocking: call it off an event loop)."""
        return self.get(plan_key(src, dst, opts, tensors), lambda: make_plan(src, dst, opts, tensors))

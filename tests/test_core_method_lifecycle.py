"""@batched on a method: docs/api.md's promise that closing an instance's batcher frees it."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import batchkit


class Model:
    @batchkit.batched(max_batch=4, max_wait_ms=1)
    def run(self, xs: list[int]) -> list[int]:
        return [2 * x for x in xs]


def test_closing_an_instances_batcher_joins_its_threads_and_frees_the_instance() -> None:
    before = set(threading.enumerate())
    refs = []
    for i in range(3):
        m = Model()
        assert m.run(i) == 2 * i
        m.run.close()
        refs.append(weakref.ref(m))
        del m
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("batchkit")]


def test_each_instance_has_its_own_batcher_and_closing_one_leaves_the_other() -> None:
    a, b = Model(), Model()
    assert a.run.batcher is not b.run.batcher
    a.run.close()
    assert b.run(5) == 10
    b.run.close()


def test_static_methods_work_and_class_methods_are_refused_clearly() -> None:
    class Host:
        @staticmethod
        @batchkit.batched(max_batch=2, max_wait_ms=1)
        def double(xs: list[int]) -> list[int]:
            return [2 * x for x in xs]

    assert Host.double(2) == 4
    assert Host().double(3) == 6
    Host.double.close()

    class Bad:
        @classmethod
        @batchkit.batched(max_batch=2, max_wait_ms=1)
        def names(cls, xs: list[int]) -> list[str]:
            return [cls.__name__ for _ in xs]

    with pytest.raises(TypeError, match="classmethod"):
        Bad.names(1)

"""The thread that owns the models' ncnn calls.

ncnn runs a layer on an OpenMP team that belongs to the thread that runs it, and once the
process's teams hold more threads than there are CPUs, libgomp lets their workers sleep between
layers: a model loaded on the main thread and decoding from a worker thread ran at 0.2-0.5x the
speed. So every ncnn call — loading nets, every forward — runs on one long-lived daemon thread
that the loaded models share (``Lease``: the last model to let go ends it), and the public API
hands coarse units to it (a load, a prefill, a decode step, an image): one hop per generated
token, however many nets a step runs.

A call from the owner thread itself runs straight through (an owner-thread function calling
another wrapped one cannot deadlock). Exceptions come back to the caller with their traceback.
A KeyboardInterrupt in a waiting caller asks the owner to stop at its next safe point (the
start of a graph run, or between its host passes): the task then raises KeyboardInterrupt on
the owner thread, where the model's whole-or-nothing cache handling undoes the partial forward,
and the caller raises it once the owner is done.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from .errors import EdgevlError

_local = threading.local()
_END = object()


class _Task:
    __slots__ = ("fn", "args", "kwargs", "done", "result", "error", "cancel")

    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.result = self.error = None
        self.cancel = False


def checkpoint() -> None:
    """A safe point: raise KeyboardInterrupt if the caller of the running owner task was
    interrupted. Free outside owner threads."""
    task = getattr(_local, "task", None)
    if task is not None and task.cancel:
        task.cancel = False   # once: the cleanup that follows may run graphs again
        raise KeyboardInterrupt


def _serve(tasks: queue.SimpleQueue) -> None:
    # only the queue: the thread holds no reference to the model (it stays collectable)
    while True:
        task = tasks.get()
        if task is None:
            return
        _run(task)
        del task   # nor to the last task's model while it waits


def _run(task: _Task) -> None:
    _local.task = task
    try:
        task.result = task.fn(*task.args, **task.kwargs)
    except BaseException as e:  # noqa: BLE001 - handed back to the caller
        task.error = e
    finally:
        _local.task = None
        task.fn = task.args = task.kwargs = None
        task.done.set()


def _relay(via, gen: Iterator) -> Iterator:
    try:
        while True:
            item = via.call(next, gen, _END)
            if item is _END:
                return
            yield item
    finally:
        # an abandoned generator (a client that hung up) is closed on the owner too, after any
        # step still running there and before any later call. Not waited for: this also runs
        # from the garbage collector, on whatever thread it ran (the owner thread too)
        (via.owner if isinstance(via, Lease) else via).post(gen.close)


class Owner:
    """One daemon thread running the calls handed to it, in order."""

    def __init__(self, name: str = "edgevl-ncnn"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._tasks,), name=name, daemon=True)
        self._thread.start()
        self.closed = False
        # a task queued after close()'s end marker would never run: the check and the put are one step
        self._lock = threading.Lock()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the owner thread; its result, or its exception raised here."""
        if self.is_current():
            return fn(*args, **kwargs)
        task = _Task(fn, args, kwargs)
        with self._lock:
            if self.closed:
                raise EdgevlError("this model was closed; load it again to use it")
            if not self._thread.is_alive():
                raise EdgevlError("this model's ncnn thread is gone (a forked process?); load the model again")
            self._tasks.put(task)
        try:
            # in short waits: an untimed one was not always woken by Ctrl-C on a busy machine (the
            # interrupt came only once the task had ended; a test caught it 1 to 3 times in 6)
            while not task.done.wait(0.05):
                pass
        except KeyboardInterrupt:
            # stop the owner at its next safe point and wait for it: the cache is whole again
            # before the interrupt goes on (a second Ctrl-C stops the waiting only)
            task.cancel = True
            task.done.wait()
            if isinstance(task.error, KeyboardInterrupt):
                raise task.error from None
            raise
        if task.error is not None:
            e, task.error = task.error, None
            try:
                raise e
            finally:
                del e
        return task.result

    def stream(self, gen: Iterator) -> Iterator:
        """``gen`` run step by step on the owner thread: each item is one hop, and the generator
        runs no further ahead than its consumer asked (a consumer that stops early leaves the
        model where it was at that item)."""
        return gen if self.is_current() else _relay(self, gen)

    def post(self, fn) -> None:
        """``fn()`` queued on the owner thread, not waited for (errors are dropped)."""
        with self._lock:
            if not self.closed:
                self._tasks.put(_Task(fn, (), {}))

    def close(self, wait: bool = True) -> None:
        """End the thread once the calls queued before have run (``wait``: wait for that);
        later calls are refused."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._tasks.put(None)
        if wait and not self.is_current():
            self._thread.join()


_shared: Owner | None = None
_shared_lock = threading.Lock()


class Lease:
    """A model's hold on the process's ncnn thread. One thread serves every model: each thread
    that runs graphs keeps its own OpenMP team, and once the teams hold more threads than there
    are CPUs their workers sleep between layers (two models with an owner thread each, 2 threads
    on 2 cores: 490 -> 85 tok/s). The thread ends when the last lease is closed."""

    def __init__(self):
        global _shared
        with _shared_lock:
            if _shared is None or _shared.closed or not _shared._thread.is_alive():
                _shared = Owner()
                _shared.holders = 0
            self.owner = _shared
            self.owner.holders += 1
        self.closed = False

    @property
    def _thread(self) -> threading.Thread:
        return self.owner._thread

    def is_current(self) -> bool:
        return self.owner.is_current()

    def call(self, fn, *args, **kwargs):
        if self.closed and not self.is_current():
            raise EdgevlError("this model was closed; load it again to use it")
        return self.owner.call(fn, *args, **kwargs)

    def stream(self, gen: Iterator) -> Iterator:
        return gen if self.is_current() else _relay(self, gen)

    def close(self, wait: bool = True) -> None:
        """Let go of the thread; the last lease ends it (``wait``: once the calls queued before
        have run). Calls after this are refused."""
        global _shared
        if self.closed:
            return
        self.closed = True
        with _shared_lock:
            self.owner.holders -= 1
            last = self.owner.holders == 0
            if last and _shared is self.owner:
                _shared = None
        if last:
            self.owner.close(wait)
        elif wait and not self.is_current():
            self.owner.call(int)   # what this model queued has run


def holders() -> int:
    """Models holding the current ncnn thread (0: none runs)."""
    with _shared_lock:
        return 0 if _shared is None else _shared.holders

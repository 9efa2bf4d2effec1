"""The one-launch backward of small problems (issue 9: host time per ``attention_backward``).

A backward plan normally launches bwd_dot_do_o (line 4 of Algorithm 2, D = rowsum(dO o O),
which also zeroes the workspace's dQ accumulator and counters) and then the main kernel; each
launch is ~5 us of host time, and for a problem of one wave the launches are the call's cost.
Where :func:`usable` holds, the plan launches only bwd_sm90's ``one_launch`` build
(``_overrides.one_launch_wanted``) with ``kBwdOwnD`` in ``Params::out_flags``: each block
computes D for the query rows it visits itself (``bwd_io::block_row_dots``), and the block that
rounds a query tile of dQ sets that tile's float32 accumulator and arrival counter back to 0
(``bwd_io::finish_dq_body``'s REZERO). The workspace therefore needs no zeroing launch: it is
kept per (plan, stream) by :class:`ZeroedWorkspaces`, zeroed once when made, and every launch
leaves it as it found it.

Why this is safe:
- Stream order: the launches that use one workspace are all on its stream, so they run one
  after the other (two threads calling one plan on one stream too). Two streams get two
  workspaces. CuPy's per-thread default stream has one handle (2) for every thread but is a
  stream a thread: keyed by the thread there.
- Every counter of every batch item is completed once a launch (each block arrives at all of
  its item's), so the rounding block of every tile runs and re-zeroes; rows no block adds into
  stay 0.
- A launch that raises (the driver refused it) ran nothing, but the workspace of that stream
  is zeroed again anyway (a memset on the stream, in stream order: a thread that looked the
  workspace up before launches after it), or forgotten if even that fails; a kernel that
  faults leaves the context unusable (every later call fails), so no call can read a
  half-zeroed one.
- A workspace is never handed back while its plan lives (a thread may hold it between the
  lookup and the launch): past ``MAX_STREAMS`` streams a plan, or past ``BUDGET`` bytes kept by
  all plans together (the plan cache holds up to 512 plans: a program with many short shapes
  would otherwise keep a workspace for each), a call takes a fresh workspace and zeroes its
  accumulators with a memset (one driver call instead of bwd_dot_do_o's launch). A plan's
  workspaces go back to CuPy's pool with the plan (``clear_plans``, the cache's bound): the
  pool reuses memory on the stream it was allocated on only, after the launches there.
- At most ``MAX_BYTES`` a workspace, else the plan keeps the two launches.
"""

from __future__ import annotations

import threading

#: the largest workspace kept per (plan, stream), the most streams kept per plan, and the most
#: bytes kept by all plans together
MAX_BYTES, MAX_STREAMS, BUDGET = 8 << 20, 4, 64 << 20
#: cudaStreamPerThread: one handle, one stream a thread
_PER_THREAD_STREAM = 2
#: bytes kept now by every plan's ZeroedWorkspaces (re-entrant: a plan collected while another
#: holds it gives its bytes back)
_held, _held_lock = [0], threading.RLock()


def usable(plan, o, do) -> bool:
    """Whether a backward plan runs as one launch: its kernel is a ``one_launch`` build that
    rounds dQ itself, dq, dk, dv are written directly in one launch with no modifier, no input
    is copied, the workspace is small, and o and dO have the rows block_row_dots reads (unit
    column stride, 16-byte aligned rows, dv a multiple of 8: ``tensor_core_ready``)."""
    from ._launch import tensor_core_ready
    return bool(plan.choice.flag.get("one_launch") and plan.fused_dq and plan.direct
                and plan.mods is None and not plan.copies and plan.workspace <= MAX_BYTES
                and tensor_core_ready(o) and tensor_core_ready(do))


class ZeroedWorkspaces:
    """A plan's workspaces, one a stream, each zeroed when made and left zeroed by every launch
    of the one-launch build (the module's docstring says why that holds)."""
    __slots__ = ("nbytes", "by_stream", "_lock")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        #: stream (or (2, thread) for the per-thread default stream) -> workspace: a caller
        #: may look a stream up here first (a dict lookup: host time), then call get()
        self.by_stream: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(stream: int):
        return (stream, threading.get_ident()) if stream == _PER_THREAD_STREAM else stream

    def get(self, stream: int):
        """The zeroed workspace of ``stream`` (a CuPy MemoryPointer), made on first use; None
        where the plan keeps ``MAX_STREAMS`` already or one more would pass ``BUDGET`` (the
        caller then zeroes a fresh one)."""
        key = self.key(stream)
        ws = self.by_stream.get(key)
        if ws is not None:
            return ws
        import cupy
        with self._lock:
            ws = self.by_stream.get(key)
            if ws is None:
                if len(self.by_stream) >= MAX_STREAMS:
                    return None
                with _held_lock:
                    if _held[0] + self.nbytes > BUDGET:
                        return None
                    _held[0] += self.nbytes
                try:
                    ws = cupy.cuda.alloc(self.nbytes)
                    cupy.cuda.runtime.memsetAsync(ws.ptr, 0, self.nbytes, stream)
                except BaseException:
                    with _held_lock:
                        _held[0] -= self.nbytes
                    raise
                self.by_stream[key] = ws
        return ws

    def reset(self, stream: int) -> None:
        """Zero ``stream``'s workspace again (after a launch that raised), in stream order;
        forget it if even that fails."""
        key = self.key(stream)
        with self._lock:
            ws = self.by_stream.get(key)
            if ws is None:
                return
            try:
                import cupy
                cupy.cuda.runtime.memsetAsync(ws.ptr, 0, self.nbytes, stream)
            except Exception:
                del self.by_stream[key]
                with _held_lock:
                    _held[0] -= self.nbytes

    def __del__(self):    # (the plan left the cache: its bytes leave the budget)
        try:
            with _held_lock:
                _held[0] -= self.nbytes * len(self.by_stream)
        except Exception:     # (interpreter shutdown: the module's globals may be gone)
            pass

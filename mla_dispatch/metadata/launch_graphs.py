"""A plan's launch replayed as a CUDA graph where its arguments repeat: one host call for all of its kernels.

An eager run of a Triton plan launches two kernels (the decode and the combine of split rows) through Triton's Python
launcher: ~50 Python calls per launch, 140-280 µs of host time on the H200's host for a kernel of ~30 µs at b=1
(benchmarks/RESULTS.md, 2026-11-29 evening). A CUDA graph of the same launches costs one ``cudaGraphLaunch``. A graph
holds its kernels' arguments as they were at capture (addresses, strides, TMA descriptors), so it may replay only a
call whose arguments are those: :class:`LaunchGraphs` keeps one graph per key of everything the launch reads from its
arguments (each tensor's address, shape and strides), captured the second time a key is seen (a key seen once costs a
plain launch and no capture), and replays it for every later call with that key. The plan's own buffers (schedule,
lengths, workspace) are the same tensors for the plan's life and ``DecodePlan.update`` rewrites them in place, so the
graphs stay valid across updates; they die with the plan.

Engines call a plan's run per layer with each layer's cache and, from a caching allocator in a repeating step, the
same q / out addresses step after step: the second step captures, the later ones replay. Where addresses never repeat
nothing is captured and each call pays a dictionary look-up over the plain launch.

Nothing is captured (the launch runs as it is) while the current stream captures a graph of its own (the caller's
graph then holds the launch), off CUDA, or on a device other than the plan's. A capture that fails (a launch that
cannot be captured) turns graphs off for the plan and runs the launch plainly, so a bad argument raises its own error.
"""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

import torch

__all__ = ["LaunchGraphs", "MAX_GRAPHS", "CAPTURE_AFTER", "capture_graph"]

#: graphs a plan keeps (one per layer and q / out address set of a model's step); past it they are all dropped
MAX_GRAPHS = 256
#: sightings of a key before its graph is captured (the first ones launch plainly)
CAPTURE_AFTER = 2

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the side stream graphs are captured on
T = TypeVar("T")


def capture_graph(fn: Callable[[], T], device_index: int) -> tuple[torch.cuda.CUDAGraph, T]:
    """``(graph, fn()'s result)``: ``fn()``'s work on ``device_index`` captured in a new CUDA graph (in a memory pool
    of its own, which holds the tensors ``fn`` allocates: its result stays valid, rewritten by each replay). The
    captured work runs only when the graph is replayed; ``fn`` runs once before, on the side stream the capture uses
    (ordered after the current stream's work, which then waits for it), so that stream's lazily made state (cuBLAS'
    handle and workspace) exists before the capture, as PyTorch's CUDA-graph notes ask. Its work must give the same
    result twice. Captured in ``thread_local`` mode: other threads' launches are untouched.

    Raises
    ------
    Exception
        Whatever ``fn`` or the capture raised (an operation that cannot be captured); nothing is left capturing.
    """
    stream = _CAPTURE_STREAMS.get(device_index)
    if stream is None:
        stream = _CAPTURE_STREAMS[device_index] = torch.cuda.Stream(device_index)
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device_index)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn()  # the warm-up
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            result = fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph, result


class LaunchGraphs:
    """Replays of one plan's launch by argument key (see the module docstring).

    Parameters
    ----------
    device_index : int
        The plan's CUDA device.
    capture_after : int
        Sightings of a key before its graph is captured.
    max_graphs : int
        Graphs kept; when full, every graph and sighting is dropped and keys start over.
    """

    __slots__ = ("device_index", "capture_after", "max_graphs", "graphs", "_seen", "enabled", "captures",
                 "replays")

    def __init__(self, device_index: int, *, capture_after: int = CAPTURE_AFTER, max_graphs: int = MAX_GRAPHS):
        if capture_after < 1 or max_graphs < 1:
            raise ValueError(f"capture_after and max_graphs must be >= 1, got {capture_after}, {max_graphs}")
        self.device_index = device_index
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._seen: dict[Hashable, int] = {}
        self.enabled = True
        self.captures = 0  # for tests and profiles
        self.replays = 0

    def __call__(self, key: Hashable, launch: Callable[[], None]) -> None:
        """Run ``launch()`` (the plan's kernels on the current stream), or replay its graph for ``key``."""
        graph = self.graphs.get(key)
        if graph is not None:
            if torch.cuda.current_device() == self.device_index and not torch.cuda.is_current_stream_capturing():
                graph.replay()
                self.replays += 1
                return
            launch()
            return
        if not self.enabled or torch.cuda.current_device() != self.device_index \
                or torch.cuda.is_current_stream_capturing():
            launch()
            return
        seen = self._seen.get(key, 0) + 1
        if seen < self.capture_after:
            if len(self._seen) >= 4 * self.max_graphs:
                self._seen.clear()
            self._seen[key] = seen
            launch()
            return
        graph = self._capture(launch)
        if graph is None:  # not capturable: graphs off for this plan, the launch as it is (its own error, if any)
            self.enabled = False
            launch()
            return
        if len(self.graphs) >= self.max_graphs:
            self.graphs.clear()
            self._seen.clear()
        self._seen.pop(key, None)
        self.graphs[key] = graph
        graph.replay()
        self.replays += 1

    def _capture(self, launch: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        """A graph of ``launch()`` (:func:`capture_graph`: the launch runs once as its warm-up), or None where capture
        failed."""
        try:
            graph, _ = capture_graph(launch, self.device_index)
        except Exception:  # noqa: BLE001 (capture refused or invalidated: run plainly, which raises a real error)
            return None
        self.captures += 1
        return graph

"""LaunchGraphs (metadata/launch_graphs.py): a plan's launch is captured the second time its argument key is seen and
replayed afterwards; nothing is captured inside the caller's own capture, on another device, or once a capture failed.

On a CPU there are no CUDA graphs: the policy is checked with the device queries and the capture played by fakes (a
"graph" that records its replays). The GPU tests run the Triton backend's bound eager path for real: replays against
the reference with outputs poisoned before each run, across DecodePlan.update, and with new tensors.
"""

from __future__ import annotations

import pytest
import torch

from mla_dispatch.metadata.launch_graphs import LaunchGraphs
from mla_dispatch.numerics.cases import case_reference, make_case, poisoned_outputs
from mla_dispatch.numerics.tolerance import compare_outputs


class FakeGraph:
    def __init__(self, log, label):
        self.log, self.label = log, label

    def replay(self):
        self.log.append(("replay", self.label))


@pytest.fixture
def fake_cuda(monkeypatch):
    """A current device 0 that is not capturing; ``_capture`` records the launch it was given and returns a fake
    graph (or None where ``state['fail']``)."""
    state = {"device": 0, "capturing": False, "fail": False, "log": []}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])

    def capture(self, launch):
        state["log"].append(("capture", launch.__name__))
        return None if state["fail"] else FakeGraph(state["log"], launch.__name__)

    monkeypatch.setattr(LaunchGraphs, "_capture", capture)
    return state


def _launch(log, name):
    def launch():
        log.append(("launch", name))

    launch.__name__ = name
    return launch


def test_second_sighting_captures_and_later_ones_replay(fake_cuda):
    log, graphs = fake_cuda["log"], LaunchGraphs(0)
    for _ in range(4):
        graphs(("a",), _launch(log, "a"))
    assert log == [("launch", "a"), ("capture", "a"), ("replay", "a"), ("replay", "a"), ("replay", "a")]
    assert graphs.replays == 3 and list(graphs.graphs) == [("a",)]
    graphs(("b",), _launch(log, "b"))  # another key: its own sightings
    assert log[-1] == ("launch", "b")


@pytest.mark.parametrize("change", ["capturing", "another device"])
def test_no_capture_or_replay_inside_the_callers_capture_or_on_another_device(fake_cuda, change):
    log, graphs = fake_cuda["log"], LaunchGraphs(0)
    graphs(("a",), _launch(log, "a"))
    graphs(("a",), _launch(log, "a"))  # captured
    if change == "capturing":
        fake_cuda["capturing"] = True
    else:
        fake_cuda["device"] = 1
    del log[:]
    for key in (("a",), ("b",), ("b",), ("b",)):
        graphs(key, _launch(log, key[0]))
    assert log == [("launch", "a"), ("launch", "b"), ("launch", "b"), ("launch", "b")]


def test_a_failed_capture_turns_graphs_off_and_launches(fake_cuda):
    log, graphs = fake_cuda["log"], LaunchGraphs(0)
    fake_cuda["fail"] = True
    for _ in range(3):
        graphs(("a",), _launch(log, "a"))
    assert log == [("launch", "a"), ("capture", "a"), ("launch", "a"), ("launch", "a")]
    assert not graphs.enabled and not graphs.graphs


def test_full_cache_starts_over(fake_cuda):
    log, graphs = fake_cuda["log"], LaunchGraphs(0, capture_after=1, max_graphs=2)
    for key in ("a", "b", "c"):
        graphs((key,), _launch(log, key))
    assert list(graphs.graphs) == [("c",)]  # a and b dropped when c came
    assert [entry for entry in log if entry[0] == "capture"] == [("capture", "a"), ("capture", "b"), ("capture", "c")]
    with pytest.raises(ValueError, match="capture_after"):
        LaunchGraphs(0, capture_after=0)


def test_plan_state_swap_rebinds_the_eager_path():
    """Assigning a plan's state (tests and benchmarks force configs so) binds the eager path to the new state: no
    run may take the old state's launch."""
    import mla_dispatch
    from mla_dispatch.dispatch.backend import BackendState

    case = make_case(2, 1, 4, 40, page_size=16)
    plan = mla_dispatch.plan_decode(*case.args(), backend="reference", **case.kwargs())
    seen = []
    cls = plan._cls

    class Spy(cls):
        @classmethod
        def bind(cls_, state, *args, **kwargs):
            seen.append(state)
            return None

    plan._cls = Spy
    new = BackendState()
    plan._state = new
    assert seen == [new] and plan.state is new


# --------------------------------------------------------------------------------------
# GPU: the Triton backend's bound eager path
# --------------------------------------------------------------------------------------


def _triton_plan(case, **options):
    from mla_dispatch import plan_decode

    return plan_decode(*case.args(), backend="triton", backend_options=options or None, **case.kwargs())


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads_q,q_len", [(128, 1), (16, 2)])
def test_triton_replays_match_the_reference_across_updates(num_heads_q, q_len, gen):
    from mla_dispatch.backends.triton import TritonBackend

    case = make_case(3, q_len, num_heads_q, 900, page_size=64, device="cuda", generator=gen, causal=q_len > 1)
    plan = _triton_plan(case)
    graphs = plan.state.graphs
    assert graphs is not None
    out, lse = poisoned_outputs(case)
    original = case.cache_seqlens.clone()
    for step in range(5):
        if step >= 3:  # new lengths in place (within each request's filled blocks): the graphs stay valid
            frac = torch.rand(original.shape, generator=gen).to(original.device)
            case.cache_seqlens.copy_(torch.maximum((original.float() * frac).to(torch.int32),
                                                   torch.full_like(original, q_len)))
            plan.update(cache_seqlens=case.cache_seqlens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        plan.run(case.q, case.kv_cache, out=out, lse=lse)
        rep = compare_outputs(out, lse, *case_reference(case), TritonBackend.TOLERANCE)
        assert rep, f"step {step}: {rep.message}"
    assert graphs.captures == 1 and graphs.replays == 4
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]  # a replay allocates nothing
    plan.run(case.q, case.kv_cache, out=out, lse=lse)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations and graphs.replays == 5
    # another q tensor: another key, launched plainly, then captured on its second run
    q2 = case.q.clone()
    out2, lse2 = poisoned_outputs(case)
    for _ in range(2):
        out2.fill_(float("nan"))
        plan.run(q2, case.kv_cache, out=out2, lse=lse2)
    assert graphs.captures == 2
    rep = compare_outputs(out2, lse2, *case_reference(case), TritonBackend.TOLERANCE)
    assert rep, rep.message


@pytest.mark.gpu
def test_triton_without_launch_graphs_captures_nothing(gen):
    case = make_case(2, 1, 16, 300, page_size=64, device="cuda", generator=gen)
    plan = _triton_plan(case, launch_graphs=False)
    assert plan.state.graphs is None
    assert plan._fast is not None  # the bound path runs, without graphs
    out, lse = poisoned_outputs(case)
    for _ in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        plan.run(case.q, case.kv_cache, out=out, lse=lse)
        rep = compare_outputs(out, lse, *case_reference(case), plan._cls.TOLERANCE)
        assert rep, rep.message

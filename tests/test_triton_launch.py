"""CachedLaunch (metadata/triton_launch.py): a kept compiled kernel is launched directly only with the arguments
``kernel[grid]`` would give it, and only while every changing argument keeps the specialization it was compiled
for; anything else goes through ``kernel[grid]``.

On a CPU there is no compiled kernel to launch, so Triton's runtime is played by a fake (``FakeKernel``): its
``kernel[grid]`` records the bound argument list and returns a compiled kernel whose launcher records the list it
is called with. The GPU test runs a real kernel both ways and compares outputs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mla_dispatch.metadata import triton_launch
from mla_dispatch.metadata.triton_launch import CachedLaunch, spec_key


def toy(X, Out, n, scale, stride, BLOCK: int = 16, FLAG: bool = False):  # the "kernel's" signature
    pass


class FakeCompiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = object(), object(), log

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
        assert function is self.function and packed is self.packed_metadata
        assert (launch_metadata, enter_hook, exit_hook) == (None, None, None)
        self.log.append(("fast", (g0, g1, g2), stream, list(args)))


class FakeKernel:
    """``kernel[grid](*args, **options)`` as Triton's JITFunction.run: binds the arguments (defaults applied) and
    returns the compiled kernel of their specialization."""

    fn = staticmethod(toy)

    def __init__(self):
        self.log, self.compiled = [], {}

    def __getitem__(self, grid):
        import inspect

        def launch(*args, **options):
            bound = inspect.signature(toy).bind(*args)
            bound.apply_defaults()
            values = list(bound.arguments.values())
            self.log.append(("slow", grid, options, values))
            key = tuple(map(spec_key, values))
            return self.compiled.setdefault(key, FakeCompiled(self.log))

        return launch


@pytest.fixture(autouse=True)
def _own_shared_cache(monkeypatch):
    """Each test with a cache of compiled kernels of its own: the process-wide one is keyed by ``id(kernel)``, and a
    FakeKernel of an earlier test, collected, can leave its id to this test's, whose first launch would then find
    the earlier kernel's compiled one (and log into the earlier test's list: a failure that came and went with the
    order of the tests in an xdist worker)."""
    monkeypatch.setattr(triton_launch, "_SHARED", {})


@pytest.fixture
def on_gpu0(monkeypatch):
    """The CUDA device and stream queries CachedLaunch makes, as on a GPU whose current device is 0."""
    current = {"device": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    return current


def test_second_call_launches_the_kept_kernel_with_the_same_arguments(on_gpu0):
    k = FakeKernel()
    x, out = torch.zeros(64), torch.zeros(64)
    launch = CachedLaunch(k, (3, 2), dict(X=x, scale=0.5, BLOCK=32), ("Out", "n", "stride"), {"num_warps": 4}, 0)
    launch(out, 17, 64)
    launch(out, 17, 64)
    (slow, fast) = k.log
    assert slow == ("slow", (3, 2), {"num_warps": 4}, [x, out, 17, 0.5, 64, 32, False])
    # the same arguments (a CUDA tensor would go as its address: the GPU test; a host one stays a tensor, for
    # Triton's launcher to refuse with its own message)
    assert fast == ("fast", (3, 2, 1), 1000, slow[3])
    assert launch.compiled_variants == 1


@pytest.mark.parametrize("change", ["int value", "misaligned pointer", "dtype", "another device", "launch hook"])
def test_a_different_specialization_goes_through_kernel_grid(on_gpu0, monkeypatch, change):
    k = FakeKernel()
    x, out = torch.zeros(64), torch.zeros(64)
    launch = CachedLaunch(k, (1,), dict(X=x, scale=1.0), ("Out", "n", "stride"), {}, 0)
    launch(out, 32, 64)
    args = [out, 32, 64]
    if change == "int value":
        args[1] = 33  # Triton specializes 32 (divisible by 16), not 33
    elif change == "misaligned pointer":
        args[0] = out[1:]
    elif change == "dtype":
        args[0] = out.double()
    elif change == "another device":
        on_gpu0["device"] = 1
    else:
        from triton import knobs

        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler's hook
    launch(*args)
    assert [entry[0] for entry in k.log] == ["slow", "slow"]
    assert k.log[1][3][1:3] == [args[0], args[1]]


def test_interpreter_and_cpu_launches_take_kernel_grid_every_time():
    k = FakeKernel()
    launch = CachedLaunch(k, (1,), dict(X=torch.zeros(4), scale=1.0), ("Out", "n", "stride"), {}, None)
    for _ in range(3):
        launch(torch.zeros(4), 1, 1)
    assert [entry[0] for entry in k.log] == ["slow"] * 3


def test_argument_errors():
    k = FakeKernel()
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['Y'\]"):
        CachedLaunch(k, (1,), dict(Y=1), ())
    with pytest.raises(ValueError, match=r"\['n'\] are both fixed"):
        CachedLaunch(k, (1,), dict(n=1), ("n",))
    with pytest.raises(ValueError, match=r"parameter 'stride' .* neither fixed nor varying"):
        CachedLaunch(k, (1,), dict(X=1, Out=2, n=3, scale=1.0), ())


def test_spec_key_separates_what_triton_specializes():
    t = torch.zeros(8)
    assert spec_key(t) == spec_key(torch.zeros(8)) != spec_key(t[1:]) and spec_key(t) != spec_key(t.half())
    assert spec_key(16) != spec_key(1) != spec_key(17) and spec_key(0.5) == spec_key(2.0)
    assert spec_key(None) is None and spec_key(True) is True
    assert triton_launch._hooks_installed() is False


@pytest.mark.gpu
def test_kept_launch_computes_what_kernel_grid_computes():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def axpy(X, Y, Out, a, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(Out + i, a * tl.load(X + i, mask=m) + tl.load(Y + i, mask=m), mask=m)

    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    want = torch.empty_like(x)
    axpy[(8,)](x, y, want, 2.0, 1000, BLOCK=128)
    launch = CachedLaunch(axpy, (8,), dict(X=x, Y=y, a=2.0, n=1000, BLOCK=128), ("Out",), {}, x.device.index)
    assert launch._addresses[:2] == [x.data_ptr(), y.data_ptr()]  # the kept kernel's launcher gets addresses
    for _ in range(3):  # slow, then the kept kernel
        got = torch.full_like(x, float("nan"))
        launch(got)
        assert torch.equal(got, want)
    assert launch.compiled_variants == 1
    with pytest.raises(ValueError, match="cpu tensor"):  # a host tensor still meets Triton's own check
        launch(torch.zeros(1000))


def test_rebased_descriptor_equals_a_fresh_one():
    """A query tile's descriptor copied with another base (kernels/triton/descriptors.py) holds what building it anew
    would: every field but the base is the geometry's, and the base is the new tensor."""
    pytest.importorskip("triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mla_dispatch.kernels.triton.descriptors import rebased

    made = []

    def make(t):
        made.append(t)
        return TensorDescriptor(t, [64, 576], [576, 1], [16, 512])

    key = ("test", 64, 576, torch.bfloat16)
    for _ in range(3):
        base = torch.zeros(64, 576, dtype=torch.bfloat16)
        got, want = rebased(key, base, make), TensorDescriptor(base, [64, 576], [576, 1], [16, 512])
        assert got.base is base and {k: v for k, v in vars(got).items() if k != "base"} == {
            k: v for k, v in vars(want).items() if k != "base"}
    assert len(made) == 1  # built (and checked) once per geometry

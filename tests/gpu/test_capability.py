"""A GPU older than the kernels' minimum (sm_80) is refused before anything compiles, with
one error naming the device, its capability and the minimum, raised on every rank. CuPy is
faked: no GPU needed. Runs alone and under mpiexec."""

import numpy as np
import pytest

import burstmpi
import burstmpi._runtime as runtime
from burstmpi._gpu.device import check_capability, device_name
from conftest import NRANKS, RANK

MESSAGE = ("f: backend 'cuda': GPU 1 (Tesla T4) has compute capability 7.5 (sm_75); burstmpi's kernels need "
           "8.0 (sm_80, Ampere) or newer")


def fake_cupy(devices):
    """A CuPy that sees ``devices``, a list of (name, compute capability as CuPy spells it:
    "75", "120"); only what the GPU set-up reads before it builds the backend."""

    class Device:
        def __init__(self, i=0):
            self.id = i
            self.compute_capability = devices[i][1]

        def use(self):
            pass

    class Runtime:
        @staticmethod
        def getDeviceCount():
            return len(devices)

        @staticmethod
        def getDeviceProperties(i):
            return {"name": devices[i][0].encode(), "major": int(devices[i][1][:-1])}

    class Cuda:
        pass

    Cuda.Device, Cuda.runtime = Device, Runtime

    class Cupy:
        cuda = Cuda

    return Cupy


GPUS = [("NVIDIA A100-SXM4-40GB", "80"), ("Tesla T4", "75"), ("NVIDIA H100 80GB HBM3", "90"),
        ("NVIDIA B200", "100"), ("NVIDIA GeForce RTX 5090", "120"), ("Tesla V100-SXM2-16GB", "70")]


def test_the_message_names_the_device_its_capability_and_the_minimum():
    cupy = fake_cupy(GPUS)
    with pytest.raises(RuntimeError) as e:
        check_capability("f", cupy, 1)
    assert str(e.value) == MESSAGE
    with pytest.raises(RuntimeError, match=r"^g: backend 'cuda': GPU 5 \(Tesla V100-SXM2-16GB\) has compute "
                                           r"capability 7\.0 \(sm_70\); burstmpi's kernels need 8\.0"):
        check_capability("g", cupy, 5)
    for ok in (0, 2, 3, 4):  # sm_80, sm_90, sm_100 and sm_120 (two-digit majors) pass
        assert check_capability("f", cupy, ok) is None
    assert device_name(cupy, 4) == "NVIDIA GeForce RTX 5090"


def test_an_old_gpu_on_one_rank_is_one_error_on_every_rank(monkeypatch):
    """Rank 1 (or the only rank, with device=1) gets the sm_75 GPU: every rank raises the
    same error naming it, before the CUDA backend is built; the host still works after."""
    cupy = fake_cupy(GPUS[:2])  # rank r takes GPU r % 2
    monkeypatch.setattr(runtime, "import_cupy", lambda fn: cupy)
    q = np.zeros((1, 8, 2, 32), np.float16)
    plan = burstmpi.BurstAttention(backend="cuda", device=1 if NRANKS == 1 else None)
    bad = 0 if NRANKS == 1 else 1
    also = [r for r in range(bad + 1, NRANKS) if r % 2 == 1]
    with pytest.raises(RuntimeError) as e:
        plan.forward(q, q, q)
    want = f"rank {bad}: " + MESSAGE.replace("f: ", "BurstAttention.forward: ", 1)
    if also:
        want += f" (ranks {also} failed too)"
    assert str(e.value) == want, (RANK, str(e.value))
    out, _ = burstmpi.BurstAttention(backend="cpu").forward(q, q, q)
    assert out.shape == q.shape

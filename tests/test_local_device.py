"""nanokl.harness.world.pick_device (the harness's choice of device, nanokl.engine.dist.local_device's plus a
diagnosis): trainer.device=auto on a CUDA build of torch that finds no usable GPU runs on the CPU and,
where the machine has a GPU (a driver loaded, or torch warning about CUDA), says why on stderr, once;
everywhere else (a CUDA wheel on a machine without a GPU too) it is silent. dist.local_device itself
only chooses: it says nothing and catches no warning.

The machine is simulated (monkeypatched torch.cuda.is_available, torch.version.cuda, the driver's
version file): torch 2.14.1+cu130 on a 570 driver, the case that would otherwise look like a run
that chose the CPU. The line names the driver found, the driver the build needs (CUDA 13.x: >= 580)
and torch's own warning, which is then not shown a second time; other warnings pass through.
"""

import warnings

import torch

from nanokl.engine import dist as D
from nanokl.harness import world

TOO_OLD = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12080). Please "
           "update your GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx")


def machine(monkeypatch, tmp_path, available=False, cuda="13.0", driver="570.86.15", warn=TOO_OLD):
    """A torch built for `cuda` on a machine with `driver` (None: no driver loaded); torch warns
    `warn` on its first CUDA query only, as the real one does."""
    monkeypatch.setattr(world, "_SAID_CPU", [])
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    version = tmp_path / "version"
    if driver is not None:
        version.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  Release Build  "
                           "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 30 2025\nGCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(world, "_DRIVER_FILE", str(version))
    warned = []

    def is_available():
        if warn and not warned:
            warned.append(True)
            warnings.warn(warn, UserWarning)
        return available

    monkeypatch.setattr(torch.cuda, "is_available", is_available)


def test_auto_on_a_driver_too_old_says_why_once(monkeypatch, tmp_path, capsys):
    machine(monkeypatch, tmp_path)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        devices = [world.pick_device("auto") for _ in range(3)]
    assert devices == [torch.device("cpu")] * 3
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("nanokl: trainer.device=auto runs on the CPU: torch 2.14.1+cu130 is built for CUDA 13.0")
    assert "needs NVIDIA driver >= 580" in line and "driver is 570.86.15" in line
    assert "found version 12080" in line
    assert not shown  # torch's warning is in the line, not repeated


def test_auto_without_a_driver_says_so_only_when_torch_saw_a_gpu(monkeypatch, tmp_path, capsys):
    machine(monkeypatch, tmp_path, cuda="12.8", driver=None, warn=None)  # a CUDA wheel on a CPU machine
    assert world.pick_device("auto") == torch.device("cpu")
    assert capsys.readouterr().err == ""
    machine(monkeypatch, tmp_path, cuda="12.8", driver=None)  # no driver file, but torch found a GPU it cannot use
    assert world.pick_device("auto") == torch.device("cpu")
    err = capsys.readouterr().err
    assert "CUDA 12.8, which needs NVIDIA driver >= 525" in err and "no NVIDIA driver loaded" in err


def test_silent_where_the_cpu_is_expected_or_cuda_works(monkeypatch, tmp_path, capsys):
    machine(monkeypatch, tmp_path, cuda=None, warn=None)  # a CPU build of torch: nothing to explain
    assert world.pick_device("auto") == torch.device("cpu")
    machine(monkeypatch, tmp_path, available=True, warn=None)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert world.pick_device("auto") == torch.device("cuda:3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: 1 / 0)  # never asked
    assert world.pick_device("cpu") == torch.device("cpu")
    assert world.pick_device("cuda") == torch.device("cuda:3")
    assert capsys.readouterr().err == ""


def test_other_warnings_pass_through(monkeypatch, tmp_path, capsys):
    machine(monkeypatch, tmp_path, available=True, warn="something unrelated")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert world.pick_device("auto") == torch.device("cuda:0")
    assert [str(w.message) for w in shown] == ["something unrelated"]
    assert capsys.readouterr().err == ""


def test_dist_local_device_only_chooses(monkeypatch, tmp_path, capsys):
    """The engine's choice, on the driver-too-old machine: the CPU, no line, torch's warning left to the
    caller's filters (dist.init returns it; the harness's pick_device is what explains it)."""
    machine(monkeypatch, tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert D.local_device("auto") == torch.device("cpu")
    assert [str(w.message) for w in shown] == [TOO_OLD]
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: 1 / 0)  # never asked
    assert D.local_device("cpu") == torch.device("cpu") and D.local_device("cuda") == torch.device("cuda:2")


def test_init_binds_nccl_to_the_local_gpu(monkeypatch):
    """Under torchrun on CUDA, init names this process's GPU (LOCAL_RANK) to set_device and to the process
    group (device_id): NCCL left to guess maps rank -> GPU by the global rank and warns it may hang (first
    H200 run). Simulated: rank 9 of 16 on a node whose local rank is 1; the calls are recorded, not made."""
    for k, v in {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(D, "rank", lambda: 9)
    monkeypatch.setattr(D, "world", lambda: 16)
    monkeypatch.setattr(D, "local_device", lambda setting="auto": torch.device("cuda", 1))
    assert D.init() == (9, 16, torch.device("cuda", 1))
    assert calls["backend"] == "nccl"
    assert calls["device_id"] == torch.device("cuda", 1) == calls["set_device"]

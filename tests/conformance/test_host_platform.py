"""The make targets' platform detection (conformance/runtime/host_platform.py), from injected host facts and
from a stand-in file system."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.runtime.host_platform import AmbiguousHost, HostFacts, detect_platform, read_host_facts

TPU_V5E = ("0x1ae0", "0x0063")
TPU_V6E = ("0x1ae0", "0x006f")
NVIDIA_H100 = ("0x10de", "0x2330")


def test_tpu_chips_on_the_pci_bus_are_a_tpu_host() -> None:
    facts = HostFacts(pci_devices=(TPU_V5E,) * 4 + (("0x8086", "0x1237"),))
    assert detect_platform(facts) == ("tpu", "4 TPU chip(s) on the PCI bus (v5e)")
    assert detect_platform(HostFacts(pci_devices=(TPU_V5E, TPU_V6E)))[1].endswith("(v5e, v6e)")


def test_accel_devices_alone_are_a_tpu_host() -> None:
    facts = HostFacts(accel_devices=("/dev/accel0", "/dev/accel1"))
    assert detect_platform(facts) == ("tpu", "TPU devices /dev/accel0, /dev/accel1")


def test_nvidias_driver_is_a_cuda_host() -> None:
    facts = HostFacts(pci_devices=(NVIDIA_H100,), nvidia_driver_files=("proc/driver/nvidia/version",))
    assert detect_platform(facts) == ("cuda", "NVIDIA's driver (/proc/driver/nvidia/version)")


def test_a_google_device_that_is_no_tpu_and_a_gpu_without_driver_are_a_cpu_host() -> None:
    facts = HostFacts(pci_devices=(("0x1ae0", "0x0001"), NVIDIA_H100))
    assert detect_platform(facts)[0] == "cpu"
    assert detect_platform(HostFacts())[0] == "cpu"


def test_a_tpu_beside_a_gpu_driver_asks_the_user() -> None:
    facts = HostFacts(accel_devices=("/dev/accel0",), nvidia_driver_files=("dev/nvidiactl",))
    with pytest.raises(AmbiguousHost, match="give PLATFORM=tpu or PLATFORM=cuda"):
        detect_platform(facts)


def test_facts_are_read_from_sysfs_dev_and_proc(tmp_path: Path) -> None:
    for slot, (vendor, device) in {"0000:00:04.0": TPU_V6E, "0000:00:05.0": NVIDIA_H100}.items():
        folder = tmp_path / "sys/bus/pci/devices" / slot
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(f"{vendor}\n")
        (folder / "device").write_text(f"{device}\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/accel0").touch()
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text("NVRM version: 570.86\n")
    facts = read_host_facts(tmp_path)
    assert facts.pci_devices == (TPU_V6E, NVIDIA_H100)
    assert facts.accel_devices == (str(tmp_path / "dev/accel0"),)
    assert facts.nvidia_driver_files == ("proc/driver/nvidia/version",)
    assert facts.tpu_chips() == ["v6e"]

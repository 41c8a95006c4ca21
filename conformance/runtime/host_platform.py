"""Which accelerator this host has, `tpu`, `cuda` or `cpu`: the make targets install that platform's extras.

`make` asks before any virtualenv exists, so this module uses the standard library alone:
`python3 -m conformance.runtime.host_platform` prints the name, `--explain` what it was told by. The facts are
the ones JAX's own start-up looks at: a TPU VM's chips on the PCI bus (Google's vendor id and a TPU
device id) or its `/dev/accel*` devices, and NVIDIA's driver (`/proc/driver/nvidia/version`,
`/dev/nvidiactl`, `/dev/nvidia0`). `PLATFORM=cpu|tpu|cuda` on the make line overrides the answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

PLATFORMS = ("cpu", "tpu", "cuda")
GOOGLE_PCI_VENDOR = "0x1ae0"
# The TPU generations by PCI device id, as JAX's `jax._src.hardware_utils` knows them.
TPU_PCI_DEVICES = {
    "0x0027": "v3",
    "0x0056": "plc",
    "0x005e": "v4",
    "0x0062": "v5p",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0076": "tpu7x",
}
NVIDIA_DRIVER_FILES = ("proc/driver/nvidia/version", "dev/nvidiactl", "dev/nvidia0")


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """What the detection reads: each PCI device's (vendor, device) ids, the `/dev/accel*` devices, and
    which of `NVIDIA_DRIVER_FILES` exist."""

    pci_devices: tuple[tuple[str, str], ...] = ()
    accel_devices: tuple[str, ...] = ()
    nvidia_driver_files: tuple[str, ...] = ()

    def tpu_chips(self) -> list[str]:
        """The TPU generation of each TPU chip on the PCI bus."""
        return [
            TPU_PCI_DEVICES[device]
            for vendor, device in self.pci_devices
            if vendor == GOOGLE_PCI_VENDOR and device in TPU_PCI_DEVICES
        ]


def read_host_facts(root: Path = Path("/")) -> HostFacts:
    """The facts of the host whose file system is at `root`."""
    pci = []
    for vendor_file in sorted(root.glob("sys/bus/pci/devices/*/vendor")):
        try:
            vendor = vendor_file.read_text().strip()
            device = vendor_file.with_name("device").read_text().strip()
        except OSError:  # a device that went away, or one this user may not read
            continue
        pci.append((vendor, device))
    return HostFacts(
        pci_devices=tuple(pci),
        accel_devices=tuple(sorted(str(path) for path in root.glob("dev/accel*"))),
        nvidia_driver_files=tuple(name for name in NVIDIA_DRIVER_FILES if (root / name).exists()),
    )


class AmbiguousHost(Exception):
    """A host with both a TPU and an NVIDIA driver: the user must say which platform to install for."""


def detect_platform(facts: HostFacts) -> tuple[str, str]:
    """(platform, what says so): `tpu` for TPU chips or `/dev/accel*` devices, `cuda` for NVIDIA's
    driver, else `cpu`; AmbiguousHost when both an accelerator and a GPU driver are there."""
    chips = facts.tpu_chips()
    tpu = ""
    if chips:
        tpu = f"{len(chips)} TPU chip(s) on the PCI bus ({', '.join(sorted(set(chips)))})"
    elif facts.accel_devices:
        tpu = f"TPU devices {', '.join(facts.accel_devices)}"
    cuda = f"NVIDIA's driver ({', '.join('/' + name for name in facts.nvidia_driver_files)})"
    if tpu and facts.nvidia_driver_files:
        raise AmbiguousHost(f"{tpu} and {cuda}: give PLATFORM=tpu or PLATFORM=cuda")
    if tpu:
        return "tpu", tpu
    if facts.nvidia_driver_files:
        return "cuda", cuda
    return "cpu", "no TPU chip or device and no NVIDIA driver found"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m conformance.runtime.host_platform", description=__doc__)
    parser.add_argument("--explain", action="store_true", help="print what the answer rests on too")
    args = parser.parse_args(argv)
    try:
        platform, evidence = detect_platform(read_host_facts())
    except AmbiguousHost as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{platform}: {evidence}" if args.explain else platform)
    return 0


if __name__ == "__main__":
    sys.exit(main())

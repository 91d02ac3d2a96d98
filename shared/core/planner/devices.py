"""The devices a plan is made for: a table of common GPUs, and the cluster a user names from it.

A cluster is given as `--devices A100-40GB,T4,T4` (each a row of DEVICES, optionally `NAME:MEMORY` for the
memory an executor may use there) or as `--cluster FILE`, the same as JSON:
`{"devices": ["A100-40GB", {"name": "T4", "memory": "12GiB"}, ...], "link_GBps": 12.5}`.

The table's figures are vendor datasheet numbers, not measurements: the planner's latency for a device
without a measured profile is modelled from them (planner/roofline.py). `cpu` has no figures: planning
for it needs a profile measured on it (`morphling profile --latency`) and an explicit memory
(`cpu:600MiB`, the executor's arena).

Sources (dense, no sparsity; the SXM part where both exist):
- H100-80GB: NVIDIA H100 Tensor Core GPU datasheet (2023): 80 GB HBM3, 3.35 TB/s, FP16 989 TFLOPS.
- H200-141GB: NVIDIA H200 Tensor Core GPU datasheet (2024): 141 GB HBM3e, 4.8 TB/s, FP16 989 TFLOPS.
- A100-40GB / A100-80GB: NVIDIA A100 datasheet (2021): 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at
  2,039 GB/s, FP16 312 TFLOPS.
- L4: NVIDIA L4 datasheet (2023): 24 GB GDDR6, 300 GB/s, FP16 121 TFLOPS (242 with sparsity).
- T4: NVIDIA T4 datasheet (2019): 16 GB GDDR6, 320 GB/s, mixed-precision FP16 65 TFLOPS.
- V100-16GB / V100-32GB: NVIDIA V100 datasheet (2020, SXM2): HBM2 at 900 GB/s, FP16 125 TFLOPS.
- P100-12GB: NVIDIA P100 PCIe datasheet (2016): 12 GB HBM2, 549 GB/s, FP16 18.7 TFLOPS (the paper's
  clusters 6).
Links between stages default to PCIe 4.0 x16 (about 25 GB/s achieved): the paper's clusters span nodes,
so NVLink is not assumed; `link_GBps` in a cluster file overrides it.
"""

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from shared.config import parse_size

GB = 10**9
TFLOPS = 10**12
DEFAULT_LINK_BPS = 25 * GB
# vLLM's default gpu_memory_utilization: the CUDA context, the allocator's slack and the kernels' workspace
# take the rest. A memory given with NAME:MEMORY is taken whole: it is what that executor may use.
MEMORY_UTILIZATION = 0.9


class ClusterError(ValueError):
    """A cluster that cannot be read; the message names the entry and what is wrong with it."""


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes an executor may use on it (M_j)
    bandwidth: float = 0.0  # bytes/s of device memory; 0: unknown (a profile must be measured there)
    fp16_flops: float = 0.0  # dense FP16 tensor FLOP/s; 0: unknown
    link: float = DEFAULT_LINK_BPS  # bytes/s to the next stage (f_j of the paper's Eq. 7)

    @property
    def modelled(self) -> bool:
        """Whether the table has what the roofline needs to model this device's latency."""
        return self.bandwidth > 0 and self.fp16_flops > 0


def _gpu(name: str, memory_gb: float, bandwidth_gbs: float, tflops: float) -> Device:
    return Device(name, int(memory_gb * GB * MEMORY_UTILIZATION), bandwidth_gbs * GB, tflops * TFLOPS)


DEVICES: dict[str, Device] = {d.name: d for d in (
    _gpu("H100-80GB", 80, 3350, 989),
    _gpu("H200-141GB", 141, 4800, 989),
    _gpu("A100-40GB", 40, 1555, 312),
    _gpu("A100-80GB", 80, 2039, 312),
    _gpu("L4", 24, 300, 121),
    _gpu("T4", 16, 320, 65),
    _gpu("V100-16GB", 16, 900, 125),
    _gpu("V100-32GB", 32, 900, 125),
    _gpu("P100-12GB", 12, 549, 18.7),
    Device("cpu", 0),
)}


def table_name(gpu_name: str) -> str | None:
    """The table's name for a GPU as CUDA names it ("NVIDIA H100 80GB HBM3" is H100-80GB), or None: the model
    must appear as a word, and its memory too where the table has the model in several sizes."""
    for name in DEVICES:
        model, _, memory = name.partition("-")
        sizes = [n for n in DEVICES if n.partition("-")[0] == model]
        if re.search(rf"\b{re.escape(model)}\b", gpu_name) and (len(sizes) == 1 or memory in gpu_name):
            return name
    return None


def device(entry: str | dict, where: str = "devices") -> Device:
    """One device from `NAME[:MEMORY]` or `{"name", "memory"}`; ClusterError names what is wrong."""
    if isinstance(entry, str):
        name, _, memory = entry.strip().partition(":")
        entry = {"name": name, **({"memory": memory} if memory else {})}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ClusterError(f"{where}: expected a device name or {{\"name\": ..., \"memory\": ...}}, got {entry!r}")
    unknown = set(entry) - {"name", "memory"}
    if unknown:
        raise ClusterError(f"{where}: unknown field {sorted(unknown)[0]!r} (a device has name and memory)")
    row = DEVICES.get(entry["name"])
    if row is None:
        raise ClusterError(f"{where}: unknown device {entry['name']!r}; the table has {', '.join(DEVICES)}")
    if "memory" in entry:
        try:
            memory = parse_size(str(entry["memory"]))
        except ValueError as exc:
            raise ClusterError(f"{where}: memory {entry['memory']!r} is not a size such as 600MiB or 12GiB") from exc
        if memory <= 0:
            raise ClusterError(f"{where}: memory must be positive, got {entry['memory']!r}")
        row = replace(row, memory=memory)
    if row.memory <= 0:
        raise ClusterError(f"{where}: {row.name} needs its memory, e.g. {row.name}:600MiB")
    return row


def parse_devices(text: str) -> list[Device]:
    """`--devices A100-40GB,T4:12GiB,T4`."""
    entries = [e for e in text.split(",") if e.strip()]
    if not entries:
        raise ClusterError("devices: name at least one device, e.g. --devices A100-40GB,T4,T4")
    return [device(e, f"devices[{i}] ({e.strip()})") for i, e in enumerate(entries)]


def read_cluster(path: str | Path) -> list[Device]:
    """`--cluster FILE`: {"devices": [...], "link_GBps": optional}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ClusterError(f"cannot read the cluster file {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list) or not data["devices"]:
        raise ClusterError(f'{path}: expected {{"devices": ["A100-40GB", {{"name": "T4", "memory": "12GiB"}}, ...]}}')
    unknown = set(data) - {"devices", "link_GBps"}
    if unknown:
        raise ClusterError(f"{path}: unknown field {sorted(unknown)[0]!r} (a cluster has devices and link_GBps)")
    devices = [device(e, f"{path}: devices[{i}]") for i, e in enumerate(data["devices"])]
    if "link_GBps" in data:
        link = data["link_GBps"]
        if not isinstance(link, (int, float)) or isinstance(link, bool) or link <= 0:
            raise ClusterError(f"{path}: link_GBps must be a positive number, got {link!r}")
        devices = [replace(d, link=link * GB) for d in devices]
    return devices


def describe(d: Device) -> str:
    return f"{d.name} ({d.memory / (1 << 30):.1f} GiB)"

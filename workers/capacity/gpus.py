"""The accelerators the planner sizes for: memory and HBM bandwidth per GPU, from the
vendors' datasheets (figures in decimal units, as the datasheets print them: 1 GB = 10^9
bytes, 1 TB/s = 10^12 bytes/s). A device exposes a little less than its datasheet
capacity to programs (the driver and CUDA context keep some), which is one reason the
planner keeps a headroom fraction free."""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
TB = 10**12


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_bytes: int
    bandwidth_bytes_s: int

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    @property
    def bandwidth_tb_s(self) -> float:
        return self.bandwidth_bytes_s / TB


GPUS: dict[str, Gpu] = {g.key: g for g in (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: 80 GB HBM3, 3.35 TB/s.
    Gpu("H100-80GB", "NVIDIA H100 SXM 80GB", 80 * GB, 3_350 * GB),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: 141 GB HBM3e, 4.8 TB/s.
    Gpu("H200-141GB", "NVIDIA H200 SXM 141GB", 141 * GB, 4_800 * GB),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: 80 GB HBM2e, 2,039 GB/s.
    Gpu("A100-80GB", "NVIDIA A100 SXM 80GB", 80 * GB, 2_039 * GB),
    # NVIDIA L40S datasheet: 48 GB GDDR6 with ECC, 864 GB/s.
    Gpu("L40S-48GB", "NVIDIA L40S 48GB", 48 * GB, 864 * GB),
    # NVIDIA Blackwell B200 as announced (GTC 2024 keynote and Blackwell architecture
    # brief): 192 GB HBM3e, 8 TB/s. DGX/HGX B200 systems list 1,440 GB for 8 GPUs, i.e.
    # 180 GB usable each: the headroom setting covers the difference.
    Gpu("B200-192GB", "NVIDIA B200 192GB", 192 * GB, 8_000 * GB),
)}

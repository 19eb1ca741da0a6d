"""Published peak memory bandwidth of devices, by the name torch reports, for a baseline's
`performance.bandwidth_fraction` (achieved / peak). A device not listed (CPUs, Ascend NPUs for now:
no figure from Huawei's own pages was checked) has no known peak and the fraction stays null.
"""

from __future__ import annotations

import re
from typing import Optional

# (pattern searched in the upper-cased device name, GB/s), each under its source. First match wins, so the
# specific variants come before the general ones.
PEAK_BANDWIDTH_GBPS = (
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM and NVL: 4.8 TB/s)
    (r"H200", 4800.0),
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM 3.35 TB/s, NVL 3.9 TB/s, PCIe 2 TB/s)
    (r"H100 NVL", 3900.0),
    (r"H100 PCIE", 2000.0),
    (r"H100 (SXM|80GB HBM3)", 3350.0),
    # https://www.nvidia.com/en-us/data-center/a100/ (80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s, 40GB 1,555 GB/s)
    (r"A100.*SXM.*80GB", 2039.0),
    (r"A100.*80GB.*PCIE", 1935.0),
    (r"A100.*40GB", 1555.0),
    # https://www.nvidia.com/en-us/data-center/l40s/ (864 GB/s)
    (r"L40S", 864.0),
)


def peak_bandwidth_gbps(device_name: Optional[str]) -> Optional[float]:
    """The published peak of `device_name` (e.g. "NVIDIA H200"), or None when not listed."""
    if not device_name:
        return None
    name = device_name.upper()
    for pattern, gbps in PEAK_BANDWIDTH_GBPS:
        if re.search(pattern, name):
            return gbps
    return None

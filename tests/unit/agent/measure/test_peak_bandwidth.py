"""agent/measure/peak_bandwidth.py, the published peak a baseline's bandwidth fraction divides by: the
specific variant before the general one (H100 NVL / PCIe / SXM, A100 80GB SXM / PCIe / 40GB), and no figure
for a device not listed (a CPU, an Ascend NPU: no checked source yet)."""

from __future__ import annotations

import pytest

from agent.measure.peak_bandwidth import peak_bandwidth_gbps


@pytest.mark.parametrize("name, gbps", [
    ("NVIDIA H200", 4800.0), ("NVIDIA H200 NVL", 4800.0),
    ("NVIDIA H100 NVL", 3900.0), ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H100 80GB HBM3", 3350.0),
    ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100 80GB PCIe", 1935.0), ("NVIDIA A100-SXM4-40GB", 1555.0),
    ("NVIDIA L40S", 864.0)])
def test_each_device_gets_its_own_variants_figure(name, gbps):
    assert peak_bandwidth_gbps(name) == gbps


@pytest.mark.parametrize("name", [None, "", "cpu", "Ascend910B4", "NVIDIA GeForce RTX 4090", "NVIDIA H100"])
def test_a_device_not_listed_has_no_peak(name):
    assert peak_bandwidth_gbps(name) is None

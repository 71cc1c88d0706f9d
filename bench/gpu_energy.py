# defines: the GPU's energy counter for the PyTorch baselines (bench/torch_baseline.py, bench/hf_families.py), read
# through NVML as moetrain bench reads it (src/ops/cuda/energy.cpp): joules since the driver loaded, or None where
# NVML or the counter is not available. A step at the power limit is as fast as the energy it spends allows.
import ctypes

import torch


def gpu_energy_j(device="cuda"):
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2():
            return None
        p = torch.cuda.get_device_properties(device)
        bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0".encode()
        handle, millijoules = ctypes.c_void_p(), ctypes.c_ulonglong()
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)):
            return None
        if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)):
            return None
        return millijoules.value / 1e3
    except (OSError, AttributeError):
        return None


def joules_between(before, after, calls):
    """Joules a call between two readings; None when either is missing or the counter did not advance between them
    (the driver updates it in steps: a window shorter than one measured nothing, which is not zero joules)."""
    if before is None or after is None or not after > before:
        return None
    return (after - before) / calls

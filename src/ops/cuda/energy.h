// defines: the set-up GPU's energy counter, power limit and SM clock as the driver's NVML reports them, for the
// benchmarks: a step that runs at the power limit is as fast as the energy it spends allows, so `moetrain bench`
// gives joules a step beside the time. NVML is loaded at run time (dlopen of libnvidia-ml.so.1): a machine without
// the driver, or a build without CUDA, reads nothing and nothing fails.
#pragma once

#include <optional>

namespace moetrain::ops::cuda {

struct GpuPowerReading {
  double energy_joules = 0.0;      // the device's counter since the driver loaded (nvmlDeviceGetTotalEnergyConsumption)
  double power_limit_watts = 0.0;  // the enforced limit (nvmlDeviceGetEnforcedPowerLimit)
  int sm_clock_mhz = 0;            // the SM clock now (nvmlDeviceGetClockInfo)
};

// The reading of the device setup_cuda set up (found by its PCI bus id, so that CUDA_VISIBLE_DEVICES cannot point it
// at another GPU), or nullopt when NVML, the device or its energy counter is not available.
std::optional<GpuPowerReading> read_gpu_power();

}  // namespace moetrain::ops::cuda

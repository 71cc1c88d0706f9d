// defines: NVML read through dlopen: the few entry points read_gpu_power needs, declared here with NVML's C types
// (the driver's header is not part of the toolkit), looked up once per process.
#include "ops/cuda/energy.h"

#include "ops/cuda/runtime.h"

#if MOETRAIN_HAS_CUDA
#include <dlfcn.h>

#include <cuda_runtime.h>
#endif

namespace moetrain::ops::cuda {

#if MOETRAIN_HAS_CUDA

namespace {

// NVML's C interface: nvmlReturn_t is an int (NVML_SUCCESS = 0), nvmlDevice_t an opaque pointer, and the SM clock
// NVML_CLOCK_SM = 1 of nvmlClockType_t.
using NvmlDevice = struct NvmlDeviceOpaque*;
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;

struct Nvml {
  int (*init)() = nullptr;
  int (*handle_by_pci_bus_id)(const char*, NvmlDevice*) = nullptr;
  int (*total_energy)(NvmlDevice, unsigned long long*) = nullptr;  // millijoules
  int (*power_limit)(NvmlDevice, unsigned int*) = nullptr;         // milliwatts
  int (*clock)(NvmlDevice, int, unsigned int*) = nullptr;          // MHz
  bool ready = false;
};

template <typename F>
bool find(void* library, const char* name, F& function) {
  function = reinterpret_cast<F>(dlsym(library, name));
  return function != nullptr;
}

// Loaded and initialised on first use; the library stays loaded for the process (NVML is never shut down: readings
// may come until exit).
const Nvml& nvml() {
  static const Nvml loaded = [] {
    Nvml n;
    void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return n;
    n.ready = find(library, "nvmlInit_v2", n.init) &&
              find(library, "nvmlDeviceGetHandleByPciBusId_v2", n.handle_by_pci_bus_id) &&
              find(library, "nvmlDeviceGetTotalEnergyConsumption", n.total_energy) &&
              find(library, "nvmlDeviceGetEnforcedPowerLimit", n.power_limit) &&
              find(library, "nvmlDeviceGetClockInfo", n.clock) && n.init() == kNvmlSuccess;
    return n;
  }();
  return loaded;
}

}  // namespace

std::optional<GpuPowerReading> read_gpu_power() {
  if (!is_setup()) return std::nullopt;
  const Nvml& n = nvml();
  if (!n.ready) return std::nullopt;
  int device = -1;
  char bus_id[32] = {};
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) != cudaSuccess)
    return std::nullopt;
  NvmlDevice handle = nullptr;
  unsigned long long millijoules = 0;
  if (n.handle_by_pci_bus_id(bus_id, &handle) != kNvmlSuccess || n.total_energy(handle, &millijoules) != kNvmlSuccess)
    return std::nullopt;
  GpuPowerReading reading;
  reading.energy_joules = static_cast<double>(millijoules) * 1e-3;
  unsigned int milliwatts = 0, mhz = 0;
  if (n.power_limit(handle, &milliwatts) == kNvmlSuccess) reading.power_limit_watts = milliwatts * 1e-3;
  if (n.clock(handle, kNvmlClockSm, &mhz) == kNvmlSuccess) reading.sm_clock_mhz = static_cast<int>(mhz);
  return reading;
}

#else

std::optional<GpuPowerReading> read_gpu_power() { return std::nullopt; }

#endif

}  // namespace moetrain::ops::cuda

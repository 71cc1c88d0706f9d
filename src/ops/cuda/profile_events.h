// defines: the CUDA events behind ops::OpScope, taken from a free list so a profiled step does not
// create thousands of events.
#pragma once

#include "core/device.h"

namespace moetrain::ops::cuda {

// Records an event on `stream` and returns it (a cudaEvent_t as void*).
void* record_profile_event(const Stream& stream);
// Waits for `stop`, returns the seconds from `start` to `stop`, and recycles both events.
double profile_event_seconds(void* start, void* stop);

}  // namespace moetrain::ops::cuda

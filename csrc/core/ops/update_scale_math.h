#pragma once
// The dynamic loss-scale update rule, shared by the CPU and CUDA kernels of
// optamp::update_scale_ (host and device code).
//
// torch.amp.GradScaler's rule plus Megatron-style hysteresis and Apex's [min, max] clamp:
//   overflow:  growth_tracker = 0; hysteresis_tracker -= 1 (not below 0);
//              when it reaches 0: scale = max(scale * backoff, min_scale)
//   no overflow: growth_tracker += 1; when it reaches growth_interval:
//              growth_tracker = 0; hysteresis_tracker = hysteresis;
//              scale = min(scale * growth, max_scale) if that product is finite.
// Products are formed in double and rounded to float once, as torch's CPU kernel does.
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace amp::ops::detail {

C10_HOST_DEVICE inline void update_scale_math(float* scale, int32_t* growth_tracker,
                                              int32_t* hysteresis_tracker, float found_inf,
                                              double growth_factor, double backoff_factor,
                                              int64_t growth_interval, int64_t hysteresis,
                                              double min_scale, double max_scale) {
  if (found_inf != 0.0f) {
    *growth_tracker = 0;
    int32_t h = *hysteresis_tracker - 1;
    if (h < 0) h = 0;
    *hysteresis_tracker = h;
    if (h == 0) {
      const float backed_off = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
      *scale =
          backed_off < static_cast<float>(min_scale) ? static_cast<float>(min_scale) : backed_off;
    }
  } else {
    const int32_t successful = *growth_tracker + 1;
    if (successful >= growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
#ifdef __CUDA_ARCH__
      const bool finite = isfinite(grown);
#else
      const bool finite = std::isfinite(grown);
#endif
      if (finite) {
        *scale = grown > static_cast<float>(max_scale) ? static_cast<float>(max_scale) : grown;
      }
      *growth_tracker = 0;
      *hysteresis_tracker = static_cast<int32_t>(hysteresis);
    } else {
      *growth_tracker = successful;
    }
  }
}

}  // namespace amp::ops::detail

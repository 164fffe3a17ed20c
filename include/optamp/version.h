#pragma once
#include "optamp/export.h"

namespace amp {

constexpr int kVersionMajor = 0;
constexpr int kVersionMinor = 1;
constexpr int kVersionPatch = 0;
// "0.1.0"
OPTAMP_API const char* version();

}  // namespace amp

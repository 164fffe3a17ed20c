#include "optamp/version.h"

namespace amp {

const char* version() { return "0.1.0"; }

}  // namespace amp

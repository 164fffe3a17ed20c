#include "optamp/version.h"

namespace amp {

const char* version() { return OPTAMP_VERSION; }

}  // namespace amp

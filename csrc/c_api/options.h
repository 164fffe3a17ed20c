#pragma once
// The C API's options: Apex's names as key/value strings, read with the spellings the Python
// front accepts (python/bindings/opt_level.cpp), into amp::Options.

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "optamp/c_api.h"
#include "optamp/opt_level.h"

namespace amp::c_api {

// keys[i] = values[i]; a NULL value is "not overridden". Throws c10::ValueError naming the key
// (and its index) for an unknown or repeated key or a value it cannot read; NULL arrays or keys
// are the caller's to refuse first.
Options options_from_strings(const char* const* keys, const char* const* values, size_t count);

// optamp_dtype <-> c10::ScalarType. from_c_dtype throws a ValueError naming `arg` for a value
// outside the enum; to_c_dtype maps types outside it to OPTAMP_DTYPE_UNDEFINED.
c10::ScalarType from_c_dtype(int dtype, const char* arg);
optamp_dtype to_c_dtype(c10::ScalarType type);

}  // namespace amp::c_api

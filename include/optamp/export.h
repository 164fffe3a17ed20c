#pragma once
// OPTAMP_API marks what liboptamp exports. The library is built with hidden visibility, so
// everything else (amp::detail, the kernels, the dispatcher glue) stays internal: a consumer can
// link only against the public API in include/optamp/.
#if defined(_WIN32)
#if defined(OPTAMP_BUILDING_LIBRARY)
#define OPTAMP_API __declspec(dllexport)
#else
#define OPTAMP_API __declspec(dllimport)
#endif
#else
#define OPTAMP_API __attribute__((visibility("default")))
#endif

#pragma once
// The library's AVX-512 vector loops under SIMDe's emulation of the intrinsics, runnable on any
// x86-64 CPU (avx512_emulated.cpp).
#include "ops/cpu/cpu_kernels.h"

namespace amp::test {

// False where the build found no SIMDe headers (Debian: libsimde-dev, which scripts/bootstrap.sh
// installs); the kernels are then empty.
bool emulated_avx512_available();

template <typename T>
ops::detail::cpu::Kernels<T> emulated_avx512_kernels();

}  // namespace amp::test

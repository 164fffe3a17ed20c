#include "ops/cpu/cpu_isa.h"

#include <c10/util/Exception.h>

#include <strings.h>
#include <atomic>
#include <cstdlib>

#if OPTAMP_CPU_X86
#include <cpuid.h>
#endif

namespace amp::ops::detail::cpu {
namespace {

constexpr Isa kIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512};

// -1 until the first kernel call reads OPTAMP_CPU_ISA (or set_cpu_isa runs).
std::atomic<int> g_isa{-1};

#if OPTAMP_CPU_X86
// F16C (the fp16 <-> fp32 conversions the AVX2 kernels use), read from CPUID leaf 1 because
// Clang before 16 rejects "f16c" in __builtin_cpu_supports at compile time.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

Isa detect_best_isa() {
#if OPTAMP_CPU_X86
  // __builtin_cpu_supports also checks that the OS saves the vector registers (XCR0), which
  // F16C, a VEX encoding, needs as AVX does.
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  if (avx2 && __builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

Isa best_isa() {
  static const Isa best = detect_best_isa();
  return best;
}

Isa capped_isa(const char* cap, Isa best) {
  if (cap == nullptr || *cap == '\0') return best;
  for (Isa isa : kIsas) {
    if (strcasecmp(cap, isa_name(isa)) == 0) return isa < best ? isa : best;
  }
  TORCH_CHECK_VALUE(false,
                    "OPTAMP_CPU_ISA: expected one of scalar, avx2, avx512 (the widest "
                    "instruction set the CPU kernels may use), got '",
                    cap, "'");
}

Isa cpu_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    // Throws on every call while the variable names no instruction set.
    const int from_env = static_cast<int>(capped_isa(std::getenv("OPTAMP_CPU_ISA"), best_isa()));
    g_isa.compare_exchange_strong(isa, from_env, std::memory_order_relaxed);
    isa = g_isa.load(std::memory_order_relaxed);
  }
  return static_cast<Isa>(isa);
}

void set_cpu_isa(Isa isa) {
  TORCH_CHECK_VALUE(isa <= best_isa(), "set_cpu_isa: isa must be one this CPU can run (at most ",
                    isa_name(best_isa()), "), got ", isa_name(isa));
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace amp::ops::detail::cpu

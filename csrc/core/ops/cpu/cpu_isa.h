#pragma once
// Which instruction set the CPU multi-tensor kernels use, picked at run time.
//
// The library is built for baseline x86-64, so one binary runs on every x86-64 CPU; the vector
// paths are compiled with function-level target attributes (vector_kernels.cpp) and taken only
// where the CPU has the instructions. By default the kernels use the widest path the CPU can run;
// OPTAMP_CPU_ISA=scalar|avx2|avx512 caps it (read on the first kernel call), and the tests switch
// paths with set_cpu_isa to hold each one to the scalar path.

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define OPTAMP_CPU_X86 1
#else
#define OPTAMP_CPU_X86 0
#endif

namespace amp::ops::detail::cpu {

// In increasing order: each path needs the instructions of the ones before it.
enum class Isa : int {
  kScalar = 0,  // ops/unscale_math.h per element; any CPU
  kAvx2 = 1,    // 8 lanes: AVX2, FMA (for the target only: nothing is fused), F16C
  kAvx512 = 2,  // 16 lanes: AVX-512F on top of kAvx2's
};

const char* isa_name(Isa isa);

// The widest path this CPU can run (kScalar where the build has no vector paths).
Isa best_isa();

// The path a cap leaves: the widest one not above `cap` (an OPTAMP_CPU_ISA value, compared
// ignoring case; nullptr or "" for none) that `best` allows. Throws on an unknown name.
Isa capped_isa(const char* cap, Isa best);

// The path the kernels take now: capped_isa(getenv("OPTAMP_CPU_ISA"), best_isa()) until
// set_cpu_isa picks another.
Isa cpu_isa();

// Makes the kernels take `isa` (any thread, from the next call on). Throws if the CPU cannot run
// it.
void set_cpu_isa(Isa isa);

}  // namespace amp::ops::detail::cpu

#pragma once
// Registration of optamp's kernels on its dispatch key.
namespace amp::detail {

// Once per process: conflict check, the permanent fallthrough fallback, the built-in tables.
// Throws a c10::Error naming the conflict if another library owns the key.
void ensure_registered();

// Turns casting on/off for this thread (registers first when turning on).
void activate_thread(bool on);

}  // namespace amp::detail

# The C++ runtime check, run at configure time before anything is built.
#
# torch's libraries need the shared C++ runtime (libstdc++.so.6). A shared library that carries
# its own static copy of libstdc++ has a second set of locale and codecvt facets in the same
# process: formatting a double through an ostream in liboptamp then crashes (seen on a GPU machine
# whose default compiler, a site-built GCC, links libstdc++ statically into shared libraries; the
# same link follows from -static-libstdc++ in CMAKE_SHARED_LINKER_FLAGS / CMAKE_MODULE_LINKER_FLAGS).
#
# The probe links a tiny shared and module library exactly as liboptamp and optamp._C are linked
# (the compiler driver, CMAKE_CXX_FLAGS and the linker flags of each kind) and reads their NEEDED
# entries. When the runtime is not among them, configure stops with an error that names a
# compiler on this machine that links it shared (scripts/common.sh picks that one by itself).

# Where a refusal names the compiler that fixes it, for scripts/common.sh to configure again with
# (the C++ check removes it first; either check writes it).
set(OPTAMP_CXX_RUNTIME_FIX_FILE "${CMAKE_BINARY_DIR}/optamp_cxx_runtime_fix.txt")

# The C++ runtimes (libstdc++.so.*, libc++.so.*) among `library`'s NEEDED entries, read with
# `readelf` (also used by the ctest script cmake/OptampRuntimeTest.cmake).
function(optamp_needed_cxx_runtimes readelf library out_var)
  execute_process(COMMAND "${readelf}" -d "${library}" OUTPUT_VARIABLE dynamic
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "optamp: readelf -d failed on ${library}")
  endif()
  string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[(libstdc\\+\\+|libc\\+\\+)\\.so[^]]*\\]" needed
         "${dynamic}")
  set(runtimes "")
  foreach(entry IN LISTS needed)
    string(REGEX REPLACE ".*\\[([^]]+)\\].*" "\\1" name "${entry}")
    list(APPEND runtimes "${name}")
  endforeach()
  set(${out_var} "${runtimes}" PARENT_SCOPE)
endfunction()

# Writes the C++ runtime libraries that a shared library linked by `compiler` with `flags` needs
# into `out_var` ("" when it links none; "FAILED: <why>" when the probe could not link). Each
# compiler and flags are probed once per configure.
function(optamp_probe_cxx_runtime compiler flags out_var)
  separate_arguments(flag_list UNIX_COMMAND "${flags}")
  string(MD5 key "${compiler}|${flag_list}")
  get_property(known GLOBAL PROPERTY "optamp_cxx_runtime_${key}" SET)
  if(known)
    get_property(runtimes GLOBAL PROPERTY "optamp_cxx_runtime_${key}")
    set(${out_var} "${runtimes}" PARENT_SCOPE)
    return()
  endif()
  set(dir "${CMAKE_BINARY_DIR}/CMakeFiles/optamp_cxx_runtime")
  file(MAKE_DIRECTORY "${dir}")
  # An ostream formatting a double: the call that crashed, and certain to need libstdc++.
  file(WRITE "${dir}/probe.cpp" "#include <sstream>\n#include <string>\n"
       "std::string optamp_runtime_probe(double v) { std::ostringstream s; s << v; return s.str(); }\n")
  set(lib "${dir}/probe_${key}.so")
  execute_process(
    COMMAND "${compiler}" ${flag_list} -fPIC -shared "${dir}/probe.cpp" -o "${lib}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    optamp_needed_cxx_runtimes("${OPTAMP_READELF}" "${lib}" runtimes)
  else()
    set(runtimes "FAILED: ${out}")
  endif()
  set_property(GLOBAL PROPERTY "optamp_cxx_runtime_${key}" "${runtimes}")
  set(${out_var} "${runtimes}" PARENT_SCOPE)
endfunction()

# The first compiler among the usual system ones, other than `compiler`, that links the runtime
# shared with no extra flags ("" when none does).
function(optamp_find_shared_runtime_compiler compiler out_var)
  set(${out_var} "" PARENT_SCOPE)
  file(REAL_PATH "${compiler}" current)
  foreach(candidate /usr/bin/g++ /usr/bin/clang++ /usr/bin/c++)
    if(NOT EXISTS "${candidate}")
      continue()
    endif()
    file(REAL_PATH "${candidate}" real)
    if(real STREQUAL current)
      continue()
    endif()
    optamp_probe_cxx_runtime("${candidate}" "" runtimes)
    if(runtimes AND NOT runtimes MATCHES "^FAILED")
      set(${out_var} "${candidate}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()

function(optamp_check_cxx_runtime)
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR OPTAMP_SKIP_CXX_RUNTIME_CHECK)
    return()
  endif()
  find_program(OPTAMP_READELF NAMES readelf "${CMAKE_READELF}")
  if(NOT OPTAMP_READELF)
    message(WARNING "optamp: no readelf here, so the C++ runtime link was not checked")
    return()
  endif()
  file(REMOVE "${OPTAMP_CXX_RUNTIME_FIX_FILE}")
  string(TOUPPER "${CMAKE_BUILD_TYPE}" config)
  set(static_kinds "")
  foreach(kind SHARED MODULE)
    optamp_probe_cxx_runtime("${CMAKE_CXX_COMPILER}"
      "${CMAKE_CXX_FLAGS} ${CMAKE_${kind}_LINKER_FLAGS} ${CMAKE_${kind}_LINKER_FLAGS_${config}}"
      runtimes)
    if(runtimes MATCHES "^FAILED")
      message(WARNING "optamp: the C++ runtime probe did not link, so the runtime link was not "
                      "checked: ${runtimes}")
      return()
    endif()
    if(NOT runtimes)
      list(APPEND static_kinds "${kind}")
    endif()
  endforeach()
  if(NOT static_kinds)
    return()
  endif()
  string(REPLACE ";" " and " kinds "${static_kinds}")
  # Whose doing is it: the flags, or the compiler itself?
  optamp_probe_cxx_runtime("${CMAKE_CXX_COMPILER}" "" plain)
  if(plain AND NOT plain MATCHES "^FAILED")
    set(fix "remove -static-libstdc++ (or whatever links the runtime statically) from "
            "CMAKE_CXX_FLAGS / CMAKE_SHARED_LINKER_FLAGS / CMAKE_MODULE_LINKER_FLAGS: "
            "${CMAKE_CXX_COMPILER} links it shared without them")
  else()
    optamp_find_shared_runtime_compiler("${CMAKE_CXX_COMPILER}" other)
    if(other)
      # scripts/common.sh reconfigures with the compiler named in this file.
      file(WRITE "${OPTAMP_CXX_RUNTIME_FIX_FILE}" "${other}\n")
      set(fix "configure with a compiler that links it shared, found on this machine: "
              "-DCMAKE_CXX_COMPILER=${other} -DCMAKE_CUDA_HOST_COMPILER=${other} "
              "(scripts/common.sh switches to it by itself)")
    else()
      set(fix "configure with a compiler that links it shared (-DCMAKE_CXX_COMPILER=<the "
              "system's g++ or clang++>); none was found among /usr/bin/g++, clang++, c++")
    endif()
  endif()
  string(CONCAT fix ${fix})
  message(FATAL_ERROR
    "optamp: ${CMAKE_CXX_COMPILER} links the C++ runtime (libstdc++) statically into ${kinds} "
    "libraries (CMAKE_CXX_FLAGS='${CMAKE_CXX_FLAGS}', CMAKE_SHARED_LINKER_FLAGS="
    "'${CMAKE_SHARED_LINKER_FLAGS}', CMAKE_MODULE_LINKER_FLAGS='${CMAKE_MODULE_LINKER_FLAGS}'). "
    "torch uses the shared libstdc++.so.6, and a second, static copy in liboptamp or optamp._C "
    "crashes the process (e.g. when a message formats a number). To fix it, ${fix}. "
    "(-DOPTAMP_SKIP_CXX_RUNTIME_CHECK=ON skips this check.)")
endfunction()

# The CUDA host compiler to use: the one named (-DCMAKE_CUDA_HOST_COMPILER, CUDAHOSTCXX), else a
# GCC C++ compiler (cmake/OptampTorch.cmake says why not nvcc's default), else "" (nvcc's default:
# a Clang C++ compiler may be newer than nvcc supports as its host; the check below then guards
# the runtime).
function(optamp_chosen_cuda_host_compiler out_var)
  if(NOT "${CMAKE_CUDA_HOST_COMPILER}" STREQUAL "")
    set(${out_var} "${CMAKE_CUDA_HOST_COMPILER}" PARENT_SCOPE)
  elseif(NOT "$ENV{CUDAHOSTCXX}" STREQUAL "")
    set(${out_var} "$ENV{CUDAHOSTCXX}" PARENT_SCOPE)
  elseif(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    set(${out_var} "${CMAKE_CXX_COMPILER}" PARENT_SCOPE)
  else()
    set(${out_var} "" PARENT_SCOPE)
  endif()
endfunction()

# A CUDA host compiler other than the C++ compiler must link the runtime shared as well: CMake puts
# its link directories on liboptamp's link line, so a static libstdc++.a found there comes in.
# With none named, nvcc's default is checked: the g++ first on PATH.
function(optamp_check_cuda_host_cxx_runtime)
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR OPTAMP_SKIP_CXX_RUNTIME_CHECK OR NOT OPTAMP_READELF)
    return()
  endif()
  set(host "${CMAKE_CUDA_HOST_COMPILER}")
  if(host STREQUAL "")
    find_program(nvcc_default_host NAMES g++ NO_CACHE)
    set(host "${nvcc_default_host}")
  endif()
  if(NOT host OR NOT IS_ABSOLUTE "${host}")
    return()
  endif()
  file(REAL_PATH "${host}" host_real)
  file(REAL_PATH "${CMAKE_CXX_COMPILER}" cxx_real)
  if(host_real STREQUAL cxx_real)
    return()
  endif()
  optamp_probe_cxx_runtime("${host}" "" runtimes)
  if(runtimes MATCHES "^FAILED")
    message(WARNING "optamp: the C++ runtime probe did not link with the CUDA host compiler "
                    "${host}, so its runtime link was not checked: ${runtimes}")
    return()
  elseif(runtimes)
    return()
  endif()
  optamp_find_shared_runtime_compiler("${host}" other)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR NOT other)
    set(other "${CMAKE_CXX_COMPILER}")
  endif()
  if(other STREQUAL CMAKE_CXX_COMPILER)
    # scripts/common.sh configures again with it (as C++ compiler too: the same one).
    file(WRITE "${OPTAMP_CXX_RUNTIME_FIX_FILE}" "${other}\n")
  endif()
  message(FATAL_ERROR
    "optamp: the CUDA host compiler ${host} (-DCMAKE_CUDA_HOST_COMPILER, else CUDAHOSTCXX, else "
    "the g++ first on PATH) links the C++ runtime (libstdc++) "
    "statically into shared libraries, and its link directories go onto liboptamp's link line, "
    "which would put a static copy into liboptamp (torch uses the shared libstdc++.so.6; two "
    "copies in one process crash). To fix it, configure with -DCMAKE_CUDA_HOST_COMPILER=${other}, "
    "which links it shared. (-DOPTAMP_SKIP_CXX_RUNTIME_CHECK=ON skips this check.)")
endfunction()

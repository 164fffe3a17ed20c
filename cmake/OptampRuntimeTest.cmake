# ctest scripts for the C++ runtime link (cmake/OptampCxxRuntime.cmake says why it matters).
#
#   -DMODE=needed -DOPTAMP_LIBRARIES="<liboptamp>;<optamp._C>" -DOPTAMP_TORCH_LIBRARY=<libc10.so>
#       every library NEEDs the C++ runtime torch's own library NEEDs, and none defines
#       libstdc++'s internals (what a static copy leaves behind).
#   -DMODE=refused -DOPTAMP_SOURCE_DIR=<repo> -DOPTAMP_WORK_DIR=<scratch> -DOPTAMP_CXX=<compiler>
#       [-DOPTAMP_CUDA=ON]
#       configuring with -static-libstdc++ in the shared and module linker flags stops with the
#       error that names the flags; a compiler that links the runtime statically by itself (a
#       wrapper that appends the flag, as a site-built GCC does) stops with the error that names a
#       compiler that does not, and scripts/common.sh then configures with that one. With
#       OPTAMP_CUDA, that compiler first on PATH (as the GPU machine's site-built GCC is) is not
#       nvcc's host compiler either: its link directories would bring the static runtime back.
find_program(READELF readelf REQUIRED)
find_program(NM nm REQUIRED)
include("${CMAKE_CURRENT_LIST_DIR}/OptampCxxRuntime.cmake")  # optamp_needed_cxx_runtimes

if(MODE STREQUAL "needed")
  optamp_needed_cxx_runtimes("${READELF}" "${OPTAMP_TORCH_LIBRARY}" torch_runtimes)
  if(NOT torch_runtimes)
    message(FATAL_ERROR "${OPTAMP_TORCH_LIBRARY} NEEDs no C++ runtime: cannot compare")
  endif()
  foreach(library IN LISTS OPTAMP_LIBRARIES)
    optamp_needed_cxx_runtimes("${READELF}" "${library}" ours)
    foreach(runtime IN LISTS torch_runtimes)
      list(FIND ours "${runtime}" at)
      if(at EQUAL -1)
        message(FATAL_ERROR "${library} does not NEED ${runtime} (it NEEDs '${ours}'), which "
                            "torch's ${OPTAMP_TORCH_LIBRARY} NEEDs: a static C++ runtime inside it?")
      endif()
    endforeach()
    # A static libstdc++ defines its own codecvt/locale internals (the crash's frames).
    execute_process(COMMAND "${NM}" -C --defined-only "${library}" OUTPUT_VARIABLE symbols)
    if(symbols MATCHES "std::(__cxx11::)?[a-z_]*codecvt[^\n]*::do_length")
      message(FATAL_ERROR "${library} defines libstdc++'s codecvt internals: a static copy of "
                          "the C++ runtime is linked into it")
    endif()
    message(STATUS "${library}: NEEDED ${ours}")
  endforeach()
  return()
endif()

if(NOT MODE STREQUAL "refused")
  message(FATAL_ERROR "MODE must be needed or refused, got '${MODE}'")
endif()

# Configure only as far as the runtime check (it runs before Torch is looked up): seconds.
function(configure_expecting_refusal name expect_regex)
  set(build "${OPTAMP_WORK_DIR}/${name}")
  file(REMOVE_RECURSE "${build}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S "${OPTAMP_SOURCE_DIR}" -B "${build}" ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "${name}: configure succeeded; expected the C++ runtime refusal")
  endif()
  if(NOT flat MATCHES "${expect_regex}")
    message(FATAL_ERROR "${name}: configure failed, but not with '${expect_regex}':\n${out}")
  endif()
  message(STATUS "${name}: refused as expected")
endfunction()

# scripts/common.sh's optamp_configure into `build`, with the environment entries given
# (`cmake -E env` arguments); the test fails when it does not configure. Its output: `out_var`.
function(configure_with_script build out_var)
  file(REMOVE_RECURSE "${build}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env ${ARGN} "OPTAMP_BUILD_DIR=${build}"
            "OPTAMP_PYTHON=${OPTAMP_PYTHON}"
            bash -c "source '${OPTAMP_SOURCE_DIR}/scripts/common.sh' && optamp_configure"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "scripts/common.sh did not configure (environment: ${ARGN}):\n${out}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# The C++ compiler a configured build directory uses.
function(cached_cxx_compiler build out_var)
  file(STRINGS "${build}/CMakeCache.txt" used REGEX "^CMAKE_CXX_COMPILER:")
  string(REGEX REPLACE "^[^=]*=" "" used "${used}")
  set(${out_var} "${used}" PARENT_SCOPE)
endfunction()

configure_expecting_refusal(static_flags
  "links the C\\+\\+ runtime \\(libstdc\\+\\+\\) statically into SHARED and MODULE libraries.*remove -static-libstdc\\+\\+"
  -DCMAKE_CXX_COMPILER=${OPTAMP_CXX}
  -DCMAKE_SHARED_LINKER_FLAGS=-static-libstdc++ -DCMAKE_MODULE_LINKER_FLAGS=-static-libstdc++)
configure_expecting_refusal(static_module_only
  "statically into MODULE libraries" -DCMAKE_CXX_COMPILER=${OPTAMP_CXX}
  -DCMAKE_MODULE_LINKER_FLAGS=-static-libstdc++)

# A compiler that links the runtime statically by itself.
set(wrapper "${OPTAMP_WORK_DIR}/static-runtime-g++")
file(WRITE "${wrapper}" "#!/bin/sh\nexec \"${OPTAMP_CXX}\" \"$@\" -static-libstdc++\n")
file(CHMOD "${wrapper}" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
configure_expecting_refusal(static_compiler
  "found on this machine: -DCMAKE_CXX_COMPILER=/" -DCMAKE_CXX_COMPILER=${wrapper})
file(READ "${OPTAMP_WORK_DIR}/static_compiler/optamp_cxx_runtime_fix.txt" named)
string(STRIP "${named}" named)
if(NOT EXISTS "${named}")
  message(FATAL_ERROR "the refusal named '${named}', which does not exist")
endif()
message(STATUS "static_compiler: the refusal names ${named}")

# scripts/common.sh repairs it: it configures again with the compiler the refusal named.
set(build "${OPTAMP_WORK_DIR}/script_repair")
configure_with_script("${build}" out "CXX=${wrapper}"
  "OPTAMP_CMAKE_ARGS=-DOPTAMP_BUILD_TESTS=OFF -DOPTAMP_BUILD_EXAMPLES=OFF -DOPTAMP_WITH_CUDA=OFF")
cached_cxx_compiler("${build}" used)
string(FIND "${out}" "configuring with ${named} instead" said)
if(NOT used STREQUAL named OR said EQUAL -1)
  message(FATAL_ERROR "scripts/common.sh: expected a configure with ${named} (and a line saying "
                      "so), got '${used}':\n${out}")
endif()
file(REMOVE_RECURSE "${build}")
message(STATUS "scripts/common.sh configured with ${named} instead of the static-runtime compiler")

# The GPU machine's case: the static-runtime compiler is the g++ and c++ first on PATH, which nvcc
# takes as its host compiler unless told otherwise. The CUDA host compiler must be the one the
# refusal named as well (CMake puts the host compiler's link directories on liboptamp's link line).
if(NOT OPTAMP_CUDA)
  return()
endif()
set(site "${OPTAMP_WORK_DIR}/site-gcc/bin")
file(MAKE_DIRECTORY "${site}")
foreach(name g++ c++)
  file(COPY_FILE "${wrapper}" "${site}/${name}")
  file(CHMOD "${site}/${name}" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
endforeach()
# scripts/common.sh with the environment entries given must configure with `named` as the C++ and
# the CUDA host compiler (as CMake's CUDA detection recorded it).
function(expect_repaired_cuda_host name)
  set(build "${OPTAMP_WORK_DIR}/${name}")
  configure_with_script("${build}" out ${ARGN}
    "OPTAMP_CMAKE_ARGS=-DOPTAMP_BUILD_TESTS=OFF -DOPTAMP_BUILD_EXAMPLES=OFF -DOPTAMP_WITH_CUDA=ON")
  file(GLOB detected "${build}/CMakeFiles/*/CMakeCUDACompiler.cmake")
  file(STRINGS "${detected}" host REGEX "^set\\(CMAKE_CUDA_HOST_COMPILER ")
  string(REGEX REPLACE "^[^\"]*\"([^\"]*)\".*" "\\1" host "${host}")
  cached_cxx_compiler("${build}" used)
  if(NOT used STREQUAL named OR NOT host STREQUAL named)
    message(FATAL_ERROR "${name} (${ARGN}): expected ${named} as the C++ and the CUDA host "
                        "compiler, got '${used}' and '${host}':\n${out}")
  endif()
  file(REMOVE_RECURSE "${build}")
  message(STATUS "${name}: C++ and CUDA host compiler ${named}")
endfunction()
expect_repaired_cuda_host(script_repair_cuda --unset=CXX --unset=CUDAHOSTCXX "PATH=${site}:$ENV{PATH}")
# The GPU machine also exports CUDAHOSTCXX naming that g++ (its fourth run), which CMake's detection
# takes over -DCMAKE_CUDA_HOST_COMPILER unless the configure overrides it.
expect_repaired_cuda_host(script_repair_cudahostcxx --unset=CXX "CUDAHOSTCXX=${site}/g++"
  "PATH=${site}:$ENV{PATH}")
# The C++ compiler links the runtime shared; only CUDAHOSTCXX names a static one.
expect_repaired_cuda_host(script_repair_cudahostcxx_only "CXX=${named}" "CUDAHOSTCXX=${site}/g++"
  "PATH=${site}:$ENV{PATH}")

# A Clang C++ compiler keeps nvcc's default host compiler (the g++ first on PATH): that one is
# probed too, and refused when it links the runtime statically, naming one that does not.
find_program(clangxx NAMES clang++ NO_CACHE)
if(clangxx)
  set(path "$ENV{PATH}")
  set(ENV{PATH} "${site}:${path}")
  unset(ENV{CUDAHOSTCXX})
  configure_expecting_refusal(clang_with_static_host
    "the CUDA host compiler ${site}/g\\+\\+ .*links the C\\+\\+ runtime .*-DCMAKE_CUDA_HOST_COMPILER=/"
    -DCMAKE_CXX_COMPILER=${clangxx} -DPython3_EXECUTABLE=${OPTAMP_PYTHON}
    -DOPTAMP_BUILD_TESTS=OFF -DOPTAMP_BUILD_EXAMPLES=OFF -DOPTAMP_WITH_CUDA=ON)
  set(ENV{PATH} "${path}")
  file(REMOVE_RECURSE "${OPTAMP_WORK_DIR}/clang_with_static_host")
endif()
file(REMOVE_RECURSE "${OPTAMP_WORK_DIR}/site-gcc")

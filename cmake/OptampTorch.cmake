# Locate Python and LibTorch through the chosen interpreter (torch.utils.cmake_prefix_path), and
# decide whether the CUDA kernels are built (OPTAMP_WITH_CUDA=AUTO/ON/OFF).
if(OPTAMP_BUILD_PYTHON)
  find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
else()
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
endif()

execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
          "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _optamp_torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _optamp_torch_rc)
if(NOT _optamp_torch_rc EQUAL 0)
  message(FATAL_ERROR "optamp: ${Python3_EXECUTABLE} cannot import torch. Run scripts/bootstrap.sh "
                      "or pass -DPython3_EXECUTABLE=<python with torch>.")
endif()
string(REPLACE "\n" ";" _optamp_torch_info "${_optamp_torch_info}")
list(GET _optamp_torch_info 0 OPTAMP_TORCH_CMAKE_PREFIX)
list(LENGTH _optamp_torch_info _len)
set(OPTAMP_TORCH_CUDA_VERSION "")
if(_len GREATER 1)
  list(GET _optamp_torch_info 1 OPTAMP_TORCH_CUDA_VERSION)
endif()
list(APPEND CMAKE_PREFIX_PATH "${OPTAMP_TORCH_CMAKE_PREFIX}")

# CUDA decision. AUTO: on when nvcc is found and torch itself was built with CUDA.
set(OPTAMP_HAVE_CUDA OFF)
if(NOT OPTAMP_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  # The CUDA host compiler is the one named (-DCMAKE_CUDA_HOST_COMPILER, CUDAHOSTCXX), else the C++
  # compiler when it is GCC, not nvcc's default (the first g++ on PATH). CMake puts the host
  # compiler's link directories on liboptamp's link line: where that g++ is another toolchain
  # whose directories hold only a static libstdc++.a (a site-built GCC), liboptamp got a static
  # C++ runtime although the C++ compiler links it shared. (A Clang C++ compiler keeps nvcc's
  # default, which may be the only host nvcc supports; the check after enable_language guards it.)
  # And check_language(CUDA) replaces a host compiler named with -D by the one its scratch
  # project found (unless nvcc is named too), so set it again after it.
  # CMake's own detection takes CUDAHOSTCXX over -DCMAKE_CUDA_HOST_COMPILER (the GPU machine
  # exports CUDAHOSTCXX=/opt/gcc/bin/g++, a static-runtime g++), so the environment carries the
  # choice, into check_language's scratch project as well.
  optamp_chosen_cuda_host_compiler(_optamp_cuda_host)
  if(NOT _optamp_cuda_host STREQUAL "")
    set(ENV{CUDAHOSTCXX} "${_optamp_cuda_host}")
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER AND NOT _optamp_cuda_host STREQUAL "")
    unset(CMAKE_CUDA_HOST_COMPILER)  # the normal variable check_language leaves
    set(CMAKE_CUDA_HOST_COMPILER "${_optamp_cuda_host}" CACHE FILEPATH "CUDA host compiler" FORCE)
  endif()
  if(CMAKE_CUDA_COMPILER AND OPTAMP_TORCH_CUDA_VERSION)
    set(OPTAMP_HAVE_CUDA ON)
  elseif(OPTAMP_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "optamp: OPTAMP_WITH_CUDA=ON but nvcc='${CMAKE_CUDA_COMPILER}' and "
                        "torch CUDA='${OPTAMP_TORCH_CUDA_VERSION}'; both are needed")
  endif()
endif()
if(OPTAMP_HAVE_CUDA)
  # Hopper (H100/H200) and Ampere by default; one architecture per entry doubles compile time.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "80;90")
  endif()
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0")
  endif()
  enable_language(CUDA)
  optamp_check_cuda_host_cxx_runtime()
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
endif()

find_package(Torch REQUIRED)
message(STATUS "optamp: Torch ${Torch_VERSION} from ${Torch_DIR}; torch CUDA '${OPTAMP_TORCH_CUDA_VERSION}'")

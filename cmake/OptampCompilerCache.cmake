# Use ccache when it is installed: LibTorch headers make every translation unit slow to compile.
find_program(OPTAMP_CCACHE_PROGRAM ccache)
if(OPTAMP_CCACHE_PROGRAM AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${OPTAMP_CCACHE_PROGRAM}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${OPTAMP_CCACHE_PROGRAM}")
  message(STATUS "optamp: using ccache (${OPTAMP_CCACHE_PROGRAM})")
endif()

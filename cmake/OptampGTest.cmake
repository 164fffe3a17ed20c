# GoogleTest for the suite: found, or built from sources; and the one discovery call, shared by
# tests/cpp and tests/cmake_compat (which checks it under Debian's CMake and PyPI's newest).

# GTest::gtest from an installed GTest, or from the sources in OPTAMP_GTEST_SOURCE_DIR (default:
# Debian's /usr/src/googletest, e.g. carried to a machine without network).
macro(optamp_find_gtest)
  find_package(GTest CONFIG QUIET)
  if(NOT TARGET GTest::gtest)
    find_package(GTest MODULE QUIET)
  endif()
  if(NOT TARGET GTest::gtest)
    if(NOT OPTAMP_GTEST_SOURCE_DIR AND EXISTS /usr/src/googletest/CMakeLists.txt)
      set(OPTAMP_GTEST_SOURCE_DIR /usr/src/googletest)
    endif()
    if(NOT OPTAMP_GTEST_SOURCE_DIR)
      message(FATAL_ERROR "optamp: no GoogleTest found. Install libgtest-dev, or pass "
                          "-DOPTAMP_GTEST_SOURCE_DIR=<googletest sources>, or -DOPTAMP_BUILD_TESTS=OFF")
    endif()
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory("${OPTAMP_GTEST_SOURCE_DIR}" "${CMAKE_BINARY_DIR}/_deps/googletest"
                     EXCLUDE_FROM_ALL)
    add_library(GTest::gtest ALIAS gtest)
  endif()
  include(GoogleTest)
endmacro()

# One ctest per GoogleTest test: one process each keeps tests independent (thread-local state,
# registrations); the discovery runs the binary once at build time.
# GTEST_SKIP (the *_CUDA tests without a GPU) shows as "Not Run" / skipped, not as passed:
# gtest_discover_tests sets that SKIP_REGULAR_EXPRESSION itself (CMake 3.22 and later). Passing it
# again in PROPERTIES broke CMake 4.x, which writes property values as [[...]] brackets: a value
# ending in "]" closes the bracket early, the generated file is a syntax error and ctest runs 0
# tests. Values given here must not contain "]".
function(optamp_discover_tests target)
  gtest_discover_tests(${target} DISCOVERY_TIMEOUT 120 PROPERTIES TIMEOUT 300)
endfunction()

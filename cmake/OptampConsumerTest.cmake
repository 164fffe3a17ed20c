# ctest script: build examples/cpp/consumer with find_package(optamp) and run the result.
#   OPTAMP_PACKAGE_FROM=install (default): against optamp installed into a scratch prefix.
#   OPTAMP_PACKAGE_FROM=build-tree: against the build directory itself (optamp_DIR), uninstalled.
set(prefix "${OPTAMP_WORK_DIR}/prefix")
set(build "${OPTAMP_WORK_DIR}/build")

function(run_step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}")
  endif()
endfunction()

# Configure, build and run the consumer; the arguments tell CMake where optamp is.
function(build_and_run_consumer)
  file(REMOVE_RECURSE "${build}")
  # The consumer is built with optamp's compiler: where the default one links libstdc++
  # statically, optamp was configured with another (cmake/OptampCxxRuntime.cmake), and so is the
  # consumer, as a user of that machine would.
  run_step(${CMAKE_COMMAND} -S "${OPTAMP_CONSUMER_DIR}" -B "${build}" -G "${OPTAMP_CMAKE_GENERATOR}"
           ${ARGN} -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=${OPTAMP_CXX_COMPILER}")
  run_step(${CMAKE_COMMAND} --build "${build}")
  run_step("${build}/optamp_consumer")
endfunction()

if(OPTAMP_PACKAGE_FROM STREQUAL "build-tree")
  build_and_run_consumer("-Doptamp_DIR=${OPTAMP_BINARY_DIR}" "-DCMAKE_PREFIX_PATH=${OPTAMP_TORCH_PREFIX}")
  return()
endif()

file(REMOVE_RECURSE "${prefix}")
run_step(${CMAKE_COMMAND} --install "${OPTAMP_BINARY_DIR}" --prefix "${prefix}")
# The package must be relocatable: build against a copy of the prefix somewhere else.
set(moved "${OPTAMP_WORK_DIR}/moved")
file(REMOVE_RECURSE "${moved}")
file(COPY "${prefix}/" DESTINATION "${moved}")
file(REMOVE_RECURSE "${prefix}")
file(GLOB_RECURSE exported "${moved}/*.cmake")
foreach(f IN LISTS exported)
  file(READ "${f}" text)
  foreach(machine_path "${OPTAMP_BINARY_DIR}" "libc10.so" "libnvrtc")
    string(FIND "${text}" "${machine_path}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${f} names a path of the build machine (${machine_path})")
    endif()
  endforeach()
endforeach()
build_and_run_consumer("-DCMAKE_PREFIX_PATH=${moved};${OPTAMP_TORCH_PREFIX}")

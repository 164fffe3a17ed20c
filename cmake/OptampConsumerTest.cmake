# ctest script: install optamp into a scratch prefix, build examples/cpp/consumer against it
# with find_package(optamp), and run the result.
set(prefix "${OPTAMP_WORK_DIR}/prefix")
set(build "${OPTAMP_WORK_DIR}/build")
file(REMOVE_RECURSE "${prefix}")

function(run_step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}")
  endif()
endfunction()

run_step(${CMAKE_COMMAND} --install "${OPTAMP_BINARY_DIR}" --prefix "${prefix}")
run_step(${CMAKE_COMMAND} -S "${OPTAMP_CONSUMER_DIR}" -B "${build}" -G "${OPTAMP_CMAKE_GENERATOR}"
         "-DCMAKE_PREFIX_PATH=${prefix};${OPTAMP_TORCH_PREFIX}" -DCMAKE_BUILD_TYPE=Release)
run_step(${CMAKE_COMMAND} --build "${build}")
run_step("${build}/optamp_consumer")

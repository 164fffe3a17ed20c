# ctest script: liboptamp exports its public API and nothing of amp::detail (hidden visibility
# with OPTAMP_API on the declarations in include/optamp/). -DOPTAMP_LIBRARY=<path to the .so>.
find_program(OPTAMP_NM nm REQUIRED)
execute_process(COMMAND "${OPTAMP_NM}" -DC --defined-only "${OPTAMP_LIBRARY}"
                OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nm failed on ${OPTAMP_LIBRARY}")
endif()
string(REPLACE "\n" ";" lines "${symbols}")
set(internal "")
foreach(line IN LISTS lines)
  # "<address> <type> <name>": a function or object defined in amp::detail (not a template of
  # another library instantiated over one of our types).
  if(line MATCHES "^[0-9a-f]+ [TtDdBbRrVvWw] amp::detail::")
    list(APPEND internal "${line}")
  endif()
endforeach()
if(internal)
  list(JOIN internal "\n  " shown)
  message(FATAL_ERROR "liboptamp exports internal symbols:\n  ${shown}")
endif()
foreach(required "amp::initialize(" "amp::core::initialize(" "amp::core::scale_loss("
                 "amp::LossScaler::" "amp::autocast::autocast(" "amp::resolve(")
  string(FIND "${symbols}" "${required}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "liboptamp does not export ${required}...")
  endif()
endforeach()
message(STATUS "liboptamp exports the public API only")

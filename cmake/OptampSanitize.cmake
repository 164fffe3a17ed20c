# OPTAMP_SANITIZE: build optamp and its tests with a sanitizer, for the concurrency and memory
# checks of scripts/sanitize.sh (docs/testing.md).
#   thread   ThreadSanitizer
#   address  AddressSanitizer + UndefinedBehaviorSanitizer
# LibTorch itself is not instrumented: the checks cover optamp's code and the LibTorch header
# code inlined into it. Python bindings are not built (an instrumented extension module needs
# the sanitizer runtime preloaded into the interpreter).
set(OPTAMP_SANITIZE "" CACHE STRING "Sanitizer build: thread, address (ASan+UBSan) or empty")
set_property(CACHE OPTAMP_SANITIZE PROPERTY STRINGS "" thread address)

if(OPTAMP_SANITIZE STREQUAL "thread")
  set(OPTAMP_SANITIZE_FLAGS -fsanitize=thread)
elseif(OPTAMP_SANITIZE STREQUAL "address")
  set(OPTAMP_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined)
elseif(NOT OPTAMP_SANITIZE STREQUAL "")
  message(FATAL_ERROR "OPTAMP_SANITIZE must be thread, address or empty, got '${OPTAMP_SANITIZE}'")
endif()

if(OPTAMP_SANITIZE_FLAGS)
  foreach(flag IN LISTS OPTAMP_SANITIZE_FLAGS ITEMS -fno-omit-frame-pointer -g)
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:${flag}>)
  endforeach()
  add_link_options(${OPTAMP_SANITIZE_FLAGS})
  if(OPTAMP_BUILD_PYTHON)
    message(STATUS "optamp: OPTAMP_SANITIZE=${OPTAMP_SANITIZE} turns the Python bindings off")
    set(OPTAMP_BUILD_PYTHON OFF CACHE BOOL "" FORCE)
  endif()
endif()

# Warnings for the project's own targets (not for nanobind or CUDA headers).
function(flashdl_set_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
    # GCC's -Wpsabi notes that a vector-returning function's ABI depends on the instruction set:
    # the CPU kernels are compiled once per instruction set, each copy's functions internal to it.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-psabi>)
    endif()
  elseif(MSVC)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:/W3>)
  endif()
endfunction()

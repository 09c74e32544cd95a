# The CPU kernels are one source compiled once per instruction set, each copy in its own namespace
# with its own target pragma;
# the backend picks the best one the running CPU supports, so a wheel built here runs on any x86-64.
# Also sets FLASHDL_CPU_ISAS, the copies compiled (widest first), for the tests.
function(flashdl_cpu_isa_sources out_var)
  set(_dir ${CMAKE_CURRENT_SOURCE_DIR}/src/cpu)
  set(_sources ${_dir}/isa_generic.cpp)
  set(_isas generic)
  set(_is_x86 OFF)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i[3-6]86)$")
    set(_is_x86 ON)
  endif()
  if(_is_x86 AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    list(APPEND _sources ${_dir}/isa_avx2.cpp ${_dir}/isa_avx512.cpp ${_dir}/isa_avx512bf16.cpp)
    # The target is switched on by a pragma inside each file, after its headers (see
    # kernels_deps.hpp); here only a * b + c may become one FMA instruction.
    set_source_files_properties(${_dir}/isa_avx2.cpp ${_dir}/isa_avx512.cpp
      ${_dir}/isa_avx512bf16.cpp PROPERTIES
      COMPILE_OPTIONS "-ffp-contract=fast")
    set_property(SOURCE ${_dir}/backend.cpp APPEND PROPERTY COMPILE_DEFINITIONS FLASHDL_X86_ISAS=1)
    set(_isas avx512bf16 avx512 avx2 generic)
  endif()
  set(${out_var} ${_sources} PARENT_SCOPE)
  set(FLASHDL_CPU_ISAS ${_isas} PARENT_SCOPE)
endfunction()

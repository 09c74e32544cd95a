# The CPU kernels are one source compiled once per instruction set, each copy in its own namespace
# with its own target pragma; the backend picks the best one the running CPU supports, so a wheel
# built here runs on any x86-64. Each copy's translation unit is generated from
# src/cpu/isa.cpp.in into the build tree.
# Also sets FLASHDL_CPU_ISAS, the copies compiled (widest first), for the tests.

# One copy: isa_<name>.cpp for the comma-separated target features `target` (empty: the baseline,
# no pragma), appended to the list named by out_var.
function(_flashdl_cpu_isa_copy out_var name description target vec_bytes have_f16c have_bf16_dot)
  set(FLASHDL_ISA ${name})
  set(FLASHDL_ISA_DESCRIPTION "${description}")
  set(FLASHDL_ISA_TARGET "${target}")
  set(FLASHDL_ISA_VEC_BYTES ${vec_bytes})
  set(FLASHDL_ISA_HAVE_F16C ${have_f16c})
  set(FLASHDL_ISA_HAVE_BF16_DOT ${have_bf16_dot})
  if(target STREQUAL "")
    set(FLASHDL_ISA_TARGETED 0)
    set(FLASHDL_ISA_SUPPORTED "true")
  else()
    # The running CPU has every feature the copy is compiled for.
    set(FLASHDL_ISA_TARGETED 1)
    string(REPLACE "," ";" _features "${target}")
    set(_checks "")
    foreach(_f IN LISTS _features)
      list(APPEND _checks "__builtin_cpu_supports(\"${_f}\")")
    endforeach()
    list(JOIN _checks " && " FLASHDL_ISA_SUPPORTED)
  endif()
  set(_out ${CMAKE_CURRENT_BINARY_DIR}/generated/cpu/isa_${name}.cpp)
  configure_file(${PROJECT_SOURCE_DIR}/src/cpu/isa.cpp.in ${_out} @ONLY)
  set(${out_var} ${${out_var}} ${_out} PARENT_SCOPE)
endfunction()

function(flashdl_cpu_isa_sources out_var)
  set(_sources "")
  _flashdl_cpu_isa_copy(_sources generic
    "the baseline instruction set (SSE2 on x86-64, NEON on ARM)" "" 16 0 0)
  set(_isas generic)
  set(_is_x86 OFF)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i[3-6]86)$")
    set(_is_x86 ON)
  endif()
  if(_is_x86 AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    set(_x86 "")
    _flashdl_cpu_isa_copy(_x86 avx2 "avx2, fma and f16c" "avx2,fma,f16c" 32 1 0)
    _flashdl_cpu_isa_copy(_x86 avx512 "avx512f, bw, vl and dq, avx2, fma and f16c"
      "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c" 64 1 0)
    _flashdl_cpu_isa_copy(_x86 avx512bf16
      "avx512f, bw, vl, dq and bf16, avx2, fma and f16c, with the bfloat16 products of bf16dot.inl"
      "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c" 64 1 1)
    # The target is switched on by a pragma inside each file, after its headers (see
    # kernels_deps.hpp); here only a * b + c may become one FMA instruction.
    set_source_files_properties(${_x86} PROPERTIES COMPILE_OPTIONS "-ffp-contract=fast")
    set_property(SOURCE ${PROJECT_SOURCE_DIR}/src/cpu/backend.cpp APPEND PROPERTY
      COMPILE_DEFINITIONS FLASHDL_X86_ISAS=1)
    list(APPEND _sources ${_x86})
    set(_isas avx512bf16 avx512 avx2 generic)
  endif()
  set(${out_var} ${_sources} PARENT_SCOPE)
  set(FLASHDL_CPU_ISAS ${_isas} PARENT_SCOPE)
endfunction()

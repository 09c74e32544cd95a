# CUDA detection. FLASHDL_CUDA = AUTO builds the CUDA backend when nvcc is found; ON requires it;
# OFF skips it; EMULATE compiles the CUDA backend's sources with the C++ compiler against flashdl's
# CUDA host emulator (tests/cuda_emulator), so that the CUDA C++ tests run its kernels on the CPU.
# Architectures default to 80;90 (never "native": it fails on a machine with no GPU);
# CMAKE_CUDA_ARCHITECTURES or the CUDAARCHS environment variable override them.
include(CheckLanguage)

set(FLASHDL_WITH_CUDA OFF)
set(FLASHDL_CUDA_EMULATOR OFF)
string(TOUPPER "${FLASHDL_CUDA}" _flashdl_cuda)
if(NOT _flashdl_cuda MATCHES "^(AUTO|ON|OFF|EMULATE)$")
  message(FATAL_ERROR "FLASHDL_CUDA must be AUTO, ON, OFF or EMULATE, got '${FLASHDL_CUDA}'")
endif()

if(_flashdl_cuda STREQUAL "EMULATE")
  if(FLASHDL_BUILD_PYTHON)
    message(FATAL_ERROR "FLASHDL_CUDA=EMULATE builds the C++ tests against the CUDA host emulator; "
                        "configure it with -DFLASHDL_BUILD_PYTHON=OFF")
  endif()
  set(FLASHDL_WITH_CUDA ON)
  set(FLASHDL_CUDA_EMULATOR ON)
  message(STATUS "flashdl: CUDA backend ON, compiled for the host emulator (no GPU code)")
  # With AddressSanitizer every access outside a device allocation or a block's shared memory is
  # reported exactly (the emulator's memcheck).
  option(FLASHDL_EMU_ASAN "Build the emulated tree with AddressSanitizer" OFF)
  if(FLASHDL_EMU_ASAN)
    add_compile_options(-fsanitize=address -fno-omit-frame-pointer)
    add_link_options(-fsanitize=address)
  endif()
elseif(NOT _flashdl_cuda STREQUAL "OFF")
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(FLASHDL_WITH_CUDA ON)
  elseif(_flashdl_cuda STREQUAL "ON")
    message(FATAL_ERROR "FLASHDL_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER "
                        "or put nvcc on PATH)")
  else()
    message(STATUS "flashdl: no CUDA compiler found, building the CPU backend only")
  endif()
endif()

if(FLASHDL_WITH_CUDA AND NOT FLASHDL_CUDA_EMULATOR)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    if(DEFINED ENV{CUDAARCHS})
      set(CMAKE_CUDA_ARCHITECTURES "$ENV{CUDAARCHS}")
    else()
      set(CMAKE_CUDA_ARCHITECTURES "80;90")
    endif()
  endif()
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "flashdl: CUDA backend ON, architectures ${CMAKE_CUDA_ARCHITECTURES}")
endif()

# What the CUDA backend and its tests link: the CUDA runtime, or the emulator, which stands in for it.
if(FLASHDL_CUDA_EMULATOR)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/../tests/cuda_emulator ${CMAKE_BINARY_DIR}/cuda_emulator)
  set(FLASHDL_CUDA_RUNTIME flashdl::cuda_emulator)
elseif(FLASHDL_WITH_CUDA)
  set(FLASHDL_CUDA_RUNTIME CUDA::cudart_static)
endif()

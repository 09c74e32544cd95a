# CUDA detection. FLASHDL_CUDA = AUTO builds the CUDA backend when nvcc is found; ON requires it;
# OFF skips it. Architectures default to 80;90 (never "native": it fails on a machine with no GPU);
# CMAKE_CUDA_ARCHITECTURES or the CUDAARCHS environment variable override them.
include(CheckLanguage)

set(FLASHDL_WITH_CUDA OFF)
string(TOUPPER "${FLASHDL_CUDA}" _flashdl_cuda)
if(NOT _flashdl_cuda MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "FLASHDL_CUDA must be AUTO, ON or OFF, got '${FLASHDL_CUDA}'")
endif()

if(NOT _flashdl_cuda STREQUAL "OFF")
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

if(FLASHDL_WITH_CUDA)
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

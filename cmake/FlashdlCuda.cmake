# CUDA detection. FLASHDL_CUDA = AUTO builds the CUDA backend where a GPU can use it: nvcc is
# found and so are an NVIDIA driver and device (nvidia-smi lists a GPU, or the kernel driver shows
# one); nvcc alone is not enough, since compiling the kernels is most of the build's time. ON
# requires nvcc and builds it GPU or not (wheels, CI); OFF skips it; EMULATE compiles the CUDA backend's sources with the C++ compiler against flashdl's
# CUDA host emulator (tests/cuda_emulator), so that the CUDA C++ tests run its kernels on the CPU.
# Architectures default to 80;90 (never "native": it fails on a machine with no GPU);
# CMAKE_CUDA_ARCHITECTURES or the CUDAARCHS environment variable override them.
include(CheckLanguage)

# Whether this machine can run CUDA code: <out> TRUE or FALSE, <why> what was found, in words.
# nvidia-smi answers first (it lists the GPUs the driver sees); without it, the kernel driver's
# /proc entries and device nodes.
function(flashdl_find_gpu out why)
  find_program(_flashdl_nvidia_smi nvidia-smi)
  if(_flashdl_nvidia_smi)
    execute_process(COMMAND ${_flashdl_nvidia_smi} -L RESULT_VARIABLE _rc OUTPUT_VARIABLE _gpus
                    ERROR_QUIET TIMEOUT 20)
    if(_rc EQUAL 0 AND _gpus MATCHES "GPU [0-9]+:")
      string(REGEX MATCHALL "GPU [0-9]+:" _list "${_gpus}")
      list(LENGTH _list _n)
      set(${out} TRUE PARENT_SCOPE)
      set(${why} "${_n} GPU(s) listed by nvidia-smi" PARENT_SCOPE)
    else()
      set(${out} FALSE PARENT_SCOPE)
      set(${why} "nvidia-smi lists no GPU" PARENT_SCOPE)
    endif()
    return()
  endif()
  file(GLOB _gpus /proc/driver/nvidia/gpus/*)
  file(GLOB _nodes /dev/nvidia[0-9]*)
  if(_gpus OR _nodes)
    set(${out} TRUE PARENT_SCOPE)
    set(${why} "an NVIDIA GPU shown by the kernel driver" PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
    set(${why} "no NVIDIA driver or GPU (no nvidia-smi, no /proc/driver/nvidia/gpus)" PARENT_SCOPE)
  endif()
endfunction()

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
  set(FLASHDL_CUDA_REASON "FLASHDL_CUDA=EMULATE")
  message(STATUS "flashdl: CUDA backend ON, compiled for the host emulator (no GPU code)")
  # With AddressSanitizer every access outside a device allocation or a block's shared memory is
  # reported exactly (the emulator's memcheck).
  option(FLASHDL_EMU_ASAN "Build the emulated tree with AddressSanitizer" OFF)
  if(FLASHDL_EMU_ASAN)
    add_compile_options(-fsanitize=address -fno-omit-frame-pointer)
    add_link_options(-fsanitize=address)
  endif()
elseif(_flashdl_cuda STREQUAL "OFF")
  set(FLASHDL_CUDA_REASON "FLASHDL_CUDA=OFF, FLASHDL_CUDA=ON builds it")
else()
  check_language(CUDA)
  if(_flashdl_cuda STREQUAL "ON")
    if(NOT CMAKE_CUDA_COMPILER)
      message(FATAL_ERROR "FLASHDL_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER "
                          "or put nvcc on PATH)")
    endif()
    set(FLASHDL_WITH_CUDA ON)
    set(FLASHDL_CUDA_REASON "FLASHDL_CUDA=ON")
  elseif(NOT CMAKE_CUDA_COMPILER)
    set(FLASHDL_CUDA_REASON
        "FLASHDL_CUDA=AUTO: no CUDA compiler found, put nvcc on PATH and rebuild to build it")
  else()
    flashdl_find_gpu(_flashdl_gpu _flashdl_gpu_why)
    if(_flashdl_gpu)
      set(FLASHDL_WITH_CUDA ON)
      set(FLASHDL_CUDA_REASON "FLASHDL_CUDA=AUTO: nvcc and ${_flashdl_gpu_why}")
    else()
      set(FLASHDL_CUDA_REASON
          "FLASHDL_CUDA=AUTO: nvcc found but ${_flashdl_gpu_why}, FLASHDL_CUDA=ON builds it anyway")
    endif()
  endif()
endif()
if(NOT FLASHDL_WITH_CUDA)
  # One line, first in the configure output (pip install -v shows it; python -m flashdl and
  # flashdl.info()["cuda_status"] repeat it).
  message(STATUS "flashdl: CUDA backend OFF, CPU only (${FLASHDL_CUDA_REASON})")
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
  message(STATUS "flashdl: CUDA backend ON, architectures ${CMAKE_CUDA_ARCHITECTURES} "
                 "(${FLASHDL_CUDA_REASON})")
endif()

# What the CUDA backend and its tests link: the CUDA runtime, or the emulator, which stands in for it.
if(FLASHDL_CUDA_EMULATOR)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/../tests/cuda_emulator ${CMAKE_BINARY_DIR}/cuda_emulator)
  set(FLASHDL_CUDA_RUNTIME flashdl::cuda_emulator)
elseif(FLASHDL_WITH_CUDA)
  set(FLASHDL_CUDA_RUNTIME CUDA::cudart_static)
endif()

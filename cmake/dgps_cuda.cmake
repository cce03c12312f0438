# @brief The CUDA backend (dgps::cuda): option DGPS_WITH_CUDA, on by default when nvcc is found.
#
# Included from the top-level CMakeLists.txt after the `dgps` target exists. Builds cuda/ (the
# compiled library, static CUDA runtime), tests/cuda and bench/cuda. The library target is appended
# to DGPS_INSTALL_TARGETS so cmake/dgps_install.cmake exports it as dgps::cuda.

include(CheckLanguage)
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "CUDA compiler")
endif()
check_language(CUDA)
set(_dgps_cuda_default OFF)
if(CMAKE_CUDA_COMPILER)
  find_program(_dgps_nvcc_found NAMES "${CMAKE_CUDA_COMPILER}" NO_CACHE)
  if(EXISTS "${CMAKE_CUDA_COMPILER}" OR _dgps_nvcc_found)
    set(_dgps_cuda_default ON)
  endif()
endif()
option(DGPS_WITH_CUDA "Build the CUDA backend dgps::cuda (needs nvcc)" ${_dgps_cuda_default})
# Machine code for Hopper (sm_90a: wgmma/TMA allowed) plus a portable sm_80 build with its PTX.
set(DGPS_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a;-gencode=arch=compute_80,code=[sm_80,compute_80]"
    CACHE STRING "nvcc -gencode flags of the CUDA backend")

set(DGPS_HAS_CUDA OFF)
if(DGPS_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "DGPS_WITH_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER)")
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/../cuda ${CMAKE_BINARY_DIR}/cuda)
  set(DGPS_HAS_CUDA ON)
  list(APPEND DGPS_INSTALL_TARGETS dgps_cuda)
  if(DGPS_BUILD_TESTS)
    enable_testing()
    add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/../tests/cuda ${CMAKE_BINARY_DIR}/tests/cuda)
  endif()
  if(DGPS_BUILD_BENCH)
    add_subdirectory(${CMAKE_CURRENT_LIST_DIR}/../bench/cuda ${CMAKE_BINARY_DIR}/bench/cuda)
  endif()
endif()
message(STATUS "dgps: CUDA ${DGPS_HAS_CUDA}")

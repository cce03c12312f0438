# @brief Cross-compiling for 64-bit ARM Linux with Debian's GCC cross compiler (g++-aarch64-linux-gnu).
#
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake
#
# The binaries run on an aarch64 machine, or here under qemu-user (qemu-aarch64 -L /usr/aarch64-linux-gnu; CMake's
# CMAKE_CROSSCOMPILING_EMULATOR makes ctest do that). Libraries come from the aarch64 sysroot
# (/usr/aarch64-linux-gnu and multiarch arm64 packages); the header-only dependencies (xsimd, doctest, Eigen) are
# taken from the build machine's packages: their headers do not depend on the architecture.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

set(DGPS_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${DGPS_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${DGPS_CROSS_TRIPLE}-g++)
set(DGPS_CROSS_SYSROOT /usr/${DGPS_CROSS_TRIPLE})

# Libraries and programs of the target from the sysroot (and multiarch arm64 packages under /usr/lib/aarch64-linux-gnu);
# packages may also come from the build machine (only header-only ones are found there: the x86 library packages
# live under /usr/lib/x86_64-linux-gnu, which the aarch64 library architecture does not search).
set(CMAKE_FIND_ROOT_PATH ${DGPS_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# Header-only packages whose CMake files Debian installs under the build machine's library directory (xsimd).
if(NOT DEFINED xsimd_DIR)
  file(GLOB _dgps_xsimd_dirs /usr/lib/*-linux-gnu*/cmake/xsimd /usr/lib/cmake/xsimd /usr/share/cmake/xsimd)
  if(_dgps_xsimd_dirs)
    list(GET _dgps_xsimd_dirs 0 _dgps_xsimd_dir)
    set(xsimd_DIR ${_dgps_xsimd_dir} CACHE PATH "xsimd's CMake package (header-only, from the build machine)")
  endif()
endif()

# The build machine's /usr/include (header-only packages) after the cross compiler's own headers, never before
# them: the compiler then lists it among its implicit include directories and CMake drops -isystem /usr/include.
set(CMAKE_CXX_FLAGS_INIT "-idirafter /usr/include")
set(CMAKE_C_FLAGS_INIT "-idirafter /usr/include")

# ctest and add_test run the aarch64 binaries under qemu-user when it is installed.
find_program(DGPS_QEMU_AARCH64 qemu-aarch64 qemu-aarch64-static)
if(DGPS_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${DGPS_QEMU_AARCH64};-L;${DGPS_CROSS_SYSROOT})
endif()

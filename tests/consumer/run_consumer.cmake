# @brief cmake -P driver of the consumer test: install the dgps build, build tests/consumer/project against it, run it.
#
# Variables (-D): BUILD_DIR (the dgps build tree), CONFIG (its configuration), PREFIX (a scratch install prefix),
# SOURCE (the consumer project), WORK (its build tree), GENERATOR, MAKE_PROGRAM, CXX (compiler), CXX_FLAGS,
# EXPECT_CUDA (ON when dgps::cuda was built), CHECK_PATHS (build/source paths that must not leak into the install),
# EXPECT_DYNAMIC (ON when dgps::dynamic was built), SHARED (ON for BUILD_SHARED_LIBS), VERSION, NEXT_MINOR (a version
# the package must refuse), SOVERSION.
cmake_minimum_required(VERSION 3.22)

foreach(var BUILD_DIR CONFIG PREFIX SOURCE WORK GENERATOR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()

function(step what)
  message(STATUS "consumer: ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer: '${what}' failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE ${PREFIX} ${WORK})
step("install into ${PREFIX}" ${CMAKE_COMMAND} --install ${BUILD_DIR} --config ${CONFIG} --prefix ${PREFIX})

# The installed package must not point back into the build or source tree.
file(GLOB_RECURSE installed_cmake ${PREFIX}/*.cmake)
if(NOT installed_cmake)
  message(FATAL_ERROR "consumer: no CMake package files were installed under ${PREFIX}")
endif()
foreach(f IN LISTS installed_cmake)
  file(READ ${f} text)
  string(REPLACE "${PREFIX}" "<prefix>" text "${text}")
  foreach(p IN LISTS CHECK_PATHS)
    string(FIND "${text}" "${p}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "consumer: ${f} refers to the build/source path ${p}")
    endif()
  endforeach()
endforeach()

set(make_program)
if(MAKE_PROGRAM)
  set(make_program -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
step("configure ${SOURCE}" ${CMAKE_COMMAND} -S ${SOURCE} -B ${WORK} -G ${GENERATOR} ${make_program}
     -DCMAKE_CXX_COMPILER=${CXX} "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" -DCMAKE_BUILD_TYPE=${CONFIG}
     -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON -DDGPS_EXPECT_CUDA=${EXPECT_CUDA}
     -DDGPS_EXPECT_DYNAMIC=${EXPECT_DYNAMIC} -DDGPS_VERSION=${VERSION} -DDGPS_NEXT_MINOR=${NEXT_MINOR})
step("build" ${CMAKE_COMMAND} --build ${WORK} --config ${CONFIG})
find_program(app NAMES app PATHS ${WORK} ${WORK}/${CONFIG} NO_DEFAULT_PATH REQUIRED)
step("run ${app}" ${app})

# pkg-config: the same program built from the flags of the installed dgps.pc (and dgps-dynamic.pc).
find_program(PKG_CONFIG NAMES pkg-config pkgconf)
if(PKG_CONFIG)
  file(GLOB_RECURSE pc_files ${PREFIX}/dgps.pc)
  list(LENGTH pc_files n_pc)
  if(NOT n_pc EQUAL 1)
    message(FATAL_ERROR "consumer: expected one installed dgps.pc, found '${pc_files}'")
  endif()
  get_filename_component(pc_dir ${pc_files} DIRECTORY)
  set(pc_modules dgps)
  set(pc_defs -DDGPS_CONSUMER_DYNAMIC=0)
  if(EXPECT_DYNAMIC)
    set(pc_modules dgps-dynamic dgps)
    set(pc_defs -DDGPS_CONSUMER_DYNAMIC=1)
  endif()
  set(ENV{PKG_CONFIG_PATH} ${pc_dir})
  execute_process(COMMAND ${PKG_CONFIG} --modversion dgps OUTPUT_VARIABLE pc_version OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT pc_version STREQUAL VERSION)
    message(FATAL_ERROR "consumer: pkg-config --modversion dgps gave '${pc_version}' (${rc}), expected ${VERSION}")
  endif()
  execute_process(COMMAND ${PKG_CONFIG} --cflags ${pc_modules} OUTPUT_VARIABLE pc_cflags
                  OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  execute_process(COMMAND ${PKG_CONFIG} --libs ${pc_modules} OUTPUT_VARIABLE pc_libs OUTPUT_STRIP_TRAILING_WHITESPACE
                  COMMAND_ERROR_IS_FATAL ANY)
  message(STATUS "consumer: pkg-config ${pc_modules}: ${pc_cflags} ${pc_libs}")
  separate_arguments(pc_cflags UNIX_COMMAND "${pc_cflags}")
  separate_arguments(pc_libs UNIX_COMMAND "${pc_libs}")
  separate_arguments(cxx_flags UNIX_COMMAND "${CXX_FLAGS}")
  set(rpath)
  if(SHARED)
    string(REGEX MATCH "-L[^ ;]+" libdir_flag "${pc_libs}")
    string(SUBSTRING "${libdir_flag}" 2 -1 pc_libdir)
    set(rpath -Wl,-rpath,${pc_libdir})
  endif()
  step("build with pkg-config" ${CXX} -std=c++20 -O2 ${cxx_flags} ${pc_defs} ${pc_cflags} ${SOURCE}/main.cpp
       -o ${WORK}/app_pkgconfig ${pc_libs} ${rpath})
  step("run ${WORK}/app_pkgconfig" ${WORK}/app_pkgconfig)
else()
  message(STATUS "consumer: pkg-config not found; dgps.pc not tested")
endif()

# A shared build: the versioned SONAME, and only the DGPS_API entry points exported.
if(SHARED)
  file(GLOB_RECURSE so_files ${PREFIX}/libdgps_cpu_kernels.so)
  find_program(READELF NAMES readelf REQUIRED)
  execute_process(COMMAND ${READELF} -d --wide ${so_files} OUTPUT_VARIABLE dyn COMMAND_ERROR_IS_FATAL ANY)
  string(FIND "${dyn}" "Library soname: [libdgps_cpu_kernels.so.${SOVERSION}]" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "consumer: ${so_files} has no SONAME libdgps_cpu_kernels.so.${SOVERSION}:\n${dyn}")
  endif()
  execute_process(COMMAND ${READELF} --dyn-syms --wide -C ${so_files} OUTPUT_VARIABLE syms COMMAND_ERROR_IS_FATAL ANY)
  string(REGEX MATCHALL "[^\n]* GLOBAL +DEFAULT +[0-9]+ [^\n]*" exported "${syms}")
  set(unexpected)
  foreach(line IN LISTS exported)
    if(NOT line MATCHES "dgps::cpu::kernels::(isa_name|chunkwise_forward|chunkwise_backward|exact_backward|decode|[a-z0-9]+::table)\\(|dgps::Error|for dgps::Error")
      list(APPEND unexpected "${line}")
    endif()
  endforeach()
  list(LENGTH exported n_exported)
  message(STATUS "consumer: ${so_files}: SONAME libdgps_cpu_kernels.so.${SOVERSION}, ${n_exported} exported symbols")
  if(unexpected)
    string(REPLACE ";" "\n" unexpected "${unexpected}")
    message(FATAL_ERROR "consumer: internals exported by ${so_files}:\n${unexpected}")
  endif()
endif()

if(EXPECT_CUDA)
  find_program(app_cuda NAMES app_cuda PATHS ${WORK} ${WORK}/${CONFIG} NO_DEFAULT_PATH REQUIRED)
  step("run ${app_cuda}" ${app_cuda})
endif()

# @brief cmake -P driver of the consumer test: install the dgps build, build tests/consumer/project against it, run it.
#
# Variables (-D): BUILD_DIR (the dgps build tree), CONFIG (its configuration), PREFIX (a scratch install prefix),
# SOURCE (the consumer project), WORK (its build tree), GENERATOR, MAKE_PROGRAM, CXX (compiler), CXX_FLAGS,
# EXPECT_CUDA (ON when dgps::cuda was built), CHECK_PATHS (build/source paths that must not leak into the install).
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
     -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON -DDGPS_EXPECT_CUDA=${EXPECT_CUDA})
step("build" ${CMAKE_COMMAND} --build ${WORK} --config ${CONFIG})
find_program(app NAMES app PATHS ${WORK} ${WORK}/${CONFIG} NO_DEFAULT_PATH REQUIRED)
step("run ${app}" ${app})
if(EXPECT_CUDA)
  find_program(app_cuda NAMES app_cuda PATHS ${WORK} ${WORK}/${CONFIG} NO_DEFAULT_PATH REQUIRED)
  step("run ${app_cuda}" ${app_cuda})
endif()

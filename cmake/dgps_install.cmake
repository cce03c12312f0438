# @brief cmake --install rules: headers, targets exported as dgps::<name>, dgpsConfig.cmake and its version file,
# dgps.pc for pkg-config.
#
# DGPS_INSTALL_TARGETS is the list of targets installed and exported (namespace dgps::, name = the target's
# EXPORT_NAME). It always holds dgps (dgps::dgps) and dgps_dynamic (dgps::dynamic), and dgps_cuda (dgps::cuda) when
# that target exists. Other CMake files add their own targets either from the top-level scope with
#   list(APPEND DGPS_INSTALL_TARGETS my_target)
# or from a subdirectory (where a plain variable would not reach this file) with
#   set_property(GLOBAL APPEND PROPERTY DGPS_INSTALL_TARGETS my_target)
# Project targets that an installed target links (e.g. the CPU kernel library linked into dgps) are added
# automatically, so the export set is always complete. Link dependencies on imported targets become
# find_dependency() calls in dgpsConfig.cmake (Threads, TBB, xsimd, Eigen3, CUDAToolkit).
# Components: every exported target except dgps itself (`dynamic`, `cuda`), requested with
# find_package(dgps CONFIG REQUIRED COMPONENTS dynamic).
include(CMakePackageConfigHelpers)

set(DGPS_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/dgps CACHE STRING "Where dgpsConfig.cmake is installed")

if(TARGET dgps_cuda)
  set_target_properties(dgps_cuda PROPERTIES EXPORT_NAME cuda)
endif()

# _dgps_link_items(<target> <out>): the targets and names in <target>'s INTERFACE_LINK_LIBRARIES, with
# $<LINK_ONLY:...> unwrapped, $<BUILD_INTERFACE:...> dropped (never exported) and aliases resolved.
function(_dgps_link_items tgt out)
  get_target_property(libs ${tgt} INTERFACE_LINK_LIBRARIES)
  set(items)
  if(libs)
    foreach(lib IN LISTS libs)
      if(lib MATCHES "^\\$<LINK_ONLY:([^$<>]+)>$")
        set(lib "${CMAKE_MATCH_1}")
      endif()
      if(lib MATCHES "\\$<|^-" OR NOT TARGET "${lib}")
        continue()
      endif()
      get_target_property(aliased "${lib}" ALIASED_TARGET)
      if(aliased)
        set(lib "${aliased}")
      endif()
      list(APPEND items "${lib}")
    endforeach()
  endif()
  set(${out} ${items} PARENT_SCOPE)
endfunction()

# _dgps_closure(<out-project-targets> <out-imported-targets> <targets>...): everything the given project targets
# link, transitively: the project's own targets and the imported targets they reach.
function(_dgps_closure out_project out_imported)
  set(todo ${ARGN})
  set(seen)
  set(imported)
  while(todo)
    list(POP_FRONT todo tgt)
    if(tgt IN_LIST seen)
      continue()
    endif()
    list(APPEND seen ${tgt})
    _dgps_link_items(${tgt} deps)
    foreach(dep IN LISTS deps)
      get_target_property(is_imported ${dep} IMPORTED)
      if(is_imported)
        list(APPEND imported ${dep})
      else()
        list(APPEND todo ${dep})
      endif()
    endforeach()
  endwhile()
  list(REMOVE_DUPLICATES imported)
  set(${out_project} ${seen} PARENT_SCOPE)
  set(${out_imported} ${imported} PARENT_SCOPE)
endfunction()

# _dgps_find_dependency_lines(<out> <indent> <imported targets>...): find_dependency() calls for imported targets.
function(_dgps_find_dependency_lines out indent)
  set(packages)
  foreach(dep IN LISTS ARGN)
    if(dep MATCHES "^Threads::")
      list(APPEND packages Threads)
    elseif(dep MATCHES "^TBB::")
      list(APPEND packages TBB)
    elseif(dep MATCHES "^xsimd$")
      list(APPEND packages xsimd)
    elseif(dep MATCHES "^Eigen3::")
      list(APPEND packages Eigen3)
    elseif(dep MATCHES "^CUDA::")
      list(APPEND packages CUDAToolkit)
    else()
      message(WARNING "dgps install: no find_dependency() known for the linked imported target '${dep}'; "
                      "add it to cmake/dgps_install.cmake")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES packages)
  set(lines "")
  foreach(pkg IN LISTS packages)
    string(APPEND lines "${indent}find_dependency(${pkg})\n")
    if(pkg STREQUAL "xsimd")
      # xsimd 8.1's package makes its consumers link a nonexistent -lxtl (DESIGN.md): drop it.
      string(APPEND lines "${indent}if(TARGET xsimd AND NOT TARGET xtl)\n"
                          "${indent}  get_target_property(_dgps_l xsimd INTERFACE_LINK_LIBRARIES)\n"
                          "${indent}  if(_dgps_l)\n"
                          "${indent}    list(REMOVE_ITEM _dgps_l xtl)\n"
                          "${indent}    set_target_properties(xsimd PROPERTIES INTERFACE_LINK_LIBRARIES \"\${_dgps_l}\")\n"
                          "${indent}  endif()\n"
                          "${indent}endif()\n")
    endif()
  endforeach()
  set(${out} "${lines}" PARENT_SCOPE)
endfunction()

get_property(_dgps_extra_targets GLOBAL PROPERTY DGPS_INSTALL_TARGETS)
list(PREPEND DGPS_INSTALL_TARGETS dgps)
if(TARGET dgps_dynamic)
  list(APPEND DGPS_INSTALL_TARGETS dgps_dynamic)
endif()
if(TARGET dgps_cuda)
  list(APPEND DGPS_INSTALL_TARGETS dgps_cuda)
endif()
list(APPEND DGPS_INSTALL_TARGETS ${_dgps_extra_targets})
list(REMOVE_DUPLICATES DGPS_INSTALL_TARGETS)

# The CUDA target's own dependencies (CUDAToolkit) are looked for only when the `cuda` component is asked for, so
# that a CUDA-enabled install still works for consumers without a CUDA toolkit.
set(_dgps_core_roots ${DGPS_INSTALL_TARGETS})
list(REMOVE_ITEM _dgps_core_roots dgps_cuda)
_dgps_closure(_dgps_core_targets _dgps_core_imported ${_dgps_core_roots})
set(_dgps_all_targets ${_dgps_core_targets})
set(_dgps_cuda_imported)
if(TARGET dgps_cuda)
  _dgps_closure(_dgps_cuda_targets _dgps_cuda_imported dgps_cuda)
  list(APPEND _dgps_all_targets ${_dgps_cuda_targets})
  list(REMOVE_DUPLICATES _dgps_all_targets)
  if(_dgps_core_imported)
    list(REMOVE_ITEM _dgps_cuda_imported ${_dgps_core_imported})
  endif()
endif()
if(dgps_project_flags IN_LIST _dgps_all_targets)
  message(WARNING "dgps install: an installed target links dgps_project_flags; wrap it in $<BUILD_INTERFACE:...> "
                  "so that warning and sanitizer flags are not exported")
endif()

set(DGPS_CONFIG_DEPENDENCIES "")
_dgps_find_dependency_lines(DGPS_CONFIG_DEPENDENCIES "" ${_dgps_core_imported})
set(DGPS_CONFIG_CUDA_DEPENDENCIES "")
_dgps_find_dependency_lines(DGPS_CONFIG_CUDA_DEPENDENCIES "    " ${_dgps_cuda_imported})

set(DGPS_COMPONENTS)
foreach(tgt IN LISTS _dgps_all_targets)
  get_target_property(name ${tgt} EXPORT_NAME)
  if(NOT name)
    set(name ${tgt})
  endif()
  if(NOT name STREQUAL "dgps")
    list(APPEND DGPS_COMPONENTS ${name})
  endif()
endforeach()
message(STATUS "dgps install: targets ${_dgps_all_targets}; components ${DGPS_COMPONENTS}")

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dgps DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")
install(TARGETS ${_dgps_all_targets} EXPORT dgpsTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        OBJECTS DESTINATION ${CMAKE_INSTALL_LIBDIR}/dgps-objects)
install(EXPORT dgpsTargets NAMESPACE dgps:: FILE dgpsTargets.cmake DESTINATION ${DGPS_INSTALL_CMAKEDIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dgpsConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/dgpsConfig.cmake INSTALL_DESTINATION ${DGPS_INSTALL_CMAKEDIR})
# While the major version is 0 a minor release may break the API: only the same major.minor is compatible.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_dgps_compatibility SameMinorVersion)
else()
  set(_dgps_compatibility SameMajorVersion)
endif()
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dgpsConfigVersion.cmake VERSION ${PROJECT_VERSION}
                                 COMPATIBILITY ${_dgps_compatibility})
install(FILES ${PROJECT_BINARY_DIR}/dgpsConfig.cmake ${PROJECT_BINARY_DIR}/dgpsConfigVersion.cmake
        DESTINATION ${DGPS_INSTALL_CMAKEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})

# pkg-config: dgps.pc (the headers, the CPU kernels and their dependencies) and, with dgps::dynamic, dgps-dynamic.pc.
# The prefix is relative to the .pc file, so the installed tree can move.
set(DGPS_PKGCONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig CACHE STRING "Where dgps.pc is installed")
file(RELATIVE_PATH _dgps_pc_to_prefix /_dgps/${DGPS_PKGCONFIG_DIR} /_dgps)
string(REGEX REPLACE "/$" "" _dgps_pc_to_prefix "${_dgps_pc_to_prefix}")
set(DGPS_PC_CFLAGS "")
set(DGPS_PC_REQUIRES "")
if(DGPS_HAS_TBB)
  string(APPEND DGPS_PC_CFLAGS " -DDGPS_HAS_TBB=1")
  set(DGPS_PC_REQUIRES "tbb")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/dgps.pc.in ${PROJECT_BINARY_DIR}/dgps.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/dgps.pc DESTINATION ${DGPS_PKGCONFIG_DIR})
if(TARGET dgps_dynamic)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/dgps-dynamic.pc.in ${PROJECT_BINARY_DIR}/dgps-dynamic.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/dgps-dynamic.pc DESTINATION ${DGPS_PKGCONFIG_DIR})
endif()

# The `dgps` command-line tool (examples/), when built: installed, not exported.
if(TARGET dgps_tool)
  install(TARGETS dgps_tool RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

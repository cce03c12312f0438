# @brief Shared-library properties of the compiled dgps libraries (BUILD_SHARED_LIBS=ON).
#
# dgps_shared_library_properties(<target>): when <target> is a shared library, only the symbols marked DGPS_API
# (include/dgps/export.hpp) are exported (-fvisibility=hidden -fvisibility-inlines-hidden), and the library gets
# VERSION = the project version and SOVERSION = <major>.<minor> while the major version is 0 (a minor release may
# break the ABI), <major> from 1.0 on. Static libraries are left as they are.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(DGPS_SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
else()
  set(DGPS_SOVERSION ${PROJECT_VERSION_MAJOR})
endif()

function(dgps_shared_library_properties tgt)
  get_target_property(type ${tgt} TYPE)
  if(type STREQUAL "SHARED_LIBRARY")
    set_target_properties(${tgt} PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${DGPS_SOVERSION}
                                            CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  endif()
endfunction()

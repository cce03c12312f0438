# @brief vcpkg overlay portfile of dgps: builds the checkout this port lives in (or a git commit) and installs it.
#
# Overlay use, from any vcpkg root:  vcpkg install dgps[tbb,tools] --overlay-ports=<dgps checkout>/cmake/ports
# The sources are the checkout that holds this port (cmake/ports/dgps/../../..). To build a published commit
# instead, set DGPS_GIT_URL and DGPS_GIT_REF (a full commit hash) in the environment and list both in
# VCPKG_KEEP_ENV_VARS so that vcpkg passes them through.
if(DEFINED ENV{DGPS_GIT_URL})
  vcpkg_from_git(OUT_SOURCE_PATH SOURCE_PATH URL "$ENV{DGPS_GIT_URL}" REF "$ENV{DGPS_GIT_REF}")
else()
  get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
endif()

# dgps::dynamic and the CPU kernels are static libraries; dgps::dgps is header-only.
vcpkg_check_linkage(ONLY_STATIC_LIBRARY)

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    tbb DGPS_WITH_TBB
    cuda DGPS_WITH_CUDA
    tools DGPS_BUILD_TOOLS
  INVERTED_FEATURES
    eigen CMAKE_DISABLE_FIND_PACKAGE_Eigen3
    xsimd CMAKE_DISABLE_FIND_PACKAGE_xsimd
)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    -DDGPS_BUILD_TESTS=OFF
    -DDGPS_BUILD_EXAMPLES=OFF
    -DDGPS_BUILD_BENCH=OFF
    -DDGPS_WARNINGS_AS_ERRORS=OFF
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME dgps CONFIG_PATH lib/cmake/dgps)

if("tools" IN_LIST FEATURES)
  vcpkg_copy_tools(TOOL_NAMES dgps AUTO_CLEAN)
endif()

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/include" "${CURRENT_PACKAGES_DIR}/debug/share")
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/share/doc" "${CURRENT_PACKAGES_DIR}/debug/share/doc")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")

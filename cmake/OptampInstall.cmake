# The C++ package (OPTAMP_INSTALL=ON): install rules, and the same targets exported from the
# build tree so a consumer can find_package(optamp) with optamp_DIR=<build dir>, as
# google/benchmark does.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(OPTAMP_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/optamp)

install(TARGETS optamp EXPORT optampTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/optamp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(FILES "${PROJECT_BINARY_DIR}/include/optamp/version.h"
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/optamp)
install(EXPORT optampTargets NAMESPACE optamp:: DESTINATION ${OPTAMP_CMAKE_INSTALL_DIR})
# Build tree: the targets with their build-tree paths (BUILD_INTERFACE include directories,
# the library in this build directory), next to a config file of their own.
export(EXPORT optampTargets NAMESPACE optamp:: FILE "${PROJECT_BINARY_DIR}/optampTargets.cmake")

# One template for both config files; each includes the optampTargets.cmake beside it.
configure_package_config_file(cmake/optampConfig.cmake.in
  "${PROJECT_BINARY_DIR}/optampConfig.cmake"
  INSTALL_DESTINATION "${PROJECT_BINARY_DIR}" INSTALL_PREFIX "${PROJECT_BINARY_DIR}")
configure_package_config_file(cmake/optampConfig.cmake.in
  "${PROJECT_BINARY_DIR}/cmake-install/optampConfig.cmake"
  INSTALL_DESTINATION ${OPTAMP_CMAKE_INSTALL_DIR})
write_basic_package_version_file("${PROJECT_BINARY_DIR}/optampConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/cmake-install/optampConfig.cmake"
              "${PROJECT_BINARY_DIR}/optampConfigVersion.cmake"
        DESTINATION ${OPTAMP_CMAKE_INSTALL_DIR})

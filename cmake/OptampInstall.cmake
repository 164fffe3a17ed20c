include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS optamp EXPORT optampTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/optamp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT optampTargets NAMESPACE optamp:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/optamp)

configure_package_config_file(cmake/optampConfig.cmake.in
  "${PROJECT_BINARY_DIR}/optampConfig.cmake"
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/optamp)
write_basic_package_version_file("${PROJECT_BINARY_DIR}/optampConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/optampConfig.cmake" "${PROJECT_BINARY_DIR}/optampConfigVersion.cmake"
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/optamp)

// amp::version(): the version set once, by project(optamp VERSION ...) in CMakeLists.txt, and
// generated into optamp/version.h.
#include <gtest/gtest.h>

#include <regex>

#include "optamp/version.h"

TEST(Version, LibraryReportsTheVersionOfItsHeaders) {
  EXPECT_STREQ(amp::version(), OPTAMP_VERSION);
}

TEST(Version, IsMajorMinorPatch) {
  EXPECT_TRUE(std::regex_match(amp::version(), std::regex(R"(\d+\.\d+\.\d+)"))) << amp::version();
}

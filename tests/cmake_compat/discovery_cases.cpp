// The shapes of test the suite has, for tests/cmake_compat: plain, skipped (as the *_CUDA tests
// are without a GPU), disabled, and value-parametrized names with '/' in them.
#include <gtest/gtest.h>

#include <string>

namespace {

TEST(Discovery, Plain) { EXPECT_EQ(1 + 1, 2); }

TEST(Discovery, SkippedLikeACudaTest_CUDA) { GTEST_SKIP() << "no CUDA device visible"; }

TEST(Discovery, DISABLED_Disabled) { FAIL() << "disabled tests do not run"; }

class OnDevice : public testing::TestWithParam<std::string> {};
TEST_P(OnDevice, NamesWithSlashes) { EXPECT_FALSE(GetParam().empty()); }
INSTANTIATE_TEST_SUITE_P(Devices, OnDevice, testing::Values("cpu", "cuda"),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return "On_" + info.param;
                         });

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

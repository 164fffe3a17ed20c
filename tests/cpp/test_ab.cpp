// optamp/ab.h, the program side of python -m optamp.ab: the level and seed come from the
// environment only when a program asks, and report() writes one JSON object a line.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "optamp/ab.h"

namespace {

// Sets an environment variable for one test and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value != nullptr)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

std::string temp_path(const char* name) {
  auto path = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove(path);
  return path.string();
}

}  // namespace

TEST(AbProtocol, LevelAndSeedComeFromTheEnvironmentWhenSet) {
  {
    ScopedEnv level(amp::ab::kOptLevelEnv, nullptr), seed(amp::ab::kSeedEnv, nullptr);
    EXPECT_EQ(amp::ab::opt_level("O2"), "O2");
    EXPECT_EQ(amp::ab::seed(7), 7);
  }
  ScopedEnv level(amp::ab::kOptLevelEnv, "O5"), seed(amp::ab::kSeedEnv, "3");
  EXPECT_EQ(amp::ab::opt_level("O2"), "O5");
  EXPECT_EQ(amp::ab::seed(7), 3);
}

TEST(AbProtocol, BadEnvironmentValuesNameTheVariable) {
  {
    ScopedEnv level(amp::ab::kOptLevelEnv, "fast");
    try {
      amp::ab::opt_level();
      FAIL() << "no error";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("OPTAMP_OPT_LEVEL must be an opt level O0..O5, got "
                                           "\"fast\""),
                std::string::npos)
          << e.what();
    }
  }
  for (const char* bad : {"-1", "x", "3x"}) {
    ScopedEnv seed(amp::ab::kSeedEnv, bad);
    EXPECT_THROW(amp::ab::seed(), c10::ValueError) << bad;
  }
}

TEST(AbProtocol, ReporterWritesOneJsonObjectALine) {
  const std::string path = temp_path("optamp_ab_report_test.jsonl");
  {
    amp::ab::Reporter reporter(path);
    ASSERT_TRUE(reporter.active());
    reporter.report({{"step", 1}, {"loss", 0.5}, {"skipped", false}});
    reporter.report(
        {{"val_bpc", std::numeric_limits<double>::quiet_NaN()}, {"note", "a \"quoted\"\nline"}});
    EXPECT_THROW(reporter.report({{"t", 1.0}}), c10::ValueError);
  }
  const auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].rfind("{\"step\": 1, \"loss\": 0.5, \"skipped\": false, \"t\": ", 0), 0u)
      << lines[0];
  EXPECT_NE(lines[1].find("\"val_bpc\": NaN"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find(R"("note": "a \"quoted\"\nline")"), std::string::npos) << lines[1];
  std::filesystem::remove(path);
}

// In a distributed program only global rank 0 writes: every rank writing into the one metrics
// file interleaved their losses, and the runner took the gaps between ranks' lines for steps.
TEST(AbProtocol, OnlyGlobalRankZeroReports) {
  const std::string path = temp_path("optamp_ab_rank_test.jsonl");
  const ScopedEnv no_mpi_rank("OMPI_COMM_WORLD_RANK", nullptr), no_pmi_rank("PMI_RANK", nullptr);
  for (const char* rank : {"1", "0", static_cast<const char*>(nullptr)}) {
    const ScopedEnv env("RANK", rank);
    EXPECT_EQ(amp::ab::reports_here(), rank == nullptr || std::string(rank) == "0");
    amp::ab::Reporter reporter(path);
    reporter.report({{"step", 1}, {"loss", 0.5}});
  }
  {
    const ScopedEnv no_rank("RANK", nullptr), mpi_rank("OMPI_COMM_WORLD_RANK", "3");
    EXPECT_FALSE(amp::ab::reports_here());
  }
  {  // read as Python's reports_here reads them: spaces stripped, a blank value not set
    const ScopedEnv padded_rank("RANK", " 0\n"), mpi_rank("OMPI_COMM_WORLD_RANK", "3");
    EXPECT_TRUE(amp::ab::reports_here());
    const ScopedEnv blank_rank("RANK", "  ");
    EXPECT_FALSE(amp::ab::reports_here()) << "a blank RANK falls through to OMPI_COMM_WORLD_RANK";
  }
  EXPECT_EQ(lines_of(path).size(), 2u) << "rank 0 and a program that is not distributed";
  std::filesystem::remove(path);
}

TEST(AbProtocol, ReporterWithoutAPathWritesNothing) {
  amp::ab::Reporter reporter("");
  EXPECT_FALSE(reporter.active());
  reporter.report({{"step", 1}, {"loss", 1.0}});  // no file, no error
}

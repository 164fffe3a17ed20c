// Opt levels: parsing, each level's defaults, every validation rule, describe().
#include "optamp/opt_level.h"

#include "test_util.h"

namespace amp {
namespace {

using c10::ScalarType;
constexpr ScalarType kNone = ScalarType::Undefined;

TEST(OptLevelParse, AcceptsExactlyTheSixLevels) {
  EXPECT_EQ(parse_opt_level("O0"), OptLevel::O0);
  EXPECT_EQ(parse_opt_level("O1"), OptLevel::O1);
  EXPECT_EQ(parse_opt_level("O2"), OptLevel::O2);
  EXPECT_EQ(parse_opt_level("O3"), OptLevel::O3);
  EXPECT_EQ(parse_opt_level("O4"), OptLevel::O4);
  EXPECT_EQ(parse_opt_level("O5"), OptLevel::O5);
  for (int i = 0; i <= 5; ++i) {
    const auto level = static_cast<OptLevel>(i);
    EXPECT_EQ(parse_opt_level(to_string(level)), level);
  }
}

TEST(OptLevelParse, RejectsLookalikesWithAValueErrorNamingTheLetterO) {
  for (const char* bad : {"00", "01", "o1", "O6", "", "O", "O1 ", " O1", "O-1", "O10", "1"}) {
    OPTAMP_EXPECT_THROW_WITH(parse_opt_level(bad), c10::ValueError, "capital letter O", "\"O5\"",
                             (std::string("got \"") + bad + "\"").c_str());
  }
}

struct Expected {
  OptLevel level;
  ScalarType cast_model_type;
  bool patch;
  ScalarType patch_type;
  std::optional<bool> keep_bn;
  std::optional<bool> master;
  bool dynamic;
  ScalarType low;
};

TEST(OptLevelDefaults, EveryLevelMatchesTheTable) {
  const Expected table[] = {
      {OptLevel::O0, ScalarType::Float, false, kNone, std::nullopt, false, false, kNone},
      {OptLevel::O1, kNone, true, ScalarType::Half, std::nullopt, std::nullopt, true,
       ScalarType::Half},
      {OptLevel::O2, ScalarType::Half, false, kNone, true, true, true, ScalarType::Half},
      {OptLevel::O3, ScalarType::Half, false, kNone, false, false, false, ScalarType::Half},
      {OptLevel::O4, kNone, true, ScalarType::BFloat16, std::nullopt, std::nullopt, false,
       ScalarType::BFloat16},
      {OptLevel::O5, ScalarType::BFloat16, false, kNone, true, true, false, ScalarType::BFloat16},
  };
  for (const auto& row : table) {
    SCOPED_TRACE(to_string(row.level));
    const Properties p = resolve(row.level);
    EXPECT_EQ(p.opt_level, row.level);
    EXPECT_TRUE(p.enabled);
    EXPECT_EQ(p.cast_model_type, row.cast_model_type);
    EXPECT_EQ(p.patch_torch_functions, row.patch);
    EXPECT_EQ(p.patch_torch_functions_type, row.patch_type);
    EXPECT_EQ(p.keep_batchnorm_fp32, row.keep_bn);
    EXPECT_EQ(p.master_weights, row.master);
    EXPECT_EQ(p.loss_scale.is_dynamic(), row.dynamic);
    if (!row.dynamic) EXPECT_EQ(p.loss_scale.value(), 1.0);
    EXPECT_EQ(p.low_dtype(), row.low);
    EXPECT_EQ(p.num_losses, 1);
    EXPECT_FALSE(p.min_loss_scale.has_value());
    EXPECT_EQ(p.max_loss_scale, 16777216.0);
    EXPECT_EQ(p.verbosity, 1);
    EXPECT_EQ(p.init_scale, 65536.0);
    EXPECT_EQ(p.growth_factor, 2.0);
    EXPECT_EQ(p.backoff_factor, 0.5);
    EXPECT_EQ(p.growth_interval, 2000);
    EXPECT_EQ(p.hysteresis, 1);
    EXPECT_EQ(is_bf16_level(row.level), row.low == ScalarType::BFloat16);
  }
}

TEST(OptLevelOverrides, AreAppliedAndReported) {
  Options o;
  o.loss_scale = 128.0;
  o.keep_batchnorm_fp32 = false;
  o.growth_interval = 10;
  o.verbosity = 0;
  const Properties p = resolve("O2", o);
  EXPECT_FALSE(p.loss_scale.is_dynamic());
  EXPECT_EQ(p.loss_scale.value(), 128.0);
  EXPECT_EQ(p.keep_batchnorm_fp32, false);
  EXPECT_EQ(p.growth_interval, 10);
  EXPECT_EQ(p.verbosity, 0);
  EXPECT_NE(p.overrides_description.find("loss_scale=128"), std::string::npos);
  EXPECT_NE(p.overrides_description.find("keep_batchnorm_fp32=False"), std::string::npos);
}

TEST(OptLevelOverrides, LossScaleAcceptsDynamicAndNumericStrings) {
  Options o;
  o.loss_scale = "dynamic";
  EXPECT_TRUE(resolve("O3", o).loss_scale.is_dynamic());
  o.loss_scale = "512.0";
  EXPECT_EQ(resolve("O1", o).loss_scale.value(), 512.0);
  OPTAMP_EXPECT_THROW_WITH(LossScale("dynamc"), c10::ValueError, "loss_scale", "dynamc");
}

TEST(OptLevelOverrides, BF16TypeAtO1SelectsBF16Casting) {
  Options o;
  o.patch_torch_functions_type = ScalarType::BFloat16;
  EXPECT_EQ(resolve("O1", o).low_dtype(), ScalarType::BFloat16);
}

TEST(OptLevelOverrides, DisabledMeansNoReducedType) {
  Options o;
  o.enabled = false;
  EXPECT_EQ(resolve("O2", o).low_dtype(), kNone);
}

TEST(OptLevelOverrides, InitScaleIsCappedByMaxLossScaleUnlessExplicit) {
  Options o;
  o.max_loss_scale = 1024.0;
  EXPECT_EQ(resolve("O1", o).init_scale, 1024.0);
}

// ---- one test per validation rule --------------------------------------------------------

TEST(OptLevelValidation, CastModelTypeAtO1) {
  Options o;
  o.cast_model_type = ScalarType::Half;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "cast_model_type", "O1",
                           "torch.float16", "opt_level='O2'");
  o.cast_model_type = ScalarType::Float;  // allowed: weights stay fp32
  EXPECT_NO_THROW(resolve("O1", o));
}

TEST(OptLevelValidation, CastModelTypeAtO4) {
  Options o;
  o.cast_model_type = ScalarType::BFloat16;
  OPTAMP_EXPECT_THROW_WITH(resolve("O4", o), c10::ValueError, "cast_model_type", "O4", "'O5'");
}

TEST(OptLevelValidation, CastModelTypeMustBeAFloatingType) {
  Options o;
  o.cast_model_type = ScalarType::Long;
  OPTAMP_EXPECT_THROW_WITH(resolve("O2", o), c10::ValueError, "cast_model_type", "torch.int64");
}

TEST(OptLevelValidation, PatchTypeMustBeReduced) {
  Options o;
  o.patch_torch_functions_type = ScalarType::Float;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "patch_torch_functions_type",
                           "torch.float32");
}

TEST(OptLevelValidation, PatchTorchFunctionsOutsideO1O4) {
  for (const char* level : {"O0", "O2", "O3", "O5"}) {
    Options o;
    o.patch_torch_functions = true;
    OPTAMP_EXPECT_THROW_WITH(resolve(level, o), c10::ValueError, "patch_torch_functions=True",
                             level, "'O1'");
  }
  Options off;
  off.patch_torch_functions = false;  // turning it off is always allowed
  EXPECT_NO_THROW(resolve("O2", off));
}

TEST(OptLevelValidation, KeepBatchnormAtO1) {
  Options o;
  o.keep_batchnorm_fp32 = true;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "keep_batchnorm_fp32", "O1",
                           "should be None");
  EXPECT_NO_THROW(resolve("O3", o));  // the documented "O3 with fp32 batchnorm" recipe
}

TEST(OptLevelValidation, MasterWeightsAtO1) {
  Options o;
  o.master_weights = true;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "master_weights", "O1");
  OPTAMP_EXPECT_THROW_WITH(resolve("O4", o), c10::ValueError, "master_weights", "O4");
}

TEST(OptLevelValidation, PatchingNeedsAType) {
  // Only C++ can say "no patch type" (Undefined): Python's None means "not overridden".
  for (const char* level : {"O1", "O4"}) {
    SCOPED_TRACE(level);
    Options o;
    o.patch_torch_functions_type = kNone;  // the level's patch_torch_functions=True stays
    OPTAMP_EXPECT_THROW_WITH(resolve(level, o), c10::ValueError,
                             "patch_torch_functions=True needs patch_torch_functions_type "
                             "torch.float16 or torch.bfloat16, got None");
    o.patch_torch_functions = true;  // spelled out: the same
    OPTAMP_EXPECT_THROW_WITH(resolve(level, o), c10::ValueError, "patch_torch_functions=True",
                             "got None");
    o.patch_torch_functions = false;  // nothing to patch, so no type is needed
    EXPECT_NO_THROW(resolve(level, o));
  }
}

// Every cast_model_type / master_weights value Apex accepted at a model level is accepted, and
// says what happens to the model (ModelCast) and whether anything is cast at all.
TEST(OptLevelValidation, ApexModelOverridesChooseWhatHappensToTheModel) {
  struct Case {
    const char* level;
    std::optional<ScalarType> cast_model_type;
    std::optional<bool> master_weights;
    ModelCast model_cast;
    ScalarType low;
  };
  const Case cases[] = {
      {"O2", std::nullopt, std::nullopt, ModelCast::kWorkingCopies, ScalarType::Half},
      {"O2", std::nullopt, false, ModelCast::kInPlace, ScalarType::Half},
      {"O2", ScalarType::Float, std::nullopt, ModelCast::kNone, kNone},
      {"O2", kNone, std::nullopt, ModelCast::kNone, kNone},  // Python's False
      {"O3", std::nullopt, std::nullopt, ModelCast::kInPlace, ScalarType::Half},
      {"O3", std::nullopt, true, ModelCast::kWorkingCopies, ScalarType::Half},
      {"O3", ScalarType::Float, std::nullopt, ModelCast::kNone, kNone},
      {"O3", ScalarType::BFloat16, std::nullopt, ModelCast::kInPlace, ScalarType::BFloat16},
      {"O5", std::nullopt, false, ModelCast::kInPlace, ScalarType::BFloat16},
      {"O5", kNone, std::nullopt, ModelCast::kNone, kNone},
      {"O0", std::nullopt, std::nullopt, ModelCast::kNone, kNone},
      {"O0", ScalarType::Half, std::nullopt, ModelCast::kInPlace, ScalarType::Half},
      {"O0", ScalarType::Half, true, ModelCast::kWorkingCopies, ScalarType::Half},
      {"O1", std::nullopt, std::nullopt, ModelCast::kNone, ScalarType::Half},
      {"O1", kNone, std::nullopt, ModelCast::kNone, ScalarType::Half},
      {"O1", ScalarType::Float, std::nullopt, ModelCast::kNone, ScalarType::Half},
  };
  for (const auto& c : cases) {
    Options o;
    o.cast_model_type = c.cast_model_type;
    o.master_weights = c.master_weights;
    const Properties p = resolve(c.level, o);
    const std::string what =
        std::string(c.level) +
        " cast_model_type=" + (c.cast_model_type ? dtype_name(*c.cast_model_type) : "unset") +
        " master_weights=" + (c.master_weights ? (*c.master_weights ? "True" : "False") : "unset");
    EXPECT_EQ(p.model_cast(), c.model_cast) << what;
    EXPECT_EQ(p.low_dtype(), c.low) << what;
    EXPECT_EQ(p.casts(), c.low != kNone) << what;
    EXPECT_EQ(p.opt_level, parse_opt_level(c.level)) << what;  // the report keeps the level
  }
  // The override is named in the one-line summary: the level's brief no longer says it.
  Options none;
  none.cast_model_type = kNone;
  EXPECT_NE(resolve("O2", none).summary().find("model not cast, no op cast"), std::string::npos)
      << resolve("O2", none).summary();
  Options in_place;
  in_place.master_weights = false;
  EXPECT_NE(resolve("O2", in_place).summary().find("model cast in place"), std::string::npos);
  EXPECT_EQ(resolve("O2").summary().find("model "), std::string::npos);
  Options off;
  off.enabled = false;
  EXPECT_EQ(resolve("O2", off).model_cast(), ModelCast::kNone);
  EXPECT_FALSE(resolve("O2", off).casts());
}

TEST(OptLevelValidation, PatchTypeOfAModelLevelMustBeTheModelType) {
  Options other_patch;
  other_patch.patch_torch_functions_type = ScalarType::BFloat16;
  OPTAMP_EXPECT_THROW_WITH(resolve("O2", other_patch), c10::ValueError,
                           "patch_torch_functions_type", "torch.bfloat16", "torch.float16");
  OPTAMP_EXPECT_THROW_WITH(resolve("O3", other_patch), c10::ValueError,
                           "patch_torch_functions_type");
  other_patch.cast_model_type = kNone;  // nothing is cast, so no patch type either
  OPTAMP_EXPECT_THROW_WITH(resolve("O2", other_patch), c10::ValueError,
                           "patch_torch_functions_type must be None, got torch.bfloat16");
  // Consistent spellings of the level's own settings stay allowed.
  Options same;
  same.cast_model_type = ScalarType::BFloat16;
  same.patch_torch_functions_type = ScalarType::BFloat16;
  EXPECT_EQ(resolve("O2", same).low_dtype(), ScalarType::BFloat16);
  EXPECT_EQ(resolve("O3", same).low_dtype(), ScalarType::BFloat16);
}

TEST(OptLevelValidation, LossScaleOutsideFloat32NormalRange) {
  // Below 2^-126, 1/scale is not finite in float32; above 3.4e38 the scale itself is not.
  for (double bad : {0.0, -1.0, 0x1p-127, 1e39, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    Options o;
    o.loss_scale = bad;
    OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "loss_scale",
                             "within [2^-126, 3.4e38]");
    Options m;
    m.min_loss_scale = bad;
    OPTAMP_EXPECT_THROW_WITH(resolve("O1", m), c10::ValueError, "min_loss_scale",
                             "within [2^-126, 3.4e38]");
  }
  Options edge;
  edge.loss_scale = 0x1p-126;
  EXPECT_EQ(resolve("O1", edge).loss_scale.value(), 0x1p-126);
}

TEST(OptLevelValidation, OverflowCheckOffNeedsAFixedScale) {
  Options o;
  o.overflow_check = false;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "overflow_check=False",
                           "\"dynamic\"");
  EXPECT_FALSE(resolve("O5", o).overflow_check);
  EXPECT_TRUE(resolve("O5").overflow_check);
  o.loss_scale = LossScale::fixed(128.0);
  EXPECT_FALSE(resolve("O1", o).overflow_check);
  EXPECT_NE(resolve("O5", o).describe().find("overflow_check=False"), std::string::npos);
}

TEST(OptLevelValidation, MinAboveMax) {
  Options o;
  o.min_loss_scale = 1024.0;
  o.max_loss_scale = 16.0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "min_loss_scale (1024)",
                           "max_loss_scale (16)");
}

TEST(OptLevelValidation, MinLossScaleNotPositive) {
  Options o;
  o.min_loss_scale = 0.0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "min_loss_scale", "got 0");
}

TEST(OptLevelValidation, MaxLossScaleNotPositive) {
  Options o;
  o.max_loss_scale = -2.0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "max_loss_scale", "got -2");
}

TEST(OptLevelValidation, NumLossesBelowOne) {
  Options o;
  o.num_losses = 0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "num_losses must be >= 1, got 0");
}

TEST(OptLevelValidation, VerbosityOutOfRange) {
  Options o;
  o.verbosity = 3;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "verbosity must be 0, 1 or 2, got 3");
  o.verbosity = -1;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError,
                           "verbosity must be 0, 1 or 2, got -1");
  for (int ok : {0, 1, 2}) {
    o.verbosity = ok;
    EXPECT_EQ(resolve("O1", o).verbosity, ok);
  }
}

TEST(OptLevelValidation, BF16LevelsRejectFP16Types) {
  Options o;
  o.cast_model_type = ScalarType::Half;
  OPTAMP_EXPECT_THROW_WITH(resolve("O5", o), c10::ValueError, "O5", "bfloat16 level",
                           "torch.float16");
  Options p;
  p.patch_torch_functions_type = ScalarType::Half;
  OPTAMP_EXPECT_THROW_WITH(resolve("O4", p), c10::ValueError, "O4", "bfloat16 level");
}

TEST(OptLevelValidation, InitScaleOutsideRange) {
  Options o;
  o.init_scale = 1e9;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "init_scale", "max_loss_scale");
  o.init_scale = -1.0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "init_scale",
                           "within [2^-126, 3.4e38]");
}

TEST(OptLevelValidation, GrowthFactorNotAboveOne) {
  Options o;
  o.growth_factor = 1.0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "growth_factor", "> 1");
}

TEST(OptLevelValidation, BackoffFactorOutsideUnitInterval) {
  Options o;
  o.backoff_factor = 1.5;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "backoff_factor", "(0, 1)");
}

TEST(OptLevelValidation, GrowthIntervalBelowOne) {
  Options o;
  o.growth_interval = 0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "growth_interval");
}

TEST(OptLevelValidation, HysteresisBelowOne) {
  Options o;
  o.hysteresis = 0;
  OPTAMP_EXPECT_THROW_WITH(resolve("O1", o), c10::ValueError, "hysteresis");
}

TEST(OptLevelDescribe, ShowsDefaultsOverridesAndFinalOptions) {
  Options o;
  o.loss_scale = 64.0;
  const std::string text = resolve("O2", o).describe();
  for (const char* needle :
       {"Selected optimization level O2", "FP32 master weights", "Defaults for this optimization",
        "loss_scale                 : dynamic", "Overrides applied: loss_scale=64.0",
        "After processing overrides", "loss_scale                 : 64.0\n",
        "keep_batchnorm_fp32        : True", "cast_model_type            : torch.float16",
        "patch_torch_functions_type : None", "max_loss_scale             : 16777216.0",
        "init_scale                 : 65536.0", "growth_factor              : 2.0"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << "missing \"" << needle << "\" in\n" << text;
  }
  Options tiny;
  tiny.min_loss_scale = 1e-5;
  tiny.backoff_factor = 0.1;
  const std::string small = resolve("O1", tiny).describe();
  EXPECT_NE(small.find("min_loss_scale             : 1e-05"), std::string::npos) << small;
  EXPECT_NE(small.find("backoff_factor             : 0.1\n"), std::string::npos) << small;
  const std::string o1 = resolve("O1").describe();
  EXPECT_NE(o1.find("Overrides applied: (none)"), std::string::npos) << o1;
  EXPECT_NE(o1.find("master_weights             : None"), std::string::npos) << o1;
}

}  // namespace
}  // namespace amp

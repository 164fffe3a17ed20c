// Training-step throughput and peak memory of ResNet-50 (synthetic 224x224 images, batch 128,
// SGD with momentum) at O0 (TF32 off/on), O1..O5 and native AMP. See train_harness.h.
//
//   bench_train_resnet50 [--device cuda] [--batch 128] [--rounds 3] [--steps 20]
//   bench_train_resnet50 --device cpu --small          # seconds-long CPU smoke test

#include "bench_models.h"
#include "train_harness.h"

namespace {

class ResNet50Workload : public bench::Workload {
 public:
  std::string name() const override { return "bench_train_resnet50"; }
  std::string describe() const override {
    std::string blocks;
    for (auto b : opts_.blocks) blocks += (blocks.empty() ? "" : "-") + std::to_string(b);
    return "ResNet blocks " + blocks + " width " + std::to_string(opts_.width) + ", " +
           std::to_string(opts_.classes) + " classes, batch " + std::to_string(batch_) + "x3x" +
           std::to_string(image_) + "x" + std::to_string(image_) +
           (fused_ ? ", amp::FusedSGD momentum 0.9" : ", SGD momentum 0.9");
  }
  bool parse_flag(const std::string& f, const std::string& v) override {
    if (f == "--batch")
      batch_ = std::stoll(v);
    else if (f == "--image")
      image_ = std::stoll(v);
    else if (f == "--width")
      opts_.width = std::stoll(v);
    else if (f == "--classes")
      opts_.classes = std::stoll(v);
    else if (f == "--blocks") {
      opts_.blocks.clear();
      for (const auto& s : bench::split(v)) opts_.blocks.push_back(std::stoll(s));
    } else
      return false;
    return true;
  }
  void small() override {
    batch_ = 4;
    image_ = 64;
    opts_ = {{1, 1, 1, 1}, 8, 10};
  }
  std::string usage() const override {
    return "  model: [--batch 128] [--image 224] [--width 64] [--blocks 3,4,6,3] [--classes 1000]\n"
           "  --small = --batch 4 --image 64 --width 8 --blocks 1,1,1,1 --classes 10\n";
  }
  std::int64_t samples_per_step() const override { return batch_; }
  void build(const torch::Device& device) override {
    model_ = bench::ResNet(opts_);
    model_->to(device);
    model_->train();
    const auto options = torch::optim::SGDOptions(0.01).momentum(0.9).weight_decay(1e-4);
    if (fused_) {
      optimizer_ = std::make_unique<amp::FusedSGD>(model_->parameters(), options);
    } else {
      optimizer_ = std::make_unique<torch::optim::SGD>(model_->parameters(), options);
    }
    x_ = torch::randn({batch_, 3, image_, image_}, torch::device(device));
    y_ = torch::randint(opts_.classes, {batch_}, torch::dtype(torch::kLong).device(device));
  }
  std::shared_ptr<torch::nn::Module> module() override { return model_.ptr(); }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  torch::Tensor loss() override {
    return torch::nn::functional::cross_entropy(model_->forward(x_), y_);
  }
  void destroy() override {
    optimizer_.reset();
    model_ = bench::ResNet(nullptr);
    x_ = y_ = torch::Tensor();
  }

 private:
  bench::ResNetOptions opts_;
  std::int64_t batch_ = 128, image_ = 224;
  bench::ResNet model_{nullptr};
  std::unique_ptr<torch::optim::SGD> optimizer_;
  torch::Tensor x_, y_;
};

}  // namespace

int main(int argc, char** argv) {
  ResNet50Workload wl;
  return bench::harness_main(wl, argc, argv);
}

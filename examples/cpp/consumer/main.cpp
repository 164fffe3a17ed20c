// The smallest optamp consumer: resolve an opt level and print Apex's report.
#include <optamp/amp.h>

#include <iostream>

int main() {
  amp::Options options;
  options.loss_scale = "dynamic";
  const amp::Properties properties = amp::resolve("O2", options);
  std::cout << "optamp " << amp::version() << "\n" << properties.describe();
  return properties.low_dtype() == c10::ScalarType::Half ? 0 : 1;
}

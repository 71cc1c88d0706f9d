// defines: Device names and parsing, and the CPU stream token.
#include "core/device.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain {

std::string Device::str() const {
  return kind == DeviceKind::CPU ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    const std::string digits = text.substr(5);
    MT_CHECK(!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos,
             "device: expected 'cpu', 'cuda' or 'cuda:N' but found '{}'", text);
    return Device::cuda(std::stoi(digits));
  }
  MT_FAIL("device: expected 'cpu', 'cuda' or 'cuda:N' but found '{}'", text);
}

Stream& Stream::cpu() {
  static Stream stream;
  return stream;
}

}  // namespace moetrain

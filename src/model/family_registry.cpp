// defines: the family registry: every folder of model/families/ (the list is generated when the build is
// configured: family_list.inc names each folder's family() function).
#include "model/family.h"

#include <fmt/format.h>

#include "core/error.h"
#include "model/family_list.inc"  // #include of each folder's family.h, then MOETRAIN_FAMILIES(X)

namespace moetrain::model {

const std::vector<const Family*>& registered_families() {
  static const std::vector<const Family*> families = [] {
    std::vector<const Family*> all;
#define MOETRAIN_ADD_FAMILY(folder) all.push_back(&families::folder::family());
    MOETRAIN_FAMILIES(MOETRAIN_ADD_FAMILY)
#undef MOETRAIN_ADD_FAMILY
    return all;
  }();
  return families;
}

std::string supported_model_types() {
  std::vector<std::string> types;
  for (const Family* f : registered_families())
    for (const std::string& t : f->model_types()) types.push_back(t);
  return fmt::format("{}", fmt::join(types, ", "));
}

const Family& family_for(const std::string& model_type, const std::string& source) {
  for (const Family* f : registered_families()) {
    for (const std::string& t : f->model_types())
      if (t == model_type) return *f;
  }
  MT_FAIL("{}: model_type '{}' is not supported (supported: {})", source, model_type, supported_model_types());
}

}  // namespace moetrain::model

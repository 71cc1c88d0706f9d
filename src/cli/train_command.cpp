// defines: the train command.
#include "cli/train_command.h"

#include <cstdio>
#include <memory>

#include "core/error.h"
#include "core/log.h"
#include "io/job_config.h"
#include "train/launch.h"

namespace moetrain::cli {

std::vector<std::string> collect_overrides(const std::vector<std::string>& extras) {
  std::vector<std::string> overrides;
  for (size_t i = 0; i < extras.size(); ++i) {
    const std::string& arg = extras[i];
    MT_CHECK(arg.rfind("--", 0) == 0 && arg.find('.') != std::string::npos,
             "train: expected an override such as --optim.lr=1e-4 but found '{}'", arg);
    std::string body = arg.substr(2);
    if (body.find('=') == std::string::npos) {
      MT_CHECK(i + 1 < extras.size() && extras[i + 1].rfind("--", 0) != 0,
               "train: override '{}' has no value (write --{}=VALUE)", arg, body);
      body += "=" + extras[++i];
    }
    overrides.push_back(body);
  }
  return overrides;
}

int run_train(const std::string& config_path, const std::vector<std::string>& overrides) {
  const io::JobConfig config = io::load_job_config(config_path, overrides);
  std::printf("# resolved job configuration\n%s\n", io::job_config_to_toml(config).c_str());
  std::fflush(stdout);
  const train::TrainSummary summary = train::run_training_job(config);
  if (summary.losses.empty()) {
    log_info("nothing to do: the job is at step {} of train.steps = {} (raise --train.steps to continue)",
             summary.last_step, config.train.steps);
  } else {
    log_info("done: steps {} -> {}, final loss {:.4f}", summary.first_step, summary.last_step, summary.losses.back());
  }
  return 0;
}

void add_train_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* train = app.add_subcommand("train", "Train a model from a TOML job file (--section.key=value overrides)");
  auto config_path = std::make_shared<std::string>();  // kept alive by the callbacks below
  train->add_option("--config", *config_path, "job TOML file")->required();
  train->allow_extras();
  train->callback([train, config_path, &command] {
    command = [train, config_path] { return run_train(*config_path, collect_overrides(train->remaining())); };
  });
}

}  // namespace moetrain::cli

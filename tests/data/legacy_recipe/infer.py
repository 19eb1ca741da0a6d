"""legacy inference: a warm-up generation, then the formal (measured) one."""

import argparse

from engine.config import load_runner_settings
from engine.data import load_prompts
from models.model_setting import check_vars, update_vars
from runner_legacy import LegacyRunner


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--yaml-file-path", "--yaml_file_path", dest="yaml_file_path",
                        default='config/legacy_1card_eager.yaml', help="recipe YAML")
    return parser.parse_args()


def main():
    args = parse_args()
    runner_settings = load_runner_settings(args.yaml_file_path)
    check_vars(runner_settings)
    update_vars(runner_settings)
    runner = LegacyRunner(runner_settings)
    data_config = runner_settings["data_config"]
    # Data parallel over groups of attn_tp_size ranks: each group takes its share of the batch.
    per_rank = runner_settings["batch_size_per_rank"]
    prompts = load_prompts(data_config["dataset"], data_config["batch_size"])
    prompts = prompts[runner.dp_rank * per_rank:(runner.dp_rank + 1) * per_rank]

    runner.init_model()
    # Warm-up first: the formal run's timings must not include one-off allocation/compilation.
    runner.model_generate(prompts, warm_up=True)
    runner.model_generate(prompts)
    runner.close()


if __name__ == "__main__":
    main()

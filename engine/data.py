"""Prompt datasets for recipes. `default` is the single prompt upstream recipes use."""

DEFAULT_PROMPT = (
    "An attention function can be described as mapping a query and a set of key-value pairs "
    "to an output, where the query, keys, values, and output are all vectors. The output is"
)

DATASETS = {"default": [DEFAULT_PROMPT]}


def load_prompts(dataset: str, batch_size: int) -> list[str]:
    """Return `batch_size` prompts, cycling through the dataset."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(sorted(DATASETS))}")
    prompts = DATASETS[dataset]
    return [prompts[i % len(prompts)] for i in range(batch_size)]

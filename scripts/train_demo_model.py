#!/usr/bin/env python
"""Train the shipped demo checkpoint, demo/tiny-attention-llama, from scratch on CPU.

The demo's job is to show readable text rather than noise, so this script trains a very small
LlamaForCausalLM (about 0.9M parameters) on a short English corpus that ships inside this file.
The corpus is a few paragraphs about attention and transformers; one of them starts with the
project's default prompt (engine.data.DEFAULT_PROMPT), so greedy decoding of that prompt continues
with readable sentences and the model predicts the prompt itself well (which is what the
untrained-weights detector in agent/measure/parity.py measures). The model memorises its corpus: it is a
demo, not a useful language model.

Steps: train a byte-level BPE tokenizer on the corpus (`tokenizers`), tokenize each paragraph
(ended by the eos token), cut windows of at most --block-size tokens that start at paragraph
starts and at regular strides inside long paragraphs, then train with AdamW on all windows per
step. Deterministic for a fixed --seed on a given machine and library version.

    python scripts/train_demo_model.py --output demo/tiny-attention-llama

runs in well under three minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from engine.data import DEFAULT_PROMPT  # noqa: E402
from engine.output_check import check_output_text  # noqa: E402


# The continuation the model learns for the default prompt (the prompt ends with "The output is").
PROMPT_CONTINUATION = (
    " computed as a weighted sum of the values, where the weight assigned to each value is "
    "computed by a compatibility function of the query with the corresponding key. In practice "
    "the compatibility function is a scaled dot product, and a softmax turns the scores into "
    "weights that are positive and add up to one. Because every position can look at every other "
    "position in a single step, attention connects distant words directly, and the whole sequence "
    "can be processed in parallel on modern hardware."
)

# Original text written for this project (the first paragraph opens with the default prompt,
# whose sentence and first continuation sentence follow Vaswani et al., 2017). Each paragraph is
# a training document; no two paragraphs open the same way, so the prompt is unambiguous.
CORPUS = [
    DEFAULT_PROMPT + PROMPT_CONTINUATION,
    "A transformer is a neural network built from a stack of identical blocks. Each block has an "
    "attention layer, which lets every token gather information from the other tokens, followed "
    "by a small feed-forward network that works on each position on its own. Residual connections "
    "and normalization around both parts keep the signal stable as the stack grows deeper.",
    "Language models are trained to predict the next token of a text. During training the model "
    "reads millions of sentences, compares its guess for every next token with the real one, and "
    "nudges its weights a little to make the right answer more likely. After enough practice the "
    "guesses become good enough to write whole paragraphs, one token at a time.",
    "Tokens are the pieces a model reads and writes. A tokenizer splits text into frequent words "
    "and fragments of words, so that common words get a single token while rare words are spelled "
    "out from smaller parts. Byte-level tokenizers can encode any string, because in the worst "
    "case they fall back to single bytes.",
    "Multi-head attention runs several attention functions side by side. Each head has its own "
    "projections of the queries, keys and values, so one head may follow grammar while another "
    "tracks names or numbers. The outputs of the heads are joined and mixed by a final linear layer.",
    "Grouped-query attention saves memory at inference time. Several query heads share one key "
    "head and one value head, which makes the cache of past keys and values smaller without "
    "losing much quality. Many recent decoder models use this trick to serve long prompts quickly.",
    "Rotary position embeddings tell the model where each token sits in the sequence. Instead of "
    "adding a position vector to the input, they rotate the queries and keys by an angle that "
    "grows with the position, so the dot product between two tokens depends on how far apart "
    "they are.",
    "Greedy decoding always picks the most likely next token. It is simple and repeatable, which "
    "makes it useful for tests: the same weights and the same prompt give the same text every "
    "time. Sampling with a temperature gives more varied text, but the result changes from run "
    "to run.",
    "Running a model on new hardware often needs small changes to the code. Data types, attention "
    "kernels and memory limits differ from one device to the next, so a careful migration checks "
    "that the new setup still produces the same tokens as the reference before it measures speed.",
    "This tiny model was trained for a few minutes on a laptop processor. It has learned these "
    "paragraphs almost by heart and knows little else, so it is only good for demonstrations. "
    "Ask it about attention and it will happily repeat what it has read.",
]

# Model and training defaults (see --help). Chosen so the float32 checkpoint is about 4 MB.
MODEL_DIMS = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
VOCAB_SIZE = 768
BLOCK_SIZE = 128
STRIDE = 32
DEFAULT_STEPS = 200
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20
CHECK_TOKENS = 32


def build_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE trained on `corpus` (the same recipe as the test checkpoints' tokenizer)."""
    from agent.testing.tiny_checkpoint import train_bpe_tokenizer

    return train_bpe_tokenizer(corpus, vocab_size, model_max_length=MODEL_DIMS["max_position_embeddings"])


def make_windows(tokenizer, corpus: list[str], block_size: int, stride: int):
    """Sliding windows over each paragraph (+ eos), always including one at the paragraph start.

    Returns (input_ids, labels) tensors of shape [n, block_size]; padding is labelled -100.
    """
    import torch

    windows: list[list[int]] = []
    for text in corpus:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        starts = list(range(0, max(1, len(ids) - block_size + 1), stride))
        if starts[-1] + block_size < len(ids):
            starts.append(len(ids) - block_size)
        windows.extend(ids[s:s + block_size] for s in starts)
    input_ids = torch.full((len(windows), block_size), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(windows), block_size), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(windows), block_size), dtype=torch.long)
    for i, w in enumerate(windows):
        input_ids[i, :len(w)] = torch.tensor(w)
        labels[i, :len(w)] = torch.tensor(w)
        attention_mask[i, :len(w)] = 1
    return input_ids, attention_mask, labels


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def prompt_nll(model, tokenizer, prompt: str) -> dict:
    """Same measure as agent.measure.parity.prompt_nll: mean next-token cross-entropy vs ln(vocab)."""
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), enc["input_ids"][0, 1:]).item()
    return {"prompt_nll": round(nll, 4), "uniform_nll": round(math.log(logits.shape[-1]), 4)}


README_TEMPLATE = """\
# tiny-attention-llama (demo checkpoint)

A {params_m:.2f}M-parameter `LlamaForCausalLM` ({layers} layers, hidden size {hidden}, {heads} query
heads / {kv_heads} key-value heads, vocabulary {vocab}, {dtype} weights, {size_mb:.1f} MB) trained from
scratch on about {corpus_words} words of plain English about attention and transformers, which ship
inside `scripts/train_demo_model.py`. It exists so that `migrator demo` shows readable text: greedy
decoding of the project's default prompt (`engine.data.DEFAULT_PROMPT`) continues with

> {continuation} …

**This is a demo, not a useful model.** It has memorised its tiny corpus and knows nothing else;
do not use it for anything but smoke tests of the migration pipeline.

## How it was made

```
{command}
```

(seed {seed}, {steps} AdamW steps on sliding windows of at most {block_size} tokens,
{train_s:.0f} s on {threads} CPU thread(s), torch {torch_version}, transformers {tf_version},
tokenizers {tok_version}). The tokenizer is a byte-level BPE trained on the same corpus with the
`tokenizers` library; special tokens `<|pad|>` (0), `<|bos|>` (1), `<|eos|>` (2), `<|unk|>` (3).
Re-running the command with the same seed and library versions re-creates an equivalent model
(floating-point results may differ in the last bits across machines).

Final training loss {final_loss:.4f}; mean next-token cross-entropy of the default prompt
{prompt_nll:.3f} nats vs ln(vocab) = {uniform_nll:.3f} for uniform guessing.

## License

Apache-2.0, like the rest of infer-migrator. The training corpus is original text written for
this project, except that its first paragraph opens with the project's default prompt and the
sentence after it, a short quotation of the definition of attention in Vaswani et al.,
"Attention Is All You Need" (2017).
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "demo" / "tiny-attention-llama",
                        help="checkpoint folder to write (default: demo/tiny-attention-llama)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"AdamW steps (default {DEFAULT_STEPS})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help=f"peak learning rate (default {LEARNING_RATE})")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"window length (default {BLOCK_SIZE})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: the model is too small to gain from more, "
                             "and one thread keeps the float reductions in a fixed order)")
    parser.add_argument("--log-every", type=int, default=20, help="print a progress line every N steps")
    args = parser.parse_args(argv)

    import random

    import numpy as np
    import tokenizers
    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(max(1, args.threads))
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    t0 = time.monotonic()

    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(CORPUS, VOCAB_SIZE)
    input_ids, attention_mask, labels = make_windows(tokenizer, CORPUS, args.block_size, STRIDE)
    n_tokens = int(attention_mask.sum())
    print(f"corpus: {len(CORPUS)} paragraphs, {n_tokens} tokens in {len(input_ids)} windows; "
          f"vocab {len(tokenizer)}", flush=True)

    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         **MODEL_DIMS)
    model = LlamaForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: LlamaForCausalLM, {n_params / 1e6:.3f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < WARMUP_STEPS:
            return args.lr * (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, args.steps - WARMUP_STEPS)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    model.train()
    loss_value = initial_loss = float("nan")
    t_train = time.monotonic()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.item()
        if step == 0:
            initial_loss = loss_value
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step + 1:4d}/{args.steps}  loss {loss_value:.4f}  lr {lr_at(step):.2e}  "
                  f"{time.monotonic() - t_train:.1f}s", flush=True)
    train_s = time.monotonic() - t_train
    model.eval()

    continuation = greedy_continuation(model, tokenizer, DEFAULT_PROMPT, CHECK_TOKENS)
    check = check_output_text(continuation)
    nll = prompt_nll(model, tokenizer, DEFAULT_PROMPT)
    print(f"greedy continuation ({CHECK_TOKENS} tokens): {continuation!r}", flush=True)
    print(f"output check: ok={check['ok']} {check['reasons'] or ''}".rstrip(), flush=True)
    print(f"prompt NLL {nll['prompt_nll']:.4f} vs ln(vocab) {nll['uniform_nll']:.4f}", flush=True)

    tokenizer.save_pretrained(out)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=CHECK_TOKENS)
    model.save_pretrained(out, safe_serialization=True)
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6

    command = "python scripts/train_demo_model.py --output demo/tiny-attention-llama"
    if args.steps != DEFAULT_STEPS:
        command += f" --steps {args.steps}"
    if args.seed != 0:
        command += f" --seed {args.seed}"
    if args.lr != LEARNING_RATE:
        command += f" --lr {args.lr}"
    if args.block_size != BLOCK_SIZE:
        command += f" --block-size {args.block_size}"
    info = {
        "script": "scripts/train_demo_model.py", "command": command, "seed": args.seed,
        "steps": args.steps, "lr": args.lr, "block_size": args.block_size,
        "initial_loss": round(initial_loss, 6), "final_loss": round(loss_value, 6), "train_seconds": round(train_s, 1),
        "parameters": n_params, "prompt_nll": nll["prompt_nll"], "uniform_nll": nll["uniform_nll"],
        "greedy_continuation": continuation, "output_check_ok": check["ok"],
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(README_TEMPLATE.format(
        params_m=n_params / 1e6, layers=config.num_hidden_layers, hidden=config.hidden_size,
        heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, vocab=len(tokenizer),
        dtype="float32", size_mb=size_mb + 0.003, corpus_words=sum(len(p.split()) for p in CORPUS),
        continuation=continuation.strip(), command=command, seed=args.seed, steps=args.steps,
        block_size=args.block_size, train_s=train_s, threads=torch.get_num_threads(),
        torch_version=torch.__version__, tf_version=transformers.__version__,
        tok_version=tokenizers.__version__, final_loss=loss_value, prompt_nll=nll["prompt_nll"],
        uniform_nll=nll["uniform_nll"]))
    total_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    print(f"wrote {out} ({total_mb:.2f} MB) in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

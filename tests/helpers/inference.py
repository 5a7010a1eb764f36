"""Small decoders trained long enough to have opinions, and prompts for them, for the engine's
tests.

Greedy parity with HF ``generate`` means something only when the logits are not near-ties, which
random weights are full of: each model here is trained for 200 steps on the standard library's
own source as bytes (vocab 256, so ``ByteTokenizer`` reads its text). Training takes a few
seconds; the weights are saved once per test session and every rank loads the same file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

VOCAB, CONTEXT = 256, 256
TRAIN_STEPS = 200


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
            eos_token_id=0))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
            bos_token_id=0, eos_token_id=0))
    raise ValueError(kind)


def corpus() -> torch.Tensor:
    from kernels_runtime.data.corpus import stdlib_corpus

    return stdlib_corpus(400_000).long()


def train(kind: str, folder: Path) -> Path:
    """Train ``kind`` for ``TRAIN_STEPS`` steps and save its weights; the file's path."""
    path = folder / f"{kind}.pt"
    if path.exists():
        return path
    model = build(kind)
    tokens = corpus()[:300_000]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, tokens.numel() - 65, (16,), generator=g)
        rows = torch.stack([tokens[s:s + 65] for s in starts.tolist()])
        logits = model(input_ids=rows[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), path)
    return path


def load(kind: str, path: str | Path) -> nn.Module:
    model = build(kind)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


def prompts(lengths: tuple[int, ...], shared: int = 0) -> list[list[int]]:
    """Text from past the training range, one prompt per length; the first ``shared`` tokens
    of every prompt the same (a system prompt)."""
    text = corpus()[320_000:]
    head = text[:shared].tolist()
    out, at = [], 1000
    for n in lengths:
        out.append(head + text[at:at + n - shared].tolist())
        at += 3 * n + 7
    return out


def reference(model: nn.Module, prompt: list[int], new: int) -> tuple[list[int], list]:
    """HF ``generate``'s greedy tokens and each step's logits (fp32, one prompt at a time)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [row[0].float() for row in out.logits]


_REFERENCES: dict[tuple, list] = {}


def references(kind: str, path: str | Path, prompts: list[list[int]], new: int) -> list:
    """``reference`` of each prompt by the model at ``path``, computed once per test session
    (the parametrized cases of a file share them)."""
    key = (kind, str(path), tuple(map(tuple, prompts)), new)
    if key not in _REFERENCES:
        model = load(kind, path)
        _REFERENCES[key] = [reference(model, p, new) for p in prompts]
    return _REFERENCES[key]


def save_hf_folder(folder: Path, steps: int = TRAIN_STEPS) -> Path:
    """A ``save_pretrained`` folder as users bring one: a tiny GPT-2 trained for ``steps``
    steps with its own BPE tokenizer (trained here with ``tokenizers`` on standard-library
    text) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    if (folder / "config.json").exists():
        return folder
    text = bytes(corpus()[:300_000].tolist()).decode("utf-8", "replace")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)],
                            trainers.BpeTrainer(vocab_size=384, special_tokens=["<|end|>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    ids = torch.tensor(tokenizer.encode(text[:200_000]))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - 65, (16,), generator=g)
        rows = torch.stack([ids[s:s + 64] for s in starts.tolist()])
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

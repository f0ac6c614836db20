#!/usr/bin/env python3
"""Writes a tiny random-weight llama model for running a real llama.cpp server on a CPU.

Usage: python3 make_model.py OUT_DIR [--seed N]

Writes into OUT_DIR:
  model.gguf             a 2-layer llama (hidden 64, 4 heads, 2 KV heads, SwiGLU 128) with a
                         SentencePiece-style ("llama") vocabulary of 512 tokens with byte fallback
                         and a ChatML chat template; about 600 KB
  tokenizer.json         the same vocabulary as a Hugging Face tokenizer (BPE with byte fallback,
                         merges derived from the scores as transformers' LlamaConverter does), so
                         the `tokenizers` crate and llama.cpp cut any text into the same ids
  template.jinja         the ChatML template for kvroute's `[[models]] chat_template`
  tokenizer_config.json  the template with the bos/eos token strings (the other form kvroute reads)
  config.json            the model's shape as a Hugging Face llama config (what the reference's
                         `dynamo.mocker --model-path` reads)

Nothing is downloaded; the vocabulary is fixed (learned from a built-in text), the weights come from
numpy's seeded generator, and the output is byte-identical for a given seed.

The weights are random, so the text is gibberish, but two things are arranged: the output rows of
every control and byte token are zero, so generation (greedy or sampled) practically never ends
on its own (`</s>` / `<|im_end|>` have logit 0 while the best of the 246 normal tokens is far
above) and never emits a lone UTF-8 byte, so every generated token decodes to plain ASCII text.
"""

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("the `gguf` package is missing: pip install -r tests/python/requirements.txt")

# The shape of the model.
N_VOCAB = 512
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX_TRAIN = 32768

SPACE = "\u2581"  # SentencePiece's visible space
UNK, BOS, EOS, IM_START, IM_END = "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIALS = [UNK, BOS, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The text the merges are learned from: ordinary English plus the words kvroute's tests use, so
# that their prompts take a realistic 3 to 4 characters per token.
CORPUS = """
You are a careful assistant. You are a helpful assistant. Answer the question of the user in a
short and friendly way. The router sends each request to the worker that holds the longest prefix
of its prompt in the key value cache, so a conversation that returns finds its earlier turns
already computed. Tell me about caches and routing. How does the engine decide which slot serves
a request? The system prompt is shared by every conversation of a family; the turns of the user and
the answers of the assistant are what set one conversation apart from another. When a worker dies
in the middle of a stream, the request continues on another worker with the tokens generated so
far. Once upon a time there was a little model that could only say random words, and it was
happy anyway, because the tests did not care what it said, only how many tokens it said and where
it said them. This is a test of the tokenizer: numbers like 0 1 2 3 4 5 6 7 8 9 10 16 64 128 256,
and punctuation, commas, periods. conversation turn answer family question system user assistant
A language model reads a prompt, computes attention over every earlier position and writes one
token after another until it reaches the end of the answer or the limit on new tokens. Serving
many users at once means batching their requests together, keeping the memory of each request in
blocks, and evicting the least recently used blocks when the memory is full. The scheduler looks
at the load of every engine, the number of requests waiting in its queue and the blocks it would
have to compute again, then picks the cheapest one. Metrics show the hit rate, the time to the
first token, the latency between tokens and the load that is still active on each worker.
Streaming returns the text as it is produced; cancelling a stream should free the slot at once.
"""


def learn_merges(n_merges):
    """Byte-pair merges learned from CORPUS inside words (a merged piece may start with the
    visible space, never hold one inside), most frequent pair first, ties broken by the pair's
    text, so the result is fixed."""
    words = Counter()
    for line in CORPUS.split("\n"):
        for word in line.split(" "):
            if word:
                words[SPACE + word] += 1
    split = {w: list(w) for w in words}
    merges = []
    while len(merges) < n_merges:
        pairs = Counter()
        for w, n in words.items():
            s = split[w]
            for a, b in zip(s, s[1:]):
                if b != SPACE:
                    pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(a + b)
        for w in words:
            s = split[w]
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            split[w] = out
    return merges


def vocabulary():
    """The tokens with their SentencePiece scores and llama.cpp token types, in id order:
    5 control tokens, 256 byte tokens, the visible space and printable ASCII, then the learned
    pieces (score = -id: an earlier piece merges first)."""
    tokens, scores, types = [], [], []
    for t in SPECIALS:
        tokens.append(t)
        scores.append(0.0)
        types.append(gguf.TokenType.UNKNOWN if t == UNK else gguf.TokenType.CONTROL)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    chars = [SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    for c in chars:
        tokens.append(c)
    merges = learn_merges(N_VOCAB - len(tokens))
    tokens.extend(merges)
    assert len(tokens) == N_VOCAB, f"the corpus gave too few merges: {len(tokens)} tokens"
    assert len(set(tokens)) == len(tokens), "duplicate token"
    for i in range(len(scores), len(tokens)):
        scores.append(-float(i))
        types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types


def hf_tokenizer(tokens, types):
    """The vocabulary as a `tokenizer.json`: BPE over the whole text with byte fallback, spaces
    as the visible space, no space prefix (the GGUF says add_space_prefix = false), the control
    tokens as special added tokens, and merges ordered like transformers' SentencePiece
    extractor (by the merged piece's id, then the parts' ids)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, ty in zip(tokens, types) if ty == gguf.TokenType.NORMAL}
    merges = []
    for merged in tokens:
        if merged not in normal or len(merged) < 2:
            continue
        local = []
        for k in range(1, len(merged)):
            left, right = merged[:k], merged[k:]
            if left in normal and right in normal:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        merges.extend([left, right] for _, _, left, right in local)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab[t],
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t in SPECIALS
        ],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": UNK,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def weights(seed, tokens, types):
    """Every tensor, float32, numpy shape (rows = outputs), in the order llama.cpp lists them."""
    rng = np.random.default_rng(seed)
    head_dim = N_EMBD // N_HEAD

    def normal(*shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    out = {"token_embd.weight": normal(N_VOCAB, N_EMBD, std=1.0)}
    for i in range(N_LAYER):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        out[p + "attn_q.weight"] = normal(N_EMBD, N_EMBD, std=N_EMBD**-0.5)
        out[p + "attn_k.weight"] = normal(N_HEAD_KV * head_dim, N_EMBD, std=N_EMBD**-0.5)
        out[p + "attn_v.weight"] = normal(N_HEAD_KV * head_dim, N_EMBD, std=N_EMBD**-0.5)
        out[p + "attn_output.weight"] = normal(N_EMBD, N_EMBD, std=N_EMBD**-0.5)
        out[p + "ffn_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
        out[p + "ffn_gate.weight"] = normal(N_FF, N_EMBD, std=N_EMBD**-0.5)
        out[p + "ffn_up.weight"] = normal(N_FF, N_EMBD, std=N_EMBD**-0.5)
        out[p + "ffn_down.weight"] = normal(N_EMBD, N_FF, std=N_FF**-0.5)
    out["output_norm.weight"] = np.ones(N_EMBD, dtype=np.float32)
    # Logits with a standard deviation of about 8 for the normal tokens; 0 for the rest.
    output = normal(N_VOCAB, N_EMBD, std=1.0)
    for i, ty in enumerate(types):
        if ty != gguf.TokenType.NORMAL:
            output[i, :] = 0.0
    out["output.weight"] = output
    return out


def write_gguf(path, seed, tokens, scores, types):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"kvroute-tiny-random-seed{seed}")
    writer.add_vocab_size(N_VOCAB)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(tokens.index(UNK))
    writer.add_bos_token_id(tokens.index(BOS))
    writer.add_eos_token_id(tokens.index(IM_END))
    writer.add_eot_token_id(tokens.index(IM_END))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in weights(seed, tokens, types).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    tokens, scores, types = vocabulary()
    write_gguf(os.path.join(args.out_dir, "model.gguf"), args.seed, tokens, scores, types)
    with open(os.path.join(args.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(hf_tokenizer(tokens, types), f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(args.out_dir, "template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        config = {
            "chat_template": CHAT_TEMPLATE,
            "bos_token": BOS,
            "eos_token": IM_END,
            "unk_token": UNK,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": N_CTX_TRAIN,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        json.dump(config, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out_dir, "config.json"), "w", encoding="utf-8") as f:
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": N_VOCAB,
            "hidden_size": N_EMBD,
            "intermediate_size": N_FF,
            "num_hidden_layers": N_LAYER,
            "num_attention_heads": N_HEAD,
            "num_key_value_heads": N_HEAD_KV,
            "max_position_embeddings": N_CTX_TRAIN,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "bos_token_id": tokens.index(BOS),
            "eos_token_id": tokens.index(IM_END),
            "torch_dtype": "float32",
        }
        json.dump(config, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
